"""Checkpoint I/O: the project's save and restore against torch.save and raw fsync'd I/O of the same bytes.

    python -m bench.checkpoint_io [--mb 256] [--tensors 16] [--repeats 5] [--dir DIR] [--json PATH]

Every method writes the same three states in one run: A, `--mb` MiB of float32 parameters in
`--tensors` tensors; B, the training state of an MLP with its Adam optimizer after one step (model,
optimizer, per-rank RNG, as the trainer saves them); C, `--mb` MiB of parameters in tensors of
`--small-kib` KiB each (many small tensors: biases, norms). A and C are the parameters of a model
trained by SGD, saved with that optimizer. The methods run in a rotated order each repeat and the
median of each is reported. Throughput is always the state's tensor bytes over wall time, so a
throughput ratio is the inverse of the time ratio.

`project_sync` is save() of a synchronous manager: when it returns the checkpoint is committed;
`project_sync_checked` adds wait(), until it has been read back, verified and retention has run
(in the background thread, overlapping the next steps in a run). The async save is timed on a
manager's second save (the first allocates what later ones reuse): `async_blocked` is the time
inside save() on the calling thread, `async_copied` until the copy of the optimizer-owned tensors
is done (what the next optimizer step waits for if it comes at once, with no forward or backward
pass in between: the worst case), `async_total` until the background commit and check are done.
`raw_fsync_write` writes the tensors' bytes to one file with one fsync; `raw_atomic_commit` writes
them into a temporary folder, fsyncs the file and the folder, renames the folder into place and
fsyncs its parent: the least a checkpoint that appears whole or not at all costs (the limit of a
small state's save, whose time is its fsyncs, not its bytes). `raw_atomic_commit_manifest` adds
what the project's commit protocol requires beyond that: a manifest naming the file's size and
checksum, written after it and fsynced too (one more durable write). `project_sync_next` is the
second save of a synchronous manager (its first one's folder removed, as for the async save): what
every save of a run but the first costs, where `project_sync` is a fresh manager's first.
Before every timed operation dirty pages are flushed (os.sync); before a cold read the page cache
is dropped (root only, else only warm reads are measured). Every timed write starts right after the
previous method's files were removed: on a thin-provisioned virtual disk, writing blocks that were
just freed is several times faster than writing fresh ones, and a method must not win by that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import xxhash

from pipeline.models import MLP
from steadfast.checkpoint.manager import CheckpointManager
from steadfast.checkpoint.storage.fileio import fsync_dir
from steadfast.distributed.comm import Comm

MiB = 1 << 20
# Async saves: blocked at most ASYNC_SHARE of a sync save or ASYNC_FLOOR_S, whichever is larger (a small
# state's sync save takes a few ms, of which no save can block less than a fixed cost).
ASYNC_SHARE, ASYNC_FLOOR_S = 0.05, 0.002
ASYNC_TARGET = ("async_blocked/allowed time", ("<=", 1.0))  # blocked / max(ASYNC_SHARE * sync, ASYNC_FLOOR_S)
# The save against its limit: A (a few big tensors) and C (many small ones) against one fsync'd write of
# the bytes; B (a small model's state, ~0.1 MiB) against the least a commit of the same bytes with a
# manifest costs (raw_atomic_commit_manifest), since there the commit's fsyncs, not the bytes, are the
# cost, and a manifest's durable write alone puts raw_atomic_commit out of reach (0.65-0.67x of it,
# bench/NOTES.md: "Checkpoint B: the sync save's fixed cost"). B is held to a manager's next save, what every
# save of a run but its first costs: a first save also walks the state so that later ones reuse its layout
# (a fixed cost paid once, which each later save of a small state repays), and runs code a process runs cold.
TARGETS = {
    "A": {"project_sync/raw_fsync_write throughput": (">=", 0.9), ASYNC_TARGET[0]: ASYNC_TARGET[1]},
    "B": {"project_sync_next/raw_atomic_commit_manifest throughput": (">=", 0.8), ASYNC_TARGET[0]: ASYNC_TARGET[1]},
    "C": {"project_sync/raw_fsync_write throughput": (">=", 0.8), ASYNC_TARGET[0]: ASYNC_TARGET[1]},
}


class Holder:
    """A plain state as a Stateful; restoring keeps a reference (no copy), like a zero-cost load."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


@dataclass
class Case:
    name: str
    objects: Dict[str, Any]
    per_rank: Dict[str, Any]
    restore_targets: Callable[[], Tuple[Dict[str, Any], Dict[str, Any]]]

    def tree(self) -> Dict[str, Any]:
        """What the project's save writes (one file per entry), as one tree."""
        states = {name: obj.state_dict() for name, obj in self.objects.items()}
        states["ranks"] = {"ranks": [{name: obj.state_dict() for name, obj in self.per_rank.items()}]}
        return states


def tensors_of(tree: Any) -> List[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def params_case(label: str, mb: int, count: int) -> Case:
    """`count` float32 parameters of `mb` MiB in all, of a model trained by SGD (no optimizer state)."""
    numel = mb * MiB // 4 // count
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ParameterDict({f"t{i:05d}": torch.nn.Parameter(torch.randn(numel, generator=g)) for i in range(count)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    size = f"{numel * 4 / MiB:.1f} MiB" if numel * 4 >= MiB else f"{numel * 4 // 1024} KiB"
    return Case(
        f"{label}: {count} x {size} float32 parameters + SGD",
        {"model": model, "optimizer": optimizer},
        {},
        lambda: ({"model": Holder(), "optimizer": Holder()}, {}),
    )


def model_case(hidden: List[int]) -> Case:
    torch.manual_seed(0)
    model = MLP((64,), 10, hidden)  # the digits data's shape
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).logsumexp(1).mean().backward()
    optimizer.step()
    rng = Holder({"torch": torch.get_rng_state()})
    objects = {"model": model, "optimizer": optimizer}
    return Case(f"B: MLP{tuple(hidden)} + Adam after one step", objects, {"rng": rng}, lambda: (objects, {"rng": Holder()}))


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], Any]) -> float:
    os.sync()  # earlier writeback must not land in this measurement
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def manager(folder: Path, async_save: bool = False, keep_last: int = 1) -> CheckpointManager:
    return CheckpointManager(
        folder, Comm(), keep_last=keep_last, training_config={}, on_event=lambda *a, **k: None, async_save=async_save
    )


def project_sync(case: Case, folder: Path) -> Dict[str, float]:
    m = manager(folder, keep_last=2)  # no retention delete inside the timing
    os.sync()
    start = time.perf_counter()
    m.save(1, case.objects, case.per_rank, {"epoch": 0})
    committed = time.perf_counter() - start
    m.wait()
    checked = time.perf_counter() - start
    shutil.rmtree(folder / "step_000000001")  # like every other method, it writes after the last one's files went
    os.sync()
    start = time.perf_counter()
    m.save(2, case.objects, case.per_rank, {"epoch": 0})
    following = time.perf_counter() - start
    m.close()
    return {"project_sync": committed, "project_sync_checked": checked, "project_sync_next": following}


def project_async(case: Case, folder: Path) -> Dict[str, float]:
    """The second save of a manager: what every save of a run but the first costs."""
    m = manager(folder, async_save=True, keep_last=2)  # no retention delete inside the timing
    m.save(1, case.objects, case.per_rank, {"epoch": 0})
    m.wait()
    shutil.rmtree(folder / "step_000000001")  # like every other method, it writes after the last one's files went
    os.sync()
    start = time.perf_counter()
    m.save(2, case.objects, case.per_rank, {"epoch": 0})
    blocked = time.perf_counter() - start  # what the training loop waits for
    m.wait_staging()
    copied = time.perf_counter() - start  # what an optimizer step right after the save would wait for
    m.wait()
    total = time.perf_counter() - start
    m.close()
    return {"async_blocked": blocked, "async_copied": copied, "async_total": total}


def torch_save(case: Case, folder: Path) -> Dict[str, float]:
    tree = case.tree()

    def write() -> None:
        with open(folder / "state.pt", "wb") as f:
            torch.save(tree, f)
            f.flush()
            os.fsync(f.fileno())

    folder.mkdir()
    return {"torch_save": timed(write)}


def raw_write(case: Case, folder: Path) -> Dict[str, float]:
    views = [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors_of(case.tree())]

    def write() -> None:
        with open(folder / "raw.bin", "wb", buffering=0) as f:
            for v in views:
                f.write(v)
            os.fsync(f.fileno())

    folder.mkdir()
    return {"raw_fsync_write": timed(write)}


def read_all(folder: Path) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        path.read_bytes()


def reads(case: Case, ckpt: Path, cold: bool, restore_first: bool) -> Dict[str, float]:
    """Project restore (load + verify) and a raw read of the same checkpoint's files, cold then warm."""
    m = manager(ckpt)

    def restore() -> None:
        objects, per_rank = case.restore_targets()
        assert m.restore(objects, per_rank, allow_config_change=False) is not None

    out: Dict[str, float] = {}
    ops = [("restore", restore), ("raw_read", lambda: read_all(ckpt))]
    for name, fn in ops if restore_first else ops[::-1]:
        if cold:
            drop_caches()
            out[f"{name}_cold"] = timed(fn)
        out[f"{name}_warm"] = timed(fn)
    return out


def raw_atomic_commit(case: Case, folder: Path) -> Dict[str, float]:
    """The least a correct commit of the same bytes costs: one file in a temporary folder, fsynced, the
    folder fsynced (the file's name), renamed into place, the parent fsynced (the rename). No manifest,
    no checksum: a reader could not tell a damaged file, which the project's commit can."""
    views = [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors_of(case.tree())]
    folder.mkdir()
    staging, final = folder / "tmp.commit", folder / "committed"

    def commit() -> None:
        staging.mkdir()
        with open(staging / "raw.bin", "wb", buffering=0) as f:
            for v in views:
                f.write(v)
            os.fsync(f.fileno())
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(folder)

    return {"raw_atomic_commit": timed(commit)}


def raw_atomic_commit_manifest(case: Case, folder: Path) -> Dict[str, float]:
    """raw_atomic_commit with the least a manifest adds: after the file, a small manifest naming its
    size and checksum (xxh3-128, as the project's), fsynced; then the folder, the rename, the parent.
    The least a commit that lets a reader tell a damaged or missing file costs."""
    views = [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors_of(case.tree())]
    folder.mkdir()
    staging, final = folder / "tmp.commit", folder / "committed"

    def commit() -> None:
        staging.mkdir()
        digest, size = xxhash.xxh3_128(), 0
        with open(staging / "raw.bin", "wb", buffering=0) as f:
            for v in views:
                f.write(v)
                digest.update(v)
                size += len(v)
            os.fsync(f.fileno())
        manifest = json.dumps({"files": {"raw.bin": {"bytes": size, "checksum": f"xxh3_128:{digest.hexdigest()}"}}})
        with open(staging / "manifest.json", "wb", buffering=0) as f:
            f.write(manifest.encode())
            os.fsync(f.fileno())
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(folder)

    return {"raw_atomic_commit_manifest": timed(commit)}


WRITERS = [project_sync, project_async, torch_save, raw_write, raw_atomic_commit, raw_atomic_commit_manifest]


def run_case(case: Case, root: Path, repeats: int, cold: bool) -> Dict[str, Any]:
    payload = sum(t.nbytes for t in tensors_of(case.tree()))
    samples: Dict[str, List[float]] = {}
    for r in range(repeats):
        order = WRITERS[r % len(WRITERS) :] + WRITERS[: r % len(WRITERS)]
        for writer in order:
            folder = root / f"{writer.__name__}-{r}"
            for k, v in writer(case, folder).items():
                samples.setdefault(k, []).append(v)
            shutil.rmtree(folder)  # every timed write starts right after the previous one's files were removed
        sync_folder = root / f"reads-{r}"
        writer_of_reads = manager(sync_folder)
        writer_of_reads.save(1, case.objects, case.per_rank, {"epoch": 0})
        writer_of_reads.close()
        for k, v in reads(case, sync_folder, cold, restore_first=r % 2 == 0).items():
            samples.setdefault(k, []).append(v)
        shutil.rmtree(sync_folder)
    med = {k: statistics.median(v) for k, v in samples.items()}
    allowed = max(ASYNC_SHARE * med["project_sync"], ASYNC_FLOOR_S)
    ratios = {
        "project_sync/raw_fsync_write throughput": med["raw_fsync_write"] / med["project_sync"],
        "project_sync/raw_atomic_commit throughput": med["raw_atomic_commit"] / med["project_sync"],
        "project_sync_next/raw_atomic_commit throughput": med["raw_atomic_commit"] / med["project_sync_next"],
        "project_sync/raw_atomic_commit_manifest throughput": med["raw_atomic_commit_manifest"] / med["project_sync"],
        "project_sync_next/raw_atomic_commit_manifest throughput": med["raw_atomic_commit_manifest"] / med["project_sync_next"],
        "raw_atomic_commit_manifest/raw_atomic_commit throughput": med["raw_atomic_commit"] / med["raw_atomic_commit_manifest"],
        "project_sync_checked/raw_fsync_write throughput": med["raw_fsync_write"] / med["project_sync_checked"],
        "torch_save/raw_fsync_write throughput": med["raw_fsync_write"] / med["torch_save"],
        "async_blocked/sync_save time": med["async_blocked"] / med["project_sync"],
        ASYNC_TARGET[0]: med["async_blocked"] / allowed,
        "async_copied/sync_save time": med["async_copied"] / med["project_sync"],
        "async_total/sync_save time": med["async_total"] / med["project_sync"],
        "restore/raw_read throughput (warm)": med["raw_read_warm"] / med["restore_warm"],
    }
    if cold:
        ratios["restore/raw_read throughput (cold)"] = med["raw_read_cold"] / med["restore_cold"]
    return {
        "case": case.name,
        "payload_bytes": payload,
        "repeats": repeats,
        "methods": {k: {"median_s": med[k], "MiB_per_s": payload / MiB / med[k], "samples_s": v} for k, v in samples.items()},
        "ratios": ratios,
        "async_allowed_s": allowed,
    }


def filesystem(path: Path) -> str:
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]} ({best[0]})"


def report(result: Dict[str, Any], targets: Dict[str, Tuple[str, float]]) -> None:
    print(f"\n{result['case']}: {result['payload_bytes'] / MiB:.2f} MiB of tensors, median of {result['repeats']}")
    print(f"  {'method':<22}{'median s':>10}{'MiB/s':>10}   min..max s")
    for name, m in result["methods"].items():
        s = m["samples_s"]
        print(f"  {name:<22}{m['median_s']:>10.4f}{m['MiB_per_s']:>10.1f}   {min(s):.4f}..{max(s):.4f}")
    for name, value in result["ratios"].items():
        target = ""
        if name in targets:
            op, goal = targets[name]
            ok = value >= goal if op == ">=" else value <= goal
            target = f"  (target {op} {goal}: {'met' if ok else 'MISSED'})"
        print(f"  {name:<42}{value:>7.3f}{target}")


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="size of state A in MiB")
    p.add_argument("--tensors", type=int, default=16, help="number of tensors in state A")
    p.add_argument("--small-kib", type=int, default=32, help="size of each tensor of state C in KiB")
    p.add_argument("--hidden", default="64,64", help="hidden sizes of state B's MLP (the default model's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write (a temporary folder is made inside)")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "checkpoint_io.json")
    p.add_argument("--no-drop-caches", action="store_true", help="measure warm reads only")
    args = p.parse_args(argv)

    cold = not args.no_drop_caches and drop_caches()
    root = Path(tempfile.mkdtemp(prefix="steadfast-bench-", dir=args.dir))
    load_before = os.getloadavg()
    try:
        cases = [
            params_case("A", args.mb, args.tensors),
            model_case([int(h) for h in args.hidden.split(",")]),
            params_case("C", args.mb, max(1, args.mb * 1024 // args.small_kib)),
        ]
        results = [run_case(case, root / f"case{i}", args.repeats, cold) for i, case in enumerate(cases)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "command": " ".join(
            [Path(sys.executable).name, "-m", "bench.checkpoint_io", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "filesystem": filesystem(root.parent),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "reads": "cold (page cache dropped) and warm" if cold else "warm only (page cache could not be dropped)",
        "targets": {f"{case}: {name}": goal for case, goals in TARGETS.items() for name, goal in goals.items()},
        "async_target": f"blocked <= max({ASYNC_SHARE} x sync save, {ASYNC_FLOOR_S * 1e3:.0f} ms)",
        "results": results,
    }
    print(f"machine: {out['machine']}\nreads: {out['reads']}")
    for r in results:
        report(r, TARGETS[r["case"].split(":")[0]])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
