"""Shared by the benchmark scripts: the job, running ours and the baseline, reading what they leave.

Every timing here is wall clock (time.time()) on one machine, so the trainer's records
(events.jsonl, metrics.jsonl), the baseline's records and the benchmark's own clock compare.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from steadfast.contract import events as event_log
from steadfast.contract.events import Event
from steadfast.contract.files import METRICS_FILE, read_jsonl

from .cpu import CpuSampler, cpu_counters, foreign_load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
TRACE_DIR = Path(__file__).resolve().parent / "trace"
PY = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


# ---- the machine ------------------------------------------------------------------------------
def machine() -> Dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover
        torch_version = "?"
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "torch": torch_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }


def command_line(module: str, argv: Optional[Sequence[str]]) -> str:
    return " ".join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def write_json(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def restored_from(run: "Run") -> Dict[str, int]:
    """How many of a run's resumes restored from each source (memory, disk)."""
    sources = [e.get("source", "disk") for e in run.events if e.get("event") == Event.RESUMED]
    return {k: sources.count(k) for k in sorted(set(sources))}


def sources_text(counts: Optional[Dict[str, int]], unit: str = "") -> str:
    """`memory 19, disk 1`: restored_from's counts as one table cell."""
    return ", ".join(f"{src} {n}{unit}" for src, n in (counts or {}).items())


def spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
    v = [x for x in values if x is not None]
    return {"median": median(v), "min": min(v) if v else None, "max": max(v) if v else None, "n": len(v), "samples": v}


# ---- the job ----------------------------------------------------------------------------------
@dataclass
class Job:
    """The same training job for ours (Hydra overrides) and for the baseline (its flags)."""

    num_samples: int = 2048
    num_features: int = 32
    num_classes: int = 4
    hidden: Tuple[int, ...] = (64, 64)
    batch_size: int = 32
    epochs: int = 1
    log_every: int = 10
    workers: int = 2
    threads: Optional[int] = None  # torch threads per worker (None: both sides use cores / workers)

    def overrides(self, backend: str = "torchrun") -> List[str]:
        workers = (
            [f"backend.nproc_per_node={self.workers}"]
            if backend == "torchrun"
            else ["backend=horovod", f"backend.np={self.workers}"]
        )
        return [
            "data=synthetic",
            f"data.num_samples={self.num_samples}",
            f"data.num_features={self.num_features}",
            f"data.num_classes={self.num_classes}",
            f"data.batch_size={self.batch_size}",
            f"model.hidden_sizes=[{','.join(map(str, self.hidden))}]",
            f"trainer.max_epochs={self.epochs}",
            f"trainer.log_every_n_steps={self.log_every}",
            *workers,
            *([f"trainer.num_threads={self.threads}"] if self.threads else []),
        ]

    def baseline_args(self) -> List[str]:
        return [
            "--num-samples",
            str(self.num_samples),
            "--num-features",
            str(self.num_features),
            "--num-classes",
            str(self.num_classes),
            "--hidden",
            ",".join(map(str, self.hidden)),
            "--batch-size",
            str(self.batch_size),
            "--epochs",
            str(self.epochs),
            "--log-every",
            str(self.log_every),
            *(["--threads", str(self.threads)] if self.threads else []),
        ]

    def params(self) -> int:
        width, total = self.num_features, 0
        for h in (*self.hidden, self.num_classes):
            total += width * h + h
            width = h
        return total

    def steps_per_epoch(self) -> int:
        train = self.num_samples - max(1, round(self.num_samples * 0.2))
        per_worker = (train - train % self.workers) // self.workers
        return -(-per_worker // self.batch_size)

    def describe(self) -> Dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "parameters": self.params(),
            "parameter_MB": round(self.params() * 4 / 1e6, 2),
            "steps_per_epoch": self.steps_per_epoch(),
        }


# Tiny: the synthetic data's defaults (start-up and recovery are not diluted by work).
TINY = Job()
# Hot loop: a step takes ~10 ms on this machine; one epoch of 384 steps per worker, so the
# measured window has no epoch end (validation) in it.
HOT = Job(num_samples=61440, num_features=256, hidden=(512, 512), batch_size=64, epochs=1, log_every=10)


# ---- running ----------------------------------------------------------------------------------
def env(trace: Optional[Path] = None, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    e = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "launchers")]
    if trace is not None:
        paths.insert(0, str(TRACE_DIR))
        e["STEADFAST_BENCH_TRACE"] = str(trace)
    else:
        e.pop("STEADFAST_BENCH_TRACE", None)
    e["PYTHONPATH"] = os.pathsep.join([*paths, e.get("PYTHONPATH", "")]).strip(os.pathsep)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("HYDRA_FULL_ERROR", None)
    e.update(extra or {})
    return e


@dataclass
class Run:
    kind: str  # "ours" | "baseline"
    started: float  # time.time() just before the process was created
    wall: float
    returncode: Optional[int]
    output: str
    folder: Path  # ours: the run folder; baseline: the folder of its records file
    events: List[Dict[str, Any]] = field(default_factory=list)
    metrics: List[Dict[str, Any]] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)
    pid: int = 0  # of the command's process (the launcher, or torchrun)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 or bool(self.extra.get("aborted_at_exit"))

    def first_step_time(self, restart: int = 0) -> Optional[float]:
        for e in self.events:  # the baseline's records use the same kind name (bench/baseline_ddp.py)
            if e.get("event") == Event.FIRST_STEP and e.get("restart", 0) == restart:
                return float(e["time"])
        return None

    def ttfs(self) -> Optional[float]:
        t = self.first_step_time()
        return t - self.started if t is not None else None

    def step_rows(self) -> List[Dict[str, Any]]:
        return [m for m in self.metrics if "loss" in m and "val_loss" not in m]

    def tail(self, n: int = 3000) -> str:
        return self.output[-n:]


def _communicate(proc: subprocess.Popen, timeout: float) -> Tuple[Optional[int], str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate(timeout=30)
        return None, (out or "") + f"\n[bench] timed out after {timeout} s and was killed"


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Workdir:
    """A scratch folder for the runs of one benchmark (their outputs/ land there); removed at the end."""

    def __init__(self, keep: bool = False) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="steadfast-bench-"))
        self.keep = keep or bool(os.environ.get("STEADFAST_BENCH_KEEP"))  # for debugging a benchmark
        self.count = 0
        self.counters: Optional[Tuple[float, float, float]] = None

    def name(self, label: str) -> str:
        self.count += 1
        return f"{label}-{self.count}"

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "Workdir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_ours(
    work: Workdir,
    name: str,
    overrides: Sequence[str],
    trace: Optional[Path] = None,
    extra_env: Optional[Dict[str, str]] = None,
    python_flags: Sequence[str] = (),
    cli_flags: Sequence[str] = (),
) -> Tuple[subprocess.Popen, float, Path]:
    extra = os.environ.get(
        "STEADFAST_BENCH_OVERRIDES", ""
    ).split()  # extra overrides for every run of ours (debugging a benchmark)
    if "backend=horovod" in overrides:
        extra = [o for o in extra if not o.startswith("backend.")]
    cmd = [PY, *python_flags, "-m", "pipeline.train", *cli_flags, *overrides, *extra, f"run.name={name}"]
    work.counters = cpu_counters()
    started = time.time()
    proc = subprocess.Popen(
        cmd,
        cwd=work.path,
        env=env(trace, extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, started, work.path / "outputs" / name


def finish_ours(
    proc: subprocess.Popen,
    started: float,
    folder: Path,
    timeout: float,
    keep: bool = False,
    counters: Optional[Tuple[float, float, float]] = None,
    sampler: Optional[CpuSampler] = None,
) -> Run:
    rc, out = _communicate(proc, timeout)
    if sampler is not None:
        sampler.stop.set()
    wall = time.time() - started
    run = Run("ours", started, wall, rc, out, folder, event_log.read(folder), read_jsonl(folder / METRICS_FILE), pid=proc.pid)
    if counters is not None:
        run.extra["load"] = foreign_load(counters, wall)
    if sampler is not None:
        run.extra["cpu"] = sampler
    if not keep:
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return run


def run_ours(
    work: Workdir, label: str, overrides: Sequence[str], timeout: float = 300, sample_cpu: bool = False, **kw: Any
) -> Run:
    proc, started, folder = start_ours(work, work.name(label), overrides, **kw)
    sampler = None
    if sample_cpu:
        sampler = CpuSampler(proc.pid)
        sampler.start()
    return finish_ours(proc, started, folder, timeout, counters=work.counters, sampler=sampler)


def run_baseline(
    work: Workdir,
    label: str,
    job: Job,
    timeout: float = 300,
    trace: Optional[Path] = None,
    sample_cpu: bool = False,
    loader: str = "dataloader",
    script: Optional[Path] = None,
    horovod: bool = False,
) -> Run:
    """bench/baseline_ddp.py (or `script`, which takes the same flags: bench/baseline_fsdp.py) under
    torchrun; loader "slices": batches indexed out of the tensors, no DataLoader. horovod: `script`
    (bench/baseline_horovod.py) under `horovodrun -np N` with Gloo, as a user starts it."""
    folder = work.path / "baseline" / work.name(label)
    folder.mkdir(parents=True)
    records = folder / "records.jsonl"
    n = str(job.workers)
    launcher = (
        [HOROVODRUN, "-np", n, "-H", f"localhost:{n}", "--gloo", PY]
        if horovod
        else [TORCHRUN, "--standalone", "--nproc_per_node", n]
    )
    cmd = [
        *launcher,
        str(script or ROOT / "bench" / "baseline_ddp.py"),
        *job.baseline_args(),
        "--loader",
        loader,
        "--out",
        str(records),
    ]
    counters = cpu_counters()
    started = time.time()
    proc = subprocess.Popen(
        cmd, cwd=work.path, env=env(trace), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    sampler = CpuSampler(proc.pid) if sample_cpu else None
    if sampler:
        sampler.start()
    rc, out = _communicate(proc, timeout)
    if sampler:
        sampler.stop.set()
    wall = time.time() - started
    rows = read_jsonl(records)  # the baseline's own records: its kinds ("first_step", "done") are not our events
    events = [{**r, "restart": 0} for r in rows if "event" in r]
    metrics = [{**r, "loss": r.get("loss", 0.0)} for r in rows if "event" not in r]
    extra: Dict[str, Any] = {"load": foreign_load(counters, wall)}
    if sampler:
        extra["cpu"] = sampler
    if rc not in (0, None) and any(e["event"] == "done" for e in events) and "terminate called" in out:
        extra["aborted_at_exit"] = True  # see the end of baseline_ddp.py
    return Run("baseline", started, wall, rc, out, folder, events, metrics, extra=extra, pid=proc.pid)


def check(run: Run, what: str) -> None:
    if not run.ok:
        raise RuntimeError(f"{what}: {run.kind} run failed (exit {run.returncode}):\n{run.tail()}")


# ---- reading the records -------------------------------------------------------------------------
def checkpoint_steps(run: Run) -> List[int]:
    return [int(e["step"]) for e in run.events if e.get("event") in (Event.CHECKPOINT_SAVED, Event.CHECKPOINT_SNAPSHOT)]


def steady_rate(run: Run, warmup_steps: int = 30, exclude_checkpoints: bool = True, how: str = "median") -> Optional[float]:
    """Training steps per second over the logged intervals after warm-up.

    An interval runs from one logged step to the next. Intervals that span an epoch end (the
    trainer validates there; the baseline does not) are left out for both; with
    exclude_checkpoints, so are intervals in which a checkpoint was taken. how="median": the
    median of the intervals' rates (the undisturbed speed: a burst of load from another tenant
    of the machine moves it little); how="mean": all their steps over all their time.
    """
    rows = sorted(run.step_rows(), key=lambda r: r["step"])
    saves = sorted(set(checkpoint_steps(run))) if exclude_checkpoints else []
    steps, seconds, rates = 0.0, 0.0, []
    for a, b in zip(rows, rows[1:]):
        if a["step"] < warmup_steps or a.get("epoch") != b.get("epoch") or a.get("restart", 0) != b.get("restart", 0):
            continue
        if any(a["step"] <= s < b["step"] for s in saves):
            continue
        dt = b["time"] - a["time"]
        steps += b["step"] - a["step"]
        seconds += dt
        if dt > 0:
            rates.append((b["step"] - a["step"]) / dt)
    if how == "median":
        return statistics.median(rates) if rates else None
    return steps / seconds if seconds > 0 else None


def steady_window(run: Run, warmup_steps: int) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """The first logged row at or after warm-up and the last logged row of the same epoch and restart."""
    rows = sorted(run.step_rows(), key=lambda r: r["step"])
    start = next((r for r in rows if r["step"] >= warmup_steps), None)
    if start is None:
        return None
    same = [
        r
        for r in rows
        if r.get("epoch") == start.get("epoch") and r.get("restart", 0) == start.get("restart", 0) and r["step"] > start["step"]
    ]
    return (start, same[-1]) if same else None


def cpu_per_step(run: Run, warmup_steps: int = 30) -> Optional[Dict[str, float]]:
    """CPU seconds per training step over the steady window: the workers', and the launcher's (or torchrun's) own."""
    sampler = run.extra.get("cpu")
    window = steady_window(run, warmup_steps)
    if sampler is None or window is None:
        return None
    a, b = window
    ca, cb = sampler.at(a["time"]), sampler.at(b["time"])
    if ca is None or cb is None:
        return None
    steps, seconds = b["step"] - a["step"], b["time"] - a["time"]
    return {
        "workers_cpu_s_per_step": (cb[1] - ca[1]) / steps,
        "launcher_cpu_s_per_step": (cb[0] - ca[0]) / steps,
        "total_cpu_s_per_step": (cb[0] + cb[1] - ca[0] - ca[1]) / steps,
        "launcher_cpu_share": (cb[0] - ca[0]) / seconds,
        "window_steps": steps,
        "window_s": seconds,
    }


def alternate(
    rounds: int, makers: Sequence[Tuple[str, Callable[[], Run]]], on_run: Optional[Callable[[str, int, Run], None]] = None
) -> Dict[str, List[Run]]:
    """Run every maker once per round, rotating the order each round (ABC, BCA, CAB, ...)."""
    out: Dict[str, List[Run]] = {name: [] for name, _ in makers}
    for r in range(rounds):
        k = r % len(makers)
        for name, make in [*makers[k:], *makers[:k]]:
            run = make()
            out[name].append(run)
            if on_run:
                on_run(name, r, run)
    return out


def aborted_at_exit(runs: Iterable[Run]) -> str:
    runs = list(runs)
    return f"{sum(1 for r in runs if r.extra.get('aborted_at_exit'))} of {len(runs)}"


def foreign(runs: Iterable[Run]) -> Dict[str, Any]:
    """Other tenants' share of the machine during these runs (0: we had it to ourselves)."""
    shares = [r.extra["load"]["foreign_share"] for r in runs if "load" in r.extra]
    return {"median": median(shares), "max": max(shares) if shares else None, "n": len(shares)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
