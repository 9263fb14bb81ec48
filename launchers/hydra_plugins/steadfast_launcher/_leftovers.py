"""A refused launch leaves nothing behind.

Hydra's sweeper creates the sweep folder and writes `multirun.yaml` into it before it calls the
launcher (for a single job, the sweep folder is the run folder). The launcher notes, when Hydra
sets it up (before the sweeper writes), which folders on the way to the sweep folder exist and
what `multirun.yaml` held; a launch refused before any job ran puts that back: the file's old
bytes (or no file) and no folder that did not exist. Cheap: standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from steadfast.contract.files import fsync_dir, read_regular

MULTIRUN_FILE = "multirun.yaml"  # Hydra's record of the sweep, written by the sweeper
_MAX_BYTES = 16 << 20


class SweepFolderSnapshot:
    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = Path(os.path.abspath(sweep_dir))
        path = self.sweep_dir / MULTIRUN_FILE
        self.had_multirun = os.path.lexists(path)
        self.multirun = read_regular(path, _MAX_BYTES) if self.had_multirun else None
        self.times = (os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns) if self.multirun is not None else None
        self.new_folders: List[Path] = []  # innermost first: the folders the sweeper will create
        folder = self.sweep_dir
        while not folder.exists() and folder != folder.parent:
            self.new_folders.append(folder)
            folder = folder.parent

    def is_new(self) -> bool:
        """The sweep folder did not exist when the launcher was set up."""
        return bool(self.new_folders)

    def restore(self) -> None:
        """Undo what the sweeper wrote for this launch (never anything else)."""
        path = self.sweep_dir / MULTIRUN_FILE
        try:
            if self.multirun is not None and self.times is not None:  # set together
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_bytes(self.multirun)
                os.utime(tmp, ns=self.times)
                os.replace(tmp, path)
                fsync_dir(path.parent)
            elif not self.had_multirun:
                path.unlink(missing_ok=True)
        except OSError:
            return
        for folder in self.new_folders:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                return


def snapshot(sweep_dir: Optional[str]) -> Optional[SweepFolderSnapshot]:
    try:
        return SweepFolderSnapshot(Path(sweep_dir)) if sweep_dir else None
    except OSError:
        return None
