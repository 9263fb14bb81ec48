"""`steadfast.Run`: every guarantee of the built-in trainer for a loop you write yourself.

    with sf.Run(cfg, seed=cfg.seed) as run:
        model, optimizer = run.setup(model, optimizer)        # DDP / hvd.DistributedOptimizer / as is
        loader = run.loader(dataset, batch_size=64)           # this rank's shard, resumable mid-epoch
        run.resume(model=model, optimizer=optimizer)          # the newest checkpoint that verifies
        for epoch in run.epochs(cfg.epochs):
            for x, y in loader:
                ...                                           # your step
                run.step(loss)                                # cadence, preemption, heartbeat, metrics

A loop of steps without epochs (a language model's) is `for step in run.steps(max_steps)`, its
batches from `run.random_batches(get_batch)` or `run.stream(loader)` (loop/streams.py).

On every step `run.step` beats the heartbeat the launcher's hang watchdog reads, adds the loss to
the metrics and to the anomaly watch (a non-finite loss or a spike sends every rank back to a
healthy state: the `anomaly` group, steadfast/health/), saves when the `checkpoint` group's cadence
says so, and takes part in the ranks' agreement on stop requests: after SIGTERM/SIGINT every rank stops at the same step, that step is
committed, and the run ends with exit code 75 ("run the same command again"). Leaving the `with`
block (or `run.finish()`) commits the last step and records the run's result in summary.json,
with the final weights' sha256.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, Mapping, Optional, Union, cast

import torch
from omegaconf import DictConfig, OmegaConf

from . import distributed as comms
from .checkpoint.memory import announce_off, open_memory
from .checkpoint.shared_folder import check_shared_run_dir
from .checkpoint.state import Progress, model_sha256, seed_everything, unwrap
from .checkpoint.storage.base import location as checkpoint_location
from .checkpoint.tracked import Checkpointer
from .config import settings_from
from .contract import events
from .contract.env import LaunchEnv
from .contract.events import Event
from .contract.heartbeat import DONE_PHASE, heartbeat
from .distributed import library_mode, parallel
from .distributed.exchange import Exchange
from .faults import FaultInjector
from .health.loop import RunHealth
from .loop.agreement import StopAgreement
from .loop.boundary import StepBoundary
from .loop.cadence import Cadence, history
from .loop.data import ResumableSampler, RunData
from .loop.memory_cadence import MemoryCadence
from .loop.shape import LoopShape
from .loop.stop import Stops
from .telemetry.logs import setup_logging
from .telemetry.metrics import Loss, Telemetry
from .telemetry.records import RunRecord
from .telemetry.sinks import open_sinks

log = logging.getLogger("steadfast")

MODEL_FILE = "model.safetensors"  # the final weights, in the run folder
_AS_IS = contextlib.nullcontext()  # run.accumulate on a batch that completes a step (reusable: nothing to enter)


def _never() -> bool:
    return False


class Run:
    """One rank's view of the run. Construct it once per task call, on every rank."""

    def __init__(
        self,
        cfg: Union[DictConfig, Mapping[str, Any], None] = None,
        *,
        seed: int = 0,
        log_every_n_steps: int = 10,
        stop_check_every_n_steps: Optional[int] = None,
        max_rss_mb: Optional[float] = None,
        num_threads: Optional[int] = None,
        elastic: bool = True,
        accumulate_grad_batches: int = 1,
    ) -> None:
        if (
            isinstance(accumulate_grad_batches, bool)
            or not isinstance(accumulate_grad_batches, int)
            or accumulate_grad_batches < 1
        ):
            raise ValueError(f"accumulate_grad_batches={accumulate_grad_batches!r}: a number of batches per optimizer step >= 1")
        self.accumulate_grad_batches = accumulate_grad_batches
        self.launch = LaunchEnv.current()
        resolved: Dict[str, Any] = (
            cast(Dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
            if isinstance(cfg, DictConfig)
            else dict(cfg or {})
        )
        self.settings = settings_from(resolved)
        self.seed, self.elastic, self.max_rss_mb = seed, elastic, max_rss_mb
        self.dir: Path = self.launch.run_dir
        self._heartbeat = heartbeat()  # None when not started by the launcher's workers
        self._beat("init")
        self.comm = comms.init(self.launch.collective, self.launch.collective_timeout_s)
        # library mode (a platform started the workers): rank 0's launch on every rank, this node's snapshot folder
        self.launch = library_mode.agree(self.launch, self.comm, self.settings.snapshot.every_n_steps != 0)
        self.started = self.launch.launch_time or time.time()
        self.restarts = self.launch.restart_count
        threads = num_threads or max(1, len(os.sched_getaffinity(0)) // self.comm.local_world_size)
        torch.set_num_threads(threads)
        check_shared_run_dir(self.dir, self.comm)
        self.record = RunRecord(self.dir, self.comm.rank)
        self._log_handler = setup_logging(self.dir, self.comm.rank)
        self.progress = Progress()
        lg = self.settings.logger
        self.exchange = Exchange(self.comm, stop_check_every_n_steps)  # the control plane's periodic message
        self.faults = FaultInjector(
            self.settings.fault,
            self.comm.rank,
            self.dir,
            lambda kind, **f: events.append(self.dir, kind, restart=self.restarts, **f),
        )
        self.telemetry = Telemetry(
            self.comm,
            self.record,
            lg.progress.value,
            lg.progress_every_s,
            log_every_n_steps,
            self.started,
            self.restarts,
            open_sinks(lg, self.dir, resolved, self.comm.rank, self.restarts, self.comm.world_size),
            max_rss_mb,
            lg.straggler_margin,
            lg.straggler_windows,
            on_boundary=(lambda: self.faults.before_work(self.progress.global_step + 1)) if self.faults.slows else None,
            exchange=self.exchange,
        )
        ck = self.settings.checkpoint
        folder = checkpoint_location(ck.dir, self.dir)
        every = self.settings.snapshot.every_n_steps
        # with the anomaly guard two more copies: the newest known healthy, the newest whose health is being agreed
        memory, why = open_memory(
            every, self.launch.snapshot, self.rank, self.local_rank, self.world_size, 4 if self.settings.anomaly.on else 2
        )
        if why:
            announce_off(self.record.event, why)
        self.checkpointer = Checkpointer(
            folder, self.comm, self.settings, resolved, self.record, self.launch, self.faults, self._beat, memory
        )
        self.checkpointer.per_rank["telemetry"] = self.telemetry
        run_seconds, failures, save_cost = (
            history(self.dir) if ck.every_n_seconds == "auto" and self.comm.rank == 0 else (0.0, 0, None)
        )
        self.cadence = Cadence(
            ck.every_n_epochs,
            ck.every_n_steps,
            ck.every_n_seconds,
            run_seconds,
            failures,
            on_interval=lambda **f: self.record.event(Event.CHECKPOINT_INTERVAL, **f),
            save_cost=save_cost,
        )
        tracked = (self.checkpointer.objects, self.checkpointer.per_rank)
        self.agreement = StopAgreement(self.exchange)
        self.boundary = StepBoundary(
            self.telemetry,
            self.agreement,
            self.cadence,
            self.faults,
            self.checkpointer,
            MemoryCadence(memory, every, self.exchange, self.record.event, tracked, self.faults.during_snapshot)
            if memory
            else None,
            self._heartbeat,
            self.cadence.time_due if self.comm.rank == 0 else _never,  # rank 0's clock decides
        )
        self.boundary.before_window = self._window_lr
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.resumed_from: Optional[int] = None
        self.saved_world_size: Optional[int] = None
        # what the app adds to the world_size_changed event of a resume on another world size (its policy)
        self.world_size_notes: Dict[str, Any] = {}
        self.train_loss: Optional[float] = None  # the mean loss of the last completed epoch
        self.latest: Dict[str, Any] = {}  # the last value of every metric given to run.log
        self.data = RunData(self.world_size, self.rank, seed, self.progress, accumulate_grad_batches)
        self.shape = LoopShape(  # epochs or steps; a loop begun after a resume on another world size records it
            self.progress,
            self.data,
            self.telemetry,
            self.boundary,
            self.cadence,
            lambda: self.data.world_size_changed(
                self.record.event, self.resumed_from, self.saved_world_size, self.world_size_notes
            ),
        )
        self.stops = Stops(  # a stop on purpose: every rank at the same step, committed, recorded
            self.progress,
            self.agreement,
            self.checkpointer,
            self.telemetry,
            self.record,
            self.shape,
            self.save,
            self.result,
            self._close,
        )
        self._first_step = True
        self._finished = False
        self._result: Dict[str, Any] = {}
        self._epoch_loss_of = (-1, 0)  # the epoch (and the data's generation: a rollback's) whose mean loss train_loss holds
        self.health = RunHealth(self, self.stops.stop)  # the anomaly guard (steadfast/health/): watch, agreement, rollbacks
        self.record.event(Event.ATTEMPT_STARTED, world_size=self.comm.world_size, device=str(self.comm.device))

    # ---- who and where ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return self.comm.local_rank

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def is_main(self) -> bool:
        return self.comm.rank == 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches per epoch on each rank, of the run's (first) loader or sampler (0 before there is one)."""
        return self.data.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    # ---- the loop's parts -----------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        """The model on this rank's device and spread over the ranks as `parallel` says: wrapped for
        data parallelism (ddp: DDP on torchrun, Horovod's DistributedOptimizer), sharded (fsdp:
        FSDP2's fully_shard, the optimizer pointed at the sharded parameters), or as it is (none).
        Call it before `resume` (Horovod's wrapper is a new optimizer)."""
        if self.resumed_from is not None or self.checkpointer.objects:
            raise RuntimeError("call run.setup(model, optimizer) before run.resume(...)")
        model = model.to(self.device)
        self.model = model
        wrapped, optimizer = parallel.setup(model, optimizer, self.settings.parallel, self.comm, self.accumulate_grad_batches)
        # the wrapper's forward is timed apart only when it begins with a collective of its own (DDP broadcasting
        # buffers): else the model's hooks see the same times, and the wrapper stays on torch's fast path (~6 us)
        outer = wrapped if any(True for _ in model.buffers()) else model
        self.telemetry.timer.watch(outer, model, forward_is_local=self.settings.parallel.kind.value != "fsdp")
        if self.faults.wants_backward_hook:  # fault=hang_in_backward: in the middle of the backward pass
            next(model.parameters()).register_hook(lambda grad: self.faults.in_backward(self.progress.global_step + 1))  # type: ignore[no-untyped-call]
        self.health.watch_model(model, optimizer)  # the faults it rehearses, the learning rate after a rollback
        if optimizer is None:
            return wrapped
        self.optimizer = optimizer
        return wrapped, optimizer

    def sampler(self, dataset: Any, batch_size: int, shuffle: bool = True) -> ResumableSampler:
        """This rank's share of one permutation per epoch, starting where the run stands (for your own DataLoader)."""
        return self.data.sampler(dataset, batch_size, shuffle)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, **kwargs: Any) -> Any:
        """A loader over this rank's share of `dataset`, resumable at any batch (kwargs: DataLoader's).
        The run's first loader is its training data: the batches it hands out are the position a
        checkpoint records (with gradient accumulation, several per step)."""
        return self.data.loader(dataset, batch_size, shuffle, **kwargs)

    def resume(self, **objects: Any) -> Optional[int]:
        """Track these objects (anything with state_dict/load_state_dict) in every checkpoint, and load
        them, with the loop's progress and every rank's RNG states, from the newest checkpoint that
        verifies. Returns the step resumed from, or None for a fresh start. Collective."""
        self.checkpointer.track(self.progress, objects)
        if self.model is None:  # a loop that wraps its own model: the result's sha256 is of the tracked one
            self.model = next((unwrap(o) for o in objects.values() if isinstance(unwrap(o), torch.nn.Module)), None)
        self._beat("restore")

        def new_rank(step: int) -> None:  # a rank the checkpoint does not have: a stream of its own, reproducible
            seed_everything(self.seed + 1 + self.rank + 1_000_003 * step)

        restored = self.checkpointer.restore(new_rank if self.elastic else None)
        self.data.sources.resumed = True
        if self.model is not None and self.optimizer is not None:
            self.comm.broadcast_state(self.model, self.optimizer)
        self.health.start()  # what is known healthy: a committed checkpoint is; a snapshot once the ranks say so
        if restored is None:
            self.progress.first_world_size = self.launch.reference_world_size
            self._beat("train")
            return None
        self.resumed_from = restored.step
        self.saved_world_size = int(restored.manifest.get("world_size") or self.world_size)
        if self.progress.first_world_size is None:
            self.progress.first_world_size = self.saved_world_size
        self.record.event(
            Event.RESUMED,
            step=restored.step,
            path=str(restored.path),
            epoch=self.progress.epoch,
            batch_in_epoch=self.progress.batch_in_epoch,
            sample_in_epoch=self.progress.sample_in_epoch,
            saved_world_size=self.saved_world_size,
            world_size=self.world_size,
            source=self.checkpointer.source,
        )
        memory = "the snapshot in memory of step %d in " % restored.step if self.checkpointer.source == "memory" else ""
        self.shape.resumed = f"Resumed from {memory}{restored.path}"  # said in the loop's terms once it begins
        self._beat("train", force=True)
        return restored.step

    def epochs(self, max_epochs: int) -> Iterator[int]:
        """The epochs left, from where the run stands; each one's end may save (epoch cadence) and
        acts on a stop request that came during validation or a save. After a resume from a
        checkpoint taken at an epoch's last step, that epoch comes once more with no batches left:
        code after the batch loop must cope (run.epoch_loss() is then None)."""
        return self.shape.epochs(max_epochs, self._end_epoch)

    def steps(self, max_steps: int) -> Iterator[int]:
        """A loop of optimizer steps without epochs: the steps left, from where the run stands, each
        given as the number of steps done before it (0, 1, ...: nanoGPT's iter_num). Call run.step()
        once in each. Progress, messages, the report and summary.json count in steps."""
        return self.shape.steps(max_steps)

    def random_batches(self, fn: Callable[..., Any], *args: Any, per_step: Optional[int] = None, **kwargs: Any) -> Any:
        """This rank's stream of random batches for a step loop: `next(batches)` is
        `fn(*args, generator=g, **kwargs)`, g a torch.Generator seeded from (seed, this source, rank,
        the batch's number). A checkpoint records the batches the steps took (`per_step` a step:
        accumulate_grad_batches unless given), not those drawn, so a batch fetched ahead of the step
        is drawn again, the same, after a resume. Draw from it after run.resume."""
        return self.data.sources.random(fn, args, kwargs, per_step)

    def stream(self, iterable: Iterable[Any], per_step: Optional[int] = None) -> Any:
        """The batches of `iterable` (a DataLoader over an IterableDataset, any re-iterable) for a step
        loop, pass after pass, as one stream (`next(batches)`); positioned as run.random_batches is.
        A resume skips to its position (whole passes by len(), then read and drop): exact when a pass's
        order depends only on its number (a DataLoader's generators are seeded per pass, set_epoch(pass) is called)."""
        return self.data.sources.iterable(iterable, per_step)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """For a loader that is not the run's: its epoch set (DistributedSampler.set_epoch) and, after a
        resume in the middle of an epoch, the batches this epoch already trained skipped (read and
        dropped: exact when the loader's order depends only on the epoch)."""
        return self.data.skipping(loader)

    @property
    def sync_gradients(self) -> bool:
        """Whether the batch just handed out completes an optimizer step (accumulate_grad_batches of
        them, or the epoch's last): then step the optimizer and call run.step()."""
        return self.data.sync_gradients

    def accumulate(self, model: torch.nn.Module) -> ContextManager[None]:
        """Around a micro-batch's forward and backward: on the batches that do not complete an
        optimizer step, gradients only accumulate on each rank (DDP's no_sync, FSDP's
        set_requires_gradient_sync(False)); on the one that does, they are reduced as usual. With
        the run's loader the batches are those it handed out; without one (run.steps), each entry
        is a batch, and the accumulate_grad_batches-th since the last run.step completes the step."""
        data = self.data
        completes = data.entering_micro_batch() if data.counts_micro_batches else data.sync_gradients
        return _AS_IS if completes else parallel.no_sync(model)

    def step(self, loss: Loss = None, grad_norm: Loss = None) -> None:
        """After the optimizer step: count it, and do what is due at this step boundary. `loss` (as it
        is: nothing is read from a GPU per step) goes to the metrics and, with `grad_norm` (say
        clip_grad_norm_'s), to the anomaly watch; an anomaly agreed at this step sends the run back."""
        p = self.progress
        p.global_step += 1
        self.data.stepped()
        if self.boundary.quiet(p.global_step, p.epoch, loss, grad_norm):  # most steps: nothing is due but counting
            return
        if self._first_step:
            self._first_step = False
            self.shape.announce(f"step {self.resumed_from}")  # a loop that began neither run.epochs nor run.steps
            self.record.event(Event.FIRST_STEP, step=p.global_step, seconds_since_launch=round(time.time() - self.started, 3))
        due = self.boundary.due(p.global_step, p.epoch, loss, grad_norm)
        if due.stop is not None:
            self.stops.preempt(due.stop)
        if due.over_memory is not None:
            rank, mb = due.over_memory
            self.stops.stop(
                "memory_limit",
                None,
                1,
                f"peak resident memory of rank {rank} reached {mb:.0f} MB > trainer.max_rss_mb={self.max_rss_mb:g} at step "
                f"{p.global_step}; checkpoint step {p.global_step} committed. Lower the memory use (the batch size, "
                "the model) or raise the limit, then run the same command again to continue",
                rss_mb=mb,
                rank=rank,
            )
        if due.save:
            self.save()
        self.boundary.after(p.global_step)

    def save(self) -> None:
        """Commit the tracked state at this step now (collective: every rank calls it at the same step).
        Only a state known healthy: the ranks' health to this step is agreed first (steadfast/health/)."""
        self._beat("save", force=True)
        seconds = self.checkpointer.save(self.progress)
        self.cadence.saved(seconds)
        self._beat("train", force=True)
        self.telemetry.display.restart_rate()

    def log(self, **metrics: Any) -> None:
        """A row of metrics.jsonl (rank 0 writes what it is given: reduce first, e.g. with run.mean)."""
        self.latest.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.checkpointer.logged(metrics, self.progress.global_step)  # checkpoint.monitor's value, for the next save
        self.telemetry.metrics(
            **self.shape.row(),
            **metrics,
            wall=round(time.time() - self.started, 3),
            restart=self.restarts,
        )

    def epoch_loss(self) -> Optional[float]:
        """The mean training loss of this epoch over every rank and batch, after its last step
        (collective; the epoch's end reuses it)."""
        if self._epoch_loss_of != (self.progress.epoch, self.data.position.generation):
            self.train_loss, self._epoch_loss_of = (
                self.telemetry.end_epoch(),
                (self.progress.epoch, self.data.position.generation),
            )
        return self.train_loss

    def mean(self, value: Any) -> float:
        """The mean of a number over the ranks (collective, on the control plane: steadfast/distributed/comm.py)."""
        t = self.comm.start_sum(torch.tensor([float(value), 1.0], dtype=torch.float64)).wait()
        return float(t[0] / t[1])

    def beat(self, phase: str = "train") -> None:
        """Tell the hang watchdog this rank is making progress (inside a long validation, say)."""
        self._beat(phase, force=True)

    def finish(self, **result: Any) -> Dict[str, Any]:
        """Commit the last step (so running the same command again trains nothing), then record the
        run's result (summary.json: these fields, the loop's position, the final weights' sha256)."""
        if self._finished:
            return {**self._result, **result}
        self.stops.commit_last()
        out = self.result(status="completed", **result)
        if self.model is not None:  # the final weights, for any safetensors reader (a sharded model gathered a tensor at a time)
            from .checkpoint.export import export_model

            export_model(unwrap(self.model).state_dict(), self.dir / MODEL_FILE, writes=self.rank == 0)
            out["model_file"] = MODEL_FILE
        self.record.flush()  # every row in metrics.jsonl and the sinks before the run says it completed
        self.telemetry.sinks.completed(out, self.dir / MODEL_FILE if "model_file" in out else None)
        self.record.event(
            Event.TRAINING_COMPLETED, step=self.progress.global_step, model_sha256=out.get("model_sha256"), result=out
        )
        self._finished, self._result = True, out
        self._close()
        return out

    def result(self, **extra: Any) -> Dict[str, Any]:
        """What summary.json reports. `final_loss` is the mean training loss of the last epoch these
        workers completed, over every rank and batch of it (run.epoch_loss(); its sums survive a
        restore, so a resumed epoch counts each batch once), not the last batch's loss; if they
        completed none, the mean of the last window they logged (log_every_n_steps steps, every
        rank); None if neither (docs/own-loop.md#what-final_loss-in-summaryjson-is)."""
        p = self.progress
        out: Dict[str, Any] = {
            **self.shape.position(),
            "global_step": p.global_step,
            "final_loss": self.train_loss if self.train_loss is not None else self.telemetry.last_loss,
            **self.latest,
            "restarts": self.restarts,
            **self.health.result(),
            "resumed_from_step": self.resumed_from,
            "world_size": self.world_size,
            "wall_seconds": round(time.time() - self.started, 3),
            "run_dir": str(self.dir),
            **self.checkpointer.best(),
        }
        if self.model is not None:
            out["model_sha256"] = model_sha256(unwrap(self.model))
        out.update(extra)
        return out

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self.finish()
            return
        try:
            self._close()
        except Exception as failed:  # the loop's own error is the one that leaves; closing's is logged
            log.error("steadfast: ending the run after %s failed too: %s: %s", kind.__name__, type(failed).__name__, failed)

    # ---- inside -----------------------------------------------------------------------------------
    def _beat(self, phase: str, force: bool = False) -> None:
        """Progress for the watchdog, written now (one small pwrite): it knows the exact step and phase.
        A training step only counts (steadfast/loop/boundary.py, contract/heartbeat.py)."""
        if self._heartbeat is not None:
            self._heartbeat.beat(self.progress.global_step if hasattr(self, "progress") else -1, phase)

    def _window_lr(self) -> None:
        """A metrics window closes at this step: the learning rate it logs."""
        if self.optimizer is not None:
            self.telemetry.lr = self.optimizer.param_groups[0]["lr"]

    def _end_epoch(self, max_epochs: int) -> None:
        p = self.progress
        self.epoch_loss()
        if self.health.rolled_back_at_epoch_end():
            return  # the epoch (or the one it went back to) comes again from the healthy state restored
        self.data.end_epoch()
        if self.cadence.epoch_due(p.epoch):
            self.save()
        self.telemetry.display.restart_rate()  # validation and the save are not training speed
        if p.epoch < max_epochs:  # a stop requested during validation or a save: act now
            signum = self.agreement.now(p.global_step)
            if signum is not None:
                self.stops.preempt(signum)

    def _close(self) -> None:
        """The run's ends, in this order, each one whatever an earlier one raised (what failed is raised after
        them all)."""
        with contextlib.ExitStack() as ends:
            ends.callback(self.comm.shutdown)
            ends.callback(self._remove_log_handler)
            ends.callback(self.record.close)
            # the sinks too: after the last rows and the result (MLflow's uploads wait here)
            ends.callback(self.telemetry.close, sinks=True)
            ends.callback(self._beat, DONE_PHASE, force=True)  # finished (or failed): the hang watchdog stops watching

    def _remove_log_handler(self) -> None:
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None  # type: ignore[assignment]
