"""Typed schemas of the training job (cheap: no torch), the run-name rule and the pre-flight check.

The launcher calls `preflight` in its own process with each job's config, before any worker
starts; every problem it returns names the full key, the bad value and what is allowed.
"""
from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra_plugins.steadfast_launcher._schemas import BackendConf, RestartConf, bad
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict


class Resume(Enum):
    auto = "auto"  # resume from the newest valid checkpoint if there is one
    never = "never"  # refuse to start if the run folder already holds checkpoints
    must = "must"  # fail if there is nothing to resume


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    seed: int = 0
    lr: float = 0.05
    optimizer: str = "sgd"  # sgd | adam | adamw
    momentum: float = 0.9
    weight_decay: float = 0.0
    scheduler: str = "none"  # none | cosine | step
    log_every_n_steps: int = 10
    num_threads: Optional[int] = None  # torch threads per worker; default: cores / local workers
    objective: str = "val_loss"  # what the job returns to Hydra (and to sweepers such as Optuna): see OBJECTIVES
    # Ranks agree every this many steps whether to stop (SIGTERM/SIGINT): a tiny all-reduce.
    stop_check_every_n_steps: int = 1
    # Stop (after a checkpoint) when any rank's peak resident memory passes this many MB; null: off.
    max_rss_mb: Optional[float] = None
    # What a resume does when the number of workers differs from the checkpoint's (an elastic job,
    # backend.nnodes=MIN:MAX, that lost or regained a node; or a relaunch on another machine):
    #   keep_global_batch: the global batch (data.batch_size x the reference world size: an elastic job's
    #                      full size, backend.nnodes MAX x nproc_per_node, else the first launch's) stays;
    #                      each worker's batch becomes global / workers (rounded up); lr unchanged.
    #   scale_lr:          each worker keeps data.batch_size, so the global batch changes; the
    #                      learning rate is scaled by workers / the reference world size (linear rule).
    #   refuse:            a checkpoint saved by another number of workers is not resumed.
    # Either way the data position is kept in samples: the resumed epoch neither repeats nor skips data.
    on_world_size_change: str = "keep_global_batch"


@dataclass
class CheckpointConfig:
    every_n_epochs: Optional[int] = 10
    every_n_steps: Optional[int] = None
    every_n_seconds: Optional[float] = None
    keep_last: int = 3
    keep_every_n_epochs: Optional[int] = None  # permanent milestones, never removed by retention
    async_save: bool = False  # training pays only for a copy to host memory; write and commit in the background
    dir: Optional[str] = None  # default: <run folder>/checkpoints


@dataclass
class RunConfig:
    name: str = MISSING  # default: derived from the job's overrides (see run_name)
    allow_config_change: bool = False  # resume even if training-relevant keys changed
    fresh_start_if_unusable: bool = False  # with resume=auto: train from scratch if every checkpoint is broken


@dataclass
class ModelConfig:
    """`name` picks a built-in builder; `_target_` (an import path) plugs in your own."""

    name: Optional[str] = None


@dataclass
class MLPConfig(ModelConfig):
    name: Optional[str] = "mlp"
    hidden_sizes: List[int] = field(default_factory=lambda: [64, 64])
    dropout: float = 0.1


@dataclass
class CNNConfig(ModelConfig):
    name: Optional[str] = "cnn"
    channels: List[int] = field(default_factory=lambda: [16, 32])
    dropout: float = 0.1


@dataclass
class DataConfig:
    name: Optional[str] = None
    batch_size: int = 32  # per worker
    val_fraction: float = 0.2
    seed: int = 0
    num_workers: int = 0


@dataclass
class DigitsConfig(DataConfig):
    name: Optional[str] = "digits"


@dataclass
class SyntheticConfig(DataConfig):
    name: Optional[str] = "synthetic"
    num_samples: int = 2048
    num_features: int = 32
    num_classes: int = 4


@dataclass
class FaultConfig:
    """Off by default. See pipeline/faults.py."""

    kind: str = "none"  # none | kill | hang | exception | sigterm | crash_in_save | save_error | corrupt_checkpoint
    rank: int = 0
    at_step: int = 1
    times: int = 1  # over the whole run, restarts included; 0 = every time
    hang_s: float = 3600.0
    hang_until_stop: bool = False  # a hang ends when the process is asked to stop (places a signal exactly)


@dataclass
class LoggerConfig:
    """What a person sees: the progress display on rank 0, and optional TensorBoard logging."""

    progress: str = "auto"  # auto (a bar on a terminal, plain lines otherwise) | bar | lines | none
    progress_every_s: float = 10.0  # seconds between plain progress lines (and lines in the log file)
    tensorboard: bool = False  # also write metrics as TensorBoard events under <run folder>/tensorboard


@dataclass
class ClusterConfig:
    """cluster=none (default): run here. cluster=slurm: submit each job to Slurm (see _slurm.py)."""

    name: str = "none"
    nodes: int = 1  # one torch elastic agent per node (srun --ntasks-per-node=1)
    min_nodes: Optional[int] = None  # elastic: backend.nnodes=min_nodes:nodes (null: exactly nodes)
    time_min: int = 60  # the job's time limit (sbatch --time, minutes)
    partition: Optional[str] = None
    gpus_per_node: Optional[int] = None
    cpus_per_node: Optional[int] = None  # sbatch --cpus-per-task (one task per node)
    requeue: bool = True  # --requeue, and `scontrol requeue` after a stop before the time limit
    signal_grace_s: int = 120  # --signal=TERM@<this>: SIGTERM this long before the time limit
    rdzv_port: int = 29400  # the c10d rendezvous port on the allocation's first node
    extra_sbatch_args: List[str] = field(default_factory=list)  # e.g. ["--account=proj", "--qos=high"]
    submit: bool = True  # false: only write <run folder>/slurm/job.sbatch


@dataclass
class TrainConfig:
    backend: BackendConf = MISSING
    restart: RestartConf = MISSING
    checkpoint: CheckpointConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resume: Resume = Resume.auto
    fault: FaultConfig = field(default_factory=FaultConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# Keys that do not change what is trained, so they do not change the derived run name:
# running again with more epochs or another cadence continues the same run.
NAME_NEUTRAL = ("run.", "resume", "trainer.max_epochs", "trainer.log_every_n_steps", "trainer.num_threads",
                "trainer.objective", "trainer.stop_check_every_n_steps", "trainer.max_rss_mb", "logger",
                "checkpoint", "restart", "hydra.", "cluster", "backend.rdzv", "backend.monitor", "backend.start_timeout")
MAX_NAME = 80
SWEEPS = "sweeps"  # sweeps get their own folder under the output root: <root>/sweeps/<sweep name>/<run name>


def _folder_name(items: Sequence[str], empty: str) -> str:
    if not items:
        return empty
    name = ",".join(re.sub(r"[^A-Za-z0-9_.=+-]", "-", o) for o in items)
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def run_name(overrides: Sequence[str]) -> str:
    """A folder name derived from the job's overrides: same command, same folder (no timestamps)."""
    return _folder_name(sorted(o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(NAME_NEUTRAL)), "default")


def sweep_name(overrides: Sequence[str], sweeper: Optional[str] = None, params: Any = None) -> str:
    """A sweep's folder name, from its command line as typed (sweep syntax included) and its sweeper.

    Like run_name, keys that do not change what is trained are left out unless the sweep varies
    them, so `-m trainer.lr=0.1,0.01 trainer.max_epochs=40` continues `-m trainer.lr=0.1,0.01`.
    What the sweep varies comes first, so a long name keeps it readable (the rest is hashed).
    """
    from hydra_plugins.steadfast_launcher._sweep import is_sweep

    swept = sorted(o.lstrip("+~") for o in overrides if is_sweep([o]))
    fixed = sorted(o.lstrip("+~") for o in overrides if not is_sweep([o]) and not o.lstrip("+~").startswith(NAME_NEUTRAL))
    searched = sorted(f"{k}={v}" for k, v in (params or {}).items())
    prefix = [str(sweeper)] if sweeper not in (None, "", "basic") else []
    return _folder_name(prefix + swept + searched + fixed, "default")


def sweep_dir(root: str, overrides: Sequence[str], sweeper: Optional[str] = None, params: Any = None) -> str:
    """`root` for one job (so a plain run keeps `<root>/<run name>`); `<root>/sweeps/<sweep name>` for a sweep."""
    from hydra_plugins.steadfast_launcher._sweep import is_sweep

    overrides = [str(o) for o in overrides]
    if isinstance(params, DictConfig):
        params = OmegaConf.to_container(params)
    if not is_sweep(overrides, sweeper, params):
        return str(root)
    return f"{root}/{SWEEPS}/{sweep_name(overrides, sweeper, params)}"


def help_groups(choices: Any) -> str:
    """The app's config groups and their options for `--help` (the typed schema_* entries hidden)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    choices = dict(choices or {})
    lines: List[str] = []

    def walk(parent: str) -> None:
        for group in sorted(loader.list_groups(parent)):
            full = f"{parent}/{group}" if parent else group
            if full == "hydra" or full.startswith("hydra/"):
                continue
            options = [o for o in loader.get_group_options(full, results_filter=ObjectType.CONFIG) if not o.startswith("schema")]
            if options:
                default = choices.get(full)
                shown = ", ".join(f"{o} (default)" if o == default else o for o in options)
                how = GROUP_HELP.get(full, "")
                if full not in choices:
                    how = f"{how}; optional: +{full}=NAME" if how else f"optional: +{full}=NAME"
                lines.append(f"  {full}: {shown}" + (f"\n      {how}" if how else ""))
            walk(full)

    walk("")
    return "\n".join(lines)


GROUP_HELP = {
    "backend": "how the workers start: torch elastic (torchrun), Horovod, or in this process",
    "restart": "what happens when a worker fails: restart.max_restarts, restart.monitor_interval",
    "checkpoint": "when checkpoints are written and how many are kept",
    "model": "the network; model._target_=my.module.MyNet plugs in your own",
    "data": "the dataset; data._target_ plugs in your own",
    "fault": "fault injection, to rehearse recovery",
    "logger": "progress display and TensorBoard logging (logger=tensorboard)",
    "experiment": "committed presets (conf/experiment/)",
}

OmegaConf.register_new_resolver("steadfast_run_name", lambda overrides: run_name(list(overrides)), replace=True)
OmegaConf.register_new_resolver("steadfast_sweep_dir", sweep_dir, replace=True)
OmegaConf.register_new_resolver("steadfast_help_groups", help_groups, replace=True)


def typed(cfg: DictConfig) -> TrainConfig:
    """The job config as typed objects (the frozen config the worker gets is plain)."""
    schema = OmegaConf.structured(TrainConfig)
    schema.backend = OmegaConf.structured(_backend_schema(cfg.backend.name))
    for group, schemas in (("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS)):
        node = cfg[group]
        if "_target_" not in node and node.get("name") in schemas:
            schema[group] = OmegaConf.structured(schemas[node.name])
    return OmegaConf.to_object(OmegaConf.merge(schema, cfg))  # type: ignore[return-value]


def _backend_schema(name: str) -> type:
    from hydra_plugins.steadfast_launcher._schemas import HorovodBackendConf, LocalBackendConf, TorchrunBackendConf

    return {"torchrun": TorchrunBackendConf, "horovod": HorovodBackendConf, "local": LocalBackendConf}[name]


MODEL_SCHEMAS = {"mlp": MLPConfig, "cnn": CNNConfig}
DATA_SCHEMAS = {"digits": DigitsConfig, "synthetic": SyntheticConfig}
OPTIMIZERS = ("sgd", "adam", "adamw")
OBJECTIVES = ("val_loss", "val_accuracy", "best_val_loss", "final_loss")  # keys of the trainer's result
SCHEDULERS = ("none", "cosine", "step")
WORLD_SIZE_POLICIES = ("keep_global_batch", "scale_lr", "refuse")
PROGRESS_MODES = ("auto", "bar", "lines", "none")


def preflight(job_cfg: DictConfig) -> List[str]:
    """Problems that would stop this job, found before any worker starts (empty: it can run)."""
    cfg = copy.deepcopy(job_cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # ${hydra:...} still resolves: the launcher has set HydraConfig
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    try:
        c = typed(cfg)
    except Exception as exc:  # a type or key error that composition let through (e.g. in a user's node)
        return [str(exc).splitlines()[0]]
    out: List[str] = []

    def positive(key: str, value: Any, allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        if value is None or value <= 0:
            out.append(bad(key, value, "a number > 0" + (", or null to disable" if allow_none else "")))

    t, ck = c.trainer, c.checkpoint
    positive("trainer.max_epochs", t.max_epochs)
    positive("trainer.lr", t.lr)
    positive("trainer.log_every_n_steps", t.log_every_n_steps)
    if t.num_threads is not None:
        positive("trainer.num_threads", t.num_threads)
    if t.optimizer not in OPTIMIZERS:
        out.append(bad("trainer.optimizer", t.optimizer, f"one of {', '.join(OPTIMIZERS)}"))
    if t.objective not in OBJECTIVES:
        out.append(bad("trainer.objective", t.objective, f"one of {', '.join(OBJECTIVES)}"))
    positive("trainer.stop_check_every_n_steps", t.stop_check_every_n_steps)
    positive("trainer.max_rss_mb", t.max_rss_mb, allow_none=True)
    if t.scheduler not in SCHEDULERS:
        out.append(bad("trainer.scheduler", t.scheduler, f"one of {', '.join(SCHEDULERS)}"))
    if t.on_world_size_change not in WORLD_SIZE_POLICIES:
        out.append(bad("trainer.on_world_size_change", t.on_world_size_change, f"one of {', '.join(WORLD_SIZE_POLICIES)}"))
    if t.weight_decay < 0:
        out.append(bad("trainer.weight_decay", t.weight_decay, "a number >= 0"))
    for key in ("every_n_epochs", "every_n_steps", "every_n_seconds"):
        positive(f"checkpoint.{key}", getattr(ck, key), allow_none=True)
    if ck.every_n_epochs is None and ck.every_n_steps is None and ck.every_n_seconds is None:
        out.append("checkpoint: set at least one of checkpoint.every_n_epochs, checkpoint.every_n_steps, checkpoint.every_n_seconds")
    if ck.keep_last < 1:
        out.append(bad("checkpoint.keep_last", ck.keep_last, "an integer >= 1 (the newest checkpoint is always kept)"))
    elif ck.async_save and ck.keep_last < 2:
        out.append(bad("checkpoint.keep_last", ck.keep_last, "at least 2 with checkpoint.async_save=true (the newest may still be writing)"))
    positive("checkpoint.keep_every_n_epochs", ck.keep_every_n_epochs, allow_none=True)
    d = c.data
    if isinstance(d, DataConfig):
        positive("data.batch_size", d.batch_size)
        if not 0 < d.val_fraction < 1:
            out.append(bad("data.val_fraction", d.val_fraction, "a fraction strictly between 0 and 1"))
        if d.num_workers < 0:
            out.append(bad("data.num_workers", d.num_workers, "an integer >= 0"))
        if isinstance(d, SyntheticConfig):
            for key in ("num_samples", "num_features"):
                positive(f"data.{key}", getattr(d, key))
            if d.num_classes < 2:
                out.append(bad("data.num_classes", d.num_classes, "an integer >= 2"))
    for group, node, schemas in (("model", cfg.model, MODEL_SCHEMAS), ("data", cfg.data, DATA_SCHEMAS)):
        if "_target_" not in node and node.get("name") not in schemas:
            out.append(bad(f"{group}.name", node.get("name"), f"one of {', '.join(schemas)}, or set {group}._target_ to an import path"))
    if isinstance(c.model, MLPConfig) and not 0 <= c.model.dropout < 1:
        out.append(bad("model.dropout", c.model.dropout, "a fraction in [0, 1)"))
    from .faults import KINDS

    f = c.fault
    if f.kind not in KINDS:
        out.append(bad("fault.kind", f.kind, f"one of {', '.join(KINDS)}"))
    if f.kind != "none":
        if f.at_step < 1:
            out.append(bad("fault.at_step", f.at_step, "a step number >= 1"))
        if f.times < 0:
            out.append(bad("fault.times", f.times, "an integer >= 0 (0 = every time)"))
        if f.kind in ("crash_in_save", "save_error", "corrupt_checkpoint", "hang_in_save") and f.rank != 0:
            out.append(bad("fault.rank", f.rank, f"0 for fault.kind={f.kind} (only rank 0 writes checkpoints)"))
    lg = c.logger
    if lg.progress not in PROGRESS_MODES:
        out.append(bad("logger.progress", lg.progress, f"one of {', '.join(PROGRESS_MODES)}"))
    if lg.progress_every_s < 0:
        out.append(bad("logger.progress_every_s", lg.progress_every_s, "seconds >= 0"))
    if lg.tensorboard:
        from importlib.util import find_spec

        if find_spec("tensorboard") is None:
            out.append("logger.tensorboard=true: the tensorboard package is not installed. Install it with "
                       "`pip install tensorboard` (or `pip install -e .[tensorboard]`), or choose logger=none")
    out += _resume_problems(job_cfg, cfg, c)
    if c.backend.name == "horovod":
        from importlib.util import find_spec

        if find_spec("horovod") is None:
            out.append("backend=horovod: Horovod is not installed. Install it with `bash scripts/install_horovod.sh "
                       "$(which python)` (builds a patched Horovod 0.28.1 with PyTorch and Gloo), or choose backend=torchrun")
    return out


def _not_writable(folder: Any) -> Optional[str]:
    """Checked before any worker starts, so a run cannot train for hours and then fail to save."""
    import os
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"checkpoint folder {folder} is not writable ({exc.strerror or exc}); choose a writable checkpoint.dir"
    return None


def _resume_problems(job_cfg: DictConfig, cfg: DictConfig, c: TrainConfig) -> List[str]:
    """What the run folder's checkpoints say about this launch, read from manifests only (cheap)."""
    from pathlib import Path

    from . import manifest

    run_dir = Path(str(OmegaConf.select(job_cfg, "hydra.sweep.dir"))) / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir"))
    folder = Path(c.checkpoint.dir) if c.checkpoint.dir else run_dir / "checkpoints"
    problem = _not_writable(folder)
    if problem:
        return [problem]
    found = manifest.committed(folder)
    if c.resume == Resume.never and found:
        return [f"resume=never, but {folder} already holds checkpoints (newest {found[0][1].name}); they are left "
                "untouched. Use resume=auto to continue that run, or choose another run.name"]
    if c.resume == Resume.must and not found:
        return [f"resume=must, but there is no committed checkpoint in {folder}"]
    newest = manifest.newest_manifest(folder)
    if c.resume == Resume.never or newest is None or c.run.allow_config_change:
        return []
    diff = manifest.changes(newest.get("config", {}), manifest.training_config(OmegaConf.to_container(cfg)))
    if diff:
        return [f"resume: the newest checkpoint in {folder} (step {newest.get('step')}) was trained with a different "
                f"config: {manifest.describe_changes(diff)}. Restore those values, choose another run.name, or set "
                "run.allow_config_change=true to resume anyway"]
    return []


cs = ConfigStore.instance()
cs.store(name="schema_train", node=TrainConfig)
cs.store(group="checkpoint", name="schema", node=CheckpointConfig)
cs.store(group="fault", name="schema", node=FaultConfig)
cs.store(group="logger", name="schema", node=LoggerConfig)
cs.store(group="cluster", name="schema", node=ClusterConfig)
cs.store(group="model", name="schema_mlp", node=MLPConfig)
cs.store(group="model", name="schema_cnn", node=CNNConfig)
cs.store(group="data", name="schema_digits", node=DigitsConfig)
cs.store(group="data", name="schema_synthetic", node=SyntheticConfig)
