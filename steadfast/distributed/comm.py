"""The collective interface the trainer uses, one implementation per backend.

The trainer never asks which backend it runs on; everything that differs between torch
distributed, Horovod and a single process lives behind `Comm`.

Two planes. The training plane is the model's: DDP's or FSDP's gradients, and `all_reduce_sum` of a
caller's tensor on its device. The control plane is the library's own: the stop agreement, the
metrics windows, snapshot timing and every object and vote a checkpoint exchanges, all of them a
few numbers or a pickled object on the CPU. Under torchrun it is a Gloo process group of its own,
so it never queues behind (or in front of) the gradients on the training group or its CUDA stream,
and its results never make the host wait for the device. Horovod has no process groups: its
control messages are CPU tensors started without waiting (`allreduce_async`) and read at a later
step, negotiated by its background thread in the same cycles as the gradients.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from . import group_store


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Pending:
    """A collective in flight; `wait()` returns its result (once)."""

    def __init__(self, finish: Any) -> None:
        self._finish, self._result = finish, None

    def wait(self) -> Any:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


class Comm:
    """A single process: every collective is the identity."""

    rank = 0
    world_size = 1
    local_rank = 0
    local_world_size = 1

    def __init__(self) -> None:
        self.device = pick_device(0)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1) -> torch.optim.Optimizer:
        """The optimizer to train with (`accumulate`: backward passes per step, for one that reduces gradients itself)."""
        return optimizer

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make every rank start from rank 0's model and optimizer state."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a tensor of the caller's, on its device (the training plane)."""
        return tensor

    def max_each(self, values: Sequence[float]) -> List[float]:
        """Element-wise maximum over the ranks, on every rank: the control agreement (stop
        requests, time-based saves). A few floats on the CPU, so it never waits for a GPU."""
        maxima: List[float] = self.start_max_each(values).wait()
        return maxima

    def start_max_each(self, values: Sequence[float]) -> "Pending":
        """`max_each` without waiting: the result is read later with `.wait()`, so the collective
        overlaps the next step instead of adding its latency to this one. Every rank must start
        and wait in the same order, like any collective."""
        return Pending(lambda: [float(v) for v in values])

    def start_sum(self, tensor: torch.Tensor) -> "Pending":
        """The sum over the ranks of a CPU tensor, on the control plane, without waiting: `.wait()`
        returns the summed tensor. Like start_max_each, every rank must start and wait in the same order."""
        return Pending(lambda: tensor)

    def gather_object(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's object, in rank order, on rank 0 (None elsewhere)."""
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's object, on every rank."""
        return obj

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class TorchDistComm(Comm):
    """torch.distributed: Gloo on CPU, NCCL when CUDA is available; DDP for gradients."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.device = pick_device(self.local_rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kwargs: Dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device  # eager NCCL init, bound to this rank's GPU
        # A platform that initialises the group itself (Ray Train's workers): the process's one default
        # group is used as it is; a second one would meet on the same address and port.
        self.owns_group = not dist.is_initialized()
        if not self.owns_group:
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise RuntimeError(
                    f"steadfast: this process's process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but RANK={self.rank} and WORLD_SIZE={self.world_size}: initialise it with torch's variables, or not at all"
                )
        else:
            store = group_store.fresh_store(self.rank, self.world_size, timeout_s)
            if store is not None:  # torch elastic's shared store (a plain torchrun): this incarnation's own namespace
                kwargs.update(store=store, rank=self.rank, world_size=self.world_size)
            elif self.rank != 0:
                await_store(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), timeout_s)
            dist.init_process_group(**kwargs)
        # the control plane (module doc): its own Gloo group, even when training runs on Gloo too
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass  # every rank loads the same checkpoint, and DDP broadcasts rank 0's parameters

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM)
        return tensor

    def start_max_each(self, values: Sequence[float]) -> Pending:
        t = torch.tensor(values, dtype=torch.float64)
        work = self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.control, async_op=True)

        def finish() -> List[float]:
            work.wait()
            return t.tolist()

        return Pending(finish)

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        work = self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM, group=self.control, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            return tensor

        return Pending(finish)

    def gather_object(self, obj: Any) -> Optional[List[Any]]:
        out: Optional[List[Any]] = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier(group=self.control)

    def shutdown(self) -> None:
        """Destroy the process group, keeping a reference to it until this process ends.

        DDP's reducer holds the group too, and when the model goes (the task's frame ends) the
        reducer's binding destroys the group with the GIL held. Gloo's destructor joins its worker
        threads, and a worker thread that is just freeing a finished collective's tensors made in
        Python needs the GIL: a deadlock (torch releases the GIL for the group's own binding, not
        for the reducer's). Seen here as ranks that never exited after their task, and orphans that
        outlived a killed launcher (the orphan watch needs the GIL too). Kept referenced, the group
        is destroyed only when the interpreter ends, through the binding that releases the GIL (a
        worker forked from the forkserver ends with os._exit and never runs that destructor)."""
        if not self.dist.is_initialized():
            return
        if not self.owns_group:  # the platform's group is the platform's to destroy: only the control plane's goes
            _RETIRED.append(self.control)
            self.dist.destroy_process_group(self.control)
            return
        _RETIRED.extend(g for g in (self.dist.group.WORLD, self.control) if g is not None)
        self.dist.destroy_process_group()


def await_store(host: Optional[str], port: Optional[str], timeout_s: float) -> None:
    """Until rank 0's store accepts connections (or timeout_s, then init_process_group's own wait).
    A rank that asks before rank 0 listens is refused, and torch's client retries only after a
    backoff: 0.5-0.7 s lost at every start and restart of the group whenever rank 0 is the later one."""
    if not host or not port or not port.isdigit():
        return
    deadline, pause = time.monotonic() + timeout_s, 0.002
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


_RETIRED: List[Any] = []  # process groups destroyed by shutdown(), referenced until the process ends
