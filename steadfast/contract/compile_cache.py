"""Where torch.compile keeps what it compiled for a run: one private folder per run and machine.

Every worker points Inductor's cache (`TORCHINDUCTOR_CACHE_DIR`: the FX graphs, the AOTAutograd
graphs, the generated kernels; Triton's follow it while `TRITON_CACHE_DIR` is unset) at
`<temporary folder>/steadfast-compile-<uid>/<run folder hash>` before the task runs, unless the
environment already names a cache. Every restart and every relaunch of the run on that machine, and
every rank on it, share the folder: a restart loads the compiled graphs instead of compiling them
again (Dynamo still traces the model: the cache holds what comes after the trace).

The cache holds pickles and code that torch loads and runs, so it is never in the run folder
(whoever can write the run folder must not be able to run code in the run: docs/trust-model.md). The
folders are made with mode 0700 and opened without following a symlink; one that is not this user's
private folder is never used (torch's own default then, `<temporary folder>/torchinductor_<user>`,
which torch does not check). The temporary folder is per machine: a run resumed on another machine
compiles there once.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Optional

from .shm import DIR_FLAGS, DIR_MODE, _check, run_key

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
PREFIX = "steadfast-compile-"


def folder(run_dir: Path) -> Path:
    """This machine's compile cache of the run in `run_dir`."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{os.geteuid()}" / run_key(run_dir)


def _private(path: Path) -> None:
    """Make `path` (mode 0700) unless it is there; OSError unless it is then this user's private folder."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    fd = os.open(path, DIR_FLAGS)  # O_NOFOLLOW: a symlink planted at the name fails here
    try:
        _check(fd, stat.S_ISDIR, path)
    finally:
        os.close(fd)


def torch_default() -> str:
    """Inductor's own default folder, which importing torch._dynamo writes into the environment of the
    process that imports it (the launcher, the forkserver): that value is not a user's choice.
    (torch/_inductor/runtime/cache_dir_utils.py: default_cache_dir, outside fbcode)"""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def chosen() -> Optional[str]:
    """The cache folder the user's environment names (not torch's default), if any."""
    value = os.environ.get(INDUCTOR_ENV)
    return value if value and os.path.abspath(value) != torch_default() else None


def use(run_dir: Path) -> Optional[str]:
    """Point torch.compile's caches at the run's folder (in this process's environment, before anything
    compiles), unless the user's environment names one. Returns why it did not, when the folder is
    not this user's private one (torch's default is used then)."""
    if chosen():
        return None
    path = folder(run_dir)
    try:
        _private(path.parent)
        _private(path)
    except OSError as exc:
        return f"compile cache {path} not used ({exc.strerror or exc}): torch.compile uses its default cache"
    os.environ[INDUCTOR_ENV] = str(path)
    return None
