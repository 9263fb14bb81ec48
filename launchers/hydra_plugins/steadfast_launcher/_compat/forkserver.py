"""multiprocessing's forkserver: its process id, and ending it with the launcher (private attributes
of `multiprocessing.forkserver._forkserver`, the module's one ForkServer)."""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

from . import PYTHON, Patch, applies


def _shape() -> Optional[str]:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    missing = [name for name in ("_forkserver_pid", "_forkserver_alive_fd") if not hasattr(server, name)]
    return f"multiprocessing.forkserver._forkserver has no {', '.join(missing)}" if missing else None


SERVER = Patch(
    "the forkserver ends (and is reaped) with the launcher",
    PYTHON,
    ">=3.10,<3.14",
    _shape,
    "the server ends on its own once the launcher's process is gone, a little later",
)


def server_pid() -> Optional[int]:
    """The running server's process id (None before it started, or where the patch does not apply)."""
    from multiprocessing import forkserver

    if not applies(SERVER):
        return None
    server: Any = vars(forkserver)["_forkserver"]
    pid: Optional[int] = server._forkserver_pid
    return pid


def stop_server() -> None:
    """End the server and reap it (the server holds nothing but imported modules by now). multiprocessing
    itself never waits for it; its own interpreter teardown (torch's modules) would take 0.2-0.3 s."""
    from multiprocessing import forkserver

    if not applies(SERVER):
        return
    server: Any = vars(forkserver)["_forkserver"]
    pid, alive = server._forkserver_pid, server._forkserver_alive_fd
    if pid is None or alive is None:
        return
    os.close(alive)
    server._forkserver_alive_fd = None
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass
    server._forkserver_pid = None
