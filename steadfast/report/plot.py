"""The report as a picture (report.png). matplotlib is imported here only, when a picture is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Sequence, Tuple

from .analysis import attempt_rows
from .model import MEMORY, Outcome, RunReport, TimeBreakdown
from .text import seconds

PART_COLORS = {
    "useful": "#2ca02c",
    "redone": "#d62728",
    "checkpoint": "#1f77b4",
    "startup": "#c7c7c7",
    "hung": "#f4b6b6",
    "other": "#ffdd88",
}
COLORS = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#2ca02c"]
OUTCOME = {
    Outcome.COMPLETED: ("#2ca02c", "completed"),
    Outcome.PREEMPTED: ("#ff7f0e", "preempted"),
    Outcome.FAILED: ("#d62728", "failed"),
    Outcome.STOPPED: ("#ff7f0e", "stopped"),
    Outcome.UNKNOWN: ("#7f7f7f", "?"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _compressed_times(r: RunReport) -> Tuple[Callable[[float], float], List[Tuple[float, float, float]]]:
    """Map wall times to a timeline where the idle gaps between launches shrink to 4% of the span."""
    spans = [(launch.start, launch.end) for launch in r.launches] or [(0.0, 1.0)]
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


def _loss(ax: Any, r: RunReport) -> None:
    """Loss against step, one colour per attempt; what a failure threw away is shaded, and so is what a
    rollback gave up (an anomaly: its step marked)."""
    for a in r.attempts:
        mine = attempt_rows(a, r.metrics)
        for i, part in enumerate(_forward(mine)):  # after a rollback the steps start again from an earlier one
            ax.plot(
                [m.step for m in part],
                [m.loss for m in part],
                "-",
                lw=1.4,
                color=COLORS[a.index % len(COLORS)],
                label=f"attempt {a.index} (train loss)" if i == 0 else None,
            )
    val = sorted((m.step, m.val_loss) for m in r.metrics if m.val_loss is not None)
    if val:
        ax.plot(*zip(*val), "o--", ms=3.5, lw=1, color="black", alpha=0.7, label="val loss")
    values = [m.loss for m in r.metrics if m.loss is not None] + [v for _, v in val]
    log_scale = bool(values) and min(values) > 0 and max(values) / min(values) > 30
    marked = 0
    for a in r.attempts:
        if a.lost_steps and a.last_step is not None:
            ax.axvspan(a.last_step - a.lost_steps, a.last_step, color="#d62728", alpha=0.12, lw=0)
        if a.outcome in (Outcome.FAILED, Outcome.PREEMPTED, Outcome.STOPPED) and a.last_step is not None:
            color = OUTCOME[a.outcome][0]
            ax.axvline(a.last_step, color=color, ls="--", lw=1.3)
            short = a.cause.split(" (")[0] if a.outcome is Outcome.FAILED else a.cause.split(" at step")[0]
            label = f"{short}" + (f"\n{a.lost_steps} step(s) redone" if a.lost_steps else "\nno step lost")
            _note(ax, label, a.last_step, 0.97 - 0.14 * (marked % 3), color)
            marked += 1
    _anomalies(ax, r)
    ckpts = sorted({step for a in r.attempts for _, step in a.checkpoints})
    if ckpts:
        ax.plot(
            ckpts,
            [0.0] * len(ckpts),
            "^",
            color="#2ca02c",
            ms=7,
            clip_on=False,
            transform=ax.get_xaxis_transform(),
            label="checkpoint committed",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if log_scale else ""))
    if log_scale:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=6, frameon=False)


def _forward(rows: Sequence[Any]) -> List[List[Any]]:
    """Rows in time order cut where the step goes back (a rollback), each part going forward."""
    parts: List[List[Any]] = []
    for row in rows:
        if not parts or row.step <= parts[-1][-1].step:
            parts.append([])
        parts[-1].append(row)
    return parts


def _anomalies(ax: Any, r: RunReport) -> None:
    """Each anomaly's step (a dotted line), and what a rollback gave up shaded (restored step to agreed step)."""
    for i, h in enumerate(r.anomalies):
        if h.step is None:
            continue
        if h.redone and h.restored_step is not None and h.agreed_at is not None:
            ax.axvspan(h.restored_step, h.agreed_at, color="#9467bd", alpha=0.12, lw=0)
        ax.axvline(h.step, color="#9467bd", ls=":", lw=1.3, label="anomaly (rolled back or healed)" if i == 0 else None)
        skipped = f", {h.samples_skipped} samples skipped" if h.samples_skipped else ""
        label = f"{h.anomaly}\n" + (f"back to {h.restored_step}{skipped}" if h.action == "rolled_back" else "healed")
        _note(ax, label, h.step, 0.55 - 0.14 * (i % 3), "#9467bd")


def _note(ax: Any, label: str, step: float, height: float, color: str) -> None:
    """A small label at `step` on the loss plot, `height` up the axes."""
    ax.annotate(
        label,
        (step, height),
        xycoords=("data", "axes fraction"),
        xytext=(4, 0),
        textcoords="offset points",
        va="top",
        fontsize=8,
        color=color,
        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8),
    )


def _timeline(tl: Any, r: RunReport) -> None:
    """The attempts on a timeline (idle gaps between launches compressed)."""
    to_x, offsets = _compressed_times(r)
    for a in r.attempts:
        color = COLORS[a.index % len(COLORS)]
        start, end = to_x(a.start), to_x(a.end if a.end is not None else a.start)
        first = to_x(a.first_step) if a.first_step else None
        tl.barh(0, (first or end) - start, left=start, color="#c7c7c7", height=0.5)
        if first is not None:
            tl.barh(0, end - first, left=first, color=color, height=0.5)
        if a.hung:
            h0, h1 = to_x(a.hung[0]), to_x(a.hung[1])
            tl.barh(0, h1 - h0, left=h0, color="#f4b6b6", hatch="xx", ec="#d62728", lw=0, height=0.5)
        for t, _ in a.checkpoints:
            tl.plot([to_x(t)] * 2, [-0.25, 0.25], color="#2ca02c", lw=1.5)
        mcolor, word = OUTCOME[a.outcome]
        marker = "X" if a.outcome is Outcome.FAILED else "s" if a.outcome in (Outcome.PREEMPTED, Outcome.STOPPED) else "o"
        tl.plot(end, 0, marker, color=mcolor, ms=9, mec="black", mew=0.6)
        what = "hung" if a.hung else "killed" if a.cause.startswith("fault=kill") else word
        where = f", from step {a.resumed_from}" if a.resumed_from else ""
        where += " (memory)" if where and a.source == MEMORY else ""
        tl.text((start + end) / 2, 0.42, f"#{a.index} {what}{where}", ha="center", va="bottom", fontsize=8)
    for (a0, b0, x0), (a1, _, x1) in zip(offsets, offsets[1:]):
        tl.axvspan(x0 + (b0 - a0), x1, color="white", hatch="//", ec="#999999", lw=0)
        tl.text(
            (x0 + (b0 - a0) + x1) / 2, -0.45, f"re-run\n+{seconds(a1 - b0)}", ha="center", va="top", fontsize=7, color="#555555"
        )
    tl.set_yticks([])
    tl.set_ylim(-0.9, 0.9)
    tl.set_xlabel(
        "seconds since the first launch  (grey: start-up and restore; hatched red: hung until the watchdog "
        "acted; green ticks: checkpoints; idle time between launches compressed)",
        fontsize=8,
    )
    tl.grid(axis="x", alpha=0.3)


def _local_work(ax: Any, r: RunReport) -> None:
    """Each rank's local work per step (loading, forward) per logging window; the named stragglers marked."""
    ranks = max(len(m.local_ms_per_rank or ()) for m in r.metrics)
    labelled = set()
    for a in r.attempts:
        end = a.end if a.end is not None else float("inf")
        mine = sorted(
            (m for m in r.metrics if m.local_ms_per_rank and m.restart == a.restart and a.start <= m.time <= end),
            key=lambda m: m.time,
        )
        for rank in range(ranks):
            points = [
                (m.step, m.local_ms_per_rank[rank]) for m in mine if m.local_ms_per_rank and rank < len(m.local_ms_per_rank)
            ]
            if points:
                label = f"rank {rank}" if rank not in labelled and ranks <= 16 else None
                labelled.add(rank)
                ax.plot(*zip(*points), "-", lw=1.2, color=COLORS[rank % len(COLORS)], label=label)
    for w in r.slow_ranks:
        if w.step is not None:
            ax.axvline(w.step, color="#2ca02c" if w.recovered else "#d62728", ls=":", lw=1)
            word = "recovered" if w.recovered else "straggler"
            ax.text(w.step, 1.0, f" rank {w.rank} {word}", transform=ax.get_xaxis_transform(), fontsize=7, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("local work per step (ms)", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right", ncol=min(ranks, 8))


def _where_the_time_went(bar: Any, b: TimeBreakdown) -> None:
    left = 0.0
    for key in TimeBreakdown.parts():
        width = b.part(key) / b.wall if b.wall else 0
        bar.barh(0, width, left=left, color=PART_COLORS[key], height=0.8)
        if width > 0.06:
            bar.text(left + width / 2, 0, f"{key} {100 * width:.0f}%", ha="center", va="center", fontsize=8)
        left += width
    bar.set_xlim(0, 1)
    bar.set_yticks([])
    bar.set_xticks([])
    bar.set_title(f"where the wall time went ({seconds(b.wall)})", fontsize=9, loc="left")


def plot_run(r: RunReport, path: Path) -> Path:
    plt = _pyplot()
    per_rank = any(m.local_ms_per_rank for m in r.metrics)
    if per_rank:
        fig, (ax, local, tl, bar) = plt.subplots(
            4, 1, figsize=(11, 9.6), dpi=100, gridspec_kw={"height_ratios": [3.2, 1.6, 1.3, 0.45]}
        )
    else:
        fig, (ax, tl, bar) = plt.subplots(3, 1, figsize=(11, 7.6), dpi=100, gridspec_kw={"height_ratios": [3.2, 1.3, 0.45]})
    gp = r.goodput
    steps = r.summary.global_step if r.summary.global_step is not None else "?"
    fig.suptitle(
        f"{r.name}: {r.status}, {steps} steps, {r.restarts} restart(s), goodput {100 * gp:.0f}%"
        if gp is not None
        else f"{r.name}: {r.status}",
        fontsize=12,
        fontweight="bold",
    )
    _loss(ax, r)
    if per_rank:
        _local_work(local, r)
        local.set_xlim(ax.get_xlim())  # the loss's steps
    _timeline(tl, r)
    _where_the_time_went(bar, r.breakdown)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(reports: Sequence[RunReport], path: Path) -> Path:
    plt = _pyplot()
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=100, gridspec_kw={"width_ratios": [1.5, 1]})
    fig.suptitle(f"sweep folder {Path(path).parent.name}: {len(reports)} job(s)", fontsize=12, fontweight="bold")
    for i, r in enumerate(reports):
        color = COLORS[i % len(COLORS)]
        val = sorted((m.step, m.val_loss) for m in r.metrics if m.val_loss is not None)
        train = sorted((m.step, m.loss) for m in r.metrics if m.loss is not None)
        if train:
            ax.plot(*zip(*train), "-", lw=1, alpha=0.45, color=color)
        if val:
            ax.plot(*zip(*val), "o-", ms=3, lw=1.6, color=color, label=f"{r.name} ({r.status})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (faint: train, dots: validation)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    names = [r.name if len(r.name) <= 28 else r.name[:25] + "..." for r in reports]
    parts = TimeBreakdown.parts()
    for n, key in enumerate(parts):
        lefts = [sum(r.breakdown.part(k) for k in parts[:n]) for r in reports]
        bar.barh(range(len(reports)), [r.breakdown.part(key) for r in reports], left=lefts, color=PART_COLORS[key], label=key)
    for i, r in enumerate(reports):
        bar.text(r.breakdown.wall, i, f" {r.restarts} restart(s)", va="center", fontsize=7)
    bar.set_yticks(range(len(reports)))
    bar.set_yticklabels(names, fontsize=7)
    bar.invert_yaxis()
    bar.set_xlabel("wall seconds")
    bar.set_xlim(0, 1.3 * max([r.breakdown.wall for r in reports] + [1e-9]))
    bar.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(parts), frameon=False)
    bar.set_title("where the time went", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
