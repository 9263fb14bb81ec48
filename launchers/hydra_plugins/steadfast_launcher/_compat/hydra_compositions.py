"""Composing each job once, not twice: Hydra's config loader, patched.

Before a batch reaches the launcher, Hydra's sweepers compose every job of it to check that it can be
composed (`Sweeper.validate_batch_is_legal`) and throw the result away; the launcher then composes
each job again to check and run it. This hands the sweeper's composition of a job to the launcher's
call for the same job, once (the launcher changes the config it gets), which saves one composition
per job (0.14 s of a single job's start-up here) without changing what either of them sees. It
wraps the loader's `load_sweep_config` (an instance attribute: the loader's class is untouched).
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional, Protocol, Tuple

from omegaconf import DictConfig

from . import Patch, applies


class SweepConfigLoader(Protocol):
    """What the launcher uses of Hydra's ConfigLoader."""

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig: ...


def _shape() -> Optional[str]:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    found = list(inspect.signature(ConfigLoaderImpl.load_sweep_config).parameters)
    wanted = ["self", "master_config", "sweep_overrides"]
    return None if found == wanted else f"ConfigLoaderImpl.load_sweep_config{tuple(found)} is not {tuple(wanted)}"


REUSE = Patch(
    "the sweeper's composition of a job reused by the launcher",
    "hydra-core",
    ">=1.3,<1.4",
    _shape,
    "every job is composed twice (about 0.14 s more per job)",
)


class ReusedCompositions:
    def __init__(self, compose: Callable[..., DictConfig]) -> None:
        self._compose = compose
        self._kept: Dict[Tuple[int, Tuple[str, ...]], List[DictConfig]] = {}

    @classmethod
    def install(cls, loader: SweepConfigLoader) -> "ReusedCompositions":
        """Wrap `loader.load_sweep_config` (once per loader; not at all where the patch does not apply)."""
        current = loader.load_sweep_config
        owner = getattr(current, "__self__", None)
        if isinstance(owner, cls):
            return owner
        reused = cls(current)
        if applies(REUSE):
            loader.load_sweep_config = reused.validate  # type: ignore[method-assign]
        return reused

    def validate(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        """What the sweeper calls: compose, and keep the result for the launcher."""
        config = self._compose(master_config=master_config, sweep_overrides=list(sweep_overrides))
        self._kept.setdefault((id(master_config), tuple(sweep_overrides)), []).append(config)
        return config

    def compose(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        """What the launcher calls: the sweeper's composition of this job if it made one, else a new one."""
        kept = self._kept.get((id(master_config), tuple(sweep_overrides)))
        if kept:
            return kept.pop(0)
        return self._compose(master_config=master_config, sweep_overrides=list(sweep_overrides))
