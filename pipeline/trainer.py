"""The training loop, shared by every backend. State that a resume must restore is a Stateful."""
from __future__ import annotations

import logging
import os
import random
import resource
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from steadfast import comm as dist
from steadfast.checkpoint import manifest
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.config import Resume
from steadfast.contract import stop as contract_stop
from steadfast.contract import events
from steadfast.contract.env import LaunchEnv
from steadfast.contract.events import Event
from steadfast.contract.exits import EXIT_PREEMPTED
from steadfast.contract.heartbeat import DONE_PHASE, heartbeat
from steadfast.faults import FaultInjector
from steadfast.progress import ProgressDisplay
from steadfast.records import RunRecord, model_sha256, setup_logging

from . import config as schema
from .data import ResumableSampler, build_data
from .models import build_model

log = logging.getLogger("pipeline")

CONTROL_EVERY = 10  # steps between the ranks' agreement on time-based checkpoints


@dataclass
class Progress:
    """Where training stands: enough to continue at the next batch."""

    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches completed in the current epoch
    sample_in_epoch: int = 0  # samples of the epoch's order consumed by all ranks together (data.ResumableSampler)
    first_world_size: Optional[int] = None  # workers of the run's first launch: the reference for on_world_size_change
    lr_scale: float = 1.0  # the learning rate's factor under trainer.on_world_size_change=scale_lr
    global_step: int = 0
    train_loss: Optional[float] = None  # mean over the last completed epoch
    val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None
    best_val_loss: Optional[float] = None

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class RNGState:
    """This rank's random number generators (torch, CUDA, numpy, python)."""

    def state_dict(self) -> Dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        np.random.set_state(state["numpy"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(cfg: schema.TrainerConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if cfg.optimizer.value == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer.value == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: schema.TrainerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.scheduler.value == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.max_epochs)
    if cfg.scheduler.value == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, cfg.max_epochs // 3), gamma=0.1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)


class RunFolderNotShared(RuntimeError):
    """Some ranks do not see the run folder rank 0 writes to (no shared storage between the nodes)."""


def check_shared_run_dir(run_dir: Path, comm: Any) -> None:
    """Collective, at start-up: every rank must see the run folder rank 0 writes checkpoints to.

    Rank 0 writes a token file with a random id into its run folder and broadcasts the id; every
    rank reads the file from its own run folder. Without shared storage (or with a different
    working directory on some node) a node sees another folder, and every rank fails here with a
    message naming the folders and hosts instead of resuming from nothing later.
    """
    if comm.world_size <= 1:
        return
    import socket
    import uuid

    host = socket.gethostname()
    token = run_dir / f".shared-check-{uuid.uuid4().hex}" if comm.rank == 0 else None
    if token is not None:
        token.write_text(token.name)
    name, root_dir, root_host = comm.broadcast_object((token.name if token else None, str(run_dir), host))
    try:
        sees = (run_dir / name).read_text() == name
    except OSError:
        sees = False
    seen = comm.gather_object((comm.rank, host, str(run_dir), sees))
    blind = [r for r in (seen or []) if not r[3]]
    message = ""
    if blind:
        who = "; ".join(f"rank {r} on {h} (its run folder: {d})" for r, h, d, _ in blind)
        message = (f"not every worker sees the run folder {root_dir} that rank 0 on {root_host} writes checkpoints to: {who} "
                   f"cannot read the file rank 0 wrote there. The nodes of a multi-node job need shared storage mounted at "
                   f"the same path, and the same working directory (or an absolute hydra.sweep.dir/run.name) on every node")
    message = comm.broadcast_object(message)
    if token is not None:
        token.unlink(missing_ok=True)
    if message:
        raise RunFolderNotShared(message)


class Trainer:
    def __init__(self, raw_cfg: DictConfig) -> None:
        self.raw_cfg = raw_cfg
        self.cfg = schema.typed(raw_cfg)
        self.launch = LaunchEnv.current()
        self.run_dir = self.launch.run_dir
        self.started = self.launch.launch_time or time.time()
        self.heartbeat = heartbeat()  # None when not started by the launcher's workers
        self.comm = dist.init(self.launch.collective, self.launch.collective_timeout_s)
        check_shared_run_dir(self.run_dir, self.comm)
        self.record = RunRecord(self.run_dir, self.comm.rank)
        self._log_handler = setup_logging(self.run_dir, self.comm.rank)
        self._step = -1
        self._tb: Any = None
        self.beat(-1, "init")

    def fit(self) -> Dict[str, Any]:
        try:
            return self._fit()
        finally:
            self.beat(phase=DONE_PHASE)  # finished (or failed): the hang watchdog stops watching this rank
            if self._tb is not None:
                self._tb.close()
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self.comm.shutdown()

    def beat(self, step: Optional[int] = None, phase: str = "train") -> None:
        """Progress for the launcher's hang watchdog (one small pwrite)."""
        if step is not None:
            self._step = step
        if self.heartbeat is not None:
            self.heartbeat.beat(self._step, phase)

    def metrics(self, **row: Any) -> None:
        """A row of metrics.jsonl (rank 0), and the same numbers to TensorBoard with logger=tensorboard."""
        self.record.metrics(**row)
        if self.comm.rank == 0 and self.cfg.logger.tensorboard:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            step = row["step"]
            for key, value in row.items():
                if key in ("time", "step", "epoch", "wall") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{'train' if 'loss' == key else 'epoch' if key.startswith(('train_', 'val_')) else 'system'}/{key}", value, step)
                elif isinstance(value, list) and key.endswith("_per_rank"):
                    for r, v in enumerate(value):
                        self._tb.add_scalar(f"system/{key[:-9]}/rank{r}", v, step)

    def _fit(self) -> Dict[str, Any]:
        cfg, comm = self.cfg, self.comm
        threads = cfg.trainer.num_threads or max(1, len(os.sched_getaffinity(0)) // comm.local_world_size)
        torch.set_num_threads(threads)
        seed_everything(cfg.trainer.seed)  # same initial weights on every rank
        data = build_data(cfg.data)
        model = build_model(cfg.model, data.input_shape, data.num_classes).to(comm.device)
        ddp_model = comm.wrap_model(model)
        # Wrapped before anything is restored into it: Horovod's wrapper is a new optimizer object.
        optimizer = comm.wrap_optimizer(build_optimizer(cfg.trainer, model), model)
        scheduler = build_scheduler(cfg.trainer, optimizer)
        seed_everything(cfg.trainer.seed + 1 + comm.rank)  # each rank its own dropout stream
        progress, rng = Progress(), RNGState()
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "progress": progress}
        per_rank = {"rng": rng}

        restarts = self.launch.restart_count
        faults = FaultInjector(cfg.fault, comm.rank, self.run_dir,
                               lambda event, **f: events.append(self.run_dir, event, restart=restarts, **f))
        if faults.wants_backward_hook:  # fault=hang_in_backward: in the middle of the backward pass
            next(model.parameters()).register_hook(lambda grad: faults.in_backward(progress.global_step + 1))
        resolved = OmegaConf.to_container(self.raw_cfg, resolve=True)
        ckpt = CheckpointManager(
            Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints",
            comm, cfg.checkpoint.keep_last, manifest.training_config(resolved, cfg.run.safe_to_change), self.record.event,
            async_save=cfg.checkpoint.async_save, keep_every_n_epochs=cfg.checkpoint.keep_every_n_epochs,
            full_config=dict(manifest.flatten(resolved)), hooks=_SaveHooks(faults, self),
        )
        self.record.event(Event.ATTEMPT_STARTED, world_size=comm.world_size, device=str(comm.device))
        self.beat(-1, "restore")
        resumed = self._resume(ckpt, objects, per_rank)
        comm.broadcast_state(model, optimizer)
        self.beat(progress.global_step, "train")
        batch_size = self._adapt_to_world_size(progress, optimizer, scheduler, resumed)

        sampler = ResumableSampler(len(data.train), comm.world_size, comm.rank, batch_size, cfg.trainer.seed)
        loader_rng = torch.Generator()  # keeps the DataLoader from drawing on the global RNG
        loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler,
                            num_workers=cfg.data.num_workers, generator=loader_rng)
        ck = cfg.checkpoint
        last_save_time = time.monotonic()
        log.info("Training %s on %d worker(s), %d batches per epoch per worker, epochs %d..%d%s",
                 type(model).__name__, comm.world_size, sampler.batches_per_epoch, progress.epoch + 1,
                 cfg.trainer.max_epochs, f" (resumed from step {resumed})" if resumed is not None else "")

        def save() -> None:
            nonlocal last_save_time
            self.beat(progress.global_step, "save")
            ckpt.save(progress.global_step, objects, per_rank,
                      {"epoch": progress.epoch, "batch_in_epoch": progress.batch_in_epoch, "global_step": progress.global_step,
                       "sample_in_epoch": progress.sample_in_epoch})
            last_save_time = time.monotonic()
            self.beat(progress.global_step, "train")
            display.restart_rate()

        def stop(reason: str, signum: Optional[int], message: str, exit_code: int) -> None:
            """Every rank, at the same step: commit this step, record why, and leave (contract_stop.StopRun)."""
            drain()
            if ckpt.last_saved_step != progress.global_step:
                save()
            self.beat(progress.global_step, "stop")
            ckpt.close()  # an asynchronous save must be committed before we report it
            display.close()
            step = progress.global_step
            asked = contract_stop.stop_requested_at()
            fields = {"step": step, "epoch": progress.epoch, "batch_in_epoch": progress.batch_in_epoch, "saved": True,
                      "checkpoint": str(ckpt.folder / manifest.step_dir_name(step))}
            if reason == contract_stop.PREEMPTED:
                fields.update(signal=contract_stop.signal_name(signum), signal_number=signum)
                if asked is not None:
                    fields["signal_to_commit_s"] = round(time.time() - asked, 3)
            fields["message"] = message
            fields["result"] = {"epochs_completed": progress.epoch, "global_step": step, "final_loss": progress.train_loss,
                                "val_loss": progress.val_loss, "restarts": restarts, "resumed_from_step": resumed,
                                "world_size": comm.world_size, "wall_seconds": round(time.time() - self.started, 3),
                                "run_dir": str(self.run_dir)}
            self.record.event(Event(reason), **fields)
            log.warning("%s", message)
            raise contract_stop.StopRun(reason, step, True, message, exit_code, signum)

        def local_flags(time_check: bool) -> List[float]:
            local = contract_stop.stop_requested()
            if local is not None and not announced:
                announced.append(local)
                log.warning("%s received: stopping at a step boundary agreed with the other ranks", contract_stop.signal_name(local))
            time_due = time_check and comm.rank == 0 and time.monotonic() - last_save_time >= (ck.every_n_seconds or 0)
            return [float(local or 0), 1.0 if time_due else 0.0]

        def agree(time_check: bool = False) -> tuple[Optional[int], bool]:
            """The control agreement, pipelined: this boundary acts on what every rank reported at the
            previous check (one tiny all-reduce started then, finished by now), and starts the next
            one. (stop signal or None, a time-based save is due): the same on every rank."""
            nonlocal pending
            agreed = pending.wait() if pending is not None else [0.0, 0.0]
            pending = comm.start_max_each(local_flags(time_check))
            return (int(agreed[0]) or None), agreed[1] > 0

        def agree_now() -> Optional[int]:
            """The same, waited for at once (at epoch ends, where a stop may have come during validation)."""
            nonlocal pending
            earlier = pending.wait() if pending is not None else [0.0, 0.0]
            pending = None
            now = comm.max_each(local_flags(False))
            return int(max(earlier[0], now[0])) or None

        def drain() -> None:
            nonlocal pending
            if pending is not None:
                pending.wait()
                pending = None

        def preempt(signum: int) -> None:
            stop(contract_stop.PREEMPTED, signum,
                 f"{contract_stop.signal_name(signum)}: stopped at step {progress.global_step} (epoch {progress.epoch + 1}, "
                 f"batch {progress.batch_in_epoch}), checkpoint committed. Run the same command again to continue.",
                 EXIT_PREEMPTED)

        announced: list = []
        pending: Any = None  # the control all-reduce in flight
        stop_every = cfg.trainer.stop_check_every_n_steps
        max_rss = cfg.trainer.max_rss_mb
        ws = comm.world_size
        cuda = comm.device.type == "cuda"
        total_steps = cfg.trainer.max_epochs * sampler.batches_per_epoch
        display = ProgressDisplay(cfg.logger.progress.value, cfg.logger.progress_every_s, total_steps, cfg.trainer.max_epochs,
                                  enabled=comm.rank == 0)
        first_step = True
        while progress.epoch < cfg.trainer.max_epochs:
            epoch = progress.epoch
            sampler.start(epoch, progress.sample_in_epoch)
            loader_rng.manual_seed(cfg.trainer.seed * 100_003 + epoch)
            ddp_model.train()
            epoch_loss = torch.zeros(2, dtype=torch.float64)  # sum of losses, batches
            window = torch.zeros(2, dtype=torch.float64)
            for x, y in loader:
                x, y = x.to(comm.device, non_blocking=True), y.to(comm.device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp_model(x), y)
                loss.backward()
                optimizer.step()
                progress.global_step += 1
                progress.batch_in_epoch += 1
                progress.sample_in_epoch = min(sampler.total, progress.sample_in_epoch + sampler.samples_per_step)
                detached = loss.detach().double().cpu()
                epoch_loss += torch.stack([detached, torch.ones((), dtype=torch.float64)])
                window += torch.stack([detached, torch.ones((), dtype=torch.float64)])
                if first_step:
                    first_step = False
                    self.record.event(Event.FIRST_STEP, step=progress.global_step, seconds_since_launch=round(time.time() - self.started, 3))
                over_memory = None
                if progress.global_step % cfg.trainer.log_every_n_steps == 0:
                    # one all-reduce: the loss, and every rank's peak memory in its own slot
                    packed = torch.zeros(2 + ws * (2 if cuda else 1), dtype=torch.float64)
                    packed[:2] = window
                    packed[2 + comm.rank] = _peak_rss_mb()
                    if cuda:
                        packed[2 + ws + comm.rank] = torch.cuda.max_memory_allocated(comm.device) / 2**20
                    packed = comm.all_reduce_sum(packed.to(comm.device)).cpu()
                    loss_mean = float(packed[0] / packed[1])
                    rss = [round(v, 1) for v in packed[2 : 2 + ws].tolist()]
                    extra = {"cuda_mb_per_rank": [round(v, 1) for v in packed[2 + ws :].tolist()]} if cuda else {}
                    self.metrics(step=progress.global_step, epoch=epoch, loss=round(loss_mean, 6),
                                 lr=optimizer.param_groups[0]["lr"], wall=round(time.time() - self.started, 3),
                                 restart=restarts, rss_mb=_peak_rss_mb(), rss_mb_per_rank=rss, rss_mb_max=max(rss), **extra)
                    window.zero_()
                    display.update(progress.global_step, epoch, loss_mean)
                    if max_rss and max(rss) > max_rss:  # every rank sees the same numbers: the same decision
                        over_memory = (rss.index(max(rss)), max(rss))
                else:
                    display.update(progress.global_step, epoch)
                self.beat(progress.global_step)
                faults.after_step(progress.global_step)
                due = bool(ck.every_n_steps and progress.global_step % ck.every_n_steps == 0)
                time_check = bool(ck.every_n_seconds and progress.global_step % CONTROL_EVERY == 0)
                if time_check or progress.global_step % stop_every == 0:
                    signum, time_due = agree(time_check)
                    due |= time_due
                    if signum is not None:
                        preempt(signum)
                if over_memory is not None:
                    rank, mb = over_memory
                    stop("memory_limit", None,
                         f"peak resident memory of rank {rank} reached {mb:.0f} MB > trainer.max_rss_mb={max_rss:g} at step "
                         f"{progress.global_step}; checkpoint step {progress.global_step} committed. Lower the memory use "
                         "(data.batch_size, the model) or raise trainer.max_rss_mb, then run the same command again to continue",
                         1)
                if due:
                    save()
            totals = comm.all_reduce_sum(epoch_loss.to(comm.device)).cpu()
            scheduler.step()
            progress.epoch, progress.batch_in_epoch, progress.sample_in_epoch = epoch + 1, 0, 0
            if totals[1] > 0:
                progress.train_loss = float(totals[0] / totals[1])
            progress.val_loss, progress.val_accuracy = self._validate(model, data.val)
            if progress.best_val_loss is None or progress.val_loss < progress.best_val_loss:
                progress.best_val_loss = progress.val_loss
            self.metrics(step=progress.global_step, epoch=epoch, train_loss=progress.train_loss,
                                val_loss=progress.val_loss, val_accuracy=progress.val_accuracy,
                                wall=round(time.time() - self.started, 3), restart=restarts, rss_mb=_peak_rss_mb())
            log.info("epoch %d/%d  step %d  train_loss %.4f  val_loss %.4f  val_acc %.3f", progress.epoch,
                     cfg.trainer.max_epochs, progress.global_step, progress.train_loss or float("nan"),
                     progress.val_loss, progress.val_accuracy)
            if ck.every_n_epochs and progress.epoch % ck.every_n_epochs == 0:
                save()
            display.restart_rate()  # validation and the save are not training speed
            if progress.epoch < cfg.trainer.max_epochs:  # a stop requested during validation or a save: act now
                signum = agree_now()
                if signum is not None:
                    preempt(signum)
        drain()
        display.close()
        if ckpt.last_saved_step != progress.global_step:
            save()  # the end of the run is always committed, so running it again trains nothing
        ckpt.close()

        result = {
            "status": "completed",
            "epochs_completed": progress.epoch,
            "global_step": progress.global_step,
            "final_loss": progress.train_loss,
            "val_loss": progress.val_loss,
            "val_accuracy": progress.val_accuracy,
            "best_val_loss": progress.best_val_loss,
            "restarts": restarts,
            "resumed_from_step": resumed,
            "world_size": comm.world_size,
            "wall_seconds": round(time.time() - self.started, 3),
            "model_sha256": model_sha256(model),
            "run_dir": str(self.run_dir),
        }
        self.record.event(Event.TRAINING_COMPLETED, step=progress.global_step, model_sha256=result["model_sha256"], result=result)
        return result

    def _resume(self, ckpt: CheckpointManager, objects: Dict[str, Any], per_rank: Dict[str, Any]) -> Optional[int]:
        policy = self.cfg.resume
        if policy == Resume.never:
            if manifest.committed(ckpt.folder):
                raise CheckpointError(f"resume=never, but {ckpt.folder} already holds checkpoints; they are left untouched")
            return None
        elastic = self.cfg.trainer.on_world_size_change.value != "refuse"
        seed = self.cfg.trainer.seed

        def new_rank(step: int) -> None:  # a rank the checkpoint does not have: a stream of its own, reproducible
            seed_everything(seed + 1 + self.comm.rank + 1_000_003 * step)

        restored = ckpt.restore(objects, per_rank, self.cfg.run.allow_config_change, self.cfg.run.fresh_start_if_unusable,
                                new_rank=new_rank if elastic else None)
        if restored is None:
            if policy == Resume.must:
                raise CheckpointError(f"resume=must, but {ckpt.folder} holds no usable checkpoint")
            return None
        progress = objects["progress"]
        saved_ws = int(restored.manifest.get("world_size") or self.comm.world_size)
        if "sample_in_epoch" not in restored.manifest:  # a checkpoint from before positions were kept in samples
            progress.sample_in_epoch = progress.batch_in_epoch * self.cfg.data.batch_size * saved_ws
        if progress.first_world_size is None:
            progress.first_world_size = saved_ws
        self._saved_world_size = saved_ws
        self.record.event(Event.RESUMED, step=restored.step, path=str(restored.path), epoch=restored.manifest.get("epoch"),
                          batch_in_epoch=restored.manifest.get("batch_in_epoch"), sample_in_epoch=progress.sample_in_epoch,
                          saved_world_size=saved_ws, world_size=self.comm.world_size)
        log.info("Resumed from %s (epoch %s, batch %s)", restored.path, restored.manifest.get("epoch"),
                 restored.manifest.get("batch_in_epoch"))
        return restored.step

    def _adapt_to_world_size(self, progress: Progress, optimizer: Any, scheduler: Any, resumed: Optional[int]) -> int:
        """Each worker's batch size for this launch, and the learning rate, per trainer.on_world_size_change."""
        ws, policy, bs = self.comm.world_size, self.cfg.trainer.on_world_size_change.value, self.cfg.data.batch_size
        if progress.first_world_size is None:  # a fresh run: the job's full size, whoever came first
            progress.first_world_size = self.launch.reference_world_size
        first = progress.first_world_size
        if policy == "keep_global_batch":
            batch = -(-bs * first // ws)
        else:
            batch = bs
        scale = ws / first if policy == "scale_lr" else 1.0
        if scale != progress.lr_scale:
            factor = scale / progress.lr_scale
            for group in optimizer.param_groups:
                group["lr"] *= factor
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
            progress.lr_scale = scale
        saved = getattr(self, "_saved_world_size", ws)
        if resumed is not None and saved != ws:
            log.warning("Resuming with %d worker(s) where the checkpoint had %d (trainer.on_world_size_change=%s): "
                        "%d samples per worker per step (global batch %d), learning rate x%g; the epoch continues at "
                        "sample %d", ws, saved, policy, batch, batch * ws, progress.lr_scale, progress.sample_in_epoch)
            self.record.event(Event.WORLD_SIZE_CHANGED, step=resumed, saved_world_size=saved, world_size=ws, policy=policy,
                              batch_per_worker=batch, global_batch=batch * ws, lr_scale=progress.lr_scale,
                              sample_in_epoch=progress.sample_in_epoch)
        return batch

    def _validate(self, model: nn.Module, dataset: Any) -> tuple[float, float]:
        """Loss and accuracy on the validation set, each rank evaluating its own shard."""
        model.eval()
        idx = list(range(self.comm.rank, len(dataset), self.comm.world_size))
        totals = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, len(idx), 256):
                self.beat(phase="validate")
                x, y = dataset[idx[start : start + 256]]
                x, y = x.to(self.comm.device), y.to(self.comm.device)
                out = model(x)
                totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                        (out.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        totals = self.comm.all_reduce_sum(totals.to(self.comm.device)).cpu()
        model.train()
        return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class _SaveHooks:
    """What the checkpoint writer calls while it writes: a heartbeat per file, and the save faults."""

    def __init__(self, faults: FaultInjector, trainer: Trainer) -> None:
        self.faults, self.trainer = faults, trainer

    def during_save(self, step: int, files_written: int) -> None:
        if threading.current_thread() is threading.main_thread():  # an asynchronous save's thread does not beat:
            self.trainer.beat(phase="save")  # if it hangs, training soon waits for it and stops beating
        self.faults.during_save(step, files_written)

    def after_commit(self, step: int, path: Path) -> None:
        self.faults.after_commit(step, path)
