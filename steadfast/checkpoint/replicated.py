"""The replicated format: every object's state is the same on every rank, and rank 0 writes it.

Format 4 (written): one file, `state.bin`, in the tensor file format (tensorformat), whose skeleton
is {"objects": {name: state, ...}, "ranks": [rank 0's own state, rank 1's, ...]} (the ranks' own
states gathered: a few KB of RNG states each). Tensors are named by their place: `model.net.0.weight`,
`optimizer.state.0.exp_avg`, `ranks.0.rng.torch`; any safetensors reader opens the file. One file is
one create, one gathered write and one fsync for the whole state, where a file per object cost one of
each per object (for a small state, the fsyncs were most of a save).
Format 2 (read, no longer written): one file per object, `<name>.bin`, and `ranks.bin` holding
{"ranks": [...]}.

A snapshot in memory keeps the objects once per node (local rank 0) and each rank's own state (the
Codec base's snapshot). Its formats' specs are replicated_spec's (no torch).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import manifest as mf
from . import tensorfile
from .codec import Codec, Collectives, Loaded, Planned, Unsaveable, Whole, register
from .replicated_spec import PER_OBJECT, REPLICATED
from .storage.base import FileCheckError, Files
from .tensorformat import gc_paused
from .tensorwrite import Layout, _place, _Planner

STATE_FILE = "state.bin"
OBJECTS, RANKS = "objects", "ranks"  # the keys of state.bin's tree; in format 2, `ranks` names ranks.bin too


def plan_state(objects: Dict[str, Any], ranks: List[Any]) -> Layout:
    """The layout of state.bin for these objects' states and every rank's own state."""
    planner = _Planner()
    nodes = []
    with gc_paused():
        for name, state in objects.items():
            if not mf.FILE_NAME.fullmatch(f"{name}.bin") or name == RANKS:
                raise Unsaveable(
                    f"an object named {name!r}",
                    "names are letters, digits, '_', '.', '-', unique, and not 'ranks' (the per-rank states)",
                )
            try:
                nodes.append([name, planner.encode(state, name, 1)])
            except (TypeError, ValueError) as exc:
                raise Unsaveable(name, str(exc)) from exc
        try:
            ranks_node = planner.encode(ranks, RANKS, 1)
        except (TypeError, ValueError) as exc:
            raise Unsaveable("the ranks' own states", str(exc)) from exc
    skeleton = {"__d": [[OBJECTS, {"__d": nodes}], [RANKS, ranks_node]]}
    return Layout(skeleton, planner.entries, _place(planner.entries))


@register
class ReplicatedCodec(Codec):
    spec = REPLICATED
    every_rank_writes = False
    catch_all = True

    def wants(self, objects: Dict[str, Any]) -> bool:
        return True

    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        gathered = comm.gather_object(own)
        if comm.rank != 0:
            return Planned({})
        ranks = gathered or []
        tree = {OBJECTS: objects, RANKS: ranks}  # what plan_state's skeleton is
        layout, _ = self.layout(STATE_FILE, (objects, ranks), tree, lambda: (plan_state(objects, ranks), None))
        return Planned({STATE_FILE: layout})

    def load(
        self, files: Files, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int, world_size: int
    ) -> Loaded:
        states, ranks = read_state(files, manifest, list(objects), own)
        return Loaded(states, ranks[rank] if rank < len(ranks) else None, len(ranks))

    def read_whole(self, files: Files, manifest: Dict[str, Any], names: Optional[Sequence[str]] = None) -> Whole:
        states, ranks = read_state(files, manifest, list(names or []), [])
        return Whole(dict(states) if names is None else {n: states[n] for n in names}, list(ranks))


@register
class PerObjectCodec(ReplicatedCodec):
    """Format 2, read only: checkpoints written before state.bin still resume."""

    spec = PER_OBJECT
    catch_all = False

    def wants(self, objects: Dict[str, Any]) -> bool:
        return False

    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        raise NotImplementedError("format 2 is read, not written")

    def load(
        self, files: Files, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int, world_size: int
    ) -> Loaded:
        states = load_checked(files, manifest, list(objects), own)
        ranks = states.pop(RANKS)[RANKS]
        return Loaded(states, ranks[rank] if rank < len(ranks) else None, len(ranks))

    def read_whole(self, files: Files, manifest: Dict[str, Any], names: Optional[Sequence[str]] = None) -> Whole:
        if names is None:
            states = load_checked(files, manifest, [], [])
            return Whole(states, list(states.pop(RANKS)[RANKS]))
        missing = [n for n in names if f"{n}.bin" not in manifest["files"]]
        if missing:
            raise FileCheckError(f"{files.where('')}: no {', '.join(n + '.bin' for n in missing)} in its manifest", "missing")
        ranks = _load(files, "ranks.bin", manifest["files"]["ranks.bin"]) if "ranks.bin" in manifest["files"] else None
        objects = {n: _load(files, f"{n}.bin", manifest["files"][f"{n}.bin"]) for n in names}
        return Whole(
            objects, _check_ranks(ranks.get(RANKS) if isinstance(ranks, dict) else None, files.where("ranks.bin"), manifest, [])
        )


def _check_ranks(ranks: Any, where: str, manifest: Dict[str, Any], per_rank: List[str]) -> List[Any]:
    if (
        not isinstance(ranks, list)
        or len(ranks) != manifest["world_size"]
        or not all(isinstance(r, dict) and all(n in r for n in per_rank) for r in ranks)
    ):
        raise FileCheckError(
            f"{where}: does not hold {per_rank} for each of the {manifest['world_size']} ranks the manifest names", "contents"
        )
    return ranks


def _load(files: Files, name: str, spec: Dict[str, Any]) -> Any:
    """The state in file `name`, verified against its manifest entry and parsed (nothing unpickled)."""
    return tensorfile.parse(files.read_verified(name, spec["bytes"], spec["checksum"]), files.where(name))


def read_state(
    files: Files, manifest: Dict[str, Any], objects: List[str], per_rank: List[str]
) -> Tuple[Dict[str, Any], List[Any]]:
    """(objects' states, every rank's own state) of a format-4 checkpoint: its one file verified
    against `manifest` and parsed, then checked to hold `objects` and, per saved rank, `per_rank`.
    Raises ValueError (FileCheckError: the checkpoint is bad), OSError or MemoryError."""
    where = files.where(STATE_FILE)
    spec = manifest["files"].get(STATE_FILE)
    if spec is None or len(manifest["files"]) != 1:
        raise FileCheckError(f"{files.where('')}: its manifest must list {STATE_FILE} and nothing else", "missing")
    tree = _load(files, STATE_FILE, spec)
    if not isinstance(tree, dict) or set(tree) != {OBJECTS, RANKS} or not isinstance(tree[OBJECTS], dict):
        raise FileCheckError(f"{where}: not the state of a checkpoint ({OBJECTS!r} and {RANKS!r})", "contents")
    missing = [n for n in objects if n not in tree[OBJECTS]]
    if missing:
        raise FileCheckError(f"{where}: holds no {', '.join(missing)}", "missing")
    return tree[OBJECTS], _check_ranks(tree[RANKS], where, manifest, per_rank)


def load_checked(files: Files, manifest: Dict[str, Any], objects: List[str], per_rank: List[str]) -> Dict[str, Any]:
    """Every file of a format-2 checkpoint, verified against `manifest` and parsed, after checking it
    holds `objects` and, per saved rank, `per_rank`. Raises ValueError (FileCheckError: the
    checkpoint is bad), OSError or MemoryError (it could not be read now)."""
    missing = [n for n in [*objects, RANKS] if f"{n}.bin" not in manifest["files"]]
    if missing:
        raise FileCheckError(f"{files.where('')}: no {', '.join(n + '.bin' for n in missing)} in its manifest", "missing")
    states = {name[:-4]: _load(files, name, spec) for name, spec in manifest["files"].items()}
    ranks = states[RANKS].get(RANKS) if isinstance(states[RANKS], dict) else None
    _check_ranks(ranks, files.where("ranks.bin"), manifest, per_rank)
    return states
