"""The backend registry: which backends exist, each with its schema, the keys that set its world size
and the variables its workers find their rank in. The rest of the contract (the schemas' checks, the
key table) asks it and never lists backends.

The backends register themselves: each is one module of the launcher's `_backends` package (its
schema, its `Backend` class, its `BackendSpec`) plus one YAML file, `steadfast/conf/backend/<name>.yaml`.
Hydra's plugin scan imports them at start-up, and every worker imports them through the launcher's
worker module, so any process that composes or runs a job sees them all. Plain data: no torch, no Hydra.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Tuple, Type

from .schemas import MISSING, bad, bounded


@dataclass
class BackendConf:
    """Base of every backend's schema (the `backend` group); `name` says which backend launches the workers."""

    name: str = MISSING

    def problems(self, prefix: str = "backend") -> List[str]:
        if self.name not in _REGISTRY:
            return [bad(f"{prefix}.name", self.name, f"one of {', '.join(names())}")]
        return bounded(prefix, self)

    @property
    def procs_per_node(self) -> int:
        return 1


@dataclass(frozen=True)
class RankEnv:
    """The environment variables in which a backend tells each worker who it is (read live: an elastic
    restart changes them). The launcher hands their names to the workers (LaunchEnv.rank_env), so a
    worker never needs to know which backend started it."""

    rank: str
    world_size: str
    local_rank: str
    local_world_size: str
    restart_count: str = ""  # the backend's own count of group restarts ("": it restarts nothing itself)
    address: str = ""  # where the workers met (recorded with the rendezvous event)
    port: str = ""
    run_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Optional["RankEnv"]:
        """None when `text` is not one (a worker then reads torch.distributed's variables)."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            return None
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None


# What torch's own launcher (`torchrun`) sets: what a process that no steadfast launcher started may have.
TORCH_DISTRIBUTED = RankEnv(
    rank="RANK",
    world_size="WORLD_SIZE",
    local_rank="LOCAL_RANK",
    local_world_size="LOCAL_WORLD_SIZE",
    restart_count="TORCHELASTIC_RESTART_COUNT",
    address="MASTER_ADDR",
    port="MASTER_PORT",
    run_id="TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class BackendSpec:
    """What the contract knows of a backend."""

    name: str
    schema: Type[BackendConf]
    collective: str  # what its workers initialise (steadfast.contract.env.COLLECTIVES)
    world_size_keys: Tuple[str, ...]  # its keys (under `backend.`) that set how many workers run: they name the run
    rank_env: RankEnv
    cannot_shard: str = ""  # why parameter sharding (parallel=fsdp) cannot run on it; empty: it can
    default: bool = False  # the backend of a job whose config names none

    def __post_init__(self) -> None:
        if self.schema().name != self.name:
            raise ValueError(f"backend {self.name!r}: its schema {self.schema.__name__} defaults name to {self.schema().name!r}")


_REGISTRY: Dict[str, BackendSpec] = {}


def _origin(spec: BackendSpec) -> str:
    return f"{spec.schema.__module__}.{spec.schema.__qualname__}"


def register(spec: BackendSpec) -> None:
    """Add a backend. Its module executed again (Hydra's plugin scan executes every public module
    under hydra_plugins once more) replaces its earlier definition; another module's backend of the
    same name is an error."""
    known = _REGISTRY.get(spec.name)
    if known is not None and _origin(known) != _origin(spec):
        raise ValueError(f"backend {spec.name!r} is registered by {_origin(known)} and by {_origin(spec)}")
    if spec.default and any(s.default for s in _REGISTRY.values() if s.name != spec.name):
        raise ValueError(f"backend {spec.name!r}: another backend is already the default")
    _REGISTRY[spec.name] = spec


def names() -> List[str]:
    return sorted(_REGISTRY)


def specs() -> List[BackendSpec]:
    return [_REGISTRY[n] for n in names()]


def spec(name: str) -> Optional[BackendSpec]:
    return _REGISTRY.get(name)


def schema_of(name: str) -> Type[BackendConf]:
    """The schema of backend `name`; KeyError naming the registered ones if there is none."""
    found = _REGISTRY.get(name)
    if found is None:
        raise KeyError(f"no backend {name!r} is registered (registered: {', '.join(names()) or 'none'})")
    return found.schema


def default() -> BackendSpec:
    found = next((s for s in _REGISTRY.values() if s.default), None)
    if found is None:
        raise LookupError("no backend is registered as the default (import the launcher's backends first)")
    return found


def world_size_keys() -> List[str]:
    """Every registered backend's world-size keys, as full keys (`backend.<key>`), once each."""
    return list(dict.fromkeys(f"backend.{key}" for s in specs() for key in s.world_size_keys))
