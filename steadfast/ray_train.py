"""The app's own command as Ray Train's `train_loop_per_worker` (docs/ray.md).

Ray Train starts its workers itself: in each it sets torch's variables, initialises the process
group and calls the training function in a thread of a Ray actor. `app_loop("train.py", *overrides)`
is that function for an app that already runs with `python train.py`: in every worker it runs the
script as that command would, from the folder the driver ran in, so the app's Hydra config names the
run folder as it always does and the launcher finds a Ray Train worker there (library mode:
contract/platforms.py's `ray` entry). The app and its config stay as they are.

A run that stops on purpose or fails ends with an exception, for Ray Train's FailureConfig to
restart the workers; one that completed returns. Ray is not imported here.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path
from typing import Callable, Sequence, Union


def app_loop(script: Union[str, Path], *overrides: str, cwd: Union[str, Path, None] = None) -> Callable[[], None]:
    """`train_loop_per_worker` for a TorchTrainer: `python <script> <overrides>` in every worker, run
    in `cwd` (default: this process's folder, where `python <script>` would run)."""
    folder = Path(cwd) if cwd is not None else Path.cwd()
    return functools.partial(run_app, str(Path(script).resolve()), tuple(overrides), str(folder.resolve()))


def run_app(script: str, overrides: Sequence[str], cwd: str) -> None:
    """One worker: the script's command in this process, as its rank. Raises when it did not complete
    (its exit code in the message); puts back the process's arguments, folder and environment after."""
    argv, path, here, environ = list(sys.argv), list(sys.path), os.getcwd(), dict(os.environ)
    sys.argv[:] = [script, *overrides]  # what Hydra parses
    sys.path.insert(0, os.path.dirname(script))  # as `python script` has it
    os.chdir(cwd)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        if end.code not in (None, 0):
            command = " ".join(["python", os.path.basename(script), *overrides])
            raise RuntimeError(f"`{command}` in {cwd} ended with exit code {end.code} in this Ray Train worker") from None
    finally:
        sys.argv[:], sys.path[:] = argv, path
        os.chdir(here)
        for name in set(os.environ) - set(environ):  # what the launcher exported for this run (its LaunchEnv)
            del os.environ[name]
        os.environ.update(environ)
