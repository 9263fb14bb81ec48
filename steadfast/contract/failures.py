"""What the workers and the launcher share about a failure: text from a worker made safe to show, and
the failures a restart cannot cure, as the code that meets one knows it.

A worker's exception message is the user's (or a library's) text: it can hold terminal escapes that,
written raw to a terminal, erase or rewrite the lines a person reads. `printable` writes every
control character but newline and tab as a visible `\\xNN`; the launcher's log handlers and the
workers' log formatter pass every line through it.

Some failures come back on every attempt, whatever is restarted: a config value a worker finds it
cannot use once it sees what the value applies to (`ConfigInvalid`), a checkpoint save that finds
the disk full. Code that knows it says so on the exception (`RECURS`, a phrase); a worker records
that phrase with its failure (`worker_failed`'s `recurs`), and the launcher then stops the job
instead of restarting it (see the launcher's _diagnosis.recurrence). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import re
from typing import Iterator, Optional

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with control characters (terminal escapes included) written as \\xNN, newline and tab kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


RECURS = "steadfast_recurs"  # the attribute of an exception that says why it would come back on every attempt
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class ConfigInvalid(ValueError):
    """A config value a worker found it cannot use (a module class the model does not have, ...): every
    attempt would find it again, so the launcher does not restart the job."""

    steadfast_recurs = "a config error found by a worker"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it (`raise ... from`) or was being handled when it was raised."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def recurs(exc: BaseException) -> Optional[str]:
    """Why `exc` would come back on every attempt (a phrase from the code that knew it), or None."""
    for e in _chain(exc):
        why = getattr(e, RECURS, None)
        if isinstance(why, str) and why:
            return why
    return None


def disk_full(exc: BaseException) -> bool:
    """`exc` or what caused it is a write that found no space (ENOSPC, or a quota: EDQUOT)."""
    return any(isinstance(e, OSError) and e.errno in DISK_FULL for e in _chain(exc))


@contextlib.contextmanager
def recurs_when_disk_full(what: str) -> Iterator[None]:
    """An exception raised inside that a full disk caused is marked as recurring: `what` found no
    space ('a checkpoint save'). Not for writes a restart can cure (snapshots in shared memory: the
    next attempt checks that they fit, and turns them off if not)."""
    try:
        yield
    except BaseException as exc:
        if disk_full(exc) and recurs(exc) is None:
            setattr(exc, RECURS, f"the disk is full ({what} found no space left)")
        raise
