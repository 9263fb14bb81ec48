"""Which state a resume uses, and the checks that make any bad checkpoint "unusable, fall back".

One collective resume (Resume) tries the tiers in order: the memory tier's snapshot, when every
rank holds the same verified step and it is newer than the newest committed checkpoint (one that
does not verify or fit on some rank is passed over), then the store's committed checkpoints. Rank 0 lists the committed checkpoints newest first by commit sequence (Chooser.candidates); the
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

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

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

    def candidates(self, listed: List[mf.Listed], allow_config_change: bool) -> List[Tuple[str, Dict[str, Any], Optional[str]]]:
        """(name, manifest, refusal) of every committed checkpoint whose manifest is valid, newest first;
        `refusal` says why a resume from it is refused (its training config differs). Checkpoints whose
        manifest is unusable are named (and may be moved aside once the resume knows where it starts)."""
        out = []
        for c in listed:
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


class Tier(Protocol):
    """The memory tier as a resume sees it (checkpoint/memory.py's MemorySnapshots): this rank's
    verified copies of the state, by step, in its node's shared memory."""

    @property
    def folder(self) -> Path: ...

    def steps(self, objects: Optional[Dict[str, Any]] = None) -> List[int]: ...

    def load(self, step: int, objects: Optional[Dict[str, Any]] = None) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]: ...

    def discard_after(self, step: int) -> None: ...


@dataclass
class Found:
    """Where a resume loaded the objects from: a committed checkpoint's location and manifest, or the
    memory tier's folder and the step (`memory`)."""

    where: str
    manifest: Dict[str, Any]
    memory: bool = False


class Resume:
    """The ranks' resume, together, from the tiers in order: the memory tier's snapshot when every rank
    holds the same verified step and it is newer than the newest committed checkpoint, then the
    committed checkpoints rank 0 lists, newest first. For each, every rank reads what it needs
    (verified) and checks it fits the live objects; the first that every rank could load is applied on
    every rank. A snapshot that does not verify or fit on some rank is passed over; a checkpoint that
    does not is unusable (named, and moved aside once the resume knows where it starts)."""

    def __init__(self, store: Store, comm: Collectives, chooser: Chooser, memory: Optional[Tier] = None) -> None:
        self.store, self.comm, self.chooser, self.memory = store, comm, chooser, memory

    def run(
        self,
        objects: Dict[str, Any],
        per_rank: Dict[str, Any],
        allow_config_change: bool,
        fresh_start_if_unusable: bool,
        new_rank: Optional[Callable[[int], None]],
        newest: Optional[int] = None,
    ) -> Optional[Found]:
        """What was loaded into the objects, or None for a fresh start (`newest`: of no later step)."""
        comm, chooser = self.comm, self.chooser
        listed = [c for c in mf.scan(self.store) if newest is None or c.step <= newest] if comm.rank == 0 else []
        found = self._from_memory(listed[0].step if listed else -1, objects, per_rank, newest)
        if found is not None:
            return found
        candidates = comm.broadcast_object(chooser.candidates(listed, allow_config_change) if comm.rank == 0 else None)
        for name, manifest, refusal in candidates:
            if refusal is not None:
                raise CheckpointError(refusal)
            load = functools.partial(self._load, name, manifest, objects, per_rank)
            loaded, error, lasting = self._tried(load, self.store.where(name), manifest.get(mf.PARAMS), objects, per_rank)
            if self._failed(error, lasting, manifest["step"], name):
                continue
            assert loaded is not None
            if comm.rank == 0:
                chooser.chosen(name, manifest)
            if loaded.world_size != comm.world_size and new_rank is None:
                raise CheckpointError(
                    f"{self.store.where(name)}: saved by {loaded.world_size} workers, this run has {comm.world_size} (trainer.on_world_size_change=refuse)"
                )
            self._apply(name, manifest["step"], loaded, objects, per_rank, new_rank)
            return Found(self.store.where(name), manifest)
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

    def _from_memory(
        self, on_disk: int, objects: Dict[str, Any], per_rank: Dict[str, Any], newest: Optional[int]
    ) -> Optional[Found]:
        """The memory tier's try (collective; `on_disk`: rank 0's newest committed step, -1: none)."""
        memory = self.memory
        steps = [s for s in memory.steps(objects) if newest is None or s <= newest] if memory is not None else []
        # the newest step every rank may have: the smallest of the ranks' newest (a rank killed in
        # the middle of a snapshot has the one before, which the others still hold: double buffers)
        lowest, newest_on_disk = self.comm.max_each([-float(steps[0] if steps else -1), float(on_disk)])
        step = int(-lowest)
        if memory is None or step < 0 or step <= newest_on_disk:
            return None

        def load() -> Loaded:
            got = memory.load(step, objects) if step in steps else None
            if got is None:
                raise ValueError(f"this rank's snapshot of step {step} is missing or does not verify")
            return Loaded(got[0], got[1], self.comm.world_size)

        loaded, error, _ = self._tried(load, str(memory.folder), None, objects, per_rank)
        if self.comm.max_each([1.0 if error else 0.0])[0]:  # some rank's bytes did not verify or fit
            log.warning(
                "The snapshot of step %d in memory is not usable on every rank (%s); resuming from %s",
                step,
                error or "another rank",
                self.store.where(),
            )
            return None
        assert loaded is not None
        self._apply(None, step, loaded, objects, per_rank, None)
        return Found(str(memory.folder), {"step": step, "world_size": self.comm.world_size}, memory=True)

    def _load(self, name: str, manifest: Dict[str, Any], objects: Dict[str, Any], per_rank: Dict[str, Any]) -> Loaded:
        with self.store.open(name, {n: spec["bytes"] for n, spec in manifest["files"].items()}) as files:
            return for_manifest(manifest).load(
                files, manifest, dict(objects), list(per_rank), self.comm.rank, self.comm.world_size
            )

    def _tried(
        self, load: Callable[[], Loaded], where: str, params: Any, objects: Dict[str, Any], per_rank: Dict[str, Any]
    ) -> Tuple[Optional[Loaded], Optional[str], bool]:
        """(what this rank loaded, why it could not, whether that is for good), its fit to the live
        objects checked (`params`: the manifest's parameter names, when it has them)."""
        try:
            loaded = load()
            check_fits(loaded, objects, per_rank, params)
            return loaded, None, False
        except (ValueError, TypeError, RuntimeError, OverflowError, RecursionError) as exc:  # bad for good
            return None, f"rank {self.comm.rank}: {where}: {exc}", True
        except (OSError, MemoryError) as exc:  # could not be read now
            return None, f"rank {self.comm.rank}: {type(exc).__name__}: {exc}", False

    def _failed(self, error: Optional[str], lasting: bool, step: int, name: str) -> bool:
        """Collective: whether any rank could not load checkpoint `name`; rank 0 names it unusable (for
        good, so it may be moved aside, when any rank's reason was lasting)."""
        failed = self.comm.max_each([1.0 if error else 0.0, 1.0 if lasting else 0.0])
        if not failed[0]:
            return False
        errors = self.comm.gather_object(error)
        if self.comm.rank == 0:
            why = "; ".join(e for e in errors or [] if e)
            self.chooser.unusable(step, name, why, "damaged" if failed[1] else None)
        return True

    def _apply(
        self,
        name: Optional[str],
        step: int,
        loaded: Loaded,
        objects: Dict[str, Any],
        per_rank: Dict[str, Any],
        new_rank: Optional[Callable[[int], None]],
    ) -> None:
        """Load the states into the live objects on every rank. A failure here (a state that fits by
        shape but not by content) leaves the objects partly loaded, so the attempt ends on every rank's
        word: checkpoint `name` is moved aside (None: the memory tier's snapshot is discarded), and the
        next attempt starts from the one before."""
        where = self.store.where(name) if name is not None else f"the snapshot of step {step} in memory"
        error = None
        try:
            for key, obj in objects.items():
                obj.load_state_dict(loaded.objects[key])
            if loaded.own is None:
                assert new_rank is not None
                new_rank(step)
            else:
                for key, obj in per_rank.items():
                    obj.load_state_dict(loaded.own[key])
        except Exception as exc:
            error = f"rank {self.comm.rank} could not load {where}: {type(exc).__name__}: {exc}"
        if not self.comm.max_each([1.0 if error else 0.0])[0]:
            return
        errors = self.comm.gather_object(error)
        if name is None:
            if self.memory is not None:
                self.memory.discard_after(-1)
            raise CheckpointError(f"{error or 'another rank could not load ' + where}; it was discarded")
        if self.comm.rank == 0:
            self.chooser.unusable(step, name, "; ".join(e for e in errors or [] if e), "load")
            self.chooser.set_aside_unusable()
        raise CheckpointError(
            error or f"another rank could not load {where}; it was moved aside and the next attempt resumes from the one before"
        )
