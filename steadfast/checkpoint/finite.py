"""A poisoned state is never committed: non-finite parameters or optimizer state, found.

A save refuses a state whose model parameters or optimizer state hold a NaN or an infinity
(tracked.Checkpointer.save), and a checkpoint or a snapshot read back with one is unusable, as a
damaged file is (restore.check_fits): the resume falls back to the one before. Only parameters and
an optimizer's state are looked at: a module's buffers may hold infinities on purpose (an
attention mask's -inf), and a user's own objects mean what they mean.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch

from .shards import is_dtensor


def _parameters(obj: object) -> Set[str]:
    return {name for name, _ in obj.named_parameters()} if isinstance(obj, torch.nn.Module) else set()


def _tensors(name: str, live: object, state: object) -> Iterator[Tuple[str, torch.Tensor]]:
    """(where, tensor) of each parameter (a module's) or optimizer state tensor in `state`."""
    if isinstance(live, torch.nn.Module) and isinstance(state, Mapping):
        for key in sorted(_parameters(live) & set(state)):
            yield f"{name}.{key}", state[key]
    elif isinstance(live, torch.optim.Optimizer) and isinstance(state, Mapping) and isinstance(state.get("state"), Mapping):
        for pid, entry in state["state"].items():
            for key, value in entry.items() if isinstance(entry, Mapping) else ():
                yield f"{name}.state.{pid}.{key}", value


def nonfinite(objects: Mapping[str, object], states: Optional[Mapping[str, object]] = None) -> Optional[str]:
    """Where the first NaN or infinity of a parameter or an optimizer's state is (None: there is none):
    of the live objects, or of `states` loaded for them (name -> state). One pass over their bytes; on
    a GPU one wait for the device, at the end."""
    found: List[Tuple[str, torch.Tensor]] = []
    for name, obj in objects.items():
        state = states.get(name) if states is not None else _live_state(obj)
        for where, t in _tensors(name, obj, state):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                found.append((where, t.to_local() if is_dtensor(t) else t))  # type: ignore[attr-defined]
    if not found:
        return None
    finite: Dict[torch.device, List[torch.Tensor]] = {}
    for _, t in found:
        finite.setdefault(t.device, []).append(torch.isfinite(t.detach()).all())
    if all(bool(torch.stack(flags).all()) for flags in finite.values()):
        return None
    return next(where for where, t in found if not bool(torch.isfinite(t.detach()).all()))


def _live_state(obj: object) -> object:
    if isinstance(obj, torch.nn.Module):
        return dict(obj.named_parameters())
    return obj.state_dict() if isinstance(obj, torch.optim.Optimizer) else None
