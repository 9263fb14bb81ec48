"""backend.start_method=forkserver (the default): torch elastic's workers are forked from a server
process that imported torch, the worker module and the steadfast library once, so a worker, the
first one or a restarted one, starts in milliseconds instead of importing torch again.

Why it is safe, where plain `fork` is not: `fork` copies the launcher, which has threads (torch
elastic's store, the launcher's supervisor, Hydra's logging); a lock one of them held at that
moment stays locked forever in the child (a development run deadlocked that way). The server is
not a copy of the launcher: multiprocessing starts it with fork + exec, a fresh interpreter that
imports PRELOAD in its only thread and then does nothing but fork on request. After the imports
it still has exactly one thread and no CUDA context (nothing in PRELOAD calls into CUDA while
importing; PYTORCH_NVML_BASED_CUDA_CHECK=1 is set in the server only, so even a
torch.cuda.is_available() there would not poison fork); it holds no file of a run and none of
the launcher's descriptors (it gets only its listening socket and a pipe that ends it when the
launcher exits). tests/launcher/test_forkserver.py checks the thread count and that the imports make no
CUDA call. The server lives as long as the launcher process: every launch and every restart of
a sweep's jobs reuses it; multiprocessing starts a new one if it died.

What a spawned worker gets from the launcher at its start and a forked one would not have, it is
given: the working folder, sys.path and sys.argv (multiprocessing's preparation data, as with
spawn), the launcher's environment at the launch (`environment_file`: a private file, adopted by
`adopt_environment` before anything reads it) and fresh random state for numpy. Variables read
only while torch is imported (TORCH_CPP_LOG_LEVEL, say) come from the environment the server
started with: the launcher's, before any job's `hydra.job.env_set`; with
backend.start_method=spawn every worker imports torch itself.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import sys
import uuid
from pathlib import Path
from typing import Dict, Iterator, Tuple

from . import _payload
from ._compat import forkserver as forkserver_compat
from ._payload import PayloadRef

# Imported once in the server, in this order: this module first (it records the server's
# environment), then what every worker imports before its first step: torch, its distributed
# package, DDP (which imports torch._dynamo), the launcher's worker module and the library.
PRELOAD: Tuple[str, ...] = (
    __name__,
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "hydra_plugins.steadfast_launcher._worker",
    "steadfast.run",
)
SERVER_ONLY_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}

# The environment of this process when it last forked. In a worker forked from the server: the
# server's (this module is the first one the server imports), which tells the variables torch
# elastic set for the worker apart from the server's.
_forked_with: Dict[str, str] = {}


def _remember_environment() -> None:
    global _forked_with
    _forked_with = dict(os.environ)


os.register_at_fork(before=_remember_environment)


def start() -> None:
    """Start the server (if it is not running) with PRELOAD; returns at once, the server imports in
    parallel with the launcher's own work. Call it before the launcher imports torch itself."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    with _environment(SERVER_ONLY_ENV):
        forkserver.ensure_running()
    if not _owner:
        _owner.append(os.getpid())
        atexit.register(_stop)


_owner: "list[int]" = []  # the process that started the server (atexit handlers also run in its forks)


def _stop() -> None:
    """At the launcher's exit: end the server and reap it, so it does not outlive the launcher and
    its workers' CPU time counts as this process's children's (what `time` and rusage report)."""
    if _owner == [os.getpid()]:
        forkserver_compat.stop_server()


@contextlib.contextmanager
def _environment(values: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if saved[k] is None})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


def environment_file(folder: Path) -> PayloadRef:
    """The launcher's environment now, in a private file the workers of this launch adopt."""
    return _payload.write(folder, f"environ-{uuid.uuid4().hex}.pkl", dict(os.environ))


def adopt_environment(ref: PayloadRef) -> None:
    """In a worker forked from the server: the launcher's environment at the launch plus what torch
    elastic set for this worker (the variables that differ from the server's), exactly what a
    spawned worker would have; and numpy's global random state drawn afresh, as in a new process
    (Python's `random` reseeds itself after a fork; numpy's does not)."""
    if not _forked_with:  # multiprocessing ignores a preload that fails to import
        raise RuntimeError(
            f"this worker was not forked from a server that imported {__name__}; backend.start_method=spawn avoids the forkserver"
        )
    launcher: Dict[str, str] = _payload.load(ref)
    set_for_worker = {k: v for k, v in os.environ.items() if _forked_with.get(k) != v}
    wanted = {**launcher, **set_for_worker}
    for key in [k for k in os.environ if k not in wanted]:
        del os.environ[key]
    os.environ.update(wanted)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
