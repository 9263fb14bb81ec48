"""What the console says when a job ends, on every backend: how it ended (completed, stopped,
failed), its steps and last loss, and where its summary and weights are. Read from the job's
`summary.json` (the launch's own record, written before this runs), never from the workers'
console output, which a backend may not show."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from steadfast.contract import summary
from steadfast.contract.exits import exit_code
from steadfast.contract.files import SUMMARY_FILE

from ._types import Job


def _shown(path: Path) -> str:
    """Relative to here when that is shorter (outputs/own_default/summary.json)."""
    relative = os.path.relpath(path)
    return relative if len(relative) < len(str(path)) else str(path)


def _loss(recorded: Dict[str, Any]) -> str:
    loss = recorded.get("final_loss")
    return f", final loss {loss:.4g}" if isinstance(loss, (int, float)) and not isinstance(loss, bool) else ""


def _where(folder: Path, recorded: Dict[str, Any]) -> str:
    out = f"summary: {_shown(folder / SUMMARY_FILE)}"
    weights = recorded.get("model_file")
    if isinstance(weights, str) and (folder / weights).is_file():
        out += f", weights: {_shown(folder / weights)}"
    return out


def _progress(recorded: Dict[str, Any]) -> str:
    steps, epochs = recorded.get("global_step"), recorded.get("epochs_completed")
    parts = [f"{steps} steps" if isinstance(steps, int) else "", f"{epochs} epochs" if isinstance(epochs, int) else ""]
    return ", ".join(p for p in parts if p)


def end_line(job: Job, signum: Optional[int] = None) -> Optional[str]:
    """One line on how the job ended (None when it wrote no summary: refused before it ran)."""
    if job.run_dir is None:
        return None
    recorded = summary.read(job.run_dir)
    status = recorded.get("status")
    if status is None:
        return None
    where = _where(job.run_dir, recorded)
    if status == summary.Status.COMPLETED.value:
        steps = recorded.get("global_step")
        if steps is not None and recorded.get("resumed_from_step") == steps:
            return f"{job.label} already complete: nothing to train ({_progress(recorded)}); {where}"
        return f"{job.label} completed: {_progress(recorded)}{_loss(recorded)}; {where}"
    if status == summary.Status.PREEMPTED.value:
        step = recorded.get("stop_step")
        at = f" at step {step}" + (", checkpoint committed" if recorded.get("stop_saved") else "") if step is not None else ""
        by = recorded.get("stop_signal") or "a stop request"
        code = f" (exit code {exit_code(signum)})" if signum is not None else ""
        return f"{job.label} stopped by {by}{at}: run the same command again to continue{code}; {where}"
    if status == summary.Status.FAILED.value:
        return f"{job.label} failed after {recorded.get('restarts', 0)} restart(s); {where}"
    return f"{job.label} stopped ({status}){' at step ' + str(recorded['stop_step']) if recorded.get('stop_step') is not None else ''}; {where}"
