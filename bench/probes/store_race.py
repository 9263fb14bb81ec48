"""The store race at init_process_group (bench/NOTES.md, time to first step).

    .venv/bin/python bench/probes/store_race.py

Two forked processes call init_process_group("gloo") on a fresh TCPStore, with rank 0 started 0,
or 50 ms after rank 1, or the other way round; prints each rank's start and init time. A rank that
connects before rank 0 listens is refused and retried after torch's backoff (0.5-0.7 s here);
steadfast.distributed.comm.await_store is the fix.
"""

import multiprocessing as mp
import os
import socket
import time

import torch.distributed as dist


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def worker(rank, port, delay, q):
    time.sleep(delay)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    t = time.time()
    dist.init_process_group("gloo")
    t1 = time.time()
    dist.barrier()
    q.put((rank, t, t1, time.time()))
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    for d0, d1 in [(0, 0), (0, 0), (0.05, 0), (0, 0.05)]:
        port = free_port()
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(r, port, d, q)) for r, d in ((0, d0), (1, d1))]
        for p in ps:
            p.start()
        res = sorted(q.get() for _ in ps)
        for p in ps:
            p.join()
        t0 = min(r[1] for r in res)
        print(
            f"delays {d0},{d1}: "
            + "  ".join(f"rank{r}: start {s - t0:.3f} init {e - s:.3f} barrier {b - e:.3f}" for r, s, e, b in res)
        )
