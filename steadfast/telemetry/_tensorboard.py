"""logger.sinks has tensorboard: every metric of metrics.jsonl as TensorBoard scalars under
<run folder>/tensorboard (torch.utils.tensorboard, imported when the first row comes)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ._sink import Sink, scalars

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Optional[SummaryWriter] = None

    def write(self, row: Mapping[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder))
        step = row.get("step", 0)
        for key, value in scalars(row).items():
            if key in ("epoch", "wall"):
                continue
            section = "train" if key == "loss" else "epoch" if key.startswith(("train_", "val_")) else "system"
            self._writer.add_scalar(f"{section}/{key}", value, step)
        for key, value in row.items():
            if isinstance(value, list) and key.endswith("_per_rank"):
                for r, v in enumerate(value):
                    self._writer.add_scalar(f"system/{key[:-9]}/rank{r}", v, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
