"""Two runs' checkpoints of the same step, compared object by object and key by key: where a
resumed run left the path of the run never stopped (`steadfast-verify`).

A checkpoint is read whole (every object's state, every rank's own state) through the format's
own reader: every file verified against its manifest first, nothing unpickled. Tensors and numpy
arrays are equal when their dtype, shape and bytes are (a NaN equals itself); anything else by ==.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Union

import numpy as np
import torch

from . import formats
from . import manifest as mf
from . import restore as rs

# what a person sees, not what is trained: the loss sums not yet logged are summed in another order
# after a resume (float32 in the checkpoint, float64 as the steps go), and differ without harm
NOT_TRAINING = ("telemetry",)


@dataclass
class States:
    """A checkpoint read whole: each object's state, and each saved rank's own states."""

    step: int
    objects: Dict[str, Any]
    ranks: List[Dict[str, Any]]


def read_states(checkpoint: Union[str, Path]) -> States:
    """The whole state of the committed checkpoint folder `checkpoint`, its files verified first.
    Raises ValueError (ManifestError, FileCheckError, TensorFileError: it is unusable) or OSError."""
    manifest = mf.read(checkpoint)
    problem = rs.verify_at(checkpoint)
    if problem:
        raise ValueError(f"{checkpoint} does not verify: {problem}")
    with rs.files_at(checkpoint, manifest) as files:
        whole = formats.for_manifest(manifest).read_whole(files, manifest)
    return States(int(manifest["step"]), whole.objects, whole.ranks)


def _same_array(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    flat_a, flat_b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return bool(torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8)))


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """The paths (`key.sub.0`) at which two states differ, in the order of `a`'s keys ('' for the whole)."""
    if isinstance(a, (torch.Tensor, np.ndarray)):
        if not _same_array(a, b):
            yield path
    elif isinstance(a, dict):
        if not isinstance(b, dict):
            yield path
            return
        for key in [*a, *[k for k in b if k not in a]]:
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                yield where
            else:
                yield from differences(a[key], b[key], where)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            yield path
            return
        if all(isinstance(x, _SCALARS) for x in a):  # a list of numbers is one value (an RNG's words)
            if [type(x) for x in a] != [type(y) for y in b] or list(a) != list(b):
                yield path
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}.{i}" if path else str(i))
    elif type(a) is not type(b) or a != b:
        yield path


_SCALARS = (int, float, str, bool, type(None))


@dataclass
class Diverged:
    """One object (or one rank's own object) whose state differs: its first differing key, and how many."""

    name: str  # the object's name (run.resume's), or "rank R's NAME" for a rank's own state
    object: str  # the object's name alone
    keys: List[str]  # the keys that differ, in order

    @property
    def first(self) -> str:
        return self.keys[0]

    @property
    def count(self) -> int:
        return len(self.keys)


@dataclass
class Comparison:
    step: int
    diverged: List[Diverged] = field(default_factory=list)
    same: List[str] = field(default_factory=list)


def undrawn(older: States, now: States) -> Set[Tuple[int, str]]:
    """(rank, generator) of the RNG states (torch, cuda, numpy, python) equal in two checkpoints of one
    run: generators the steps between them never drew on. Their state is whatever the process began
    with (an unseeded numpy differs between any two runs) and cannot change what is trained."""
    out: Set[Tuple[int, str]] = set()
    if older.step == now.step:
        return out
    for rank, (before, after) in enumerate(zip(older.ranks, now.ranks)):
        old, new = before.get("rng"), after.get("rng")
        if isinstance(old, dict) and isinstance(new, dict):
            out |= {(rank, gen) for gen in new if gen in old and next(differences(old[gen], new[gen]), None) is None}
    return out


def _drop(state: Any, rank: int, skip: Set[Tuple[int, str]]) -> Any:
    return {k: v for k, v in state.items() if (rank, k) not in skip} if isinstance(state, dict) else state


def compare(a: States, b: States, skip: Optional[Set[Tuple[int, str]]] = None) -> Comparison:
    """Every tracked object of two checkpoints of the same step: those that differ (their first
    differing key; the run's own state, the loop's progress and the ranks' RNGs, first) and those that
    do not. Telemetry (loss sums not yet logged) is left out, and the generators in `skip` (undrawn)."""
    out, skip = Comparison(a.step), skip or set()
    names = sorted(set(a.objects) | set(b.objects), key=lambda n: (n != "progress", n))
    pairs: List[Tuple[str, str, Any, Any]] = [(n, n, a.objects.get(n), b.objects.get(n)) for n in names]
    for rank in range(max(len(a.ranks), len(b.ranks))):
        mine = a.ranks[rank] if rank < len(a.ranks) else {}
        theirs = b.ranks[rank] if rank < len(b.ranks) else {}
        own = sorted(set(mine) | set(theirs), key=lambda n: (n != "rng", n))
        for n in own:
            if n not in NOT_TRAINING:
                x, y = mine.get(n), theirs.get(n)
                pairs.append((f"rank {rank}'s {n}", n, *((_drop(x, rank, skip), _drop(y, rank, skip)) if n == "rng" else (x, y))))
    first_run = [p for p in pairs if p[1] in ("progress", "rng")] + [p for p in pairs if p[1] not in ("progress", "rng")]
    for name, obj, x, y in first_run:
        found = list(differences(x, y))
        if found:
            out.diverged.append(Diverged(name, obj, [k or "(the whole state)" for k in found]))
        else:
            out.same.append(name)
    return out


def common_steps(a: Path, b: Path) -> List[int]:
    """The steps at which both checkpoint folders hold a committed checkpoint, oldest first."""
    steps_a = {step for step, _ in mf.committed(a)}
    return sorted(steps_a & {step for step, _ in mf.committed(b)})


def first_divergence(a: Path, b: Path) -> Tuple[Optional[Comparison], List[int], List[str]]:
    """(the comparison at the oldest common step whose states differ, or None; the common steps
    compared; the problems met reading them): for each step both folders hold, oldest first. `a` is
    the reference: RNGs equal in its oldest and newest checkpoints are left out (`undrawn`)."""
    compared: List[int] = []
    problems: List[str] = []
    skip: Set[Tuple[int, str]] = set()
    found = mf.committed(a)  # `a`'s oldest and newest checkpoints: the generators its steps never drew on
    if len(found) >= 2:
        try:
            skip = undrawn(read_states(found[-1][1]), read_states(found[0][1]))
        except (ValueError, OSError) as exc:
            problems.append(f"{a}: {exc}")
    for step in common_steps(a, b):
        try:
            left, right = read_states(a / mf.step_dir_name(step)), read_states(b / mf.step_dir_name(step))
        except (ValueError, OSError) as exc:
            problems.append(f"step {step}: {exc}")
            continue
        compared.append(step)
        result = compare(left, right, skip)
        if result.diverged:
            return result, compared, problems
    return None, compared, problems


def suspects(diverged: List[Diverged]) -> List[str]:
    """What untracked state to suspect, from which objects diverged first."""
    kinds = {d.object for d in diverged}
    out: List[str] = []
    if "progress" in kinds:
        keys = {d.first.split(".")[0] for d in diverged if d.object == "progress"}
        if "streams" in keys:
            out.append(
                "the loop's progress differs in a source's position (progress.streams): a step drew a different "
                "number of batches from run.random_batches/run.stream after the resume"
            )
        else:
            out.append(
                "the loop's progress differs: the resumed run called run.step a different number of times for the "
                "same work (a step counted outside run.step, or an epoch that ended elsewhere)"
            )
    if "rng" in kinds:
        out.append(
            "the random number generators (torch, numpy, python) were drawn a different number of times: something "
            "draws on the global RNG outside what the checkpoint can replay: a batch fetched ahead of the step with "
            "torch.randint (draw it from run.random_batches), a DataLoader without a generator of its own, an "
            "evaluation that draws on some ranks only after the resume"
        )
    trained = kinds - {"progress", "rng"}
    if trained and not kinds & {"progress", "rng"}:
        out.append(
            f"{', '.join(sorted(trained))} differ while the loop's position and the random state are the same: the "
            "steps after the resume trained on other data or other values. Suspect state the checkpoint does not "
            "hold: a batch fetched ahead of the step and kept in a variable (draw batches from run.random_batches "
            "or run.stream), an iterator over your data, a counter of your own (an iteration number, a learning-rate "
            "schedule's position: use the step run.steps gives, or track the object with run.resume)"
        )
    mine = trained - {"model", "optimizer"}
    if mine:
        out.append(f"{', '.join(sorted(mine))}: your own object(s): does state_dict() return everything they use?")
    return out
