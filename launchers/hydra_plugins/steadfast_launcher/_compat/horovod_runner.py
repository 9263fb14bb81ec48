"""Horovod 0.28.1's runner (`horovod.run`), patched for the duration of one launch: five patches.

- shutdown events: horovod.run would swap SIGINT/SIGTERM for an event that terminates the workers
  after a fixed 5 s. Instead the launcher's handlers stay (they only set the stop flag), its
  supervisor forwards the signal to the workers, which save and stop, and it sets these events
  (Horovod then stops whatever still runs) only after restart.preemption_grace_s.
- tuning: horovod.run hands every worker HOROVOD_CYCLE_TIME='(None,)' and
  HOROVOD_CACHE_CAPACITY='(None,)' (its runner/__init__.py sets `cycle_time_ms = None,` and
  `cache_capacity = None,`: tuples), whatever the environment says. The C++ side parses both with
  strto*, so they become 0, and fixed (the autotuner may not change them): a background thread that
  never waits between cycles, spinning on one of the cores the workers train on, and no response
  cache, so every cycle negotiates every tensor by name. TUNING are the values the workers get
  instead; a value in the launcher's environment wins. Chosen from bench/horovod.py's measurement
  (see bench/NOTES.md): Horovod's own defaults for the two it meant to leave alone.
- Gloo check: what horovod.run's `gloo_built` asks (in a forked child that imports torch: 1.6 s of
  every launch here), asked the way Horovod's own basics.py does, the extension's
  horovod_gloo_built through ctypes, in a new interpreter that loads the library without torch (0.25 s).
- result store: horovod.run's store of the workers' results answers through socketserver's
  serve_forever, which notices the runner's shutdown() only at its next poll (0.5 s by default):
  every launch and every relaunch ended with that wait.
- exit statuses: when workers fail, horovod.run's error names one, the first whose runner thread
  returned; a rank killed by a signal is often not that one (a peer's collective fails at once and its
  process exits while the killed one's shell is still being reaped). Every worker's exit status is
  recorded as its thread returns (rank, shell status, whether another had already failed), so the
  launcher can say how each ended.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import Patch, applies

HOROVOD = "horovod"  # the distribution
WRITTEN_FOR = "==0.28.1"
TUNING = {"HOROVOD_CYCLE_TIME": "1", "HOROVOD_CACHE_CAPACITY": "1024"}
SERVER_POLL_S = 0.02
_GLOO_BUILT = """
import ctypes, importlib.util, os, sysconfig
spec = importlib.util.find_spec("horovod")
library = os.path.join(os.path.dirname(spec.origin), "torch", "mpi_lib_v2" + sysconfig.get_config_var("EXT_SUFFIX"))
print(int(ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL).horovod_gloo_built()))
"""


def _parameters(function: Callable[..., Any]) -> List[str]:
    return list(inspect.signature(function).parameters)


def _shutdown_shape() -> Optional[str]:
    from horovod.runner import gloo_run

    found = _parameters(gloo_run.register_shutdown_event)
    return None if found == [] else f"gloo_run.register_shutdown_event{tuple(found)} now takes arguments"


def _tuning_shape() -> Optional[str]:
    from horovod.runner.common.util import config_parser

    found = _parameters(config_parser.set_env_from_args)
    return None if found == ["env", "args"] else f"config_parser.set_env_from_args{tuple(found)} is not (env, args)"


def _gloo_shape() -> Optional[str]:
    from horovod.runner import launch

    return None if callable(getattr(launch, "gloo_built", None)) else "horovod.runner.launch.gloo_built is gone"


def _exits_shape() -> Optional[str]:
    from horovod.runner import gloo_run

    found = _parameters(gloo_run._exec_command_fn)
    return None if found == ["settings"] else f"gloo_run._exec_command_fn{tuple(found)} is not (settings)"


def _store_shape() -> Optional[str]:
    from horovod.runner.http import http_server

    server = http_server.KVStoreHTTPServer
    if not issubclass(server, http_server.HTTPServer) or "serve_forever" in vars(server):
        return "KVStoreHTTPServer no longer serves with socketserver's serve_forever"
    found = _parameters(server.serve_forever)
    return None if "poll_interval" in found else f"serve_forever{tuple(found)} takes no poll_interval"


SHUTDOWN = Patch(
    "horovod.run keeps the launcher's stop handlers",
    HOROVOD,
    WRITTEN_FOR,
    _shutdown_shape,
    "Horovod's runner takes SIGINT/SIGTERM over and stops the workers 5 s after a stop request",
)
WORKER_TUNING = Patch(
    "horovod.run's workers get HOROVOD_CYCLE_TIME and HOROVOD_CACHE_CAPACITY",
    HOROVOD,
    WRITTEN_FOR,
    _tuning_shape,
    "the workers get what this Horovod writes",
)
GLOO_CHECK = Patch(
    "horovod.run's Gloo check without importing torch",
    HOROVOD,
    WRITTEN_FOR,
    _gloo_shape,
    "each launch waits for Horovod's own check (about 1.6 s)",
)
RESULT_STORE = Patch(
    "horovod.run's result store polls every 20 ms",
    HOROVOD,
    WRITTEN_FOR,
    _store_shape,
    "each launch ends up to 0.5 s later",
)
EXIT_STATUSES = Patch(
    "horovod.run tells every worker's exit status",
    HOROVOD,
    WRITTEN_FOR,
    _exits_shape,
    "a failure names how the first worker to be reaped ended, and no other's",
)
PATCHES = (SHUTDOWN, WORKER_TUNING, GLOO_CHECK, RESULT_STORE, EXIT_STATUSES)
Exit = Tuple[int, int, bool]  # (rank, its shell's exit status, another worker had already failed when it was reaped)


@functools.lru_cache(maxsize=None)
def gloo_built() -> Optional[bool]:
    """Whether Horovod's PyTorch extension has Gloo; None if this cannot tell (horovod.run then
    makes its own check, and says what is wrong)."""
    try:
        done = subprocess.run([sys.executable, "-c", _GLOO_BUILT], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip()
    return answer == "1" if done.returncode == 0 and answer in ("0", "1") else None


def tuned(set_env_from_args: Callable[[Dict[str, str], object], None]) -> Callable[[Dict[str, str], object], None]:
    """Horovod's `config_parser.set_env_from_args` (what horovod.run builds the workers' environment
    with), followed by TUNING: explicit values instead of the '(None,)' it writes."""

    def with_tuning(env: Dict[str, str], args: object) -> None:
        set_env_from_args(env, args)
        env.update({key: os.environ.get(key) or value for key, value in TUNING.items()})

    return with_tuning


def recording(exec_command_fn: Callable[[Any], Any], exits: List[Exit]) -> Callable[[Any], Any]:
    """Horovod's `gloo_run._exec_command_fn`, whose commands append each worker's exit to `exits`."""
    lock = threading.Lock()

    def fn(settings: Any) -> Any:
        exec_command = exec_command_fn(settings)

        def recorded(command: str, slot_info: Any, events: Any) -> Tuple[int, float]:
            status, at = exec_command(command, slot_info, events)
            with lock:
                exits.append((int(slot_info.rank), int(status), any(s != 0 for _, s, _ in exits)))
            return status, at

        return recorded

    return fn


@contextlib.contextmanager
def runner_patched(stop_events: List[threading.Event], exits: Optional[List[Exit]] = None) -> Iterator[None]:
    """Horovod's runner with every patch whose gate holds; `stop_events` collects the runner's
    shutdown events (set them to have it stop what still runs), `exits` every worker's exit (Exit).
    Everything is put back on exit."""
    from horovod.runner import gloo_run
    from horovod.runner import launch as runner_launch
    from horovod.runner.common.util import config_parser
    from horovod.runner.http import http_server

    def event_without_handlers() -> threading.Event:
        stop_events.append(threading.Event())
        return stop_events[-1]

    swaps: List[Tuple[Any, str, Any]] = []
    if applies(SHUTDOWN):
        swaps.append((gloo_run, "register_shutdown_event", event_without_handlers))
    if applies(WORKER_TUNING):
        swaps.append((config_parser, "set_env_from_args", tuned(config_parser.set_env_from_args)))
    known = gloo_built() if applies(GLOO_CHECK) else None
    if known is not None:
        swaps.append((runner_launch, "gloo_built", lambda verbose=False: known))
    if applies(RESULT_STORE):
        polling = functools.partialmethod(http_server.HTTPServer.serve_forever, poll_interval=SERVER_POLL_S)
        swaps.append((http_server.KVStoreHTTPServer, "serve_forever", polling))
    if exits is not None and applies(EXIT_STATUSES):
        swaps.append((gloo_run, "_exec_command_fn", recording(gloo_run._exec_command_fn, exits)))
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in swaps]
    for owner, name, new in swaps:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in saved:
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
