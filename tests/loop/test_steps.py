"""Loops of steps (`run.steps`), in one process: the progress line, the report and summary.json in
steps; the step-loop sources (`run.random_batches`, `run.stream`) and torchdata's StatefulDataLoader
resumed from a real checkpoint at the batch the interrupted run would have trained next, a batch
fetched ahead of the step included; run.accumulate without run.loader.

Each resume here is a real one: one Run trains to a checkpoint and fails (an exception leaves its
`with` block: nothing more is committed), a second Run in the same folder resumes from it and
finishes; what each step trained on must be what an uninterrupted Run trained on.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from helpers import ROOT
from steadfast.checkpoint.state import Progress
from steadfast.contract import files, summary
from steadfast.contract.env import TORCH, LaunchEnv
from steadfast.loop.streams import Sources, StreamError, stream_seed
from steadfast.report.records import summary_from
from steadfast.report.text import _position
from steadfast.run import Run
from steadfast.telemetry._progress import ProgressDisplay


# ---- what a person sees ----------------------------------------------------------------------------------
def test_the_progress_line_of_a_loop_of_steps_has_no_epoch_and_no_negative_eta() -> None:
    steps = ProgressDisplay("lines", 10.0, 500, 0)
    assert steps.text(153, 0).startswith("step 153/500 (31%) | loss - | ")
    unknown = ProgressDisplay("lines", 10.0, 0, 0)  # no bound given (a loop that calls neither run.epochs nor run.steps)
    text = unknown.text(153, 0)
    assert text.startswith("step 153 | ") and text.endswith("ETA ?") and "epoch" not in text and "/0" not in text
    unknown._rate = 10.0
    assert unknown.text(153, 0).endswith("ETA ?")  # not -1:59:40
    assert ProgressDisplay("lines", 10.0, 300, 3).text(110, 1).startswith("epoch 2/3 | step 110/300 (37%)")


def test_the_report_counts_a_loop_of_steps_in_steps() -> None:
    s, bad = summary_from({"max_steps": 500, "global_step": 500, "final_loss": 1.25})
    assert not bad and _position(s) == "steps 500/500, train loss (last logged window) 1.2500"
    s, _ = summary_from({"epochs_completed": 3, "global_step": 96, "final_loss": 0.5})
    assert _position(s) == "epochs 3, steps 96, train loss (last epoch) 0.5000"
    s, _ = summary_from({"global_step": 96, "final_loss": 0.5})  # a loop that gave no bound
    assert _position(s) == "steps 96, train loss (last logged window) 0.5000"
    assert _position(summary_from({})[0]) == "epochs -, steps -, train loss (last epoch) -"  # a failure before any record


# ---- the sources' accounting, alone ---------------------------------------------------------------------
def _sources(per_step: int = 1, resumed: bool = True) -> Tuple[Progress, Sources]:
    progress = Progress()
    sources = Sources(progress, seed=7, rank=0, per_step=per_step)
    sources.resumed = resumed
    return progress, sources


def _numbered(generator: torch.Generator) -> int:
    return int(torch.randint(10**9, (1,), generator=generator))


def test_a_checkpoint_records_the_batches_the_steps_took_not_those_fetched_ahead() -> None:
    progress, sources = _sources(per_step=2)
    batches = sources.random(_numbered, (), {}, None)
    stream = [next(batches)]  # fetched ahead of the loop
    for step in range(1, 4):
        stream += [next(batches), next(batches)]  # the step trains on 2, fetches the next one ahead
        progress.global_step = step
        sources.stepped(step)
    assert progress.streams == [6] and batches.ahead == 1
    # a resume from here: the source starts at batch 6, the one the interrupted run had fetched ahead
    again, resumed = _sources(per_step=2)
    again.load_state_dict(progress.state_dict())
    assert next(resumed.random(_numbered, (), {}, None)) == stream[6]
    # another rank: a stream of its own (and another source, or another seed)
    other = Sources(again, 7, 1, 2)
    other.resumed = True
    assert next(other.random(_numbered, (), {}, None)) != stream[6]
    assert len({stream_seed(7, 0, 0, 6), stream_seed(7, 1, 0, 6), stream_seed(8, 0, 0, 6), stream_seed(7, 0, 1, 6)}) == 4


def test_a_step_that_draws_more_than_it_declares_is_refused_at_once() -> None:
    progress, sources = _sources(per_step=1)
    batches = sources.random(_numbered, (), {}, None)
    next(batches)
    for step in (1, 2):
        next(batches)
        sources.stepped(step)
    next(batches)
    next(batches)  # an evaluation drawing from the training stream
    with pytest.raises(StreamError, match=r"at step 3 the loop had drawn \+2 batch\(es\) beyond the 1 a step takes"):
        sources.stepped(3)
    _, early = _sources(resumed=False)
    with pytest.raises(StreamError, match=r"drawn before run.resume"):
        next(early.random(_numbered, (), {}, None))
    with pytest.raises(ValueError, match=r"per_step=0: the number of batches"):
        early.random(_numbered, (), {}, 0)
    with pytest.raises(TypeError, match=r"not an iterator"):
        early.iterable(iter([1, 2]), None)


def test_an_iterable_stream_skips_whole_passes_by_len_and_refuses_a_len_that_lies() -> None:
    def stream(position: int, iterable: Any) -> Any:
        progress, sources = _sources()
        progress.streams = [position]
        return sources.iterable(iterable, None)

    shuffled = DataLoader(torch.arange(10), batch_size=3, shuffle=True)  # 4 batches a pass, each pass its own order
    whole = stream(0, shuffled)
    seen = [next(whole).tolist() for _ in range(14)]
    assert sorted(sum(seen[4:8], [])) == list(range(10)) and seen[4:8] != seen[:4]  # pass 1: all of it, another order
    assert [next(stream(9, shuffled)).tolist() for _ in range(1)] == [seen[9]]  # skips passes 0 and 1 by len()
    resumed = stream(9, shuffled)
    assert [next(resumed).tolist() for _ in range(5)] == seen[9:14]

    class Lying(IterableDataset):
        def __len__(self) -> int:
            return 20

        def __iter__(self) -> Iterator[int]:
            return iter(range(7))

    lying = stream(0, DataLoader(Lying(), batch_size=2))
    with pytest.raises(StreamError, match=r"pass 0 of the iterable gave 4 batch\(es\), len\(\) says 10"):
        for _ in range(5):
            next(lying)


def test_progress_without_sources_saves_what_it_always_saved_and_refuses_bad_positions() -> None:
    assert "streams" not in Progress().state_dict()
    with pytest.raises(ValueError, match="progress 'streams'"):
        Progress().load_state_dict({"streams": [1, -1]})


# ---- a real checkpoint and a real resume, one rank in this process ----------------------------------------
@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """The environment a one-rank torchrun launch gives its worker; calling it moves to a new port
    (each Run initialises the collectives afresh)."""
    folder = tmp_path / "run"
    folder.mkdir()
    env = LaunchEnv(backend="torchrun", collective=TORCH, run_dir=folder, collective_timeout_s=60).to_environ()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def new_port() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))

    threads = torch.get_num_threads()
    new_port()
    yield new_port
    torch.set_num_threads(threads)


CFG: Dict[str, Any] = {
    "logger": {"progress": "none"},
    "checkpoint": {"every_n_epochs": None, "every_n_steps": 4},
    "snapshot": {"every_n_steps": 0},
}
STEPS, FAIL_AFTER = 10, 6  # the failed attempt's last checkpoint: step 4


class Crash(Exception):
    pass


Loop = Callable[[Run, nn.Module, torch.optim.Optimizer, List[Any]], None]


def _train(new_port: Callable[[], None], loop: Loop, fail: bool, accumulate: int = 1) -> Tuple[List[Any], Dict[str, Any]]:
    """One Run of `loop` (the model, its optimizer and the list of what each step trained on given);
    `fail`: raise after step FAIL_AFTER (the checkpoint of step 4 is the newest)."""
    new_port()
    trained: List[Any] = []
    result: Dict[str, Any] = {}
    try:
        with Run(CFG, seed=3, num_threads=1, accumulate_grad_batches=accumulate) as run:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = run.setup(model, optimizer)

            def step_done(step: int) -> None:
                if fail and step == FAIL_AFTER:
                    raise Crash

            run.step_done = step_done  # type: ignore[attr-defined]
            loop(run, model, optimizer, trained)
            result = run.finish()
    except Crash:
        pass
    return trained, result


def _fit(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    loss = model(x.float().reshape(-1, 4) / 1000).pow(2).mean()  # tokens to [0, 1): a loss that stays finite
    loss.backward()
    optimizer.step()
    run.step(loss)
    run.step_done(run.global_step)  # type: ignore[attr-defined]


def _resumes_exactly(launched: Callable[[], None], loop: Loop, accumulate: int = 1) -> List[Any]:
    whole, done = _train(launched, loop, fail=False, accumulate=accumulate)
    _empty_run_folder()  # the same folder, empty again, for the interrupted run
    first, _ = _train(launched, loop, fail=True, accumulate=accumulate)
    assert len(first) == FAIL_AFTER
    rest, resumed = _train(launched, loop, fail=False, accumulate=accumulate)
    assert resumed["resumed_from_step"] == 4 and resumed["global_step"] == STEPS
    assert [torch.equal(a, b) for a, b in zip(first[:4] + rest, whole)] == [True] * STEPS
    assert resumed["model_sha256"] == done["model_sha256"]
    return whole


def _empty_run_folder() -> None:
    for junk in Path(LaunchEnv.current().run_dir).iterdir():
        shutil.rmtree(junk) if junk.is_dir() else junk.unlink()


def _tokens(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) * 7 % 1000


def get_batch(data: torch.Tensor, generator: Any = None) -> torch.Tensor:
    """nanoGPT's get_batch, its draw given a generator."""
    ix = torch.randint(len(data) - 4, (2,), generator=generator)
    return torch.stack([data[i : i + 4] for i in ix])


def test_random_batches_fetched_ahead_resume_exactly(launched: Callable[[], None]) -> None:
    data = _tokens(400)

    def loop(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, trained: List[Any]) -> None:
        batches = run.random_batches(get_batch, data)
        run.resume(model=model, optimizer=optimizer)
        x = next(batches)  # fetched ahead of the loop, as nanoGPT does
        for _ in run.steps(STEPS):
            trained.append(x)
            now, x = x, next(batches)  # the next batch fetched before this step's backward
            _fit(run, model, optimizer, now)

    whole = _resumes_exactly(launched, loop)
    assert len({tuple(b.flatten().tolist()) for b in whole}) == STEPS  # random batches, all different


def test_random_batches_with_accumulation_resume_exactly(launched: Callable[[], None]) -> None:
    data = _tokens(400)

    def loop(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, trained: List[Any]) -> None:
        batches = run.random_batches(get_batch, data)  # per_step: accumulate_grad_batches
        run.resume(model=model, optimizer=optimizer)
        x = next(batches)
        for _ in run.steps(STEPS):
            step = []
            for _micro in range(3):
                with run.accumulate(model):
                    step.append(x)
                    (model(x.float() / 1000).pow(2).mean() / 3).backward()  # a loss that stays finite
                    x = next(batches)
            assert run.sync_gradients
            trained.append(torch.stack(step))
            optimizer.step()
            optimizer.zero_grad()
            run.step()
            run.step_done(run.global_step)  # type: ignore[attr-defined]

    _resumes_exactly(launched, loop, accumulate=3)


class Windows(IterableDataset):
    """Consecutive windows of a token array (an IterableDataset: no index, no length)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        shift = self.epoch  # each pass starts one token later: a pass's order depends on its number only
        for i in range(shift, len(self.data) - 4, 4):
            yield self.data[i : i + 4]


def test_an_iterable_dataset_fetched_ahead_resumes_exactly_across_passes(launched: Callable[[], None]) -> None:
    # 7 windows, 4 batches of 2 a pass (the last one short): the batch fetched ahead at the checkpoint
    # (step 4) is the first of pass 1, and the run goes on into pass 2
    data = _tokens(30)

    def loop(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, trained: List[Any]) -> None:
        batches = run.stream(DataLoader(Windows(data), batch_size=2))
        run.resume(model=model, optimizer=optimizer)
        x = next(batches)
        for _ in run.steps(STEPS):
            trained.append(x)
            now, x = x, next(batches)
            _fit(run, model, optimizer, now)

    whole = _resumes_exactly(launched, loop)
    assert [int(whole[i][0, 0]) for i in (0, 4, 8)] == [int(data[0]), int(data[1]), int(data[2])]  # set_epoch per pass


def test_a_stateful_dataloader_resumes_at_its_position(launched: Callable[[], None]) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed: pip install torchdata")
    data = _tokens(400).reshape(-1, 4)

    def loop(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, trained: List[Any]) -> None:
        loader = stateful.StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
        run.resume(model=model, optimizer=optimizer, loader=loader)  # per rank: a DataLoader's position is its own
        batches = iter(loader)
        for _ in run.steps(STEPS):
            x = next(batches)  # no batch fetched ahead: the loader's state is what it handed out
            trained.append(x)
            _fit(run, model, optimizer, x)

    _resumes_exactly(launched, loop)


def test_a_loop_of_steps_records_steps_and_refuses_an_iteration_without_a_step(
    launched: Callable[[], None], tmp_path: Path
) -> None:
    with Run(CFG, num_threads=1) as run:
        model = run.setup(nn.Linear(4, 1))
        run.resume(model=model)
        for _ in run.steps(12):
            run.step(F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
        with pytest.raises(RuntimeError, match=r"run.steps: the iteration of step 13 ended without run.step\(\)"):
            for _ in run.steps(13):
                pass
        result = run.finish()
    assert result["max_steps"] == 13 and "epochs_completed" not in result and result["final_loss"] is not None
    rows = files.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows and all("epoch" not in r for r in rows if "loss" in r)
    assert summary.read(tmp_path / "run") == {}  # the launcher writes summary.json; the result is in events


def _accumulation_snippets() -> List[str]:
    """The python blocks of docs/sharded.md's "Gradient accumulation" section."""
    import re

    text = (ROOT / "docs" / "sharded.md").read_text()
    section = text.split("## Gradient accumulation", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, re.M | re.S)


def test_the_accumulation_snippets_in_the_docs_run(launched: Callable[[], None]) -> None:
    """docs/sharded.md's two loops, run as written (their `...` is the setup a loop has): every name
    bound, 4 batches a step with run.loader and with run.steps."""
    import textwrap

    import steadfast as sf

    with_loader, with_steps = _accumulation_snippets()
    setup = (
        "model = run.setup(nn.Linear(4, 1))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loss_fn = F.mse_loss\n"
        "loader = run.loader(TensorDataset(torch.ones(32, 4), torch.zeros(32, 1)), batch_size=2)\n"
        "batches = run.random_batches(lambda generator: (torch.rand(2, 4, generator=generator), torch.zeros(2, 1)))\n"
        "run.resume(model=model, optimizer=optimizer)\n"
    )
    first = with_loader.replace("    ...\n", textwrap.indent(setup, "    "))
    from omegaconf import OmegaConf

    names: Dict[str, Any] = {"sf": sf, "cfg": OmegaConf.create({**CFG, "max_steps": 3}), "nn": nn, "torch": torch, "F": F}
    names["TensorDataset"] = torch.utils.data.TensorDataset
    exec(compile(first, "docs/sharded.md", "exec"), names)  # noqa: S102  (the documents' own code)
    assert names["run"].global_step == 32 // 2 // 4  # 16 batches on this rank, 4 a step
    launched()
    _empty_run_folder()
    second = "with sf.Run(cfg, accumulate_grad_batches=4) as run:\n" + textwrap.indent(setup, "    ") + with_steps
    exec(compile(second, "docs/sharded.md", "exec"), names)  # noqa: S102
    assert names["run"].global_step == 3 and names["run"].data.sources.all[0].taken == 12
