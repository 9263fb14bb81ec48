"""CPU time (thread_time) inside an async save() (the part that blocks the loop), saves 2..N+1 of one manager.

    python bench/probes/async_blocked_cpu.py C|B N [trainer]

C: bench.checkpoint_io's case C at 128 MiB (4096 x 32 KiB + SGD); B: its MLP + Adam. `trainer`: with
the trainer's Progress (its step changed at every save) and every RNG's state, as a run saves them.
CPU time, not wall time: it holds on a loaded machine (issue 35's plan reuse was measured with it).
"""

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

from bench.checkpoint_io import manager, model_case, params_case
from steadfast.checkpoint.state import Progress, RNGState

case = {"C": lambda: params_case("C", 128, 4096), "B": lambda: model_case([64, 64])}[sys.argv[1]]()
N = int(sys.argv[2])
per_rank: Dict[str, Any] = dict(case.per_rank)
objects: Dict[str, Any] = dict(case.objects)
if len(sys.argv) > 3:  # as the trainer saves: progress and every RNG too
    objects["progress"] = Progress()
    per_rank = {"rng": RNGState()}
root = Path(tempfile.mkdtemp())
m = manager(root / "ck", async_save=True, keep_last=2)
m.save(1, objects, per_rank, {"epoch": 0})
m.wait()
ts: list[float] = []
for i in range(2, 2 + N):
    if len(sys.argv) > 3:
        objects["progress"].global_step = i
    t = time.thread_time()
    m.save(i, objects, per_rank, {"epoch": 0})
    ts.append(time.thread_time() - t)
    m.wait()
m.close()
shutil.rmtree(root)
print(
    "%s%s: blocked CPU ms median %.3f (n=%d)"
    % (sys.argv[1], " +progress+rng" if len(sys.argv) > 3 else "", statistics.median(ts) * 1e3, N)
)
