"""The built-in trainer: one client of `steadfast.Run`, written as a user would write their loop.

Everything that makes a run safe (resume, cadence, preemption, heartbeat, records) comes from the
library; what is left here is the model, the data, the task, the optimizer and the loop.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig

from steadfast import Run
from steadfast.checkpoint.state import seed_everything

from . import config as schema
from .data import build_data
from .models import build_model
from .tasks import build_task, reduce_sums
from .world_size import WorldSizePolicy

log = logging.getLogger("pipeline")


@dataclass
class Scores:
    """What validation found so far (`val_loss` and the task's own `val_*`): checkpointed, so a
    resumed run reports the same as an uninterrupted one, even one resumed after its last epoch."""

    val: Dict[str, float] = field(default_factory=dict)
    best_val_loss: Optional[float] = None

    def update(self, found: Dict[str, float]) -> None:
        self.val = dict(found)
        loss = found.get("val_loss")
        if loss is not None and (self.best_val_loss is None or loss < self.best_val_loss):
            self.best_val_loss = loss

    def result(self) -> Dict[str, Any]:
        return {"val_loss": None, **self.val, "best_val_loss": self.best_val_loss}

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "val" not in state:  # a checkpoint written before the task was a choice: val_loss, val_accuracy
            state = {"val": {k: v for k, v in state.items() if k.startswith("val_") and v is not None}, **state}
        self.val = dict(state["val"] or {})
        self.best_val_loss = state.get("best_val_loss")


def build_optimizer(t: schema.TrainerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    name, params = t.optimizer.value, model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def build_scheduler(t: schema.TrainerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if t.scheduler.value == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t.max_epochs)
    if t.scheduler.value == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, t.max_epochs // 3), gamma=0.1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)


def validate(run: Run, model: torch.nn.Module, dataset: Any, task: Any) -> Dict[str, float]:
    """Each rank evaluates its own shard of the validation set; the sums are reduced over the ranks."""
    model.eval()
    idx = list(range(run.rank, len(dataset), run.world_size))
    largest = -(-len(dataset) // run.world_size)  # the largest rank's share
    batches = -(-largest // 256)
    totals: Dict[str, float] = {}
    with torch.no_grad():
        # as many batches on every rank (some may be empty): a sharded model's forward is collective
        for start in range(0, batches * 256, 256):
            run.beat("validate")
            x, y = dataset[idx[start : start + 256]]
            for key, value in task.sums(model(x.to(run.device)), y.to(run.device)).items():
                totals[key] = totals.get(key, 0.0) + value
    model.train()
    return reduce_sums(run, totals, [k for k in totals if k != "count"] or ["loss"])


def train(cfg: DictConfig) -> Dict[str, Any]:
    c = schema.typed(cfg)
    t = c.trainer
    with Run(
        cfg,
        seed=t.seed,
        log_every_n_steps=t.log_every_n_steps,
        stop_check_every_n_steps=t.stop_check_every_n_steps,
        max_rss_mb=t.max_rss_mb,
        num_threads=t.num_threads,
        elastic=t.on_world_size_change.value != "refuse",
        accumulate_grad_batches=t.accumulate_grad_batches,
    ) as run:
        seed_everything(t.seed)  # the same initial weights on every rank
        data = build_data(c.data)
        task = build_task(c.task)
        model = build_model(c.model, data.input_shape, data.output_size)
        ddp_model, optimizer = run.setup(model, build_optimizer(t, model))
        scheduler = build_scheduler(t, optimizer)
        seed_everything(t.seed + 1 + run.rank)  # each rank its own dropout stream
        scores, world = Scores(), WorldSizePolicy(t.on_world_size_change.value, c.data.batch_size)
        run.resume(model=model, optimizer=optimizer, scheduler=scheduler, scores=scores, world=world)
        loader = run.loader(data.train, world.batch_size(run, optimizer, scheduler), num_workers=c.data.num_workers)
        log.info(
            "Training %s on %d worker(s), %d batches per epoch per worker, epochs %d..%d%s",
            type(model).__name__,
            run.world_size,
            run.batches_per_epoch,
            run.epoch + 1,
            t.max_epochs,
            f" (resumed from step {run.resumed_from})" if run.resumed_from is not None else "",
        )
        for epoch in run.epochs(t.max_epochs):
            ddp_model.train()
            for x, y in loader:
                x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
                with run.accumulate(ddp_model):  # gradients reduced over the ranks on a step's last batch only
                    loss = task.loss(ddp_model(x), y)
                    (loss / t.accumulate_grad_batches if t.accumulate_grad_batches > 1 else loss).backward()
                if run.sync_gradients:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    run.step(loss)
            train_loss = run.epoch_loss()
            scheduler.step()
            found = validate(run, model, data.val, task)
            scores.update(found)
            run.log(train_loss=train_loss, **found, best_val_loss=scores.best_val_loss)
            log.info(
                "epoch %d/%d  step %d  train_loss %.4f  %s",
                epoch + 1,
                t.max_epochs,
                run.global_step,
                train_loss if train_loss is not None else float("nan"),
                "  ".join(f"{k} {v:.4f}" for k, v in found.items()),
            )
        return run.finish(**scores.result())
