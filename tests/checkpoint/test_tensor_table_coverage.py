"""The tensor table's coverage check: exact at any number of pieces (issue 32, finding 2)."""

from __future__ import annotations

import time
from typing import Any, Dict, List

from steadfast.checkpoint.manifest import tensor_table_problem

FILES: Dict[str, Any] = {"rank00000.bin": {}, "rank00001.bin": {}}


def _table(pieces: List[List[Any]], rows: int, cols: int = 4) -> Dict[str, Any]:
    return {"w": {"dtype": "F32", "shape": [rows, cols], "pieces": pieces}}


def test_a_duplicated_piece_among_more_than_512_is_refused() -> None:
    # piece 0 twice (their sizes add up to the whole) plus 600 empty pieces: rows 15-29 covered by none
    pieces = [["rank00000.bin", [0, 0], [15, 4]]] * 2 + [["rank00001.bin", [15, 0], [0, 4]]] * 600
    assert tensor_table_problem(_table(pieces, 30), FILES) == "tensor 'w': two pieces overlap"


def test_2000_pieces_are_swept_exactly_and_fast() -> None:
    n = 2000
    good = [["rank00000.bin", [i, 0], [1, 4]] for i in range(n)]
    started = time.monotonic()
    assert tensor_table_problem(_table(good, n), FILES) is None
    overlapping = good[:-1] + [["rank00001.bin", [7, 0], [1, 4]]]  # the last row missing, row 7 twice
    assert tensor_table_problem(_table(overlapping, n), FILES) == "tensor 'w': two pieces overlap"
    gap = good[:-1]
    assert "its pieces hold" in str(tensor_table_problem(_table(gap, n), FILES))
    assert time.monotonic() - started < 5  # the pairwise check took minutes here


def test_pieces_split_along_the_second_dimension() -> None:
    halves = [["rank00000.bin", [0, 0], [8, 2]], ["rank00001.bin", [0, 2], [8, 2]]]
    assert tensor_table_problem(_table(halves, 8), FILES) is None
    shifted = [["rank00000.bin", [0, 0], [8, 2]], ["rank00001.bin", [0, 1], [8, 1]]]
    assert tensor_table_problem(_table(shifted, 8, 3), FILES) == "tensor 'w': two pieces overlap"


def test_a_0d_tensor_has_one_piece() -> None:
    one = {"s": {"dtype": "F32", "shape": [], "pieces": [["rank00000.bin", [], []]]}}
    assert tensor_table_problem(one, FILES) is None
    one["s"]["pieces"] *= 2
    assert tensor_table_problem(one, FILES) is not None
