"""What a launch's modules need from Hydra's set-up of the launcher, as one value (in place of the
Launcher object itself): the sweep's config, Hydra's context and the task function, the jobs'
compositions, and what the sweep folder held before the sweeper wrote to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from ._compat.hydra_compositions import ReusedCompositions
from ._leftovers import SweepFolderSnapshot


@dataclass(frozen=True)
class LaunchContext:
    config: DictConfig  # the sweep's config (Hydra's master config), with its hydra node
    hydra_context: HydraContext
    task_function: TaskFunction
    compositions: ReusedCompositions  # a job's config, composed once (see _compat.hydra_compositions)
    sweep_folder_before: Optional[SweepFolderSnapshot] = None  # for a refused launch to leave nothing behind
