"""What the stop agreement costs: `python -m bench.stop_agreement [--quick | --tiny] [--json PATH]`.

The ranks agree on stop requests (and rank 0's "a timed save is due") in the control plane's
periodic message (steadfast/distributed/exchange.py: one all-reduce of a few floats on CPU tensors, on a Gloo
group of its own), pipelined: started at one exchange, read at the next. Measured two ways on 2
local workers:

1. the bare collective, waited for at once: `Comm.max_each` in a loop (torch.distributed over
   Gloo, and Horovod when it is installed): its latency, what a blocking check would add;
2. its cost in training (bench.step_cost's harness: the hot-loop job, configurations switched
   every 20 steps inside one pair of processes, in a rotated order): the agreement every step
   (trainer.stop_check_every_n_steps=1), at the default automatic interval
   (stop_check_every_n_steps=null: every 2**k steps, about CONTROL_INTERVAL_S of rank 0's measured
   step time), and never (every 10**6 steps), each against the same loop without it; wall-clock
   and CPU time (both workers), medians of the blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


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
    from steadfast.distributed.comm import TorchDistComm

    comm = TorchDistComm(60)
    for _ in range(min(200, n)):
        comm.max_each([0.0, 0.0])
    times = []
    for _ in range(n):
        t = time.perf_counter()
        comm.max_each([0.0, 0.0])
        times.append(time.perf_counter() - t)
    comm.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    # End without the interpreter's teardown, as a worker forked from the launcher's forkserver does:
    # Gloo's process group, kept referenced by Comm.shutdown, can abort in its destructor at exit
    # ("terminate called without an active exception", torch 2.13), failing a measurement already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    from steadfast.distributed._horovod import HorovodComm

    comm = HorovodComm()
    for _ in range(min(200, n)):
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

    from hydra_plugins.steadfast_launcher._compat.horovod_runner import TUNING

    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    os.environ.update({k: os.environ.get(k) or v for k, v in TUNING.items()})  # as the launcher's Horovod backend
    return horovod.run(_hvd_worker, args=(n,), np=2, hosts="localhost:2", use_gloo=True, executable=sys.executable)[0]


def _latency(times: List[float]) -> Dict[str, float]:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": ordered[int(0.9 * len(ordered))] * 1e6, "n": len(ordered)}


# ---- 2. in training --------------------------------------------------------------------------
CONFIGS = {"every step": "agreement@1", "auto (default)": "agreement", "never": "agreement@1000000"}


def in_training(rounds: int, block: int) -> Dict[str, Any]:
    from .step_cost import measure

    res = measure(rounds, block, ",".join(["bare", *CONFIGS.values()]))
    out: Dict[str, Any] = {
        "rounds": rounds,
        "block_steps": block,
        "auto_every_n_steps": res["agreement_every"],
        "bare_ms_per_step": res["ms_per_step"]["bare"],
    }
    for label, config in CONFIGS.items():
        out[label] = {
            "ms_per_step": res["ms_per_step"][config],
            "extra_us_per_step": res["extra_us_per_step"][config],
            "speed vs without": res["bare/config steps_per_s"][config],
            "extra_cpu_us_per_step": res["extra_cpu_us_per_step"][config],
            "speed per CPU-second vs without": res["bare/config steps per CPU-second"][config],
        }
    return out


def report(out: Dict[str, Any]) -> None:
    print("\nThe all-reduce of 2 floats, waited for at once:")
    for backend, c in out["collective"].items():
        print(f"  {backend:<10} median {c['median_us']:8.1f} us   p90 {c['p90_us']:8.1f} us")
    t = out["in_training"]
    print(
        f"\nIn training ({t['rounds']} rounds of {t['block_steps']}-step blocks; a step without it {t['bare_ms_per_step']:.3f} ms;"
        f" auto = every {t['auto_every_n_steps']} steps here)"
    )
    for label in CONFIGS:
        r = t[label]
        print(
            f"  {label:<15} {r['extra_us_per_step']:+8.1f} us/step (speed {r['speed vs without']:.3f})"
            f"   CPU {r['extra_cpu_us_per_step']:+8.1f} us/step (per CPU-second {r['speed per CPU-second vs without']:.3f})"
        )


def main(argv: Optional[List[str]] = None) -> int:
    from .common import RESULTS, command_line, log, machine, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--tiny", action="store_true", help="a few of everything (smoke test)")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of blocks in training")
    parser.add_argument("--json", type=Path, default=RESULTS / "stop_agreement.json")
    args = parser.parse_args(argv)
    n, rounds, block = 3000, args.rounds, 20
    if args.quick:
        n, rounds = 500, 20
    if args.tiny:
        n, rounds, block = 50, 1, 5
    out: Dict[str, Any] = {
        "benchmark": "stop_agreement",
        "command": command_line("bench.stop_agreement", argv),
        "machine": machine(),
        "collective": {},
    }
    log(f"stop agreement: {n} bare all-reduces, {rounds} rounds in training")
    out["collective"]["torchrun"] = _latency(bare_gloo(n))
    try:
        import horovod.torch  # noqa: F401

        if not args.tiny:
            out["collective"]["horovod"] = _latency(bare_horovod(n))
    except ImportError:
        pass
    out["in_training"] = in_training(rounds, block)
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
