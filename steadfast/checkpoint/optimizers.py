"""Whether an optimizer's saved state fits the live optimizer, checked before anything is applied.

An optimizer's state_dict names its parameters by position (`param_groups[g]["params"]`: ids into
`state`), so a state saved by an optimizer built over the same parameters in another order (a code
change) loads without complaint: its first step() raises where the shapes differ, and where they do
not (two blocks of the same shape) it silently applies one parameter's moments to another. The
check (`optimizer_misfit`) compares the saved state with the live optimizer, never with a fresh
optimizer's empty state: the groups and their parameter counts; each saved state tensor against
the live parameter at the same place (shape, dtype, sharded or not and how: the placements); and
the parameters' names, which every save records in the manifest (`manifest_fields`: the tracked
modules' parameter names, `<object>.<name>`, per group): a parameter found at another place in the
checkpoint is a misfit. A checkpoint written before the names were recorded is checked without them.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import manifest as mf
from .shards import is_dtensor

Names = List[List[Optional[str]]]  # per param group, each parameter's name (None: not a tracked module's)


_MODULE = torch.nn.Module
_WALKS = ("named_parameters", "_named_members", "named_modules")  # what named_parameters' answer comes from
# One module of a tree as named_parameters reads it: (its prefix, itself, its class, its parameters' keys
# and values, its children's keys and values); a tree's reads, in its order, determine its parameters' names.
_Read = Tuple[str, Any, type, Tuple[str, ...], Tuple[Any, ...], Tuple[str, ...], Tuple[Any, ...]]
Named = Dict[int, str]  # id of a parameter -> its first name


def _reads(prefix: str, module: torch.nn.Module, out: List[_Read]) -> bool:
    """`module`'s reads and its submodules', in the order of named_modules(remove_duplicate=False),
    appended to `out`; False: a module of the tree overrides how its parameters are listed (FSDP's names)."""
    cls = type(module)
    if not all(getattr(cls, walk) is getattr(_MODULE, walk) for walk in _WALKS):
        return False
    params, children = module._parameters, module._modules
    out.append((prefix, module, cls, tuple(params), tuple(params.values()), tuple(children), tuple(children.values())))
    return all(_reads(f"{prefix}{key}.", child, out) for key, child in children.items() if child is not None)


def _named(reads: List[_Read]) -> Named:
    """Each parameter's first name in named_parameters(remove_duplicate=False) order, from a tree's reads."""
    pairs: List[Tuple[int, str]] = []
    for prefix, _, _, keys, values, _, _ in reads:
        if all(map(operator.is_not, values, repeat(None))):
            pairs.extend(zip(map(id, values), map(prefix.__add__, keys)))
        else:
            pairs.extend((id(v), prefix + k) for k, v in zip(keys, values) if v is not None)
    return dict(reversed(pairs))  # the first name of each parameter: the last one set wins


def _unchanged(module: torch.nn.Module, reads: List[_Read], at: int) -> int:
    """Where `module`'s subtree ends in `reads` if, read now, it reads as `reads` from `at` on (the same
    modules, classes, keys and objects, by identity); -1 if not. Compared in place, without a new read."""
    if at >= len(reads):
        return -1
    _, was, cls, keys, values, names, children = reads[at]
    params, modules = module._parameters, module._modules
    if (
        module is not was
        or type(module) is not cls
        or len(params) != len(keys)
        or len(modules) != len(names)
        or not all(map(operator.is_, params.values(), values))
        or not all(map(operator.is_, modules.values(), children))
        or not all(map(operator.eq, params, keys))
        or not all(map(operator.eq, modules, names))
    ):
        return -1
    at += 1
    for child in children:
        if child is not None:
            at = _unchanged(child, reads, at)
            if at < 0:
                return -1
    return at


def _default_walks(reads: List[_Read]) -> bool:
    """Whether every class of a tree still lists its parameters as torch.nn.Module does."""
    return all(getattr(cls, walk) is getattr(_MODULE, walk) for cls in {r[2] for r in reads} for walk in _WALKS)


class ParamNames:
    """param_names for a manager's saves: a module tree's names kept while its modules' tables are as they
    were (compared in place with the last read, in a C-level pass each, nothing rebuilt)."""

    def __init__(self) -> None:
        self._last: Dict[str, Tuple[List[_Read], Named]] = {}  # object name -> its tree's reads and names

    def named(self, name: str, module: torch.nn.Module) -> Named:
        last = self._last.get(name)
        if last is not None and _unchanged(module, last[0], 0) == len(last[0]) and _default_walks(last[0]):
            return last[1]
        reads: List[_Read] = []
        if not _reads(f"{name}.", module, reads):
            self._last.pop(name, None)
            return dict(reversed([(id(p), f"{name}.{key}") for key, p in module.named_parameters(remove_duplicate=False)]))
        named = _named(reads)
        self._last[name] = (reads, named)  # holds the parameters: their ids stay theirs
        return named

    def fields(self, objects: Dict[str, Any]) -> Dict[str, Any]:
        """manifest_fields(objects)."""
        names = param_names(objects, self.named)
        return {mf.PARAMS: names} if names else {}


def param_names(objects: Dict[str, Any], named: Optional[Callable[[str, torch.nn.Module], Named]] = None) -> Dict[str, Names]:
    """Each optimizer among `objects` (name -> object) -> its param groups' parameters by name, where
    the parameter belongs to a module among `objects`; optimizers none of whose parameters does are left out.
    A parameter found under several names has the first that named_parameters(remove_duplicate=False)
    lists, read from the modules' own tables (`named`: a ParamNames' memo)."""
    trees = [(named or ParamNames().named)(name, obj) for name, obj in objects.items() if isinstance(obj, torch.nn.Module)]
    if len(trees) == 1:
        ids = trees[0]
    else:
        ids = {}
        for tree in reversed(trees):  # an earlier object's name wins
            ids.update(tree)
    out: Dict[str, Names] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            groups = [list(map(ids.get, map(id, group["params"]))) for group in obj.param_groups]
            if any(n is not None for g in groups for n in g):
                out[name] = groups
    return out


def manifest_fields(objects: Dict[str, Any]) -> Dict[str, Any]:
    """What a save records in the manifest of its optimizers (nothing without one)."""
    names = param_names(objects)
    return {mf.PARAMS: names} if names else {}


def order_misfit(saved: Names, live: Names) -> Optional[str]:
    """Why the parameters' places differ (None: every parameter named in both is at the same place)."""
    places = {n: (g, j) for g, group in enumerate(saved) for j, n in enumerate(group) if n is not None}
    for g, group in enumerate(live):
        for j, name in enumerate(group):
            where = places.get(name) if name is not None else None
            if where is not None and where != (g, j):
                return (
                    f"param_groups[{g}].params[{j}] is {name} here, at param_groups[{where[0]}].params[{where[1]}] "
                    "in the checkpoint (an optimizer built over its parameters in another order)"
                )
    return None


def _sharding(t: Any) -> str:
    return f"sharded {list(t.placements)} over a mesh of {list(t.device_mesh.shape)}" if is_dtensor(t) else "not sharded"


def _tensor_misfit(value: torch.Tensor, param: Any, where: str) -> Optional[str]:
    if tuple(value.shape) != tuple(param.shape) or (
        value.is_floating_point() and param.is_floating_point() and value.dtype != param.dtype
    ):
        return f"{value.dtype} {list(value.shape)} in the checkpoint, the parameter at {where} is {param.dtype} {list(param.shape)} here"
    if _sharding(value) != _sharding(param):
        return f"{_sharding(value)} in the checkpoint, the parameter at {where} is {_sharding(param)} here"
    return None


def optimizer_misfit(
    optimizer: Any, saved: Any, saved_names: Optional[Names] = None, live_names: Optional[Names] = None
) -> Optional[str]:
    """Why `saved` (an Optimizer.state_dict) cannot be loaded into the live `optimizer` (None: it
    fits); `saved_names`, `live_names`: its parameters' names in the checkpoint and here (param_names;
    None: not recorded). See the module's docstring. Only the positional form (integer parameter
    ids) is checked place by place; a keyed form passes."""
    if not isinstance(saved, dict):
        return f"the state: a dict was expected, the checkpoint holds a {type(saved).__name__}"
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return "the state: param_groups (a list) and state (a dict) were expected"
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups):
        return f"param_groups: {len(groups)} in the checkpoint, {len(live_groups)} here"
    for g, (group, live_group) in enumerate(zip(groups, live_groups)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list):
            return f"param_groups[{g}].params: a list was expected"
        if len(ids) != len(live_group["params"]):
            return f"param_groups[{g}]: {len(ids)} parameters in the checkpoint, {len(live_group['params'])} here"
    if saved_names is not None and live_names is not None:
        problem = order_misfit(saved_names, live_names)
        if problem:
            return problem
    for g, (group, live_group) in enumerate(zip(groups, live_groups)):
        for j, (pid, param) in enumerate(zip(group["params"], live_group["params"])):
            if not isinstance(pid, int) or isinstance(pid, bool):
                return None
            entry = state.get(pid)
            if entry is None:
                continue
            if not isinstance(entry, dict):
                return f"state.{pid}: a dict was expected, the checkpoint holds a {type(entry).__name__}"
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # a step count, not a per-element buffer
                problem = _tensor_misfit(value, param, f"param_groups[{g}].params[{j}]")
                if problem:
                    return f"state.{pid}.{key}: {problem}"
    return None
