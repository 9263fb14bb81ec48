"""The cells and tables of BENCHMARKS.md (a targets row: target(), reported()), and reading a benchmark's results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional


def load(results: Path, name: str) -> Optional[Dict[str, Any]]:
    try:
        return json.loads((results / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def f(x: Any, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}f}{unit}"
    return str(x)


# The first columns of a table of runs' speeds: the run, its steps/s (spread()), its CPU time per step
SPEED_COLUMNS = ["run", "steps/s (median)", "min", "max", "CPU ms per step (all processes)"]


def spread(figure: Dict[str, Any], digits: int = 2) -> List[str]:
    """A figure's median, min and max (a bench.common.spread), as three cells."""
    return [f(figure.get(k), digits) for k in ("median", "min", "max")]


def status(value: Optional[float], op: str, goal: float) -> str:
    if value is None:
        return "not measured"
    ok = value >= goal if op == ">=" else value <= goal
    return "**met**" if ok else "**missed**"


def table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *["| " + " | ".join(r) + " |" for r in rows], ""]


def foreign_note(*loads: Optional[Dict[str, Any]]) -> str:
    shares = [load["median"] for load in loads if load and load.get("median") is not None]
    if not shares:
        return ""
    return f" Other tenants used a median {max(shares) * 100:.0f}% of the machine during these runs."


def reported(section: str, what: str, shown: str, note: str = "reported") -> List[str]:
    """A row of the targets table without a goal: the figure is reported."""
    return [section, what, shown, "-", note]


def target(
    section: str,
    what: str,
    value: Optional[float],
    op: str,
    goal: Optional[float],
    digits: int = 2,
    shown: Optional[str] = None,
    goal_text: Optional[str] = None,
) -> List[str]:
    """A row of the targets table: `value` against `op goal` (met, missed, not measured); without a
    goal, reported. `shown`: the figure's cell where it says more than the value; `goal_text`: the
    goal's, where it says more than `op goal`."""
    cell = f(value, digits) if shown is None else shown
    if goal is None:
        return reported(section, what, cell)
    return [section, what, cell, goal_text or f"{op} {goal}", status(value, op, goal)]
