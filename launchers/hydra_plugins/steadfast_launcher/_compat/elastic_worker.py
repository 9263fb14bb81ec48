"""torch elastic's worker wrapper (`torch.distributed.elastic.multiprocessing.api._wrap`): a worker's
process ends as soon as the wrapper has handed back its result.

The wrapper puts the result in a SimpleQueue, a synchronous pipe write, then waits for an event the
agent sets once it has collected every rank's result in its monitoring loop. When the agent is
stopping the group instead (a node joined or left: it SIGTERMs healthy workers, which save and
return) it never sets it and SIGKILLs them after 30 s, so a scale-up cost 30 s. Setting the event
before returning is safe: each worker still puts its result before it reads the event, and the event
only exists to wait for results that a feeder thread has not yet written, which a SimpleQueue does
not have. The event is a local of the wrapper's frame, found by walking up the stack.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Optional

from . import Patch, applies

WRAPPER = "torch.distributed.elastic.multiprocessing.api"
EVENT = "queue_finished_reading_event"


def _shape() -> Optional[str]:
    wrap = getattr(sys.modules[WRAPPER], "_wrap", None)
    if wrap is None:
        return f"{WRAPPER} has no _wrap"
    code = wrap.__code__
    return None if EVENT in code.co_varnames[: code.co_argcount] else f"{WRAPPER}._wrap takes no {EVENT}"


WRAPPER_WAIT = Patch(
    "a worker ends once torch elastic's wrapper has its result",
    "torch",
    ">=2.13,<2.14",
    _shape,
    "a healthy worker the agent stops (a node joined or left) is killed after 30 s",
)


def end_once_returned(frame: Optional[FrameType]) -> None:
    """Set the wrapper's event from `frame` (a caller's) or any frame above it; not under torch
    elastic (Horovod, the in-process backend), nothing changes."""
    if WRAPPER not in sys.modules or not applies(WRAPPER_WAIT):
        return
    while frame is not None:
        event = frame.f_locals.get(EVENT) if frame.f_code.co_name == "_wrap" else None
        if event is not None:
            try:
                event.set()
            except Exception:  # the agent's side of it is gone: nothing to wait for anyway
                pass
            return
        frame = frame.f_back
