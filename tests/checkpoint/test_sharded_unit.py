"""The sharded checkpoint format in one process: FSDP2 over a process group of one rank (its state
is DTensors, so it takes the sharded codec), saved and restored by the real CheckpointManager, and
every crafted or mismatched sharded checkpoint unusable (it falls back), never an escaping error.
The many-rank cases (pieces read across world sizes) are in test_sharded.py, with real workers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import sharded
from steadfast.checkpoint.consolidate import consolidate
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.checkpoint.shards import is_dtensor
from steadfast.distributed.comm import Comm


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model_and_optimizer(seed: int = 0, width: int = 6) -> Any:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        optimizer.step()


def whole(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if is_dtensor(v) else v).clone() for k, v in state.items()}


def manager(folder: Path, events: List[Any] | None = None) -> CheckpointManager:
    return CheckpointManager(
        folder, Comm(), 3, {"a": 1}, (lambda *a, **k: events.append((a, k))) if events is not None else (lambda *a, **k: None)
    )


def saved(folder: Path, steps: List[int]) -> Dict[int, Dict[str, torch.Tensor]]:
    """Checkpoints of a trained FSDP2 model at each of `steps`; returns each one's whole weights."""
    model, optimizer = model_and_optimizer()
    m, out, done = manager(folder), {}, 0
    for step in steps:
        train(model, optimizer, step - done)
        done = step
        m.save(step, {"model": model, "optimizer": optimizer}, {}, {"epoch": 0})
        m.wait()
        out[step] = whole(model.state_dict())
    m.close()
    return out


def test_a_sharded_state_saves_in_the_sharded_format_and_restores_exactly(tmp_path: Path) -> None:
    weights = saved(tmp_path, [3])
    path = tmp_path / mf.step_dir_name(3)
    manifest = mf.read(path)
    assert manifest["format"] == mf.SHARDED_FORMAT and set(manifest["files"]) == {sharded.file_name(0)}
    assert manifest["tensors"]["model.0.weight"]["shape"] == [6, 4]
    model, optimizer = model_and_optimizer(seed=1)  # other weights, no optimizer state yet
    restored = manager(tmp_path).restore({"model": model, "optimizer": optimizer}, {}, False)
    assert restored is not None and restored.step == 3
    assert all(torch.equal(v, weights[3][k]) for k, v in whole(model.state_dict()).items())
    state = optimizer.state_dict()["state"]
    assert len(state) == 4 and is_dtensor(state[0]["exp_avg"]) and float(state[0]["step"]) == 3.0


def test_a_consolidated_file_is_the_whole_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    weights = saved(tmp_path, [2])
    out = tmp_path / "model.safetensors"
    done = consolidate(tmp_path / mf.step_dir_name(2), out)
    assert done["tensors"] == 4
    loaded = load_file(str(out))
    assert sorted(loaded) == sorted(weights[2]) and all(torch.equal(loaded[k], weights[2][k]) for k in loaded)
    with pytest.raises(Exception, match="exists"):  # never replaced without --force
        consolidate(tmp_path / mf.step_dir_name(2), out)


def _rewrite_manifest(path: Path, change: Any) -> None:
    data = json.loads((path / mf.MANIFEST).read_text())
    change(data)
    (path / mf.MANIFEST).write_bytes(mf.seal(data))  # the digest made to match: the check under test must catch it


def _overlap(data: Dict[str, Any]) -> None:
    pieces = data["tensors"]["model.0.weight"]["pieces"]
    pieces.append([pieces[0][0], [0, 0], [1, 4]])  # a second piece over the first row
    pieces[0][2] = [5, 4]


def _outside(data: Dict[str, Any]) -> None:
    data["tensors"]["model.0.weight"]["pieces"][0][1] = [1, 0]  # shifted past the tensor's end


def _unknown_file(data: Dict[str, Any]) -> None:
    data["tensors"]["model.0.weight"]["pieces"][0][0] = "rank00007.bin"


def _dtype(data: Dict[str, Any]) -> None:
    data["tensors"]["model.0.weight"]["dtype"] = "F16"  # the table disagrees with the file


def _shape(data: Dict[str, Any]) -> None:
    entry = data["tensors"]["model.0.weight"]
    entry["shape"], entry["pieces"][0][2] = [4, 6], [4, 6]  # the same bytes, another shape


@pytest.mark.parametrize("change", [_overlap, _outside, _unknown_file, _dtype, _shape])
def test_a_crafted_tensor_table_is_unusable_and_the_previous_checkpoint_is_used(tmp_path: Path, change: Any) -> None:
    weights = saved(tmp_path, [2, 4])
    _rewrite_manifest(tmp_path / mf.step_dir_name(4), change)
    events: List[Any] = []
    model, optimizer = model_and_optimizer(seed=1)
    restored = manager(tmp_path, events).restore({"model": model, "optimizer": optimizer}, {}, False)
    assert restored is not None and restored.step == 2
    assert all(torch.equal(v, weights[2][k]) for k, v in whole(model.state_dict()).items())
    assert any(a[0] == "checkpoint_invalid" for a, _ in events)
    assert not (tmp_path / mf.step_dir_name(4)).exists()  # moved aside, not deleted
    assert [p for p in os.listdir(tmp_path) if p.startswith(mf.SET_ASIDE_PREFIX)]


def test_a_checkpoint_of_another_model_shape_is_unusable_before_anything_is_applied(tmp_path: Path) -> None:
    saved(tmp_path, [2])
    model, optimizer = model_and_optimizer(seed=1, width=8)
    before = whole(model.state_dict())
    with pytest.raises(CheckpointError, match="none of the 1 committed checkpoints .* is usable.*does not fit this run.s model"):
        manager(tmp_path).restore({"model": model, "optimizer": optimizer}, {}, False)
    assert all(torch.equal(v, before[k]) for k, v in whole(model.state_dict()).items())  # untouched
    assert (tmp_path / mf.step_dir_name(2)).is_dir()  # kept as it is (no fresh start was allowed)


def test_a_damaged_rank_file_falls_back(tmp_path: Path) -> None:
    weights = saved(tmp_path, [2, 4])
    path = tmp_path / mf.step_dir_name(4) / sharded.file_name(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    model, optimizer = model_and_optimizer(seed=1)
    assert manager(tmp_path).restore({"model": model, "optimizer": optimizer}, {}, False).step == 2
    assert all(torch.equal(v, weights[2][k]) for k, v in whole(model.state_dict()).items())


def test_the_tensor_table_is_checked_without_torch() -> None:
    files = {"rank00000.bin": {}, "rank00001.bin": {}}
    good = {
        "w": {"dtype": "F32", "shape": [4, 2], "pieces": [["rank00000.bin", [0, 0], [2, 2]], ["rank00001.bin", [2, 0], [2, 2]]]}
    }
    assert mf.tensor_table_problem(good, files) is None
    assert "cover" not in (mf.tensor_table_problem({"s": {"dtype": "F32", "shape": [], "pieces": []}}, files) or "values")
    for bad, why in [
        ({"w": {**good["w"], "dtype": "X9"}}, "known dtype"),
        ({"w": {**good["w"], "pieces": good["w"]["pieces"][:1]}}, "hold 4 of its 8"),
        ({"w": {**good["w"], "pieces": [["rank00002.bin", [0, 0], [4, 2]]]}}, "a file of the manifest"),
        ({"w": {**good["w"], "shape": [2**63, 1]}}, "non-negative ints"),
        (
            {
                "w": {
                    "dtype": "F32",
                    "shape": [4, 2],
                    "pieces": [["rank00000.bin", [0, 0], [3, 2]], ["rank00001.bin", [1, 0], [1, 2]]],
                }
            },
            "overlap",
        ),
        ([], "JSON object"),
    ]:
        assert why in (mf.tensor_table_problem(bad, files) or ""), (bad, why)


def test_an_asynchronous_sharded_save_is_committed_once_written(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    train(model, optimizer, 2)
    m = CheckpointManager(tmp_path, Comm(), 2, {"a": 1}, lambda *a, **k: None, async_save=True)
    m.save(2, {"model": model, "optimizer": optimizer}, {}, {"epoch": 0})
    assert m.written_step() == 2 and not mf.committed(tmp_path)  # written in the background, not committed yet
    expected = whole(model.state_dict())
    train(model, optimizer, 3)  # the save's copy was taken before these steps changed the weights
    m.wait()  # commits it
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [2] and m.written_step() is None
    fresh, opt = model_and_optimizer(seed=1)
    assert manager(tmp_path).restore({"model": fresh, "optimizer": opt}, {}, False).step == 2
    assert all(torch.equal(v, expected[k]) for k, v in whole(fresh.state_dict()).items())


def test_a_sharded_save_reuses_its_layout_and_restores_exactly(tmp_path: Path) -> None:
    """The same FSDP2 state saved again: the layout is reused (each piece taken from the live DTensor
    anew) and every save restores exactly; an optimizer state appearing plans anew."""
    model, optimizer = model_and_optimizer()
    m, weights = manager(tmp_path), {}
    m.plans.small = 0  # this small state's file reused too
    for step in (1, 2, 3):
        if step > 1:
            train(model, optimizer, 1)
        m.save(step, {"model": model, "optimizer": optimizer}, {}, {"epoch": 0})
        m.wait()
        weights[step] = whole(model.state_dict())
        assert m.plans.reused == (1 if step == 3 else 0)  # step 2: the optimizer's state appeared
    m.close()
    for step in (2, 3):
        fresh, fresh_optimizer = model_and_optimizer(seed=1)
        restored = manager(tmp_path).restore({"model": fresh, "optimizer": fresh_optimizer}, {}, False, newest=step)
        assert restored is not None and restored.step == step
        assert all(torch.equal(v, weights[step][k]) for k, v in whole(fresh.state_dict()).items())
        assert float(fresh_optimizer.state_dict()["state"][0]["step"]) == step - 1


def test_a_snapshot_in_memory_reuses_its_sharded_layout_and_loads_exactly(launch: Any) -> None:
    """Snapshots of an FSDP2 state in memory: from the second on, the last one's layout is reused
    (each piece taken from the live DTensor anew) although the state has fewer tensors than a save
    would reuse for (Plans.small), and every snapshot loads back exactly."""
    from helpers import memory_of
    from steadfast.checkpoint.state import Progress, RNGState

    model, optimizer = model_and_optimizer()
    train(model, optimizer, 1)  # the optimizer's state exists: the state's structure from here on
    memory, progress, expected = memory_of(launch), Progress(), {}
    objects = {"model": model, "optimizer": optimizer, "progress": progress}
    for step in (1, 2, 3):
        train(model, optimizer, 1)
        progress.global_step = step
        memory.take(step, memory.plan(objects, {"rng": RNGState()}))
        expected[step] = (whole(model.state_dict()), float(optimizer.state_dict()["state"][0]["step"]))
    assert memory.sharded_plans.reused == 2
    for step in (3, 2):  # the two slots: the newest snapshot, and the one before it
        fresh, fresh_optimizer = model_and_optimizer(seed=1)
        fresh_objects = {"model": fresh, "optimizer": fresh_optimizer, "progress": Progress()}
        loaded = memory.load(step, fresh_objects)
        assert loaded is not None
        states, own = loaded
        for name, obj in fresh_objects.items():
            obj.load_state_dict(states[name])
        weights, optimizer_step = expected[step]
        assert all(torch.equal(v, weights[k]) for k, v in whole(fresh.state_dict()).items())
        assert float(fresh_optimizer.state_dict()["state"][0]["step"]) == optimizer_step
        assert fresh_objects["progress"].global_step == step and "rng" in own
