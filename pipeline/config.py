"""Typed schemas of the built-in trainer's config (cheap: no torch) and its pre-flight check.

The library's groups (backend, restart, checkpoint, cluster, fault, logger) and keys (run, resume)
have their schemas in steadfast; this app adds `trainer`, `model` and `data`. Choice fields are
Enums: a bad value fails at composition, naming the key and listing what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from steadfast.config import CheckpointConf, FaultConf, LoggerConf, Resume, RunConf, SnapshotConf, register_configs
from steadfast.contract import naming
from steadfast.contract.schemas import BackendConf, ClusterConf, RestartConf, bad
from steadfast.preflight import resolved


class Optimizer(Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class Scheduler(Enum):
    none = "none"
    cosine = "cosine"
    step = "step"


class Objective(Enum):
    """What the job returns to Hydra (and to sweepers such as Optuna): a key of the trainer's result."""

    val_loss = "val_loss"
    val_accuracy = "val_accuracy"
    best_val_loss = "best_val_loss"
    final_loss = "final_loss"


class WorldSizePolicy(Enum):
    """What a resume does when the number of workers differs from the checkpoint's (an elastic job,
    backend.nnodes=MIN:MAX, that lost or regained a node; or a relaunch on another machine).
    Either way the data position is kept in samples: the resumed epoch neither repeats nor skips data."""

    keep_global_batch = "keep_global_batch"  # the global batch stays; each worker's batch becomes global / workers
    scale_lr = "scale_lr"  # each worker keeps data.batch_size; the learning rate scales with workers / reference
    refuse = "refuse"  # a checkpoint saved by another number of workers is not resumed


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    seed: int = 0
    lr: float = 0.05
    optimizer: Optimizer = Optimizer.sgd
    momentum: float = 0.9
    weight_decay: float = 0.0
    scheduler: Scheduler = Scheduler.none
    log_every_n_steps: int = 10
    num_threads: Optional[int] = None  # torch threads per worker; default: cores / local workers
    objective: Objective = Objective.val_loss
    # Ranks agree every this many steps whether to stop (SIGTERM/SIGINT): a tiny all-reduce,
    # pipelined. null: about every 50 ms, from the measured time per step.
    stop_check_every_n_steps: Optional[int] = None
    # Stop (after a checkpoint) when any rank's peak resident memory passes this many MB; null: off.
    max_rss_mb: Optional[float] = None
    # The reference world size is the job's full size (an elastic job's backend.nnodes MAX x
    # nproc_per_node), else the run's first launch's; see WorldSizePolicy.
    on_world_size_change: WorldSizePolicy = WorldSizePolicy.keep_global_batch


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
class TaskConfig:
    """`name` picks a built-in task (pipeline/tasks.py); `_target_` plugs in your own."""

    name: Optional[str] = None


@dataclass
class ClassificationConfig(TaskConfig):
    name: Optional[str] = "classification"


@dataclass
class TrainConfig:
    backend: BackendConf = MISSING
    restart: RestartConf = MISSING
    checkpoint: CheckpointConf = MISSING
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConf = field(default_factory=RunConf)
    resume: Resume = Resume.auto
    fault: FaultConf = field(default_factory=FaultConf)
    logger: LoggerConf = field(default_factory=LoggerConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    snapshot: SnapshotConf = field(default_factory=SnapshotConf)


MODEL_SCHEMAS = {"mlp": MLPConfig, "cnn": CNNConfig}
DATA_SCHEMAS = {"digits": DigitsConfig, "synthetic": SyntheticConfig}
TASK_SCHEMAS = {"classification": ClassificationConfig}


def typed(cfg: DictConfig) -> TrainConfig:
    """The job config as typed objects (the frozen config the worker gets is plain)."""
    from steadfast.contract.schemas import BACKEND_SCHEMAS

    schema = OmegaConf.structured(TrainConfig)
    schema.backend = OmegaConf.structured(BACKEND_SCHEMAS[cfg.backend.name])
    for group, schemas in (("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS), ("task", TASK_SCHEMAS)):
        node = cfg[group]
        if "_target_" not in node and node.get("name") in schemas:
            schema[group] = OmegaConf.structured(schemas[node.name])
    return OmegaConf.to_object(OmegaConf.merge(schema, cfg))  # type: ignore[return-value]


def preflight(job_cfg: DictConfig) -> List[str]:
    """Problems with the trainer's keys that would stop this job (the library checks its own)."""
    cfg = resolved(job_cfg)
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

    t = c.trainer
    positive("trainer.max_epochs", t.max_epochs)
    positive("trainer.lr", t.lr)
    positive("trainer.log_every_n_steps", t.log_every_n_steps)
    positive("trainer.num_threads", t.num_threads, allow_none=True)
    positive("trainer.stop_check_every_n_steps", t.stop_check_every_n_steps, allow_none=True)
    positive("trainer.max_rss_mb", t.max_rss_mb, allow_none=True)
    if t.weight_decay < 0:
        out.append(bad("trainer.weight_decay", t.weight_decay, "a number >= 0"))
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
    for group, node, schemas in (("model", cfg.model, MODEL_SCHEMAS), ("data", cfg.data, DATA_SCHEMAS), ("task", cfg.task, TASK_SCHEMAS)):
        if "_target_" not in node and node.get("name") not in schemas:
            out.append(bad(f"{group}.name", node.get("name"), f"one of {', '.join(schemas)}, or set {group}._target_ to an import path"))
    if isinstance(c.model, MLPConfig) and not 0 <= c.model.dropout < 1:
        out.append(bad("model.dropout", c.model.dropout, "a fraction in [0, 1)"))
    return out


naming.register_resolvers()
register_configs()
cs = ConfigStore.instance()
cs.store(name="schema_train", node=TrainConfig)
cs.store(group="model", name="schema_mlp", node=MLPConfig)
cs.store(group="model", name="schema_cnn", node=CNNConfig)
cs.store(group="data", name="schema_digits", node=DigitsConfig)
cs.store(group="data", name="schema_synthetic", node=SyntheticConfig)
cs.store(group="task", name="schema_classification", node=ClassificationConfig)
