"""logger.sinks has csv: <run folder>/metrics.csv, one row per step and one column per metric, for
pandas (`pd.read_csv(path, index_col="step")`) or a spreadsheet.

Columns: `step`, `time` (of the step's first row), then each metric in the order it first came;
an empty cell is a metric not logged at that step. Rows are appended in step order, across restarts
and relaunches. A cell is written once: a step logged again (an epoch's row after the window's at
the same step, a step trained again after a resume) fills only its cells still empty. A new metric
widens the header: the file is then rewritten whole, atomically (as is a fill of an earlier row).

An attempt reads the file back before it writes (bounded, validated: a header that begins with
step,time and names each column once; integer steps, each once; numbers). A last line cut by a crash
is dropped; a file that fails any check is set aside as metrics.csv.unusable (-1, -2, ...) with a
warning, and a new one begun (metrics.jsonl has every row).
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, TextIO, Tuple

from ..contract.files import MAX_JSONL_BYTES, METRICS_CSV_FILE, atomic_write, read_regular
from ._sink import Sink, scalars, step_of

log = logging.getLogger("steadfast")

FIXED = ["step", "time"]
MAX_COLUMNS = 10_000
MAX_NAME = 1000
Table = Tuple[List[str], Dict[int, Dict[str, str]]]  # header, step -> {column: cell}


def parse(data: bytes) -> Tuple[Table, bool]:
    """The table in a metrics.csv, and whether it was whole (False: a last line cut by a crash,
    dropped). Raises ValueError saying what is wrong with a file that is not one we write."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    whole = text.endswith("\n") or not text
    text = text[: text.rfind("\n") + 1]
    try:
        records = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise ValueError(f"not CSV ({exc})") from None
    if not records:
        return (list(FIXED), {}), whole
    header = records[0]
    if header[:2] != FIXED or len(header) > MAX_COLUMNS or len(set(header)) != len(header):
        raise ValueError(f"the header {','.join(header)[:80]!r} does not begin with step,time or names a column twice")
    if any(not name or len(name) > MAX_NAME for name in header):
        raise ValueError("a column without a name, or with one longer than 1000 characters")
    rows: Dict[int, Dict[str, str]] = {}
    for n, record in enumerate(records[1:], start=2):
        if not record[0].isascii() or not record[0].isdigit() or len(record) > len(header) or int(record[0]) in rows:
            raise ValueError(f"line {n}: not a step's row (an integer step not seen before, at most {len(header)} cells)")
        cells = {name: cell for name, cell in zip(header[1:], record[1:]) if cell}
        for cell in cells.values():
            try:
                float(cell)
            except ValueError:
                raise ValueError(f"line {n}: {cell[:40]!r} is not a number") from None
        rows[int(record[0])] = cells
    return (header, rows), whole


def csv_text(header: List[str], rows: Iterable[Tuple[int, Mapping[str, str]]], with_header: bool = True) -> str:
    """CSV lines: the header, then each (step, cells) in the header's order."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if with_header:
        writer.writerow(header)
    writer.writerows([str(step), *(cells.get(name, "") for name in header[1:])] for step, cells in rows)
    return out.getvalue()


class CsvSink(Sink):
    name = "csv"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / METRICS_CSV_FILE
        self.header = list(FIXED)
        self.filled: Dict[int, FrozenSet[str]] = {}  # each step's cells written (the sets shared: most rows have the same)
        self._sets: Dict[FrozenSet[str], FrozenSet[str]] = {}
        self.last = -1  # the last step in the file
        self._file: Optional[TextIO] = None  # appending
        table = self._read()
        if table is not None:
            self.header, rows = table
            for step, cells in rows.items():
                self._filled(step, cells.keys())

    def _read(self) -> Optional[Table]:
        """The file's table (rewritten if its last line was cut); None when there is none to continue."""
        if not os.path.lexists(self.path):
            return None
        data = read_regular(self.path, MAX_JSONL_BYTES)
        try:
            if data is None:
                raise ValueError(f"not a regular file of at most {MAX_JSONL_BYTES >> 20} MiB")
            table, whole = parse(data)
        except ValueError as why:
            aside = self._set_aside()
            log.warning(
                "logger.sinks: csv: %s: %s; set aside as %s, a new one begins (metrics.jsonl has every row)",
                self.path.name,
                why,
                aside,
            )
            return None
        if not whole:
            self._rewrite(*table)
        return table

    def _set_aside(self) -> str:
        for n in range(1000):
            aside = self.path.with_name(f"{self.path.name}.unusable" + (f"-{n}" if n else ""))
            if not os.path.lexists(aside):
                os.rename(self.path, aside)
                return aside.name
        raise RuntimeError(f"{self.path.name}: 1000 unusable copies already set aside")

    def _filled(self, step: int, names: Iterable[str]) -> None:
        have = frozenset(names)
        self.filled[step] = self._sets.setdefault(have, have)
        self.last = max(self.last, step)

    def write(self, row: Mapping[str, Any]) -> None:
        step = step_of(row)
        if step is None:
            return
        have = self.filled.get(step, frozenset())
        values = {k: str(v) for k, v in {"time": row.get("time"), **scalars(row)}.items() if isinstance(v, (int, float))}
        new = {k: v for k, v in values.items() if k not in have}
        if not new:
            return
        wider = [k for k in new if k not in self.header]
        if wider or step <= self.last:
            self._merge(step, new, wider)
        else:
            self._append(step, new)
        self._filled(step, have | new.keys())

    def _append(self, step: int, cells: Mapping[str, str]) -> None:
        if self._file is None:
            fresh = not self.path.exists()
            self._file = open(self.path, "a", newline="")
            if fresh:
                self._file.write(csv_text(self.header, []))
        self._file.write(csv_text(self.header, [(step, cells)], with_header=False))
        self._file.flush()  # whole rows for a reader, as metrics.jsonl's

    def _merge(self, step: int, cells: Mapping[str, str], wider: List[str]) -> None:
        """The file rewritten with `cells` filled in at `step` (a row of its own if there is none) and
        the header widened."""
        self.close()
        rows: Dict[int, Dict[str, str]] = {}
        if self.path.exists():
            data = read_regular(self.path, MAX_JSONL_BYTES)
            if data is None:
                raise RuntimeError(f"{self.path.name} is no longer a regular file of at most {MAX_JSONL_BYTES >> 20} MiB")
            (_, rows), _ = parse(data)
        for k, v in cells.items():
            rows.setdefault(step, {}).setdefault(k, v)
        self.header += wider
        self._rewrite(self.header, rows)

    def _rewrite(self, header: List[str], rows: Mapping[int, Mapping[str, str]]) -> None:
        atomic_write(self.path, csv_text(header, sorted(rows.items())))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
