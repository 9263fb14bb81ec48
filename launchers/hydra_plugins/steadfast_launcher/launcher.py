"""The Hydra launcher: a thin class; the work happens in `_core` (imported lazily: it imports torch)."""
from __future__ import annotations

import atexit
import logging
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

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
        return _core.launch(
            launcher=self, job_overrides=job_overrides, initial_job_idx=initial_job_idx
        )
