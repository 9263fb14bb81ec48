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
from typing import Any, Callable, Dict, Optional, Sequence, TypeVar, Union

from . import export, formats
from . import manifest as mf
from . import restore as rs
from .storage.base import FileCheckError


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
    manifest = _verified(checkpoint)
    with rs.files_at(checkpoint, manifest) as files:
        tensors = _missing_is_an_error(checkpoint, lambda: formats.for_manifest(manifest).tensors(files, manifest, name))
        if tensors is None:
            raise ConsolidateError(f"{checkpoint}: {name} is not a flat name -> tensor state (a model's state_dict)")
        listed = [(k, t.dtype, t.shape) for k, t in tensors.items()]
        export.write(out, listed, lambda k: tensors[k].read())
    return {"checkpoint": str(checkpoint), "step": manifest["step"], "object": name, "tensors": len(listed), "file": str(out)}


def load_whole(checkpoint: Union[str, Path], names: Sequence[str]) -> Dict[str, Any]:
    """The states of the objects `names` in a committed checkpoint, in one process and with whole
    tensors, whatever the format (sampling from a trained model, say). Every file is verified first.
    Raises ConsolidateError, or ValueError/OSError for a checkpoint that cannot be read."""
    manifest = _verified(checkpoint)
    with rs.files_at(checkpoint, manifest) as files:
        return _missing_is_an_error(checkpoint, lambda: formats.for_manifest(manifest).read_whole(files, manifest, names).objects)


def _verified(checkpoint: Union[str, Path]) -> Dict[str, Any]:
    manifest = mf.read(checkpoint)
    problem = rs.verify_at(checkpoint)
    if problem:
        raise ConsolidateError(f"{checkpoint} does not verify: {problem}")
    return manifest


Read = TypeVar("Read")


def _missing_is_an_error(checkpoint: Union[str, Path], read: Callable[[], Read]) -> Read:
    try:
        return read()
    except FileCheckError as exc:
        if exc.reason != "missing":
            raise
        raise ConsolidateError(f"{checkpoint}: {exc}") from None


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
