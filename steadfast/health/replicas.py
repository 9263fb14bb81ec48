"""Replica divergence: under data parallelism every rank must hold bit-identical parameters.

A fingerprint of this rank's replicated parameters is one integer: each tensor's bits read as
integers of its element size and summed (int64, wrapping), the sums weighed by odd numbers in the
tensors' order and added. Any single flipped bit changes it (a change of 2^b times an odd weight is
never 0 modulo 2^64); it is folded to 52 bits to travel exactly as a float64 on the control plane.
One pass over the parameters' bytes, a kernel per tensor on a GPU, copied to the host without
waiting; compared every `anomaly.fingerprint_every_n_steps` steps and at every checkpoint.

When the fingerprints differ, every rank's fingerprint of each tensor is compared (once, at once)
to name the first tensor that differs; a rank that disagrees with a strict majority has its
parameters replaced by a majority rank's (`heal`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpoint.shards import is_dtensor

MASK = (1 << 52) - 1
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replicated(model: Any) -> List[Tuple[str, torch.Tensor]]:
    """The model's parameters that every rank holds whole (a sharded DTensor is not a replica)."""
    return [(name, p) for name, p in model.named_parameters() if not is_dtensor(p)]


def _sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
        flat = flat.view(_INT[flat.element_size()]) if flat.element_size() in _INT else flat.view(torch.uint8)
    return flat.sum(dtype=torch.int64)


def sums(params: Sequence[Tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each tensor's bits summed as integers (int64, on the parameters' device)."""
    return torch.stack([_sum(p) for _, p in params])


def combined(tensor_sums: torch.Tensor) -> torch.Tensor:
    """One int64 for all of them, on their device: the sums weighed by 1, 3, 5, ... and added."""
    weights = torch.arange(1, 2 * len(tensor_sums) + 1, 2, dtype=torch.int64, device=tensor_sums.device)
    return (tensor_sums * weights).sum()


def fold(value: int) -> float:
    """A 64-bit integer as 52 bits: exact in a float64 (the control plane's numbers)."""
    value &= (1 << 64) - 1
    return float((value ^ (value >> 52)) & MASK)


def majority(values: Sequence[float]) -> Tuple[Optional[float], List[int]]:
    """(the value a strict majority of ranks holds, or None; the ranks that differ from the most common)."""
    counts: Dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=lambda v: (counts[v], -values.index(v)))
    differ = [r for r, v in enumerate(values) if v != common]
    return (common if counts[common] * 2 > len(values) else None), differ


def first_differing(comm: Any, params: Sequence[Tuple[str, torch.Tensor]], ranks: Sequence[int]) -> Optional[str]:
    """Collective, at once: the name of the first tensor whose fingerprint differs between the ranks."""
    mine = [fold(int(v)) for v in sums(params).tolist()]
    n, ws = len(mine), comm.world_size
    values = torch.zeros(ws * n, dtype=torch.float64)
    values[comm.rank * n : (comm.rank + 1) * n] = torch.tensor(mine, dtype=torch.float64)
    rows = comm.start_sum(values).wait().view(ws, n)
    for i, (name, _) in enumerate(params):
        if len(set(rows[:, i].tolist())) > 1:
            return name
    return None


def heal(comm: Any, params: Sequence[Tuple[str, torch.Tensor]], source: int) -> None:
    """Collective: every rank's parameters become rank `source`'s (a sum in which only it gives its values)."""
    with torch.no_grad():
        for _, p in params:
            mine = p.detach().clone() if comm.rank == source else torch.zeros_like(p)
            p.copy_(comm.all_reduce_sum(mine))
