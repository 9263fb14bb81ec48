"""The backends: every other module of this package is one (its schema, its `Backend` class and its
registration, `@register`), with its YAML file in steadfast/conf/backend/. Importing this package
imports them all, so a new backend is one new module here and one YAML file. The rest of the
launcher asks a job's backend, `of(job.backend)`, and never which one it is."""

from __future__ import annotations

import importlib
import pkgutil

from ._registry import backend_class, backend_from, of, register
from .base import Attempt, Backend

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Attempt", "Backend", "backend_class", "backend_from", "of", "register"]
