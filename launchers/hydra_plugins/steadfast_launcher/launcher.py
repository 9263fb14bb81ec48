"""The Hydra launcher: a thin class; the work happens in `_core` (imported lazily: it imports torch)."""

from __future__ import annotations

import atexit
import logging
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from ._leftovers import SweepFolderSnapshot, snapshot
from ._reuse import ReusedCompositions

log = logging.getLogger(__name__)


class SteadfastLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        # The launcher's own fields are re-read per job from the job's config (sweeps can vary them).
        self.params = params
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        self.sweep_folder_before: Optional[SweepFolderSnapshot] = None
        self.compositions: Optional[ReusedCompositions] = None
        self._launched = False

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.compositions = ReusedCompositions.install(hydra_context.config_loader)
        # The sweep's config is Hydra's config from here on, so `${hydra:...}` resolves in
        # hydra.sweep.dir (a single job's sweep folder is its run folder, named by run.name) when
        # the sweeper creates it; and what is there before the sweeper writes is noted, so a
        # refused launch leaves nothing behind (see _leftovers).
        HydraConfig.instance().set_config(config)
        try:
            sweep_dir = str(config.hydra.sweep.dir)
        except Exception:  # the sweeper reports it
            sweep_dir = None
        self.sweep_folder_before = snapshot(sweep_dir)
        if _forkserver_wanted(config):
            from . import _forkserver

            _forkserver.start()
        self._launched = False
        atexit.register(self._never_launched)

    def _never_launched(self) -> None:
        """Hydra refused the sweep itself (e.g. a swept value its composition rejects) after its
        sweeper wrote multirun.yaml: the launcher never ran, so what the sweeper wrote goes too."""
        if not self._launched and self.sweep_folder_before is not None:
            self.sweep_folder_before.restore()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from . import _core

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        self._launched = True
        return _core.launch(launcher=self, job_overrides=job_overrides, initial_job_idx=initial_job_idx)


def _forkserver_wanted(config: DictConfig) -> bool:
    """Will this launch most likely fork its workers from the forkserver (torchrun, the default
    start method, on this machine)? Then the server starts now: its imports (torch, ~3 s here) are
    the longest part of a launch's start-up, and they run while Hydra composes and checks the jobs.
    A guess from the sweep's own config: a job that does not use the server leaves it idle, and it
    ends with the launcher either way."""
    try:
        backend = OmegaConf.select(config, "hydra.launcher.backend")
        cluster = OmegaConf.select(config, "hydra.launcher.cluster.name", default="none")
        return (
            backend is not None
            and backend.get("name") == "torchrun"
            and backend.get("start_method") == "forkserver"
            and cluster in (None, "none")
        )
    except Exception:  # a config the launcher reports on properly later
        return False
