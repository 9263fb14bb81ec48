"""A step's loss is read once, on the host, for the metrics window and the anomaly watch
(steadfast/loop/boundary.py `_on_host`): a one-number CPU tensor through `.tolist()`, which must give
what `.item()` gives, bit for bit; any other shape through `.item()` (its number, or its error)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from steadfast.loop.boundary import _on_host


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_scalar_loss_reads_as_item_reads_it(dtype: torch.dtype) -> None:
    for value in (2.302585093, -0.0, 1e-40, 6.5e4, 3.4e38, math.inf, -math.inf, math.nan):
        loss = (torch.tensor(value, dtype=dtype, requires_grad=True) * 1).squeeze()  # a loss: a graph, no warning
        got = _on_host(loss)
        assert type(got) is float and _bits(got) == _bits(loss.item()), (dtype, value)


def test_other_values_and_shapes() -> None:
    assert _on_host(torch.tensor([1.5])) == 1.5  # one number in a 1-d tensor: .item()'s
    assert _on_host(torch.tensor(3)) == 3 and type(_on_host(torch.tensor(3))) is int  # as .item() gives it
    with pytest.raises(RuntimeError):
        _on_host(torch.tensor([1.0, 2.0]))  # not one number: .item()'s error
    assert _on_host(None) is None and _on_host(0.25) == 0.25
    meta = torch.empty((), device="meta")  # not on the host: as it is (a device's tensor is never read at a step)
    assert _on_host(meta) is meta
