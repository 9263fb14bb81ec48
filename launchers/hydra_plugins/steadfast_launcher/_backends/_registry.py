"""The launcher's side of the backend registry: each backend's class, found from its typed config, and
`@register`, what every backend module ends with.

Its state lives here (and in steadfast.contract.backends), in a module whose name starts with an
underscore: Hydra's plugin scan executes every other module under hydra_plugins a second time,
which would empty it. For the same reason a backend is found by its name, never by its schema's
class: the scan may run after a job's config was typed (a parallel sweep's job process unpickles
its job, then restores Hydra's state, which scans), and the module it executes again defines the
classes anew.
"""

from __future__ import annotations

from typing import Dict, Mapping, Type

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import backends
from steadfast.contract.backends import BackendConf, BackendSpec
from steadfast.contract.schemas import bad

from .._types import ConfigError
from .base import Backend

_CLASSES: Dict[str, Type[Backend]] = {}  # by backend name


def register(backend: Type[Backend]) -> Type[Backend]:
    """A backend module's last word (a class decorator): its spec in the contract's registry, its
    class for `of`, its schema as `backend/schema_<name>` in Hydra's ConfigStore (what its YAML file
    extends through its defaults list)."""
    spec = backend.spec
    backends.register(spec)
    _CLASSES[spec.name] = backend
    ConfigStore.instance().store(group="backend", name=f"schema_{spec.name}", node=spec.schema, provider="steadfast")
    return backend


def backend_class(spec: BackendSpec) -> Type[Backend]:
    return _CLASSES[spec.name]


def of(conf: BackendConf) -> Backend:
    """The backend that runs a job with this (typed) `backend` config (an app's subclass of a schema too)."""
    spec = backends.spec(conf.name)
    if spec is None:
        raise TypeError(f"no backend is registered as {conf.name!r} ({type(conf).__name__})")
    return backend_class(spec)(conf)


def backend_from(node: object) -> BackendConf:
    """A typed backend from a config node (typed or plain; none: the default backend), or a ConfigError naming the problem."""
    if isinstance(node, BackendConf):
        return node
    if node is None:
        return backends.default().schema()
    name = (
        OmegaConf.select(node, "name")
        if isinstance(node, DictConfig)
        else node.get("name")
        if isinstance(node, Mapping)
        else None
    )
    spec = backends.spec(str(name))
    if spec is None:
        raise ConfigError([bad("backend.name", name, f"one of {', '.join(backends.names())}")])
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.schema), node))  # type: ignore[return-value]
