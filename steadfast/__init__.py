"""steadfast: fault-tolerant distributed PyTorch training.

    import steadfast as sf

    with sf.Run(cfg) as run:              # in a Hydra task run by the steadfast launcher
        ...

The names below are imported on first use, so `import steadfast` (and its `contract`, which the
launcher imports at Hydra's start-up) never imports torch.

  run              Run: the API a loop uses (docs/own-loop.md)
  contract         what the launch side and the workers promise each other (no torch, nothing of ours)
  checkpoint       durable state: the commit protocol, the format, the resume; what a run's loop tracks
  loop             the step boundary and what is due at it (cadences, the stop agreement, resumable data)
  distributed      the collectives and the control plane (init(), Comm, Exchange, DDP and FSDP2)
  telemetry        what a person sees: metrics, stragglers, the progress display, logs
  faults           rehearsed failures (`fault=...`)
  config, conf     the library's config schemas (cheap: no torch) and its config groups (pkg://steadfast.conf)
  preflight        the library's checks, run by the launcher before any worker starts
  app_keys         an app's own keys checked before any worker starts (its optional schema, `+KEY`)
  help             `--help`'s config groups: every group's real options for any app
  report           `python -m pipeline.report`: what happened in a run, from its records
  verify_recovery  `steadfast-verify`: an app killed and resumed against the same app uninterrupted
  ray_train        the app's own command as Ray Train's train_loop_per_worker (docs/ray.md; imports no Ray)
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
