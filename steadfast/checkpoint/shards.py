"""Where each rank's piece of a sharded tensor (a DTensor: FSDP2's parameters and optimizer state)
lies in the whole tensor, and how to build the piece a rank needs from pieces saved by other ranks.

A piece is a box: its offset in the whole tensor and its shape. DTensor's `Shard(d)` placement splits
dimension d as `torch.chunk` does (pieces of ceil(n / parts), the last ones shorter or empty), one
mesh dimension after the other; `Replicate()` gives every coordinate of that mesh dimension the same
piece, which only coordinate 0 writes. Other placements (Partial, strided sharding) are refused with
a message naming the tensor: their pieces are not boxes of the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape) in the whole tensor


def is_dtensor(t: Any) -> bool:
    """A DTensor, without importing torch.distributed.tensor unless one could exist."""
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Piece:
    """This rank's piece of a sharded tensor."""

    local: torch.Tensor  # the piece's values (a plain tensor)
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]  # of the piece; the whole tensor's is `whole`
    whole: Tuple[int, ...]
    writer: bool  # the one rank that stores this piece (others hold a replica of it)


def _split(length: int, parts: int, index: int) -> Tuple[int, int]:
    """(start, size) of part `index` of `length` split as torch.chunk splits it."""
    size = -(-length // parts) if parts else 0
    start = min(length, size * index)
    return start, max(0, min(size, length - start))


def box_of(
    whole: Sequence[int], placements: Sequence[Any], coordinate: Sequence[int], mesh_shape: Sequence[int], what: str
) -> Box:
    """The box of the piece at `coordinate` of a mesh of `mesh_shape` with these placements."""
    from torch.distributed.tensor import Replicate, Shard

    offset, shape = [0] * len(whole), list(whole)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise TypeError(f"{what}: placement {placement} is not supported in checkpoints (Shard and Replicate are)")
        d = placement.dim if placement.dim >= 0 else placement.dim + len(whole)
        start, size = _split(shape[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offset[d] += start
        shape[d] = size
    return tuple(offset), tuple(shape)


def piece_of(t: Any, what: str) -> Piece:
    """This rank's piece of the DTensor `t` (its local tensor and where that lies in the whole)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{what}: this rank is not in the tensor's device mesh")
    whole = tuple(int(d) for d in t.shape)
    offset, shape = box_of(whole, t.placements, coordinate, tuple(mesh.shape), what)
    local = t.to_local()
    if tuple(local.shape) != shape:
        raise ValueError(f"{what}: its local piece has shape {tuple(local.shape)}, its placements {t.placements} say {shape}")
    from torch.distributed.tensor import Replicate

    writer = all(c == 0 for c, p in zip(coordinate, t.placements) if type(p) is Replicate)
    return Piece(local, offset, shape, whole, writer)


def target_box(t: Any) -> Optional[Box]:
    """The box a live DTensor `t` holds on this rank (None: `t` is not a DTensor)."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    return box_of(tuple(int(d) for d in t.shape), t.placements, coordinate, tuple(mesh.shape), "tensor")


def like(local: torch.Tensor, template: Any) -> Any:
    """A DTensor with `template`'s mesh and placements whose piece on this rank is `local`."""
    from torch.distributed.tensor import DTensor

    whole = tuple(int(d) for d in template.shape)
    strides = tuple(int(s) for s in torch.empty(whole, device="meta").stride())
    return DTensor.from_local(
        local.to(template.device),
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=torch.Size(whole),
        stride=strides,
    )


def overlap(a: Box, b: Box) -> Optional[Box]:
    """The intersection of two boxes (None if empty)."""
    offset, shape = [], []
    for (ao, a_n), (bo, b_n) in zip(zip(*a), zip(*b)):
        lo, hi = max(ao, bo), min(ao + a_n, bo + b_n)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return tuple(offset), tuple(shape)


def volume(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fill(target: torch.Tensor, target_box: Box, piece: torch.Tensor, piece_box: Box) -> int:
    """Copy the part of `piece` (whose box is piece_box) that lies in target_box into `target`;
    returns the number of elements copied."""
    common = overlap(target_box, piece_box)
    if common is None:
        return 0
    (co, cs), (to, _), (po, _) = common, target_box, piece_box
    dst = target[tuple(slice(c - t, c - t + n) for c, t, n in zip(co, to, cs))] if cs else target
    src = piece[tuple(slice(c - p, c - p + n) for c, p, n in zip(co, po, cs))] if cs else piece
    dst.copy_(src)
    return volume(cs)
