"""The app's own keys, checked before any worker starts (part of the library's pre-flight).

With a schema (`hydra.launcher.app_schema: "module:Dataclass"`, `__main__:Config` for a class in
the script being run): the app's keys (every top-level key but the library's) are typed with it
like the library's own: unknown keys (in YAML files or on the command line), wrong types, missing
required keys and numbers out of range are refused, each naming the key (and the nearest known key).
Without one: a key added on the command line with `+` (`+lrr=0.1`) that nothing declares is refused,
with the nearest existing key: `+` adds a key that the app never reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .contract.keys import LIBRARY_KEYS
from .contract.schemas import bad, bounded

SCHEMA_KEY = "hydra.launcher.app_schema"


def did_you_mean(key: str, known: Sequence[str]) -> str:
    """ " (did you mean lr?)" for the known key nearest to `key` (the last part of a dotted key), or ""."""
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, [k for k in known if k != leaf], n=1, cutoff=0.6)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def schema_of(job_cfg: DictConfig) -> Tuple[Optional[Type[Any]], List[str]]:
    """The dataclass `hydra.launcher.app_schema` names (None when unset), or the problem finding it."""
    spec = OmegaConf.select(job_cfg, SCHEMA_KEY)
    if spec is None:
        return None, []
    module, _, name = str(spec).partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        return None, [bad(SCHEMA_KEY, spec, f"'module:Dataclass' naming the app's schema ({type(exc).__name__}: {exc})")]
    if not (isinstance(found, type) and dataclasses.is_dataclass(found)):
        return None, [bad(SCHEMA_KEY, spec, "'module:Dataclass': a dataclass of the app's own keys")]
    return found, []


def problems(job_cfg: DictConfig, cfg: DictConfig) -> List[str]:
    """`job_cfg`: the job's config (for hydra.*); `cfg`: the task's config, resolved."""
    schema, out = schema_of(job_cfg)
    if out:
        return out
    own = OmegaConf.create({k: cfg[k] for k in cfg if k not in LIBRARY_KEYS})
    if schema is not None:
        return _typed(own, schema)
    return _added(job_cfg, cfg)


def _unknown(node: Any, schema: Type[Any], prefix: str) -> List[str]:
    """Keys of `node` that `schema` (a dataclass) does not have, at any depth of nested dataclasses."""
    if not isinstance(node, DictConfig):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = []
    for key in map(str, node):
        full = f"{prefix}{key}"
        if key not in fields:
            out.append(
                f"{full}: not a key of the app's schema {schema.__name__}{did_you_mean(full, list(fields))}; its keys: {', '.join(fields)}"
            )
            continue
        kind = fields[key].type
        nested = kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None
        if nested is None and isinstance(kind, str):  # postponed annotations: the name of a dataclass in its module
            nested = getattr(importlib.import_module(schema.__module__), kind, None)
            nested = nested if isinstance(nested, type) and dataclasses.is_dataclass(nested) else None
        if nested is not None:
            out += _unknown(node[key], nested, f"{full}.")
    return out


def _typed(own: DictConfig, schema: Type[Any]) -> List[str]:
    out = _unknown(own, schema, "")
    if out:
        return out
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), own))
    except MissingMandatoryValue as exc:
        return [
            f"{exc.full_key}: required by the app's schema {schema.__name__}, and not set (set it in the config or on the command line)"
        ]
    except OmegaConfBaseException as exc:
        value = OmegaConf.select(own, exc.full_key) if exc.full_key else None
        return [bad(exc.full_key or "?", value, f"{str(exc.msg).splitlines()[0]} (the app's schema {schema.__name__})")]
    return bounded("", typed)


def _added(job_cfg: DictConfig, cfg: DictConfig) -> List[str]:
    """`+KEY=VALUE` overrides of keys (not config groups) the app's config does not have: refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: Dict[str, Any] = dict(OmegaConf.select(job_cfg, "hydra.runtime.choices") or {})
    task = [str(o) for o in OmegaConf.select(job_cfg, "hydra.overrides.task") or []]
    out = []
    for override in OverridesParser.create().parse_overrides(task):
        key = override.key_or_group
        if not override.is_add() or key.split(".")[0] in (*choices, *LIBRARY_KEYS):
            continue
        parent, _, leaf = key.rpartition(".")
        siblings = OmegaConf.select(cfg, parent) if parent else cfg
        known = [str(k) for k in siblings] if isinstance(siblings, DictConfig) else []
        out.append(
            f"+{key}: not a key of the app's config{did_you_mean(key, known)}. `+` adds a key that nothing "
            f"declares: declare it in the app's config file (with a default) or in its schema ({SCHEMA_KEY})"
        )
    return out
