"""The checkpoint file format and the rules for what counts as a committed checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
import torch

from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import tensorfile
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.distributed.comm import Comm


class Box:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_roundtrip_of_real_training_state(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    tree = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "np": np.random.get_state(),
        "rng": torch.get_rng_state(),
        "py": random.getstate(),
        "empty": torch.empty(0, 3),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
    }
    size, digest = tensorfile.save(tree, tmp_path / "t.bin")
    back = tensorfile.load(tmp_path / "t.bin", size, digest)
    for key, value in model.state_dict().items():
        assert torch.equal(back["model"][key], value)
    assert back["opt"]["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.999)
    np.random.set_state(back["np"])
    random.setstate(back["py"])
    for t in (back["rng"], back["model"]["0.weight"]):  # no view into one big storage: its own bytes only
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    torch.set_rng_state(back["rng"])  # (crashed on a tensor with a storage offset)
    assert back["empty"].shape == (0, 3) and back["bf16"].dtype == torch.bfloat16


def test_pickle_payload_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(marker), "w"))

    path = tmp_path / "model.bin"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(tensorfile.TensorFileError, match="not a steadfast tensor file"):
        tensorfile.load(path)
    torch.save({"x": Payload()}, tmp_path / "torch.bin")
    with pytest.raises(tensorfile.TensorFileError):
        tensorfile.load(tmp_path / "torch.bin")
    assert not marker.exists()


def test_damage_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    size, digest = tensorfile.save({"w": torch.arange(1000.0)}, path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(tensorfile.TensorFileError, match="checksum mismatch"):
        tensorfile.load(path, size, digest)
    path.write_bytes(bytes(data[: size // 2]))
    with pytest.raises(tensorfile.TensorFileError, match="size"):
        tensorfile.load(path, size, digest)
    with pytest.raises(tensorfile.TensorFileError):
        tensorfile.load(path)  # even without a manifest, a truncated file does not parse


def test_committed_lists_by_commit_sequence_and_ignores_partial_folders(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=10)
    for step in (100, 9, 10):  # committed in this order: 10 is the newest, whatever the step numbers say
        m.save(step, {"model": Box({"w": torch.ones(1)})}, {}, {})
    m.close()
    (tmp_path / mf.step_dir_name(1000)).mkdir()  # no manifest: not committed
    (tmp_path / f"{mf.TMP_PREFIX}step_000002000-abc").mkdir()
    (tmp_path / "step_5").mkdir()
    assert [s for s, _ in mf.committed(tmp_path)] == [10, 9, 100]
    assert [mf.read(p)["commit"] for _, p in mf.committed(tmp_path)] == [3, 2, 1]
    assert mf.newest_manifest(tmp_path)["step"] == 10


def test_training_config_changes_separate_safe_keys() -> None:
    old = mf.training_config(
        {"trainer": {"lr": 0.1, "max_epochs": 5}, "model": {"hidden": [4]}, "checkpoint": {"keep_last": 2}},
        ["trainer.max_epochs"],
    )
    new = mf.training_config(
        {"trainer": {"lr": 0.2, "max_epochs": 50}, "model": {"hidden": [4]}, "checkpoint": {"keep_last": 9}},
        ["trainer.max_epochs"],
    )
    assert mf.changes(old, new) == [("trainer.lr", 0.1, 0.2)]


def manager(folder: Path, keep_last: int = 2, config: dict | None = None, async_save: bool = False) -> CheckpointManager:
    return CheckpointManager(folder, Comm(), keep_last, config or {"a": 1}, lambda *a, **k: None, async_save=async_save)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_commit_retention_and_restore(tmp_path: Path, async_save: bool) -> None:
    m = manager(tmp_path, keep_last=2, async_save=async_save)
    w = Box({"w": torch.zeros(3)})
    for step in (1, 2, 3):
        w.state["w"] = torch.full((3,), float(step))
        m.save(step, {"model": w}, {"rng": Box({"seed": step})}, {"epoch": step})
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [3, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((mf.TMP_PREFIX, mf.TRASH_PREFIX))]
    fresh, rng = Box({}), Box({})
    restored = manager(tmp_path).restore({"model": fresh}, {"rng": rng}, allow_config_change=False)
    assert restored is not None and restored.step == 3
    assert fresh.state["w"].tolist() == [3.0, 3.0, 3.0] and rng.state == {"seed": 3}


class OwnStateDict(torch.nn.Linear):
    """A module whose class defines state_dict() without torch's keyword arguments."""

    def state_dict(self) -> dict:  # type: ignore[override]
        return {"w": self.weight.detach().clone(), "note": "mine"}

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        with torch.no_grad():
            self.weight.copy_(state["w"])


@pytest.mark.parametrize("async_save", [False, True])
def test_modules_are_saved_as_their_values_whatever_their_state_dict(tmp_path: Path, async_save: bool) -> None:
    """A module's state is read with its tensors themselves (keep_vars), a module of its own
    state_dict() as it defines it; either way the checkpoint holds the values at the save's step,
    also when the optimizer changes the parameters right after an asynchronous save returns."""
    torch.manual_seed(0)
    model, own = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), OwnStateDict(2, 2)
    opt = torch.optim.Adam([*model.parameters(), *own.parameters()], lr=0.1)

    def step() -> None:
        opt.zero_grad()
        (model(torch.randn(5, 4)).square().sum() + own(torch.randn(3, 2)).sum()).backward()
        opt.step()

    step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    own_expected = own.weight.detach().clone()
    m = manager(tmp_path, async_save=async_save)
    m.save(1, {"model": model, "own": own, "optimizer": opt}, {}, {})
    step()  # waits for the deferred copy of the optimizer's tensors, then changes them in place
    m.close()
    fresh, fresh_own = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), OwnStateDict(2, 2)
    fresh_opt = torch.optim.Adam([*fresh.parameters(), *fresh_own.parameters()], lr=0.1)
    assert manager(tmp_path).restore({"model": fresh, "own": fresh_own, "optimizer": fresh_opt}, {}, False).step == 1
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(fresh_own.weight, own_expected)
    assert not any(v.requires_grad for v in fresh.state_dict(keep_vars=False).values())
    assert all(p.requires_grad for p in fresh.parameters())  # loaded into, not replaced


def test_corrupt_newest_falls_back_to_the_previous(tmp_path: Path) -> None:
    m = manager(tmp_path)
    for step in (1, 2):
        m.save(step, {"model": Box({"w": torch.full((4,), float(step))})}, {}, {})
    newest = tmp_path / mf.step_dir_name(2) / "state.bin"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 1
    newest.write_bytes(bytes(data))
    fresh = Box({})
    assert manager(tmp_path).restore({"model": fresh}, {}, False).step == 1
    assert fresh.state["w"].tolist() == [1.0] * 4


def test_incompatible_config_is_refused_with_the_changed_keys(tmp_path: Path) -> None:
    manager(tmp_path, config={"trainer.lr": 0.1}).save(1, {"model": Box({"w": torch.ones(1)})}, {}, {})
    with pytest.raises(CheckpointError, match=r"trainer.lr: 0.1 -> 0.2"):
        manager(tmp_path, config={"trainer.lr": 0.2}).restore({"model": Box({})}, {}, allow_config_change=False)
    assert manager(tmp_path, config={"trainer.lr": 0.2}).restore({"model": Box({})}, {}, allow_config_change=True).step == 1


def test_manifest_lists_sizes_and_checksums(tmp_path: Path) -> None:
    manager(tmp_path).save(7, {"model": Box({"w": torch.ones(10)})}, {"rng": Box({"s": 1})}, {"epoch": 1, "batch_in_epoch": 3})
    man = json.loads((tmp_path / mf.step_dir_name(7) / mf.MANIFEST).read_text())
    assert man["format"] == mf.FORMAT and man["step"] == 7 and man["batch_in_epoch"] == 3 and man["world_size"] == 1
    assert set(man["files"]) == {"state.bin"}
    for name, spec in man["files"].items():
        assert (tmp_path / mf.step_dir_name(7) / name).stat().st_size == spec["bytes"] and spec["checksum"].startswith(
            "xxh3_128:"
        )


def test_views_conjugates_and_negative_views_are_written_as_their_values(tmp_path: Path) -> None:
    x = torch.randn(8, 5)
    z = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    tree = {"transposed": x.t(), "strided": x[::2, 1:], "conj": z.conj(), "neg_view": z.conj().imag}
    back = tensorfile.load(tmp_path / "t.bin", *tensorfile.save(tree, tmp_path / "t.bin"))
    for key, value in tree.items():
        assert torch.equal(back[key], value.resolve_conj().resolve_neg()), key


def _state(step: int) -> dict:
    return {"model": Box({"w": torch.full((100,), float(step))})}


def test_the_files_manifest_and_folder_are_durable_before_the_rename_and_the_rename_before_retention(
    tmp_path: Path, monkeypatch
) -> None:
    m = manager(tmp_path, keep_last=1)
    m.save(1, _state(1), {}, {})
    m.wait()
    log: List[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        log.append(f"fsync {'folder' if target == tmp_path else target.name if target.is_file() else 'tmp'}")

    def rename(src: Any, dst: Any) -> None:
        real_rename(src, dst)
        log.append(f"rename {Path(dst).name[:6]}")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    m.save(2, _state(2), {}, {})
    m.wait()
    commit = log.index("rename step_0")
    assert sorted(log[:commit]) == ["fsync manifest.json", "fsync state.bin", "fsync tmp"]  # side by side, any order
    assert log[commit + 1 :] == ["fsync folder", "rename .trash"]  # the rename durable, then the old one removed


def test_a_failed_fsync_fails_the_save_and_keeps_the_previous(tmp_path: Path, monkeypatch) -> None:
    m = manager(tmp_path, keep_last=1)
    m.save(1, _state(1), {}, {})
    m.wait()
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(mf.MANIFEST):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(CheckpointError, match="Input/output error.*step_000000001"):
        m.save(2, _state(2), {}, {})
    assert [s for s, _ in mf.committed(tmp_path)] == [1]
    assert [p.name for p in tmp_path.iterdir()] == [mf.step_dir_name(1)]  # no temporary folder left


def test_small_tensors_gathered_into_one_copy_are_the_bytes_the_file_holds(tmp_path: Path) -> None:
    """What a run of small device tensors becomes (one gather, one copy to the host; on any device)."""
    from steadfast.checkpoint import tensorwrite

    x = torch.randn(6, 5)
    z = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    tree = {"t": x.t(), "flags": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5), "conj": z.conj(), "h": x.half()}
    layout = tensorfile.plan(tree)
    data = bytes(tensorwrite.gathered([e for e in layout.entries if e.end > e.begin]).numpy())
    size, _ = tensorfile.save(tree, tmp_path / "t.bin")
    assert data == (tmp_path / "t.bin").read_bytes()[size - layout.data_bytes :]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_on_the_gpu_is_saved_as_its_values(tmp_path: Path, async_save: bool) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(20)], torch.nn.BatchNorm1d(16)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
    big = {"w": torch.randn(1 << 19, device="cuda"), "t": torch.randn(64, 32, device="cuda").t()}
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    m = manager(tmp_path, async_save=async_save)
    m.save(1, {"model": model, "optimizer": opt, "big": Box(big)}, {}, {})
    m.close()
    saved_model, saved_big = Box({}), Box({})
    assert manager(tmp_path).restore({"model": saved_model, "optimizer": Box({}), "big": saved_big}, {}, False).step == 1
    assert all(torch.equal(saved_model.state[k], v) for k, v in expected.items())
    assert all(torch.equal(saved_big.state[k], v.cpu()) for k, v in big.items())


class _OneOfTwo(Comm):
    """Rank `rank` of two in one process: the peer's own state is gathered; every collective counted."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls = rank, []  # type: ignore[misc]

    def gather_object(self, obj: Any) -> Any:
        self.calls.append("gather_object")
        return [obj, {"rng": {"seed": 99}}] if self.rank == 0 else None

    def broadcast_object(self, obj: Any) -> Any:
        self.calls.append("broadcast_object")
        return obj


@pytest.mark.parametrize("async_save", [False, True])
def test_a_replicated_save_is_rank_0_s_alone_after_the_plan_s_gather(tmp_path: Path, async_save: bool) -> None:
    # the one save path: the replicated format's plan gives rank 0 every file and the others none, so
    # the save costs the plan's gather and nothing more: no staged name, report or outcome exchanged
    # (rank 1 gone on at once), and an asynchronous one commits in the background, not at a step boundary
    zero, one = _OneOfTwo(0), _OneOfTwo(1)
    for comm in (one, zero):
        m = CheckpointManager(tmp_path, comm, 2, {"a": 1}, lambda *a, **k: None, async_save=async_save)
        m.save(5, {"model": Box({"w": torch.arange(4.0)})}, {"rng": Box({"seed": comm.rank})}, {"epoch": 0})
        assert m.written_step() is None and not m.busy()  # nothing left for a step boundary to commit
        if comm is one:
            assert not mf.committed(tmp_path) and not list(tmp_path.iterdir())  # rank 1 stages and writes nothing
        m.close()
    assert zero.calls == one.calls == ["gather_object"]
    assert [s for s, _ in mf.committed(tmp_path)] == [5]
    fresh, rng = Box({}), Box({})
    restored = manager(tmp_path).restore({"model": fresh}, {"rng": rng}, allow_config_change=False, new_rank=lambda step: None)
    assert restored is not None and fresh.state["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and rng.state == {"seed": 0}


def test_an_async_save_defers_by_memory_only_what_is_worth_the_proof() -> None:
    """Staging: a tensor that is not an optimizer's own by identity is deferred when it shares the
    memory of one (a detached view) and is large enough to repay reading every owned tensor's address;
    a small one (an RNG's state beside thousands of parameters) is copied before save() returns."""
    from steadfast.checkpoint.staging import KEY_WORTH_BYTES, optimizer_owned
    from steadfast.checkpoint.tensorwrite import Entry

    small, big = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2 * KEY_WORTH_BYTES // 4))
    opt = torch.optim.SGD([small, big], lr=0.1)

    def entries(*tensors: torch.Tensor) -> List[Entry]:
        out, at = [], 0
        for i, t in enumerate(tensors):
            out.append(Entry(f"t{i}", "F32", tuple(t.shape), at, at + t.nbytes, t, i))
            at += t.nbytes
        return out

    _, owned = optimizer_owned([opt])
    rng = torch.zeros(8, dtype=torch.uint8)
    now, later = owned.split(entries(small, big, rng, small.detach()))
    assert [e.name for e in later] == ["t0", "t1"] and [e.name for e in now] == ["t2", "t3"]  # the view: copied now
    now, later = owned.split(entries(small, rng, big.detach()))
    assert [e.name for e in later] == ["t0", "t2"] and [e.name for e in now] == ["t1"]  # the big view: by its memory
