"""The backend registry: one Backend class per schema of steadfast.contract.schemas.BACKEND_SCHEMAS
(the one map from a backend's name to its schema). The rest of the launcher asks a job's backend,
`of(job.backend)`, and never which one it is."""

from __future__ import annotations

from typing import Dict, Type

from steadfast.contract.schemas import BACKEND_SCHEMAS, BackendConf

from .base import Backend
from .horovod import HorovodBackend
from .local import LocalBackend
from .torchrun import TorchrunBackend

REGISTRY: Dict[Type[BackendConf], Type[Backend]] = {cls.schema: cls for cls in (TorchrunBackend, HorovodBackend, LocalBackend)}
assert set(REGISTRY) == set(BACKEND_SCHEMAS.values()), "every backend schema needs exactly one Backend"


def of(conf: BackendConf) -> Backend:
    """The backend that runs a job with this (typed) `backend` config (an app's subclass of a schema too)."""
    schema = next((t for t in type(conf).__mro__ if t in REGISTRY), None)
    if schema is None:
        raise TypeError(f"no backend is registered for {type(conf).__name__} (backend.name={conf.name!r})")
    return REGISTRY[schema](conf)


__all__ = ["Backend", "REGISTRY", "of"]
