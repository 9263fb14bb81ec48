"""Per-thread CPU per step of the hot-loop job's workers in a 3 s steady-state window (bench/NOTES.md, Horovod).

    .venv/bin/python bench/probes/thread_cpu.py [--tiny] LABEL horovod|torchrun [ENV=VALUE ...]

Runs `python -m pipeline.train` on bench.common.HOT's job in a scratch folder, waits for step 60,
then reads utime + stime of every thread of every process under the launcher from /proc, twice,
3 s apart, and prints CPU milliseconds per training step for each thread (MAIN: a process's main
thread). `--tiny`: half the data, step 10 and a 0.5 s window (its smoke test). A development
probe: its figures are quoted in bench/NOTES.md, not in the tables.
"""

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, DefaultDict, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import HOT, env  # noqa: E402


def step(metrics: Path) -> int:
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return max([r["step"] for r in rows if "loss" in r] or [0])
    except (OSError, ValueError):
        return 0


def descendants(pid: int) -> List[int]:
    kids: DefaultDict[int, List[int]] = collections.defaultdict(list)
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                kids[int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])].append(int(p))
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo += kids[q]
    return out


def threads(pids: List[int]) -> Dict[Tuple[int, int], Tuple[str, str, float, int, int]]:
    r = {}
    for p in pids:
        try:
            pname = open(f"/proc/{p}/comm").read().strip()
        except OSError:
            continue
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                st = open(f"/proc/{p}/task/{t}/stat").read().rsplit(")", 1)
                name = ("MAIN " if int(t) == p else "") + st[0].split("(", 1)[1]
                f = st[1].split()
                r[(p, int(t))] = (pname, name, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), int(f[11]), int(f[12]))
            except (OSError, IndexError):
                pass
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("label")
    p.add_argument("backend", choices=["horovod", "torchrun"])
    p.add_argument("env", nargs="*", metavar="ENV=VALUE", help="set in the run's environment")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    job, at_step, window_s = (
        (dataclasses.replace(HOT, num_samples=HOT.num_samples // 2), 10, 0.5) if args.tiny else (HOT, 60, 3.0)
    )
    overrides = [*job.overrides(args.backend), "checkpoint.every_n_epochs=1000", f"run.name={args.label}"]
    with tempfile.TemporaryDirectory(prefix="thread_cpu-") as work:
        extra = dict(a.split("=", 1) for a in args.env)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.train", *overrides],
            cwd=work,
            env=env(extra=extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        metrics = Path(work) / "outputs" / args.label / "metrics.jsonl"
        t0 = time.time()
        while step(metrics) < at_step and time.time() - t0 < 120 and proc.poll() is None:
            time.sleep(0.05)
        s0, a = step(metrics), threads(descendants(proc.pid))
        w0 = time.time()
        time.sleep(window_s)
        s1, b = step(metrics), threads(descendants(proc.pid))
        w1 = time.time()
        rc = proc.wait(timeout=300)
    n = s1 - s0
    agg: DefaultDict[Tuple[Any, ...], float] = collections.defaultdict(float)
    for k, v in b.items():
        if k in a:
            agg[(v[0], v[1] + " " + str(k[0]) + "/" + str(k[1]) + " u" + str(v[3] - a[k][3]) + " s" + str(v[4] - a[k][4]))] += (
                v[2] - a[k][2]
            )
    print(
        f"{args.label}: {n} steps in {w1 - w0:.2f} s = {n / (w1 - w0):.1f} steps/s; CPU s/step total {sum(agg.values()) / max(n, 1) * 1000:.2f} ms"
    )
    for (pn, tn), cpu in sorted(agg.items(), key=lambda kv: -kv[1]):
        if cpu > 0.01:
            print(f"   {pn:<16}{tn:<18}{cpu / max(n, 1) * 1000:7.2f} ms/step  {cpu / (w1 - w0) * 100:5.1f}% core")
    if rc != 0:
        sys.exit(f"the run failed (exit {rc})")


if __name__ == "__main__":
    main()
