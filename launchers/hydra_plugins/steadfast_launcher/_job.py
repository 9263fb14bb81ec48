"""One job: lock its folders, run it through Hydra's run_job, freeze its config, hand the workers
their payload, launch and relaunch within restart.max_restarts, and write its summary.

Both ways of running a sweep's jobs (in the launcher's process, or one launcher process per job)
call `run_one`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional, cast

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import events, shm, summary
from steadfast.contract.env import ENV_ATTEMPT, ENV_LAUNCH_ID, ENV_LAUNCH_TIME, LaunchEnv
from steadfast.contract.events import Event
from steadfast.contract.exits import EXIT_PREEMPTED
from steadfast.contract.files import CONFIG_FILE, EVENTS_FILE, SUMMARY_FILE, atomic_write
from steadfast.contract.heartbeat import stop_marker
from steadfast.contract.stop import PREEMPTED, Stopped, request_stop, restore_handlers, signal_name, stop_requested
from steadfast.contract.summary import Status

from . import _backends, _payload
from ._backends import Backend
from ._locks import RunLock
from ._payload import PayloadRef
from ._signals import LaunchSignals
from ._supervise import Supervisor
from ._types import Interrupted, Job, JobFailed, Refused, WorkerFailure, job_return, signame

log = logging.getLogger(__name__)

PAYLOAD_PREFIX = "steadfast-job-"  # the job's private folder under the system's temporary folder


def run_one(hydra_context: HydraContext, task_function: TaskFunction, job: Job) -> JobReturn:
    """One job through Hydra's run_job (output folder, .hydra/, logging, callbacks), under its run lock.

    A launch refused by the lock returns a failed JobReturn whose value is the `Refused` error,
    before Hydra has written anything.
    """
    assert job.run_dir is not None
    lock = RunLock(job.run_dir, job.lock_dirs, _backends.of(job.backend).multi_node_identity(job.run_dir))
    try:
        lock.acquire()
    except Refused as refused:
        return job_return(job, JobStatus.FAILED, refused)
    try:
        return run_job(
            hydra_context=hydra_context,
            task_function=functools.partial(_run, job, task_function),
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    finally:
        lock.release()


def _run(job: Job, task_function: TaskFunction, task_cfg: DictConfig) -> Any:
    """Runs in the launcher process, inside Hydra's run_job (output folder made, HydraConfig set).
    A stop request at any moment, even before the workers exist, ends it with a recorded summary."""
    started = time.time()
    try:
        return _run_job(job, task_function, task_cfg, started)
    except KeyboardInterrupt as stop:
        if getattr(stop, "recorded", False) or job.run_dir is None:
            raise
        env = {ENV_LAUNCH_TIME: repr(started), ENV_ATTEMPT: "0"}
        events.append(job.run_dir, Event.JOB_INTERRUPTED, attempt=0, signal=signame(getattr(stop, "signum", None)))
        _end_on_stop_request(job.run_dir, job, started, env, getattr(stop, "signum", None))


def _run_job(job: Job, task_function: TaskFunction, task_cfg: DictConfig, started: float) -> Any:
    run_dir = job.run_dir
    assert run_dir is not None
    backend = _backends.of(job.backend)
    multi_node = backend.multi_node_identity(run_dir)
    frozen = OmegaConf.create(cast(Dict[str, Any], OmegaConf.to_container(task_cfg, resolve=True, enum_to_str=True)))
    atomic_write(run_dir / CONFIG_FILE, OmegaConf.to_yaml(frozen))
    segments = shm.LaunchFolder(run_dir)  # the snapshots' private folder in shared memory (see contract/shm.py)
    try:
        segments.create()
    except OSError as exc:  # the workers find no folder and say that snapshots in memory are off, and why
        log.info("No snapshot folder in %s for this launch: %s", shm.SHM_DIR, exc.strerror or exc)
    launch = LaunchEnv(
        backend=backend.name,
        collective=backend.collective,
        run_dir=run_dir,
        launch_time=started,
        launch_id=f"{os.getpid()}-{started!r}",
        reference_world_size=backend.reference_world_size(),
        collective_timeout_s=job.restart.collective_timeout_s,
        launcher_pid=os.getpid(),
        snapshot=segments.name,
    )
    for leaked in shm.remove_orphans(run_dir, keep=segments.name):
        log.info("Removed %s, the snapshots of a launch of this run whose launcher is gone", leaked)
    try:
        return _attempts(job, task_function, run_dir, backend, launch, frozen, started, multi_node)
    finally:
        segments.remove()  # the job's snapshots in memory end with it


def _attempts(
    job: Job,
    task_function: TaskFunction,
    run_dir: Path,
    backend: Any,
    launch: LaunchEnv,
    frozen: DictConfig,
    started: float,
    multi_node: Optional[str],
) -> Any:
    """The relaunch loop: one attempt after another, up to the restart budget."""
    events.append(run_dir, Event.LAUNCH, backend=backend.name, overrides=filter_overrides(job.overrides))
    log.info("Run folder: %s", run_dir)
    attempts = 1 if backend.restarts_itself else job.restart.max_restarts + 1
    first_failure: Optional[str] = None
    last = WorkerFailure("no attempt ran")
    with _payload.scratch(PAYLOAD_PREFIX) as private:
        payload = _payload.write(private, "payload.pkl", (task_function, frozen, job.config, Singleton.get_state()))
        for attempt in range(attempts):
            env = LaunchEnv(**{**launch.__dict__, "attempt": attempt}).to_environ()
            if attempt:
                events.append(run_dir, Event.RELAUNCH, attempt=attempt, cause=last.args[0])
                log.warning("Relaunching %s (restart %d of %d)", job.label, attempt, job.restart.max_restarts)
            try:
                result = run_attempt(backend, payload, job, env, run_dir)
            except WorkerFailure as failure:
                last = failure
                first_failure = first_failure or first_recorded_failure(run_dir, started) or failure.args[0]
                continue
            except KeyboardInterrupt as stop:
                events.append(run_dir, Event.JOB_INTERRUPTED, attempt=attempt, signal=signame(getattr(stop, "signum", None)))
                raise
            hosted_rank0 = multi_node is None or result is not None
            if not hosted_rank0:  # global rank 0 ran on another node
                log.info("%s: global rank 0 ran on another node; its result is in %s", job.label, run_dir / SUMMARY_FILE)
            events.append(run_dir, Event.JOB_COMPLETED, relaunches=attempt)
            job.restarts = attempt
            summary.write(
                run_dir,
                Status.COMPLETED,
                since=started,
                restarts=attempt,
                wall_seconds=time.time() - started,
                hosts_rank0=hosted_rank0,
            )
            return result
    restarts = last.restarts if backend.restarts_itself else attempts - 1
    job.restarts = restarts
    message = f"{job.label} failed after {restarts} restart(s) (restart.max_restarts={job.restart.max_restarts}). "
    if first_failure and first_failure != last.args[0]:
        message += f"First failure: {first_failure}. Last failure: {last.args[0]}"
    else:
        message += f"Cause: {last.args[0]}"
    events.append(
        run_dir,
        Event.JOB_FAILED,
        restarts=restarts,
        error=message,
        **({"host": socket.gethostname(), "pid": os.getpid()} if multi_node else {}),
    )
    summary.write(
        run_dir,
        Status.FAILED,
        since=started,
        restarts=restarts,
        wall_seconds=time.time() - started,
        error=message,
        hosts_rank0=multi_node is None,
    )
    raise JobFailed(f"{message}\nRun folder: {run_dir} (logs under logs/, events in {EVENTS_FILE})", restarts)


def first_recorded_failure(run_dir: Path, since: float) -> Optional[str]:
    """The earliest failure recorded in this launch: a worker's error, a hang the watchdog found,
    or an injected fault (workers killed by a signal record nothing themselves)."""
    for event in events.read(run_dir, since=since, kinds=(Event.WORKER_FAILED, Event.HANG_DETECTED, Event.FAULT_FIRED)):
        kind = event["event"]
        if kind == Event.WORKER_FAILED:
            return f"rank {event.get('rank')} on {event.get('host')}: {event.get('error')} (at {event.get('where')})"
        if kind == Event.HANG_DETECTED:
            return (
                f"rank {event.get('rank')} on {event.get('host')} hung after step {event.get('step')} "
                f"(no progress for {event.get('seconds_without_progress')} s, at {event.get('where')}; "
                f"stacks in logs/stacks/)"
            )
        if event.get("fails") is True:  # a rehearsed failure (hangs: see hang_detected)
            return f"rank {event.get('rank')} on {event.get('host')}: fault={event.get('fault')} injected at step {event.get('step')}"
    return None


def run_attempt(backend: Backend, payload: PayloadRef, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
    """`backend.launch` under supervision; turns the ways a launch can end into what the relaunch loop expects.

    - a result: returned;
    - a `Stopped` marker from the workers (they saved and stopped on purpose): for a
      preemption, `Interrupted` (the sweep stops; exit code EXIT_PREEMPTED after SIGTERM); for any
      other stop (e.g. trainer.max_rss_mb), `JobFailed` (not restarted: it would happen again);
    - a stop request that ended the launch otherwise (grace expired, a worker killed by it before
      it could save): `Interrupted` as well; the newest committed checkpoint is intact;
    - a worker failure: `WorkerFailure`, named after the watchdog's finding if it killed a hung rank.

    For the launch's duration SIGTERM/SIGINT/SIGHUP in the launcher set the stop flag and are
    passed on to the registered workers, which stop cleanly (see LaunchSignals, Supervisor).
    """
    env.setdefault(ENV_LAUNCH_ID, f"{os.getpid()}-{env.get(ENV_LAUNCH_TIME, time.time())}")
    if env.get(ENV_ATTEMPT, "0") == "0":
        log.info(
            "Logs: %s (launcher), %s (one per rank)%s",
            _launcher_log(run_dir),
            run_dir / "logs" / "rank<r>.log",
            "".join(f", {folder}" for folder in backend.log_folders(run_dir)),
        )
    handler = LaunchSignals(run_dir, env[ENV_LAUNCH_ID], in_process=backend.in_process)
    previous = handler.install()
    launched = time.time()
    result: Any = None
    try:
        with contextlib.ExitStack() as stack:
            if stop_requested() is not None:  # asked before the workers started: nothing to launch or save
                stack.close()
                return _end_on_stop_request(run_dir, job, launched, env)
            supervisor = (
                None
                if backend.in_process
                else stack.enter_context(
                    Supervisor(
                        run_dir,
                        job.restart,
                        env[ENV_LAUNCH_ID],
                        backend.stop_on_grace_expired,
                        on_overdue=handler.interrupt_main,
                        forwarded=handler.forwarded,
                    )
                )
            )
            try:
                result = backend.launch(payload, job, env, run_dir)
            except WorkerFailure as failure:
                if stop_requested() is None:
                    if supervisor is not None and supervisor.last_hang:  # the watchdog knows more than "killed by SIGKILL"
                        failure.args = (
                            f"{supervisor.last_hang} (killed by the watchdog after restart.hang_timeout_s="
                            f"{job.restart.hang_timeout_s:g})",
                        )
                    raise
                log.warning("%s", failure.args[0])
            except KeyboardInterrupt as stop:
                request_stop(getattr(stop, "signum", None) or signal.SIGINT)
            else:
                if not isinstance(result, Stopped):
                    return result
                if result.reason != PREEMPTED:
                    status = Status(result.reason) if result.reason in {s.value for s in Status} else Status.FAILED
                    summary.write(
                        run_dir,
                        status,
                        since=_launch_time(env),
                        restarts=int(env.get(ENV_ATTEMPT, "0")),
                        wall_seconds=time.time() - _launch_time(env),
                        error=result.message,
                        stop_step=result.step,
                    )
                    events.append(run_dir, Event.JOB_STOPPED, reason=result.reason, step=result.step, message=result.message)
                    raise JobFailed(f"{job.label} stopped: {result.message}\nRun folder: {run_dir}")
        return _end_on_stop_request(run_dir, job, launched, env, getattr(result, "signal", None))
    finally:
        restore_handlers(previous)
        stop_marker(run_dir, env[ENV_LAUNCH_ID]).unlink(missing_ok=True)


def _end_on_stop_request(run_dir: Path, job: Job, launched: float, env: Dict[str, str], signum: Optional[int] = None) -> Any:
    """A stop request ended the launch: record it and raise Interrupted with where the workers stopped."""
    signum = stop_requested() or signum or signal.SIGTERM
    message = _preempted(run_dir, job, launched, signum, env)
    log.warning("%s", message)
    stop = Interrupted(message, signum=signum)
    stop.recorded = True  # type: ignore[attr-defined]
    raise stop


def _launch_time(env: Dict[str, str]) -> float:
    try:
        return float(env.get(ENV_LAUNCH_TIME) or time.time())
    except ValueError:
        return time.time()


def _preempted(run_dir: Path, job: Job, since: float, signum: int, env: Dict[str, str]) -> str:
    """Summary and message of a stop on request: where the workers stopped, and whether it is committed."""
    stop = events.last(events.read(run_dir, since=since, kinds=(Event.PREEMPTED,)), Event.PREEMPTED)
    name = str(stop.get("signal")) if stop and stop.get("signal") else signal_name(signum)
    if stop and stop.get("saved"):
        how = f"stopped at step {stop.get('step')}, checkpoint committed: no step lost"
    else:
        how = (
            "stopped before the workers could save (restart.preemption_grace_s="
            f"{job.restart.preemption_grace_s:g}); they resume from the newest committed checkpoint"
        )
    summary.write(
        run_dir,
        Status.PREEMPTED,
        since=since,
        restarts=int(env.get(ENV_ATTEMPT, "0")),
        wall_seconds=time.time() - _launch_time(env),
        stop_signal=name,
    )
    return (
        f"{job.label} preempted by {name}: {how}. Run the same command again to continue "
        f"(exit code {EXIT_PREEMPTED} after SIGTERM)."
    )


def _launcher_log(run_dir: Path) -> str:
    """Hydra's job log file (the launcher's messages for this job), or logs/launcher.log if Hydra writes none."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    path = run_dir / "logs" / "launcher.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return str(path)
