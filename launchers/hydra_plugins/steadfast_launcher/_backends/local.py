"""backend=local: one worker in the launcher's own process (debuggers and breakpoints work)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from steadfast.contract.env import NONE
from steadfast.contract.schemas import LocalBackendConf

from .._payload import PayloadRef
from .._types import Job, WorkerFailure
from .._worker import run_rank
from .base import Backend, restore_environment, saved_environment


class LocalBackend(Backend):
    schema = LocalBackendConf
    collective = NONE
    in_process = True  # its worker is the launcher's own thread; the launcher relaunches it (restart.max_restarts)

    def describe(self) -> str:
        return f"1 in-process worker (backend={self.name})"

    def launch(self, payload: PayloadRef, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
        dist_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        saved = saved_environment([*env, *dist_env])
        os.environ.update({**env, **dist_env})
        try:
            return run_rank(payload, restore_hydra=False)
        except Exception as exc:
            raise WorkerFailure(self.root_cause(exc, run_dir)) from exc
        finally:
            restore_environment(saved)

    def root_cause(self, error: BaseException, run_dir: Path, attempt: int = 0) -> str:
        return f"rank 0 (in-process): {type(error).__name__}: {error}"
