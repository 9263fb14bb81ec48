"""torch's log formatter (torch._logging's TorchLogsFormatter) imports torch._dynamo to read one
setting whenever a record carries exc_info, and torch elastic's agent logs every worker failure that
way: the first restart of every launch waited for that import (1.1 s of 1.7 s here). A filter on the
handlers puts the traceback into the record's text first and drops exc_info; the text is the same
(logging's own formatException, which that formatter would use)."""

from __future__ import annotations

import logging
from typing import Optional

from . import Patch, applies


def _shape() -> Optional[str]:
    from torch._logging import _internal

    formatter = getattr(_internal, "TorchLogsFormatter", None)
    if formatter is None:
        return "torch._logging._internal has no TorchLogsFormatter"
    return None if issubclass(formatter, logging.Formatter) else "TorchLogsFormatter is not a logging.Formatter"


RENDERED_FIRST = Patch(
    "tracebacks rendered before torch's log formatter sees them",
    "torch",
    ">=2.13,<2.14",
    _shape,
    "the first restart of a launch waits about 1 s for torch._dynamo's import",
)


class _TracebackRendered(logging.Filter):
    """Puts the traceback of a record of logger `name` (or below) into its text and drops exc_info;
    other records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and super().filter(record):
            if not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


def render_tracebacks_first(name: str) -> None:
    """Add the filter to every handler a record of logger `name` reaches (once)."""
    if not applies(RENDERED_FIRST):
        return
    logger: Optional[logging.Logger] = logging.getLogger(name)
    while logger is not None:
        for handler in logger.handlers:
            if not any(isinstance(f, _TracebackRendered) and f.name == name for f in handler.filters):
                handler.addFilter(_TracebackRendered(name))
        logger = logger.parent if logger.propagate else None
