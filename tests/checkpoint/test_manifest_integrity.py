"""Manifests that check themselves and agree with their files (issue 32, findings 1-4), in one process
with real CheckpointManagers and real files: every one-bit flip of a manifest is refused; a manifest of
an earlier version (no digest) still resumes, with a warning; retention ranks by step; a rank file's
own table of pieces must match the manifest's; a tensor is read only when its pieces cover it exactly
once; an optimizer's parameters are checked by name. The same cases with real workers, end to end:
tests/checkpoint/test_crafted_checkpoints.py."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

from helpers import Box
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import piecetable as pt
from steadfast.checkpoint import shard_reader, sharded
from steadfast.checkpoint._sealer import Sealer, encode_fields
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.checkpoint.optimizers import optimizer_misfit, param_names
from steadfast.checkpoint.retention import Policy
from steadfast.checkpoint.sources import BufferSource
from steadfast.checkpoint.tensorformat import TensorFileError
from steadfast.distributed.comm import Comm


def manager(folder: Path, keep_last: int = 3, events: Any = None) -> CheckpointManager:
    return CheckpointManager(folder, Comm(), keep_last, {"a": 1}, events or (lambda *a, **k: None))


def saved(folder: Path, steps: List[int], keep_last: int = 3) -> None:
    m = manager(folder, keep_last)
    for step in steps:
        m.save(step, {"model": Box({"w": torch.full((4,), float(step))})}, {}, {"epoch": 0})
    m.close()


def as_earlier_version(ckpt: Path, **changes: Any) -> None:
    """Rewrite the manifest as the version before wrote it (no digest, no parameter names), with `changes`."""
    data = {k: v for k, v in json.loads((ckpt / mf.MANIFEST).read_text()).items() if k not in (mf.DIGEST, mf.PARAMS)}
    (ckpt / mf.MANIFEST).write_text(json.dumps({**data, **changes}, indent=1))


def test_every_one_bit_flip_of_a_manifest_is_refused(tmp_path: Path) -> None:
    saved(tmp_path, [7])
    path = tmp_path / mf.step_dir_name(7) / mf.MANIFEST
    raw = path.read_bytes()
    assert raw.startswith(b'{\n "digest": "xxh3_128:') and mf.read(path.parent)["step"] == 7
    accepted = []
    for i in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            try:
                mf.validate(mf.parse(bytes(flipped), path), path, 7)
            except mf.ManifestError:
                continue
            accepted.append((i, bit))
    assert not accepted, [(raw[i - 10 : i + 10], bit) for i, bit in accepted[:5]]


def test_a_commit_raised_by_one_bit_is_refused_and_the_newest_is_used(tmp_path: Path) -> None:
    saved(tmp_path, [10, 20, 30])
    path = tmp_path / mf.step_dir_name(10) / mf.MANIFEST
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"1", raw.index(b'"commit"'))] ^= 0x08  # 1 -> 9: it would be the newest
    path.write_bytes(bytes(raw))
    events: List[Any] = []
    target = Box()
    restored = manager(tmp_path, events=lambda kind, **f: events.append((kind.value, f))).restore({"model": target}, {}, False)
    assert restored is not None and restored.step == 30 and target.state["w"][0].item() == 30.0
    invalid = [f for kind, f in events if kind == "checkpoint_invalid"]
    assert [f["step"] for f in invalid] == [10] and "digest does not match" in invalid[0]["error"]


def test_a_manifest_of_the_version_before_still_resumes_with_a_warning(tmp_path: Path, caplog: Any) -> None:
    saved(tmp_path, [5])
    as_earlier_version(tmp_path / mf.step_dir_name(5))
    (listed,) = mf.scan(tmp_path)
    assert listed.manifest is not None and not listed.sealed
    with caplog.at_level(logging.WARNING):
        assert manager(tmp_path).restore({"model": Box()}, {}, False).step == 5  # type: ignore[union-attr]
    assert "without a digest" in caplog.text


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw.replace(b'"digest"', b'"dhgest"', 1),  # one bit in the key's name
        lambda raw: raw.replace(b"{\n", b"{ \n", 1),  # the first line moved: the digest is not where it is written
        lambda raw: raw.replace(b"xxh3_128:", b"xxh3_129:", 1),  # one bit in the digest's algorithm
    ],
)
def test_a_digest_that_is_not_where_it_belongs_is_damage_not_an_old_manifest(tmp_path: Path, damage: Any) -> None:
    saved(tmp_path, [5])
    path = tmp_path / mf.step_dir_name(5) / mf.MANIFEST
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(mf.ManifestError):
        mf.read(path.parent)


def test_a_manifest_sealed_with_its_configs_encoded_once_is_the_one_seal_writes(tmp_path: Path) -> None:
    """The manager encodes the configs once (_sealer.Sealer); its manifests must be byte for byte what
    `seal` writes for the whole manifest, whatever the configs hold, and read back as they do."""
    odd = {"a.b": 1, "nested": {"list": [1, [], {}, "x\ny\u00e9\t"], 3: True, None: 2.5, "obj": Path("p")}, "e": {}}
    fields = {"format": 4, "step": 9, "commit": 2, "world_size": 1, "created": 1.5, "files": {"state.bin": {"bytes": 3}}}
    constant = {"config": odd, "full_config": {"k": "v", "deep": odd}}
    sealer = Sealer(constant)
    assert mf.seal(fields, sealer.encoded) == mf.seal({**fields, **constant})
    assert mf.seal(fields, encode_fields({})) == mf.seal(fields)
    assert sealer.read_back == {k: v for k, v in mf.parse(mf.seal({**fields, **constant}), "m").items() if k in constant}

    m = CheckpointManager(tmp_path, Comm(), 1, odd, lambda *a, **k: None, full_config=constant["full_config"])
    m.save(9, {"model": Box({"w": torch.zeros(2)})}, {}, {"epoch": 0})
    m.close()
    raw = (tmp_path / mf.step_dir_name(9) / mf.MANIFEST).read_bytes()
    assert raw == mf.seal({k: v for k, v in mf.read(tmp_path / mf.step_dir_name(9)).items() if k not in constant}, sealer.encoded)
    with pytest.raises(mf.ManifestError, match="'world_size'"):  # what a reader would refuse is never written
        sealer.seal({**fields, "world_size": 0}, "here", 9)


def test_a_fresh_managers_first_save_reads_no_manifest_and_is_the_newest(tmp_path: Path, monkeypatch: Any) -> None:
    """The commit sequence is learnt when the manager is made (rank 0 lists the store then): its
    first save lists names and reads no manifest on the saving thread, and still commits one above
    the highest commit there (the background read-back of the new one is not the save's)."""
    saved(tmp_path, [5, 6, 7])
    m = manager(tmp_path, keep_last=5)
    read = []
    real = type(m.store).read_manifest

    def counted(store: Any, name: str) -> bytes:
        read.append((threading.get_ident(), name))
        return real(store, name)

    monkeypatch.setattr(type(m.store), "read_manifest", counted)
    m.save(8, {"model": Box({"w": torch.zeros(4)})}, {}, {"epoch": 0})
    assert [name for thread, name in read if thread == threading.get_ident()] == []
    m.close()
    assert [(c.step, c.commit) for c in mf.scan(tmp_path)] == [(8, 4), (7, 3), (6, 2), (5, 1)]


def test_the_commit_sequence_sees_a_checkpoint_another_writer_committed(tmp_path: Path) -> None:
    """A manager follows its own commits without reading every manifest each save (_commits.Commits), but a
    checkpoint committed beside them by anything else (here: one copied in, with a higher commit)
    still moves the sequence on: the next save is the newest."""
    m = manager(tmp_path, keep_last=5)
    m.save(1, {"model": Box({"w": torch.zeros(2)})}, {}, {"epoch": 0})
    m.save(2, {"model": Box({"w": torch.zeros(2)})}, {}, {"epoch": 0})
    m.wait()
    other = tmp_path / "elsewhere"
    saved(other, [1, 2, 3, 4, 5, 6, 7])
    (other / mf.step_dir_name(7)).rename(tmp_path / mf.step_dir_name(70))
    as_earlier_version(tmp_path / mf.step_dir_name(70), step=70)  # commit 7, above this manager's 2
    m.save(3, {"model": Box({"w": torch.zeros(2)})}, {}, {"epoch": 0})
    m.close()
    assert [(c.step, c.commit) for c in mf.scan(tmp_path)][:2] == [(3, 8), (70, 7)]


def test_retention_ranks_by_step_so_a_raised_commit_never_removes_the_newest(tmp_path: Path, caplog: Any) -> None:
    """Finding 3 in manifests of the version before (no digest to refuse the raised commit): the
    resume takes the older step 40, saying so, and three saves later step 60 is still there (ranked
    by commit, retention removed it)."""
    saved(tmp_path, [20, 40, 60])
    for step in (20, 40, 60):
        as_earlier_version(tmp_path / mf.step_dir_name(step), **({"commit": 6} if step == 40 else {}))
    m = manager(tmp_path, keep_last=3)
    with caplog.at_level(logging.WARNING):
        assert m.restore({"model": Box()}, {}, False).step == 40  # type: ignore[union-attr]
    assert "step_000000060 holds a later step" in caplog.text
    for step in (45, 50, 55):
        m.save(step, {"model": Box({"w": torch.full((4,), float(step))})}, {}, {"epoch": 0})
    m.close()
    assert sorted(s for s, _ in mf.committed(tmp_path)) == [50, 55, 60]


def test_expendable_keeps_the_newest_by_step_the_resume_pick_and_milestones(tmp_path: Path) -> None:
    def listed(step: int, commit: int, epoch: int = 0) -> mf.Listed:
        return mf.Listed(step, tmp_path / mf.step_dir_name(step), {"commit": commit, "epoch": epoch, "batch_in_epoch": 0})

    order = [listed(100, 9), listed(300, 3, epoch=4), listed(200, 2), listed(150, 1)]  # scan's order: by commit
    assert mf.expendable(order, Policy(1), []) == [order[2].path, order[3].path]  # 300 (by step) and 100 (by commit) kept
    assert mf.expendable(order, Policy(1, 2), [order[3].path]) == [order[2].path]  # 150 kept as asked; 300 also a milestone


# ---- a rank file's own table of pieces, and coverage ---------------------------------------------
def _rank_file(tensors: Dict[str, torch.Tensor]) -> tuple:
    """The bytes of a rank file holding `tensors` whole (the replicated part of rank 0's file), and its table."""
    planned = sharded.plan({"m": tensors}, {}, skeleton=True, replicated=True)
    data = bytearray(b"".join(bytes(b) for b in planned.layout.buffers()))
    table = pt.tensor_table([("rank00000.bin", planned.pieces, planned.keys)])
    return data, table


def test_a_rank_file_s_own_table_of_pieces_must_match_the_manifest_s() -> None:
    data, table = _rank_file({"w": torch.arange(12.0).reshape(6, 2), "b": torch.ones(3)})
    meta = shard_reader.Reader(BufferSource({"rank00000.bin": data}), table, check_files=False).header("rank00000.bin").meta
    assert pt.mismatch("rank00000.bin", meta, table, pt.by_file(table)) is None
    moved = json.loads(json.dumps(table))
    moved["m.w"]["pieces"][0][0] = "rank00001.bin"  # the manifest names another file for it
    assert "rank00000.bin: tensor 'm.w'" in str(pt.mismatch("rank00000.bin", meta, moved, pt.by_file(moved)))
    retyped = json.loads(json.dumps(table))
    retyped["m.b"]["dtype"] = "F64"
    assert "tensor 'm.b' is ['F32', [3]] in it" in str(pt.mismatch("rank00000.bin", meta, retyped, pt.by_file(retyped)))
    assert "no readable table of its pieces" in str(pt.mismatch("rank00000.bin", {}, table, pt.by_file(table)))
    reader = shard_reader.Reader(BufferSource({"rank00000.bin": data}), moved)
    with pytest.raises(TensorFileError, match="the manifest does not describe its files"):
        reader.header("rank00000.bin")


def test_a_tensor_is_read_only_when_its_pieces_cover_it_exactly_once() -> None:
    """Two pieces of 6 rows at rows 0-5 and 3-8 of a 12-row tensor: their sizes add up to the whole,
    so a count of the values copied passes, while rows 9-11 come from no piece."""
    data, table = _rank_file({"w": torch.arange(12.0).reshape(6, 2)})
    piece = table["m.w"]["pieces"][0]
    crafted = {"m.w": {"dtype": "F32", "shape": [12, 2], "pieces": [piece, [piece[0], [3, 0], [6, 2]]]}}
    reader = shard_reader.Reader(BufferSource({"rank00000.bin": data}), crafted, check_files=False)  # past every other check
    with pytest.raises(TensorFileError, match="do not cover the 24 values needed exactly once"):
        reader.region("m.w", ((0, 0), (12, 2)))
    assert reader.region("m.w", ((0, 0), (3, 2))).tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]  # rows one piece holds


# ---- an optimizer's parameters, by name ----------------------------------------------------------
def _two_blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))


def _stepped(model: torch.nn.Module, params: List[Any]) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(params, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def test_an_optimizer_over_same_shaped_parameters_in_another_order_does_not_fit(tmp_path: Path) -> None:
    model = _two_blocks()
    opt = _stepped(model, list(model.parameters()))
    m = manager(tmp_path)
    m.save(3, {"model": model, "optimizer": opt}, {}, {"epoch": 0})
    m.close()
    names = mf.read(tmp_path / mf.step_dir_name(3))[mf.PARAMS]
    assert names == {"optimizer": [["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]]}

    live = _two_blocks()
    swapped = torch.optim.Adam([*live[2].parameters(), *live[0].parameters()], lr=0.1)
    assert optimizer_misfit(swapped, opt.state_dict()) is None  # every shape fits: only the names tell
    assert "params[0] is model.2.weight here, at param_groups[0].params[2]" in str(
        optimizer_misfit(swapped, opt.state_dict(), names["optimizer"], param_names({"model": live, "o": swapped})["o"])
    )
    with pytest.raises(CheckpointError, match="is model.2.weight here"):
        manager(tmp_path).restore({"model": live, "optimizer": swapped}, {}, False)
    as_earlier_version(tmp_path / mf.step_dir_name(3))  # an earlier version recorded no names
    assert manager(tmp_path).restore({"model": _two_blocks(), "optimizer": swapped}, {}, False) is not None  # by shape: fits


def test_manifest_params_are_validated(tmp_path: Path) -> None:
    saved(tmp_path, [1])
    base = mf.read(tmp_path / mf.step_dir_name(1))
    for bad in ("x", {"o": "x"}, {"o": [["a", 3]]}, {"o": [[None, "\x00"]]}):
        with pytest.raises(mf.ManifestError, match="'params'"):
            mf.validate({**base, mf.PARAMS: bad}, tmp_path, 1)
    assert mf.validate({**base, mf.PARAMS: {"o": [["model.w", None]]}}, tmp_path, 1)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_state_sharded_otherwise_than_its_parameter_does_not_fit(one_rank_group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    plain = _two_blocks()
    state = _stepped(plain, list(plain.parameters())).state_dict()  # plain tensors
    model = _two_blocks()
    fully_shard(model)
    problem = optimizer_misfit(torch.optim.Adam(model.parameters()), state)
    assert problem is not None and "not sharded in the checkpoint" in problem and "is sharded [Shard(dim=0)]" in problem
