"""The launcher's schema and what Hydra needs before it composes any app's config (imported by
Hydra's plugin scan at start-up, cheap: no torch), as Hydra's own launcher plugins keep theirs:

- `hydra/launcher=steadfast`: SteadfastLauncherConf, the launcher's own node;
- the `restart` and `cluster` schemas, and each backend's (`backend/schema_<name>`, stored by the
  backend modules as they register themselves: importing `_backends` imports them all);
- the library's own schemas (`checkpoint`, `fault`, `logger`, ...) and the resolvers that name run folders.

The YAML options in `steadfast/conf/` (and an app's own) extend these schemas through their defaults
list, so unknown keys there are errors too.

No `from __future__ import annotations` here: Hydra's scan executes this module before it is in
sys.modules, where dataclasses cannot resolve string annotations.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore

from steadfast import help
from steadfast.config import register_configs
from steadfast.contract import naming
from steadfast.contract.schemas import ClusterConf, RestartConf, bad, bounded

from . import _backends  # noqa: F401  (registers every backend)
from ._compat import hydra_overrides


@dataclass
class SteadfastLauncherConf:
    _target_: str = "hydra_plugins.steadfast_launcher.launcher.SteadfastLauncher"
    # Apps point these at their own nodes (`${backend}`, `${restart}`) so sweeps can vary them.
    # Unset: the default backend (one in-process worker) and no restarts.
    backend: Any = None
    restart: Any = None
    cluster: Any = None
    # The command each node runs under cluster=slurm: `python -m <app>` (null: the module or script
    # this launcher was started as).
    app: Optional[str] = None
    # Folders the job writes besides its run folder (e.g. a shared checkpoint.dir): the run lock
    # covers them too, so two launches never share them.
    lock_dirs: List[Any] = field(default_factory=list)
    # "package.module:function" (or a list of them) called with each job's config in the launcher
    # process before any worker starts; each returns a list of problems (empty when it can run).
    # `preflight` is the library's (set by its `steadfast` config), `app_preflight` the app's own:
    # an app adds its checks without dropping the library's.
    preflight: Any = None
    app_preflight: Any = None
    # "module:Dataclass" (`__main__:Config` for a class in the script being run): the app's own keys,
    # typed; checked by the library's pre-flight like its own (steadfast/app_keys.py).
    app_schema: Optional[str] = None
    # Sweep-level settings (read from the sweep's config, not per job):
    # How many jobs run at once. Above 1, each job runs in its own launcher process and jobs
    # are packed by the worker processes they need (backend.procs_per_node) into max_procs.
    max_parallel_jobs: int = 1
    # Worker processes the machine runs at once. Default: its GPUs if it has any, else the CPU
    # cores this process may use; then each parallel job is also pinned to its own cores/GPUs.
    max_procs: Optional[int] = None
    # Stop the sweep at the first failed job (running jobs are stopped, resumable); default:
    # run every job, report the failures at the end and exit non-zero.
    fail_fast: bool = False
    # Re-running a sweep returns a completed job's recorded result (sweep ledger) instead of
    # launching it again; failed and interrupted jobs are launched again (and resume).
    skip_completed: bool = True

    def problems(self) -> List[str]:
        out = bounded("hydra.launcher", self)
        if self.max_parallel_jobs < 1:
            out.append(bad("hydra.launcher.max_parallel_jobs", self.max_parallel_jobs, "an integer >= 1"))
        if self.max_procs is not None and self.max_procs < 1:
            out.append(
                bad("hydra.launcher.max_procs", self.max_procs, "an integer >= 1, or null (this machine's GPUs or CPU cores)")
            )
        return out


_store = ConfigStore.instance()
_store.store(group="hydra/launcher", name="steadfast", node=SteadfastLauncherConf, provider="steadfast")
_store.store(group="restart", name="schema", node=RestartConf, provider="steadfast")
_store.store(group="cluster", name="schema", node=ClusterConf, provider="steadfast")
register_configs()
naming.register_resolvers()
help.register_resolver()
hydra_overrides.install()  # before Hydra composes the app's config
