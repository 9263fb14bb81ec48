"""Which checkpoint a resume uses, and the checks that make any bad checkpoint "unusable, fall back".

Rank 0 lists the committed checkpoints newest first by commit sequence (Chooser.candidates); the
ranks try them in that order, together (CheckpointManager.restore): each reads what it needs, every
byte checked against the manifest, parsed by the strict reader, and checked to fit the live objects
(`misfit`: keys, shapes; an optimizer's state against its live parameters: optimizers.py) before
anything is applied. Every failure on the way is an unusable checkpoint, never an exception that
escapes: it is named in the log and in events.jsonl (checkpoint_invalid), and once a usable one is
found (or a fresh start is allowed), the unusable ones tried are moved aside, not deleted. Resource
errors (out of memory, an I/O error) skip a checkpoint without moving it. The log warns when the
checkpoint chosen has a manifest without a digest (an earlier version's) or is not the newest by step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..contract.events import Event
from . import manifest as mf
from .codec import Collectives, Loaded
from .finite import nonfinite
from .formats import for_manifest
from .optimizers import optimizer_misfit, param_names
from .storage import Store, split
from .storage.base import Files, StoreError

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the message names the file and the cause."""


class StoreUnavailable(CheckpointError):
    """A save failed because its store could not be reached or written (storage.base.StoreError, after the
    client's own retries): nothing committed, the newest committed checkpoint intact; the run may go on
    and save again at its next checkpoint."""


def misfit(live: Any, saved: Any, path: str = "") -> Optional[str]:
    """Why `saved` cannot be loaded where the live state is `live` (None: it fits): a tensor of the
    live state must find a tensor of the same shape at its place; a module's state (an OrderedDict of
    tensors: what nn.Module.state_dict returns) must have exactly the live keys."""
    import torch

    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{path or 'the state'}: a tensor was expected, the checkpoint holds a {type(saved).__name__}"
        if tuple(live.shape) != tuple(saved.shape) or live.dtype != saved.dtype:
            return f"{path}: {saved.dtype} {list(saved.shape)} in the checkpoint, {live.dtype} {list(live.shape)} here"
        return None
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{path or 'the state'}: a dict was expected, the checkpoint holds a {type(saved).__name__}"
        if type(live).__name__ == "OrderedDict" and live and all(isinstance(v, torch.Tensor) for v in live.values()):
            missing, extra = sorted(set(live) - set(saved), key=str), sorted(set(saved) - set(live), key=str)
            if missing or extra:
                return f"{path or 'the state'}: keys missing {missing[:5]}, unexpected {extra[:5]}"
        for key, value in live.items():
            if key in saved:
                problem = misfit(value, saved[key], f"{path}.{key}" if path else str(key))
                if problem:
                    return problem
    return None


def check_fits(
    loaded: Loaded, objects: Dict[str, Any], per_rank: Dict[str, Any], params: Optional[Dict[str, Any]] = None
) -> None:
    """ValueError naming what does not fit, before anything is applied: each object's state against
    its live state (`misfit`), an optimizer's against its live parameters (`optimizer_misfit`; by
    name too where the manifest's `params` names them), and against the object's own `check_state`
    where it has one (the loop's progress, the RNG states: they refuse a state without setting any of it);
    then that no parameter or optimizer state holds a NaN or an infinity (checkpoint/finite.py)."""
    own = loaded.own or {}
    live_names = param_names(objects) if params else {}
    for name, obj in [*objects.items(), *(per_rank.items() if loaded.own is not None else [])]:
        state = loaded.objects.get(name) if name in objects else own.get(name)
        problem = misfit(obj.state_dict(), state, name) if name in objects else None
        if not problem and name in objects and _is_optimizer(obj):
            problem = optimizer_misfit(obj, state, (params or {}).get(name), live_names.get(name))
            problem = f"{name}.{problem}" if problem else None
        if problem:
            raise ValueError(f"does not fit this run's {name}: {problem}")
        check = getattr(obj, "check_state", None)
        if check is not None:
            check(state)
    poisoned = nonfinite(objects, loaded.objects)
    if poisoned:
        raise ValueError(f"{poisoned} holds a NaN or an infinity (a poisoned state is never resumed)")


def _is_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)


def verify(store: Store, name: str, checksums: bool = True) -> Optional[str]:
    """None when committed checkpoint `name` in `store` verifies (manifest, sizes, and with `checksums`
    every file's checksum); else why not. StoreError when the store cannot be reached now."""
    try:
        files = mf.read_in(store, name)["files"]
        with store.open(name, {n: spec["bytes"] for n, spec in files.items()}) as opened:
            for file, spec in files.items():
                opened.verify(file, spec["bytes"], spec["checksum"] if checksums else None)
    except StoreError:
        raise  # not read now: nothing known against it
    except (ValueError, OSError, MemoryError) as exc:
        return str(exc) or type(exc).__name__
    return None


def files_at(ckpt: Union[str, Path], manifest: Dict[str, Any]) -> Files:
    """The files of the committed checkpoint at a location, for reading (its manifest already read)."""
    store, name = split(ckpt)
    return store.open(name, {n: spec["bytes"] for n, spec in manifest["files"].items()})


def verify_at(ckpt: Union[str, Path], checksums: bool = True) -> Optional[str]:
    """`verify` of the checkpoint at a location (its folder, or `s3://.../step_000000100`)."""
    try:
        store, name = split(ckpt)
    except ValueError as exc:
        return str(exc)
    return verify(store, name, checksums)


class Chooser:
    """Rank 0's part of a resume: which committed checkpoints to try, newest first, what to say of the
    unusable ones, and which config changes a resume accepts (see the module's docstring)."""

    def __init__(
        self,
        store: Store,
        training_config: Dict[str, Any],
        full_config: Dict[str, Any],
        on_event: Callable[..., None],
        set_aside: Callable[[Optional[int], str, str, str], Any],
    ) -> None:
        self.store, self.training_config, self.full_config = store, training_config, full_config
        self.on_event, self.set_aside = on_event, set_aside
        self.problems: List[str] = []
        self.movable: List[Tuple[int, str, str, str]] = []  # (step, name, reason, error): bad for good, not just now
        self.newest: Optional[mf.Listed] = None  # the newest by step whose manifest is valid

    def unusable(self, step: int, name: str, error: str, reason: Optional[str]) -> None:
        """Name an unusable checkpoint (`reason`: why it is bad for good, so it may be moved aside; None: not now)."""
        log.warning("Checkpoint %s is unusable, trying an older one: %s", self.store.where(name), error)
        self.on_event(Event.CHECKPOINT_INVALID, step=step, path=self.store.where(name), error=error)
        self.problems.append(f"{name}: {error}")
        if reason is not None:
            self.movable.append((step, name, reason, error))

    def candidates(self, allow_config_change: bool) -> List[Tuple[str, Dict[str, Any], Optional[str]]]:
        """(name, manifest, refusal) of every committed checkpoint whose manifest is valid, newest first;
        `refusal` says why a resume from it is refused (its training config differs). Checkpoints whose
        manifest is unusable are named (and may be moved aside once the resume knows where it starts)."""
        out = []
        for c in mf.scan(self.store):
            if c.manifest is None:
                self.unusable(c.step, c.name, c.error or "unreadable manifest", "manifest")
                continue
            if self.newest is None or c.step > self.newest.step:
                self.newest = c
            diff = mf.changes(c.manifest["config"], self.training_config)
            refusal = None
            if diff and not allow_config_change:
                refusal = (
                    f"checkpoint {c.path} was made with a different training config; refusing to resume. Changed: "
                    f"{mf.describe_changes(diff)}. Restore those values, choose another run.name, or set "
                    "run.allow_config_change=true to resume anyway"
                )
            out.append((c.name, c.manifest, refusal))
        return out

    def chosen(self, name: str, manifest: Dict[str, Any]) -> None:
        """The resume starts from checkpoint `name`: the unusable checkpoints seen are moved aside; config changes are recorded."""
        self.set_aside_unusable()
        step = manifest["step"]
        if mf.DIGEST not in manifest:
            log.warning(
                "Checkpoint %s has a manifest without a digest (written by an earlier version): its fields are "
                "validated and its files checked, but a damaged field the checks cannot see would go unnoticed",
                self.store.where(name),
            )
        if self.newest is not None and self.newest.step > step:
            log.warning(
                "Resuming from %s, the newest by commit sequence, though %s holds a later step (expected after a "
                "fresh start beside older checkpoints, or in a shared checkpoint.dir)",
                self.store.where(name),
                self.newest.name,
            )
        diff = mf.changes(manifest["config"], self.training_config)
        if diff:
            self.on_event(
                Event.CONFIG_CHANGED_ON_RESUME, step=step, accepted="run.allow_config_change", changes=[list(d) for d in diff]
            )
        safe = [d for d in mf.changes(manifest["full_config"], self.full_config) if d not in diff]
        if safe:
            self.on_event(Event.CONFIG_CHANGED_ON_RESUME, step=step, accepted="safe to change", changes=[list(d) for d in safe])

    def set_aside_unusable(self) -> None:
        for step, name, reason, error in self.movable:
            self.set_aside(step, name, reason, error)
        self.movable = []


class Resume:
    """The ranks' resume, together: the checkpoints rank 0 lists are tried newest first; each rank
    reads what it needs of one (verified) and checks it fits the live objects; the first that every
    rank could load is applied on every rank."""

    def __init__(self, store: Store, comm: Collectives, chooser: Chooser) -> None:
        self.store, self.comm, self.chooser = store, comm, chooser

    def run(
        self,
        objects: Dict[str, Any],
        per_rank: Dict[str, Any],
        allow_config_change: bool,
        fresh_start_if_unusable: bool,
        new_rank: Optional[Callable[[int], None]],
        newest: Optional[int] = None,
    ) -> Optional[Tuple[str, Dict[str, Any]]]:
        """(name, manifest) of the checkpoint loaded into the objects, or None for a fresh start
        (`newest`: of no later step)."""
        comm, chooser = self.comm, self.chooser
        candidates = comm.broadcast_object(chooser.candidates(allow_config_change) if comm.rank == 0 else None)
        candidates = [c for c in candidates if newest is None or c[1]["step"] <= newest]
        for name, manifest, refusal in candidates:
            if refusal is not None:
                raise CheckpointError(refusal)
            loaded, error, lasting = self._try_load(name, manifest, objects, per_rank)
            failed = comm.max_each([1.0 if error else 0.0, 1.0 if lasting else 0.0])
            if failed[0]:
                errors = comm.gather_object(error)
                if comm.rank == 0:
                    why = "; ".join(e for e in errors or [] if e)
                    chooser.unusable(manifest["step"], name, why, "damaged" if failed[1] else None)
                continue
            assert loaded is not None
            if comm.rank == 0:
                chooser.chosen(name, manifest)
            if loaded.world_size != comm.world_size and new_rank is None:
                raise CheckpointError(
                    f"{self.store.where(name)}: saved by {loaded.world_size} workers, this run has {comm.world_size} (trainer.on_world_size_change=refuse)"
                )
            self._apply(name, manifest["step"], loaded, objects, per_rank, new_rank)
            return name, manifest
        problems = comm.broadcast_object(chooser.problems if comm.rank == 0 else None)
        if not problems:
            return None
        detail = "; ".join(problems)
        if not fresh_start_if_unusable:
            raise CheckpointError(
                f"none of the {len(problems)} committed checkpoints in {self.store.where()} is usable ({detail}). "
                "They are kept as they are. Set run.fresh_start_if_unusable=true to train from scratch anyway "
                "(they are then moved aside, not deleted)"
            )
        if comm.rank == 0:
            chooser.set_aside_unusable()
        log.warning("No usable checkpoint (%s); starting from scratch as run.fresh_start_if_unusable allows", detail)
        return None

    def _try_load(
        self, name: str, manifest: Dict[str, Any], objects: Dict[str, Any], per_rank: Dict[str, Any]
    ) -> Tuple[Optional[Loaded], Optional[str], bool]:
        """(what this rank loaded, why it could not, whether that is for good) for one checkpoint."""
        try:
            with self.store.open(name, {n: spec["bytes"] for n, spec in manifest["files"].items()}) as files:
                loaded = for_manifest(manifest).load(
                    files, manifest, dict(objects), list(per_rank), self.comm.rank, self.comm.world_size
                )
            check_fits(loaded, objects, per_rank, manifest.get(mf.PARAMS))
            return loaded, None, False
        except (ValueError, TypeError, RuntimeError, OverflowError, RecursionError) as exc:  # bad for good
            return None, f"rank {self.comm.rank}: {self.store.where(name)}: {exc}", True
        except (OSError, MemoryError) as exc:  # could not be read now
            return None, f"rank {self.comm.rank}: {type(exc).__name__}: {exc}", False

    def _apply(
        self,
        name: str,
        step: int,
        loaded: Loaded,
        objects: Dict[str, Any],
        per_rank: Dict[str, Any],
        new_rank: Optional[Callable[[int], None]],
    ) -> None:
        """Load the states into the live objects on every rank. A failure here (a state that fits by
        shape but not by content) leaves the objects partly loaded: the checkpoint is moved aside on
        every rank's word, and the attempt ends, so the next one starts from the checkpoint before."""
        error = None
        try:
            for name, obj in objects.items():
                obj.load_state_dict(loaded.objects[name])
            if loaded.own is None:
                assert new_rank is not None
                new_rank(step)
            else:
                for name, obj in per_rank.items():
                    obj.load_state_dict(loaded.own[name])
        except Exception as exc:
            error = f"rank {self.comm.rank} could not load {self.store.where(name)}: {type(exc).__name__}: {exc}"
        if self.comm.max_each([1.0 if error else 0.0])[0]:
            errors = self.comm.gather_object(error)
            why = "; ".join(e for e in errors or [] if e) if self.comm.rank == 0 else ""
            if self.comm.rank == 0:
                self.chooser.unusable(step, name, why, "load")
                self.chooser.set_aside_unusable()
            raise CheckpointError(
                error
                or f"another rank could not load {self.store.where(name)}; it was moved aside and the next attempt resumes from the one before"
            )
