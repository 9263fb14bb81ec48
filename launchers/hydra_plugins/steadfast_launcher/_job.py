"""One job: lock its folders, run it through Hydra's run_job, freeze its config, hand the workers
their payload, launch and relaunch within restart.max_restarts, and record how it ended.

How a launch ended is a value (Completed, Stopped, Failed: see _types) from the backend up to the
relaunch loop, and how the job ended is one too, up to `_run`, which hands it to Hydra the way
Hydra's run_job expects a task to end (its value returned; JobFailed or Interrupted raised). On the
way, `_record_end` writes the job's last event and its summary.json: the one place either is written.

Both ways of running a sweep's jobs (in the launcher's process, or one launcher process per job)
call `run_one`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Optional, cast

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import events, shm, summary
from steadfast.contract.env import ENV_LAUNCH_ID, LaunchEnv
from steadfast.contract.events import Event
from steadfast.contract.exits import exit_code
from steadfast.contract.failures import printable
from steadfast.contract.files import CONFIG_FILE, EVENTS_FILE, SUMMARY_FILE, atomic_write
from steadfast.contract.heartbeat import stop_marker
from steadfast.contract.stop import Stopped, StopReason, request_stop, restore_handlers, signal_name, stop_requested
from steadfast.contract.summary import Status

from . import _backends, _payload
from ._backends import Attempt, Backend
from ._locks import RunLock
from ._logfiles import DETAILS, printable_only
from ._signals import LaunchSignals
from ._supervise import Supervisor
from ._types import Completed, Failed, Interrupted, Job, JobFailed, Outcome, Refused, job_return
from ._worker import run_rank

log = logging.getLogger(__name__)
details = logging.getLogger(DETAILS)  # train.log only

PAYLOAD_PREFIX = "steadfast-job-"  # the job's private folder under the system's temporary folder
_STATUS_OF: Dict[StopReason, Status] = {
    StopReason.PREEMPTED: Status.PREEMPTED,
    StopReason.MEMORY_LIMIT: Status.MEMORY_LIMIT,
    StopReason.ANOMALY_STOP: Status.ANOMALY_STOP,
}


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
    assert job.run_dir is not None
    try:
        outcome = _run_job(job, task_function, task_cfg, started)
    except KeyboardInterrupt as stop:  # before the relaunch loop took over (the config, the payload)
        outcome = _end_on_request(job, job.run_dir, started, started, 0, getattr(stop, "signum", None))
    if isinstance(outcome, Completed):
        return outcome.value
    if isinstance(outcome, Failed):
        raise JobFailed(outcome.cause, outcome.restarts)
    if outcome.reason is StopReason.PREEMPTED:  # the sweep stops (exit code EXIT_PREEMPTED after SIGTERM)
        raise Interrupted(outcome.message, signum=outcome.signal)
    raise JobFailed(outcome.message)  # stopped on purpose, not to be restarted (e.g. trainer.max_rss_mb)


def _run_job(job: Job, task_function: TaskFunction, task_cfg: DictConfig, started: float) -> Outcome:
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
        rank_env=backend.spec.rank_env,
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
    backend: Backend,
    launch: LaunchEnv,
    frozen: DictConfig,
    started: float,
    multi_node: Optional[str],
) -> Outcome:
    """The relaunch loop: one attempt after another, up to the restart budget; how the job ended."""
    events.write(run_dir, events.Launch(backend=backend.name, overrides=list(filter_overrides(job.overrides))))
    log.info("Run folder: %s", run_dir)
    attempts = 1 if backend.restarts_itself else job.restart.max_restarts + 1
    first_failure: Optional[str] = None
    last = Failed("no attempt ran")
    with _payload.scratch(PAYLOAD_PREFIX) as private:
        payload = _payload.write(private, "payload.pkl", (task_function, frozen, job.config, Singleton.get_state()))
        for attempt in range(attempts):
            env = LaunchEnv(**{**launch.__dict__, "attempt": attempt}).to_environ()
            if attempt:
                events.write(run_dir, events.Relaunch(attempt=attempt, cause=last.cause))
                log.warning("Relaunching %s (restart %d of %d)", job.label, attempt, job.restart.max_restarts)
            launched = time.time()
            try:
                outcome = run_attempt(backend, Attempt(run_rank, payload, env, run_dir, job.restart))
            except KeyboardInterrupt as stop:  # a signal outside the launch's own handling of it
                return _end_on_request(job, run_dir, started, started, attempt, getattr(stop, "signum", None))
            if isinstance(outcome, Failed):
                last = outcome
                first_failure = first_failure or first_recorded_failure(run_dir, started) or outcome.cause
                if outcome.recurs is not None:  # it would fail the same way again: no further attempt
                    restarts = outcome.restarts if backend.restarts_itself else attempt
                    return _end_failed(job, run_dir, outcome, first_failure, started, restarts, multi_node)
                continue
            if isinstance(outcome, Stopped) and outcome.reason is StopReason.PREEMPTED:
                noted = stop_requested() or outcome.signal or signal.SIGTERM
                return _end_on_request(job, run_dir, launched, started, attempt, noted)
            if isinstance(outcome, Stopped):
                return _end_stopped(job, run_dir, outcome, started, attempt)
            return _end_completed(job, run_dir, outcome, started, attempt, multi_node)
    restarts = last.restarts if backend.restarts_itself else attempts - 1
    return _end_failed(job, run_dir, last, first_failure, started, restarts, multi_node)


def _end_completed(
    job: Job, run_dir: Path, done: Completed, started: float, attempt: int, multi_node: Optional[str]
) -> Completed:
    hosted_rank0 = multi_node is None or done.value is not None
    if not hosted_rank0:  # global rank 0 ran on another node
        log.info("%s: global rank 0 ran on another node; its result is in %s", job.label, run_dir / SUMMARY_FILE)
    job.restarts = attempt
    _record_end(
        run_dir, events.JobCompleted(relaunches=attempt), Status.COMPLETED, started, started, attempt, hosts_rank0=hosted_rank0
    )
    return done


def _end_failed(
    job: Job, run_dir: Path, last: Failed, first_failure: Optional[str], started: float, restarts: int, multi_node: Optional[str]
) -> Failed:
    job.restarts = restarts
    message = f"{job.label} failed after {restarts} restart(s) (restart.max_restarts={job.restart.max_restarts}). "
    if first_failure and first_failure != last.cause:
        message += f"First failure: {first_failure}. Last failure: {last.cause}"
    else:
        message += f"Cause: {last.cause}"
    if last.recurs is not None:
        message += f"\n{last.recurs[0].upper()}{last.recurs[1:]}"
    message = printable(message)  # a backend's own account of the cause quotes a worker's message
    record = events.JobFailed(restarts=restarts, error=message)
    _record_end(run_dir, record, Status.FAILED, started, started, restarts, error=message, hosts_rank0=multi_node is None)
    return Failed(f"{message}\nRun folder: {run_dir} (logs under logs/, events in {EVENTS_FILE})", restarts)


def _end_stopped(job: Job, run_dir: Path, stopped: Stopped, started: float, attempt: int) -> Stopped:
    """The workers stopped on purpose for a reason that must not be restarted (it would happen again)."""
    record = events.JobStopped(reason=stopped.reason.value, step=stopped.step, message=stopped.message)
    status = _STATUS_OF.get(stopped.reason, Status.FAILED)
    _record_end(run_dir, record, status, started, started, attempt, error=stopped.message, stop_step=stopped.step)
    return dataclasses.replace(stopped, message=f"{job.label} stopped: {stopped.message}\nRun folder: {run_dir}")


def _end_on_request(job: Job, run_dir: Path, since: float, started: float, attempt: int, noted: Optional[int]) -> Stopped:
    """A stop request ended the job (`noted`: the signal it came with, if it said): recorded, with where
    the workers stopped (their stop event since `since`) and whether that step is committed."""
    signum = stop_requested() or noted or signal.SIGTERM
    stop = events.newest(events.records(run_dir, since=since, kinds=(Event.PREEMPTED,)), events.Preempted)
    name = stop.signal if stop is not None and stop.signal else signal_name(signum)
    if stop is not None and stop.saved:
        how = f"stopped at step {stop.step}, checkpoint committed: no step lost"
    elif stop is None and not events.records(run_dir, since=since, kinds=(Event.FIRST_STEP,)):
        how = "stopped during start-up, before the first step: nothing to save"
    else:
        how = (
            "stopped before the workers could save (restart.preemption_grace_s="
            f"{job.restart.preemption_grace_s:g}); they resume from the newest committed checkpoint"
        )
    record = events.JobInterrupted(attempt=attempt, signal=signal_name(noted, unknown="a signal"))
    _record_end(run_dir, record, Status.PREEMPTED, since, started, attempt, stop_signal=name)
    message = (
        f"{job.label} preempted by {name}: {how}. Run the same command again to continue "
        f"(exit code {exit_code(signum, job.restart.preemption_exit_code)})."
    )
    log.warning("%s", message)
    return Stopped(
        StopReason.PREEMPTED, step=stop.step if stop else None, saved=bool(stop and stop.saved), message=message, signal=signum
    )


def _record_end(
    run_dir: Path,
    last: events.Record,
    status: Status,
    since: float,
    started: float,
    restarts: int,
    error: Optional[str] = None,
    hosts_rank0: bool = True,
    **extra: Any,
) -> None:
    """The job's last event and its summary.json (derived from the events since `since`): the one place
    either is written."""
    events.write(run_dir, last)
    wall = time.time() - started
    said = summary.write(
        run_dir, status, since=since, restarts=restarts, wall_seconds=wall, error=error, hosts_rank0=hosts_rank0, **extra
    )
    if status is Status.FAILED and said.get("status") == Status.COMPLETED.value:
        log.warning(
            "%s still says completed (an earlier launch's record, kept): this launch's failure is recorded in %s",
            run_dir / SUMMARY_FILE,
            run_dir / EVENTS_FILE,
        )
    # the end of the launcher's story in train.log (the console has it from Hydra or the lines before)
    details.info(
        "Ended: %s after %.1f s, %s restart(s)%s; %s",
        status.value,
        wall,
        said.get("restarts", restarts),
        f", {len(said['failures'])} failure(s)" if said.get("failures") else "",
        error or f"summary in {run_dir / SUMMARY_FILE}",
    )


def first_recorded_failure(run_dir: Path, since: float) -> Optional[str]:
    """The first failure diagnosed in this launch (the supervisor's `attempt_failed`)."""
    for record in events.records(run_dir, since=since, kinds=(Event.ATTEMPT_FAILED,)):
        if isinstance(record, events.AttemptFailed) and record.cause:
            return record.cause
    return None


def run_attempt(backend: Backend, attempt: Attempt) -> Outcome:
    """`backend.launch` under supervision, and how it ended with what the launcher knows added:

    - Completed: rank 0's value;
    - Failed: the workers failed, named after the watchdog's finding if it killed a hung rank;
    - Stopped: the workers saved and stopped on purpose (their StopRun); or a stop request ended the
      launch otherwise (before the workers started, grace expired, a worker killed by it before it
      could save): reason PREEMPTED, and the newest committed checkpoint is intact.

    For the launch's duration SIGTERM/SIGINT/SIGHUP in the launcher set the stop flag and are
    passed on to the registered workers, which stop cleanly (see LaunchSignals, Supervisor).
    """
    env, run_dir = attempt.env, attempt.run_dir
    env.setdefault(ENV_LAUNCH_ID, f"{os.getpid()}-{time.time()}")
    printable_only()  # what the workers wrote reaches the console and train.log escaped
    if attempt.number == 0:
        log.info(
            "Logs: %s (launcher), %s (one per rank)%s",
            _launcher_log(run_dir),
            run_dir / "logs" / "rank<r>.log",
            "".join(f", {folder}" for folder in backend.log_folders(run_dir)),
        )
    handler = LaunchSignals(run_dir, env[ENV_LAUNCH_ID], in_process=backend.in_process)
    previous = handler.install()
    try:
        with contextlib.ExitStack() as stack:
            if stop_requested() is not None:  # asked before the workers started: nothing to launch or save
                return Stopped(StopReason.PREEMPTED, signal=stop_requested())
            supervisor = (
                None
                if backend.in_process
                else stack.enter_context(
                    Supervisor(
                        run_dir,
                        attempt.restart,
                        env[ENV_LAUNCH_ID],
                        backend.stop_on_grace_expired,
                        on_overdue=handler.interrupt_main,
                        forwarded=handler.forwarded,
                        group_restarts=backend.restarts_itself,
                        on_recurring=backend.stop_restarting,
                        launched=LaunchEnv.from_environ(env).launch_time or None,
                        whole_job=backend.multi_node_identity(run_dir) is None,
                    )
                )
            )
            if supervisor is not None:
                attempt = dataclasses.replace(attempt, on_exits=supervisor.worker_exits)
            try:
                outcome = backend.launch(attempt)
            except KeyboardInterrupt as stop:  # the launch abandoned (a second signal; overdue after the grace)
                request_stop(getattr(stop, "signum", None) or signal.SIGINT)
                return Stopped(StopReason.PREEMPTED, signal=stop_requested())
            if isinstance(outcome, Failed) and stop_requested() is not None:  # killed while it stopped on request
                log.warning("%s", outcome.cause)
                return Stopped(StopReason.PREEMPTED, signal=stop_requested())
            if isinstance(outcome, Failed) and supervisor is not None:
                supervisor.settle()  # its diagnosis of the last incarnation, if it still waited for one
                if supervisor.recurring is not None:  # stopped: it would fail the same way on every attempt
                    restart, why, line = supervisor.recurring
                    return Failed(line, restart, recurs=why)
                if supervisor.diagnoses:  # the first failure of the last incarnation, not the backend's pick
                    return Failed(supervisor.diagnoses[-1].line(), outcome.restarts)
            return outcome
    finally:
        restore_handlers(previous)
        stop_marker(run_dir, env[ENV_LAUNCH_ID]).unlink(missing_ok=True)


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
