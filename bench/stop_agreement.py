"""What the per-step stop agreement costs: `python -m bench.stop_agreement [--quick]`.

Every step (trainer.stop_check_every_n_steps=1) the ranks agree whether to stop, with one
all-reduce (MAX) of two floats on CPU tensors. Measured two ways, on 2 local workers:

1. the bare collective: `Comm.max_each` in a loop (torch.distributed over Gloo, and Horovod);
2. the training step of a small job (synthetic data, the MLP): median seconds per step from
   metrics.jsonl, with the check every step against a check every 10**6 steps (never), runs
   alternated so that drift of the machine hits both alike.

Writes bench/results/stop_agreement.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def _env() -> Dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "launchers"), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


# ---- 1. the bare collective ------------------------------------------------------------------
def _gloo_worker(rank: int, port: int, n: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    from steadfast.comm import TorchDistComm

    comm = TorchDistComm(60)
    for _ in range(200):
        comm.max_each([0.0, 0.0])
    times = []
    for _ in range(n):
        t = time.perf_counter()
        comm.max_each([0.0, 0.0])
        times.append(time.perf_counter() - t)
    comm.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def bare_gloo(n: int) -> List[float]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.start_processes(_gloo_worker, args=(port, n, f.name), nprocs=2, start_method="spawn")
        return json.loads(Path(f.name).read_text())


def _hvd_worker(n: int) -> List[float]:
    import torch

    torch.set_num_threads(1)
    from steadfast.comm_horovod import HorovodComm

    comm = HorovodComm()
    for _ in range(200):
        comm.max_each([0.0, 0.0])
    times = []
    for _ in range(n):
        t = time.perf_counter()
        comm.max_each([0.0, 0.0])
        times.append(time.perf_counter() - t)
    comm.shutdown()
    return times


def bare_horovod(n: int) -> List[float]:
    import horovod

    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    return horovod.run(_hvd_worker, args=(n,), np=2, hosts="localhost:2", use_gloo=True, executable=sys.executable)[0]


# ---- 2. the training step --------------------------------------------------------------------
JOB = ["data=synthetic", "data.num_samples=16384", "data.batch_size=16", "trainer.max_epochs=2", "checkpoint=every_epoch",
       "restart.monitor_interval=0.1", "trainer.log_every_n_steps=10", "logger.progress=none"]


def step_time(backend: str, every: int, workdir: Path, i: int) -> float:
    name = f"{backend}-{every}-{i}"
    cmd = [sys.executable, "-m", "pipeline.train", *JOB, f"trainer.stop_check_every_n_steps={every}", f"run.name={name}",
           f"hydra.sweep.dir={workdir}"] + (["backend=horovod"] if backend == "horovod" else [])
    subprocess.run(cmd, env=_env(), check=True, capture_output=True)
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])
            if b["step"] - a["step"] == 10 and b["epoch"] == a["epoch"]]
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = 500 if args.quick else 3000
    repeats = 1 if args.quick else args.repeats
    out: Dict[str, Any] = {"collective_us": {}, "step_ms": {}}
    backends = ["torchrun"]
    try:
        import horovod.torch  # noqa: F401

        backends.append("horovod")
    except ImportError:
        pass
    for backend in backends:
        times = bare_gloo(n) if backend == "torchrun" else bare_horovod(n)
        out["collective_us"][backend] = {"median": statistics.median(times) * 1e6, "p90": sorted(times)[int(0.9 * len(times))] * 1e6}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            per: Dict[int, List[float]] = {1: [], 10**6: []}
            for i in range(repeats):
                for every in (10**6, 1):
                    per[every].append(step_time(backend, every, Path(tmp), i))
            out["step_ms"][backend] = {("every step" if k == 1 else "never"): [round(v * 1e3, 4) for v in vals] for k, vals in per.items()}
    print(f"{'backend':<10} {'all-reduce of 2 floats (median, p90)':<38} {'step, check every step':<24} {'step, no check':<16} {'cost/step':<10}")
    for backend in backends:
        c = out["collective_us"][backend]
        s = out["step_ms"][backend]
        on, off = statistics.median(s["every step"]), statistics.median(s["never"])
        out["step_ms"][backend]["cost_ms"] = round(on - off, 4)
        print(f"{backend:<10} {c['median']:>7.1f} us, {c['p90']:>7.1f} us{'':<19} {on:>8.3f} ms{'':<13} {off:>8.3f} ms{'':<5} "
              f"{on - off:+.3f} ms ({100 * (on - off) / off:+.1f}%)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stop_agreement.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
