"""backend=local: one worker in the launcher's own process (debuggers and breakpoints work); the
backend of a job whose config names none."""

from __future__ import annotations

import os
from dataclasses import dataclass

from steadfast.contract.backends import BackendConf, BackendSpec, RankEnv
from steadfast.contract.env import NONE
from steadfast.contract.stop import Stopped

from .._types import Completed, Failed, Outcome
from ._registry import register
from .base import Attempt, Backend, restore_environment, saved_environment


@dataclass
class LocalBackendConf(BackendConf):
    """One worker, in the launcher's own process: for debuggers and quick checks."""

    name: str = "local"


RANK_ENV = RankEnv(rank="RANK", world_size="WORLD_SIZE", local_rank="LOCAL_RANK", local_world_size="LOCAL_WORLD_SIZE")


@register
class LocalBackend(Backend):
    spec = BackendSpec(
        name="local",
        schema=LocalBackendConf,
        collective=NONE,
        world_size_keys=(),
        rank_env=RANK_ENV,
        cannot_shard="one in-process worker has nothing to shard over",
        default=True,
    )
    in_process = True  # its worker is the launcher's own thread; the launcher relaunches it (restart.max_restarts)

    def describe(self) -> str:
        return f"1 in-process worker (backend={self.name})"

    def launch(self, attempt: Attempt) -> Outcome:
        dist_env = {RANK_ENV.rank: "0", RANK_ENV.local_rank: "0", RANK_ENV.world_size: "1", RANK_ENV.local_world_size: "1"}
        saved = saved_environment([*attempt.env, *dist_env])
        os.environ.update({**attempt.env, **dist_env})
        try:
            value = attempt.entry(attempt.payload, restore_hydra=False)
        except Exception as exc:
            return Failed(f"rank 0 (in-process): {type(exc).__name__}: {exc}")
        finally:
            restore_environment(saved)
        return value if isinstance(value, Stopped) else Completed(value)
