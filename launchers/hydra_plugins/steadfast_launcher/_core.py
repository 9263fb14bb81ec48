"""The launcher's `launch`: compose and check every job before any starts, then hand them to Slurm
or to the sweep runner, and return Hydra's JobReturns (the shape of Hydra's own launcher plugins).

Where the work is: `_compose` (jobs and their checks), `_sweep` (running them, the ledger, the
table), `_job` (one job: lock, relaunch loop, summary), `_backends` (how workers start), `_locks`;
`_inplace` when a platform (torchrun, srun, a PyTorchJob) started this process as one of its
workers: the task runs here, as its rank (library mode, docs/platforms.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, setup_globals
from omegaconf import DictConfig

from steadfast.contract import platforms
from steadfast.contract.naming import master_is_sweep

from . import _compose, _inplace, _slurm
from ._context import LaunchContext
from ._ledger import Ledger
from ._leftovers import SweepFolderSnapshot
from ._locks import lock_sweep, unlock_sweep
from ._sweep import Sweep
from ._types import ConfigError, Refused

log = logging.getLogger(__name__)


def launch(ctx: LaunchContext, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    found = platforms.detect(os.environ)
    if found is not None:  # a platform started this process as one of its workers: its task runs here (library mode)
        return _inplace.launch(ctx, job_overrides, initial_job_idx, found)
    setup_globals()
    master: DictConfig = ctx.config
    configure_log(master.hydra.hydra_logging, master.hydra.verbose)
    # The sweep folder is resolved once, from the sweep's own config, and every job gets that
    # folder: a job's config could resolve it differently (it sees its own overrides, a later clock).
    HydraConfig.instance().set_config(master)
    sweep_dir = str(master.hydra.sweep.dir)
    sweeping = master_is_sweep(master)
    before: Optional[SweepFolderSnapshot] = ctx.sweep_folder_before
    try:
        settings = _compose.settings(master)
        jobs = [_compose.prepare(ctx, list(o), initial_job_idx + i, sweep_dir) for i, o in enumerate(job_overrides)]
        _compose.check_folders(jobs)
        Path(sweep_dir).mkdir(parents=True, exist_ok=True)
        ledger = None
        if sweeping:
            holder = lock_sweep(Path(sweep_dir))
            if holder:
                raise Refused(
                    f"Sweep folder {sweep_dir} is in use by {holder}. Wait for that launch to end, "
                    "or choose another hydra.sweep.dir."
                )
            ledger = Ledger(
                Path(sweep_dir),
                {
                    "sweep_dir": os.path.abspath(sweep_dir),
                    "command": {"task": list(master.hydra.overrides.task), "hydra": list(master.hydra.overrides.hydra)},
                },
            )
        sweep = Sweep(ctx, jobs, settings, ledger, sweep_dir)
        _compose.preflight([j for j in jobs if sweep.completed_result(j) is None])
        _compose.check_task(ctx.task_function)
    except (ConfigError, Refused):
        if before is not None and initial_job_idx == 0:  # nothing of this launch ran: leave nothing behind
            unlock_sweep(Path(sweep_dir), remove=before.is_new())
            before.restore()
        raise
    HydraConfig.instance().set_config(master)
    if _slurm.wanted(jobs):
        return _slurm.submit_jobs(jobs)
    returns = sweep.run(table=sweeping)
    if sweep.all_refused() and before is not None and initial_job_idx == 0:
        before.restore()  # e.g. the run folder is in use: the running job's multirun.yaml is put back
    return returns
