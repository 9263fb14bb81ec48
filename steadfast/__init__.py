"""steadfast: fault-tolerant distributed PyTorch training.

    import steadfast as sf

    with sf.Run(cfg) as run:              # in a Hydra task run by the steadfast launcher
        ...

The names below are imported on first use, so `import steadfast` (and its `contract`, which the
launcher imports at Hydra's start-up) never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, List

__all__ = ["Run", "PerRank", "Progress", "ResumableSampler", "Stateful", "StopRun", "model_sha256"]

_WHERE = {
    "Run": ".run",
    "PerRank": ".checkpoint.state",
    "Progress": ".checkpoint.state",
    "Stateful": ".checkpoint.state",
    "ResumableSampler": ".loop.data",
    "StopRun": ".contract.stop",
    "model_sha256": ".checkpoint.state",
}

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint.state import PerRank, Progress, Stateful, model_sha256
    from .contract.stop import StopRun
    from .loop.data import ResumableSampler
    from .run import Run


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'steadfast' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted([*globals(), *__all__])
