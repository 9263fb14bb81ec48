"""Typed schemas of the built-in trainer's config (cheap: no torch) and its pre-flight check.

The library's groups (backend, restart, checkpoint, cluster, fault, logger) and keys (run, resume)
have their schemas in steadfast; this app adds `trainer`, `model` and `data`. Choice fields are
Enums: a bad value fails at composition, naming the key and listing what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Type

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from steadfast.config import (
    AnomalyConf,
    CheckpointConf,
    FaultConf,
    LoggerConf,
    ParallelConf,
    Resume,
    RunConf,
    SnapshotConf,
    register_configs,
)
from steadfast.contract import backends, naming
from steadfast.contract.backends import BackendConf
from steadfast.contract.schemas import ClusterConf, RestartConf, bad, bounded, positive
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
    """What the job returns to Hydra (and to sweepers such as Optuna): a key of the trainer's result.
    `val_<metric>` only where the task reports that metric (TaskConfig.metrics; checked by preflight)."""

    val_loss = "val_loss"
    val_accuracy = "val_accuracy"  # task=classification
    val_mae = "val_mae"  # task=regression
    val_bits_per_char = "val_bits_per_char"  # task=language_model
    best_val_loss = "best_val_loss"
    final_loss = "final_loss"


# What a sample gives the model and what its target is: the model, the data and the task must agree.
INPUTS = {"features": "real-valued features", "tokens": "sequences of token indices"}
TARGETS = {"classes": "class labels", "values": "real-valued targets", "next_tokens": "next-token targets"}


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
    # Batches per optimizer step: gradients accumulate over this many batches (reduced over the
    # ranks only on the last), the loss of each scaled by 1/N; checkpoints record every batch.
    accumulate_grad_batches: int = 1


@dataclass
class ModelConfig:
    """`name` picks a built-in builder; `_target_` (an import path) plugs in your own."""

    name: Optional[str] = None
    inputs: ClassVar[str] = "features"  # a key of INPUTS


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
class TransformerConfig(ModelConfig):
    """A small decoder-only character transformer (pipeline/models.py CharTransformer)."""

    name: Optional[str] = "transformer"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    bias: bool = True
    inputs: ClassVar[str] = "tokens"


@dataclass
class DataConfig:
    name: Optional[str] = None
    batch_size: int = 32  # per worker
    val_fraction: float = 0.2
    seed: int = 0
    num_workers: int = 0
    inputs: ClassVar[str] = "features"  # a key of INPUTS
    targets: ClassVar[str] = "classes"  # a key of TARGETS


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
class SyntheticRegressionConfig(DataConfig):
    """y = tanh(x A) B + noise, A and B drawn from `seed` (pipeline/data.py synthetic_regression)."""

    name: Optional[str] = "synthetic_regression"
    num_samples: int = 2048
    num_features: int = 16
    num_targets: int = 1
    hidden: int = 8
    noise: float = 0.1
    targets: ClassVar[str] = "values"


@dataclass
class TextConfig(DataConfig):
    """Character windows of the Python standard library's sources (pipeline/text.py); no download."""

    name: Optional[str] = "text"
    block_size: int = 128  # characters of context
    stride: Optional[int] = None  # characters between window starts; null: block_size (no overlap)
    max_chars: int = 1_000_000  # how much of the sources, in characters
    val_fraction: float = 0.1  # the end of the text, held out whole
    inputs: ClassVar[str] = "tokens"
    targets: ClassVar[str] = "next_tokens"


@dataclass
class TaskConfig:
    """`name` picks a built-in task (pipeline/tasks.py); `_target_` plugs in your own."""

    name: Optional[str] = None
    targets: ClassVar[str] = "classes"  # a key of TARGETS
    metrics: ClassVar[Tuple[str, ...]] = ()  # what validation reports besides loss, as val_<metric>


@dataclass
class ClassificationConfig(TaskConfig):
    name: Optional[str] = "classification"
    metrics: ClassVar[Tuple[str, ...]] = ("accuracy",)


@dataclass
class RegressionConfig(TaskConfig):
    name: Optional[str] = "regression"
    targets: ClassVar[str] = "values"
    metrics: ClassVar[Tuple[str, ...]] = ("mae",)


@dataclass
class LanguageModelConfig(TaskConfig):
    name: Optional[str] = "language_model"
    targets: ClassVar[str] = "next_tokens"
    metrics: ClassVar[Tuple[str, ...]] = ("bits_per_char",)


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
    parallel: ParallelConf = field(default_factory=ParallelConf)
    anomaly: AnomalyConf = field(default_factory=AnomalyConf)


MODEL_SCHEMAS: Dict[str, Type[ModelConfig]] = {"mlp": MLPConfig, "cnn": CNNConfig, "transformer": TransformerConfig}
DATA_SCHEMAS: Dict[str, Type[DataConfig]] = {
    "digits": DigitsConfig,
    "synthetic": SyntheticConfig,
    "synthetic_regression": SyntheticRegressionConfig,
    "text": TextConfig,
}
TASK_SCHEMAS: Dict[str, Type[TaskConfig]] = {
    "classification": ClassificationConfig,
    "regression": RegressionConfig,
    "language_model": LanguageModelConfig,
}


def typed(cfg: DictConfig) -> TrainConfig:
    """The job config as typed objects (the frozen config the worker gets is plain)."""
    schema = OmegaConf.structured(TrainConfig)
    schema.backend = OmegaConf.structured(backends.schema_of(cfg.backend.name))
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
    out: List[str] = bounded("trainer", c.trainer)
    for group in ("model", "data"):
        out += bounded(group, getattr(c, group))
    if out:  # a NaN, an infinity or a number too large for what the workers build from it
        return out
    t = c.trainer
    out += positive("trainer.max_epochs", t.max_epochs)
    out += positive("trainer.lr", t.lr)
    out += positive("trainer.log_every_n_steps", t.log_every_n_steps)
    out += positive("trainer.num_threads", t.num_threads, allow_none=True)
    out += positive("trainer.stop_check_every_n_steps", t.stop_check_every_n_steps, allow_none=True)
    out += positive("trainer.max_rss_mb", t.max_rss_mb, allow_none=True)
    out += positive("trainer.accumulate_grad_batches", t.accumulate_grad_batches)
    if t.weight_decay < 0:
        out.append(bad("trainer.weight_decay", t.weight_decay, "a number >= 0"))
    d = c.data
    if isinstance(d, DataConfig):
        out += positive("data.batch_size", d.batch_size)
        if not 0 < d.val_fraction < 1:
            out.append(bad("data.val_fraction", d.val_fraction, "a fraction strictly between 0 and 1"))
        if d.num_workers < 0:
            out.append(bad("data.num_workers", d.num_workers, "an integer >= 0"))
        if isinstance(d, SyntheticConfig):
            for key in ("num_samples", "num_features"):
                out += positive(f"data.{key}", getattr(d, key))
            if d.num_classes < 2:
                out.append(bad("data.num_classes", d.num_classes, "an integer >= 2"))
        if isinstance(d, SyntheticRegressionConfig):
            for key in ("num_samples", "num_features", "num_targets", "hidden"):
                out += positive(f"data.{key}", getattr(d, key))
            if d.noise < 0:
                out.append(bad("data.noise", d.noise, "a number >= 0"))
        if isinstance(d, TextConfig):
            out += positive("data.block_size", d.block_size)
            out += positive("data.stride", d.stride, allow_none=True)
            out += positive("data.max_chars", d.max_chars)
    for group, node, schemas in (
        ("model", cfg.model, MODEL_SCHEMAS),
        ("data", cfg.data, DATA_SCHEMAS),
        ("task", cfg.task, TASK_SCHEMAS),
    ):
        if "_target_" not in node and node.get("name") not in schemas:
            out.append(
                bad(f"{group}.name", node.get("name"), f"one of {', '.join(schemas)}, or set {group}._target_ to an import path")
            )
    if isinstance(c.model, (MLPConfig, CNNConfig, TransformerConfig)) and not 0 <= c.model.dropout < 1:
        out.append(bad("model.dropout", c.model.dropout, "a fraction in [0, 1)"))
    if isinstance(c.model, TransformerConfig):
        for key in ("n_layer", "n_head", "n_embd"):
            out += positive(f"model.{key}", getattr(c.model, key))
        if c.model.n_head > 0 and c.model.n_embd % c.model.n_head:
            out.append(bad("model.n_embd", c.model.n_embd, f"a multiple of model.n_head={c.model.n_head}"))
    return out + _mismatches(c)


def _name(group: str, node: Any) -> str:
    return f"{group}={node.name}"


def _fits(schemas: Mapping[str, type], attr: str, value: str, group: str) -> str:
    names = [n for n, sch in schemas.items() if getattr(sch, attr) == value]
    return " or ".join(f"{group}={n}" for n in names) + f", or your own with {group}._target_"


def _mismatches(c: TrainConfig) -> List[str]:
    """A model, data and task that cannot work together, an objective the task does not report, and a
    checkpoint.monitor the trainer does not log (built-in choices only: a `_target_` node's inputs and
    metrics are its own business)."""
    out: List[str] = []
    model = c.model if isinstance(c.model, ModelConfig) else None
    data = c.data if isinstance(c.data, DataConfig) else None
    task = c.task if isinstance(c.task, TaskConfig) else None
    if data is not None and task is not None and data.targets != task.targets:
        out.append(
            f"{_name('task', task)} needs data with {TARGETS[task.targets]}, but {_name('data', data)} gives "
            f"{TARGETS[data.targets]}: choose {_fits(DATA_SCHEMAS, 'targets', task.targets, 'data')}"
        )
    if data is not None and model is not None and data.inputs != model.inputs:
        out.append(
            f"{_name('model', model)} takes {INPUTS[model.inputs]}, but {_name('data', data)} gives "
            f"{INPUTS[data.inputs]}: choose {_fits(MODEL_SCHEMAS, 'inputs', data.inputs, 'model')}"
        )
    if task is not None:
        validated = ["val_loss", *(f"val_{m}" for m in task.metrics)]
        reported = [*validated, "best_val_loss", "final_loss"]
        objective = c.trainer.objective.value
        if objective not in reported:
            owners = [n for n, sch in TASK_SCHEMAS.items() if objective in (f"val_{m}" for m in sch.metrics)]
            only = f" ({objective} is reported by task={' or task='.join(owners)} only)" if owners else ""
            out.append(bad("trainer.objective", objective, f"{_name('task', task)} reports {', '.join(reported)}{only}"))
        logged = ["train_loss", *validated, "best_val_loss"]  # what trainer.py gives run.log after each epoch
        monitor = c.checkpoint.monitor
        if monitor is not None and monitor not in logged:
            out.append(
                bad("checkpoint.monitor", monitor, f"a metric the trainer logs with {_name('task', task)}: {', '.join(logged)}")
            )
    return out


naming.register_resolvers()
register_configs()
cs = ConfigStore.instance()
cs.store(name="schema_train", node=TrainConfig)
for group, schemas in (("model", MODEL_SCHEMAS), ("data", DATA_SCHEMAS), ("task", TASK_SCHEMAS)):
    for name, node in schemas.items():
        cs.store(group=group, name=f"schema_{name}", node=node)
