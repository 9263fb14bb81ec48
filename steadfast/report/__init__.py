"""What happened in a run, in words and in a picture: `python -m pipeline.report outputs/<run.name>`.

Prints a summary (status, epochs, steps, each attempt of the run with how it ended, where it
resumed from and the work it lost, checkpoints committed and verified, time on useful steps
against restarts and checkpointing = goodput) and writes report.png in the folder: the loss
against the step, with the restarts, preemptions and checkpoints marked on it, a timeline of the
attempts, and the time breakdown. Given a sweep folder (a folder of run folders), it summarises
every job and writes a comparison plot to <sweep folder>/report.png.

Everything comes from the run folder's records: events.jsonl (the launcher's and the workers'
events), metrics.jsonl, summary.json, config.yaml (where the checkpoints are) and the checkpoints
themselves, verified against their manifests. Times are wall-clock times of one machine's records.

  loader       reads and validates a run folder's files   -> records.RunRecords
  records      what is read, validated into plain values (the analysis's input; no file I/O)
  checkpoints  the committed checkpoints, listed and verified
  analysis     pure: records -> launches, attempts, lost steps, time breakdown, goodput (model.RunReport)
  anomalies    the rollbacks, skipped data and replica divergences of a run, from its anomaly events
  model        what the report says about a run (the analysis's output)
  text, plot   the words and the picture (matplotlib only in plot, imported when drawing)
  cli          the command (`main`)
"""

from .analysis import analyse
from .cli import main, report
from .loader import find_runs, is_run, load_run
from .model import Attempt, Launch, Outcome, RunReport, TimeBreakdown
from .records import RunRecords
from .text import format_run, format_sweep

__all__ = [
    "Attempt",
    "Launch",
    "Outcome",
    "RunRecords",
    "RunReport",
    "TimeBreakdown",
    "analyse",
    "find_runs",
    "format_run",
    "format_sweep",
    "is_run",
    "load_run",
    "main",
    "report",
]
