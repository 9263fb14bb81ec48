"""Composing and checking a launch's jobs before any of them starts: each job's config (as Hydra
composes it for a sweep job), its typed backend and restart settings, its run folder and the
other folders it locks; then every check (schemas, backends, cluster, the app's pre-flight
hooks), so a bad value fails the whole launch with one message before any worker starts."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Dict, Iterable, List, Union

from hydra.core.hydra_config import HydraConfig
from hydra.types import TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from steadfast.contract import keys

from . import _backends, _ledger, _payload
from ._context import LaunchContext
from ._types import ConfigError, Job, Refused, Settings, cluster_from, restart_from
from .config import SteadfastLauncherConf


def settings(master: DictConfig) -> Settings:
    node = OmegaConf.select(master, "hydra.launcher") or {}
    defaults = SteadfastLauncherConf()
    values = {k: node.get(k, getattr(defaults, k)) for k in ("max_parallel_jobs", "max_procs", "fail_fast", "skip_completed")}
    problems = SteadfastLauncherConf(**values).problems()
    if problems:
        raise ConfigError(problems)
    return Settings(**values)


def prepare(ctx: LaunchContext, overrides: List[str], idx: int, sweep_dir: str) -> Job:
    sweep_config = ctx.compositions.compose(ctx.config, overrides)
    with read_write(sweep_config.hydra), open_dict(sweep_config):
        sweep_config.hydra.job.id = idx
        sweep_config.hydra.job.num = idx
        sweep_config.hydra.sweep.dir = sweep_dir
    HydraConfig.instance().set_config(sweep_config)  # lets ${hydra:...} resolve while we check it
    nodes = {g: sweep_config.get(g) for g in keys.GROUPS if g in sweep_config}
    shadowed = [keys.shadowing(g, v) for g, v in nodes.items() if v is not None and not isinstance(v, DictConfig)]
    if shadowed:
        raise ConfigError(shadowed)
    backend = _backends.backend_from(OmegaConf.select(sweep_config, "hydra.launcher.backend"))
    restart = restart_from(OmegaConf.select(sweep_config, "hydra.launcher.restart"))
    job = Job(idx=idx, overrides=overrides, config=sweep_config, backend=backend, restart=restart)
    subdir = OmegaConf.select(sweep_config, "hydra.sweep.subdir")
    # as Hydra's run_job computes it
    job.run_dir = Path(os.path.abspath(os.path.join(sweep_dir, str(subdir)) if subdir is not None else sweep_dir))
    job.lock_dirs = _lock_dirs(sweep_config, job.run_dir)
    job.key = _ledger.job_key(overrides)
    job.digest = _ledger.config_digest(sweep_config)
    return job


def _lock_dirs(config: DictConfig, run_dir: Path) -> List[Path]:
    """hydra.launcher.lock_dirs as absolute folders (null entries ignored, and locations that are not
    folders: checkpoint.dir=s3://...); a relative one is taken from where the workers run: the run
    folder with hydra.job.chdir=true, else here."""
    base = run_dir if OmegaConf.select(config, "hydra.job.chdir") else Path.cwd()
    entries = OmegaConf.select(config, "hydra.launcher.lock_dirs") or []
    folders = [str(e) for e in entries if e is not None and str(e) not in ("", "None") and "://" not in str(e)]
    return [Path(os.path.abspath(base / e)) for e in folders]


def check_folders(jobs: List[Job]) -> None:
    """Two different jobs of one sweep must not share a run folder (identical jobs may: they run in turn)."""
    seen: Dict[Path, Job] = {}
    problems = []
    for job in jobs:
        assert job.run_dir is not None
        other = seen.setdefault(job.run_dir, job)
        if other is not job and other.key != job.key:
            problems.append(
                f"{other.label} and {job.label} would share the run folder {job.run_dir}; give each job "
                "its own, e.g. a hydra.sweep.subdir that includes the keys this sweep varies "
                "(${hydra.job.override_dirname} has all of them)"
            )
    if problems:
        raise ConfigError(problems)


def _listed(hooks: Union[None, str, Iterable[object]]) -> List[str]:
    return [] if not hooks else [str(hooks)] if isinstance(hooks, str) else [str(h) for h in hooks]


def preflight(jobs: List[Job]) -> None:
    """Every problem of every job, in one ConfigError: schemas, the backend's own checks, the
    cluster, then the app's hooks (hydra.launcher.preflight: "module:function", called with the job's config)."""
    problems: List[str] = []
    for job in jobs:
        HydraConfig.instance().set_config(job.config)
        found = (
            _backends.of(job.backend).problems()
            + job.restart.problems()
            + cluster_from(OmegaConf.select(job.config, "hydra.launcher.cluster")).problems()
        )
        hooks = [
            h for key in ("preflight", "app_preflight") for h in _listed(OmegaConf.select(job.config, f"hydra.launcher.{key}"))
        ]
        for hook in [] if found else hooks:
            module, _, name = str(hook).partition(":")
            found += list(getattr(importlib.import_module(module), name)(job.config))
        prefix = f"{job.label}: " if len(jobs) > 1 else ""
        problems += [prefix + p for p in found]
    if problems:
        raise ConfigError(problems)


def check_task(task_function: TaskFunction) -> None:
    """The workers get the task function pickled: what cannot be pickled is named now, in one line."""
    why = _payload.unpicklable(task_function)
    if why is not None:
        raise Refused(why[0].upper() + why[1:])
