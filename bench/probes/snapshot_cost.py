"""Per-snapshot cost of MemorySnapshots.take, before and after #23 (shared memory private to its user).

    .venv/bin/python bench/probes/snapshot_cost.py [SNAPSHOTS] [BEFORE_REV]

BEFORE_REV (default b892bd8, the last commit before #23) is the version whose snapshots.py copied
through a memory mapping with an unkeyed digest; this tree's writes with pwrite into the launch's
private folder with a keyed digest. Both run in this process, interleaved snapshot by snapshot (so
both see the same load from other tenants), on three states: many small tensors, medium, large.
Prints the median and the minimum wall time and the median CPU time of SNAPSHOTS snapshots each
(default 30). A development probe:
its figures are quoted in a commit or report, not in the tables.
"""

import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
BEFORE = sys.argv[2] if len(sys.argv) > 2 else "b892bd8"
shm_dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="sf-snapshot-cost-")
os.environ["STEADFAST_SHM_DIR"] = shm_dir

import torch  # noqa: E402

import steadfast.checkpoint.memory as after  # noqa: E402
from steadfast.checkpoint.state import Progress, RNGState  # noqa: E402
from steadfast.contract import shm  # noqa: E402


def before_module() -> object:
    text = subprocess.run(
        ["git", "show", f"{BEFORE}:steadfast/snapshots.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(shm_dir) / "snapshots_before.py"  # its relative imports made absolute
    path.write_text(text.replace("from .", "from steadfast."))
    spec = importlib.util.spec_from_file_location("snapshots_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SHM_DIR = Path(shm_dir)  # type: ignore[attr-defined]
    return module


class Box:
    def __init__(self, state: object) -> None:
        self.state = state

    def state_dict(self) -> object:
        return self.state


def main() -> None:
    before = before_module()
    folder = shm.LaunchFolder(Path(shm_dir) / "run")
    folder.create()
    for mb, tensors in ((4, 200), (64, 100), (512, 50)):
        n = mb * (1 << 20) // 4 // tensors
        objects = {"model": Box({f"w{i}": torch.randn(n) for i in range(tensors)}), "progress": Progress()}
        new = after.MemorySnapshots(shm.Segments(folder.name), rank=0, local_rank=0, world_size=1)
        old = before.MemorySnapshots(f"before-{mb}", rank=0, local_rank=0, world_size=1)  # type: ignore[attr-defined]
        variants = [("before", old), ("after", new)]
        wall = {name: [] for name, _ in variants}  # type: ignore[var-annotated]
        cpu = {name: [] for name, _ in variants}  # type: ignore[var-annotated]
        for step in range(1, N + 3):
            for name, memory in variants[step % 2 :] + variants[: step % 2]:
                planned = memory.plan(objects, {"rng": RNGState()})
                c, t = time.process_time(), time.perf_counter()
                memory.take(step, planned)
                if step > 2:  # the first two create and fill the files
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
        line = f"{mb:4d} MB in {tensors:3d} tensors"
        for name, _ in variants:
            line += (
                f" | {name}: {statistics.median(wall[name]) * 1e3:6.1f} ms"
                f" (min {min(wall[name]) * 1e3:6.1f}, cpu {statistics.median(cpu[name]) * 1e3:6.1f})"
            )
        print(line, flush=True)
        assert new.load(N + 2) is not None and old.load(N + 2) is not None
    folder.remove()


try:
    main()
finally:
    shutil.rmtree(shm_dir, ignore_errors=True)
