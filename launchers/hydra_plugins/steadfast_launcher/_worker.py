"""What runs on every rank: read the job's payload, restore Hydra's state, call the task function,
record a failure. Importing it registers the backends too (a task may ask the registry, e.g. an
app that types its config with a backend's schema)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import setup_globals

from steadfast.contract import compile_cache, events
from steadfast.contract.env import ENV_LAUNCH_ID, LaunchEnv, current_rank, restart_count, run_dir
from steadfast.contract.exits import EXIT_ORPHANED
from steadfast.contract.failures import recurs
from steadfast.contract.heartbeat import DONE_PHASE, STARTUP_PHASES, enable_stack_dumps, heartbeat, start_heartbeat, stop_marker
from steadfast.contract.stop import STOP_SIGNALS, StopRun, ignore_stop_signals, install_stop_handlers, stop_requested

from . import _backends, _forkserver, _payload  # noqa: F401  (_backends: registers every backend)
from ._compat.elastic_worker import end_once_returned
from ._payload import PayloadRef


def run_rank(ref: PayloadRef, environ: Optional[PayloadRef] = None, restore_hydra: bool = True) -> Any:
    """One rank's task. `environ`: the launcher's environment at the launch, for a worker forked from
    the forkserver (a spawned one inherits it)."""
    if restore_hydra:  # a fresh worker process
        start_rank(environ)
    try:
        return run_task(lambda: _loaded(ref, restore_hydra))
    finally:
        end_rank(restore_hydra)


def start_rank(environ: Optional[PayloadRef] = None) -> None:
    """What a fresh worker process does first, once its LaunchEnv is in the environment."""
    # First of all: from here on a SIGTERM/SIGINT (forwarded by the launcher, or sent by a
    # scheduler) is a stop request, never a sudden death; the watchdog can see this rank and
    # ask it for its stacks.
    install_stop_handlers()
    if environ is not None:
        _forkserver.adopt_environment(environ)
    folder = run_dir()
    refused = compile_cache.use(folder)  # before the task compiles anything: restarts reuse what it compiled
    if refused and current_rank() == 0:
        print(f"[rank 0] {refused}", file=sys.stderr, flush=True)
    start_heartbeat(folder, current_rank())
    enable_stack_dumps(folder, current_rank())
    _guard_start_up(folder)
    _end_with_the_launcher()


def _loaded(ref: PayloadRef, restore_hydra: bool) -> Tuple[Callable[[Any], Any], Any]:
    task_function, task_cfg, job_cfg, hydra_state = _payload.load(ref)  # checks the sha256 first
    if restore_hydra:  # a fresh process: rebuild what Hydra had in the launcher
        Singleton.set_state(hydra_state)
        setup_globals()
        HydraConfig.instance().set_config(job_cfg)
    return task_function, task_cfg


def run_task(task: Callable[[], Tuple[Callable[[Any], Any], Any]]) -> Any:
    """Call the task function `task()` gives with its config: its value, or the Stopped marker of a
    task that stopped on purpose; a failure is recorded (worker_failed) and raised."""
    try:
        task_function, task_cfg = task()
        _record_rendezvous()
        result = task_function(task_cfg)
        _end_once_returned()
        return result
    except StopRun as stop:
        _end_once_returned()
        return stop.marker  # a normal exit: no backend treats it as a failure to restart from
    except Exception as exc:
        _record_failure(exc)
        raise


def end_rank(fresh_process: bool) -> None:
    """The task is over: the hang watchdog stops watching this rank."""
    beat = heartbeat()
    if beat is not None:
        beat.beat(beat.step, DONE_PHASE)
    if fresh_process:
        # Nothing left to stop. Python puts back the default action of every signal it handles
        # while the interpreter shuts down, so a late SIGTERM (a scheduler signalling every
        # process, a second forward) would end a finished worker with -15, which torch elastic
        # takes for a failure and restarts the group; ignored signals stay ignored.
        ignore_stop_signals()


def _end_once_returned() -> None:
    """Let this worker's process end as soon as torch elastic's wrapper has handed back its result
    (see _compat.elastic_worker; not under torch elastic, nothing changes)."""
    end_once_returned(sys._getframe(1))


ORPHAN_CHECK_S = 0.5  # how often a worker looks whether its launcher is still there


def _end_with_the_launcher() -> None:
    """A worker whose launcher is gone (killed with SIGKILL) ends at once, saving nothing: a new launch
    may already hold the run folder, and nothing would collect its result. (torch sends its workers
    SIGINT when the agent dies, which a worker takes for a stop request and would act on by saving.)"""
    launch = LaunchEnv.current()
    if not launch.launcher_pid:
        return

    def watch() -> None:
        while launch.launcher_alive():
            time.sleep(ORPHAN_CHECK_S)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="steadfast-orphan-watch", daemon=True).start()


def _record_rendezvous() -> None:
    """Rank 0 records where this launch's workers met (address:port, run id): sweep jobs never share them."""
    if current_rank() != 0:
        return
    try:
        launch = LaunchEnv.current()
        names, env = launch.rank_env, os.environ
        port = env.get(names.port) if names.port else None
        record = events.Rendezvous(
            world_size=launch.world_size,
            restart=restart_count(),
            endpoint=f"{env.get(names.address)}:{port}" if port else None,
            run_id=(env.get(names.run_id) or None) if names.run_id else None,
        )
        events.write(launch.run_dir, record)
    except Exception:  # recording must never stop the job
        pass


def _record_failure(exc: BaseException) -> None:
    """What the launcher diagnoses a failure from: the error, where it was raised, the step this rank had
    reached, and whether the code that raised it knew it comes back on every attempt."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    beat = heartbeat()
    try:
        record = events.WorkerFailed(
            rank=current_rank(),
            restart=restart_count(),
            error=f"{type(exc).__name__}: {exc}",
            where=where,
            step=beat.step if beat is not None and beat.step >= 0 else None,
            recurs=recurs(exc),
        )
        events.write(run_dir(), record)
    except Exception:  # recording must never hide the original error
        pass


MARKER_WAIT_S = 1.0  # how long a stop signal during start-up waits for the launcher's marker


def _guard_start_up(folder: Path) -> None:
    """Until its first step, a worker ends at once on a stop signal that did not come from the launcher.

    Such a signal is the backend stopping the worker group (a peer died: torch elastic restarts the
    group, Horovod's runner ends the job). A worker still starting up may be blocked in C++ waiting
    for that peer (connecting to its store, a rendezvous barrier), where its Python stop handler
    cannot run, so the backend would wait out its own timeout (torch elastic: 30 s) before it kills
    it. It has nothing to save yet. The signal reaches a thread at once through the wakeup fd
    (written by the C-level handler), or, when it came before this guard was up, through the stop
    handler's flag; a stop request from the launcher (it writes its stop marker
    before it signals) is left to the stop handler, as at any other time.
    """
    launch_id = os.environ.get(ENV_LAUNCH_ID, "")
    if threading.current_thread() is not threading.main_thread() or not launch_id:
        return
    readable, writable = os.pipe()
    os.set_blocking(writable, False)
    try:
        signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(readable)
        os.close(writable)
        return
    marker = stop_marker(folder, launch_id)
    threading.Thread(target=_start_up_watch, args=(readable, marker), name="steadfast-startup-guard", daemon=True).start()


def _starting() -> bool:
    beat = heartbeat()
    return beat is not None and beat.phase in STARTUP_PHASES


def _start_up_watch(readable: int, marker: Path) -> None:
    stops = {int(s) for s in STOP_SIGNALS}
    while _starting():
        woken = select.select([readable], [], [], 0.2)[0]
        received = set(os.read(readable, 64)) & stops if woken else set()
        early = stop_requested()
        if not received and early is not None:
            # it came between the stop handlers and this guard: only the handler's flag saw it
            received = {early}
        if not received:
            continue
        deadline = time.monotonic() + MARKER_WAIT_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if marker.exists() or not _starting():
            return  # the launcher's stop request: the stop handler saves and stops at the first step
        name = signal.Signals(min(received)).name
        print(
            f"[rank {current_rank()}] {name} during start-up (the backend is stopping the worker group): exiting now",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + min(received))
