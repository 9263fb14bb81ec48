"""Horovod (over Gloo): the Comm behind `backend=horovod`. Imported only when that backend runs."""

from __future__ import annotations

import os
import time
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from .comm import Comm, Pending, pick_device

SPIN_S = 0.1  # how long a rank waiting for a collective keeps its core, yielding it between polls
POLL_S = 5e-5  # then: how often it asks Horovod whether the collective is done, asleep in between


class HorovodComm(Comm):
    """The model stays unwrapped; hvd.DistributedOptimizer averages the gradients."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.local_rank, self.local_world_size = hvd.local_rank(), hvd.local_size()
        self.device = pick_device(self.local_rank)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1) -> torch.optim.Optimizer:
        if hasattr(optimizer, "_allreduce_grad_async"):  # hvd.DistributedOptimizer already (an app with hvd idioms)
            wrapped = optimizer
        else:
            # groups=1: one grouped all-reduce of every gradient per step, negotiated once, instead of one
            # per tensor spread over Horovod's cycles (bench/horovod.py: ~15% fewer CPU-seconds per step)
            wrapped = self.hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), groups=1, backward_passes_per_step=accumulate
            )
        hvd_zero_grad = wrapped.zero_grad  # takes no arguments (it predates torch's set_to_none)

        def zero_grad(set_to_none: bool = True) -> None:
            if set_to_none:
                hvd_zero_grad()  # also refuses while gradients are still being reduced
            else:
                torch.optim.Optimizer.zero_grad(wrapped, set_to_none=False)

        wrapped.zero_grad = zero_grad  # type: ignore[method-assign]
        hvd_synchronize = wrapped.synchronize  # type: ignore[attr-defined]

        def synchronize() -> None:
            # the gradients' all-reduces, waited for by `_wait`; then Horovod's own bookkeeping
            self._wait([h for h, _ in wrapped._handles.values() if isinstance(h, int)])  # type: ignore[attr-defined]
            hvd_synchronize()

        wrapped.synchronize = synchronize  # type: ignore[attr-defined]
        return wrapped

    def _wait(self, handles: List[int]) -> None:
        """Until every handle's collective is done. A step's all-reduce is over within milliseconds:
        the waiting thread polls and yields its core in between, so that it runs the moment the
        collective ends. Asleep, it would be woken onto a core that another thread of the job holds,
        and wait there for its turn (bench/horovod.py, four runs of 4-8 rounds on 5 Dec, one with a core
        busy: 0.83-1.07x the hand-written script asleep, 1.06-1.20x yielding; Horovod's own `synchronize`
        sleeps 1 ms between polls). A longer wait (a slow peer, a hang) goes on asleep after SPIN_S: a
        rank waiting for a stuck peer does not burn a core."""
        poll, pending = self.hvd.poll, list(handles)
        spin_until: Optional[float] = None
        while True:
            pending = [h for h in pending if not poll(h)]
            if not pending:
                return
            now = time.monotonic()
            if spin_until is None:
                spin_until = now + SPIN_S
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(POLL_S)

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # A fresh optimizer is identical on every rank. Horovod would "initialise" its state with
        # a real step on zero gradients, which moves the weights under weight decay and advances
        # Adam's step count: the run would then differ from the same run on another backend.
        # Every rank restores the same checkpoint, so the state is empty on all ranks or on none.
        if optimizer.state_dict()["state"]:
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor = self.hvd.allreduce(tensor, op=self.hvd.Sum)
        return total

    def start_max_each(self, values: Sequence[float]) -> Pending:
        # Horovod runs a collective only at its next cycle (HOROVOD_CYCLE_TIME): waiting for it
        # at once would cost a cycle every step; started now, it rides with the next gradients.
        # a name of its own per call (the same sequence on every rank): two may be in flight at once
        self._controls = getattr(self, "_controls", 0) + 1
        handle = self.hvd.allreduce_async(
            torch.tensor(values, dtype=torch.float64), op=self.hvd.Max, name=f"steadfast.control.{self._controls}"
        )
        return Pending(lambda: self._result(handle).tolist())

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        self._sums = getattr(self, "_sums", 0) + 1
        handle = self.hvd.allreduce_async(tensor, op=self.hvd.Sum, name=f"steadfast.sum.{self._sums}")
        return Pending(lambda: self._result(handle))

    def _result(self, handle: int) -> Any:
        self._wait([handle])
        return self.hvd.synchronize(handle)

    def gather_object(self, obj: Any) -> Optional[List[Any]]:
        self._gathers = getattr(self, "_gathers", 0) + 1
        gathered = self.hvd.allgather_object(obj, name=f"steadfast.gather.{self._gathers}")  # Horovod has no gather to one rank
        return gathered if self.rank == 0 else None

    def broadcast_object(self, obj: Any) -> Any:
        # named by the call's place in the sequence: Horovod names it by the object's type otherwise,
        # which differs between rank 0 (the object) and the others (None), and the ranks never meet
        self._objects = getattr(self, "_objects", 0) + 1
        return self.hvd.broadcast_object(obj, root_rank=0, name=f"steadfast.object.{self._objects}")

    def barrier(self) -> None:
        self.hvd.barrier()

    def shutdown(self) -> None:
        if self.hvd.is_initialized():
            self.hvd.shutdown()
