"""The ranks' collectives and the library's control plane.

init()      the Comm for the collective library the launcher started us with (here: it picks the
            implementation, so the base module never imports Horovod's)
comm        Comm, the collective interface (Pending, TorchDistComm, pick_device, await_store);
            _horovod: HorovodComm, imported only when that backend runs
exchange    Exchange, the control plane's one periodic message (stop flags, metrics windows,
            snapshot timings ride it)
parallel    how run.setup(model, optimizer) spreads the model over the ranks (DDP, FSDP2)
group_store   a fresh namespace per incarnation of the group in torch elastic's shared store (a plain
              torchrun)
library_mode  when a platform started the workers (docs/platforms.md): rank 0's launch on every rank,
              and the node's snapshot folder
"""

from __future__ import annotations

from ..contract import env
from .comm import Comm, TorchDistComm


def init(collective: str = env.NONE, timeout_s: float = 600.0) -> Comm:
    """The Comm for the collective library the launcher started us with (LaunchEnv.collective)."""
    if collective == env.TORCH:
        return TorchDistComm(timeout_s)
    if collective == env.HOROVOD:
        from ._horovod import HorovodComm

        return HorovodComm()
    return Comm()
