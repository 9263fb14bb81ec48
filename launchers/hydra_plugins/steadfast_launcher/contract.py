"""The contract between the launch side (this plugin) and the worker side (any task function).

The launcher calls the Hydra task function on every rank with the job's config, resolved once
in the launcher process and identical for every rank and every restart. `HydraConfig.get()`
works in the worker as in a normal Hydra job. Besides the backend's own variables (torch
elastic's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT;
Horovod's HOROVOD_RANK, HOROVOD_SIZE, ...), every worker sees:

  STEADFAST_BACKEND   "torchrun", "horovod" or "local": which collective library to initialise
  STEADFAST_RUN_DIR   the job's output folder (absolute); the launcher created it
  STEADFAST_ATTEMPT   how many times the launcher itself relaunched this job (0 first)
  STEADFAST_LAUNCH_TIME  when the launcher started this job (seconds since the epoch)

A worker reports back through:
  - its return value (rank 0's becomes the job's return value, and must pickle);
  - an exception (the job failed; the launcher restarts it within `restart.max_restarts`);
  - exit code EXIT_PREEMPTED (75): it saved and stopped on request; not restarted, not a failure;
  - lines appended to EVENTS_FILE in the run folder with `append_event` (one JSON object a line).

This module is imported by both sides and must stay free of heavy imports.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

ENV_BACKEND = "STEADFAST_BACKEND"
ENV_RUN_DIR = "STEADFAST_RUN_DIR"
ENV_ATTEMPT = "STEADFAST_ATTEMPT"
ENV_LAUNCH_TIME = "STEADFAST_LAUNCH_TIME"

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped cleanly after a checkpoint; run again to continue

EVENTS_FILE = "events.jsonl"
CONFIG_FILE = "config.yaml"


def run_dir() -> Path:
    """The run folder of the current job (set by the launcher)."""
    value = os.environ.get(ENV_RUN_DIR)
    if not value:
        raise RuntimeError(f"{ENV_RUN_DIR} is not set: run this task through the steadfast launcher")
    return Path(value)


def restart_count() -> int:
    """Restarts of this job so far: the launcher's relaunches plus the elastic agent's restarts."""
    return int(os.environ.get(ENV_ATTEMPT, "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def append_event(folder: str | os.PathLike[str], kind: str, **fields: Any) -> None:
    """Append one event to the run's events file.

    One `write` of one line on a file opened with O_APPEND, so lines written by the launcher
    and by rank 0 at the same time never interleave.
    """
    record = {"time": round(time.time(), 3), "event": kind, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(Path(folder) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
