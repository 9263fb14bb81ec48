"""A new checkpoint format is one module and its registration, shown by doing it: a toy codec written
into a scratch folder (not shipped) registers itself and its manifest field's check, and a
CheckpointManager saves with it and restores from it, falling back where its own field is damaged.
A manifest of a format this process does not read is unusable (fall back), never an exception; the
manifest's validation, a sharded manifest's tensor table included, needs no torch (the launcher's
pre-flight runs it)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from safetensors.torch import load_file

from helpers import Box, Recorder, env
from steadfast.checkpoint import codec, formats, formatspec
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint.compare import read_states
from steadfast.checkpoint.consolidate import ConsolidateError, consolidate, load_whole
from steadfast.checkpoint.formatspec import FormatSpec
from steadfast.checkpoint.manager import CheckpointManager
from steadfast.checkpoint.replicated import ReplicatedCodec
from steadfast.contract.events import Event
from steadfast.distributed.comm import Comm

# One module: a format of its own (99, "toy"): rank 0 writes toy.bin; the manifest names the objects
# it holds (`toy_objects`), a field only the toy's own check knows.
TOY_MODULE = '''
"""format 99: rank 0 writes toy.bin (every object's state, every rank's own); the manifest lists the objects."""
from typing import Any, Dict, List, Optional

from steadfast.checkpoint import tensorfile
from steadfast.checkpoint.codec import Codec, Collectives, Loaded, Planned, Whole, register
from steadfast.checkpoint.formatspec import FormatSpec
from steadfast.checkpoint.storage.base import FileCheckError, Files

FILE = "toy.bin"


def toy_fields(manifest: Dict[str, Any]) -> Optional[str]:
    names = manifest.get("toy_objects")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return "'toy_objects' must list the names of the objects it holds"
    if list(manifest["files"]) != [FILE]:
        return f"'files' must be {FILE} alone"
    return None


@register
class ToyCodec(Codec):
    spec = FormatSpec(99, "toy", toy_fields)
    every_rank_writes = False

    def wants(self, objects: Dict[str, Any]) -> bool:
        return True  # any state: registered, it is asked before the replicated codec, the catch-all

    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        ranks = comm.gather_object(own)
        if comm.rank != 0:
            return Planned({})
        return Planned({FILE: tensorfile.plan({"objects": objects, "ranks": ranks})}, {"toy_objects": sorted(objects)})

    def manifest_fields(self, reports: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"toy_objects": reports[0]["toy_objects"]}

    def load(self, files: Files, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int,
             world_size: int) -> Loaded:
        spec = manifest["files"][FILE]
        tree = tensorfile.parse(files.read_verified(FILE, spec["bytes"], spec["checksum"]), files.where(FILE))
        if not isinstance(tree, dict) or sorted(tree.get("objects", {})) != manifest["toy_objects"]:
            raise FileCheckError(f"{files.where(FILE)}: does not hold the objects its manifest lists", "contents")
        ranks = tree["ranks"]
        return Loaded(tree["objects"], ranks[rank] if rank < len(ranks) else None, len(ranks))

    def read_whole(self, files: Files, manifest: Dict[str, Any], names: Optional[List[str]] = None) -> Whole:
        spec = manifest["files"][FILE]
        tree = tensorfile.parse(files.read_verified(FILE, spec["bytes"], spec["checksum"]), files.where(FILE))
        missing = [n for n in names or [] if n not in tree["objects"]]
        if missing:
            raise FileCheckError(f"{files.where(FILE)}: holds no {missing}", "missing")
        return Whole({n: tree["objects"][n] for n in (names or tree["objects"])}, tree["ranks"])
'''


def state(step: int) -> Dict[str, Box]:
    return {"model": Box({"w": torch.full((300,), float(step)), "b": torch.arange(3.0) + step})}


def save(m: CheckpointManager, steps: List[int]) -> None:
    for step in steps:
        m.save(step, state(step), {"rng": Box({"seed": torch.tensor([step])})}, {"epoch": step})
        m.wait()


def restored_step(m: CheckpointManager) -> Any:
    target, rng = {"model": Box({"w": torch.zeros(300), "b": torch.zeros(3)})}, {"rng": Box({"seed": torch.tensor([0])})}
    r = m.restore(target, rng, False)
    if r is None:
        return None
    assert float(target["model"].state["w"][0]) == r.step and int(rng["rng"].state["seed"][0]) == r.step  # that step's bytes
    return r.step


def reseal(folder: Path, step: int, change: Callable[[Dict[str, Any]], None]) -> None:
    """Rewrite a committed manifest with `change` made, its digest made to match (damage a digest cannot see)."""
    path = folder / mf.step_dir_name(step) / mf.MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_bytes(mf.seal(data))


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The toy's module imported from a scratch folder, into copies of the registries (undone after)."""
    monkeypatch.setattr(codec, "_CODECS", dict(codec._CODECS))
    monkeypatch.setattr(formatspec, "_SPECS", dict(formatspec._SPECS))
    scratch = tmp_path / "plugins"
    scratch.mkdir()
    (scratch / "steadfast_toy_codec.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(scratch))
    try:
        yield importlib.import_module("steadfast_toy_codec")
    finally:
        sys.modules.pop("steadfast_toy_codec", None)


def test_a_new_format_is_one_module_and_its_registration(tmp_path: Path, toy: Any) -> None:
    assert 99 in formatspec.numbers() and isinstance(formats.for_state({"model": {}}), toy.ToyCodec)
    folder, events = tmp_path / "ck", Recorder()
    m = CheckpointManager(folder, Comm(), 3, {"a": 1}, events)
    save(m, [1, 2])
    m.close()
    m = CheckpointManager(folder, Comm(), 3, {"a": 1}, events, async_save=True)  # the background save's path too
    save(m, [3])
    for step in (1, 2, 3):
        written = mf.read(folder / mf.step_dir_name(step))
        assert (written["format"], written["toy_objects"], list(written["files"])) == (99, ["model"], [toy.FILE])
    assert restored_step(m) == 3
    # read whole in one process (steadfast-verify, steadfast-consolidate) through the toy's own reader
    whole = read_states(folder / mf.step_dir_name(3))
    assert whole.step == 3 and float(whole.objects["model"]["w"][0]) == 3 and int(whole.ranks[0]["rng"]["seed"][0]) == 3
    consolidate(folder / mf.step_dir_name(2), tmp_path / "model.safetensors")
    assert float(load_file(tmp_path / "model.safetensors")["w"][0]) == 2
    with pytest.raises(ConsolidateError, match="holds no"):
        load_whole(folder / mf.step_dir_name(2), ["optimizer"])
    # the toy's own field damaged where the digest cannot see it: its own check refuses it, and the
    # resume falls back; the manifest's common fields never knew of the field
    reseal(folder, 3, lambda d: d.update(toy_objects="model"))
    reseal(folder, 2, lambda d: d["files"].update({"extra.bin": d["files"][toy.FILE]}))
    assert restored_step(m) == 1
    invalid = events.of(Event.CHECKPOINT_INVALID)
    assert [e["step"] for e in invalid] == [3, 2]
    assert "'toy_objects' must list" in invalid[0]["error"] and "'files' must be toy.bin alone" in invalid[1]["error"]
    m.close()


def test_a_format_this_process_does_not_read_is_unusable_never_an_exception(tmp_path: Path) -> None:
    folder, events = tmp_path / "ck", Recorder()
    m = CheckpointManager(folder, Comm(), 5, {"a": 1}, events)
    save(m, [1, 2, 3, 4])
    reseal(folder, 4, lambda d: d.update(format=77))  # a later version's format, say
    reseal(folder, 3, lambda d: d.update(format=[4]))  # not a number at all (unhashable)
    reseal(folder, 2, lambda d: d.update(format=True))  # a bool is not format 1
    listed = mf.scan(folder)
    assert [c.step for c in listed if c.manifest is not None] == [1]
    unusable = {c.step: c.error for c in listed if c.manifest is None}
    assert "format '77'; this version reads formats 2, 3, 4" in str(unusable[4]) and set(unusable) == {2, 3, 4}
    assert restored_step(m) == 1
    assert sorted(e["step"] for e in events.of(Event.CHECKPOINT_INVALID)) == [2, 3, 4]
    m.close()


def test_the_registry_refuses_a_second_owner_of_a_format_and_a_check_that_raises_is_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codec, "_CODECS", dict(codec._CODECS))
    monkeypatch.setattr(formatspec, "_SPECS", dict(formatspec._SPECS))
    other = type("OtherCodec", (ReplicatedCodec,), {"__module__": "elsewhere"})
    with pytest.raises(ValueError, match="format 4 is registered by steadfast.checkpoint.replicated.ReplicatedCodec"):
        codec.register(other)
    with pytest.raises(ValueError, match="format 4 is registered as 'replicated'"):
        formatspec.register(FormatSpec(5, "replicated"))
    codec.register(ReplicatedCodec)  # its module executed again: the same codec, still there once
    assert [c.__name__ for c in codec.codecs()].count("ReplicatedCodec") == 1

    def raises(manifest: Dict[str, Any]) -> None:
        raise KeyError("tensors")

    formatspec.register(FormatSpec(98, "broken", raises))  # type: ignore[arg-type]
    manifest = {**_sharded(), "format": 98}
    with pytest.raises(mf.ManifestError, match=r"format 98 \(broken\): its fields cannot be checked \(KeyError"):
        mf.validate(manifest, "here")
    with pytest.raises(ValueError, match="no codec that reads it"):  # a spec without its codec: unusable here
        formats.for_manifest(manifest)


def _sharded(tensors: Any = None) -> Dict[str, Any]:
    files = {f"rank0000{r}.bin": {"bytes": 64, "checksum": "xxh3_128:" + "0" * 32} for r in (0, 1)}
    pieces = [["rank00000.bin", [0], [4]], ["rank00001.bin", [4], [4]]]
    return {
        "format": 3,
        "step": 1,
        "commit": 1,
        "world_size": 2,
        "created": 1.0,
        "config": {},
        "full_config": {},
        "files": files,
        "tensors": {"model.w": {"dtype": "F32", "shape": [8], "pieces": pieces}} if tensors is None else tensors,
    }


def test_the_sharded_formats_own_check_runs_without_torch(tmp_path: Path) -> None:
    """The pre-flight's view: a sharded checkpoint's manifest listed and validated, its tensor table
    checked by the sharded format's own check, with no torch imported."""
    crafted = {
        1: _sharded(),
        2: _sharded(
            {"model.w": {"dtype": "F32", "shape": [8], "pieces": [["rank00000.bin", [0], [5]], ["rank00001.bin", [3], [3]]]}}
        ),
        3: _sharded({"model.w": {"dtype": ["F32"], "shape": [8], "pieces": []}}),  # a TypeError out of scan before
        4: _sharded({"model.w": {"dtype": "F32", "shape": [8], "pieces": [[["rank00000.bin"], [0], [8]]]}}),
    }
    for step, data in crafted.items():
        (tmp_path / mf.step_dir_name(step)).mkdir()
        (tmp_path / mf.step_dir_name(step) / mf.MANIFEST).write_bytes(mf.seal({**data, "step": step, "commit": step}))
    code = textwrap.dedent(f"""
        import sys
        from steadfast.checkpoint import manifest as mf
        listed = {{c.step: c for c in mf.scan({str(tmp_path)!r})}}
        assert 'torch' not in sys.modules, 'the manifest imported torch'
        assert listed[1].manifest is not None, listed[1].error
        for step in (2, 3, 4):
            print(step, listed[step].error)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert errors["2"].endswith("'tensors': tensor 'model.w': two pieces overlap")
    assert errors["3"].endswith(
        "'tensors': tensor 'model.w': needs a known dtype, a shape of non-negative ints and a list of pieces"
    )
    assert errors["4"].endswith(
        "'tensors': tensor 'model.w': a piece must be [a file of the manifest, offset, shape] of its rank"
    )
