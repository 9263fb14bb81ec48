"""What a run's workers leave in its folder: metrics.jsonl and events (rank 0)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, TextIO

from ..contract import events
from ..contract.env import restart_count
from ..contract.events import Event
from ..contract.files import METRICS_FILE


class RunRecord:
    """Rank 0 writes the records; on other ranks every method is a no-op."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.enabled = run_dir, rank == 0
        self._metrics: Optional[TextIO] = None  # kept open: opening it for every row cost more than the row
        self._holding = False  # rows buffered until held() ends

    def event(self, kind: Event, **fields: Any) -> None:
        if self.enabled:
            events.append(self.run_dir, kind, restart=restart_count(), **fields)

    def metrics(self, **row: Any) -> Optional[Dict[str, Any]]:
        """Write a row (its `time` now unless given); returns the row written (None on other ranks)."""
        if not self.enabled:
            return None
        if next(iter(row), None) != "time":  # a window's row has its own, first: as it is
            row = {"time": round(time.time(), 3), **row}
        if self._metrics is None:
            self._metrics = open(self.run_dir / METRICS_FILE, "a")
        self._metrics.write(json.dumps(row) + "\n")
        if not self._holding:
            self._metrics.flush()  # whole rows for a reader (the benchmarks, a person's tail -f)
        return row

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Rows written inside reach the file together, at the end (one write for a message's windows)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if self._metrics is not None:
                self._metrics.flush()

    def close(self) -> None:
        """Close metrics.jsonl (a later row opens it again)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
