"""The Hydra launcher: a thin class; the work happens in `_core` (imported lazily: it imports torch)."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class SteadfastLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        # The launcher's own fields are re-read per job from the job's config (sweeps can vary them).
        self.params = params
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from . import _core

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        return _core.launch(
            launcher=self, job_overrides=job_overrides, initial_job_idx=initial_job_idx
        )
