"""Folder names from the command line: the same command finds the same folders (no timestamps).

A run's name comes from the job's overrides that change what is trained (contract.keys); a sweep's
from its command line as typed. One job's folder is `<root>/<run name>`, and that folder is also
its sweep folder (Hydra's sweeper writes `multirun.yaml` there, never at the root); a sweep's jobs
are in `<root>/sweeps/<sweep name>/<run name>`. The launcher registers these as resolvers
(`steadfast_run_name`, `steadfast_sweep_dir`, `steadfast_sweep_subdir`) for the library's
`steadfast` config.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from .keys import names_run, override_key

if TYPE_CHECKING:
    from omegaconf import DictConfig

MAX_NAME = 80
SWEEPS = "sweeps"  # sweeps get their own folder under the output root: <root>/sweeps/<sweep name>/<run name>


def folder_name(items: Sequence[str], empty: str = "default") -> str:
    if not items:
        return empty
    name = ",".join(re.sub(r"[^A-Za-z0-9_.=+-]", "-", o) for o in items)
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def run_name(overrides: Sequence[str], safe_to_change: Iterable[str] = ()) -> str:
    """A folder name derived from the job's overrides that change what is trained."""
    safe = [str(k) for k in safe_to_change or ()]
    return folder_name(sorted(o.lstrip("+~") for o in overrides if names_run(override_key(o), safe)))


def is_sweep(task_overrides: Iterable[Any], sweeper: Optional[str] = None, params: Any = None) -> bool:
    """Does this command run a sweep (rather than one job)?

    A sweep: an override with sweep syntax (`a=1,2`, `range()`, `choice()`, `interval()`,
    `glob()`), a sweeper other than Hydra's basic one, or sweeper params in the config.
    """
    if sweeper not in (None, "", "basic"):
        return True
    if params:
        return True
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([str(o) for o in task_overrides])
    except Exception:  # already parsed once by Hydra; be lenient here
        return False
    return any(o.is_sweep_override() for o in parsed)


def sweep_name(
    overrides: Sequence[str], sweeper: Optional[str] = None, params: Any = None, safe_to_change: Iterable[str] = ()
) -> str:
    """A sweep's folder name, from its command line as typed (sweep syntax included) and its sweeper.

    As for run_name, keys that do not change what is trained are left out unless the sweep varies
    them, so `-m trainer.lr=0.1,0.01 trainer.max_epochs=40` continues `-m trainer.lr=0.1,0.01`.
    What the sweep varies comes first, so a long name keeps it readable (the rest is hashed).
    """
    safe = [str(k) for k in safe_to_change or ()]
    swept = sorted(o.lstrip("+~") for o in overrides if is_sweep([o]))
    fixed = sorted(o.lstrip("+~") for o in overrides if not is_sweep([o]) and names_run(override_key(o), safe))
    searched = sorted(f"{k}={v}" for k, v in (params or {}).items())
    prefix = [str(sweeper)] if sweeper not in (None, "", "basic") else []
    return folder_name(prefix + swept + searched + fixed)


def sweep_dir(
    root: str,
    overrides: Sequence[Any],
    sweeper: Optional[str] = None,
    params: Any = None,
    safe_to_change: Iterable[str] = (),
    run: Optional[str] = None,
) -> str:
    """`<root>/sweeps/<sweep name>` for a sweep. For one job: its run folder `<root>/<run>` when its
    run name is given (see sweep_subdir), else `root`."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    overrides = [str(o) for o in overrides]
    if isinstance(params, DictConfig):
        params = OmegaConf.to_container(params)
    if isinstance(safe_to_change, ListConfig):
        safe_to_change = list(safe_to_change)
    if not is_sweep(overrides, sweeper, params):
        return str(root) if run is None else f"{root}/{run}"
    return f"{root}/{SWEEPS}/{sweep_name(overrides, sweeper, params, safe_to_change)}"


def sweep_subdir(root: str, sweep_folder: str, run: str) -> str:
    """A job's folder inside its sweep folder: "." when the sweep folder is the job's own run folder
    (one job, see sweep_dir), else the job's run name."""
    return "." if os.path.normpath(str(sweep_folder)) == os.path.normpath(f"{root}/{run}") else str(run)


def master_is_sweep(master: "DictConfig") -> bool:
    """`is_sweep` for a composed master config (the one the sweeper and the launcher get)."""
    from omegaconf import OmegaConf

    overrides = OmegaConf.select(master, "hydra.overrides.task", default=[]) or []
    choices = OmegaConf.select(master, "hydra.runtime.choices", default={}) or {}
    sweeper = choices.get("hydra/sweeper") if hasattr(choices, "get") else None
    params = OmegaConf.select(master, "hydra.sweeper.params", default=None)
    return is_sweep(list(overrides), sweeper, params)


def register_resolvers() -> None:
    """`steadfast_run_name`, `steadfast_sweep_dir` and `steadfast_sweep_subdir`, used by the library's `steadfast` config."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(
        "steadfast_run_name", lambda overrides, safe=(): run_name(list(overrides), list(safe or ())), replace=True
    )
    OmegaConf.register_new_resolver("steadfast_sweep_dir", sweep_dir, replace=True)
    OmegaConf.register_new_resolver("steadfast_sweep_subdir", sweep_subdir, replace=True)


register_resolvers()
