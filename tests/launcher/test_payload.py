"""The job payload goes to workers through a private file; they get a small, checked reference."""

from __future__ import annotations

import os
import pickle
import stat
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest

from hydra_plugins.steadfast_launcher import _forkserver, _payload
from hydra_plugins.steadfast_launcher._payload import PayloadError, PayloadRef

PIPE_BUFFER = 64 << 10  # Linux's default pipe capacity: what multiprocessing's spawn writes a worker's arguments into


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_what_a_spawned_worker_is_given_stays_far_under_the_pipe_buffer(tmp_path: Path) -> None:
    big = {"config": "x" * (200 << 10)}  # a payload well over the pipe buffer
    with _payload.scratch("steadfast-test-") as folder:
        ref = _payload.write(folder, "payload.pkl", big)
        assert ref.size > PIPE_BUFFER
        environ = _forkserver.environment_file(folder)  # a forkserver's worker is also handed the launcher's environment
        # torch elastic passes every rank's arguments to every worker it starts: here 8 ranks
        spawn_args = {rank: (ref, environ) for rank in range(8)}
        sent = len(ForkingPickler.dumps(spawn_args))
        assert sent < 4096, sent
        assert _payload.load(ref) == big


def test_the_payload_folder_is_private_and_removed(tmp_path: Path) -> None:
    with _payload.scratch("steadfast-test-") as folder:
        st = os.lstat(folder)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        ref = _payload.write(folder, "p.pkl", 1)
        assert stat.S_IMODE(os.stat(ref.path).st_mode) == 0o600
    assert not folder.exists()


def test_a_changed_payload_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    with _payload.scratch("steadfast-test-") as folder:
        ref = _payload.write(folder, "payload.pkl", {"ok": 1})
        crafted = pickle.dumps(_Exploit(str(marker)))
        Path(ref.path).write_bytes(crafted)
        with pytest.raises(PayloadError, match="not the file the launcher wrote|sha256 does not match"):
            _payload.load(ref)
        with pytest.raises(PayloadError, match="sha256 does not match"):
            _payload.load(PayloadRef(ref.path, ref.sha256, len(crafted)))
        link = folder / "link.pkl"
        link.symlink_to(ref.path)
        with pytest.raises(PayloadError):
            _payload.load(PayloadRef(str(link), ref.sha256, ref.size))
        with pytest.raises(PayloadError):
            _payload.load(PayloadRef(str(folder / "missing"), ref.sha256, ref.size))
    assert not marker.exists()


def test_a_killed_launcher_s_folder_is_removed_by_the_next_one(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    orphan = Path(_payload.tempfile.gettempdir()) / f"steadfast-test-{dead.stdout.strip()}-abc"
    orphan.mkdir(mode=0o700)
    (orphan / "payload.pkl").write_bytes(b"x")
    mine = _payload.private_folder("steadfast-test-")
    try:
        assert not orphan.exists() and mine.name.startswith(f"steadfast-test-{os.getpid()}-")
        assert _payload.private_folder("steadfast-test-") and mine.exists()  # a live launcher's folder stays
    finally:
        for leftover in Path(_payload.tempfile.gettempdir()).glob(f"steadfast-test-{os.getpid()}-*"):
            _payload.shutil.rmtree(leftover)
