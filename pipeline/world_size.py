"""trainer.on_world_size_change: what a resume with another number of workers does to the batch
size and the learning rate (the data position is kept in samples by the library either way)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:  # pragma: no cover
    from steadfast import Run

log = logging.getLogger("pipeline")


class WorldSizePolicy:
    """keep_global_batch: each worker's batch becomes data.batch_size x reference / workers (rounded up);
    scale_lr: each worker keeps data.batch_size and the learning rate scales with workers / reference;
    refuse: a checkpoint of another world size is not resumed (steadfast.Run(elastic=False)).
    The reference world size is the run's first launch's (an elastic job's full size); the factor
    applied to the learning rate is checkpointed, so it is applied once."""

    def __init__(self, policy: str, batch_size: int) -> None:
        self.policy, self.per_worker = policy, batch_size
        self.lr_scale = 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"lr_scale": self.lr_scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.lr_scale = float(state.get("lr_scale", 1.0))

    def batch_size(self, run: Run, optimizer: Any, scheduler: Any) -> int:
        """Each worker's batch size for this launch; scales the learning rate under scale_lr."""
        ws, first = run.world_size, run.progress.first_world_size or run.world_size
        batch = -(-self.per_worker * first // ws) if self.policy == "keep_global_batch" else self.per_worker
        scale = ws / first if self.policy == "scale_lr" else 1.0
        if scale != self.lr_scale:
            factor = scale / self.lr_scale
            for group in optimizer.param_groups:
                group["lr"] *= factor
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
            self.lr_scale = scale
        saved = run.saved_world_size
        if run.resumed_from is not None and saved is not None and saved != ws:
            log.warning(
                "trainer.on_world_size_change=%s: %d samples per worker per step (global batch %d), learning rate x%g",
                self.policy,
                batch,
                batch * ws,
                self.lr_scale,
            )
            run.world_size_notes.update(policy=self.policy, lr_scale=self.lr_scale)
        return batch
