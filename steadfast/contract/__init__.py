"""The contract between the launch side (the Hydra launcher plugin) and the worker side (any task).

The launcher calls the Hydra task function on every rank with the job's config, resolved once in
the launcher process and identical for every rank and every restart (`HydraConfig.get()` works as
in a normal Hydra job). What the two sides promise each other lives here, in modules that import
nothing of ours and no torch:

  env        the launch environment, as a typed `LaunchEnv` (run folder, attempt, launch id,
             the collective library to initialise, the reference world size, timeouts)
  events     the event vocabulary of `events.jsonl`, its one writer and its one reader
  summary    `summary.json`: derived from the events by its one writer, the launcher
  exits      exit codes (EXIT_PREEMPTED: stopped on request, run the same command to continue)
  stop       stop requests: signals set a flag; a task saves and raises `StopRun`
  heartbeat  progress counters the launcher's hang watchdog reads; stack dumps on request
  schemas    the launcher's backend, restart, cluster and launcher schemas
  keys       which config keys change what is trained (run names, the resume guard)
  files      file names in the run folder, the atomic write, bounded validated reads

A worker reports back through its return value (rank 0's becomes the job's), an exception (the
job failed; it is restarted within `restart.max_restarts`), `StopRun` after it saved (every rank,
at the same step), and events.
"""

from .env import LaunchEnv, NotLaunched, current_rank, restart_count, run_dir
from .events import Event
from .exits import EXIT_PREEMPTED, exit_code
from .stop import PREEMPTED, STOP_SIGNALS, Stopped, StopRun, signal_name, stop_requested
from .summary import Status

__all__ = [
    "EXIT_PREEMPTED",
    "Event",
    "LaunchEnv",
    "NotLaunched",
    "PREEMPTED",
    "STOP_SIGNALS",
    "Status",
    "StopRun",
    "Stopped",
    "current_rank",
    "exit_code",
    "restart_count",
    "run_dir",
    "signal_name",
    "stop_requested",
]
