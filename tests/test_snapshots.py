"""Snapshots in shared memory (steadfast/snapshots.py): the double buffer, torn copies, the agreed
restore, the launcher's clean-up, and end to end: a worker killed at random steps loses at most the
steps since the last snapshot, and the run ends with the uninterrupted run's weights."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import torch

from helpers import QUICK, env, event_of, events, restores, run_dir, run_train, start_train, stop, summary, wait_for
from steadfast.contract import shm
from steadfast.contract.heartbeat import read_heartbeats
from steadfast.snapshots import MemorySnapshots, fits
from steadfast.state import Progress, RNGState


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import steadfast.snapshots as snapshots

    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", folder)
    monkeypatch.setattr(snapshots, "SHM_DIR", folder)
    return folder


@pytest.fixture
def launch(shm_dir: Path, tmp_path: Path) -> Iterator[shm.LaunchFolder]:
    """What the launcher makes for a launch: its private folder in shared memory, with its key."""
    folder = shm.LaunchFolder(tmp_path / "run")
    folder.create()
    yield folder
    folder.remove()


def _memory(launch: shm.LaunchFolder, world_size: int = 1) -> MemorySnapshots:
    """A worker's snapshots, as a new process makes them: the launch's folder opened and checked afresh."""
    return MemorySnapshots(shm.Segments(launch.name), rank=0, local_rank=0, world_size=world_size)


def _state() -> Dict[str, Any]:
    return {"model": torch.nn.Linear(4, 3), "progress": Progress()}


def _snap(memory: MemorySnapshots, objects: Dict[str, Any], step: int, halfway: Any = None) -> None:
    objects["progress"].global_step = step
    with torch.no_grad():
        objects["model"].weight.fill_(float(step))
    memory.take(step, memory.plan(objects, {"rng": RNGState()}), halfway)


def test_the_double_buffer_keeps_the_two_newest_and_a_new_process_reads_them(launch: shm.LaunchFolder) -> None:
    objects = _state()
    writer = _memory(launch, world_size=2)
    for step in (1, 2, 3):
        _snap(writer, objects, step)
    reader = _memory(launch, world_size=2)  # a restarted worker
    assert reader.steps() == [3, 2]
    shared, own = reader.load(3)
    assert torch.equal(shared["model"]["weight"], torch.full((3, 4), 3.0)) and shared["progress"]["global_step"] == 3
    assert "rng" in own
    assert _memory(launch, world_size=3).steps() == []  # another world size: not ours


def test_a_copy_killed_halfway_leaves_the_other_buffer(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = _memory(launch)
    _snap(memory, objects, 1)
    _snap(memory, objects, 2)

    def die() -> None:
        raise KeyboardInterrupt("killed in the middle of the copy")

    with pytest.raises(KeyboardInterrupt):
        _snap(memory, objects, 3, halfway=die)  # overwrites the older buffer (step 1)
    fresh = _memory(launch)
    assert fresh.steps() == [2]
    assert fresh.load(2)[0]["progress"]["global_step"] == 2


def test_damaged_bytes_never_load(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = _memory(launch)
    _snap(memory, objects, 5)
    slot = next(s for s in memory.objects.slots if s.header())
    data = bytearray(slot.path.read_bytes())
    data[-1] ^= 0xFF
    slot.path.write_bytes(bytes(data))
    assert memory.load(5) is None  # the checksum catches it: the run falls back (to disk, or the other buffer)


def test_newer_snapshots_of_an_abandoned_timeline_are_discarded(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = _memory(launch)
    _snap(memory, objects, 7)
    _snap(memory, objects, 8)
    memory.discard_after(7)
    assert _memory(launch).steps() == [7]


def test_too_little_shared_memory_is_said_before_anything_is_written(
    launch: shm.LaunchFolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Small:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "fstatvfs", lambda fd: Small())
    problem = fits(shm.Segments(launch.name), 10 << 20)
    assert problem and "MiB free" in problem and "two copies" in problem
    assert os.listdir(launch.path) == [shm.KEY_FILE]


def test_the_launcher_removes_the_folders_of_launchers_that_are_gone(shm_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    killed = subprocess.run(  # a launcher killed with SIGKILL after it made its folder
        [sys.executable, "-c", KILLED_LAUNCHER, str(shm_dir), str(run)], env=env(), capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    gone = killed.stdout.strip()
    assert (shm_dir / gone / shm.KEY_FILE).is_file()
    alive, other = shm.LaunchFolder(run), shm.LaunchFolder(tmp_path / "other")
    for folder in (alive, other):
        folder.create()
    try:
        mine = shm.LaunchFolder(run)
        mine.create()
        removed = shm.remove_orphans(run, keep=mine.name)
        assert [p.name for p in removed] == [gone]  # the live launcher's and another run's are kept
        assert sorted(os.listdir(shm_dir)) == sorted([alive.name, other.name, mine.name])
        mine.remove()
        assert not (shm_dir / mine.name).exists()
    finally:
        alive.remove()
        other.remove()


KILLED_LAUNCHER = """
import os, signal, sys
from pathlib import Path
from steadfast.contract import shm
shm.SHM_DIR = Path(sys.argv[1])
folder = shm.LaunchFolder(Path(sys.argv[2]))
folder.create()
print(folder.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_launchers_folder_is_told_by_its_nonce_and_lock_not_by_a_pid(launch: shm.LaunchFolder, tmp_path: Path) -> None:
    """A killed launcher whose pid the next launcher got (#23 item 8: its segments were taken for the
    new launch's own, and a restore from them skipped the config-drift check). Here every launch is
    this process: the pid says nothing, the nonce and the lock do."""
    _snap(_memory(launch), _state(), 5)
    os.close(launch.fd)  # the launcher is gone: its lock with it (its folder stays, as after SIGKILL)
    launch.fd = -1
    new = shm.LaunchFolder(tmp_path / "run")  # the same run folder, the same pid
    new.create()
    try:
        assert new.name != launch.name and _memory(new).steps() == []  # nothing of the old launch is seen as the new one's
        assert shm.remove_orphans(tmp_path / "run", keep=new.name) == [launch.path]
        assert os.listdir(new.path) == [shm.KEY_FILE]
    finally:
        new.remove()


# ---- end to end ---------------------------------------------------------------------------------------
ON = "snapshot.every_n_steps=auto"  # QUICK turns the memory tier off; the default is back on here
# 390 steps: far past the last kill (steps 10-70), so a fast restarted group cannot finish before it
# lands. A snapshot every step: what auto chooses where a step is of real size (these steps are so
# short that auto spaces the snapshots out, and the interval it picks moves with the machine's load)
LONG = [
    *QUICK,
    "snapshot.every_n_steps=1",
    "trainer.max_epochs=30",
    "checkpoint=every_n_steps",
    "checkpoint.every_n_steps=40",
    "restart.max_restarts=6",
]


def _every_n(folder: Path) -> int:
    return max(e["every_n_steps"] for e in events(folder) if e["event"] == "snapshot_created")


@pytest.mark.extended
@pytest.mark.slow
def test_a_worker_killed_at_random_steps_loses_at_most_the_snapshot_interval(tmp_path: Path) -> None:
    seed = int(os.environ.get("STEADFAST_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    run_train(tmp_path, *LONG, "run.name=ref", check=True)
    proc = start_train(tmp_path, *LONG, "run.name=r")
    folder = run_dir(tmp_path, "r")
    try:
        for restart, target in enumerate(sorted(rng.sample(range(10, 70), 3))):
            rank = rng.randrange(2)

            def reached(rank: int = rank, restart: int = restart, target: int = target) -> Any:
                beat = read_heartbeats(folder).get(rank)
                return (
                    beat
                    if beat and beat.get("restart") == restart and beat.get("phase") == "train" and beat["step"] >= target
                    else None
                )

            beat = wait_for(reached, 120, f"rank {rank} past step {target} in attempt {restart} (seed {seed})", proc)
            os.kill(beat["pid"], signal.SIGKILL)
        code = proc.wait(timeout=240)
    finally:
        out = stop(proc)
    assert code == 0, (seed, out[-3000:])
    restored = restores(folder)
    every = _every_n(folder)
    # from memory, unless the kill landed right on a checkpoint step (both tiers hold it: disk)
    assert len(restored) == 3 and all(r["source"] == "memory" or r["step"] % 40 == 0 for r in restored), (seed, restored)
    assert every == 1 and all(0 <= r["reached"] - r["step"] <= every for r in restored), (seed, every, restored)
    assert summary(folder)["model_sha256"] == summary(run_dir(tmp_path, "ref"))["model_sha256"], seed


@pytest.mark.slow
def test_killed_while_copying_a_snapshot_uses_the_other_buffer_and_stays_exact(tmp_path: Path, baseline: dict) -> None:
    run_train(
        tmp_path, *QUICK, "run.name=r", "snapshot.every_n_steps=1", "fault=crash_in_snapshot", "fault.at_step=20", check=True
    )
    folder = run_dir(tmp_path, "r")
    resumed = event_of(folder, "resumed")
    assert resumed["source"] == "memory" and resumed["step"] == 19  # the copy of 20 was torn: 19, the other buffer
    assert summary(folder)["model_sha256"] == baseline["summary"]["model_sha256"]


@pytest.mark.extended
@pytest.mark.slow
def test_without_shared_memory_the_run_says_so_and_resumes_from_disk(
    tmp_path: Path, baseline: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEADFAST_SHM_DIR", str(tmp_path / "no-such-folder"))
    proc = run_train(tmp_path, *QUICK, ON, "run.name=r", "fault=kill_rank", "fault.at_step=20", check=True)
    folder = run_dir(tmp_path, "r")
    assert "Snapshots in memory are off" in proc.stderr and "snapshot.every_n_steps=0" in proc.stderr
    assert event_of(folder, "snapshot_unavailable") and event_of(folder, "resumed")["source"] == "disk"
    assert summary(folder)["model_sha256"] == baseline["summary"]["model_sha256"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_launchers_orphans_commit_nothing_and_its_segments_go_with_the_next_launch(tmp_path: Path) -> None:
    import json
    import time

    args = [*QUICK, ON, "run.name=r", "trainer.max_epochs=100"]
    proc = start_train(tmp_path, *args)
    folder = run_dir(tmp_path, "r")
    try:
        created = wait_for(lambda: event_of(folder, "snapshot_created"), 120, "the first snapshot", proc)
        workers = [b["pid"] for b in read_heartbeats(folder).values()]
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its workers are orphaned (and get SIGINT from torch)
        proc.wait(timeout=30)
        # they end by themselves, within a second, saving nothing
        wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "the orphaned workers to end")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader: anything left of it
        except ProcessLookupError:
            pass
        proc.communicate(timeout=30)
    committed = [json.loads(m.read_text()) for m in (folder / "checkpoints").glob("step_*/manifest.json")]
    assert all(m["created"] < killed_at for m in committed), "an orphaned worker committed after its launcher was gone"
    segment = created["segment"]
    assert (shm.SHM_DIR / segment / "objects.a").is_file(), "the killed launcher left its snapshots"
    run_train(tmp_path, *args, check=True)  # the same command: removes them, and its own at the end
    assert not list(shm.SHM_DIR.glob(f"{segment.rsplit('-', 1)[0]}-*"))


def test_auto_takes_a_snapshot_every_step_when_cheap_and_spaces_them_to_two_percent_of_the_time(
    launch: shm.LaunchFolder, tmp_path: Path
) -> None:
    from steadfast.comm import Comm
    from steadfast.records import RunRecord
    from steadfast.snapshots import MEMORY_SHARE, MemoryCadence

    memory, record = _memory(launch), RunRecord(tmp_path, 0)
    cadence = MemoryCadence(memory, "auto", Comm(), record.event, ({}, {}), lambda step: None)
    step = 0.010  # seconds per step
    for cost, every in (
        (0.1 * MEMORY_SHARE * step, 1),
        (0.99 * MEMORY_SHARE * step, 1),
        (5 * MEMORY_SHARE * step, 5),
        (4.5 * MEMORY_SHARE * step, 5),
    ):
        memory.seconds = cost
        cadence.retune(step)
        assert cadence.every == every and cost / every <= MEMORY_SHARE * step * 1.0001, (cost, cadence.every)
    recorded = [e["every_n_steps"] for e in events(tmp_path) if e["event"] == "snapshot_created"]
    assert recorded == [5], recorded  # each change of the interval is recorded, with the cost it came from
    fixed = MemoryCadence(memory, 3, Comm(), record.event, ({}, {}), lambda step: None)
    memory.seconds = 100 * step
    fixed.retune(step)
    assert fixed.every == 3  # a number the user set is kept
