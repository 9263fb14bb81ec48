"""What goes to the launcher's log file (train.log) and not to the console.

The console gets one line per failure and per restart; the details (a failed worker's traceback as
the backend logs it, the consequences of a failure, torch elastic's own warnings) go to the job's log
file, so that train.log tells the launcher's whole story. Hydra gives each job its own file handler,
so the loggers are pointed at the current job's files at every launch.
"""

from __future__ import annotations

import logging

DETAILS = "hydra_plugins.steadfast_launcher.details"  # the launcher's own file-only messages
_MARK = "_steadfast_file_only"


def files_only(*names: str) -> None:
    """Send the records of loggers `names` to the root logger's file handlers only. Without a file
    handler (logging configured without one) they stay on the console rather than be lost."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in names:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
            logger.removeHandler(handler)
        if not files:
            logger.propagate = True
            continue
        for handler in files:
            setattr(handler, _MARK, True)
            logger.addHandler(handler)
        logger.propagate = False
