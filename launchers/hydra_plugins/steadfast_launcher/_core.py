"""The launcher's work. Per sweep: compose and check every job before any starts, run them (one
at a time in this process, or packed in parallel, one launcher process per job), keep the sweep
ledger, print the table. Per job: freeze the config, lock the run folder, launch, relaunch.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from steadfast.contract import events, summary
from steadfast.contract.env import COLLECTIVES, HOROVOD, NONE, TORCH, LaunchEnv
from steadfast.contract.events import Event
from steadfast.contract.exits import exit_code
from steadfast.contract.files import CONFIG_FILE, EVENTS_FILE, SUMMARY_FILE, atomic_write
from steadfast.contract.naming import master_is_sweep
from steadfast.contract.schemas import (BackendConf, ConfigError, RestartConf, SteadfastLauncherConf, backend_from,
                                        cluster_from, restart_from)
from steadfast.contract.summary import Status

from . import _sweep

log = logging.getLogger(__name__)

LOCK_FILE = ".steadfast.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 90.0  # a parallel job gets this long to stop after a forwarded signal, then it is killed


class JobFailed(CompactHydraException):
    """A job that failed after its restart budget; the message names the root cause."""

    def __init__(self, message: str, restarts: int = 0) -> None:
        super().__init__(message)
        self.restarts = restarts


class Interrupted(KeyboardInterrupt):
    """A job (or the sweep) stopped by a signal; running the same command again resumes it."""

    def __init__(self, message: str = "", signum: Optional[int] = None) -> None:
        super().__init__(message or f"stopped by {_signame(signum)}")
        self.signum = signum


class WorkerFailure(Exception):
    """Raised by a backend adapter when the workers of one launch failed."""

    def __init__(self, message: str, restarts: int = 0) -> None:
        super().__init__(message)
        self.restarts = restarts


@dataclass
class Job:
    idx: int
    overrides: List[str]
    config: DictConfig  # the job's full config (with the hydra node), as Hydra composed it
    backend: BackendConf
    restart: RestartConf
    run_dir: Optional[Path] = None  # resolved by the launcher before anything runs
    key: str = ""  # identity in the sweep ledger (its overrides)
    digest: str = ""  # sha256 of its composed config: a changed config is not "completed"
    restarts: int = 0  # of the last launch, set by _run_job_distributed

    @property
    def label(self) -> str:
        shown = " ".join(filter_overrides(self.overrides)) or "(defaults)"
        return f"job #{self.idx} [{shown}]"

    @property
    def procs(self) -> int:
        return self.backend.procs_per_node


@dataclass
class Settings:
    max_parallel_jobs: int = 1
    max_procs: Optional[int] = None
    fail_fast: bool = False
    skip_completed: bool = True


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    setup_globals()
    master: DictConfig = launcher.config
    configure_log(master.hydra.hydra_logging, master.hydra.verbose)
    settings = _settings(master)
    # The sweep folder is resolved once, from the sweep's own config, and every job gets that
    # folder: a job's config could resolve it differently (it sees its own overrides, a later clock).
    HydraConfig.instance().set_config(master)
    sweep_dir = str(master.hydra.sweep.dir)
    sweeping = master_is_sweep(master)
    jobs = [_prepare(launcher, list(o), initial_job_idx + i, sweep_dir) for i, o in enumerate(job_overrides)]
    _check_folders(jobs)
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    ledger = None
    if sweeping:
        holder = _sweep.lock_sweep(Path(sweep_dir))
        if holder:
            raise JobFailed(f"Sweep folder {sweep_dir} is in use by {holder}. Wait for that launch to end, "
                            "or choose another hydra.sweep.dir.")
        ledger = _sweep.Ledger(Path(sweep_dir), {
            "sweep_dir": os.path.abspath(sweep_dir),
            "command": {"task": list(master.hydra.overrides.task), "hydra": list(master.hydra.overrides.hydra)},
        })
    sweep = _Sweep(launcher, jobs, settings, ledger, sweep_dir)
    _preflight(launcher, [j for j in jobs if sweep.completed_result(j) is None])
    from . import _slurm

    if any(_slurm.cluster_of(j.config).get("name") == "slurm" for j in jobs):
        HydraConfig.instance().set_config(master)
        return _submit_to_slurm(jobs)
    HydraConfig.instance().set_config(master)
    return sweep.run(table=sweeping)


def _submit_to_slurm(jobs: List[Job]) -> List[JobReturn]:
    """cluster=slurm: every job becomes one Slurm batch job (a sweep: one per point); see _slurm."""
    from . import _slurm

    problems = []
    for job in jobs:
        problems += [(f"{job.label}: " if len(jobs) > 1 else "") + p for p in _slurm.problems(_slurm.cluster_of(job.config))]
    if problems:
        raise ConfigError(problems)
    returns = []
    for job in jobs:
        assert job.run_dir is not None
        cluster = _slurm.cluster_of(job.config)
        script = job.run_dir / "slurm" / _slurm.SCRIPT_NAME
        script.parent.mkdir(parents=True, exist_ok=True)
        app = OmegaConf.select(job.config, "hydra.launcher.app")
        atomic_write(script, _slurm.sbatch_script(job.overrides, cluster, job.run_dir, f"steadfast-{job.run_dir.name}", app=app))
        if not cluster.get("submit", True):
            log.info("%s: wrote %s (cluster.submit=false: not submitted)", job.label, script)
            returns.append(_job_return(job, JobStatus.COMPLETED, {"slurm_script": str(script)}))
            continue
        job_id = _slurm.submit(script)
        events.append(job.run_dir, Event.SLURM_SUBMITTED, slurm_job_id=job_id, script=str(script), nodes=cluster["nodes"])
        log.info("%s: submitted as Slurm job %s (%d node(s)); script %s, output %s/slurm/<job id>.out",
                 job.label, job_id, cluster["nodes"], script, job.run_dir)
        returns.append(_job_return(job, JobStatus.COMPLETED, {"slurm_job_id": job_id, "slurm_script": str(script)}))
    return returns


def _settings(master: DictConfig) -> Settings:
    node = OmegaConf.select(master, "hydra.launcher") or {}
    defaults = SteadfastLauncherConf()
    values = {k: node.get(k, getattr(defaults, k)) for k in ("max_parallel_jobs", "max_procs", "fail_fast", "skip_completed")}
    problems = SteadfastLauncherConf(**values).problems()
    if problems:
        raise ConfigError(problems)
    return Settings(**values)


def _prepare(launcher: Any, overrides: List[str], idx: int, sweep_dir: str) -> Job:
    sweep_config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with read_write(sweep_config.hydra), open_dict(sweep_config):
        sweep_config.hydra.job.id = idx
        sweep_config.hydra.job.num = idx
        sweep_config.hydra.sweep.dir = sweep_dir
    HydraConfig.instance().set_config(sweep_config)  # lets ${hydra:...} resolve while we check it
    backend = backend_from(OmegaConf.select(sweep_config, "hydra.launcher.backend"))
    restart = restart_from(OmegaConf.select(sweep_config, "hydra.launcher.restart"))
    job = Job(idx=idx, overrides=overrides, config=sweep_config, backend=backend, restart=restart)
    subdir = OmegaConf.select(sweep_config, "hydra.sweep.subdir")
    # as Hydra's run_job computes it
    job.run_dir = Path(os.path.abspath(os.path.join(sweep_dir, str(subdir)) if subdir is not None else sweep_dir))
    job.key = _sweep.job_key(overrides)
    job.digest = _sweep.config_digest(sweep_config)
    return job


def _check_folders(jobs: List[Job]) -> None:
    """Two different jobs of one sweep must not share a run folder (identical jobs may: they run in turn)."""
    seen: Dict[Path, Job] = {}
    problems = []
    for job in jobs:
        assert job.run_dir is not None
        other = seen.setdefault(job.run_dir, job)
        if other is not job and other.key != job.key:
            problems.append(f"{other.label} and {job.label} would share the run folder {job.run_dir}; give each job "
                            "its own, e.g. a hydra.sweep.subdir that includes the keys this sweep varies "
                            "(${hydra.job.override_dirname} has all of them)")
    if problems:
        raise ConfigError(problems)


def _preflight(launcher: Any, jobs: List[Job]) -> None:
    problems: List[str] = []
    for job in jobs:
        HydraConfig.instance().set_config(job.config)
        found = job.backend.problems() + job.restart.problems() + list(getattr(_adapter(job.backend.name), "problems", lambda b: [])(job.backend)) + cluster_from(OmegaConf.select(job.config, "hydra.launcher.cluster")).problems()
        hooks = OmegaConf.select(job.config, "hydra.launcher.preflight")
        for hook in ([] if found or not hooks else [hooks] if isinstance(hooks, str) else list(hooks)):
            module, _, name = str(hook).partition(":")
            found += list(getattr(importlib.import_module(module), name)(job.config))
        prefix = f"{job.label}: " if len(jobs) > 1 else ""
        problems += [prefix + p for p in found]
    if problems:
        raise ConfigError(problems)


def _describe(backend: BackendConf) -> str:
    if backend.name == "local":
        return "1 in-process worker (backend=local)"
    return f"{backend.procs_per_node} {backend.name} workers"


_COLLECTIVE = {"torchrun": TORCH, "horovod": HOROVOD, "local": NONE}


def _reference_world_size(backend: BackendConf) -> int:
    if backend.name == "torchrun":
        return backend.node_range()[1] * backend.procs_per_node  # type: ignore[attr-defined]
    return backend.procs_per_node


def _run_job_distributed(job: Job, task_function: TaskFunction, task_cfg: DictConfig) -> Any:
    """Runs in the launcher process, inside Hydra's run_job (output folder made, HydraConfig set)."""
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    multi_node = multi_node_identity(job.backend, run_dir)
    with _RunLock(run_dir, multi_node):
        frozen = OmegaConf.create(OmegaConf.to_container(task_cfg, resolve=True, enum_to_str=True))
        atomic_write(run_dir / CONFIG_FILE, OmegaConf.to_yaml(frozen))
        payload = cloudpickle.dumps((task_function, frozen, job.config, Singleton.get_state()))
        launch = LaunchEnv(backend=job.backend.name, collective=_COLLECTIVE[job.backend.name], run_dir=run_dir,
                           launch_time=started, launch_id=f"{os.getpid()}-{started!r}",
                           reference_world_size=_reference_world_size(job.backend),
                           collective_timeout_s=job.restart.collective_timeout_s, launcher_pid=os.getpid())
        adapter = _adapter(job.backend.name)
        events.append(run_dir, Event.LAUNCH, backend=job.backend.name, overrides=filter_overrides(job.overrides))
        log.info("Run folder: %s", run_dir)
        attempts = 1 if adapter.RESTARTS_ITSELF else job.restart.max_restarts + 1
        first_failure: Optional[str] = None
        last = WorkerFailure("no attempt ran")
        for attempt in range(attempts):
            env = LaunchEnv(**{**launch.__dict__, "attempt": attempt}).to_environ()
            if attempt:
                events.append(run_dir, Event.RELAUNCH, attempt=attempt, cause=last.args[0])
                log.warning("Relaunching %s (restart %d of %d)", job.label, attempt, job.restart.max_restarts)
            try:
                from ._supervise import run_attempt  # stop requests, hang watchdog, stop markers

                result = run_attempt(adapter, payload, job, env, run_dir)
                hosted_rank0 = multi_node is None or result is not None
                if not hosted_rank0:  # global rank 0 ran on another node
                    log.info("%s: global rank 0 ran on another node; its result is in %s", job.label, run_dir / SUMMARY_FILE)
                events.append(run_dir, Event.JOB_COMPLETED, relaunches=attempt)
                job.restarts = attempt
                summary.write(run_dir, Status.COMPLETED, since=started, restarts=attempt, wall_seconds=time.time() - started,
                              hosts_rank0=hosted_rank0)
                return result
            except WorkerFailure as failure:
                last = failure
                first_failure = first_failure or _first_recorded_failure(run_dir, started) or failure.args[0]
            except KeyboardInterrupt as stop:
                events.append(run_dir, Event.JOB_INTERRUPTED, attempt=attempt, signal=_signame(getattr(stop, "signum", None)))
                raise
        restarts = last.restarts if adapter.RESTARTS_ITSELF else attempts - 1
        job.restarts = restarts
        message = f"{job.label} failed after {restarts} restart(s) (restart.max_restarts={job.restart.max_restarts}). "
        if first_failure and first_failure != last.args[0]:
            message += f"First failure: {first_failure}. Last failure: {last.args[0]}"
        else:
            message += f"Cause: {last.args[0]}"
        events.append(run_dir, Event.JOB_FAILED, restarts=restarts, error=message,
                      **({"host": socket.gethostname(), "pid": os.getpid()} if multi_node else {}))
        summary.write(run_dir, Status.FAILED, since=started, restarts=restarts, wall_seconds=time.time() - started,
                      error=message, hosts_rank0=multi_node is None)
        raise JobFailed(f"{message}\nRun folder: {run_dir} (logs under logs/, events in {EVENTS_FILE})", restarts)


def _adapter(name: str) -> Any:
    if name == "torchrun":
        from . import _torchrun as adapter
    elif name == "horovod":
        from . import _horovod as adapter
    else:
        from . import _local as adapter
    return adapter


def _first_recorded_failure(run_dir: Path, since: float) -> Optional[str]:
    """The earliest failure recorded in this launch: a worker's error, a hang the watchdog found,
    or an injected fault (workers killed by a signal record nothing themselves)."""
    for event in events.read(run_dir, since=since, kinds=(Event.WORKER_FAILED, Event.HANG_DETECTED, Event.FAULT_FIRED)):
        kind = event["event"]
        if kind == Event.WORKER_FAILED:
            return f"rank {event.get('rank')} on {event.get('host')}: {event.get('error')} (at {event.get('where')})"
        if kind == Event.HANG_DETECTED:
            return (f"rank {event.get('rank')} on {event.get('host')} hung after step {event.get('step')} "
                    f"(no progress for {event.get('seconds_without_progress')} s, at {event.get('where')}; "
                    f"stacks in logs/stacks/)")
        if event.get("fault") in ("kill", "crash_in_save"):  # hangs: see hang_detected
            return f"rank {event.get('rank')} on {event.get('host')}: fault={event.get('fault')} injected at step {event.get('step')}"
    return None


class _RunLock:
    """One launch per run folder: a second launch on the same folder refuses to start.

    flock is released by the kernel when the holder dies, so a crashed launch never leaves a
    lock that blocks the next one; the file only tells the refused launch who holds it.

    A multi-node job (`backend.nnodes` above 1) runs one launcher per node on the same (shared)
    folder: its launchers hold the lock *shared*, and the first one records the job's identity
    (`multi_node_identity`: backend, rendezvous id and endpoint) in the lock file. A later launcher
    joins only if its identity is the same; a single-node launch (exclusive) or another multi-node
    job is refused. A short exclusive lock on a second file makes check-and-record atomic.
    """

    def __init__(self, run_dir: Path, multi_node: Optional[str] = None) -> None:
        self.path = run_dir / LOCK_FILE
        self.multi_node = multi_node  # the job's identity when several launchers share the folder
        self.fd = -1
        self.shared = False

    def __enter__(self) -> "_RunLock":
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        gate = os.open(self.path.with_name(LOCK_FILE + ".gate"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # held for a moment: the check and the record are one step
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(self.fd, 1024, 0).decode(errors="replace").strip() or "another process"
                joined = False
                if self.multi_node is not None and owner.startswith(f"multi-node job {self.multi_node}:"):
                    try:
                        fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        joined = True
                    except BlockingIOError:
                        pass
                if not joined:
                    os.close(self.fd)
                    mine = f" (this launch is multi-node job {self.multi_node})" if self.multi_node else ""
                    raise JobFailed(
                        f"Run folder {self.path.parent} is in use by {owner}{mine}. "
                        "Wait for that launch to end, or choose another run.name. (The launchers of one multi-node "
                        "job share a folder when they agree on backend.rdzv_backend, backend.rdzv_endpoint and the "
                        "rendezvous id, backend.rdzv_id or run.name.)"
                    ) from None
                self.shared = True
                log.info("Run folder %s: joining multi-node job %s (%s)", self.path.parent, self.multi_node, owner)
                return self
            os.ftruncate(self.fd, 0)
            if self.multi_node is not None:
                os.write(self.fd, f"multi-node job {self.multi_node}: first launcher {me}\n".encode())
                fcntl.flock(self.fd, fcntl.LOCK_SH)  # let the job's other launchers in
                self.shared = True
            else:
                os.write(self.fd, f"{me}\n".encode())
            return self
        finally:
            os.close(gate)

    def __exit__(self, *exc: Any) -> None:
        if not self.shared:
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing releases the flock


def multi_node_identity(backend: BackendConf, run_dir: Path) -> Optional[str]:
    """What the launchers of one multi-node job agree on (None for a single-node job)."""
    if backend.name != "torchrun":
        return None
    low, high = backend.node_range()  # type: ignore[attr-defined]
    if high <= 1:
        return None
    rdzv_id = backend.rdzv_id or run_dir.name  # type: ignore[attr-defined]
    return f"{backend.rdzv_backend}:{rdzv_id}@{backend.rdzv_endpoint}"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- running the jobs of a sweep


def run_one(hydra_context: HydraContext, task_function: TaskFunction, job: Job) -> JobReturn:
    """One job through Hydra's run_job (output folder, .hydra/, logging, callbacks); both modes use it."""
    return run_job(
        hydra_context=hydra_context,
        task_function=functools.partial(_run_job_distributed, job, task_function),
        config=job.config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def _signame(signum: Optional[int]) -> str:
    try:
        return signal.Signals(signum).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "a signal"


@contextlib.contextmanager
def handling_signals(handler: Callable[[int, Any], None]) -> Iterator[Callable[[], None]]:
    """Route SIGTERM/SIGINT/SIGHUP to `handler` (main thread only); yields a function that
    installs it again (torch elastic's agent replaces the handlers while it runs); restores on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def install() -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, handler)

    install()
    try:
        yield install
    finally:
        for s, previous in saved.items():
            if previous is not None:
                signal.signal(s, previous)


def _first_line(exc: Any) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _varying(jobs: List[Job]) -> set:
    """The override keys whose values differ between these jobs (empty for a single job)."""
    if len(jobs) < 2:
        return set()
    values = [{_override_key(o): o.split("=", 1)[-1] for o in job.overrides} for job in jobs]
    keys = set().union(*values)
    return {k for k in keys if len({v.get(k) for v in values}) > 1}


def _job_return(job: Job, status: JobStatus, value: Any) -> JobReturn:
    """A JobReturn for a job that did not go through run_job now (skipped, not run, interrupted)."""
    cfg = job.config.copy()
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(job.run_dir)
    ret = JobReturn()
    task_cfg = cfg.copy()
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    ret.cfg = task_cfg
    ret.hydra_cfg = OmegaConf.masked_copy(cfg, "hydra")  # as HydraConfig holds it
    ret.overrides = list(job.overrides)
    ret.working_dir = str(job.run_dir) if OmegaConf.select(cfg, "hydra.job.chdir") else os.getcwd()
    ret.task_name = str(OmegaConf.select(cfg, "hydra.job.name"))
    ret.status = status
    ret.return_value = value
    return ret


class _Sweep:
    """Runs the jobs of one launch() call and keeps the ledger and the table up to date."""

    def __init__(self, launcher: Any, jobs: List[Job], settings: Settings, ledger: Optional[_sweep.Ledger], sweep_dir: str) -> None:
        self.launcher, self.jobs, self.settings, self.ledger, self.sweep_dir = launcher, jobs, settings, ledger, sweep_dir
        self.returns: Dict[int, JobReturn] = {}
        self.status: Dict[int, str] = {}
        self.results: Dict[int, Any] = {}
        self.signum: Optional[int] = None
        self.failed_first: Optional[Job] = None  # the failure that stopped the sweep (fail_fast)
        self.in_job = False

    # ---- ledger

    def _folder(self, job: Job) -> str:
        assert job.run_dir is not None
        try:
            return str(job.run_dir.relative_to(os.path.abspath(self.sweep_dir)))
        except ValueError:
            return str(job.run_dir)

    def completed_result(self, job: Job) -> Optional[List[Any]]:
        """[value] if the ledger says this very job completed earlier (same config, folder still there)."""
        if self.ledger is None or not self.settings.skip_completed:
            return None
        rec = self.ledger.get(job.key)
        if not rec or rec.get("status") != _sweep.COMPLETED or rec.get("config_sha256") != job.digest:
            return None
        if rec.get("run_dir") != self._folder(job) or not (job.run_dir and job.run_dir.is_dir()):
            return None
        ok, value = _sweep.decode_result(rec)
        return [value] if ok else None

    def _record(self, job: Job, **fields: Any) -> None:
        if self.ledger is not None:
            self.ledger.update(job.key, overrides=list(job.overrides), run_dir=self._folder(job), job_num=job.idx,
                               config_sha256=job.digest, **fields)

    def _try_skip(self, job: Job) -> bool:
        found = self.completed_result(job)
        if found is None:
            return False
        value = found[0]
        self.returns[job.idx] = _job_return(job, JobStatus.COMPLETED, value)
        self.status[job.idx], self.results[job.idx] = _sweep.SKIPPED, value
        log.info("%s completed in an earlier run of this sweep: skipped (result %s)", job.label, _sweep.describe_result(value))
        return True

    def _started(self, job: Job) -> None:
        attempts = ((self.ledger.get(job.key) or {}).get("attempts", 0) if self.ledger else 0) + 1
        self._record(job, status=_sweep.RUNNING, attempts=attempts, started_at=round(time.time(), 3), ended_at=None)

    def _finished(self, job: Job, ret: JobReturn, interrupted: bool = False) -> None:
        self.returns[job.idx] = ret
        recorded = summary.read(job.run_dir)
        restarts = recorded["restarts"] if isinstance(recorded.get("restarts"), int) else job.restarts
        rec = (self.ledger.get(job.key) or {}) if self.ledger else {}
        wall = round(time.time() - rec["started_at"], 3) if rec.get("started_at") else None
        fields: Dict[str, Any] = dict(restarts=restarts, ended_at=round(time.time(), 3), wall_seconds=wall)
        if interrupted:
            self.status[job.idx] = _sweep.INTERRUPTED
            fields.update(status=_sweep.INTERRUPTED, error=_first_line(ret._return_value))
        elif ret.status == JobStatus.COMPLETED:
            self.status[job.idx], self.results[job.idx] = _sweep.COMPLETED, ret._return_value
            fields.update(status=_sweep.COMPLETED, error=None, **_sweep.encode_result(ret._return_value))
        else:
            self.status[job.idx] = _sweep.FAILED
            fields.update(status=_sweep.FAILED, error=str(ret._return_value).strip())
            if self.failed_first is None:
                self.failed_first = job
        if fields["status"] != _sweep.COMPLETED and rec:
            for stale in ("result", "result_pickle", "result_unavailable"):
                rec.pop(stale, None)
        self._record(job, **fields)

    # ---- the run

    def run(self, table: bool) -> List[JobReturn]:
        parallel = self.settings.max_parallel_jobs > 1 and sum(1 for j in self.jobs if self.completed_result(j) is None) > 1
        try:
            if parallel:
                self._run_parallel()
            else:
                self._run_sequential()
        finally:
            self._fill_not_run()
            if table or self.signum is not None:
                self._print_table()
        if self.signum is not None:
            log.warning("Stopped by %s. Run the same command again to resume: completed jobs are skipped, "
                        "interrupted ones resume from their checkpoints.", _signame(self.signum))
            sys.exit(exit_code(self.signum))
        return [self.returns[j.idx] for j in self.jobs]

    def stop_reason(self) -> str:
        if self.signum is None and self.failed_first is not None:
            return f"stopped because {self.failed_first.label} failed and hydra.launcher.fail_fast=true"
        return f"stopped by {_signame(self.signum)}"

    def _stopping(self) -> bool:
        return self.signum is not None or (self.settings.fail_fast and self.failed_first is not None)

    def _fill_not_run(self) -> None:
        for job in self.jobs:
            if job.idx in self.returns:
                continue
            why = f"not run: the sweep was {self.stop_reason()}"
            self.returns[job.idx] = _job_return(job, JobStatus.FAILED, JobFailed(f"{job.label} was {why}"))
            self.status[job.idx] = _sweep.NOT_RUN
            if self.ledger is not None and (self.ledger.get(job.key) or {}).get("status") in (None, _sweep.RUNNING):
                self._record(job, status=_sweep.PENDING)

    def _interrupted_return(self, job: Job, why: str) -> JobReturn:
        return _job_return(job, JobStatus.FAILED, JobFailed(f"{job.label} was interrupted ({why}); run the command "
                                                            "again to resume it from its checkpoints", job.restarts))

    def _print_table(self) -> None:
        varying = _varying(self.jobs)
        rows = []
        for job in self.jobs:
            status = self.status.get(job.idx, _sweep.NOT_RUN)
            recorded = summary.read(job.run_dir) if status != _sweep.NOT_RUN else {}
            restarts = recorded["restarts"] if isinstance(recorded.get("restarts"), int) else job.restarts
            shown = [o for o in filter_overrides(job.overrides) if _override_key(o) in varying] if varying else filter_overrides(job.overrides)
            rows.append(dict(job=job.idx, overrides=" ".join(shown) or "(defaults)", status=status,
                             restarts=restarts if status != _sweep.NOT_RUN else "",
                             result=_sweep.describe_result(self.results.get(job.idx)), folder=self._folder(job)))
        counts: Dict[str, int] = {}
        for row in rows:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        lines = [f"Sweep summary: {', '.join(f'{n} {s}' for s, n in counts.items())}"]
        lines.append(f"  sweep folder: {os.path.relpath(os.path.abspath(self.sweep_dir))}"
                     + (f" (ledger: {self.ledger.path.name})" if self.ledger is not None else ""))
        if varying:
            lines.append("  overrides: those the jobs differ in (all of them are in the ledger)")
        log.info("%s\n%s", "\n".join(lines), _sweep.format_table(rows))
        failed = [j for j in self.jobs if self.status.get(j.idx) == _sweep.FAILED]
        if failed:
            log.error("%d of %d job(s) failed: %s", len(failed), len(self.jobs), ", ".join(f"#{j.idx}" for j in failed))

    # ---- one at a time, in this process

    def _on_signal_sequential(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        if self.in_job:
            raise Interrupted(signum=signum)

    def _run_sequential(self) -> None:
        config = self.launcher.config
        with handling_signals(self._on_signal_sequential) as reinstall:
            for job in self.jobs:
                if self._stopping():
                    break
                if self._try_skip(job):
                    continue
                log.info("Launching %s on %s", job.label, _describe(job.backend))
                self._started(job)
                try:
                    self.in_job = True
                    ret = run_one(self.launcher.hydra_context, self.launcher.task_function, job)
                except KeyboardInterrupt as stop:
                    self.in_job = False
                    self.signum = getattr(stop, "signum", None) or self.signum or signal.SIGINT
                    self._finished(job, self._interrupted_return(job, self.stop_reason()), interrupted=True)
                    break
                finally:
                    self.in_job = False
                    reinstall()
                    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
                self._finished(job, ret)

    # ---- several at once, one launcher process per job

    def _on_signal_parallel(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self._second_signal = True
        self.signum = self.signum or signum

    def _run_parallel(self) -> None:
        box = _sweep.machine(self.settings.max_procs)
        log.info("Running up to %d jobs at once on %d %s%s", self.settings.max_parallel_jobs, box.capacity,
                 {"gpu": "GPUs", "cpu": "CPU cores", "slots": "worker slots (hydra.launcher.max_procs)"}[box.kind],
                 "" if box.kind == "slots" else f" ({', '.join(box.labels)})")
        pending = list(self.jobs)
        running: Dict[int, _JobProcess] = {}
        self._second_signal = False
        forwarded_at: Optional[float] = None
        with handling_signals(self._on_signal_parallel), tempfile.TemporaryDirectory(prefix="steadfast-jobs-") as scratch:
            while pending or running:
                if self._stopping():
                    pending_stop = [p for p in running.values() if not p.stop_sent]
                    for proc in pending_stop:
                        proc.stop(self.signum or signal.SIGTERM)
                    if pending_stop and forwarded_at is None:
                        forwarded_at = time.monotonic()
                    if self._second_signal or (forwarded_at is not None and time.monotonic() - forwarded_at > STOP_GRACE_S):
                        for proc in running.values():
                            proc.kill()
                else:
                    while True:
                        busy = [p.job.run_dir for p in running.values()]
                        folders = {j.idx: j.run_dir for j in pending}
                        idx = _sweep.pick([(j.idx, j.procs) for j in pending], box, len(running),
                                          self.settings.max_parallel_jobs, busy, folders)
                        if idx is None:
                            break
                        job = next(j for j in pending if j.idx == idx)
                        pending.remove(job)
                        if self._try_skip(job):
                            continue
                        if job.procs > box.capacity:
                            log.warning("%s needs %d worker processes, more than the %d this machine has: it runs alone",
                                        job.label, job.procs, box.capacity)
                        units = box.take(job.procs)
                        self._started(job)
                        running[job.idx] = _JobProcess(self.launcher, job, box, units, Path(scratch))
                    if not running:
                        break
                time.sleep(0.1)
                for idx, proc in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[idx]
                    box.give_back(proc.units)
                    status, ret = proc.outcome(self)
                    self._finished(proc.job, ret, interrupted=status == _sweep.INTERRUPTED)
                if self._stopping() and not running:
                    break


class _JobProcess:
    """One job in its own launcher process (`python -m ..._jobproc`), in its own session.

    Hydra's process-wide state (HydraConfig, the working directory, logging, signal handlers,
    environment variables the backends set) is per process, so jobs that run at once never share
    it. The process gets the job composed and checked by this launcher, Hydra's singletons and the
    task function (cloudpickled), runs it exactly as the sequential path does (`run_one`), and
    leaves its JobReturn in a file. Its output is forwarded line by line, prefixed with the job.
    """

    def __init__(self, launcher: Any, job: Job, box: "_sweep.Machine", units: List[int], scratch: Path) -> None:
        self.job, self.units, self.stop_sent = job, units, False
        self.payload_path = scratch / f"job{job.idx}.payload"
        self.result_path = scratch / f"job{job.idx}.result"
        config = launcher.config
        payload = {
            "parent": os.getpid(),
            "hydra_state": Singleton.get_state(),
            "hydra_context": launcher.hydra_context,
            "task_function": launcher.task_function,
            "job": job,
            "hydra_logging": config.hydra.hydra_logging,
            "verbose": config.hydra.verbose,
            "cpus": list(units) if box.kind == "cpu" else None,
        }
        with open(self.payload_path, "wb") as f:
            cloudpickle.dump(payload, f)
        env = dict(os.environ)
        ours = [os.getcwd() if p == "" else p for p in sys.path if p == "" or not p.startswith((sys.prefix, sys.base_prefix))]
        env["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(ours), env.get("PYTHONPATH", "")]).strip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        where = ""
        if box.kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(box.labels[u] for u in units)
            where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}"
        elif box.kind == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(units) // max(1, job.procs))))
            where = f" on CPU {','.join(str(u) for u in units)}"
        log.info("Launching %s on %s%s", job.label, _describe(job.backend), where)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "hydra_plugins.steadfast_launcher._jobproc", str(self.payload_path), str(self.result_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
        )
        prefix = f"[job #{job.idx}] "
        self.threads = [threading.Thread(target=_forward, args=(stream, sink, prefix), daemon=True)
                        for stream, sink in ((self.popen.stdout, sys.stdout), (self.popen.stderr, sys.stderr))]
        for t in self.threads:
            t.start()

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self, signum: int) -> None:
        """Forward a stop request to the job's launcher process; its agent stops the workers."""
        self.stop_sent = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signum)

    def kill(self) -> None:
        """The whole job (its launcher process and every worker): they share its session's process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def outcome(self, sweep: _Sweep) -> tuple:
        for t in self.threads:
            t.join(timeout=5)
        try:
            with open(self.result_path, "rb") as f:
                out = cloudpickle.load(f)
        except (OSError, EOFError, Exception):  # noqa: B014  (any unpickling error)
            out = None
        job = self.job
        if out is None:
            how = f"exit code {self.popen.returncode}"
            if self.popen.returncode is not None and self.popen.returncode < 0:
                how = f"killed by {_signame(-self.popen.returncode)}"
            if self.stop_sent:
                return _sweep.INTERRUPTED, sweep._interrupted_return(job, f"{sweep.stop_reason()}; its launcher process ended ({how})")
            return _sweep.FAILED, _job_return(job, JobStatus.FAILED, JobFailed(
                f"{job.label}: its launcher process ended ({how}) without a result; see its output above"))
        job.restarts = out.get("restarts", 0)
        if out["status"] == _sweep.INTERRUPTED:
            return _sweep.INTERRUPTED, sweep._interrupted_return(job, sweep.stop_reason())
        return out["status"], out["ret"]


_print_lock = threading.Lock()


def _forward(stream: Any, sink: Any, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with _print_lock:
            try:
                sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                sink.flush()
            except (OSError, ValueError):
                pass
    stream.close()
