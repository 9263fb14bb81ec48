"""backend=local: one worker in the launcher's own process (debuggers and breakpoints work)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ._core import Job, WorkerFailure
from ._worker import run_rank

RESTARTS_ITSELF = False  # the launcher relaunches it, up to restart.max_restarts


def run(payload: bytes, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
    dist_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in [*env, *dist_env]}
    os.environ.update({**env, **dist_env})
    try:
        return run_rank(payload, restore_hydra=False)
    except Exception as exc:
        raise WorkerFailure(f"rank 0 (in-process): {type(exc).__name__}: {exc}") from exc
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
