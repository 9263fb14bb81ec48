"""The Hydra launcher: a thin class; the work happens in `_core` (imported lazily: it imports torch)."""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import backends, platforms

from . import _backends
from ._compat.hydra_compositions import ReusedCompositions
from ._context import LaunchContext
from ._leftovers import snapshot

log = logging.getLogger(__name__)


class SteadfastLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        # The launcher's own fields are re-read per job from the job's config (sweeps can vary them).
        self.params = params
        self.context: Optional[LaunchContext] = None
        self._launched = False

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # The sweep's config is Hydra's config from here on, so `${hydra:...}` resolves in
        # hydra.sweep.dir (a single job's sweep folder is its run folder, named by run.name) when
        # the sweeper creates it; and what is there before the sweeper writes is noted, so a
        # refused launch leaves nothing behind (see _leftovers).
        HydraConfig.instance().set_config(config)
        try:
            sweep_dir = str(config.hydra.sweep.dir)
        except Exception:  # the sweeper reports it
            sweep_dir = None
        self.context = LaunchContext(
            config=config,
            hydra_context=hydra_context,
            task_function=task_function,
            compositions=ReusedCompositions.install(hydra_context.config_loader),
            sweep_folder_before=snapshot(sweep_dir),
        )
        _warm_up(config)
        self._launched = False
        atexit.register(self._never_launched)

    def _never_launched(self) -> None:
        """Hydra refused the sweep itself (e.g. a swept value its composition rejects) after its
        sweeper wrote multirun.yaml: the launcher never ran, so what the sweeper wrote goes too."""
        before = self.context.sweep_folder_before if self.context is not None else None
        if not self._launched and before is not None:
            before.restore()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from . import _core

        assert self.context is not None, "Hydra sets a launcher up before it launches"
        self._launched = True
        return _core.launch(self.context, job_overrides=job_overrides, initial_job_idx=initial_job_idx)


def _warm_up(config: DictConfig) -> None:
    """Let the backend the sweep's own config names (most likely its jobs' backend) start what its
    launches will need, while Hydra composes and checks the jobs (e.g. torchrun's forkserver, whose
    imports are the longest part of a launch's start-up). Not for a job submitted elsewhere (Slurm),
    nor in library mode (a platform started this process as one of its workers: no workers to start)."""
    if platforms.detect(os.environ) is not None:
        return
    try:
        node = OmegaConf.select(config, "hydra.launcher.backend")
        cluster = OmegaConf.select(config, "hydra.launcher.cluster.name", default="none")
        spec = backends.spec(str(node.get("name"))) if node is not None else None
        if spec is not None and cluster in (None, "none"):
            _backends.backend_class(spec).warm_up(node)
    except Exception:  # a config the launcher reports on properly later
        return
