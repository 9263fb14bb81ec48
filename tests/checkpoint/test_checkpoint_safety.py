"""Checkpoints never lose work: whole writes, read-back before retention, commit order, set-aside.

Real files and real CheckpointManagers throughout; the only stand-ins are a write primitive that
moves fewer bytes per call (what a full disk or a signal does) and a file-size limit set with
setrlimit in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from helpers import Box, Recorder, manager, model_state
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import tensorfile
from steadfast.checkpoint.manager import CheckpointError, verify_checkpoint
from steadfast.checkpoint.replicated import STATE_FILE as STATE
from steadfast.checkpoint.storage import fileio
from steadfast.contract.events import Event


def set_aside(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(mf.SET_ASIDE_PREFIX))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- 1. every byte written, or a loud failure --------------------------------------------------
FSIZE_CHILD = r"""
import json, resource, signal, sys
from pathlib import Path
import torch
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.distributed.comm import Comm

class Box:
    def __init__(self, state): self.state = state
    def state_dict(self): return self.state
    def load_state_dict(self, state): self.state = state

m = CheckpointManager(Path(sys.argv[1]), Comm(), 1, {"a": 1}, lambda *a, **k: None)
m.save(1, {"model": Box({"w": torch.ones(16)})}, {}, {})
m.wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    m.save(2, {"model": Box({"w": torch.arange(4096.0)})}, {}, {})  # 16 KiB: over the limit
    m.wait()
    print(json.dumps({"raised": None}))
except CheckpointError as exc:
    print(json.dumps({"raised": str(exc)}))
"""


def test_a_file_size_limit_makes_the_save_fail_loudly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    raised = json.loads(proc.stdout.strip().splitlines()[-1])["raised"]
    assert raised and "step 2" in raised and "step_000000001" in raised  # names the intact one
    assert [s for s, _ in mf.committed(tmp_path)] == [1]
    assert manager(tmp_path).restore({"model": Box()}, {}, False).step == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(mf.TMP_PREFIX)]


@pytest.mark.parametrize("per_call", [1, 4093, 1 << 20])
def test_writes_that_move_fewer_bytes_per_call_still_make_a_correct_file(tmp_path: Path, monkeypatch, per_call: int) -> None:
    g = torch.Generator().manual_seed(0)
    tree = {
        "big": torch.randn(600_000, generator=g),
        "small": [torch.randn(5, generator=g) for _ in range(50)],
        "half": torch.ones(33, dtype=torch.bfloat16),
        "n": 3,
    }
    size = (4 << 10) if per_call == 1 else None  # one byte per call: a small state, to stay fast
    if size:
        tree = {"small": tree["small"][:3], "half": tree["half"], "n": 3}
    expected_size, expected_sum = tensorfile.save(tree, tmp_path / "reference.bin")
    calls = {"write": 0, "writev": 0}

    def short_write(fd: int, data: Any) -> int:
        calls["write"] += 1
        return os.write(fd, memoryview(data)[:per_call])

    def short_writev(fd: int, buffers: List[Any]) -> int:
        calls["writev"] += 1
        joined = b"".join(bytes(b) for b in buffers)
        return os.write(fd, joined[:per_call])

    monkeypatch.setattr(fileio, "_write", short_write)
    monkeypatch.setattr(fileio, "_writev", short_writev)
    got = tensorfile.save(tree, tmp_path / "short.bin")
    assert got == (expected_size, expected_sum)
    assert (tmp_path / "short.bin").read_bytes() == (tmp_path / "reference.bin").read_bytes()
    assert calls["writev"] and calls["write"]  # both paths were cut short
    back = tensorfile.load(tmp_path / "short.bin", *got)
    assert torch.equal(back["half"], tree["half"]) and all(torch.equal(a, b) for a, b in zip(back["small"], tree["small"]))


def test_a_write_that_moves_nothing_is_an_error(tmp_path: Path, monkeypatch) -> None:
    m = manager(tmp_path, keep_last=1)
    m.save(1, model_state(1), {}, {})
    m.wait()
    monkeypatch.setattr(fileio, "_write", lambda fd, data: 0)
    monkeypatch.setattr(fileio, "_writev", lambda fd, buffers: 0)
    with pytest.raises(CheckpointError, match="moved 0 bytes.*step_000000001"):
        m.save(2, model_state(2), {}, {})
    assert [s for s, _ in mf.committed(tmp_path)] == [1]


def test_read_back_runs_before_retention_and_a_bad_read_back_keeps_the_older_checkpoints(tmp_path: Path) -> None:
    events = Recorder()
    m = manager(tmp_path, keep_last=1, events=events)
    m.save(1, model_state(1), {}, {})
    m.wait()
    release = threading.Event()
    m._pool.submit(release.wait, 60)  # hold the background thread: the read-back of step 2 waits behind it
    m.save(2, model_state(2), {}, {})  # committed when save() returns
    flip_last_byte(tmp_path / mf.step_dir_name(2) / STATE)  # the disk does not hold what was written
    release.set()
    with pytest.raises(CheckpointError, match="step 2 was written but does not read back"):
        m.wait()
    assert [s for s, _ in mf.committed(tmp_path)] == [1]  # retention did not run
    assert set_aside(tmp_path) and "readback" in set_aside(tmp_path)[0]
    assert events.of(Event.CHECKPOINT_SET_ASIDE)[0]["step"] == 2
    assert manager(tmp_path).restore({"model": Box()}, {}, False).step == 1


# ---- 2. commit order, never step order --------------------------------------------------------
def test_fresh_start_next_to_damaged_higher_steps_keeps_its_own_checkpoints(tmp_path: Path) -> None:
    first = manager(tmp_path, keep_last=2)
    for step in (4000, 5000):
        first.save(step, model_state(step), {}, {})
    first.close()
    for step in (4000, 5000):
        flip_last_byte(tmp_path / mf.step_dir_name(step) / STATE)
    # without permission to start over, the run stops and nothing is moved
    with pytest.raises(CheckpointError, match="none of the 2 committed checkpoints.*fresh_start_if_unusable"):
        manager(tmp_path).restore({"model": Box()}, {}, False)
    assert [s for s, _ in mf.committed(tmp_path)] == [5000, 4000] and not set_aside(tmp_path)

    events = Recorder()
    fresh = manager(tmp_path, keep_last=1, events=events)
    assert fresh.restore({"model": Box()}, {}, False, fresh_start_if_unusable=True) is None
    assert [e["step"] for e in events.of(Event.CHECKPOINT_INVALID)] == [5000, 4000]
    moved = events.of(Event.CHECKPOINT_SET_ASIDE)
    assert sorted(e["step"] for e in moved) == [4000, 5000] and all(Path(e["moved_to"]).is_dir() for e in moved)
    fresh.save(100, model_state(100), {}, {})
    fresh.save(200, model_state(200), {}, {})
    fresh.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [200]  # keep_last=1 of this run's, by commit order
    assert len(set_aside(tmp_path)) == 2  # the damaged ones are kept, out of the way
    target = Box()
    assert manager(tmp_path).restore({"model": target}, {}, False).step == 200
    assert target.state["w"][0].item() == 200.0


def test_a_shared_folder_with_higher_steps_does_not_lose_the_new_checkpoint(tmp_path: Path) -> None:
    other = manager(tmp_path, keep_last=5)
    other.save(5000, model_state(5000), {}, {})
    other.close()
    mine = manager(tmp_path, keep_last=1)
    mine.save(100, model_state(100), {}, {})
    mine.save(200, model_state(200), {}, {})
    mine.close()
    # retention ranks by step: the newest by step (5000) and the newest commit (200, what a resume picks) stay
    assert [s for s, _ in mf.committed(tmp_path)] == [200, 5000]
    assert manager(tmp_path).restore({"model": Box()}, {}, False).step == 200


def test_retention_keeps_milestones_and_the_checkpoint_just_committed(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=1, keep_every_n_epochs=2)
    for step, epoch, batch in [(10, 1, 0), (20, 2, 0), (25, 2, 5), (30, 3, 0), (40, 4, 0), (45, 4, 3)]:
        m.save(step, model_state(step), {}, {"epoch": epoch, "batch_in_epoch": batch})
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [45, 40, 20]


def test_a_re_save_of_a_committed_step_moves_the_old_one_aside(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=3)
    m.save(7, model_state(1), {}, {})
    m.save(7, model_state(2), {}, {})
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [7]
    assert len(set_aside(tmp_path)) == 1 and "replaced" in set_aside(tmp_path)[0]
    target = Box()
    manager(tmp_path).restore({"model": target}, {}, False)
    assert target.state["w"][0].item() == 2.0


@pytest.mark.parametrize("there", ["an empty folder", "a folder of files", "a file"])
def test_whatever_uncommitted_is_at_a_steps_name_gives_way_to_its_commit(tmp_path: Path, there: str) -> None:
    """The commit renames at once and looks at what is in the way only when the rename is refused: a
    leftover at step_N's name (no manifest) gives way whatever it is, and nothing is set aside."""
    m = manager(tmp_path, keep_last=3)
    m.save(6, model_state(1), {}, {})
    m.wait()
    final = tmp_path / mf.step_dir_name(7)
    if there == "a file":
        final.write_bytes(b"x")
    else:
        final.mkdir()
        if there == "a folder of files":
            (final / STATE).write_bytes(b"half")
    m.save(7, model_state(2), {}, {})
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [7, 6]
    assert final.is_dir() and mf.read(final)["step"] == 7 and verify_checkpoint(final) is None
    assert not set_aside(tmp_path)  # never committed: nothing to keep
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(mf.TMP_PREFIX)]


def test_a_symlinked_folder_with_a_manifest_is_not_listed_as_committed(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=3)
    m.save(6, model_state(1), {}, {})
    m.close()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / mf.MANIFEST).write_bytes((tmp_path / mf.step_dir_name(6) / mf.MANIFEST).read_bytes())
    (tmp_path / mf.step_dir_name(9)).symlink_to(outside, target_is_directory=True)
    assert [s for s, _ in mf.committed(tmp_path)] == [6]


# ---- 4. any damage: unusable, fall back, never an exception -------------------------------------
def _edit_manifest(edit):  # type: ignore[no-untyped-def]
    def damage(ckpt: Path) -> None:
        data = json.loads((ckpt / mf.MANIFEST).read_text())
        (ckpt / mf.MANIFEST).write_bytes(mf.seal(edit(data)))  # its digest made to match: the check under test must catch it

    return damage


def _set(key: str, value: Any):  # type: ignore[no-untyped-def]
    return _edit_manifest(lambda m: {**m, key: value})


def _file_spec(name: str, spec: Any):  # type: ignore[no-untyped-def]
    return _edit_manifest(lambda m: {**m, "files": {**{k: v for k, v in m["files"].items() if k != STATE}, name: spec}})


def _replace_model(payload: bytes):  # type: ignore[no-untyped-def]
    """A crafted state.bin whose size and checksum the manifest is made to match."""

    def damage(ckpt: Path) -> None:
        (ckpt / STATE).write_bytes(payload)
        data = json.loads((ckpt / mf.MANIFEST).read_text())
        import xxhash

        data["files"][STATE] = {"bytes": len(payload), "checksum": f"xxh3_128:{xxhash.xxh3_128(payload).hexdigest()}"}
        (ckpt / mf.MANIFEST).write_bytes(mf.seal(data))

    return damage


def _state_file(tree: Any) -> bytes:
    """The bytes of a well-formed tensor file holding `tree` (what a crafted state.bin can be)."""
    return b"".join(bytes(piece) for piece in tensorfile.plan(tree).buffers())


def _edit_state(edit):  # type: ignore[no-untyped-def]
    """state.bin rewritten, well-formed, with `edit` applied to its tree; the manifest made to match."""

    def damage(ckpt: Path) -> None:
        _replace_model(_state_file(edit(tensorfile.load(ckpt / STATE))))(ckpt)

    return damage


def _truncate_state(ckpt: Path) -> None:
    data = (ckpt / STATE).read_bytes()
    _replace_model(data[: len(data) - 16])(ckpt)  # the manifest made to match: only the parser can tell


def _rename_state(ckpt: Path) -> None:
    (ckpt / STATE).rename(ckpt / "model.bin")
    _edit_manifest(lambda m: {**m, "files": {"model.bin": m["files"][STATE]}})(ckpt)


def _crafted(header: Dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _fifo(ckpt: Path) -> None:
    (ckpt / STATE).unlink()
    os.mkfifo(ckpt / STATE)


def _symlink_out(ckpt: Path) -> None:
    outside = ckpt.parent.parent / "outside.bin"
    (ckpt / STATE).rename(outside)  # same bytes, same checksum: only the link is wrong
    (ckpt / STATE).symlink_to(outside)


def _manifest_fifo(ckpt: Path) -> None:
    (ckpt / mf.MANIFEST).unlink()
    os.mkfifo(ckpt / mf.MANIFEST)


DAMAGE = {
    "manifest null": lambda c: (c / mf.MANIFEST).write_text("null"),
    "manifest list": lambda c: (c / mf.MANIFEST).write_text("[1, 2]"),
    "manifest not json": lambda c: (c / mf.MANIFEST).write_bytes(b"\xff{"),
    "manifest deep": lambda c: (c / mf.MANIFEST).write_text("[" * 100_000),
    "manifest fifo": _manifest_fifo,
    "checksum null": _file_spec(STATE, None),
    "checksum missing": _edit_manifest(lambda m: {**m, "files": {k: {"bytes": v["bytes"]} for k, v in m["files"].items()}}),
    "checksum none": _edit_manifest(lambda m: {**m, "files": {k: {**v, "checksum": None} for k, v in m["files"].items()}}),
    "bytes bool": _edit_manifest(lambda m: {**m, "files": {k: {**v, "bytes": True} for k, v in m["files"].items()}}),
    "bytes huge": _edit_manifest(lambda m: {**m, "files": {k: {**v, "bytes": 10**30} for k, v in m["files"].items()}}),
    "path escape": _file_spec("../../outside.bin", {"bytes": 1, "checksum": "xxh3_128:" + "0" * 32}),
    "path nested": _file_spec("a/model.bin", {"bytes": 1, "checksum": "xxh3_128:" + "0" * 32}),
    "no state file": _edit_manifest(lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != STATE}}),
    "state file renamed": _rename_state,
    "state file listed twice": _edit_manifest(lambda m: {**m, "files": {**m["files"], "model.bin": m["files"][STATE]}}),
    "commit far ahead": _set("commit", 2**62),  # was chosen, and every later save failed its own validation
    "step mismatch": _set("step", 1),
    "step string": _set("step", "2"),
    "world size zero": _set("world_size", 0),
    "files list": _set("files", ["model.bin"]),
    "config list": _set("config", []),
    "model fifo": _fifo,
    "model symlink out": _symlink_out,
    "crafted shape overflow": _replace_model(_crafted({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 0]}})),
    # zero elements, so no bytes needed; torch.empty raised "Stride calculation overflowed" (a RuntimeError)
    "crafted empty tensor overflowing strides": _replace_model(
        _crafted({"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}})
    ),
    "crafted negative shape": _replace_model(_crafted({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4)),
    "crafted overlap": _replace_model(
        _crafted(
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
        )
    ),
    "crafted unknown dtype": _replace_model(
        _crafted({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16)
    ),
    "crafted deep tree": _replace_model(_crafted({"__metadata__": {tensorfile.TREE_KEY: "[" * 50_000 + "]" * 50_000}})),
    "crafted bad reference": _replace_model(
        _crafted({"__metadata__": {tensorfile.TREE_KEY: '{"__d": [["w", {"__t": "nope"}]]}'}})
    ),
    "crafted numpy bf16": _replace_model(
        _crafted(
            {"__metadata__": {tensorfile.TREE_KEY: '{"__n": "a"}'}, "a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}},
            b"\0\0",
        )
    ),
    "crafted huge header": _replace_model((9 << 20).to_bytes(8, "little") + b"{" * 64),
    # state.bin: a well-formed tensor file that is not a checkpoint's state, or a truncated one
    "state truncated": _truncate_state,
    "state plain safetensors": _replace_model(_state_file({"w": torch.ones(3)})),
    "state no ranks": _edit_state(lambda t: {"objects": t["objects"]}),
    "state ranks not a list": _edit_state(lambda t: {**t, "ranks": {"0": t["ranks"][0]}}),
    "state ranks of another world size": _edit_state(lambda t: {**t, "ranks": t["ranks"] * 2}),
    "state rank without rng": _edit_state(lambda t: {**t, "ranks": [{}]}),
    "state objects a list": _edit_state(lambda t: {**t, "objects": [t["objects"]["model"]]}),
    "state no model": _edit_state(lambda t: {**t, "objects": {"other": t["objects"]["model"]}}),
    "state extra key": _edit_state(lambda t: {**t, "more": 1}),
    "state rank not a dict": _edit_state(lambda t: {**t, "ranks": [[t["ranks"][0]]]}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_any_damage_to_the_newest_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    folder = tmp_path / "checkpoints"
    m = manager(folder)
    for step in (1, 2):
        m.save(step, model_state(step), {"rng": Box({"seed": step})}, {"epoch": step})
    m.close()
    DAMAGE[damage](folder / mf.step_dir_name(2))
    mf.newest_manifest(folder)  # the launcher's pre-flight reads manifests too: never an exception
    mf.scan(folder)
    events = Recorder()
    target, rng = Box(), Box()
    restored = manager(folder, events=events).restore({"model": target}, {"rng": rng}, False)
    assert restored is not None and restored.step == 1
    assert target.state["w"][0].item() == 1.0 and rng.state == {"seed": 1}
    assert [e["step"] for e in events.of(Event.CHECKPOINT_INVALID)] == [2]
    assert not (folder / mf.step_dir_name(2)).exists() and len(set_aside(folder)) == 1  # kept, out of the way


def test_a_crafted_commit_far_ahead_is_unusable_and_later_saves_keep_working(tmp_path: Path) -> None:
    m = manager(tmp_path)
    for step in (1, 2):
        m.save(step, model_state(step), {"rng": Box({"seed": step})}, {"epoch": step})
    m.close()
    _set("commit", 2**62)(tmp_path / mf.step_dir_name(2))
    resumed = manager(tmp_path)
    target = Box()
    restored = resumed.restore({"model": target}, {"rng": Box()}, False)
    assert restored is not None and restored.step == 1 and target.state["w"][0].item() == 1.0
    for step in (2, 3, 4):  # the run goes on from step 1: every save commits, and the newest is the last
        resumed.save(step, model_state(step), {"rng": Box({"seed": step})}, {"epoch": step})
    resumed.close()
    listed = mf.scan(tmp_path)
    assert [c.step for c in listed][:2] == [4, 3] and all(c.manifest is not None for c in listed)
    assert listed[0].commit < 10 and len(set_aside(tmp_path)) == 1


def test_a_commit_at_the_bound_is_used_and_the_next_saves_still_validate(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(5, model_state(5), {"rng": Box({"seed": 5})}, {"epoch": 5})
    m.close()
    _set("commit", mf.MAX_COMMIT)(tmp_path / mf.step_dir_name(5))
    m, target = manager(tmp_path), Box()
    assert m.restore({"model": target}, {"rng": Box()}, False).step == 5  # type: ignore[union-attr]
    for step in (6, 7):
        m.save(step, model_state(step), {"rng": Box({"seed": step})}, {"epoch": step})
    m.close()
    listed = mf.scan(tmp_path)
    assert [(c.step, c.commit) for c in listed] == [(7, mf.MAX_COMMIT), (6, mf.MAX_COMMIT)]  # keep_last=2; ordered by step


# ---- 5. asynchronous saves: only what the next optimizer step changes is copied later -----------
def _trained() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(16, 4)).square().mean().backward()
    opt.step()
    return model, opt


def test_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    model, opt = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = opt.state_dict()["state"][0]["exp_avg"].clone()
    m = manager(tmp_path, async_save=True)
    release = threading.Event()
    m._pool.submit(release.wait, 60)  # the background copy cannot start before we release it
    m.save(1, {"model": model, "optimizer": opt}, {}, {})
    model(torch.randn(16, 4)).square().mean().backward()  # the forward pass changes BatchNorm's running stats
    stepped = threading.Thread(target=opt.step)  # the step must wait for the copy of what it changes
    stepped.start()
    stepped.join(0.5)
    waited = stepped.is_alive()
    release.set()
    stepped.join(30)
    m.close()
    assert waited and not stepped.is_alive()
    assert not torch.equal(model.state_dict()["0.weight"], expected["0.weight"])  # training did go on
    saved_model, saved_opt = Box(), Box()
    manager(tmp_path).restore({"model": saved_model, "optimizer": saved_opt}, {}, False)
    for key, value in expected.items():
        assert torch.equal(saved_model.state[key], value), key
    assert torch.equal(saved_opt.state["state"][0]["exp_avg"], expected_moment)


def test_async_save_failure_is_raised_at_the_next_save_and_keeps_the_previous(tmp_path: Path, monkeypatch) -> None:
    m = manager(tmp_path, async_save=True)
    m.save(1, model_state(1), {}, {})
    m.wait()
    monkeypatch.setattr(fileio, "_write", lambda fd, data: 0)
    monkeypatch.setattr(fileio, "_writev", lambda fd, buffers: 0)
    m.save(2, model_state(2), {}, {})
    with pytest.raises(CheckpointError, match="step 2.*step_000000001"):
        m.save(3, model_state(3), {}, {})
    assert [s for s, _ in mf.committed(tmp_path)] == [1]


def test_a_state_that_cannot_be_stored_is_refused_by_name_before_anything_is_written(tmp_path: Path) -> None:
    m = manager(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot save model at step 1: .*complex128.*at model\.w"):
        m.save(1, {"model": Box({"w": torch.zeros(2, dtype=torch.complex128)})}, {}, {})
    with pytest.raises(CheckpointError, match="object named 'ranks'"):
        m.save(1, {"ranks": Box({})}, {}, {})
    with pytest.raises(CheckpointError, match="reserved"):
        m.save(1, model_state(1), {}, {"commit": 7})
    m.close()
    assert mf.committed(tmp_path) == [] and list(tmp_path.iterdir()) == []
