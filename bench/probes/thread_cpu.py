"""Per-thread CPU per step of the hot-loop job's workers in a 3 s steady-state window (bench/NOTES.md, Horovod).

    .venv/bin/python bench/probes/thread_cpu.py LABEL horovod|torchrun [ENV=VALUE ...]

Runs `python -m pipeline.train` on bench.common.HOT's job in /tmp/hvdprobe/LABEL, waits for step 60,
then reads utime + stime of every thread of every process under the launcher from /proc, twice,
3 s apart, and prints CPU milliseconds per training step for each thread (MAIN: a process's main
thread). A development probe: its figures are quoted in bench/NOTES.md, not in the tables.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, DefaultDict, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
label, backend = sys.argv[1], sys.argv[2]
extra = dict(a.split("=", 1) for a in sys.argv[3:])
hot = [
    "data=synthetic",
    "data.num_samples=61440",
    "data.num_features=256",
    "data.num_classes=4",
    "data.batch_size=64",
    "model.hidden_sizes=[512,512]",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=10",
    "checkpoint.every_n_epochs=1000",
    f"run.name={label}",
]
hot += ["backend=horovod", "backend.np=2"] if backend == "horovod" else ["backend.nproc_per_node=2"]
work = f"/tmp/hvdprobe/{label}"
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT}/launchers", OMP_NUM_THREADS="1", **extra)
proc = subprocess.Popen(
    [f"{ROOT}/.venv/bin/python", "-m", "pipeline.train", *hot],
    cwd=work,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
metrics = f"{work}/outputs/{label}/metrics.jsonl"


def step():
    try:
        rows = [json.loads(line) for line in open(metrics) if line.strip()]
        return max([r["step"] for r in rows if "loss" in r] or [0])
    except (OSError, ValueError):
        return 0


def descendants(pid):
    kids = collections.defaultdict(list)
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


def threads(pids):
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


t0 = time.time()
while step() < 60 and time.time() - t0 < 120 and proc.poll() is None:
    time.sleep(0.05)
s0, a = step(), threads(descendants(proc.pid))
w0 = time.time()
time.sleep(3.0)
s1, b = step(), threads(descendants(proc.pid))
w1 = time.time()
proc.wait(timeout=300)
n = s1 - s0
agg: DefaultDict[Tuple[Any, ...], float] = collections.defaultdict(float)
for k, v in b.items():
    if k in a:
        agg[(v[0], v[1] + " " + str(k[0]) + "/" + str(k[1]) + " u" + str(v[3] - a[k][3]) + " s" + str(v[4] - a[k][4]))] += (
            v[2] - a[k][2]
        )
print(
    f"{label}: {n} steps in {w1 - w0:.2f} s = {n / (w1 - w0):.1f} steps/s; CPU s/step total {sum(agg.values()) / max(n, 1) * 1000:.2f} ms"
)
for (pn, tn), cpu in sorted(agg.items(), key=lambda kv: -kv[1]):
    if cpu > 0.01:
        print(f"   {pn:<16}{tn:<18}{cpu / max(n, 1) * 1000:7.2f} ms/step  {cpu / (w1 - w0) * 100:5.1f}% core")
