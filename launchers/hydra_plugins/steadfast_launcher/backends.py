"""What a backend module uses, and the import that registers every backend.

A backend is one module of `_backends/` (or any module imported before the launch, e.g. one that
Hydra's plugin scan finds under a `hydra_plugins` package) and one YAML file in a `backend` config
group: the module declares its schema (a dataclass extending BackendConf), a `Backend` subclass
with its `BackendSpec` (world-size keys, rank variables, collective), decorated with `@register`;
the YAML file selects `schema_<name>` in its defaults list. Importing this module imports the
launcher's own backends (Hydra's plugin scan does at start-up; a tool that names runs without Hydra
imports it).
"""

from steadfast.contract.backends import BackendConf, BackendSpec, RankEnv
from steadfast.contract.stop import Stopped, StopReason

from ._backends import Attempt, Backend, register
from ._types import Completed, Failed, Outcome

__all__ = [
    "Attempt",
    "Backend",
    "BackendConf",
    "BackendSpec",
    "Completed",
    "Failed",
    "Outcome",
    "RankEnv",
    "StopReason",
    "Stopped",
    "register",
]
