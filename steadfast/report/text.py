"""The report in words: one run, or the table of a sweep folder's runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence

from .model import DISK, MEMORY, Attempt, RunReport, SlowRank
from .records import DEFAULT_CHECKPOINT_DIR, Summary


def seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _attempt_rows(r: RunReport) -> List[str]:
    with_source = r.resumed_from_memory  # the `from` column only when some attempt restored from memory
    t0 = r.launches[0].start if r.launches else 0.0
    head = f"    {'#':>2}  {'launch':>6}  {'restart':>7}  {'start':>8}  {'resumed':>7}  "
    head += f"{'from':>6}  " if with_source else ""
    lines = ["  attempts:", head + f"{'reached':>7}  {'lost':>4}  how it ended"]
    for a in r.attempts:
        row = (
            f"    {a.index:>2}  {a.launch:>6}  {a.restart:>7}  {'+' + seconds(a.start - t0).replace(' ', ''):>8}  "
            f"{a.resumed_from:>7}  "
        )
        row += f"{a.source or '-':>6}  " if with_source else ""
        lines.append(row + f"{_dash(a.last_step):>7}  {a.lost_steps:>4}  {a.how_it_ended}")
    return lines


def _restores(attempts: Sequence[Attempt]) -> str:
    """How many restores came from memory and from disk, and the steps the attempts before them lost."""
    parts = []
    for source in (MEMORY, DISK):
        mine = [a for a in attempts if a.source == source]
        lost = sum(attempts[a.index - 1].lost_steps for a in mine if a.index > 0)
        parts.append(f"{len(mine)} from {source} ({lost} step(s) lost before them)")
    return "  restores: " + ", ".join(parts)


def _position(s: Summary) -> str:
    """Where the run ended and its training loss, in its loop's terms: steps of run.steps (the loss of
    the last logged window), or epochs (the last epoch's mean loss)."""
    if s.epochs_completed is None and (s.max_steps is not None or s.global_step is not None):
        bound = f"/{s.max_steps}" if s.max_steps is not None else ""
        return f"steps {_dash(s.global_step)}{bound}, train loss (last logged window) {_fmt(s.final_loss)}"
    return f"epochs {_dash(s.epochs_completed)}, steps {_dash(s.global_step)}, train loss (last epoch) {_fmt(s.final_loss)}"


def format_run(r: RunReport) -> str:
    s, b = r.summary, r.breakdown
    lines = [f"Run {r.folder}: {r.status}"]
    for problem in r.problems:
        lines.append(f"  problem: {problem}")
    if s.error:
        lines.append(f"  error: {s.error}")
    lines.append(f"  {_position(s)}, val loss {_fmt(s.val_loss)}, val accuracy {_fmt(s.val_accuracy, '.3f')}")
    if s.model_sha256:
        lines.append(f"  model_sha256 {s.model_sha256}")
    lines.append(
        f"  launches {len(r.launches)}, attempts {len(r.attempts)}, restarts {r.restarts}, "
        f"preemptions {r.preemptions}, faults injected {len(r.faults)}"
    )
    if r.wall > 0:
        lines.append(
            f"  wall {seconds(r.wall)}: useful steps {seconds(b.useful)} (goodput {100 * (r.goodput or 0.0):.1f}%), "
            f"redone steps {seconds(b.redone)}, checkpointing {seconds(b.checkpoint)}, start-up and restarts "
            f"{seconds(b.startup)}, hung until detected {seconds(b.hung)}, other (validation, shutdown) {seconds(b.other)}"
        )
    if r.attempts:
        lines += _attempt_rows(r)
    if r.resumed_from_memory:
        lines.append(_restores(r.attempts))
    verified = sum(1 for c in r.checkpoints_on_disk if c.verified)
    where = "" if r.checkpoint_dir in (None, str(r.folder / DEFAULT_CHECKPOINT_DIR)) else f" in {r.checkpoint_dir}"
    lines.append(
        f"  checkpoints: {r.checkpoints_saved} committed during the run, {len(r.checkpoints_on_disk)} kept on disk"
        f"{where}, {verified} verified against their manifests"
        + (f", newest step {r.checkpoints_on_disk[0].step}" if r.checkpoints_on_disk else "")
    )
    for c in r.checkpoints_on_disk:
        if not c.verified:
            lines.append(f"    step {c.step}: DAMAGED: {c.problem}")
    for u in r.invalid_on_resume:
        lines.append(f"    found unusable on resume: step {_dash(u.step)}: {u.error}")
    for f in r.faults:
        lines.append(f"  fault fired: {f.fault} on rank {_dash(f.rank)} at step {_dash(f.step)} (restart {_dash(f.restart)})")
    lines += [_slow_rank(w) for w in r.slow_ranks]
    lines += [f"  anomaly: {h.describe()}" for h in r.anomalies]
    return "\n".join(lines)


def _slow_rank(w: SlowRank) -> str:
    who = f"rank {_dash(w.rank)}" + (f" on {w.host}" if w.host else "")
    numbers = f"local work {_fmt(w.local_ms, '.1f')} ms per step, the other ranks' median {_fmt(w.median_ms, '.1f')} ms"
    if w.recovered:
        return f"  straggler no longer: {who} from step {_dash(w.step)} ({numbers}; restart {_dash(w.restart)})"
    over = f", +{100 * (w.ratio - 1):.0f}%" if w.ratio is not None else ""
    return (
        f"  straggler: {who} slower than the others from step {_dash(w.step)} ({numbers}{over}, "
        f"{_dash(w.windows)} logging windows in a row; restart {_dash(w.restart)})"
    )


def format_sweep(folder: Path, reports: Sequence[RunReport]) -> str:
    lines = [
        f"Sweep {folder}: {len(reports)} job(s)",
        f"  {'job':<40}  {'status':<11}  {'steps':>6}  {'val loss':>8}  {'restarts':>8}  {'goodput':>7}  {'wall':>8}",
    ]
    for r in reports:
        gp = f"{100 * r.goodput:.0f}%" if r.goodput is not None else "-"
        lines.append(
            f"  {r.name[:40]:<40}  {r.status:<11}  {_dash(r.summary.global_step):>6}  "
            f"{_fmt(r.summary.val_loss):>8}  {r.restarts:>8}  {gp:>7}  {seconds(r.wall):>8}"
        )
    return "\n".join(lines)
