"""Where a training step's time goes: the library's per-step work, piece by piece, inside one run.

    python -m bench.step_cost [--rounds 12] [--block 40] [--job hot|tiny] [--nproc 2] [--configs bare,run] [--control-every N]
        [--processes N] [--quick | --tiny] [--json PATH]

Wall-clock ratios between separate runs move with other tenants' load (+-10% here); this
benchmark measures inside one pair of processes instead. Two workers under torchrun train the
hot-loop job (bench.common.HOT: MLP 256-512-512-10, batch 64, SGD, Gloo; `--job tiny`: section 7's
tiny model, MLP 32-64-64-4, batch 32, with more samples so an epoch has 512 steps) and switch every
`--block` steps between configurations, in a rotated order, `--rounds` times; each
configuration's time per step is the median of its blocks, as a ratio to `bare`, in wall-clock
time (rank 0) and in CPU time (both workers' processes, every thread: what the step costs the
machine, which other tenants' load hardly moves):

  bare        batches indexed out of the in-memory tensors, forward, backward, SGD step
  loader      the same batches through the library's loader (ResumableSampler + TensorBatches)
  dataloader  torch's DataLoader over the TensorDataset with a DistributedSampler (bench/baseline_ddp.py's loop)
  heartbeat   bare + the heartbeat's count every step (its thread writes the count within 50 ms)
  telemetry   bare + the loss window on the device and the metrics all-reduce and row every 10 steps
              (a Telemetry alone: a control-plane message per window)
  agreement   bare + the stop agreement: the control plane's periodic message (steadfast/distributed/exchange.py),
              every --control-every steps
  run_step    the pieces of steadfast.Run.step above, in its order (with the loader; the windows ride the
              agreement's messages, as in steadfast.Run)
  run         steadfast.Run itself, as a launched worker's loop uses it: a model of bare's shape from run.setup,
              run.loader, run.step after every step, the heartbeat counting (no checkpoints; snapshots off:
              `snapshot` is their row)
  reduce_sync   bare + only a blocking control-plane all-reduce of 8 floats every 10 steps
  reduce_async  bare + only a control-plane all-reduce of 2 floats at the agreement's interval, started at
                one and waited for at the next (the exchange's collective)
  snapshot    bare + a snapshot in shared memory every step (steadfast.checkpoint.memory: model, optimizer,
              progress on local rank 0, every rank's RNG states): snapshot.every_n_steps=1.
              snapshot.every_n_steps=auto takes one every N steps, N the smallest power of two at
              which cost <= 2% of N steps (steadfast.loop.memory_cadence.auto_interval); the result
              reports that interval and its cost per step

The control plane's message goes every --control-every steps in every configuration that sends it
(default: 128 steps with one rank, 32 with two: what its automatic interval, about CONTROL_INTERVAL_S
of steps, chose for the hot job on the quiet benchmark machine of 2-3 Dec). Fixed, so the work
measured is the same on every machine: the automatic interval follows the wall-clock time of a step,
and a message costs several hundred microseconds, so a slower or loaded machine sent more of them
and its `run.step` figure rose with the machine, not with the code.

Rank 0 times the blocks (DDP's all-reduce keeps the ranks in step). `--nproc 1`: one rank alone (the
same job and harness, world size 1), so the library's own per-step work is timed with a core to
itself, not against the other rank's and Gloo's threads on a 2-core machine. `--processes N`: N
launches one after the other, their blocks pooled; run.step amortised is the median of the launches'
means (each launch's mean is in the JSON): the same code reads 13-20 us a quiet step from one process to
the next here (bench/NOTES.md, 5 Dec late night), more than a change of the library moves it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (
    "bare",
    "loader",
    "dataloader",
    "heartbeat",
    "telemetry",
    "agreement",
    "run_step",
    "run",
    "reduce_sync",
    "reduce_async",
    "snapshot",
)
# NAME@N: the configuration with the stop agreement every N steps instead of --control-every


def _worker(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from bench.common import HOT, TINY
    from pipeline.data import synthetic
    from pipeline.models import MLP
    from steadfast import Run
    from steadfast.checkpoint.memory import MemorySnapshots
    from steadfast.checkpoint.state import Progress, RNGState
    from steadfast.contract import shm
    from steadfast.contract.env import TORCH, LaunchEnv
    from steadfast.contract.heartbeat import Heartbeat, start_heartbeat
    from steadfast.distributed.exchange import Exchange
    from steadfast.loop.agreement import StopAgreement
    from steadfast.loop.data import ResumableSampler, TensorBatches
    from steadfast.telemetry.metrics import Telemetry
    from steadfast.telemetry.records import RunRecord

    folder = Path(args.dir)
    # tiny: section 7's model and batch, with an epoch of 512 steps per worker (26 there): epoch ends stay rare
    job = HOT if args.job == "hot" else dataclasses.replace(TINY, num_samples=40960)
    # `run` is steadfast.Run as a launched worker has it: it starts the process groups every configuration uses
    (folder / "run").mkdir(exist_ok=True)
    os.environ.update(
        LaunchEnv(backend="torchrun", collective=TORCH, run_dir=folder / "run", collective_timeout_s=120).to_environ()
    )
    start_heartbeat(folder / "run", int(os.environ["RANK"]))  # a launched worker's (its launcher reads it)
    run = Run(
        {"checkpoint": {"every_n_epochs": None}, "logger": {"progress": "none"}},
        log_every_n_steps=job.log_every,
        stop_check_every_n_steps=args.control_every,
    )
    comm = run.comm
    torch.manual_seed(0)
    data = synthetic(
        num_samples=job.num_samples, num_features=job.num_features, num_classes=job.num_classes, val_fraction=0.2, seed=0
    )

    def mlp() -> torch.nn.Module:
        return MLP(data.input_shape, data.output_size, list(job.hidden), dropout=0.1)

    model = comm.wrap_model(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    theirs = mlp()
    run_model, run_optimizer = run.setup(theirs, torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9))
    run.resume(model=theirs, optimizer=run_optimizer)
    run_loader = run.loader(data.train, job.batch_size)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
    features, labels = data.train.tensors
    progress = Progress()
    sampler = ResumableSampler(len(features), comm.world_size, comm.rank, 0, job.batch_size, True, progress)
    record = RunRecord(folder, comm.rank)
    beat = Heartbeat(folder / "heartbeats", comm.rank)
    telemetry = Telemetry(comm, record, "lines", 10.0, job.log_every, time.time(), 0)
    agreement = StopAgreement(Exchange(comm, args.control_every))
    exchange = agreement.exchange
    riding = Telemetry(comm, record, "lines", 10.0, job.log_every, time.time(), 0, exchange=exchange)  # run_step's
    segment = shm.LaunchFolder(folder)  # what the launcher makes: one node's private snapshot folder, named to every rank
    if comm.rank == 0:
        segment.create()
    memory = MemorySnapshots(shm.Segments(comm.broadcast_object(segment.name)), comm.rank, comm.local_rank, comm.world_size)
    shared, per_rank = {"model": model, "optimizer": optimizer, "progress": progress}, {"rng": RNGState()}

    def slices() -> Iterator[Tuple[Any, Any]]:
        g = torch.Generator()
        g.manual_seed(progress.epoch)
        order = torch.randperm(len(features), generator=g)
        order = order[: len(order) - len(order) % comm.world_size][comm.rank :: comm.world_size]
        for begin in range(0, len(order), job.batch_size):
            index = order[begin : begin + job.batch_size]
            yield features[index], labels[index]

    def library() -> Iterator[Tuple[Any, ...]]:
        return iter(TensorBatches((features, labels), sampler, job.batch_size))

    torch_sampler: DistributedSampler[int] = DistributedSampler(
        data.train, num_replicas=comm.world_size, rank=comm.rank, shuffle=True, seed=0
    )

    def dataloader() -> Iterator[Tuple[Any, Any]]:
        torch_sampler.set_epoch(progress.epoch)
        return iter(DataLoader(data.train, batch_size=job.batch_size, sampler=torch_sampler))

    inside: List[Tuple[float, float]] = []  # `run`, per step: seconds fetching the batch from run.loader, and in run.step

    def run_steps() -> Iterator[None]:  # the loop a user writes, one step per next()
        for _ in run.epochs(1 << 30):
            batches, clock = iter(run_loader), time.perf_counter
            while True:
                began = clock()
                batch = next(batches, None)
                fetched = clock()
                if batch is None:
                    break
                x, y = batch
                run_optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(run_model(x), y)
                loss.backward()
                run_optimizer.step()
                stepping = clock()
                run.step(loss)
                inside.append((fetched - began, clock() - stepping))
                yield

    def after(name: str, loss: Any) -> None:
        p = progress
        p.global_step += 1
        p.batch_in_epoch += 1
        p.sample_in_epoch += job.batch_size * comm.world_size
        if name in ("telemetry", "run_step"):
            windows = telemetry if name == "telemetry" else riding
            windows.add_loss(loss)
            windows.after_step(p.global_step, p.epoch)
        if name in ("heartbeat", "run_step"):
            beat.count(p.global_step)
        if name in ("agreement", "run_step"):
            agreement.at_step(p.global_step, lambda: False)
        if name == "reduce_sync" and p.global_step % telemetry.every == 0:
            comm.start_sum(torch.zeros(8, dtype=torch.float64)).wait()
        if name == "snapshot":
            memory.take(p.global_step, memory.plan(shared, per_rank))
        if name == "reduce_async" and p.global_step % exchange.every == 0:
            if pending:
                pending.pop().wait()
            pending.append(comm.start_max_each([0.0, 0.0]))

    pending: List[Any] = []
    fetching: Dict[str, List[float]] = {}  # per configuration and block: the mean seconds per step fetching the batch
    stepping: List[float] = []  # `run`, per block: the mean seconds per step in run.step

    batches: Dict[str, Optional[Iterator[Any]]] = {"slices": None, "library": None, "dataloader": None}
    ours = run_steps()

    def next_batch(kind: str) -> Tuple[Any, Any]:
        while True:
            it = batches[kind]
            if it is not None:
                try:
                    return next(it)
                except StopIteration:
                    pass
            progress.epoch, progress.batch_in_epoch, progress.sample_in_epoch = progress.epoch + 1, 0, 0
            batches["slices"], batches["library"], batches["dataloader"] = slices(), library(), dataloader()

    def block(config: str, steps: int) -> Tuple[float, float]:
        name, _, every = config.partition("@")
        kind = {"loader": "library", "run_step": "library", "dataloader": "dataloader"}.get(name, "slices")
        auto = exchange.every
        exchange.every = int(every) if every else auto
        start, cpu = time.perf_counter(), time.process_time()
        if name == "run":
            del inside[:]
            for _ in range(steps):
                next(ours)
            fetching.setdefault(config, []).append(sum(f for f, _ in inside) / steps)
            stepping.append(sum(s for _, s in inside) / steps)
            return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps
        fetched = 0.0
        for _ in range(steps):
            began = time.perf_counter()
            x, y = next_batch(kind)
            fetched += time.perf_counter() - began
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            after(name, loss)
        agreement.drain(progress.global_step)
        while pending:
            pending.pop().wait()
        if every:
            exchange.every = auto
        fetching.setdefault(config, []).append(fetched / steps)
        return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps

    block("run_step", 3 * args.block)  # warm-up
    block("run", 3 * args.block)
    configs = tuple(args.configs.split(",")) if args.configs else CONFIGS
    times: Dict[str, List[float]] = {name: [] for name in configs}
    cpu: Dict[str, List[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        k = r % len(configs)
        for name in configs[k:] + configs[:k]:
            wall, used = block(name, args.block)
            times[name].append(wall)
            cpu[name].append(used)
    telemetry.close()
    riding.close()
    every_rank = comm.gather_object(cpu)
    comm.barrier()
    run.finish()  # shuts the process groups down
    if comm.rank == 0:
        segment.remove()
        assert every_rank is not None  # rank 0 gathers
        total = {name: [sum(c[name][i] for c in every_rank) for i in range(args.rounds)] for name in configs}
        Path(args.out).write_text(
            json.dumps(
                {
                    "seconds_per_step": times,
                    "cpu_seconds_per_step": total,
                    "agreement_every": exchange.every,
                    "run_agreement_every": run.exchange.every,
                    "fetch_seconds_per_step": {name: fetching[name][-args.rounds :] for name in configs},
                    "run_step_seconds_per_step": stepping[-args.rounds :],
                    "snapshot_bytes": memory.bytes,
                }
            )
        )


def control_every(nproc: int) -> int:
    """The control plane's fixed interval for these ranks (the module's docstring says why these)."""
    return 128 if nproc == 1 else 32


def _launch(rounds: int, block: int, configs: str, timeout: float, job: str, nproc: int, every: Optional[int]) -> Dict[str, Any]:
    """One launch of the workers under torchrun: the raw figures rank 0 wrote."""
    from .common import TORCHRUN, env

    with tempfile.TemporaryDirectory(prefix="steadfast-step-cost-") as tmp:
        out = Path(tmp) / "times.json"
        cmd = [
            TORCHRUN,
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            str(Path(__file__).resolve()),
            "--worker",
            "--rounds",
            str(rounds),
            "--block",
            str(block),
            "--dir",
            tmp,
            "--out",
            str(out),
            "--job",
            job,
            "--control-every",
            str(every or control_every(nproc)),
            *(["--configs", configs] if configs else []),
        ]
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"step_cost workers failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        raw: Dict[str, Any] = json.loads(out.read_text())
        return raw


def measure(
    rounds: int,
    block: int,
    configs: str = "",
    timeout: float = 900,
    job: str = "hot",
    nproc: int = 2,
    every: Optional[int] = None,
    processes: int = 1,
) -> Dict[str, Any]:
    from steadfast.loop.memory_cadence import MEMORY_SHARE, auto_interval

    runs = [_launch(rounds, block, configs, timeout, job, nproc, every) for _ in range(max(1, processes))]
    # every launch's blocks together: the medians below are over them all
    raw = {k: runs[0][k] for k in ("agreement_every", "run_agreement_every", "snapshot_bytes")}
    for key in ("seconds_per_step", "cpu_seconds_per_step", "fetch_seconds_per_step"):
        raw[key] = {name: [x for r in runs for x in r[key][name]] for name in runs[0][key]}
    # run.step amortised: the mean of each launch's blocks, then the median of the launches (the same code
    # reads 13-20 us a quiet step from one process to the next here, with its memory's placement: bench/NOTES.md)
    stepping = [r["run_step_seconds_per_step"] for r in runs if r.get("run_step_seconds_per_step")]
    amortised = [statistics.fmean(s) * 1e6 for s in stepping]
    per = {k: statistics.median(v) for k, v in raw["seconds_per_step"].items()}
    cpu = {k: statistics.median(v) for k, v in raw["cpu_seconds_per_step"].items()}
    first = next(iter(per))  # "bare", unless --configs says otherwise
    bare, bare_cpu = per[first], cpu[first]
    snapshot = {}
    if "snapshot" in per:  # what snapshot.every_n_steps=auto makes of this cost (steadfast.loop.memory_cadence)
        cost = per["snapshot"] - bare
        every = auto_interval(max(cost, 0.0), bare)
        snapshot = {
            "bytes_per_node": raw.get("snapshot_bytes"),
            "cost_ms": cost * 1e3,
            "every_step_share_of_step": cost / bare,
            "auto_every_n_steps": every,
            "auto_share_of_step": cost / every / bare,
            "target_share": MEMORY_SHARE,
        }
    return {
        "job": job,
        "nproc": nproc,
        "processes": len(runs),
        "rounds": rounds,
        "block_steps": block,
        "agreement_every": raw["agreement_every"],
        "run_agreement_every": raw["run_agreement_every"],
        # timed around the calls on rank 0, medians of the blocks: fetching each configuration's batch, and
        # `run`'s run.step (the hooks in the forward and the control plane's threads not in it): a direct,
        # low-noise view of the library's own per-step work. The median leaves out the blocks with a
        # control-plane message (one every 128 steps, ~0.65 ms); the mean of the blocks counts every step
        # (amortised: what the target holds)
        "fetch_us_per_step": {k: statistics.median(v) * 1e6 for k, v in raw["fetch_seconds_per_step"].items()},
        "run.step_us_per_step": statistics.median([x for s in stepping for x in s]) * 1e6 if stepping else None,
        "run.step_us_per_step_amortised": statistics.median(amortised) if amortised else None,
        "run.step_us_per_step_amortised_per_process": [round(a, 2) for a in amortised],
        "snapshot": snapshot,
        "ms_per_step": {k: v * 1e3 for k, v in per.items()},
        "extra_us_per_step": {k: (v - bare) * 1e6 for k, v in per.items()},
        "bare/config steps_per_s": {k: bare / v for k, v in per.items()},
        "cpu_ms_per_step (both workers)": {k: v * 1e3 for k, v in cpu.items()},
        "extra_cpu_us_per_step": {k: (v - bare_cpu) * 1e6 for k, v in cpu.items()},
        "bare/config steps per CPU-second": {k: bare_cpu / v for k, v in cpu.items()},
        "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in raw["seconds_per_step"].items()},
        "cpu_samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in raw["cpu_seconds_per_step"].items()},
    }


def report(res: Dict[str, Any]) -> None:
    print(
        f"\nStep cost ({res['job']} job, {res.get('nproc', 2)} rank(s), {res['rounds']} rounds of {res['block_steps']}-step blocks; agreement every"
        f" {res['agreement_every']} steps, {res['run_agreement_every']} in `run`)"
    )
    if res.get("run.step_us_per_step") is not None:
        fetch = res["fetch_us_per_step"]
        print(
            f"  timed around the calls (rank 0): run.step {res['run.step_us_per_step_amortised']:.1f} us per step amortised"
            f" (mean of blocks; the median of {res.get('processes', 1)} launches':"
            f" {', '.join(f'{v:.1f}' for v in res.get('run.step_us_per_step_amortised_per_process', []))}),"
            f" {res['run.step_us_per_step']:.1f} us median of blocks;"
            " a batch from " + ", ".join(f"{k} {fetch[k]:.1f} us" for k in ("bare", "loader", "dataloader", "run") if k in fetch)
        )
    snap = res.get("snapshot")
    if snap:
        print(
            f"  snapshot: {snap['cost_ms']:.3f} ms ({100 * snap['every_step_share_of_step']:.1f}% of a step) every step;"
            f" auto: every {snap['auto_every_n_steps']} step(s), {100 * snap['auto_share_of_step']:.2f}% of a step"
        )
    for k in res["ms_per_step"]:
        print(
            f"  {k:<10} {res['ms_per_step'][k]:7.3f} ms/step  {res['extra_us_per_step'][k]:+8.1f} us  "
            f"speed vs bare {res['bare/config steps_per_s'][k]:.3f}   CPU {res['cpu_ms_per_step (both workers)'][k]:7.3f} ms/step"
            f"  {res['extra_cpu_us_per_step'][k]:+8.1f} us  per CPU-second vs bare {res['bare/config steps per CPU-second'][k]:.3f}"
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--block", type=int, default=20)
    p.add_argument(
        "--configs", default="", help=f"comma-separated, from {', '.join(CONFIGS)} (NAME@N: the agreement every N steps)"
    )
    p.add_argument("--job", choices=("hot", "tiny"), default="hot", help="the hot-loop job, or section 7's tiny model")
    p.add_argument("--nproc", type=int, default=2, help="ranks (1: one rank alone, a core to itself)")
    p.add_argument(
        "--control-every",
        type=int,
        default=None,
        help="the control plane's message every N steps (default: 128 alone, 32 with 2 ranks)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="launches of the workers, one after the other; run.step amortised is the median of theirs",
    )
    p.add_argument("--quick", action="store_true", help="15 rounds")
    p.add_argument("--tiny", action="store_true", help="1 round of 5-step blocks (smoke test)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    from .common import RESULTS, command_line, log, machine, write_json

    rounds, block = (15 if args.quick else args.rounds), args.block
    if args.tiny:
        rounds, block = 1, 5
    log(f"step cost: {args.nproc} rank(s), {rounds} rounds of {block}-step blocks")
    out = {
        "benchmark": "step_cost",
        "command": command_line("bench.step_cost", argv),
        "machine": machine(),
        **measure(
            rounds, block, args.configs, job=args.job, nproc=args.nproc, every=args.control_every, processes=args.processes
        ),
    }
    report(out)
    write_json(args.json or RESULTS / "step_cost.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
