"""A namespace of its own in torch elastic's store for every incarnation of the worker group.

Under a plain `torchrun` (c10d rendezvous, the default), the workers' process group meets in the
agent's own TCP store (TORCHELASTIC_USE_AGENT_STORE=True), which lives as long as the agent, with
no prefix per restart. A restarted group then finds its predecessor's keys there: Gloo's
connectFullMesh reads a dead rank's address and fails with `Connection refused` (NCCL reads an old
unique id), so the restart fails and uses up another (pytorch/pytorch#135712; nanoGPT under
`torchrun --max-restarts=3` failed 8 of 11 restarts so). The launcher avoids it by giving each round
a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); a platform's torchrun does not.

So the workers agree on a generation number nobody used before, and the group meets under
`steadfast/<generation>`. Rank 0 takes the number from a counter in the store (`add`: atomic), and
every other rank asks for it under a nonce of its own, drawn now: rank 0 answers every nonce it
finds under that nonce's own key, which never existed before, so no rank can read a stale answer;
each rank acknowledges under the generation's key, and rank 0 answers until all have. Every old
worker is gone before a new one starts (the agent stops its workers before the next rendezvous).
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Any, Optional, Set

COUNTER = "steadfast/generation"
ASKS = "steadfast/asks"  # nonces, appended ("<nonce>;")


def wanted() -> bool:
    """The workers' group would meet in torch elastic's shared store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def fresh_store(rank: int, world_size: int, timeout_s: float) -> Optional[Any]:
    """A PrefixStore over the agent's store, fresh for this incarnation (None when not `wanted`)."""
    if not wanted():
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timedelta(seconds=timeout_s)
    )
    deadline = time.monotonic() + timeout_s
    generation = _hand_out(store, world_size, deadline) if rank == 0 else _ask(store, rank, timeout_s)
    return dist.PrefixStore(f"steadfast/{generation}", store)


def _ask(store: Any, rank: int, timeout_s: float) -> int:
    nonce = secrets.token_hex(12)
    store.append(ASKS, f"{nonce};")
    answer = f"steadfast/answer/{nonce}"
    store.wait([answer], timedelta(seconds=timeout_s))
    generation = int(store.get(answer))
    store.append(f"steadfast/acks/{generation}", f"{rank};")
    return generation


def _hand_out(store: Any, world_size: int, deadline: float) -> int:
    generation = int(store.add(COUNTER, 1))
    acks = f"steadfast/acks/{generation}"
    answered: Set[str] = set()
    pause = 0.002
    while world_size > 1:
        if store.check([ASKS]):
            for nonce in store.get(ASKS).decode().split(";"):
                if nonce and nonce not in answered:  # a stale nonce's answer is never read: harmless
                    store.set(f"steadfast/answer/{nonce}", str(generation))
                    answered.add(nonce)
        if store.check([acks]) and len(set(store.get(acks).decode().split(";")) - {""}) >= world_size - 1:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"steadfast: not every rank joined generation {generation} of the process group in the "
                "agent's store within restart.collective_timeout_s"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    for key in [ASKS, acks, *(f"steadfast/answer/{n}" for n in answered)]:  # every rank has asked and read its answer
        store.delete_key(key)
    return generation
