"""`steadfast-consolidate CHECKPOINT [-o model.safetensors]`: one plain safetensors file of a model from
a committed checkpoint, sharded (each rank's pieces put together) or not, for any safetensors reader.

CHECKPOINT is a checkpoint folder (`.../checkpoints/step_000000100`) or a run folder (its newest
committed checkpoint). Every file is verified against the manifest first; nothing is unpickled;
the whole tensors are assembled one at a time, so memory holds one tensor, not the model. An
existing output file is never replaced unless --force.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import export, tensorfile
from . import manifest as mf
from . import restore as rs
from .piecetable import SHARDED
from .replicated import read_objects
from .sharded import OBJECTS, Reader, assemble, file_name
from .storage.base import FileCheckError
from .tensorformat import CODES


class ConsolidateError(Exception):
    """Why a checkpoint cannot be consolidated (one line)."""


def checkpoint_of(path: Path) -> Path:
    """The checkpoint folder `path` names: itself, or a run folder's newest committed checkpoint."""
    if (path / mf.MANIFEST).is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [c for c in mf.scan(folder) if c.manifest is not None]
    if not found:
        raise ConsolidateError(
            f"{path}: neither a checkpoint folder (no {mf.MANIFEST}) nor a folder holding committed checkpoints"
        )
    return Path(found[0].path)


def consolidate(checkpoint: Path, out: Path, name: str = "model", force: bool = False) -> Dict[str, Any]:
    """Write object `name`'s state (a flat name -> tensor dict: a model's state_dict) of the committed
    checkpoint as one safetensors file at `out`; returns what was written."""
    if out.exists() and not force:
        raise ConsolidateError(f"{out} exists; choose another -o or pass --force to replace it")
    manifest = mf.read(checkpoint)
    problem = rs.verify_at(checkpoint)
    if problem:
        raise ConsolidateError(f"{checkpoint} does not verify: {problem}")
    if manifest["format"] == SHARDED.number:
        listed, value, close = _sharded(checkpoint, manifest, name)
    else:
        listed, value, close = _replicated(checkpoint, manifest, name)
    try:
        export.write(out, listed, value)
    finally:
        close()
    return {"checkpoint": str(checkpoint), "step": manifest["step"], "object": name, "tensors": len(listed), "file": str(out)}


Listed = List[Tuple[str, str, Tuple[int, ...]]]


def _flat(state: Any, name: str, where: Path) -> Dict[str, Any]:
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConsolidateError(f"{where}: {name} is not a flat name -> tensor state (a model's state_dict)")
    return state


def _sharded(checkpoint: Path, manifest: Dict[str, Any], name: str) -> Tuple[Listed, Any, Any]:
    source = rs.files_at(checkpoint, manifest)
    close = source.close
    try:
        reader = Reader(source, manifest["tensors"])
        for file in manifest["files"]:  # every file's own table of pieces agrees with the manifest's
            reader.header(file)
        objects = reader.tree(file_name(0)).get(OBJECTS)
        if not isinstance(objects, dict) or name not in objects:
            raise ConsolidateError(f"{checkpoint} holds no object {name!r} (it holds {sorted(objects or {})})")
        state = _flat(objects[name], name, checkpoint)
        refs = {k: v for k, v in state.items() if isinstance(v, tensorfile.ShardRef)}
        listed = [(k, manifest["tensors"][r.key]["dtype"], tuple(manifest["tensors"][r.key]["shape"])) for k, r in refs.items()]
    except BaseException:
        close()
        raise

    def value(k: str) -> Any:
        whole = tuple(manifest["tensors"][refs[k].key]["shape"])
        return reader.region(refs[k].key, ((0,) * len(whole), whole))

    return listed, value, close


def _replicated(checkpoint: Path, manifest: Dict[str, Any], name: str) -> Tuple[Listed, Any, Any]:
    try:
        with rs.files_at(checkpoint, manifest) as files:
            state = _flat(read_objects(files, manifest, [name])[name], name, checkpoint)
    except FileCheckError as exc:
        if exc.reason != "missing":
            raise
        raise ConsolidateError(f"{checkpoint} holds no object {name!r} ({exc})") from None
    tensors = {k: v for k, v in state.items() if hasattr(v, "dtype") and v.dtype in CODES}
    listed = [(k, CODES[t.dtype], tuple(t.shape)) for k, t in tensors.items()]
    return listed, tensors.__getitem__, lambda: None


def load_whole(checkpoint: Union[str, Path], names: Sequence[str]) -> Dict[str, Any]:
    """The states of the objects `names` in a committed checkpoint, in one process and with whole
    tensors, whatever the format (sampling from a trained model, say). Every file is verified first.
    Raises ConsolidateError, or ValueError/OSError for a checkpoint that cannot be read."""
    manifest = mf.read(checkpoint)
    problem = rs.verify_at(checkpoint)
    if problem:
        raise ConsolidateError(f"{checkpoint} does not verify: {problem}")
    if manifest["format"] != SHARDED.number:
        try:
            with rs.files_at(checkpoint, manifest) as files:
                return read_objects(files, manifest, list(names))
        except FileCheckError as exc:
            if exc.reason != "missing":
                raise
            raise ConsolidateError(f"{checkpoint} holds no {list(names)}: {exc}") from None
    with rs.files_at(checkpoint, manifest) as source:
        reader = Reader(source, manifest["tensors"])
        for file in manifest["files"]:
            reader.header(file)
        objects = reader.tree(file_name(0)).get(OBJECTS) or {}
        missing = [n for n in names if n not in objects]
        if missing:
            raise ConsolidateError(f"{checkpoint} holds no {missing}")
        return {n: assemble(objects[n], None, reader, (), lambda _path: None) for n in names}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="steadfast-consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, or a run folder (its newest checkpoint)")
    parser.add_argument("-o", "--output", type=Path, default=Path("model.safetensors"), help="default: model.safetensors")
    parser.add_argument("--object", default="model", help="which tracked object (run.resume's name); default: model")
    parser.add_argument("--force", action="store_true", help="replace the output file if it exists")
    args = parser.parse_args(argv)
    try:
        done = consolidate(checkpoint_of(args.checkpoint), args.output, args.object, args.force)
    except (ConsolidateError, ValueError, OSError) as exc:  # ManifestError, FileCheckError, TensorFileError are ValueErrors
        print(f"steadfast-consolidate: {exc}", file=sys.stderr)
        return 1
    print(f"{done['file']}: {done['tensors']} tensors of {done['object']} from {done['checkpoint']} (step {done['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
