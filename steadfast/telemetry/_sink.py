"""The interface every sink of logger.sinks implements (sinks.py opens them), and what they share."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

log = logging.getLogger("steadfast")

Number = Union[int, float]
POSITION = ("time", "step")  # a row's place, not a metric


def scalars(row: Mapping[str, Any]) -> Dict[str, Number]:
    """A row's metrics that are one number each (bools, strings and per-rank lists stay in metrics.jsonl)."""
    return {k: v for k, v in row.items() if k not in POSITION and isinstance(v, (int, float)) and not isinstance(v, bool)}


def step_of(row: Mapping[str, Any]) -> Optional[int]:
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


class Sink:
    """One destination of the metrics rows (rank 0 only)."""

    name = "sink"

    def write(self, row: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def completed(self, result: Mapping[str, Any], model: Optional[Path]) -> None:
        """The run completed: `result` is summary.json's fields, `model` the final weights (if any)."""

    def close(self) -> None:
        """The end of this attempt (completed or not); a later attempt opens a new sink."""


class Sinks:
    """The sinks of `logger.sinks`, each kept out of the way of the others and of training."""

    def __init__(self, sinks: Optional[List[Sink]] = None) -> None:
        self.sinks: List[Sink] = list(sinks or [])

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def _each(self, what: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, what)(*args)
            except Exception as exc:  # noqa: BLE001 - a sink must never stop training
                self.sinks.remove(sink)
                log.warning(
                    "logger.sinks: %s failed (%s: %s); it is left out for the rest of this attempt, metrics.jsonl has every row",
                    sink.name,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )

    def write(self, row: Mapping[str, Any]) -> None:
        self._each("write", row)

    def completed(self, result: Mapping[str, Any], model: Optional[Path]) -> None:
        self._each("completed", result, model)

    def close(self) -> None:
        self._each("close")
        self.sinks = []
