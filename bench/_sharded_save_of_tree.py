"""One group of 2 workers timing sharded saves against raw fsync'd writes, with the code of a given tree.

    python bench/_sharded_save_of_tree.py TREE WIDTH BLOCKS PAIRS DROP(0|1) OUT.json

Run by bench.checkpoint_refactor with PYTHONPATH=TREE:TREE/launchers: TREE's own bench.sharded starts
the group (its forkserver imports TREE's library) and its workers run TREE's `throughput` task
(bench/sharded_workers.py), so a tree from before a refactor is measured with its own code. Writes
the task's samples (seconds of each sharded save and raw write, slowest rank) to OUT.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def main() -> None:
    tree, width, blocks, pairs, drop, out = sys.argv[1:7]
    sys.path[0] = tree  # not this file's folder: the tree's bench package, not this one's
    from bench.sharded import Groups  # type: ignore[import-not-found,unused-ignore]
    from bench.sharded_workers import Size  # type: ignore[import-not-found,unused-ignore]

    scratch = Path(tempfile.mkdtemp(prefix="steadfast-bench-refactor-"))
    groups = Groups()
    try:
        result = groups.run(2, [f"throughput:{pairs}"], Size(int(width), int(blocks)), scratch, scratch / "ref", drop == "1", 600)
    finally:
        groups.close()
        shutil.rmtree(scratch, ignore_errors=True)
    (task,) = [t for t in result["tasks"] if t["task"] == "throughput"]
    Path(out).write_text(json.dumps({**task, "load": result["load"]}))


if __name__ == "__main__":
    main()
