"""What the anomaly guard did in a run (its `anomaly` records: steadfast/health/), for the report:
each finding, where the run went back to, what it skipped, and the steps trained again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional

from ..contract.events import Event
from .records import integer, number, text


@dataclass(frozen=True)
class Handled:
    """One `anomaly` record: what every rank agreed it saw and what they did about it."""

    anomaly: str  # nonfinite_loss, loss_spike, nonfinite_grad_norm, divergence
    step: Optional[int]
    ranks: List[int]  # the first to show it first (a divergence: the ranks that differ)
    value: Optional[float]
    agreed_at: Optional[int]
    action: str  # rolled_back or healed
    restored_step: Optional[int]
    source: Optional[str]
    skipped: Optional[List[int]]  # [epoch, first sample, samples, first batch, batches]
    tensor: Optional[str]
    suspect: List[int]
    restart: Optional[int]

    @property
    def redone(self) -> int:
        """Steps trained and then given up (trained again, or skipped): from the state restored to where it was agreed."""
        if self.action != "rolled_back" or self.agreed_at is None or self.restored_step is None:
            return 0
        return max(0, self.agreed_at - self.restored_step)

    @property
    def samples_skipped(self) -> int:
        return self.skipped[2] if self.skipped else 0

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks)) or "?"
        seen = f" ({self.value:.4g})" if self.value is not None else ""
        if self.anomaly == "divergence":
            what = f"replicas diverged at step {_dash(self.step)} (ranks {ranks}" + (
                f", first in {self.tensor})" if self.tensor else ")"
            )
        else:
            first = self.ranks[0] if self.ranks else None
            also = self.ranks[1:]
            others = f" (then on rank(s) {', '.join(map(str, also))})" if also else ""
            what = f"{self.anomaly}{seen} on rank {_dash(first)} at step {_dash(self.step)}{others}"
        what += f", agreed at step {_dash(self.agreed_at)}: "
        if self.action == "healed":
            what += f"healed from {self.source or 'a majority rank'}"
            return what + (f"; suspect hardware: rank(s) {', '.join(map(str, self.suspect))}" if self.suspect else "")
        what += f"rolled back to step {_dash(self.restored_step)} ({self.source or '?'}), {self.redone} step(s) redone, "
        if not self.skipped:
            return what + "nothing skipped"
        epoch, first, samples, first_batch, batches = self.skipped
        if samples:
            return what + f"{samples} sample(s) skipped (epoch {epoch + 1}, {first}..{first + samples - 1} of its order)"
        return what + f"{batches} batch(es) skipped (epoch {epoch + 1}, from batch {first_batch})"


def handled(events: Iterable[Mapping[str, Any]]) -> List[Handled]:
    """The run's `anomaly` records, in file order (fields of the wrong type read as missing)."""
    out = []
    for e in events:
        if e.get("event") != Event.ANOMALY.value:
            continue
        skipped = e.get("skipped")
        ok_skip = isinstance(skipped, list) and len(skipped) == 5 and all(integer(v) is not None for v in skipped)
        out.append(
            Handled(
                anomaly=text(e.get("anomaly"), 40) or "?",
                step=integer(e.get("step")),
                ranks=_ints(e.get("ranks")),
                value=number(e.get("value")),
                agreed_at=integer(e.get("agreed_at")),
                action=text(e.get("action"), 40) or "?",
                restored_step=integer(e.get("restored_step")),
                source=text(e.get("source"), 40),
                skipped=[int(v) for v in skipped] if ok_skip and isinstance(skipped, list) else None,
                tensor=text(e.get("tensor"), 200),
                suspect=_ints(e.get("suspect")),
                restart=integer(e.get("restart")),
            )
        )
    return out


def _ints(value: Any) -> List[int]:
    return [v for v in (integer(x) for x in value) if v is not None][:64] if isinstance(value, list) else []


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)
