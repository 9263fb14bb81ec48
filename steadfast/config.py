"""Typed schemas of the library's own config groups (cheap: no torch).

`checkpoint`, `snapshot`, `parallel`, `anomaly`, `fault`, `logger`, `run` and `resume` configure what every task gets from
`steadfast.Run`, the built-in trainer and a user's own loop alike; `backend`, `restart` and
`cluster` are the launcher's (steadfast.contract.schemas, and each backend's own module). The YAML
options of these groups live in `steadfast/conf/` (an app adds `pkg://steadfast.conf` to its search
path). Choice fields are Enums, so a bad value fails at composition, naming the key and listing
what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Union

from omegaconf import MISSING, DictConfig


class Resume(Enum):
    auto = "auto"  # resume from the newest valid checkpoint if there is one
    never = "never"  # refuse to start if the run folder already holds checkpoints
    must = "must"  # fail if there is nothing to resume


class FaultKind(Enum):
    none = "none"
    kill = "kill"  # SIGKILL, as a crash or the OOM killer would
    segfault = "segfault"  # SIGSEGV, as a crash in native code would (faulthandler writes the stack to the rank's log)
    hang = "hang"  # alive but stuck for hang_s
    hang_in_backward = "hang_in_backward"
    hang_in_save = "hang_in_save"
    exception = "exception"
    sigterm = "sigterm"  # a scheduler's preemption notice
    crash_in_save = "crash_in_save"  # SIGKILL in the middle of writing a checkpoint
    crash_in_snapshot = "crash_in_snapshot"  # SIGKILL in the middle of copying a snapshot into shared memory
    save_error = "save_error"  # ENOSPC while writing a checkpoint
    corrupt_checkpoint = "corrupt_checkpoint"  # one byte of the newest committed checkpoint flipped
    slow_rank = "slow_rank"  # delay_s more local work on every step from at_step on: a straggler
    nan_loss = "nan_loss"  # the model's output on one rank is NaN in step at_step: a non-finite loss and gradients
    loss_spike = "loss_spike"  # the model's output on one rank plus `factor` times noise in step at_step: a loss spike
    bitflip = "bitflip"  # one bit of one parameter flipped on one rank after step at_step: silent corruption


class ProgressMode(Enum):
    auto = "auto"  # a bar on a terminal, plain lines otherwise
    bar = "bar"
    lines = "lines"
    none = "none"


class MonitorMode(Enum):
    min = "min"  # the lowest value is the best (a loss)
    max = "max"  # the highest value is the best (an accuracy)


@dataclass
class CheckpointConf:
    every_n_epochs: Optional[int] = 10
    every_n_steps: Optional[int] = None
    # seconds between checkpoints, or "auto": chosen from the measured save cost and the time
    # between failures seen so far (Young/Daly), with a floor
    every_n_seconds: Any = None
    keep_last: int = 3
    keep_every_n_epochs: Optional[int] = None  # permanent milestones, never removed by retention
    # also keep the keep_best best checkpoints by `monitor`, a metric given to run.log (the built-in
    # trainer's val_loss): each checkpoint records the value logged since the save before it
    keep_best: int = 0
    monitor: Optional[str] = None
    mode: MonitorMode = MonitorMode.min
    async_save: bool = False  # training pays only for a copy to host memory; write and commit in the background
    dir: Optional[str] = None  # a folder (default: <run folder>/checkpoints) or s3://bucket/prefix (docs/checkpoints.md)


@dataclass
class SnapshotConf:
    """Copies of the training state in shared memory between checkpoints (steadfast/checkpoint/memory.py):
    after a worker's death the group restores from memory, losing at most the interval in force
    (every_n_steps, or what auto chose then: the attempt's snapshot_interval events)."""

    # auto: every step when a copy costs under 2% of a step, else as often as 2% allows; 0: off
    every_n_steps: Any = "auto"


class ParallelKind(Enum):
    ddp = "ddp"  # every rank holds the whole model; gradients all-reduced (DDP on torchrun, Horovod's optimizer)
    fsdp = "fsdp"  # FSDP2: parameters, gradients and optimizer state sharded over the ranks (torchrun only)
    none = "none"  # run.setup leaves the model as it is (a loop that wraps or shards it itself)


class Precision(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class SkipKind(Enum):
    batch = "batch"  # the batches of the step that showed the anomaly, on every rank
    window = "window"  # every batch since the state a rollback restores, up to that step's


@dataclass
class AnomalyConf:
    """Failures that crash nothing (steadfast/health/): a non-finite loss or gradient norm, a loss
    spike, replicas that diverged. Found on every rank, agreed at the same step, rolled back."""

    nonfinite: bool = True  # a NaN or infinite loss (or gradient norm given to run.step) is an anomaly
    # a loss spike: a step's loss this many standard deviations above its moving average ... (anomaly=spikes: 6)
    spike_zscore: Optional[float] = None
    # ... and this many times the average (anomaly=spikes: 2); either test off when null; both null: no spikes (default)
    spike_ratio: Optional[float] = None
    ema_steps: int = 100  # the moving average's span: each healthy loss weighs 1/ema_steps
    warmup_steps: int = 100  # healthy losses seen before a spike can be called
    skip: SkipKind = SkipKind.batch  # the data a rollback skips (batch: exactly reproducible)
    max_rollbacks: int = 3  # rollbacks allowed in any window_steps steps; one more stops the run
    window_steps: int = 1000
    lr_scale: float = 1.0  # after a rollback, the learning rate times this ...
    lr_scale_steps: int = 0  # ... for this many steps from the anomaly's step (0: never)
    # compare the replicas' parameters (a fingerprint of each) every this many steps and at every
    # checkpoint; 0: off. Only replicated parameters (parallel=ddp, Horovod): off for fsdp and none
    fingerprint_every_n_steps: int = 100

    @property
    def spikes(self) -> bool:
        return self.spike_zscore is not None or self.spike_ratio is not None

    @property
    def watches(self) -> bool:
        """Whether the losses are watched at all (anomaly=off: no)."""
        return self.nonfinite or self.spikes

    @property
    def on(self) -> bool:
        """Whether anything is watched (the losses, or the replicas where there are some)."""
        return self.watches or self.fingerprint_every_n_steps > 0


@dataclass
class ParallelConf:
    """How run.setup(model, optimizer) spreads the model over the ranks (steadfast/distributed/parallel.py)."""

    kind: ParallelKind = ParallelKind.ddp
    # fsdp: the module classes (by class name) that become their own FSDP unit, each sharded and
    # gathered on its own; the whole model is the last unit. Empty: every block of the model's
    # first ModuleList or Sequential of several blocks (a transformer's layers)
    units: List[str] = field(default_factory=list)
    reshard_after_forward: bool = True  # fsdp: free the gathered parameters after the forward (less memory, one more gather)
    param_dtype: Optional[Precision] = None  # fsdp mixed precision: the dtype of the gathered parameters in forward/backward
    reduce_dtype: Optional[Precision] = None  # fsdp mixed precision: the dtype gradients are reduced in


@dataclass
class RunConf:
    name: str = MISSING  # default: derived from the job's overrides (steadfast.contract.keys)
    allow_config_change: bool = False  # resume even if training-relevant keys changed
    fresh_start_if_unusable: bool = False  # with resume=auto: train from scratch if every checkpoint is broken
    # the app's keys that do not change what is trained (besides the library's own: see
    # steadfast.contract.keys): they stay out of the run's name and may change on resume
    safe_to_change: List[str] = field(default_factory=list)


@dataclass
class FaultConf:
    """Off by default. See steadfast/faults.py."""

    kind: FaultKind = FaultKind.none
    rank: int = 0
    at_step: int = 1
    times: int = 1  # over the whole run, restarts included; 0 = every time
    hang_s: float = 3600.0
    hang_until_stop: bool = False  # a hang ends when the process is asked to stop (places a signal exactly)
    delay_s: float = 0.02  # slow_rank: seconds added to each step's local work (before its forward)
    factor: float = 1000.0  # loss_spike: this times standard normal noise is added to the model's output
    bit: int = 12  # bitflip: the bit flipped (0: the lowest) in the first element of the first parameter


class SinkKind(Enum):
    """Where rank 0's metrics rows go besides metrics.jsonl (steadfast/telemetry/sinks.py)."""

    tensorboard = "tensorboard"  # event files under <run folder>/tensorboard
    csv = "csv"  # <run folder>/metrics.csv: one row per step, one column per metric
    mlflow = "mlflow"  # an MLflow run (logger.mlflow): params, metrics by step, the final weights


@dataclass
class MlflowConf:
    """The MLflow run a run logs to (logger.sinks has mlflow). Credentials come from MLflow's own
    environment variables (MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN), never from here."""

    tracking_uri: Optional[str] = None  # default: MLFLOW_TRACKING_URI, else MLflow's own default
    experiment: Optional[str] = None  # default: MLFLOW_EXPERIMENT_NAME, else MLflow's "Default"
    log_model: bool = True  # upload model.safetensors as an artifact when the run completes
    timeout_s: float = 120.0  # the most the end of an attempt waits for what is not yet sent


@dataclass
class LoggerConf:
    """What a person sees: the progress display on rank 0, and where metrics go besides metrics.jsonl."""

    progress: ProgressMode = ProgressMode.auto
    progress_every_s: float = 10.0  # seconds between plain progress lines (and lines in the log file)
    sinks: List[SinkKind] = field(default_factory=list)  # any of tensorboard, csv, mlflow
    mlflow: MlflowConf = field(default_factory=MlflowConf)
    # name a rank whose local work per step (loading, forward) exceeds the other ranks' median by more
    # than this fraction (and by 2 ms) for straggler_windows logging windows in a row; 0 or null: off
    straggler_margin: Optional[float] = 0.25
    straggler_windows: int = 3


def register_configs() -> None:
    """Store the schemas the YAML options of the library's groups extend (called by the launcher
    plugin's config module, which Hydra imports before it composes any app's config; the launcher's
    own groups, `backend`, `restart` and `cluster`, are stored there)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, name, node in (
        ("checkpoint", "schema", CheckpointConf),
        ("fault", "schema", FaultConf),
        ("logger", "schema", LoggerConf),
        ("snapshot", "schema", SnapshotConf),
        ("parallel", "schema", ParallelConf),
        ("anomaly", "schema", AnomalyConf),
    ):
        cs.store(group=group, name=name, node=node, provider="steadfast")


@dataclass
class Settings:
    """The library's view of a job config: its own groups, typed, with defaults for what the app left out."""

    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    run: RunConf = field(default_factory=lambda: RunConf(name="run"))
    resume: Resume = Resume.auto
    fault: FaultConf = field(default_factory=FaultConf)
    logger: LoggerConf = field(default_factory=LoggerConf)
    snapshot: SnapshotConf = field(default_factory=SnapshotConf)
    parallel: ParallelConf = field(default_factory=ParallelConf)
    anomaly: AnomalyConf = field(default_factory=AnomalyConf)


def settings_from(cfg: Union[DictConfig, Dict[str, Any]]) -> Settings:
    """Settings from a job config (a DictConfig or a dict); raises ValueError naming a bad key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg
    node = {
        key: plain[key]
        for key in ("checkpoint", "run", "resume", "fault", "logger", "snapshot", "parallel", "anomaly")
        if isinstance(plain, dict) and key in plain and plain[key] is not None
    }
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Settings), node)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
