"""The run lock and a refused launch: one launch per run folder and per folder of
hydra.launcher.lock_dirs (a shared checkpoint.dir), taken before Hydra writes anything; a
filesystem that cannot lock is named with the fix; a refused launch leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Dict, Tuple

import pytest

from helpers import event_of, run_dir, run_train, start_train, stop, wait_for
from hydra_plugins.steadfast_launcher import _locks
from hydra_plugins.steadfast_launcher._types import Refused

TINY = ["backend=local", "data=synthetic", "data.num_samples=64", "trainer.max_epochs=1", "checkpoint=every_epoch"]


def tree(folder: Path) -> Dict[str, Tuple[int, bytes]]:
    """Every file and folder under `folder`: (mtime_ns, bytes) for files, (0, b'') for folders."""
    out: Dict[str, Tuple[int, bytes]] = {}
    if not folder.exists():
        return out
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = (path.stat().st_mtime_ns, path.read_bytes()) if path.is_file() else (0, b"")
    return out


# ---- the lock itself, in this process (flock locks of two open files conflict within one process too)


def test_a_shared_lock_dir_admits_one_run_and_names_the_holder(tmp_path: Path) -> None:
    ck = tmp_path / "shared_ck"
    a, b = tmp_path / "outputs" / "a", tmp_path / "outputs" / "b"
    with _locks.RunLock(a, [ck, ck, a]):  # duplicates and the run folder itself are locked once
        with pytest.raises(Refused) as refused:
            _locks.RunLock(b, [ck]).acquire()
        message = str(refused.value)
        assert f"Folder {ck} is in use by pid {os.getpid()} on {socket.gethostname()} (run folder {a})" in message
        assert not b.exists(), "lock_dirs are taken first: a refused launch creates nothing in its own run folder"
        with pytest.raises(Refused, match=f"Run folder {a} is in use by pid {os.getpid()}"):
            _locks.RunLock(a, [tmp_path / "other_ck"]).acquire()
    with _locks.RunLock(b, [ck]):  # released: the next run may have it
        pass


def test_a_launch_refused_by_its_run_folder_takes_back_the_folders_and_lock_files_it_created(tmp_path: Path) -> None:
    run, held_ck = tmp_path / "outputs" / "a", tmp_path / "ck"
    new_ck, empty_ck = tmp_path / "new" / "deeper" / "ck", tmp_path / "empty_ck"
    empty_ck.mkdir()
    with _locks.RunLock(run, [held_ck]):
        with pytest.raises(Refused, match=f"Run folder {run} is in use"):
            _locks.RunLock(run, [new_ck, empty_ck]).acquire()
        assert not (tmp_path / "new").exists(), tree(tmp_path / "new")  # was left with .steadfast.lock and .gate
        assert list(empty_ck.iterdir()) == []  # a folder that was there stays, without the lock files made for it
        assert sorted(os.listdir(held_ck)) == sorted([_locks.GATE_FILE, _locks.LOCK_FILE])  # the holder's are untouched
        with pytest.raises(Refused, match=f"Folder {held_ck} is in use"):
            _locks.RunLock(tmp_path / "outputs" / "b", [held_ck]).acquire()
        assert not (tmp_path / "outputs" / "b").exists()
    with _locks.RunLock(run, [new_ck]):  # and the folder works as usual afterwards
        assert (new_ck / _locks.LOCK_FILE).is_file()


@pytest.mark.parametrize("name", [_locks.LOCK_FILE, _locks.GATE_FILE])
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    folder, target = tmp_path / "run", tmp_path / "precious.txt"
    folder.mkdir()
    target.write_text("someone's data")
    (folder / name).symlink_to(target)
    with pytest.raises(Refused, match=f"{folder / name} is not a regular file"):
        _locks.RunLock(folder, []).acquire()
    assert target.read_text() == "someone's data"  # the lock's truncate went through the link
    assert (folder / name).is_symlink()  # left for the person to look at
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / _locks.SWEEP_LOCK_FILE).symlink_to(target)
    with pytest.raises(Refused, match="is not a regular file"):
        _locks.lock_sweep(sweep)
    assert target.read_text() == "someone's data"
    os.mkfifo(folder / "fifo")
    with pytest.raises(Refused, match="is not a regular file"):
        _locks.open_lock_file(folder / "fifo")


def test_the_launchers_of_one_multi_node_job_share_the_lock(tmp_path: Path) -> None:
    folder, ck = tmp_path / "run", tmp_path / "ck"
    with _locks.RunLock(folder, [ck], multi_node="c10d:run@h:1"), _locks.RunLock(folder, [ck], multi_node="c10d:run@h:1"):
        with pytest.raises(Refused, match="is in use by multi-node job c10d:run@h:1"):
            _locks.RunLock(folder, [], multi_node="c10d:run@h:2").acquire()
        with pytest.raises(Refused, match="is in use by multi-node job"):
            _locks.RunLock(folder, []).acquire()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
def test_a_filesystem_that_cannot_flock_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 27 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"98 22 0:50 / {tmp_path} rw,relatime shared:1 - nfs4 server:/export rw,vers=4.2,local_lock=none\n"
    )
    monkeypatch.setattr(_locks, "MOUNTINFO", str(mountinfo))

    def no_flock(fd: int, how: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = tmp_path / "outputs" / "r"
    with pytest.raises(Refused) as refused:
        _locks.RunLock(folder, []).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"Cannot lock {folder}: flock failed with {errno.errorcode[code]}")
    assert f"on its nfs4 filesystem (mounted at {tmp_path}" in message and "local_lock=none" in message
    assert "or put the run folder on a local or flock-capable filesystem" in message
    with pytest.raises(Refused, match=f"Cannot lock {tmp_path}: .* nfs4 filesystem"):
        _locks.lock_sweep(tmp_path)
    monkeypatch.setattr(_locks, "filesystem", lambda path: ("lustre", "/lus", "rw"))
    with pytest.raises(Refused, match="mount Lustre with -o flock"):
        _locks.RunLock(folder, []).acquire()


def test_filesystem_type_comes_from_the_mount_table(tmp_path: Path) -> None:
    fstype, mount, _ = _locks.filesystem(tmp_path)
    assert fstype not in ("", "unknown") and str(tmp_path).startswith(mount)


# ---- real launches -------------------------------------------------------------------------


@pytest.mark.extended
def test_a_refused_launch_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = run_train(tmp_path, *TINY, "checkpoint.every_n_epochs=0", timeout=120)
    assert proc.returncode != 0 and "checkpoint.every_n_epochs=0 is not allowed" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), tree(tmp_path / "outputs")
    run_train(tmp_path, *TINY, "run.name=done", check=True)
    # a successful single run writes nothing directly under outputs/ besides its run folder
    assert os.listdir(tmp_path / "outputs") == ["done"]
    assert (run_dir(tmp_path, "done") / "multirun.yaml").is_file()  # Hydra's record of the launch, in the run folder
    before = tree(tmp_path / "outputs")
    for bad in (
        ["run.name=done", "checkpoint.every_n_epochs=0"],  # an existing run: its files untouched
        ["run.name=new", "checkpoint.every_n_epochs=0"],
        ["-m", "trainer.seed=1,2", "checkpoint.every_n_epochs=0"],  # a sweep refused at pre-flight
        ["-m", "trainer.seed=1,2", "trainer.no_such_key=1,2"],
    ):  # refused by Hydra's own composition
        proc = run_train(tmp_path, *TINY, *bad, timeout=120)
        assert proc.returncode != 0, (bad, proc.stderr[-2000:])
        assert tree(tmp_path / "outputs") == before, bad


@pytest.mark.extended
def test_a_run_in_use_refuses_a_second_launch_before_it_writes_anything(tmp_path: Path) -> None:
    """Run A holds outputs/a and its checkpoint.dir. B (another run name, the same checkpoint.dir) is
    refused naming that folder and A; C (the same run folder, other overrides) is refused before
    Hydra writes .hydra/ or its log: A's files are unchanged, and nothing new appears under outputs/."""
    ck = tmp_path / "shared_checkpoints"
    a = start_train(
        tmp_path,
        *TINY,
        "run.name=a",
        f"checkpoint.dir={ck}",
        "fault=hang_rank",
        "fault.rank=0",
        "fault.at_step=1",
        "fault.hang_s=120",
    )
    folder = run_dir(tmp_path, "a")
    try:
        fired = wait_for(lambda: event_of(folder, "fault_fired"), 120, "run A to reach its pause", a)
        before = tree(tmp_path / "outputs")
        b = run_train(tmp_path, *TINY, "run.name=b", f"checkpoint.dir={ck}", timeout=120)
        assert b.returncode != 0
        assert f"Folder {ck} is in use by pid {fired['pid']} on {socket.gethostname()} (run folder {folder})" in b.stderr, (
            b.stderr[-2000:]
        )
        c = run_train(tmp_path, *TINY, "run.name=a", "trainer.max_epochs=3", timeout=120)
        assert c.returncode != 0 and f"Run folder {folder} is in use by pid {fired['pid']}" in c.stderr, c.stderr[-2000:]
        new_ck = tmp_path / "new_checkpoints" / "a"  # D: the run folder in use, with a checkpoint.dir of its own
        d = run_train(tmp_path, *TINY, "run.name=a", f"checkpoint.dir={new_ck}", timeout=120)
        assert d.returncode != 0 and f"Run folder {folder} is in use by pid {fired['pid']}" in d.stderr, d.stderr[-2000:]
        assert not (tmp_path / "new_checkpoints").exists(), tree(tmp_path / "new_checkpoints")
        after = tree(tmp_path / "outputs")
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        # A itself keeps writing its logs while paused; nothing else may change
        assert {k for k in changed if not k.startswith(("a/logs/", "a/heartbeats/", "a/train.log"))} == set(), changed
        assert os.listdir(tmp_path / "outputs") == ["a"]
        assert after["a/.hydra/overrides.yaml"] == before["a/.hydra/overrides.yaml"]
        assert "trainer.max_epochs=3" not in (folder / ".hydra" / "overrides.yaml").read_text()
    finally:
        stop(a)
