"""The replicated format (manifest format 2): every object's state is the same on every rank.

Rank 0 writes one tensor file per object, `<name>.bin`, and `ranks.bin` with every rank's own state
(gathered: a few KB of RNG states each). Any safetensors reader opens each file. A snapshot in memory
keeps the objects once per node (local rank 0) and each rank's own state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from . import fileio, tensorfile
from . import manifest as mf
from .codec import OWN, SHARED, Codec, Collectives, Loaded, Planned, Unsaveable
from .tensorwrite import Layout

RANKS = "ranks"  # the file of every rank's own state: ranks.bin


class ReplicatedCodec(Codec):
    format = mf.FORMAT
    every_rank_writes = False

    def wants(self, objects: Dict[str, Any]) -> bool:
        return True

    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        gathered = comm.gather_object(own)
        if comm.rank != 0:
            return Planned({})
        files: Dict[str, Layout] = {}
        for name, tree in [*objects.items(), (RANKS, {RANKS: gathered})]:
            file = f"{name}.bin"
            if not mf.FILE_NAME.fullmatch(file) or file in files:
                raise Unsaveable(
                    f"an object named {name!r}",
                    "names are letters, digits, '_', '.', '-', unique, and not 'ranks' (the per-rank states)",
                )
            try:
                files[file] = tensorfile.plan(tree)
            except (TypeError, ValueError) as exc:
                raise Unsaveable(name, str(exc)) from exc
        return Planned(files)

    def load(
        self, path: Path, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int, world_size: int
    ) -> Loaded:
        states = load_checked(path, manifest, list(objects), own)
        ranks = states.pop(RANKS)[RANKS]
        return Loaded(states, ranks[rank] if rank < len(ranks) else None, len(ranks))

    def snapshot(self, objects: Dict[str, Any], own: Dict[str, Any], writes_objects: bool) -> Dict[str, Layout]:
        out = {OWN: tensorfile.plan(own)}
        if writes_objects:
            out[SHARED] = tensorfile.plan(objects)
        return out

    def snapshot_blobs(self) -> List[str]:
        return [SHARED, OWN]

    def load_snapshot(self, blobs: Dict[str, Any], objects: Dict[str, Any], rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        shared = tensorfile.parse(blobs[SHARED], SHARED)
        mine = tensorfile.parse(blobs[OWN], OWN)
        if not isinstance(shared, dict) or not all(name in shared for name in objects) or not isinstance(mine, dict):
            raise tensorfile.TensorFileError("the snapshot does not hold every tracked object", "contents")
        return shared, mine


def load_checked(path: Path, manifest: Dict[str, Any], objects: List[str], per_rank: List[str]) -> Dict[str, Any]:
    """Every file of the checkpoint at `path`, verified against `manifest` and parsed, after checking
    it holds `objects` and, per saved rank, `per_rank`. Raises ValueError (FileCheckError: the
    checkpoint is bad), OSError or MemoryError (it could not be read now)."""
    missing = [n for n in [*objects, RANKS] if f"{n}.bin" not in manifest["files"]]
    if missing:
        raise fileio.FileCheckError(f"{path}: no {', '.join(n + '.bin' for n in missing)} in its manifest", "missing")
    dir_fd = fileio.open_folder(path)
    try:
        states = {
            name[:-4]: tensorfile.load(path / name, spec["bytes"], spec["checksum"], dir_fd)
            for name, spec in manifest["files"].items()
        }
    finally:
        os.close(dir_fd)
    ranks = states[RANKS].get(RANKS) if isinstance(states[RANKS], dict) else None
    if (
        not isinstance(ranks, list)
        or len(ranks) != manifest["world_size"]
        or not all(isinstance(r, dict) and all(n in r for n in per_rank) for r in ranks)
    ):
        raise fileio.FileCheckError(
            f"{path / 'ranks.bin'}: does not hold {per_rank} for each of the {manifest['world_size']} ranks the manifest names",
            "contents",
        )
    return states
