"""The report's one use of the checkpoint format: list the committed checkpoints and verify each.

What "committed" means, the manifest, where the checkpoints are (a folder, a bucket: the store) and
the files' checks all come from steadfast.checkpoint, so a change of the checkpoint format or a new
store changes nothing here but this call.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Union

from .records import CheckpointCheck


def verify(where: Union[str, Path]) -> List[CheckpointCheck]:
    """Every committed checkpoint at `where` (a folder or a store's location), newest first, checked
    against its manifest now (every file's size and checksum)."""
    from ..checkpoint import manifest as mf
    from ..checkpoint.storage import store_for

    try:
        store = store_for(where)
    except ValueError as exc:
        raise OSError(str(exc)) from None
    found = mf.scan(store)
    if not found:
        return []
    from ..checkpoint.restore import verify as verify_checkpoint  # imports torch: only when there is something to verify

    out: List[CheckpointCheck] = []
    for c in found:
        problem = c.error if c.manifest is None else verify_checkpoint(store, c.name)
        out.append(CheckpointCheck(c.step, problem) if problem else CheckpointCheck(c.step))
    return out
