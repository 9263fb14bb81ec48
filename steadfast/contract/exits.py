"""Exit codes of a launch, as a scheduler or a shell script sees them."""

from __future__ import annotations

import signal
from typing import Optional

EXIT_OK = 0
EXIT_FAILED = 1  # a job failed after its restart budget, or the config was refused
EXIT_ORPHANED = 70  # a worker whose launcher is gone (EX_SOFTWARE): it ends at once and commits nothing
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request (SIGTERM/SIGHUP); run the same command again to continue
# Library mode (a platform started the workers): 128 + SIGTERM, what a shell reports for SIGTERM and
# what Kubernetes' training operator retries under restartPolicy ExitCode (it retries 130, 137, 138
# and 143 only: 75 would be a permanent failure there).
EXIT_PLATFORM_PREEMPTED = 128 + int(signal.SIGTERM)
RETRIED_BY_KUBEFLOW = (130, 137, 138, 143)  # the training operator's IsRetryableExitCode


def exit_code(signum: Optional[int], configured: Optional[int] = None, library: bool = False) -> int:
    """The exit code of a process that stopped on request after `signum`.

    SIGTERM/SIGHUP (a scheduler's stop request): `configured` (restart.preemption_exit_code) when
    set, else EXIT_PREEMPTED from the steadfast launcher and EXIT_PLATFORM_PREEMPTED in library
    mode. SIGINT (Ctrl-C): 130, as shells report it."""
    if signum in (signal.SIGTERM, signal.SIGHUP) or (signum is None and library):
        if configured is not None:
            return configured
        return EXIT_PLATFORM_PREEMPTED if library else EXIT_PREEMPTED
    return 128 + int(signum or signal.SIGINT)
