"""Which committed checkpoints retention keeps: a pure rule over what their manifests record.

No files here: `manifest.expendable` turns the listed checkpoints into `Saved` values and names the
folders this rule does not keep; CheckpointManager removes them. Kept is the union of
  - the newest `keep_last` by step (at least one: the newest by step is always kept),
  - the one a resume picks first (the newest by commit sequence),
  - the end of every `keep_every_n_epochs`-th epoch (milestones, never removed),
  - the best `keep_best` by the value of `monitor` each one recorded (`mode`: min or max),
  - and the steps the caller pins (the checkpoint just committed).
Only a finite value of the monitored metric ranks. A checkpoint without one (nothing logged since
the save before it, a NaN or an infinity, another metric, a manifest of an earlier version) is never
kept as best; the other rules still keep it. Ties go to the earlier step, as in Lightning's
`save_top_k`: a later checkpoint displaces one only by being strictly better. Any total order keeps
the rule stable: a checkpoint once left out of the best k stays out (the k ahead of it are kept),
so nothing is removed that a later save would have wanted back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Set

MODES = ("min", "max")


@dataclass(frozen=True)
class Policy:
    """The `checkpoint` group's retention keys."""

    keep_last: int = 1
    keep_every_n_epochs: Optional[int] = None
    keep_best: int = 0
    monitor: Optional[str] = None
    mode: str = "min"  # min: the lowest value is the best (a loss); max: the highest (an accuracy)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"retention mode {self.mode!r}: one of {', '.join(MODES)}")


@dataclass(frozen=True)
class Saved:
    """What retention knows of one committed checkpoint (from its manifest)."""

    step: int
    commit: int
    epoch: int = 0
    batch_in_epoch: int = 0
    metric: Optional[str] = None  # the name of the metric it recorded
    value: Optional[float] = None  # that metric's value (None: none was logged)


def ranked(saved: Sequence[Saved], policy: Policy) -> List[Saved]:
    """The checkpoints with a finite value of `policy.monitor`, best first (ties: the earlier step)."""
    if not policy.monitor:
        return []
    sign = 1.0 if policy.mode == "min" else -1.0
    valued = [s for s in saved if s.metric == policy.monitor and s.value is not None and math.isfinite(s.value)]
    return sorted(valued, key=lambda s: (sign * float(s.value or 0.0), s.step, s.commit))


def kept(saved: Sequence[Saved], policy: Policy, pinned: Iterable[int] = ()) -> Set[int]:
    """The steps of `saved` that retention keeps (see the module's docstring), and `pinned`. A step
    is a folder's name: two folders of one step (possible only by hand) are kept or removed together."""
    keep = set(pinned)
    if not saved:
        return keep
    by_step = sorted(saved, key=lambda s: (s.step, s.commit), reverse=True)
    keep.update(s.step for s in by_step[: max(1, policy.keep_last)])
    keep.add(max(saved, key=lambda s: (s.commit, s.step)).step)
    n = policy.keep_every_n_epochs
    if n:
        keep.update(s.step for s in saved if s.epoch and s.epoch % n == 0 and not s.batch_in_epoch)
    keep.update(s.step for s in ranked(saved, policy)[: max(0, policy.keep_best)])
    return keep
