"""Tasks, the text corpus, the character transformer and the checks that keep model, data and task
compatible (no workers)."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.nn.functional as F

import pipeline.config as schema
from helpers import composed, problems
from pipeline.data import build_data
from pipeline.models import CharTransformer, build_model
from pipeline.tasks import TASKS, Classification, LanguageModel, Regression, build_task
from pipeline.text import CharCorpus, Vocabulary, load_corpus, split, stdlib_text, windows


# ---- tasks -------------------------------------------------------------------------------------
def test_regression_loss_is_the_mean_squared_error_and_sums_give_mse_and_mae() -> None:
    output = torch.tensor([[1.0], [2.0], [4.0]])
    target = torch.tensor([[0.0], [2.0], [1.0]])
    task = Regression()
    assert task.loss(output, target).item() == pytest.approx((1 + 0 + 9) / 3)
    sums = task.sums(output, target)
    assert sums == {"loss": pytest.approx(10.0), "mae": pytest.approx(4.0), "count": 3.0}


def test_regression_accepts_a_flat_target_for_one_output() -> None:
    output, target = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0])
    assert Regression().loss(output, target).item() == pytest.approx((1 + 4) / 2)


def test_language_model_loss_is_per_position_cross_entropy_and_bits_are_nats_over_ln2() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    task = LanguageModel()
    by_hand = torch.stack(
        [F.cross_entropy(logits[b, t : t + 1], target[b, t : t + 1]) for b in range(2) for t in range(5)]
    ).mean()
    assert task.loss(logits, target).item() == pytest.approx(by_hand.item(), rel=1e-6)
    sums = task.sums(logits, target)
    assert sums["count"] == 10.0
    assert sums["loss"] / sums["count"] == pytest.approx(by_hand.item(), rel=1e-6)
    assert sums["bits_per_char"] == pytest.approx(sums["loss"] / math.log(2))


def test_classification_sums() -> None:
    output = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    sums = Classification().sums(output, torch.tensor([0, 1, 1]))
    assert sums["accuracy"] == 2 and sums["count"] == 3.0
    assert sums["loss"] == pytest.approx(F.cross_entropy(output, torch.tensor([0, 1, 1]), reduction="sum").item())


@pytest.mark.parametrize("name", sorted(schema.TASK_SCHEMAS))
def test_each_task_reports_exactly_the_metrics_its_schema_declares(name: str) -> None:
    """The pre-flight checks trainer.objective against the schema's metrics (no torch there); the task
    must report exactly those."""
    task = build_task({"name": name})
    output, target = {
        "classification": (torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
        "regression": (torch.randn(4, 2), torch.randn(4, 2)),
        "language_model": (torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))),
    }[name]
    assert set(task.sums(output, target)) - {"loss", "count"} == set(schema.TASK_SCHEMAS[name].metrics)
    assert set(TASKS) == set(schema.TASK_SCHEMAS)


# ---- the corpus -----------------------------------------------------------------------------------
def test_corpus_is_one_megabyte_deterministic_and_read_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the corpus must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    first, second = load_corpus(), load_corpus()
    assert len(first.text) == 1_000_000
    assert first == second and first.sha256 == second.sha256
    assert "def " in first.text and "import " in first.text  # Python sources
    assert 60 <= first.vocab_size <= 200
    assert first.chars == "".join(sorted(set(first.text)))


def test_a_shorter_corpus_is_the_start_of_the_longer_one() -> None:
    assert stdlib_text(50_000) == stdlib_text(1_000_000)[:50_000]


def test_too_short_sources_are_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(RuntimeError, match="data.max_chars"):
        stdlib_text(1000, root=tmp_path)


def test_walk_skips_installed_packages_and_caches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for rel, text in (
        ("b.py", "B"),
        ("a/x.py", "AX"),
        ("site-packages/p.py", "P"),
        ("__pycache__/c.py", "C"),
        ("_sysconfigdata_x.py", "S"),
        ("a.py", "A"),
        ("a/z.txt", "Z"),
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert stdlib_text(4, root=tmp_path) == "AXAB"  # 'a' (folder) < 'a.py' < 'b.py'


def test_encode_decode_round_trip_and_unknown_characters() -> None:
    corpus = CharCorpus.from_text("hello world")
    ids = corpus.encode("low")
    assert ids.dtype == torch.long and corpus.decode(ids) == "low"
    with pytest.raises(ValueError, match="'z'"):
        corpus.encode("zoo")


def test_windows_are_inputs_and_the_next_characters() -> None:
    ids = torch.arange(20)
    data = windows(ids, block_size=4, stride=4)
    x, y = data.tensors
    assert x.shape == y.shape == (4, 4)  # starts 0, 4, 8, 12 (16 would need index 20)
    assert torch.equal(y, x + 1)
    assert x[1].tolist() == [4, 5, 6, 7]
    assert len(windows(ids, block_size=4, stride=1)) == 16


def test_validation_windows_come_from_text_never_trained_on() -> None:
    corpus = CharCorpus.from_text("".join(chr(ord("a") + i % 26) for i in range(1000)))
    train, val = split(corpus, block_size=8, stride=8, val_fraction=0.1)
    cut = 1000 - 100
    assert len(val) == (100 - 8 - 1) // 8 + 1
    last_train_index = (len(train) - 1) * 8 + 8  # the last target of the last training window
    assert last_train_index < cut


def test_vocabulary_in_a_checkpoint_refuses_another_corpus() -> None:
    saved = Vocabulary(CharCorpus.from_text("abc")).state_dict()
    Vocabulary(CharCorpus.from_text("abc")).load_state_dict(saved)
    with pytest.raises(ValueError, match="another corpus"):
        Vocabulary(CharCorpus.from_text("abd")).load_state_dict(saved)


def test_text_data_gives_windows_and_the_vocabulary_as_output_size() -> None:
    data = build_data({"name": "text", "block_size": 16, "max_chars": 20_000, "val_fraction": 0.1, "batch_size": 8})
    x, y = data.train.tensors
    assert data.input_shape == (16,) and x.shape[1] == 16 and x.dtype == torch.long
    assert data.output_size == load_corpus(20_000).vocab_size
    assert len(data.train) == (18_000 - 16 - 1) // 16 + 1


def test_regression_data_is_fixed_by_its_seed_and_real_valued() -> None:
    a = build_data({"name": "synthetic_regression", "num_samples": 64, "num_targets": 2, "seed": 3})
    b = build_data({"name": "synthetic_regression", "num_samples": 64, "num_targets": 2, "seed": 3})
    c = build_data({"name": "synthetic_regression", "num_samples": 64, "num_targets": 2, "seed": 4})
    assert torch.equal(a.train.tensors[1], b.train.tensors[1]) and not torch.equal(a.train.tensors[1], c.train.tensors[1])
    assert a.train.tensors[1].dtype == torch.float32 and a.output_size == 2 and a.input_shape == (16,)


# ---- the transformer ----------------------------------------------------------------------------
def test_transformer_maps_indices_to_logits_per_position() -> None:
    model = CharTransformer((16,), 11, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    out = model(torch.randint(0, 11, (3, 16)))
    assert out.shape == (3, 16, 11)
    assert model(torch.randint(0, 11, (3, 5))).shape == (3, 5, 11)  # shorter contexts too
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 11, (1, 17)))


def test_transformer_is_causal() -> None:
    """The output at position t does not depend on inputs after t (and does depend on those before)."""
    torch.manual_seed(0)
    model = CharTransformer((12,), 9, n_layer=2, n_head=2, n_embd=16, dropout=0.1).eval()
    x = torch.randint(0, 9, (2, 12))
    for t in (0, 5, 10):
        changed = x.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % 9
        assert torch.equal(model(x)[:, : t + 1], model(changed)[:, : t + 1]), t
    earlier = x.clone()
    earlier[:, 0] = (earlier[:, 0] + 1) % 9
    assert not torch.allclose(model(x)[:, 6], model(earlier)[:, 6])


def test_transformer_generates_from_its_vocabulary() -> None:
    model = CharTransformer((8,), 5, n_layer=1, n_head=1, n_embd=8).eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 23) and int(out.max()) < 5
    again = model.generate(torch.zeros(1, 3, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_builders_take_the_output_size() -> None:
    mlp = build_model({"name": "mlp", "hidden_sizes": [8]}, (16,), 3)
    assert mlp(torch.randn(2, 16)).shape == (2, 3)
    lm = build_model({"name": "transformer", "n_layer": 1, "n_head": 2, "n_embd": 8}, (10,), 7)
    assert lm(torch.zeros(2, 10, dtype=torch.long)).shape == (2, 10, 7)


# ---- configs and the pre-flight -----------------------------------------------------------------------
LM = ["task=language_model", "data=text", "model=transformer"]
REG = ["task=regression", "data=synthetic_regression"]


@pytest.mark.parametrize(
    "overrides",
    [
        LM,
        REG,
        [*LM, "trainer.objective=val_bits_per_char"],
        [*REG, "trainer.objective=val_mae"],
        ["+experiment=charlm_quick"],
        ["+experiment=charlm"],
        ["+experiment=regression_quick"],
    ],
)
def test_new_tasks_compose_and_pass_preflight(overrides: list[str]) -> None:
    assert problems(*overrides) == []


def test_accuracy_is_refused_as_objective_of_a_regression_naming_both_keys() -> None:
    found = problems(*REG, "trainer.objective=val_accuracy")
    assert len(found) == 1
    assert found[0].startswith("trainer.objective='val_accuracy' is not allowed: task=regression reports val_loss, val_mae")
    assert "task=classification only" in found[0]


def test_bits_per_char_is_refused_for_classification() -> None:
    assert any("trainer.objective='val_bits_per_char'" in p for p in problems("trainer.objective=val_bits_per_char"))


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["task=regression"],
            "task=regression needs data with real-valued targets, but data=digits gives class labels: choose data=synthetic_regression",
        ),
        (
            ["data=text", "task=language_model"],
            "model=mlp takes real-valued features, but data=text gives sequences of token indices: choose model=transformer",
        ),
        (
            ["model=transformer", "data=synthetic"],
            "model=transformer takes sequences of token indices, but data=synthetic gives real-valued features",
        ),
        (
            [*LM, "task=classification"],
            "task=classification needs data with class labels, but data=text gives next-token targets",
        ),
        ([*LM, "model.n_embd=30"], "model.n_embd=30 is not allowed: a multiple of model.n_head=4"),
        ([*LM, "data.block_size=0"], "data.block_size=0 is not allowed"),
    ],
)
def test_a_model_data_and_task_that_do_not_fit_are_refused(overrides: list[str], expected: str) -> None:
    found = problems(*overrides)
    assert any(p.startswith(expected) for p in found), found


def test_own_nodes_are_not_second_guessed() -> None:
    """A task of the user's own (task._target_, its own YAML option) may report any metric and take any data."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    cfg = composed("data=synthetic_regression", "trainer.objective=val_accuracy")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.task = {"_target_": "my.module.MyTask"}
    assert schema.preflight(cfg) == []


def test_unknown_keys_in_the_new_groups_fail_at_composition() -> None:
    from hydra.errors import ConfigCompositionException

    for override in ("data.blocksize=3", "model.layers=3", "task.weight=2"):
        with pytest.raises(ConfigCompositionException):
            problems(*LM, override)
