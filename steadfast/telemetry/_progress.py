"""The progress display of rank 0: epoch (a loop of epochs), step, loss, steps/s, ETA, and the ranks named stragglers.

On a terminal (logger.progress=auto or bar) it is one line, redrawn in place at most 5 times a
second; log records clear it before they print, and it comes back with the next step. Anywhere
else (CI, a pipe, Horovod's forwarded output, logger.progress=lines) it is a plain log line every
`logger.progress_every_s` seconds. The log file (logs/rank0.log) gets the plain lines in both
cases. Other ranks show nothing. `update` is cheap enough to call every step: a clock read and a
comparison, unless something is due.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections import deque
from typing import Any, Deque, List, Optional, TextIO, Tuple

log = logging.getLogger("steadfast.progress")

REDRAW_S = 0.2  # the terminal line at most this often
SAMPLE_S = 0.25  # a (time, step) sample for the speed at most this often
RATE_WINDOW_S = 20.0  # steps/s over about this long


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class _ClearLine(logging.Filter):
    """On the console handler: clear the progress line before a record prints; drop file-only records."""

    def __init__(self, display: "ProgressDisplay") -> None:
        super().__init__()
        self.display = display

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "progress_file_only", False):
            return False
        self.display.clear()
        return True


class ProgressDisplay:
    def __init__(
        self, mode: str, every_s: float, total_steps: int, max_epochs: int, enabled: bool = True, stream: Optional[TextIO] = None
    ) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            is_tty = getattr(self.stream, "isatty", lambda: False)()
            mode = "bar" if is_tty and os.environ.get("TERM") != "dumb" else "lines"
        self.mode = mode if enabled else "none"
        self.every_s, self.total, self.max_epochs = every_s, total_steps, max_epochs
        self.loss: Optional[float] = None
        self.slow = ""  # the ranks named stragglers (steadfast/telemetry/_stragglers.py), e.g. "rank 1 (+48%)"
        self._rate: Optional[float] = None
        self.visible = False
        self._samples: Deque[Tuple[float, int]] = deque()
        self._last_draw = self._last_line = -1e9
        self._due = 0.0  # the next time a sample, a redraw or a line is due (update does nothing before)
        self._filters: List[Tuple[logging.Handler, logging.Filter]] = []
        if self.mode == "bar":
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    f = _ClearLine(self)
                    handler.addFilter(f)
                    self._filters.append((handler, f))

    # ---- what is shown ----------------------------------------------------------------------
    def rate(self) -> Optional[float]:
        """Steps per second over the last RATE_WINDOW_S of training (the previous figure right after a pause)."""
        if len(self._samples) >= 2:
            (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
            if t1 > t0 and s1 > s0:
                self._rate = (s1 - s0) / (t1 - t0)
        return self._rate

    def text(self, step: int, epoch: int) -> str:
        """The line: `epoch e/E | ` only for a loop of epochs (max_epochs > 0); the step out of the total,
        its share and the ETA only when the total is known and not passed."""
        rate = self.rate()
        known = self.total >= step and self.total > 0
        eta = (self.total - step) / rate if rate and known else None
        where = f"step {step}/{self.total} ({100.0 * step / self.total:.0f}%)" if known else f"step {step}"
        if self.max_epochs > 0:
            where = f"epoch {min(epoch + 1, self.max_epochs)}/{self.max_epochs} | {where}"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        speed = f"{rate:.1f} steps/s" if rate else "- steps/s"
        return f"{where} | loss {loss} | {speed} | ETA {format_duration(eta)}" + (f" | slow: {self.slow}" if self.slow else "")

    # ---- called by the trainer -------------------------------------------------------------------
    def update(self, step: int, epoch: int, loss: Optional[float] = None) -> None:
        if self.mode == "none":
            return
        if loss is not None:
            self.loss = loss
        now = time.monotonic()
        if now < self._due:  # most steps: one clock read
            return
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_S:
            self._samples.append((now, step))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
        if self.mode == "bar" and now - self._last_draw >= REDRAW_S:
            self._last_draw = now
            self._draw(step, epoch)
        if now - self._last_line >= self.every_s:
            self._last_line = now
            # in bar mode only the log file gets the line (the terminal has the bar)
            log.info("progress: %s", self.text(step, epoch), extra={"progress_file_only": self.mode == "bar"})
        due = min(self._samples[-1][0] + SAMPLE_S, self._last_line + self.every_s)
        self._due = min(due, self._last_draw + REDRAW_S) if self.mode == "bar" else due

    def restart_rate(self) -> None:
        """Forget the speed measured so far (after a pause that is not training: a save, validation)."""
        self._samples.clear()
        self._due = 0.0

    def _draw(self, step: int, epoch: int) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        text = self.text(step, epoch)
        bar_width = max(10, min(30, width - len(text) - 4))
        filled = min(bar_width, int(bar_width * step / self.total)) if self.total else 0
        line = f"[{'#' * filled}{'.' * (bar_width - filled)}] {text}"[: max(1, width - 1)]
        try:
            self.stream.write("\r\x1b[K" + line)
            self.stream.flush()
            self.visible = True
        except (OSError, ValueError):
            self.mode = "none"

    def clear(self) -> None:
        if self.visible:
            try:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self.visible = False

    def close(self) -> None:
        self.clear()
        for handler, f in self._filters:
            handler.removeFilter(f)
        self._filters.clear()

    def __enter__(self) -> "ProgressDisplay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
