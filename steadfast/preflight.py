"""The library's pre-flight check: run by the launcher in its own process before any worker starts.

Every problem names the full key, the bad value and what is allowed. It reads checkpoints'
manifests only (cheap, no torch): a resume that cannot work is refused here, not after start-up.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, cast

from omegaconf import DictConfig, OmegaConf, open_dict

from . import app_keys
from .checkpoint import manifest
from .checkpoint.storage import Store, store_for
from .checkpoint.storage.base import location
from .config import FaultKind, Resume, Settings, settings_from
from .contract import backends
from .contract.schemas import bad, bounded, positive
from .faults import WRITER_KINDS
from .telemetry import sinks


def resolved(job_cfg: DictConfig) -> DictConfig:
    """The task's config, resolved, without the hydra node (${hydra:...} resolves: the launcher set HydraConfig)."""
    cfg = copy.deepcopy(job_cfg)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return OmegaConf.create(cast(Dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))


def checkpoint_store(job_cfg: DictConfig, s: Settings) -> Store:
    """The store the job's checkpoints go to (checkpoint.dir, or its run folder's checkpoints/); ValueError
    for a checkpoint.dir no store takes."""
    run_dir = f"{OmegaConf.select(job_cfg, 'hydra.sweep.dir')}/{OmegaConf.select(job_cfg, 'hydra.sweep.subdir')}"
    return store_for(location(s.checkpoint.dir, run_dir))


def check(job_cfg: DictConfig) -> List[str]:
    """Problems with the library's keys that would stop this job (empty: it can run)."""
    cfg = resolved(job_cfg)
    try:
        s = settings_from(cfg)
    except ValueError as exc:
        return [str(exc)]
    out: List[str] = bounded("", s)
    if out:  # a NaN, an infinity or a number too large for what the workers build from it
        return out
    ck = s.checkpoint
    out += positive("checkpoint.every_n_epochs", ck.every_n_epochs, allow_none=True)
    out += positive("checkpoint.every_n_steps", ck.every_n_steps, allow_none=True)
    if ck.every_n_seconds != "auto":
        if isinstance(ck.every_n_seconds, str):
            try:
                ck.every_n_seconds = float(ck.every_n_seconds)
            except ValueError:
                pass
        if ck.every_n_seconds is not None and (
            isinstance(ck.every_n_seconds, bool) or not isinstance(ck.every_n_seconds, (int, float)) or ck.every_n_seconds <= 0
        ):
            out.append(
                bad(
                    "checkpoint.every_n_seconds",
                    ck.every_n_seconds,
                    "seconds > 0, auto (from the save cost and the failures seen), or null",
                )
            )
    if ck.every_n_epochs is None and ck.every_n_steps is None and ck.every_n_seconds is None:
        out.append(
            "checkpoint: set at least one of checkpoint.every_n_epochs, checkpoint.every_n_steps, checkpoint.every_n_seconds"
        )
    if ck.keep_last < 1:
        out.append(bad("checkpoint.keep_last", ck.keep_last, "an integer >= 1 (the newest checkpoint is always kept)"))
    elif ck.async_save and ck.keep_last < 2:
        out.append(
            bad(
                "checkpoint.keep_last",
                ck.keep_last,
                "at least 2 with checkpoint.async_save=true (the newest may still be writing)",
            )
        )
    out += positive("checkpoint.keep_every_n_epochs", ck.keep_every_n_epochs, allow_none=True)
    out += _best_problems(s)
    f = s.fault
    if f.kind.value != "none":
        if f.at_step < 1:
            out.append(bad("fault.at_step", f.at_step, "a step number >= 1"))
        if f.times < 0:
            out.append(bad("fault.times", f.times, "an integer >= 0 (0 = every time)"))
        if f.kind is FaultKind.slow_rank:
            out += positive("fault.delay_s", f.delay_s)
        if f.kind is FaultKind.bitflip and not 0 <= f.bit <= 63:
            out.append(bad("fault.bit", f.bit, "a bit number from 0 (the lowest) to 63"))
        sharded = s.parallel.kind.value == "fsdp"  # every rank writes its own file of a sharded checkpoint
        if f.kind in WRITER_KINDS and f.rank != 0 and not sharded:
            out.append(bad("fault.rank", f.rank, f"0 for fault.kind={f.kind.value} (only rank 0 writes checkpoints)"))
    out += _sharding_problems(s, OmegaConf.select(cfg, "backend.name", default=None)) + _anomaly_problems(s)
    if s.parallel.kind.value != "fsdp" and s.parallel.units:
        out.append(
            bad("parallel.units", s.parallel.units, "empty unless parallel.kind=fsdp (the modules FSDP shards one by one)")
        )
    every = s.snapshot.every_n_steps
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        out.append(bad("snapshot.every_n_steps", every, "auto, a number of steps >= 1, or 0 to turn memory snapshots off"))
    if s.logger.progress_every_s < 0:
        out.append(bad("logger.progress_every_s", s.logger.progress_every_s, "seconds >= 0"))
    if s.logger.straggler_margin is not None and s.logger.straggler_margin < 0:
        out.append(
            bad(
                "logger.straggler_margin",
                s.logger.straggler_margin,
                "a fraction > 0 (0.25: a rank's local work 25% over the other ranks' median), or 0 or null: off",
            )
        )
    if s.logger.straggler_windows < 1:
        out.append(bad("logger.straggler_windows", s.logger.straggler_windows, "an integer >= 1 (logging windows in a row)"))
    out += sinks.problems(s.logger)
    out += app_keys.problems(job_cfg, cfg)
    return out + _resume_problems(job_cfg, cfg, s)


def _best_problems(s: Settings) -> List[str]:
    ck, out = s.checkpoint, []
    if ck.keep_best < 0:
        out.append(bad("checkpoint.keep_best", ck.keep_best, "an integer >= 0: the best checkpoints by checkpoint.monitor kept"))
    if ck.monitor is not None and not manifest.METRIC_NAME.fullmatch(ck.monitor):
        out.append(bad("checkpoint.monitor", ck.monitor, "the name of a metric given to run.log (e.g. val_loss), or null"))
    elif ck.keep_best > 0 and ck.monitor is None:
        out.append(
            bad(
                "checkpoint.keep_best",
                ck.keep_best,
                "0 without checkpoint.monitor: set checkpoint.monitor to the metric given to run.log to rank by (e.g. val_loss)",
            )
        )
    return out


def _anomaly_problems(s: Settings) -> List[str]:
    a, out = s.anomaly, []
    if a.spike_zscore is not None and a.spike_zscore <= 0:
        out.append(bad("anomaly.spike_zscore", a.spike_zscore, "standard deviations > 0, or null: no z-score test"))
    if a.spike_ratio is not None and a.spike_ratio <= 1:
        out.append(bad("anomaly.spike_ratio", a.spike_ratio, "a ratio > 1 to the moving average, or null: no ratio test"))
    out += positive("anomaly.ema_steps", a.ema_steps) + positive("anomaly.window_steps", a.window_steps)
    out += positive("anomaly.lr_scale", a.lr_scale)
    for key in ("warmup_steps", "max_rollbacks", "lr_scale_steps", "fingerprint_every_n_steps"):
        if getattr(a, key) < 0:
            out.append(bad(f"anomaly.{key}", getattr(a, key), "an integer >= 0"))
    return out


def _sharding_problems(s: Settings, backend: Optional[str]) -> List[str]:
    """parallel=fsdp on a backend that cannot shard parameters (what it says about itself)."""
    spec = backends.spec(str(backend)) if backend is not None else None
    if s.parallel.kind.value != "fsdp" or spec is None or not spec.cannot_shard:
        return []
    able = " or ".join(f"backend={b.name}" for b in backends.specs() if not b.cannot_shard)
    return [f"parallel=fsdp needs {able} (backend={backend}: {spec.cannot_shard}); choose parallel=ddp or {able}"]


def _resume_problems(job_cfg: DictConfig, cfg: DictConfig, s: Settings) -> List[str]:
    """What the checkpoint store says about this launch, read from manifests only (cheap)."""
    try:
        store = checkpoint_store(job_cfg, s)
    except ValueError as exc:
        return [str(exc)]
    problem = store.problem()  # before any worker starts: a run must not train for hours, then fail to save
    if problem:
        return [problem]
    try:
        found = manifest.scan(store)
    except OSError as exc:  # StoreError: it answered the check, then not
        return [str(exc)]
    if s.resume == Resume.never and found:
        return [
            f"resume=never, but {store.where()} already holds checkpoints (newest {found[0].name}); they are left "
            "untouched. Use resume=auto to continue that run, or choose another run.name"
        ]
    if s.resume == Resume.must and not found:
        return [f"resume=must, but there is no committed checkpoint in {store.where()}"]
    newest = next((c.manifest for c in found if c.manifest is not None), None)
    if s.resume == Resume.never or newest is None or s.run.allow_config_change:
        return []
    diff = manifest.changes(
        newest.get("config", {}),
        manifest.training_config(cast(Dict[str, Any], OmegaConf.to_container(cfg)), s.run.safe_to_change),
    )
    if diff:
        return [
            f"resume: the newest checkpoint in {store.where()} (step {newest.get('step')}) was trained with a different "
            f"config: {manifest.describe_changes(diff)}. Restore those values, choose another run.name, or set "
            "run.allow_config_change=true to resume anyway"
        ]
    return []
