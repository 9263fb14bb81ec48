"""A synchronous manager's first and next saves against raw fsync'd writes of the same bytes, with the code of a given tree.

    python bench/_sync_saves_of_tree.py TREE MB TENSORS REPEATS B_REPEATS OUT.json

Run by bench.checkpoint_refactor with PYTHONPATH=TREE:TREE/launchers: TREE's own bench.checkpoint_io
builds the states (cases A, B, C, as its main() does with `--mb MB --tensors TENSORS` and its other
defaults), makes the managers (its `manager()`: TREE's library) and writes the raw file (its
`raw_write`), while the timing is this file's, the same for every tree. First one untimed save of each
state (a process's first save: imports, first allocations, as bench.sharded's throughput task does).
Then REPEATS times per state (B_REPEATS for B, whose save is a few ms), in an order rotated between the
two: a fresh manager (keep_last=2: no retention delete inside the timing) saves once (its
first save), the first save's folder is removed (the next save writes right after files were removed,
as every write here does) and it saves again (its next save: what every save of a run but its first
costs); the raw fsync'd write of the state's tensor bytes. os.sync() before each. Writes each case's
wall seconds of each, and the process CPU seconds of each save (its fsync threads too), to OUT.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

SMALL_KIB, HIDDEN = 32, [64, 64]  # bench.checkpoint_io's defaults: C's tensor size, B's MLP (the same in every tree)


def timed(fn: Callable[[], Any]) -> Tuple[float, float]:
    """fn's wall and process CPU seconds, after the earlier writes' dirty pages were flushed."""
    os.sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def saves(io: Any, case: Any, folder: Path) -> Dict[str, Tuple[float, float]]:
    m = io.manager(folder, keep_last=2)

    def save(step: int) -> Callable[[], None]:
        return lambda: m.save(step, case.objects, case.per_rank, {"epoch": 0})

    first = timed(save(1))
    m.wait()  # its read-back check, outside both timings
    shutil.rmtree(folder / "step_000000001")
    following = timed(save(2))
    m.close()
    return {"first": first, "next": following}


def main() -> None:
    tree, mb, tensors, repeats, b_repeats, out = sys.argv[1:7]
    sys.path[0] = tree  # not this file's folder: the tree's bench package, not this one's
    import bench.checkpoint_io as io  # type: ignore[import-not-found,unused-ignore]

    mib, count = int(mb), int(tensors)
    cases = [
        io.params_case("A", mib, count),
        io.model_case(HIDDEN),
        io.params_case("C", mib, max(1, mib * 1024 // SMALL_KIB)),
    ]
    scratch = Path(tempfile.mkdtemp(prefix="steadfast-bench-refactor-"))
    result: Dict[str, Dict[str, List[float]]] = {}
    try:
        for c, case in enumerate(cases):  # untimed: what a process runs cold must not land in a case's first sample
            m = io.manager(scratch / f"warm-up{c}")
            m.save(1, case.objects, case.per_rank, {"epoch": 0})
            m.close()
            shutil.rmtree(scratch / f"warm-up{c}")
        for c, case in enumerate(cases):
            tag = case.name.split(":")[0]
            samples: Dict[str, List[float]] = {k: [] for k in ("first_s", "next_s", "raw_s", "first_cpu_s", "next_cpu_s")}
            for r in range(int(b_repeats if tag == "B" else repeats)):
                folder = scratch / f"case{c}-{r}"
                for method in ("saves", "raw") if r % 2 == 0 else ("raw", "saves"):
                    if method == "saves":
                        for name, (wall, cpu) in saves(io, case, folder).items():
                            samples[f"{name}_s"].append(wall)
                            samples[f"{name}_cpu_s"].append(cpu)
                    else:
                        samples["raw_s"].append(io.raw_write(case, folder)["raw_fsync_write"])
                    shutil.rmtree(folder)  # every timed write starts right after the previous one's files were removed
            result[tag] = samples
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
