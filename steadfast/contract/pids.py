"""Whether a process is still there: the one check the launcher and the workers use (the launcher's
watch over its workers, a worker's watch over its launcher, orphaned snapshot segments and folders),
and a signal to one that may be gone."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while process `pid` runs. A zombie has exited; a process of another user counts as running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass  # no /proc (not Linux), or the process is gone: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def kill(pid: int, sig: int) -> None:
    """Send `sig` to `pid`; a process already gone (or not ours) is not an error."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass
