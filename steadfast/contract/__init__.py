"""The contract between the launch side (the Hydra launcher plugin) and the worker side (any task).

The launcher calls the Hydra task function on every rank with the job's config, resolved once in
the launcher process and identical for every rank and every restart (`HydraConfig.get()` works as
in a normal Hydra job). What the two sides promise each other lives here, in modules that import
nothing of ours and no torch:

  env        the launch environment, as a typed `LaunchEnv` (run folder, attempt, launch id,
             the collective library to initialise, the backend's rank variables, timeouts)
  events     the event vocabulary of `events.jsonl`: a record type per kind, one writer, one reader
             (_record: the kinds and the base record; _worker_events: the workers' record types)
  summary    `summary.json`: derived from the events by its one writer, the launcher
  exits      exit codes (EXIT_PREEMPTED: stopped on request, run the same command to continue;
             EXIT_PLATFORM_PREEMPTED in library mode)
  stop       stop requests: signals set a flag; a task saves and raises `StopRun` (a `StopReason`)
  heartbeat  progress counters the launcher's hang watchdog reads; stack dumps on request
  backends   the backend registry: each backend's schema, world-size keys and rank variables
  schemas    the restart and cluster schemas, and how a config check words a problem
  keys       which config keys change what is trained (run names, the resume guard)
  naming     folder names from the command line (Hydra's overrides, OmegaConf's resolvers)
  shm        the shared-memory folder of a launch's snapshots: private, made and removed by the launcher
             (in library mode by the workers)
  platforms  the platforms that start the workers themselves (torchrun, srun, a PyTorchJob): how a
             worker recognises one (library mode, docs/platforms.md)
  compile_cache  torch.compile's cache: one private folder per run and machine, named to every worker
  files      file names in the run folder, the atomic write, bounded validated reads
  pids       whether a process is still there
  fits       whether a value fits a type hint (what the event records are checked with)
  failures   a worker's text made safe to show; the failures a restart cannot cure (ConfigInvalid)

A worker reports back through its return value (rank 0's becomes the job's), an exception (the
job failed; it is restarted within `restart.max_restarts`), `StopRun` after it saved (every rank,
at the same step), and events.
"""

from .env import LaunchEnv, NotLaunched, current_rank, restart_count, run_dir
from .events import Event
from .exits import EXIT_PREEMPTED, exit_code
from .stop import PREEMPTED, STOP_SIGNALS, Stopped, StopReason, StopRun, signal_name, stop_requested
from .summary import Status

__all__ = [
    "EXIT_PREEMPTED",
    "Event",
    "LaunchEnv",
    "NotLaunched",
    "PREEMPTED",
    "STOP_SIGNALS",
    "Status",
    "StopReason",
    "StopRun",
    "Stopped",
    "current_rank",
    "exit_code",
    "restart_count",
    "run_dir",
    "signal_name",
    "stop_requested",
]
