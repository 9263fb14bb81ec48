"""torch elastic's view of its worker processes (`MultiprocessContext`) reports one failed worker per
failure: the first one its `join` happens to find, after which it stops the others. Which one that is
depends on polling order, so a survivor whose collective failed a moment after its peer was killed is
often reported instead of the peer. A wrapper of `_poll` reads every worker's exit status as the
agent finds the failure (before torch stops the rest) and after, and hands them to the launcher's
observers (`observe`), in the agent's own thread. An observer that answers True (the failure would
come back on every attempt) has the agent stopped there, before it restarts the group: its `stop`
is called last, outside any handler, so the signal it sends the agent ends the agent's run at once.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .._types import ExitObserver, WorkerExit
from . import Patch, applies

TARGET = "torch.distributed.elastic.multiprocessing.api"
log = logging.getLogger(__name__)


def _shape() -> Optional[str]:
    module = importlib.import_module(TARGET)
    context = getattr(module, "MultiprocessContext", None)
    if context is None:
        return f"{TARGET} has no MultiprocessContext"
    if not callable(getattr(context, "_poll", None)):
        return "MultiprocessContext has no _poll"
    return None


EXIT_STATUSES = Patch(
    "every worker's exit status when torch elastic finds a failure",
    "torch",
    ">=2.13,<2.14",
    _shape,
    "a failure is diagnosed from the workers' own records and when the launcher saw them end, without their exit statuses",
)

_observers: List[Tuple[ExitObserver, Callable[[], None]]] = []
_lock = threading.Lock()
_installed = False


def _statuses(context: Any) -> Dict[int, tuple[int, int]]:
    """{pid: (local rank, exit code)} of the context's processes that have ended."""
    processes = getattr(getattr(context, "_pc", None), "processes", None) or []
    out: Dict[int, tuple[int, int]] = {}
    for local_rank, process in enumerate(processes):
        code = process.exitcode  # non-blocking; the agent's thread, as torch's own polling
        if code is not None and process.pid is not None:
            out[process.pid] = (local_rank, code)
    return out


def _install() -> None:
    global _installed
    if _installed:
        return
    context = importlib.import_module(TARGET).MultiprocessContext
    original = context._poll

    def _poll(self: Any) -> Any:
        if not _observers:
            return original(self)
        before = _statuses(self)
        result = original(self)
        if result is not None and result.is_failed():
            after = {**_statuses(self), **before}
            exits = [
                WorkerExit(code, stopped_by_backend=pid not in before, pid=pid, local_rank=lr)
                for pid, (lr, code) in after.items()
            ]
            with _lock:
                observers = list(_observers)
            stops = []
            for observer, stop in observers:
                try:
                    if observer(exits):
                        stops.append(stop)
                except Exception:  # the launcher's diagnosis must never break the agent's own handling
                    log.exception("steadfast: recording the workers' exit statuses failed")
            for stop in stops:
                stop()  # last: the agent's own handler may end its run here
        return result

    context._poll = _poll
    _installed = True


@contextlib.contextmanager
def observe(observer: Optional[ExitObserver], stop: Callable[[], None]) -> Iterator[None]:
    """While inside, each failure torch elastic's agent finds hands `observer` every worker's exit;
    when it answers True, `stop` is called (in the agent's thread) before the agent goes on."""
    if observer is None or not applies(EXIT_STATUSES):
        yield
        return
    entry = (observer, stop)
    with _lock:
        _install()
        _observers.append(entry)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(entry)
