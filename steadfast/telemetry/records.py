"""What a run's workers leave in its folder: metrics.jsonl and events (rank 0)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

from ..contract import events
from ..contract.env import restart_count
from ..contract.events import Event
from ..contract.files import METRICS_FILE
from ._rows import Item, RowWriter, flush_all

Row = Dict[str, Any]


class RunRecord:
    """Rank 0 writes the records; on other ranks every method is a no-op. Metrics rows are written by
    a thread of their own, in the order given (_rows.py): `flush` before reading them back."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.enabled = run_dir, rank == 0
        self.after: Optional[Callable[[Row], None]] = None  # each row once in the file (the sinks), on the rows' thread
        self._rows: Optional[RowWriter] = None
        self._holding = False  # rows handed over together when held() ends

    def event(self, kind: Event, **fields: Any) -> None:
        if self.enabled:
            events.append(self.run_dir, kind, restart=restart_count(), **fields)

    def metrics(self, **row: Any) -> None:
        """A row (its `time` now unless given), written after every row given before it."""
        if not self.enabled:
            return
        if next(iter(row), None) != "time":  # a window's row has its own, first: as it is
            row = {"time": round(time.time(), 3), **row}
        self._hand(row)

    def later(self, build: Callable[[], Optional[Row]]) -> None:
        """A row built on the rows' thread by `build` (from numbers that no longer change; None: no row),
        in its place among the rows given."""
        if self.enabled:
            self._hand(build)

    def _hand(self, item: Item) -> None:
        if self._rows is None:
            self._rows = RowWriter(self.run_dir / METRICS_FILE, self._after)
        self._rows.add(item)
        if not self._holding:
            self._rows.wake()

    def _after(self, row: Row) -> None:
        if self.after is not None:
            self.after(row)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Rows given inside are handed to the rows' thread together, at the end (one wake-up for a message's windows)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if self._rows is not None:
                self._rows.wake()

    def flush(self) -> None:
        """Every row given so far in metrics.jsonl (and given to `after`) when this returns."""
        if self._rows is not None:
            self._rows.flush()

    def close(self) -> None:
        """Every row written, metrics.jsonl closed (a later row opens it again)."""
        if self._rows is not None:
            self._rows.close()


def flush_rows() -> None:
    """Every RunRecord's rows in its file now (a fault about to kill this process)."""
    flush_all()
