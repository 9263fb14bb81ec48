"""The checkpoint file format: safetensors-compatible, and its readers only ever return a value or
their own error, in bounded memory and time, whatever bytes they are given (property-based)."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import tensorfile
from steadfast.checkpoint.manager import CheckpointManager
from steadfast.distributed.comm import Comm

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load as st_load  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

MEMORY_CAP = 64 << 20  # tracemalloc peak allowed for parsing one input (the header cap is 8 MiB)
SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("FUZZ_EXAMPLES", "150")),
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- compatibility ------------------------------------------------------------------------------
def test_a_checkpoint_file_opens_with_safetensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2).to(torch.bfloat16))
    opt = torch.optim.Adam(model[0].parameters())
    model[0](torch.randn(4, 5)).sum().backward()
    opt.step()
    m = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None)
    m.save(3, {"model": model, "optimizer": opt}, {}, {"epoch": 1})
    m.close()
    ckpt = tmp_path / mf.step_dir_name(3)
    assert set(json.loads((ckpt / mf.MANIFEST).read_text())["files"]) == {"state.bin"}  # one file for the whole state
    with safe_open(str(ckpt / "state.bin"), "pt") as f:
        assert f.metadata()["format"] == "pt"
        got = {k: f.get_tensor(k) for k in f.keys()}
    model_keys = {f"model.{k}" for k in model.state_dict()}
    assert model_keys <= got.keys() and all(torch.equal(got[f"model.{k}"], v) for k, v in model.state_dict().items())
    optimizer = load_file(str(ckpt / "state.bin"))
    assert torch.equal(optimizer["optimizer.state.0.exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _write_format_2(folder: Path, step: int, objects: Dict[str, Any], ranks: list) -> None:
    """A committed checkpoint as the replicated format 2 wrote it: a file per object and ranks.bin."""
    tmp = folder / f".tmp-{step}"
    tmp.mkdir(parents=True)
    files = {}
    for name, tree in [*objects.items(), ("ranks", {"ranks": ranks})]:
        size, checksum = tensorfile.save(tree, tmp / f"{name}.bin")
        files[f"{name}.bin"] = {"bytes": size, "checksum": checksum}
    manifest = {"format": 2, "step": step, "commit": 1, "world_size": len(ranks), "created": 1.0, "epoch": 1}
    (tmp / mf.MANIFEST).write_text(json.dumps({**manifest, "files": files, "config": {}, "full_config": {}}))
    tmp.rename(folder / mf.step_dir_name(step))


def test_a_checkpoint_of_format_2_still_resumes_and_consolidates(tmp_path: Path) -> None:
    from steadfast.checkpoint.consolidate import consolidate, load_whole

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    _write_format_2(tmp_path, 4, {"model": model.state_dict(), "extra": {"n": 7}}, [{"rng": {"seed": 11}}])
    target, extra, rng = torch.nn.Linear(3, 2), Holder(), Holder()
    m = CheckpointManager(tmp_path, Comm(), 2, {}, lambda *a, **k: None)
    restored = m.restore({"model": target, "extra": extra}, {"rng": rng}, False)
    assert restored is not None and restored.step == 4 and restored.manifest["format"] == 2
    assert torch.equal(target.weight, model.weight) and extra.state == {"n": 7} and rng.state == {"seed": 11}
    m.save(5, {"model": target, "extra": extra}, {"rng": rng}, {"epoch": 1})  # the next save writes the new format
    m.close()
    assert json.loads((tmp_path / mf.step_dir_name(5) / mf.MANIFEST).read_text())["format"] == mf.FORMAT
    for step in (4, 5):
        ckpt = tmp_path / mf.step_dir_name(step)
        consolidate(ckpt, tmp_path / f"model{step}.safetensors")
        assert torch.equal(load_file(str(tmp_path / f"model{step}.safetensors"))["weight"], model.weight)
        assert load_whole(ckpt, ["extra"]) == {"extra": {"n": 7}}


class Holder:
    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_export_and_files_written_by_safetensors_round_trip(tmp_path: Path) -> None:
    state = {
        "b": torch.arange(3, dtype=torch.int64),
        "a.weight": torch.randn(4, 4),
        "h": torch.ones(3, dtype=torch.float16),
        "empty": torch.zeros(0, 5),
        "flags": torch.tensor([True, False]),
    }
    size, checksum = tensorfile.export_safetensors(state, tmp_path / "model.safetensors")
    assert size == (tmp_path / "model.safetensors").stat().st_size and checksum.startswith("xxh3_128:")
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    save_file(state, str(tmp_path / "theirs.safetensors"))
    ours = tensorfile.load(tmp_path / "theirs.safetensors")
    assert ours.keys() == state.keys() and all(torch.equal(ours[k], v) for k, v in state.items())
    with pytest.raises(TypeError, match="complex128"):
        tensorfile.export_safetensors({"z": torch.zeros(1, dtype=torch.complex128)}, tmp_path / "z.safetensors")
    assert not list(tmp_path.glob(".*tmp"))


# ---- the parser, fed anything -------------------------------------------------------------------
def _valid_file() -> bytes:
    g = torch.Generator().manual_seed(1)
    tree = {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "flag": torch.tensor([True, False]),
        "np": np.arange(3, dtype=np.uint32),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "nested": {1: (2.5, None, "x", float("inf")), "l": [torch.zeros(0, 2), torch.tensor(7.0)]},
    }
    layout = tensorfile.plan(tree)
    return b"".join(bytes(memoryview(b).cast("B")) for b in layout.buffers())


VALID = _valid_file()
HEADER_LEN = int.from_bytes(VALID[:8], "little")
HEADER = json.loads(VALID[8 : 8 + HEADER_LEN])
DATA = VALID[8 + HEADER_LEN :]
NAMES = sorted(k for k in HEADER if k != "__metadata__")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=30,
)
shape_items = st.one_of(st.integers(-(2**66), 2**66), st.integers(0, 8), st.booleans(), st.floats(), st.text(max_size=2))


def _with_header(header: Dict[str, Any], data: bytes = DATA) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@st.composite
def header_edits(draw: Any) -> bytes:
    header = json.loads(json.dumps(HEADER))
    name = draw(st.sampled_from(NAMES))
    kind = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "extra", "tree", "tree-text", "meta", "rename", "data"]))
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = draw(st.sampled_from([*tensorfile.DTYPES, "F128", "", "f32", "F4"]) | json_values)
    elif kind == "shape":
        entry["shape"] = draw(st.lists(shape_items, max_size=6) | json_values)
    elif kind == "offsets":
        entry["data_offsets"] = draw(
            st.lists(st.integers(-5, 2**64 + 5) | st.integers(0, len(DATA) + 2), max_size=3) | json_values
        )
    elif kind == "drop":
        del entry[draw(st.sampled_from(sorted(entry)))]
    elif kind == "extra":
        header[draw(st.text(max_size=6))] = draw(json_values)
    elif kind == "tree":
        header["__metadata__"][tensorfile.TREE_KEY] = json.dumps(draw(json_values))
    elif kind == "tree-text":
        tree = header["__metadata__"][tensorfile.TREE_KEY]
        at = draw(st.integers(0, len(tree)))
        header["__metadata__"][tensorfile.TREE_KEY] = tree[:at] + draw(st.text(max_size=6)) + tree[at + draw(st.integers(0, 6)) :]
    elif kind == "meta":
        header["__metadata__"] = draw(json_values)
    elif kind == "rename":
        header[draw(st.text(max_size=6))] = header.pop(name)
    data = DATA
    if kind == "data":
        data = DATA[: draw(st.integers(0, len(DATA)))] + draw(st.binary(max_size=16))
    return _with_header(header, data)


@st.composite
def mutations(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "header", "bytes", "duplicate"]))
    if kind == "truncate":
        return VALID[: draw(st.integers(0, len(VALID) - 1))]
    if kind == "flip":
        data = bytearray(VALID)
        for pos, bit in draw(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 7)), min_size=1, max_size=8)):
            data[pos] ^= 1 << bit
        return bytes(data)
    if kind == "header":
        return draw(header_edits())
    if kind == "duplicate":  # the same tensor named twice in the JSON text
        text = json.dumps(HEADER)
        name = draw(st.sampled_from(NAMES))
        entry = json.dumps({name: HEADER[name]})[1:-1]
        text = text[:-1] + ", " + entry + "}"
        return len(text).to_bytes(8, "little") + text.encode() + DATA
    return draw(st.binary(max_size=512))


def _touch(value: Any) -> None:
    """Use every tensor the parser returned (a bad view would crash here)."""
    if isinstance(value, torch.Tensor):
        value.clone()
    elif isinstance(value, np.ndarray):
        np.array(value, copy=True)
    elif isinstance(value, dict):
        for v in value.values():
            _touch(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _touch(v)


def _parse_bounded(data: bytes) -> Any:
    tracemalloc.start()
    try:
        try:
            value = tensorfile.parse(bytearray(data))
        except tensorfile.TensorFileError:
            value = tensorfile.TensorFileError
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_CAP, f"parsing {len(data)} bytes peaked at {peak} bytes"
    return value


@SETTINGS
@given(mutations())
def test_the_parser_returns_a_value_or_its_own_error(data: bytes) -> None:
    value = _parse_bounded(data)
    if value is not tensorfile.TensorFileError:
        _touch(value)
        st_load(data)  # what we accept, safetensors accepts too (we are stricter, never looser)


def test_the_valid_file_parses_and_large_headers_are_refused_in_bounded_memory() -> None:
    assert _parse_bounded(VALID)["nested"][1] == (2.5, None, "x", float("inf"))
    empty_lists = "[" + ",".join(["[]"] * 2_000_000) + "]"  # ~6 MiB of tiny containers: under the byte cap
    assert _parse_bounded(_with_header({"__metadata__": {tensorfile.TREE_KEY: empty_lists}}, b"")) is tensorfile.TensorFileError
    huge = (tensorfile.MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}"
    assert _parse_bounded(huge) is tensorfile.TensorFileError


def test_an_empty_tensor_whose_strides_overflow_is_the_parser_s_own_error() -> None:
    """Zero elements need no bytes, so the size check passed; torch.empty then raised RuntimeError
    ("Stride calculation overflowed"), which escaped the fall-back."""
    for shape in ([0, 2**62, 2**62], [2**62, 0, 2**62], [0, 2**61, 4, 2]):
        crafted = _with_header({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}, b"")
        with pytest.raises(tensorfile.TensorFileError, match="too large for a tensor"):
            tensorfile.parse(bytearray(crafted))
    ok = tensorfile.parse(
        bytearray(_with_header({"w": {"dtype": "F32", "shape": [0, 1 << 20, 1 << 20], "data_offsets": [0, 0]}}, b""))
    )
    assert ok["w"].shape == (0, 1 << 20, 1 << 20)  # an empty tensor of a real shape still loads


# ---- the manifest reader, fed anything ----------------------------------------------------------
def _manifest() -> Dict[str, Any]:
    return {
        "format": mf.FORMAT,
        "step": 5,
        "commit": 3,
        "world_size": 2,
        "created": 1.5,
        "epoch": 1,
        "files": {"model.bin": {"bytes": 10, "checksum": "xxh3_128:" + "0" * 32}},
        "config": {},
        "full_config": {},
    }


@st.composite
def manifests(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["value", "edit", "bytes"]))
    if kind == "value":
        return json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=256))
    m = _manifest()
    key = draw(st.sampled_from([*m, "files.model.bin", "files.model.bin.bytes", "files.model.bin.checksum", "files.name"]))
    value = draw(json_values | st.integers(-(2**70), 2**70))
    if key == "files.name":
        m["files"][draw(st.text(max_size=12))] = m["files"]["model.bin"]
    elif key.startswith("files.model.bin."):
        m["files"]["model.bin"][key.rsplit(".", 1)[1]] = value
    elif key == "files.model.bin":
        m["files"]["model.bin"] = value
    else:
        m[key] = value
    return json.dumps(m).encode()


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(manifests())
def test_the_manifest_reader_returns_a_manifest_or_its_own_error(tmp_path: Path, data: bytes) -> None:
    ckpt = tmp_path / mf.step_dir_name(5)
    ckpt.mkdir(exist_ok=True)
    (ckpt / mf.MANIFEST).write_bytes(data)
    try:
        manifest = mf.read(ckpt)
    except mf.ManifestError:
        manifest = None
    if manifest is not None:  # then every field the readers use has its type
        assert manifest["step"] == 5 and isinstance(manifest["commit"], int)
        assert all(isinstance(s["bytes"], int) and isinstance(s["checksum"], str) for s in manifest["files"].values())
    listed = mf.scan(tmp_path)
    assert [c.step for c in listed] == [5] and (listed[0].manifest is None) == (manifest is None)
    assert (mf.newest_manifest(tmp_path) is None) == (manifest is None)


def test_a_valid_manifest_reads_back() -> None:
    random.seed(0)
    assert mf.validate(_manifest(), Path("x"), 5)["commit"] == 3
