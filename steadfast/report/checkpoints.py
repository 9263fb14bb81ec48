"""The report's one use of the checkpoint format: list the committed checkpoints and verify each.

What "committed" means, the manifest and the tensor files' checks all come from
steadfast.checkpoint, so a change of the checkpoint format changes nothing here but this call.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from .records import CheckpointCheck


def verify(folder: Path) -> List[CheckpointCheck]:
    """Every committed checkpoint in `folder`, newest first, checked against its manifest now.

    Raises OSError only when the folder itself cannot be listed."""
    from ..checkpoint import manifest as mf

    found = mf.committed(folder)
    if not found:
        return []
    from ..checkpoint.tensorfile import read_verified  # imports torch: only when there is something to verify

    out: List[CheckpointCheck] = []
    for step, path in found:
        try:
            manifest = mf.read(path)
            for name, spec in manifest["files"].items():
                file = path / name
                # a manifest is read back from disk: a name must stay inside its checkpoint, and
                # only a regular file is read (a FIFO would block the report)
                if Path(name).name != name or not file.is_file():
                    raise ValueError(f"{file}: not a regular file in the checkpoint")
                read_verified(file, spec["bytes"], spec["checksum"])
        except Exception as exc:  # whatever the files hold, the answer is "damaged", never a traceback
            out.append(
                CheckpointCheck(step, str(exc) if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: {exc}")
            )
        else:
            out.append(CheckpointCheck(step))
    return out
