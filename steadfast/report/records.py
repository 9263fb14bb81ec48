"""What the report reads from a run folder, validated into plain values: the analysis's input.

No file I/O here: `loader` reads the files and hands their contents to these functions, and the
unit tests build the same values by hand. Anything of the wrong type is dropped (and said so),
never passed on to fail later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..checkpoint.storage.base import DEFAULT_FOLDER

DEFAULT_CHECKPOINT_DIR = DEFAULT_FOLDER  # <run folder>/checkpoints unless the run's checkpoint.dir says otherwise


def number(value: Any) -> Optional[float]:
    """A JSON number as a float; None for anything else (bools, strings, null, NaN stays NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def integer(value: Any) -> Optional[int]:
    """A JSON integer (or a float with an integral value); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def text(value: Any, limit: int = 2000) -> Optional[str]:
    """A string, cut to `limit` characters (a record is shown, never trusted to be short), without
    characters a plot's font may lack (libraries put emoji in their errors)."""
    return "".join(c for c in value[:limit] if c.isprintable() and ord(c) < 0x2000) if isinstance(value, str) else None


@dataclass(frozen=True)
class Summary:
    """The fields of summary.json the report shows; None where the file has no usable value."""

    status: Optional[str] = None
    epochs_completed: Optional[int] = None
    max_steps: Optional[int] = None  # a loop of steps (run.steps): its bound; it has no epochs
    global_step: Optional[int] = None
    final_loss: Optional[float] = None
    val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None
    model_sha256: Optional[str] = None
    error: Optional[str] = None


_SUMMARY_FIELDS: Dict[str, Callable[[Any], Any]] = {
    "status": text,
    "epochs_completed": integer,
    "max_steps": integer,
    "global_step": integer,
    "final_loss": number,
    "val_loss": number,
    "val_accuracy": number,
    "model_sha256": text,
    "error": text,
}


def summary_from(raw: Mapping[str, Any]) -> Tuple[Summary, List[str]]:
    """The summary's fields, and the names of those present with an unusable value."""
    values: Dict[str, Any] = {}
    bad: List[str] = []
    for name, convert in _SUMMARY_FIELDS.items():
        if raw.get(name) is None:
            continue
        value = convert(raw[name])
        if value is None:
            bad.append(name)
        values[name] = value
    return Summary(**values), bad


@dataclass(frozen=True)
class MetricRow:
    """One row of metrics.jsonl: a logged step (loss) or an epoch's end (val_loss)."""

    time: float
    step: int
    restart: Optional[int] = None
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    local_ms_per_rank: Optional[Tuple[float, ...]] = None  # each rank's local work per step (steadfast/telemetry/_stragglers.py)


MAX_RANKS = 65536  # a per-rank list longer than any world size is damage, not data


def per_rank(value: Any) -> Optional[Tuple[float, ...]]:
    """A list of one finite number >= 0 per rank; None for anything else."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_RANKS:
        return None
    numbers = [number(v) for v in value]
    if any(n is None or not 0 <= n < float("inf") for n in numbers):
        return None
    return tuple(n for n in numbers if n is not None)


def metric_rows(raw: Sequence[Mapping[str, Any]]) -> Tuple[List[MetricRow], int]:
    """The usable rows (a numeric time and step), and how many were not."""
    rows: List[MetricRow] = []
    for r in raw:
        t, step = number(r.get("time")), integer(r.get("step"))
        if t is None or step is None:
            continue
        rows.append(
            MetricRow(
                time=t,
                step=step,
                restart=integer(r.get("restart")),
                loss=number(r.get("loss")),
                val_loss=number(r.get("val_loss")),
                local_ms_per_rank=per_rank(r.get("local_ms_per_rank")),
            )
        )
    return rows, len(raw) - len(rows)


@dataclass(frozen=True)
class CheckpointCheck:
    """A committed checkpoint found on disk, checked against its manifest now."""

    step: int
    problem: Optional[str] = None  # None: its files match the manifest

    @property
    def verified(self) -> bool:
        return self.problem is None


@dataclass
class RunRecords:
    """Everything read back from one run folder, validated; `problems` says what was missing or damaged."""

    folder: Path
    events: List[Dict[str, Any]] = field(default_factory=list)  # as steadfast.contract.events.read returns them
    metrics: List[MetricRow] = field(default_factory=list)
    summary: Summary = field(default_factory=Summary)
    checkpoint_dir: Optional[str] = None  # where the checkpoints are: a folder, or a store's location (s3://...)
    checkpoints: List[CheckpointCheck] = field(default_factory=list)  # newest first
    problems: List[str] = field(default_factory=list)
