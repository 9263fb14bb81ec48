"""Where a small synchronous save's time goes (bench.checkpoint_io's state B: an MLP with Adam after one
step, ~0.1 MiB), in CPU time of the calling thread (time.thread_time) and wall time, per part:

    nice -n 19 .venv/bin/python bench/probes/sync_save_parts.py [SAVES] [--profile] [--config] [--dir DIR]

Three ways, each SAVES times (default 200), medians and means per save:
  first   a fresh manager's first save (what bench.checkpoint_io's project_sync times: made, os.sync(),
          saved), then wait(); the manager's construction is reported too
  second  that manager's second save, its first one's folder removed (bench's project_sync_next)
  steady  saves 1..SAVES of one manager with keep_last=1 (what a run's every save costs: the
          previous one's check waited for, retention removing the one before)
The parts are the functions the save calls, wrapped with timers (a part's time includes the parts it
calls: `commit` holds `fsync batch`). `--config` gives the manager the training config and full config
of steadfast/conf/steadfast.yaml (the library's defaults), as a run's manifest carries them; without, {}
as bench.checkpoint_io does. `--dir`: where to write (default: the system's temporary folder; a tmpfs
such as /dev/shm makes every fsync a no-op, leaving the Python). `--profile` prints cProfile's top functions of the steady saves.

CPU time is what this measures reliably on a loaded machine; wall time includes the fsyncs and the
machine's load. A development probe: its figures are quoted in bench/NOTES.md, not in the tables.
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.checkpoint_io import model_case  # noqa: E402
from steadfast.checkpoint import manager as mg  # noqa: E402
from steadfast.checkpoint import manifest as mf  # noqa: E402
from steadfast.checkpoint.storage import fileio, posix  # noqa: E402
from steadfast.distributed.comm import Comm  # noqa: E402

SAVES = int(next((a for a in sys.argv[1:] if a.isdigit()), "200"))
PROFILE = "--profile" in sys.argv
CONFIG = "--config" in sys.argv
DIR = sys.argv[sys.argv.index("--dir") + 1] if "--dir" in sys.argv else None

current: Dict[str, List[float]] = {}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading_ident() != MAIN:
            return fn(*args, **kwargs)
        c, w = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc = current.setdefault(name, [0.0, 0.0])
            acc[0] += time.thread_time() - c
            acc[1] += time.perf_counter() - w

    return wrapper


def threading_ident() -> int:
    import threading

    return threading.get_ident()


MAIN = threading_ident()


def wrap(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, timed(name, getattr(owner, attr)))


def found(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def instrument() -> None:
    """Timers around the parts of a save (the calling thread only)."""
    wrap(mg, "state_of", "state dicts")
    names = found("steadfast.checkpoint.optimizers", "ParamNames")  # a manager's kept names (the trees since 3 Dec)
    if names is not None:
        wrap(names, "fields", "optimizer fields")
    elif hasattr(mg, "optimizer_fields"):
        wrap(mg, "optimizer_fields", "optimizer fields")
    wrap(mg, "for_state", "codec choice")
    wrap(mg, "write_own", "write state.bin")
    wrap(mf, "next_commit", "next commit (scan)")
    # the trees before and after the commit sequence was followed and the configs sealed once (in
    # manifest.py at first, then in their own modules)
    commits = getattr(mf, "Commits", None) or found("steadfast.checkpoint._commits", "Commits")
    if commits is not None:
        wrap(commits, "next", "next commit (listing)")
    wrap(mf, "seal", "seal manifest")
    sealer = getattr(mf, "Sealer", None) or found("steadfast.checkpoint._sealer", "Sealer")
    if sealer is not None:
        wrap(sealer, "seal", "seal+check manifest")
    wrap(mf, "validate", "validate manifest")
    wrap(mf, "parse", "parse manifest")
    wrap(posix.FolderStore, "stage", "stage (mkdir)")
    wrap(posix.FolderStore, "commit", "commit")
    wrap(fileio.Unsynced, "sync", "fsync batch")
    wrap(mg.CheckpointManager, "_saved", "saved event")
    wrap(mg.CheckpointManager, "_check_later", "submit check")
    wrap(mg.CheckpointManager, "wait", "wait")
    from steadfast.checkpoint import replicated

    wrap(replicated.ReplicatedCodec, "plan", "plan")


def config_of_a_run() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if not CONFIG:
        return {}, {}
    from omegaconf import OmegaConf

    loaded = OmegaConf.to_container(OmegaConf.load(ROOT / "steadfast" / "conf" / "steadfast.yaml"), resolve=False)
    assert isinstance(loaded, dict)
    resolved: Dict[str, Any] = {str(k): v for k, v in loaded.items()}
    return mf.training_config(resolved), dict(mf.flatten(resolved))


def manager(folder: Path, keep_last: int = 1) -> mg.CheckpointManager:
    training, full = config_of_a_run()
    return mg.CheckpointManager(
        folder, Comm(), keep_last=keep_last, training_config=training, full_config=full, on_event=lambda *a, **k: None
    )


def one(m: mg.CheckpointManager, step: int, case: Any) -> Tuple[float, float, Dict[str, List[float]]]:
    current.clear()
    c, w = time.thread_time(), time.perf_counter()
    m.save(step, case.objects, case.per_rank, {"epoch": 0})
    return time.thread_time() - c, time.perf_counter() - w, dict(current)


def summary(label: str, rows: List[Tuple[float, float, Dict[str, List[float]]]]) -> None:
    print(f"\n{label}: {len(rows)} saves, ms per save (calling thread)")
    print(f"  {'part':<24}{'cpu med':>9}{'cpu mean':>10}{'wall med':>10}")
    print(
        f"  {'save() total':<24}{statistics.median(r[0] for r in rows) * 1e3:>9.3f}"
        f"{statistics.mean(r[0] for r in rows) * 1e3:>10.3f}{statistics.median(r[1] for r in rows) * 1e3:>10.3f}"
    )
    names = sorted({k for r in rows for k in r[2]}, key=lambda k: -statistics.median(r[2].get(k, [0, 0])[0] for r in rows))
    for k in names:
        cpu = [r[2].get(k, [0.0, 0.0])[0] for r in rows]
        wall = [r[2].get(k, [0.0, 0.0])[1] for r in rows]
        print(
            f"  {k:<24}{statistics.median(cpu) * 1e3:>9.3f}{statistics.mean(cpu) * 1e3:>10.3f}{statistics.median(wall) * 1e3:>10.3f}"
        )


def main() -> None:
    import torch

    torch.set_num_threads(1)
    case = model_case([64, 64])
    root = Path(tempfile.mkdtemp(prefix="sf-sync-parts-", dir=DIR))
    instrument()
    try:
        first, second, waits, made = [], [], [], []
        for i in range(0 if PROFILE else SAVES):  # as bench.checkpoint_io's project_sync and project_sync_next
            c = time.thread_time()
            m = manager(root / f"first-{i}", keep_last=2)
            made.append(time.thread_time() - c)
            os.sync()
            first.append(one(m, 1, case))
            c = time.thread_time()
            m.wait()
            waits.append(time.thread_time() - c)
            shutil.rmtree(root / f"first-{i}" / "step_000000001")
            os.sync()
            second.append(one(m, 2, case))
            m.close()
            shutil.rmtree(root / f"first-{i}")
        if first:
            print(f"\nthe manager's construction: cpu med {statistics.median(made) * 1e3:.3f} ms on the calling thread")
            summary("first save of a fresh manager", first)
            print(f"  (wait() after it: cpu med {statistics.median(waits) * 1e3:.3f} ms on the calling thread)")
            summary("second save of the same manager (its first one's folder removed)", second)

        m = manager(root / "steady")
        one(m, 0, case)
        profiler = cProfile.Profile() if PROFILE else None
        t0 = time.process_time()
        steady = []
        for step in range(1, SAVES + 1):
            if profiler is not None:
                profiler.enable()
            steady.append(one(m, step, case))
            if profiler is not None:
                profiler.disable()
        m.wait()
        process = time.process_time() - t0
        m.close()
        summary("steady saves of one manager (keep_last=1)", steady)
        print(f"  process CPU (every thread, the background check and retention too): {process / SAVES * 1e3:.3f} ms a save")
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
