"""Exit codes of a launch, as a scheduler or a shell script sees them."""

from __future__ import annotations

import signal
from typing import Optional

EXIT_OK = 0
EXIT_FAILED = 1  # a job failed after its restart budget, or the config was refused
EXIT_ORPHANED = 70  # a worker whose launcher is gone (EX_SOFTWARE): it ends at once and commits nothing
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request (SIGTERM/SIGHUP); run the same command again to continue


def exit_code(signum: Optional[int]) -> int:
    """SIGTERM/SIGHUP (a scheduler's stop request): EXIT_PREEMPTED; SIGINT (Ctrl-C): 130, as shells report it."""
    if signum in (signal.SIGTERM, signal.SIGHUP):
        return EXIT_PREEMPTED
    return 128 + int(signum or signal.SIGINT)
