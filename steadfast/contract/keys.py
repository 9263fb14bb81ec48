"""Which config keys change what is trained: one table, used for run names and for the resume guard.

A key that changes what is trained (the model, the data, the optimizer, the seed, ...) names the
run (`run.name` is derived from such overrides) and must match when a run resumes from a
checkpoint. A key that does not (how many epochs, how often to save, how workers start, ...)
neither renames the run nor is refused on resume, so running again with `trainer.max_epochs=40`
continues the 20-epoch run. One kind of row differs on purpose: how many workers there are names the
run, but a resume with another world size is the world-size policy's business, not config drift. Those
rows come from the backend registry (each backend declares the keys that set its world size).

An app adds its own neutral keys with `run.safe_to_change` (a list of keys or `prefix.`es).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import backends

# The library's config groups (steadfast/conf/, the launcher's schemas) and what each is for: an
# app's own key must not take one of these names (nor `run`, `resume`), and --help describes them.
GROUPS: Dict[str, str] = {
    "backend": "how the workers start: torch elastic (torchrun), Horovod, or in this process",
    "restart": "what happens when a worker fails: restart.max_restarts, restart.hang_timeout_s",
    "checkpoint": "when checkpoints are written and how many are kept",
    "snapshot": "copies in shared memory between checkpoints",
    "parallel": "how run.setup spreads the model over the ranks: ddp, fsdp, none",
    "fault": "fault injection, to rehearse recovery",
    "logger": "progress display, and metrics also to TensorBoard, metrics.csv or MLflow (logger=tensorboard, csv, mlflow; several: logger.sinks=[csv,mlflow])",
    "anomaly": "non-finite losses and loss spikes rolled back, replicas' divergence found (anomaly=default, spikes, off)",
    "cluster": "where jobs run: here (none) or submitted to Slurm",
}
LIBRARY_KEYS: Tuple[str, ...] = (*GROUPS, "run", "resume", "hydra")


def shadowing(group: str, value: object) -> str:
    """The problem of an app's key that takes a library group's name (its value is not the group's node)."""
    return (
        f"{group}={value!r}: `{group}` is the library's config group ({GROUPS[group]}), so the app's own "
        f"key cannot take that name: rename the app's key (e.g. my_{group}), or pick an option with "
        f"`- {group}: OPTION` in the defaults list"
    )


@dataclass(frozen=True)
class KeyRule:
    prefix: str  # a full key, or a group ending in "."
    names_run: bool
    checked_on_resume: bool
    why: str

    def matches(self, key: str) -> bool:
        return key == self.prefix.rstrip(".") or key.startswith(self.prefix) if self.prefix.endswith(".") else key == self.prefix


# The first matching row wins; a key no row matches changes what is trained.
RULES: Tuple[KeyRule, ...] = (
    KeyRule("hydra.", False, False, "Hydra's own settings"),
    KeyRule("run.", False, False, "the run's name and resume options"),
    KeyRule("resume", False, False, "whether to resume"),
    KeyRule("checkpoint.", False, False, "how often and where checkpoints are written"),
    KeyRule("snapshot.", False, False, "in-memory snapshots between checkpoints"),
    KeyRule("restart.", False, False, "the restart policy"),
    KeyRule("cluster.", False, False, "where the job is submitted"),
    KeyRule("logger.", False, False, "what a person sees"),
    KeyRule("anomaly.", False, False, "what is done about a loss spike or a non-finite value: changes only a run that has one"),
    KeyRule("fault.", True, False, "a rehearsal is a run of its own, but a recovered run ends with the same weights"),
    KeyRule("parallel.param_dtype", True, True, "mixed precision changes the numbers trained"),
    KeyRule("parallel.reduce_dtype", True, True, "mixed precision changes the numbers trained"),
    KeyRule(
        "parallel.", True, False, "how the model is spread over the ranks: names the run; a resume with another layout reshards"
    ),
    KeyRule("backend.name", True, False, "the world size's layout: names the run; resuming with another is elastic"),
    # here: each registered backend's world-size keys (rules())
    KeyRule("backend.", False, False, "how the workers start and meet (rendezvous, start method, timeouts)"),
)
WORLD_SIZE = "the world size: names the run; resuming with another is elastic"


def rules() -> Tuple[KeyRule, ...]:
    """RULES with the registered backends' world-size keys before the catch-all `backend.` row."""
    sizes = tuple(KeyRule(key, True, False, WORLD_SIZE) for key in backends.world_size_keys())
    return (*RULES[:-1], *sizes, RULES[-1])


def rule(key: str, safe_to_change: Iterable[str] = ()) -> Optional[KeyRule]:
    """The row for `key` (None: it changes what is trained). `safe_to_change` are the app's own neutral keys.
    The backend group's choice (`backend=local`) is its name: it names the run as `backend.name` does."""
    key = key.lstrip("+~")
    key = "backend.name" if key == "backend" else key
    for prefix in safe_to_change:
        row = KeyRule(str(prefix), False, False, "declared by the app in run.safe_to_change")
        if row.matches(key):
            return row
    return next((r for r in rules() if r.matches(key)), None)


def names_run(key: str, safe_to_change: Iterable[str] = ()) -> bool:
    found = rule(key, safe_to_change)
    return found is None or found.names_run


def checked_on_resume(key: str, safe_to_change: Iterable[str] = ()) -> bool:
    found = rule(key, safe_to_change)
    return found is None or found.checked_on_resume


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def naming_overrides(overrides: Sequence[str], safe_to_change: Iterable[str] = ()) -> List[str]:
    """The overrides that name a run, normalised (no +/~ prefix), sorted."""
    safe = list(safe_to_change)
    return sorted(o.lstrip("+~") for o in overrides if names_run(override_key(o), safe))
