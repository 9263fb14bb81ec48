"""Library mode on the worker side: what every rank takes from rank 0 once the process group is up.

When a platform starts the workers (torchrun, srun, a PyTorchJob: docs/platforms.md), no launcher
of ours names the launch for them. Rank 0 opened it, or continued the one its platform's earlier
incarnation opened, before the group formed (the launcher's `_inplace`); here every rank learns it
from rank 0: the launch's id and start, the restarts so far where the platform does not count them,
and, from the launch and this rank's node, the folder in shared memory that the snapshots of every
restart of the platform's workers on this node share (contract/shm.py `platform_folder`).
"""

from __future__ import annotations

import dataclasses
import os

from ..contract import platforms, shm
from ..contract.env import LaunchEnv
from .comm import Comm


def agree(launch: LaunchEnv, comm: Comm, snapshots: bool) -> LaunchEnv:
    """In library mode, this rank's LaunchEnv with rank 0's launch (exported to the environment too)
    and, when `snapshots` are wanted, this node's folder for them (made if it is not there; if it
    cannot be, the memory tier says why it is off when it finds nothing there). Collective. Else `launch`."""
    if not launch.library_mode:
        return launch
    launch_id, launch_time, attempt = comm.broadcast_object((launch.launch_id, launch.launch_time, launch.attempt))
    platform = platforms.by_name(launch.platform)
    node = platform.node(os.environ) if platform else "0"
    folder = ""
    if snapshots:
        try:
            folder = shm.platform_folder(launch.run_dir, launch_id, node)
        except OSError:
            folder = shm.platform_folder_name(launch.run_dir, launch_id, node)
    agreed = dataclasses.replace(launch, launch_id=launch_id, launch_time=launch_time, attempt=attempt, snapshot=folder)
    os.environ.update(agreed.to_environ())
    return agreed
