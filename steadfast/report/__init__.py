"""What happened in a run, in words and in a picture: `python -m pipeline.report outputs/<run.name>`.

Prints a summary (status, epochs, steps, each attempt of the run with how it ended and the work
it lost, checkpoints committed and verified, time on useful steps against restarts and
checkpointing = goodput) and writes report.png in the folder: the loss against the step, with
the restarts, preemptions and checkpoints marked on it, and a timeline of the attempts.

Given a sweep folder (a folder of run folders), it summarises every job and writes a comparison
plot (loss curves and the time breakdown of each job) to <sweep folder>/report.png.

Everything comes from the run folder's records: events.jsonl (the launcher's and the workers'
events), metrics.jsonl, summary.json and the checkpoints themselves, which are verified
against their manifests. Times are wall-clock times of one machine's records.

The time breakdown of a run (all launches of the same run folder together):
  useful       steps that are part of the final model, at the measured time per step
  redone       steps trained and then lost to a failure (trained again after the resume)
  checkpoint   time training waited for checkpoints (the whole save when synchronous, the
               snapshot when asynchronous)
  start-up     from a launch or a failure to the first step of the next attempt: process start,
               rendezvous, restore (restarts included)
  other        the rest: validation, shutdown, the watchdog's detection time, waiting
goodput = useful / wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..checkpoint import manifest as mf

EVENTS, METRICS, SUMMARY, PNG = "events.jsonl", "metrics.jsonl", "summary.json", "report.png"
LAUNCH_END = ("job_completed", "job_failed", "job_interrupted", "job_stopped")
FAILURE_FAULTS = ("kill", "crash_in_save", "exception", "save_error")


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(record, dict):
            out.append(record)
    return out


@dataclass
class Attempt:
    """One incarnation of the worker group: from its launch (or the failure before it) to its end."""

    index: int
    launch: int
    restart: int
    start: float
    first_step: Optional[float] = None
    end: Optional[float] = None
    resumed_from: int = 0
    last_step: Optional[int] = None
    outcome: str = "unknown"  # completed | preempted | failed | stopped | unknown
    cause: str = ""
    lost_steps: int = 0
    step_time: Optional[float] = None
    checkpoints: List[Tuple[float, int]] = field(default_factory=list)  # (time, step)
    hung: Optional[Tuple[float, float]] = None  # (last progress, detection) when the watchdog found it stuck


@dataclass
class RunReport:
    folder: Path
    name: str
    summary: Dict[str, Any]
    events: List[Dict[str, Any]]
    metrics: List[Dict[str, Any]]
    launches: List[Tuple[float, float]]  # (start, end) of each launch of this run folder
    attempts: List[Attempt]
    breakdown: Dict[str, float]
    checkpoints_saved: int
    checkpoints_on_disk: List[Tuple[int, Optional[str]]]  # (step, problem or None when verified)
    invalid_on_resume: List[Dict[str, Any]]
    faults: List[Dict[str, Any]]
    preemptions: List[Dict[str, Any]]

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "running or killed" if self.events else "no record"))

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - len(self.launches))

    @property
    def wall(self) -> float:
        return sum(b - a for a, b in self.launches)

    @property
    def goodput(self) -> Optional[float]:
        return self.breakdown["useful"] / self.wall if self.wall > 0 else None


# ---- reading a run -------------------------------------------------------------------------------
def analyse(folder: Path) -> RunReport:
    folder = Path(folder)
    events = sorted(read_jsonl(folder / EVENTS), key=lambda e: e.get("time", 0))
    metrics = read_jsonl(folder / METRICS)
    try:
        summary = json.loads((folder / SUMMARY).read_text())
    except (OSError, ValueError):
        summary = {}
    launches: List[Tuple[float, float]] = []
    attempts: List[Attempt] = []
    current: Dict[int, Attempt] = {}  # restart -> attempt, in the current launch
    launch = -1
    for e in events:
        kind, t = e.get("event"), float(e.get("time", 0))
        if kind == "launch":
            launch += 1
            launches.append((t, t))
            current = {}
            continue
        if launch < 0:  # events before any launch record (an old folder): one implicit launch
            launch = 0
            launches.append((t, t))
        launches[-1] = (launches[-1][0], max(launches[-1][1], t))
        restart = e.get("restart")
        if kind in ("attempt_started", "resumed", "first_step") and isinstance(restart, int):
            a = current.get(restart)
            if a is None:
                prev_end = attempts[-1].end if attempts and attempts[-1].launch == launch else None
                a = Attempt(index=len(attempts), launch=launch, restart=restart, start=prev_end or launches[-1][0])
                current[restart] = a
                attempts.append(a)
            if kind == "resumed":
                a.resumed_from = int(e.get("step", 0))
            elif kind == "first_step":
                a.first_step = t
            continue
        a = current.get(restart) if isinstance(restart, int) else None
        if kind == "attempt_ended" and a is not None:
            a.end = t
            a.last_step = max(a.last_step or -1, int(e.get("last_step", -1)))
        elif kind == "checkpoint_saved" and a is not None:
            a.checkpoints.append((t, int(e.get("step", 0))))
            a.last_step = max(a.last_step or -1, int(e.get("step", 0)))
        elif kind == "training_completed" and a is not None:
            a.outcome, a.cause = "completed", "completed"
            a.last_step = max(a.last_step or -1, int(e.get("step", 0)))
            a.end = a.end or t
        elif kind == "preempted" and a is not None:
            a.outcome, a.cause = "preempted", f"preempted by {e.get('signal')} at step {e.get('step')} (saved)"
            a.last_step = max(a.last_step or -1, int(e.get("step", 0)))
        elif kind == "memory_limit" and a is not None:
            a.outcome, a.cause = "stopped", f"memory limit at step {e.get('step')} (saved)"
        elif kind == "hang_detected" and a is not None and a.outcome == "unknown":
            a.outcome = "failed"
            where = str(e.get("where", "")).replace(str(Path.cwd()) + "/", "")
            a.cause = f"hang: rank {e.get('rank')} at step {e.get('step')} ({where})"
            a.hung = (t - float(e.get("seconds_without_progress", 0)), t)
            a.end = a.end or t
        elif kind == "fault_fired" and a is not None and e.get("fault") in FAILURE_FAULTS and a.outcome == "unknown":
            a.outcome, a.cause = "failed", f"fault={e.get('fault')} on rank {e.get('rank')} at step {e.get('step')}"
            a.last_step = max(a.last_step or -1, int(e.get("step", 0)))
        elif kind == "worker_failed" and a is not None and a.outcome == "unknown":
            a.outcome, a.cause = "failed", f"rank {e.get('rank')}: {e.get('error')}"
        elif kind == "preemption_grace_expired":
            for a in current.values():
                if a.outcome == "unknown":
                    a.outcome, a.cause = "preempted", f"preempted by {e.get('signal')}: not saved within the grace period"
        elif kind in LAUNCH_END:
            for a in current.values():
                if a.end is None:
                    a.end = t
                if a.outcome == "unknown" and kind == "job_interrupted":
                    a.outcome, a.cause = "preempted", f"stopped by {e.get('signal')}"
    for a in attempts:  # whatever ended an attempt without a cause of its own: the launcher's word
        if a.outcome == "unknown" and a is not attempts[-1]:
            a.outcome, a.cause = "failed", "a worker died without recording an error (killed by a signal?)"
        if a.end is None:
            a.end = launches[a.launch][1]
    # the work each attempt lost: what it reached beyond the step the next attempt resumed from
    for a, nxt in zip(attempts, attempts[1:]):
        if a.last_step is not None and a.outcome != "completed":
            a.lost_steps = max(0, a.last_step - nxt.resumed_from)
    _step_times(attempts, metrics)
    breakdown = _breakdown(attempts, events, launches)
    ckpt_dir = Path(summary.get("checkpoint_dir") or folder / "checkpoints")
    on_disk = verify_checkpoints(ckpt_dir)
    return RunReport(
        folder=folder, name=folder.name, summary=summary, events=events, metrics=metrics, launches=launches,
        attempts=attempts, breakdown=breakdown,
        checkpoints_saved=sum(1 for e in events if e.get("event") == "checkpoint_saved"),
        checkpoints_on_disk=on_disk,
        invalid_on_resume=[e for e in events if e.get("event") == "checkpoint_invalid"],
        faults=[e for e in events if e.get("event") == "fault_fired"],
        preemptions=[e for e in events if e.get("event") in ("preempted", "preemption_grace_expired")],
    )


def _step_times(attempts: List[Attempt], metrics: List[Dict[str, Any]]) -> None:
    """Seconds per step of each attempt: the median over consecutive logged steps."""
    rows = sorted((r for r in metrics if "loss" in r and "time" in r), key=lambda r: r["time"])
    every: List[float] = []
    for a in attempts:
        mine = [r for r in rows if a.start <= r["time"] <= (a.end or 1e18) and r.get("restart") == a.restart]
        gaps = [(b["time"] - x["time"]) / (b["step"] - x["step"]) for x, b in zip(mine, mine[1:]) if b["step"] > x["step"]]
        if gaps:
            a.step_time = statistics.median(gaps)
            every += gaps
    fallback = statistics.median(every) if every else None
    for a in attempts:
        if a.step_time is None:
            a.step_time = fallback


def _breakdown(attempts: List[Attempt], events: List[Dict[str, Any]], launches: List[Tuple[float, float]]) -> Dict[str, float]:
    wall = sum(b - a for a, b in launches)
    startup = sum(((a.first_step or a.end or a.start) - a.start) for a in attempts)
    snapshots = {(e.get("pid"), e.get("step")) for e in events if e.get("event") == "checkpoint_snapshot"}
    checkpoint = sum(float(e.get("blocked_seconds", 0)) for e in events if e.get("event") == "checkpoint_snapshot")
    checkpoint += sum(float(e.get("seconds", 0)) for e in events
                      if e.get("event") == "checkpoint_saved" and (e.get("pid"), e.get("step")) not in snapshots)
    useful = redone = 0.0
    for a, nxt in zip(attempts, attempts[1:] + [None]):
        reached = a.last_step if a.last_step is not None else a.resumed_from
        kept_to = min(reached, nxt.resumed_from) if nxt is not None else reached
        useful += max(0, kept_to - a.resumed_from) * (a.step_time or 0.0)
        redone += a.lost_steps * (a.step_time or 0.0)
    hung = sum(b - a for a, b in (x.hung for x in attempts if x.hung))
    other = max(0.0, wall - startup - checkpoint - useful - redone - hung)
    return {"wall": wall, "useful": useful, "redone": redone, "checkpoint": checkpoint, "startup": startup, "hung": hung,
            "other": other}


def verify_checkpoints(folder: Path) -> List[Tuple[int, Optional[str]]]:
    """Every committed checkpoint on disk, newest first, with None when its files match the manifest."""
    from ..checkpoint.tensorfile import read_verified

    out: List[Tuple[int, Optional[str]]] = []
    for step, path in mf.committed(folder):
        try:
            manifest = mf.read(path)
            for name, spec in manifest["files"].items():
                read_verified(path / name, spec["bytes"], spec["checksum"])
            out.append((step, None))
        except (OSError, ValueError, KeyError) as exc:
            out.append((step, str(exc)))
    return out


def is_run(folder: Path) -> bool:
    return (folder / EVENTS).is_file()


def find_runs(folder: Path) -> List[Path]:
    """The run folders under a sweep folder (any depth up to 3), in name order."""
    found = sorted({p.parent for pattern in ("*/" + EVENTS, "*/*/" + EVENTS, "*/*/*/" + EVENTS) for p in folder.glob(pattern)})
    return [p for p in found if p != folder]


# ---- words ---------------------------------------------------------------------------------------
def _s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _fmt(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def format_run(r: RunReport) -> str:
    s, b = r.summary, r.breakdown
    lines = [f"Run {r.folder}: {r.status}"]
    if s.get("error"):
        lines.append(f"  error: {s['error']}")
    lines.append(f"  epochs {s.get('epochs_completed', '-')}, steps {s.get('global_step', '-')}, final train loss "
                 f"{_fmt(s.get('final_loss'))}, val loss {_fmt(s.get('val_loss'))}, val accuracy {_fmt(s.get('val_accuracy'), '.3f')}")
    if s.get("model_sha256"):
        lines.append(f"  model_sha256 {s['model_sha256']}")
    lines.append(f"  launches {len(r.launches)}, attempts {len(r.attempts)}, restarts {r.restarts}, "
                 f"preemptions {sum(1 for a in r.attempts if a.outcome == 'preempted')}, faults injected {len(r.faults)}")
    if r.wall > 0:
        gp = r.goodput or 0.0
        lines.append(f"  wall {_s(r.wall)}: useful steps {_s(b['useful'])} (goodput {100 * gp:.1f}%), redone steps "
                     f"{_s(b['redone'])}, checkpointing {_s(b['checkpoint'])}, start-up and restarts {_s(b['startup'])}, "
                     f"hung until detected {_s(b['hung'])}, other (validation, shutdown) {_s(b['other'])}")
    if r.attempts:
        lines.append("  attempts:")
        t0 = r.launches[0][0] if r.launches else 0.0
        lines.append(f"    {'#':>2}  {'launch':>6}  {'restart':>7}  {'start':>8}  {'resumed':>7}  {'reached':>7}  {'lost':>4}  how it ended")
        for a in r.attempts:
            lines.append(f"    {a.index:>2}  {a.launch:>6}  {a.restart:>7}  {'+' + _s(a.start - t0).replace(' ', ''):>8}  {a.resumed_from:>7}  "
                         f"{a.last_step if a.last_step is not None else '-':>7}  {a.lost_steps:>4}  {a.cause or a.outcome}")
    verified = sum(1 for _, problem in r.checkpoints_on_disk if problem is None)
    lines.append(f"  checkpoints: {r.checkpoints_saved} committed during the run, {len(r.checkpoints_on_disk)} kept on disk, "
                 f"{verified} verified against their manifests"
                 + (f", newest step {r.checkpoints_on_disk[0][0]}" if r.checkpoints_on_disk else ""))
    for step, problem in r.checkpoints_on_disk:
        if problem:
            lines.append(f"    step {step}: DAMAGED: {problem}")
    for e in r.invalid_on_resume:
        lines.append(f"    found unusable on resume: step {e.get('step')}: {e.get('error')}")
    for e in r.faults:
        lines.append(f"  fault fired: {e.get('fault')} on rank {e.get('rank')} at step {e.get('step')} (restart {e.get('restart')})")
    return "\n".join(lines)


# ---- pictures ------------------------------------------------------------------------------------
PARTS = [("useful", "#2ca02c"), ("redone", "#d62728"), ("checkpoint", "#1f77b4"), ("startup", "#c7c7c7"),
         ("hung", "#f4b6b6"), ("other", "#ffdd88")]
COLORS = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#2ca02c"]
OUTCOME = {"completed": ("#2ca02c", "completed"), "preempted": ("#ff7f0e", "preempted"), "failed": ("#d62728", "failed"),
           "stopped": ("#ff7f0e", "stopped"), "unknown": ("#7f7f7f", "?")}


def _compressed_times(r: RunReport) -> Tuple[Any, List[Tuple[float, float, float]]]:
    """Map wall times to a timeline where the idle gaps between launches shrink to 4% of the span."""
    spans = r.launches or [(0.0, 1.0)]
    busy = sum(b - a for a, b in spans) or 1.0
    gap = 0.04 * busy
    offsets: List[Tuple[float, float, float]] = []  # (launch start, launch end, x of launch start)
    x = 0.0
    for a, b in spans:
        offsets.append((a, b, x))
        x += (b - a) + gap

    def to_x(t: float) -> float:
        for a, b, x0 in offsets:
            if t <= b + 1e-6:
                return x0 + max(0.0, t - a)
        a, b, x0 = offsets[-1]
        return x0 + (t - a)

    return to_x, offsets


def plot_run(r: RunReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, tl, bar) = plt.subplots(3, 1, figsize=(11, 7.6), dpi=100, gridspec_kw={"height_ratios": [3.2, 1.3, 0.45]})
    gp = r.goodput
    fig.suptitle(f"{r.name}: {r.status}, {r.summary.get('global_step', '?')} steps, {r.restarts} restart(s), "
                 f"goodput {100 * gp:.0f}%" if gp is not None else f"{r.name}: {r.status}", fontsize=12, fontweight="bold")

    # -- loss against step, one colour per attempt; what a failure threw away is shaded
    rows = [m for m in r.metrics if "loss" in m and "step" in m]
    for a in r.attempts:
        mine = [m for m in rows if a.start <= m.get("time", 0) <= (a.end or 1e18) and m.get("restart") == a.restart]
        if mine:
            ax.plot([m["step"] for m in mine], [m["loss"] for m in mine], "-", lw=1.4, color=COLORS[a.index % len(COLORS)],
                    label=f"attempt {a.index} (train loss)")
    val = sorted(((m["step"], m["val_loss"]) for m in r.metrics if m.get("val_loss") is not None), key=lambda v: v[0])
    if val:
        ax.plot(*zip(*val), "o--", ms=3.5, lw=1, color="black", alpha=0.7, label="val loss (per epoch)")
    values = [m["loss"] for m in rows] + [v for _, v in val]
    log_scale = bool(values) and min(values) > 0 and max(values) / min(values) > 30
    marked = 0
    for a in r.attempts:
        if a.lost_steps and a.last_step is not None:
            ax.axvspan(a.last_step - a.lost_steps, a.last_step, color="#d62728", alpha=0.12, lw=0)
        if a.outcome in ("failed", "preempted", "stopped") and a.last_step is not None:
            color = OUTCOME[a.outcome][0]
            ax.axvline(a.last_step, color=color, ls="--", lw=1.3)
            short = a.cause.split(" (")[0] if a.outcome == "failed" else a.cause.split(" at step")[0]
            label = f"{short}" + (f"\n{a.lost_steps} step(s) redone" if a.lost_steps else "\nno step lost")
            ax.annotate(label, (a.last_step, 0.97 - 0.14 * (marked % 3)), xycoords=("data", "axes fraction"), xytext=(4, 0),
                        textcoords="offset points", va="top", fontsize=8, color=color,
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
            marked += 1
    ckpts = sorted({step for a in r.attempts for _, step in a.checkpoints})
    if ckpts:
        ax.plot(ckpts, [0.0] * len(ckpts), "^", color="#2ca02c", ms=7, clip_on=False, transform=ax.get_xaxis_transform(),
                label="checkpoint committed")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if log_scale else ""))
    if log_scale:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=6, frameon=False)

    # -- the attempts on a timeline (idle gaps between launches compressed)
    to_x, offsets = _compressed_times(r)
    for a in r.attempts:
        color = COLORS[a.index % len(COLORS)]
        start, first, end = to_x(a.start), to_x(a.first_step) if a.first_step else None, to_x(a.end or a.start)
        tl.barh(0, (first or end) - start, left=start, color="#c7c7c7", height=0.5)
        if first is not None:
            tl.barh(0, end - first, left=first, color=color, height=0.5)
        if a.hung:
            h0, h1 = to_x(a.hung[0]), to_x(a.hung[1])
            tl.barh(0, h1 - h0, left=h0, color="#f4b6b6", hatch="xx", ec="#d62728", lw=0, height=0.5)
        for t, _ in a.checkpoints:
            tl.plot([to_x(t)] * 2, [-0.25, 0.25], color="#2ca02c", lw=1.5)
        mcolor, word = OUTCOME[a.outcome]
        tl.plot(end, 0, "X" if a.outcome == "failed" else "s" if a.outcome in ("preempted", "stopped") else "o",
                color=mcolor, ms=9, mec="black", mew=0.6)
        what = "hung" if a.hung else "killed" if a.cause.startswith("fault=kill") else word
        tl.text((start + end) / 2, 0.42, f"#{a.index} {what}" + (f", from step {a.resumed_from}" if a.resumed_from else ""),
                ha="center", va="bottom", fontsize=8)
    for (a0, b0, x0), (a1, _, x1) in zip(offsets, offsets[1:]):
        tl.axvspan(x0 + (b0 - a0), x1, color="white", hatch="//", ec="#999999", lw=0)
        tl.text((x0 + (b0 - a0) + x1) / 2, -0.45, f"re-run\n+{_s(a1 - b0)}", ha="center", va="top", fontsize=7, color="#555555")
    tl.set_yticks([])
    tl.set_ylim(-0.9, 0.9)
    tl.set_xlabel("seconds since the first launch  (grey: start-up and restore; hatched red: hung until the watchdog "
                  "acted; green ticks: checkpoints; idle time between launches compressed)", fontsize=8)
    tl.grid(axis="x", alpha=0.3)

    # -- where the time went
    b = r.breakdown
    left = 0.0
    for key, color in PARTS:
        width = b[key] / b["wall"] if b["wall"] else 0
        bar.barh(0, width, left=left, color=color, height=0.8)
        if width > 0.06:
            bar.text(left + width / 2, 0, f"{key} {100 * width:.0f}%", ha="center", va="center", fontsize=8)
        left += width
    bar.set_xlim(0, 1)
    bar.set_yticks([])
    bar.set_xticks([])
    bar.set_title(f"where the wall time went ({_s(b['wall'])})", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(reports: Sequence[RunReport], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bar) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=100, gridspec_kw={"width_ratios": [1.5, 1]})
    fig.suptitle(f"sweep folder {Path(path).parent.name}: {len(reports)} job(s)", fontsize=12, fontweight="bold")
    for i, r in enumerate(reports):
        color = COLORS[i % len(COLORS)]
        val = sorted(((m["step"], m["val_loss"]) for m in r.metrics if m.get("val_loss") is not None), key=lambda v: v[0])
        train = sorted(((m["step"], m["loss"]) for m in r.metrics if "loss" in m), key=lambda v: v[0])
        if train:
            ax.plot(*zip(*train), "-", lw=1, alpha=0.45, color=color)
        if val:
            ax.plot(*zip(*val), "o-", ms=3, lw=1.6, color=color, label=f"{r.name} ({r.status})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (faint: train, dots: validation)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    names = [r.name if len(r.name) <= 28 else r.name[:25] + "..." for r in reports]
    for key, color in PARTS:
        lefts = []
        for i, r in enumerate(reports):
            left = sum(r.breakdown[k] for k, _ in PARTS[: [p[0] for p in PARTS].index(key)])
            lefts.append(left)
        bar.barh(range(len(reports)), [r.breakdown[key] for r in reports], left=lefts, color=color, label=key)
    for i, r in enumerate(reports):
        bar.text(r.breakdown["wall"], i, f" {r.restarts} restart(s)", va="center", fontsize=7)
    bar.set_yticks(range(len(reports)))
    bar.set_yticklabels(names, fontsize=7)
    bar.invert_yaxis()
    bar.set_xlabel("wall seconds")
    bar.set_xlim(0, 1.3 * max([r.breakdown["wall"] for r in reports] + [1e-9]))
    bar.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(PARTS), frameon=False)
    bar.set_title("where the time went", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_sweep(folder: Path, reports: Sequence[RunReport]) -> str:
    lines = [f"Sweep {folder}: {len(reports)} job(s)"]
    lines.append(f"  {'job':<40}  {'status':<11}  {'steps':>6}  {'val loss':>8}  {'restarts':>8}  {'goodput':>7}  {'wall':>8}")
    for r in reports:
        gp = f"{100 * r.goodput:.0f}%" if r.goodput is not None else "-"
        lines.append(f"  {r.name[:40]:<40}  {r.status:<11}  {r.summary.get('global_step', '-'):>6}  "
                     f"{_fmt(r.summary.get('val_loss')):>8}  {r.restarts:>8}  {gp:>7}  {_s(r.wall):>8}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run folder (outputs/<run.name>) or a sweep folder")
    parser.add_argument("--no-plot", action="store_true", help="only print the summary")
    args = parser.parse_args(argv)
    folder: Path = args.folder
    if not folder.is_dir():
        print(f"{folder}: no such folder", file=sys.stderr)
        return 2
    if is_run(folder):
        r = analyse(folder)
        print(format_run(r))
        if not args.no_plot:
            print(f"  picture: {plot_run(r, folder / PNG)}")
        return 0
    runs = find_runs(folder)
    if not runs:
        print(f"{folder}: neither a run folder ({EVENTS} missing) nor a folder of runs", file=sys.stderr)
        return 2
    reports = [analyse(p) for p in runs]
    print(format_sweep(folder, reports))
    for r in reports:
        print()
        print(format_run(r))
    if not args.no_plot:
        print(f"\ncomparison picture: {plot_sweep(reports, folder / PNG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
