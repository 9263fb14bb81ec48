"""What goes to the launcher's log file (train.log) and not to the console.

The console gets one line per failure and per restart; the details (a failed worker's traceback as
the backend logs it, the consequences of a failure, torch elastic's own warnings) go to the job's log
file, so that train.log tells the launcher's whole story. Hydra gives each job its own file handler,
so the loggers are pointed at the current job's files at every launch.

Whatever reaches the console or train.log shows only printable characters (`printable_only`): a
worker's exception message, quoted in a traceback torch elastic logs or in a diagnosis, can hold
terminal escapes that would erase or rewrite the lines a person reads; they are written as \\xNN.
A backend that copies its workers' output to the console itself (Horovod's runner) does it through
`printable_streams`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator, TextIO

from steadfast.contract.failures import printable

DETAILS = "hydra_plugins.steadfast_launcher.details"  # the launcher's own file-only messages
_MARK = "_steadfast_file_only"


def files_only(*names: str) -> None:
    """Send the records of loggers `names` to the root logger's file handlers only. Without a file
    handler (logging configured without one) they stay on the console rather than be lost."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in names:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
            logger.removeHandler(handler)
        if not files:
            logger.propagate = True
            continue
        for handler in files:
            setattr(handler, _MARK, True)
            logger.addHandler(handler)
        logger.propagate = False


class _Printable(logging.Filter):
    """Writes the control characters of a record's text and traceback as \\xNN (newline and tab kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = printable(record.getMessage()), None
        except Exception:  # a record whose arguments do not fit its format: logging reports it as usual
            return True
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None  # the text below is what every formatter shows
        if record.exc_text:
            record.exc_text = printable(record.exc_text)
        if record.stack_info:
            record.stack_info = printable(record.stack_info)
        return True


def printable_only() -> None:
    """Every record the root logger's handlers write (the console, the job's log file) shows only
    printable characters. Hydra gives each job its handlers: called at every launch."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _Printable) for f in handler.filters):
            handler.addFilter(_Printable())


class _PrintableStream:
    """A text stream that writes what it is given with its control characters as \\xNN."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable(text))

    def __getattr__(self, name: str) -> Any:  # flush, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def printable_streams() -> Iterator[None]:
    """While inside, what is written to sys.stdout and sys.stderr (a backend copying its workers' output)
    shows only printable characters; the log handlers keep their own streams."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PrintableStream(out), _PrintableStream(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
