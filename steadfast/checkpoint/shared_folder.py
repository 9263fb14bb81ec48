"""Whether every rank sees the run folder rank 0 writes checkpoints to (shared storage between the nodes)."""

from __future__ import annotations

from pathlib import Path

from .codec import Collectives


class RunFolderNotShared(RuntimeError):
    """Some ranks do not see the run folder rank 0 writes to (no shared storage between the nodes)."""


def check_shared_run_dir(run_dir: Path, comm: "Collectives") -> None:
    """Collective, at start-up: every rank must see the run folder rank 0 writes checkpoints to.

    Rank 0 writes a token file with a random id into its run folder and broadcasts the id; every
    rank reads the file from its own run folder. Without shared storage (or with a different
    working directory on some node) a node sees another folder, and every rank fails here with a
    message naming the folders and hosts instead of resuming from nothing later.
    """
    if comm.world_size <= 1:
        return
    import socket
    import uuid

    host = socket.gethostname()
    token = run_dir / f".shared-check-{uuid.uuid4().hex}" if comm.rank == 0 else None
    if token is not None:
        token.write_text(token.name)
    name, root_dir, root_host = comm.broadcast_object((token.name if token else None, str(run_dir), host))
    try:
        sees = (run_dir / name).read_text() == name
    except OSError:
        sees = False
    seen = comm.gather_object((comm.rank, host, str(run_dir), sees))
    blind = [r for r in (seen or []) if not r[3]]
    message = ""
    if blind:
        who = "; ".join(f"rank {r} on {h} (its run folder: {d})" for r, h, d, _ in blind)
        message = (
            f"not every worker sees the run folder {root_dir} that rank 0 on {root_host} writes checkpoints to: {who} "
            f"cannot read the file rank 0 wrote there. The nodes of a multi-node job need shared storage mounted at "
            f"the same path, and the same working directory (or an absolute hydra.sweep.dir/run.name) on every node"
        )
    message = comm.broadcast_object(message)
    if token is not None:
        token.unlink(missing_ok=True)
    if message:
        raise RunFolderNotShared(message)
