"""The workers of bench.sharded: groups of 1-3 processes, each one rank of an FSDP2 model and its AdamW
optimizer, that save, load and measure what bench/sharded.py asks (its docstring says what and how).

Each worker is a process of its own, forked from a forkserver that imported torch, torch._dynamo,
FSDP2, torch.distributed.checkpoint and the library once (under torchrun those imports cost 10-30 s
per group on this loaded 2-core machine; no figure includes them), with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set as torchrun sets them, on Gloo, through steadfast.distributed.comm.TorchDistComm.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

MB = 1e6


# ---- the workers (one process per rank, forked by the forkserver of Groups) ----------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _trim() -> None:
    """Hand freed heap memory back to the system, so VmRSS is what is live."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def drop_caches(enabled: bool) -> bool:
    os.sync()
    if not enabled:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


class _Holder:
    """A plain state as a Stateful (the gathered save's objects)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class _Worker:
    """One rank of a group: an FSDP2 model and AdamW after one step, and the tasks it is given."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from steadfast.distributed.comm import TorchDistComm

        self.args = args
        self.comm = TorchDistComm(600)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.comm.local_world_size))
        self.scratch, self.drop, self.ref = Path(args.dir), bool(args.drop), Path(args.ref)
        self.model, self.optimizer = self.build()
        self.train_step()
        self.out: Dict[str, Any] = {"world_size": self.world, "tasks": []}
        self.count = 0

    # ---- the state
    def build(self) -> Tuple[Any, Any]:
        import torch
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(self.args.width, self.args.width) for _ in range(self.args.blocks)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(self) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.model(torch.randn(8, self.args.width, generator=g)).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def local(t: Any) -> Any:
        from steadfast.checkpoint.shards import is_dtensor

        return t.to_local() if is_dtensor(t) else t

    def fingerprint(self) -> List[float]:
        """Sums of the parameters and of each optimizer state kind, over every rank's pieces."""
        import torch
        import torch.distributed as dist

        sums = torch.zeros(3, dtype=torch.float64)
        for p in self.model.parameters():
            sums[0] += self.local(p).detach().double().sum()
        for s in self.optimizer.state.values():
            sums[1] += self.local(s["exp_avg"]).double().sum()
            sums[2] += self.local(s["exp_avg_sq"]).double().sum()
        dist.all_reduce(sums)
        return [float(x) for x in sums.tolist()]

    # ---- saving
    def manager(self, folder: Path) -> Any:
        from steadfast.checkpoint.manager import CheckpointManager

        return CheckpointManager(folder, self.comm, keep_last=1, training_config={}, on_event=lambda *a, **k: None)

    def sharded_save(self, folder: Path) -> None:
        m = self.manager(folder)
        m.save(1, {"model": self.model, "optimizer": self.optimizer}, {}, {"epoch": 0})
        m.close()  # waits for the background check (manifest read back, sizes)

    def gathered_save(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        whole_model = get_model_state_dict(self.model, options=options)
        whole_optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        m = self.manager(folder)
        m.save(1, {"model": _Holder(whole_model), "optimizer": _Holder(whole_optimizer)}, {}, {"epoch": 0})
        m.close()

    def raw_writer(self, size: int) -> Callable[[Path], None]:
        """A raw fsync'd write of this rank's pieces, padded to `size` bytes (its rank file's)."""
        import torch

        from steadfast.checkpoint.shards import is_dtensor

        pieces = [self.local(t) for t in self.model.state_dict().values() if is_dtensor(t)]
        for s in self.optimizer.state.values():
            pieces += [self.local(v) for v in s.values() if is_dtensor(v)]
        views = [memoryview(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for p in pieces]
        pad = bytes(max(0, size - sum(v.nbytes for v in views)))
        rank = self.rank

        def write(folder: Path) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"raw{rank}.bin", "wb", buffering=0) as f:
                for v in views:
                    f.write(v)
                if pad:
                    f.write(pad)
                os.fsync(f.fileno())

        return write

    # ---- timing
    def folder_for(self, label: str) -> Path:
        self.count += 1  # every rank counts alike, so the names agree
        return self.scratch / f"w{self.world}-{label}-{self.count}"

    def timed(self, fn: Callable[[], Any]) -> Dict[str, Any]:
        """fn on every rank at once; on rank 0 every rank's seconds and bytes read (rchar), {} elsewhere."""
        import torch.distributed as dist

        dist.barrier()
        io0, t0 = _rchar(), time.perf_counter()
        fn()
        seconds, read = time.perf_counter() - t0, _rchar() - io0
        every = self.comm.gather_object((seconds, read))
        if every is None:
            return {}
        return {"seconds": max(s for s, _ in every), "per_rank_s": [s for s, _ in every], "rchar": [r for _, r in every]}

    def between(self, folder: Optional[Path]) -> None:
        """Before a timed write or a cold read: the last write's files removed, dirty pages flushed, the cache dropped."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            drop_caches(self.drop)
        dist.barrier()

    # ---- the tasks
    def memory(self, method: str) -> None:
        """Rank 0's peak memory during one save (the first task of a group: only the step freed memory before)."""
        import torch.distributed as dist

        from steadfast.checkpoint import manifest as mf

        folder = self.folder_for(method)
        save = self.gathered_save if method == "gathered" else self.sharded_save
        self.between(None)
        _trim()
        dist.barrier()
        rss = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        reset = _status_kb("VmHWM")
        t = self.timed(lambda: save(folder))
        peak = _status_kb("VmHWM")
        mem = self.comm.gather_object({"rss_kb": rss, "hwm_after_reset_kb": reset, "hwm_kb": peak})
        if mem is not None:
            files = mf.read(mf.committed(folder)[0][1])["files"]
            self.out["tasks"].append(
                {
                    "task": "memory",
                    "method": method,
                    "seconds": t["seconds"],
                    "bytes": sum(f["bytes"] for f in files.values()),
                    "files": len(files),
                    "peak_above_rss_MB": [(m["hwm_kb"] - m["rss_kb"]) * 1024 / MB for m in mem],
                    "rss_before_MB": [m["rss_kb"] * 1024 / MB for m in mem],
                    "reset_ok": all(m["hwm_after_reset_kb"] <= m["rss_kb"] + 1024 for m in mem),
                }
            )
        self.between(folder)

    def save_ref(self) -> None:
        """The checkpoint every restore reads (saved once, by 2 workers) and its fingerprint."""
        self.sharded_save(self.ref)
        sums = self.fingerprint()
        if self.rank == 0:
            (self.ref / "fingerprint.json").write_text(json.dumps({"sums": sums, "world_size": self.world}))
        self.comm.barrier()

    def throughput(self, pairs: int) -> None:
        from steadfast.checkpoint import manifest as mf

        folder = self.folder_for("warm-up")
        self.sharded_save(folder)  # untimed: a process's first save (imports, first allocations); gives the file sizes
        sizes: Dict[int, int] = {}
        if self.rank == 0:
            files = mf.read(mf.committed(folder)[0][1])["files"]
            sizes = {int(name[4:9]): spec["bytes"] for name, spec in files.items()}  # rank00001.bin
        sizes = self.comm.broadcast_object(sizes)
        methods = [("sharded_save", self.sharded_save), ("raw_fsync_write", self.raw_writer(sizes[self.rank]))]
        samples: Dict[str, List[Any]] = {name: [] for name, _ in methods}
        previous = folder
        for i in range(pairs):
            for name, fn in methods if i % 2 == 0 else methods[::-1]:
                self.between(previous)  # every timed write starts right after the last one's files were removed
                previous = self.folder_for(name)
                t = self.timed(functools.partial(fn, previous))
                if t:
                    samples[name].append(t)
        self.between(previous)
        if self.rank == 0:
            self.out["tasks"].append({"task": "throughput", "rank_file_bytes": [sizes[r] for r in range(self.world)], **samples})

    def restore(self, count: int) -> None:
        expected = json.loads((self.ref / "fingerprint.json").read_text())["sums"]
        samples: Dict[str, List[Any]] = {"cold": [], "warm": []}
        checked: Optional[bool] = None
        for _ in range(count):
            for mode in ("cold", "warm") if self.drop else ("warm",):
                del self.model, self.optimizer
                _trim()
                self.model, self.optimizer = self.build()  # fresh, no optimizer state yet: a resumed run's start
                m = self.manager(self.ref)
                if mode == "cold":
                    self.between(None)
                objects = {"model": self.model, "optimizer": self.optimizer}
                found: List[Any] = []
                t = self.timed(functools.partial(_restore_into, found, m, objects))
                m.close()
                if found[0] is None:
                    raise RuntimeError(f"rank {self.rank}: nothing restored from {self.ref}")
                if checked is None:
                    got = self.fingerprint()
                    checked = all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, expected))
                    if not checked:
                        raise RuntimeError(f"the restored state differs from the saved one: sums {got}, saved {expected}")
                if t:
                    samples[mode].append(t)
        if self.rank == 0:
            self.out["tasks"].append({"task": "restore", "verified": bool(checked), **samples})

    def run(self, tasks: Sequence[str], out: Path) -> None:
        for task in tasks:
            kind, _, arg = task.partition(":")
            if kind == "memory":
                self.memory(arg)
            elif kind == "ref":
                self.save_ref()
            elif kind == "throughput":
                self.throughput(int(arg))
            elif kind == "restore":
                self.restore(int(arg))
            else:
                raise ValueError(f"unknown task {task!r}")
        times = os.times()
        cpu = self.comm.gather_object(times.user + times.system)
        if cpu is not None:
            out.write_text(json.dumps({**self.out, "workers_cpu_s": sum(cpu)}))
        self.comm.barrier()
        self.comm.shutdown()


def _no_state(step: int) -> None:
    """A rank the checkpoint does not have (a larger world): it has no own state to seed here."""


def _restore_into(found: List[Any], manager: Any, objects: Dict[str, Any]) -> None:
    found.append(manager.restore(objects, {}, False, new_rank=_no_state))


# ---- the benchmark ---------------------------------------------------------------------------------
@dataclass
class Size:
    """The state: `blocks` Linear layers of width x width, with AdamW."""

    width: int
    blocks: int

    def parameters(self) -> int:
        return self.blocks * (self.width * self.width + self.width)

    def state_MB(self) -> float:
        return 3 * 4 * self.parameters() / MB  # parameters, exp_avg, exp_avg_sq (float32)


def child(rank: int, world: int, port: int, params: Dict[str, Any]) -> None:
    """One rank of a group (a process forked by the forkserver, which imported torch, FSDP and the library once)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    _Worker(argparse.Namespace(**params)).run([t for t in params["tasks"].split(",") if t], Path(params["out"]))


def noop() -> None:
    pass
