"""`python -m steadfast.report FOLDER` (also `python -m pipeline.report FOLDER`): print the report, draw report.png."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from ..contract.files import EVENTS_FILE, SUMMARY_FILE
from .analysis import analyse
from .loader import find_runs, is_run, load_run
from .model import RunReport
from .text import format_run, format_sweep

PNG = "report.png"


def report(folder: Path) -> RunReport:
    """The report of one run folder (source locations shown relative to the working directory)."""
    return analyse(load_run(folder), relative_to=os.getcwd())


def _picture(reports: Sequence[RunReport], path: Path, sweep: bool) -> str:
    """Draw the picture; one that cannot be drawn is said so, and the printed report stands."""
    try:
        from . import plot

        return str(plot.plot_sweep(reports, path) if sweep else plot.plot_run(reports[0], path))
    except ImportError as exc:
        return f"not drawn: {exc} (pip install matplotlib)"
    except OSError as exc:
        return f"not written: {path}: {exc.strerror or exc}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="What happened in a run, in words and in a picture (report.png in the folder).",
    )
    parser.add_argument("folder", type=Path, help="a run folder (outputs/<run.name>) or a sweep folder")
    parser.add_argument("--no-plot", action="store_true", help="only print the summary")
    args = parser.parse_args(argv)
    folder: Path = args.folder
    if not folder.is_dir():
        print(f"{folder}: no such folder", file=sys.stderr)
        return 2
    if is_run(folder):
        r = report(folder)
        print(format_run(r))
        if not args.no_plot:
            print(f"  picture: {_picture([r], folder / PNG, sweep=False)}")
        return 0
    runs = find_runs(folder)
    if not runs:
        print(f"{folder}: neither a run folder ({EVENTS_FILE} or {SUMMARY_FILE} missing) nor a folder of runs", file=sys.stderr)
        return 2
    reports = [report(p) for p in runs]
    print(format_sweep(folder, reports))
    for r in reports:
        print()
        print(format_run(r))
    if not args.no_plot:
        print(f"\ncomparison picture: {_picture(reports, folder / PNG, sweep=True)}")
    return 0
