"""Library mode: the job's task runs in this process, as one rank of a job a platform started.

Under torchrun, srun or a PyTorchJob (steadfast/contract/platforms.py recognises them) every worker
runs the app's command itself, so every worker reaches the launcher: starting workers of our own
there would nest two launchers that fight over one run folder. `_core.launch` hands the launch here
instead, and each worker runs the job's task as its own rank (docs/platforms.md):

- the job is composed and checked as any (one job: a sweep, or cluster=slurm, is refused in one line);
- every worker holds the run folder's lock shared, as one job (the platform's job identity), so
  another launch, or another platform job, is refused as usual;
- rank 0 freezes the config and opens the launch, or continues the one its platform's earlier
  incarnation opened (_platform_records); torch's variables and the LaunchEnv go to the environment;
- the task runs as under the launcher's workers (_worker), with a watchdog in the worker (_selfwatch);
- rank 0 records the end of a launch that completed or stopped (summary.json); a worker that fails
  records it; every worker exits with a code its platform understands: 0 (completed),
  restart.preemption_exit_code (stopped on request, or failed only because it lost a peer: the
  platform may run it again), 1 with the traceback (failed).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
import time
from typing import Any, List, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.types import TaskFunction
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import events, shm
from steadfast.contract.env import HOROVOD, TORCH, LaunchEnv
from steadfast.contract.exits import exit_code
from steadfast.contract.files import CONFIG_FILE, atomic_write
from steadfast.contract.naming import master_is_sweep
from steadfast.contract.platforms import Detected
from steadfast.contract.stop import Stopped, StopReason, signal_name
from steadfast.contract.summary import Status

from . import _backends, _compose, _platform_records, _slurm, _worker
from ._compat.hydra_job_return import returned
from ._context import LaunchContext
from ._diagnosis import first_line, is_peer_lost
from ._job import _record_end
from ._locks import RunLock
from ._selfwatch import SelfWatch
from ._types import ConfigError, Job, Refused

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Exit:
    """The task stopped on purpose: the process ends with this code, after this line."""

    code: int
    message: str


def launch(ctx: LaunchContext, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, found: Detected) -> List[JobReturn]:
    setup_globals()
    master: DictConfig = ctx.config
    configure_log(master.hydra.hydra_logging, master.hydra.verbose)
    HydraConfig.instance().set_config(master)
    sweep_dir = str(master.hydra.sweep.dir)
    try:
        if master_is_sweep(master) or len(job_overrides) != 1:
            raise ConfigError(
                [
                    f"a sweep cannot run inside a job that {found.title} started (each of its workers would run "
                    "every job): run the sweep with the app's own command outside it (the launcher starts each "
                    "job's workers), or start one such job per point of the sweep"
                ]
            )
        job = _compose.prepare(ctx, list(job_overrides[0]), initial_job_idx, sweep_dir)
        if _backends.of(job.backend).collective == HOROVOD:
            raise ConfigError(
                [
                    f"backend.name={job.backend.name} inside a job that {found.title} started: library mode runs "
                    "torch.distributed; start it with the app's own command (the launcher starts Horovod's workers)"
                ]
            )
        if _slurm.wanted([job]):
            raise ConfigError(
                [f"cluster=slurm inside a job that {found.title} started: submit from a login node, or drop cluster=slurm"]
            )
        _compose.preflight([job])
        assert job.run_dir is not None
        lock = RunLock(job.run_dir, job.lock_dirs, found.job)
        lock.acquire()
    except (ConfigError, Refused):
        if ctx.sweep_folder_before is not None and found.rank == 0:
            ctx.sweep_folder_before.restore()
        raise
    HydraConfig.instance().set_config(master)
    log.info("Rank %d of a %s job (library mode): run folder %s", found.rank, found.name, job.run_dir)
    try:
        ret = run_job(
            hydra_context=ctx.hydra_context,
            task_function=functools.partial(_task, job, ctx.task_function, found),
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
            configure_logging=found.rank == 0,
        )
    finally:
        lock.release()
    _exit_as_the_platform_expects(ret, job, found)
    return [ret]


def _task(job: Job, task_function: TaskFunction, found: Detected, task_cfg: DictConfig) -> Any:
    """One rank's task, in Hydra's run_job (output folder made, HydraConfig set)."""
    run_dir = job.run_dir
    assert run_dir is not None
    started = time.time()
    frozen = OmegaConf.create(OmegaConf.to_container(task_cfg, resolve=True, enum_to_str=True))
    launch = LaunchEnv(
        backend=job.backend.name,
        collective=TORCH,
        run_dir=run_dir,
        launch_time=started,
        launch_id=found.job,  # rank 0's launch replaces it once the group is up (steadfast/library_mode.py)
        reference_world_size=found.world_size,
        collective_timeout_s=job.restart.collective_timeout_s,
        rank_env=found.platform.rank_env,
        platform=found.name,
    )
    if found.rank == 0:
        atomic_write(run_dir / CONFIG_FILE, OmegaConf.to_yaml(frozen))
        opened = _platform_records.open_launch(run_dir, found, job.backend.name, job.overrides)
        counted = bool(found.platform.rank_env.restart_count)  # else its incarnations count its restarts
        launch = dataclasses.replace(
            launch, launch_id=opened.launch_id, launch_time=opened.since, attempt=0 if counted else opened.incarnations
        )
    os.environ.update({**found.torch_environ(), **launch.to_environ()})
    _platform_records.keep_previous_heartbeat(run_dir, found.rank)
    _worker.start_rank()
    watch = SelfWatch(run_dir, found.rank, job.restart).start()
    ended = False
    try:
        value = _worker.run_task(lambda: (task_function, frozen))
        ended = True
    except Exception:
        agreed = LaunchEnv.current()  # rank 0's launch once the group formed (else this rank's own start)
        _platform_records.record_failure(run_dir, found.name, agreed.launch_time, started)
        raise
    finally:
        watch.stop()
        _worker.end_rank(fresh_process=True)
        shm.leave_platform_folder(LaunchEnv.current().snapshot, ended)
    return _ended(job, found, value)


def _ended(job: Job, found: Detected, value: Any) -> Any:
    """The task returned (its value) or stopped on purpose (Stopped): rank 0 records the launch's end."""
    run_dir = job.run_dir
    assert run_dir is not None
    since = LaunchEnv.current().launch_time
    restarts = _platform_records.restarts_since(run_dir, since)
    if not isinstance(value, Stopped):
        if found.rank == 0:
            _record_end(run_dir, events.JobCompleted(relaunches=0), Status.COMPLETED, since, since, restarts)
        return value
    if value.reason is StopReason.PREEMPTED:
        name = signal_name(value.signal, unknown="a stop request")
        code = exit_code(value.signal, job.restart.preemption_exit_code, library=True)
        if found.rank == 0:
            record = events.JobInterrupted(attempt=restarts, signal=name)
            _record_end(run_dir, record, Status.PREEMPTED, since, since, restarts, stop_signal=name)
        return _Exit(code, f"{value.message} Under {found.name}: exit code {code} (restart.preemption_exit_code).")
    if found.rank == 0:
        stopped = events.JobStopped(reason=value.reason.value, step=value.step, message=value.message)
        _record_end(run_dir, stopped, Status.MEMORY_LIMIT, since, since, restarts, error=value.message, stop_step=value.step)
    return _Exit(1, value.message)


def _exit_as_the_platform_expects(ret: JobReturn, job: Job, found: Detected) -> None:
    """End the process with the code its platform understands; return for a completed task (exit 0)
    and for a failure of its own (Hydra prints it, exit 1)."""
    value = returned(ret)
    if ret.status is JobStatus.COMPLETED and isinstance(value, _Exit):
        (log.warning if value.code else log.error)("%s", value.message)
        sys.exit(value.code)
    if ret.status is JobStatus.FAILED and isinstance(value, Exception) and is_peer_lost(f"{type(value).__name__}: {value}"):
        code = exit_code(signal.SIGTERM, job.restart.preemption_exit_code, library=True)
        print(
            f"[rank {found.rank}] lost a peer ({first_line(str(value), 200)}): exit code {code}, for {found.platform.restarts} "
            "to start the workers again",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(code)
