"""Where a sharded save's time goes, in one process: FSDP2 over a process group of one rank, an MLP
of BLOCKS Linear layers of WIDTH x WIDTH with AdamW after one step, its rank file written five ways,
in a rotated order, the page cache dropped before each (as root), medians of REPEATS (default 5):

    .venv/bin/python bench/probes/sharded_save_parts.py [WIDTH] [BLOCKS]   (REPEATS=N in the environment)

  sharded_save      CheckpointManager.save (sync) + close: what bench.sharded times
  save_no_readback  the same with fileio.verify_file replaced by nothing (the read-back in ranks.write_own)
  raw               the rank file's tensors and padding to its size, written and fsynced
  write_file        fileio.write_file of the same buffers (write, fsync, checksum)
  write+verify      fileio.write_file, then fileio.verify_file (what write_own does for each file)
  plan              the sharded codec's plan of the state and its header (no I/O)

A development probe: its figures are quoted in bench/NOTES.md, not in the tables.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from steadfast.checkpoint import manifest as mf  # noqa: E402
from steadfast.checkpoint import shard_reader, sharded  # noqa: E402
from steadfast.checkpoint.manager import CheckpointManager  # noqa: E402
from steadfast.checkpoint.storage import fileio  # noqa: E402
from steadfast.distributed.comm import Comm  # noqa: E402

WIDTH = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
BLOCKS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
REPEATS = int(os.environ.get("REPEATS", "5"))

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(8, WIDTH)).sum().backward()
optimizer.step()
optimizer.zero_grad()
root = Path(tempfile.mkdtemp(dir="/tmp", prefix="sf-save-parts-"))


def drop() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def save(folder: Path) -> None:
    m = CheckpointManager(folder, Comm(), 1, {}, lambda *a, **k: None)
    m.save(1, {"model": model, "optimizer": optimizer}, {}, {"epoch": 0})
    m.close()


def save_no_readback(folder: Path) -> None:
    verify = fileio.verify_file  # the module ranks.py calls it through
    fileio.verify_file = lambda *a, **k: None
    try:
        save(folder)
    finally:
        fileio.verify_file = verify


save(root / "first")
size = mf.read(mf.committed(root / "first")[0][1])["files"][shard_reader.file_name(0)]["bytes"]
pieces = [t.to_local() for t in model.state_dict().values()]
pieces += [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
views = [memoryview(p.detach().reshape(-1).view(torch.uint8).numpy()) for p in pieces]
pad = bytes(size - sum(v.nbytes for v in views))


def raw(folder: Path) -> None:
    folder.mkdir()
    with open(folder / "raw.bin", "wb", buffering=0) as f:
        for v in views:
            f.write(v)
        f.write(pad)
        os.fsync(f.fileno())


def write_file(folder: Path) -> None:
    folder.mkdir()
    fileio.write_file(folder / "x.bin", [*views, pad])


def write_verify(folder: Path) -> None:
    folder.mkdir()
    n, digest = fileio.write_file(folder / "x.bin", [*views, pad])
    fileio.verify_file(folder / "x.bin", n, digest)


def plan(folder: Path) -> None:
    sharded.plan({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, {}, True, True).layout.header()


ops = [
    ("sharded_save", save),
    ("save_no_readback", save_no_readback),
    ("raw", raw),
    ("write_file", write_file),
    ("write+verify", write_verify),
    ("plan", plan),
]
times: Dict[str, List[float]] = {name: [] for name, _ in ops}
previous = root / "first"
try:
    for r in range(REPEATS):
        for name, fn in ops[r % len(ops) :] + ops[: r % len(ops)]:
            shutil.rmtree(previous, ignore_errors=True)  # every write right after the last one's files went
            drop()
            previous = root / f"{name}-{r}"
            start = time.perf_counter()
            fn(previous)
            times[name].append(time.perf_counter() - start)
finally:
    shutil.rmtree(root, ignore_errors=True)
print(f"rank file {size / 1e6:.1f} MB, {REPEATS} repeats")
for name, values in times.items():
    print(f"  {name:<17} median {statistics.median(values) * 1e3:8.1f} ms   {[round(v * 1e3) for v in values]}")
