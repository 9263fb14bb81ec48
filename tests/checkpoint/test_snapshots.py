"""Snapshots in shared memory (steadfast/checkpoint/memory.py, steadfast/loop/memory_cadence.py): the double buffer, torn
copies, the agreed restore, the launcher's clean-up, when they are taken and what is recorded of it,
and end to end: a worker killed at random steps loses at most the interval in force, and the run ends
with the uninterrupted run's weights."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from helpers import QUICK, env, event_of, events, memory_of, restores, run_dir, run_train, start_train, stop, summary, wait_for
from steadfast.checkpoint.memory import MemorySnapshots, fits
from steadfast.checkpoint.state import Progress, RNGState
from steadfast.contract import shm
from steadfast.contract.heartbeat import read_heartbeats


def _state() -> Dict[str, Any]:
    return {"model": torch.nn.Linear(4, 3), "progress": Progress()}


def _snap(memory: MemorySnapshots, objects: Dict[str, Any], step: int, halfway: Any = None) -> None:
    objects["progress"].global_step = step
    with torch.no_grad():
        objects["model"].weight.fill_(float(step))
    memory.take(step, memory.plan(objects, {"rng": RNGState()}), halfway)


def test_the_double_buffer_keeps_the_two_newest_and_a_new_process_reads_them(launch: shm.LaunchFolder) -> None:
    objects = _state()
    writer = memory_of(launch, world_size=2)
    for step in (1, 2, 3):
        _snap(writer, objects, step)
    reader = memory_of(launch, world_size=2)  # a restarted worker
    assert reader.steps() == [3, 2]
    shared, own = reader.load(3)
    assert torch.equal(shared["model"]["weight"], torch.full((3, 4), 3.0)) and shared["progress"]["global_step"] == 3
    assert "rng" in own
    assert memory_of(launch, world_size=3).steps() == []  # another world size: not ours


def test_a_copy_killed_halfway_leaves_the_other_buffer(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = memory_of(launch)
    _snap(memory, objects, 1)
    _snap(memory, objects, 2)

    def die() -> None:
        raise KeyboardInterrupt("killed in the middle of the copy")

    with pytest.raises(KeyboardInterrupt):
        _snap(memory, objects, 3, halfway=die)  # overwrites the older buffer (step 1)
    fresh = memory_of(launch)
    assert fresh.steps() == [2]
    assert fresh.load(2)[0]["progress"]["global_step"] == 2


def test_damaged_bytes_never_load(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = memory_of(launch)
    _snap(memory, objects, 5)
    slot = next(s for s in memory.objects.slots if s.header())
    data = bytearray(slot.path.read_bytes())
    data[-1] ^= 0xFF
    slot.path.write_bytes(bytes(data))
    assert memory.load(5) is None  # the checksum catches it: the run falls back (to disk, or the other buffer)


def test_newer_snapshots_of_an_abandoned_timeline_are_discarded(launch: shm.LaunchFolder) -> None:
    objects = _state()
    memory = memory_of(launch)
    _snap(memory, objects, 7)
    _snap(memory, objects, 8)
    memory.discard_after(7)
    assert memory_of(launch).steps() == [7]


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
    _snap(memory_of(launch), _state(), 5)
    os.close(launch.fd)  # the launcher is gone: its lock with it (its folder stays, as after SIGKILL)
    launch.fd = -1
    new = shm.LaunchFolder(tmp_path / "run")  # the same run folder, the same pid
    new.create()
    try:
        assert new.name != launch.name and memory_of(new).steps() == []  # nothing of the old launch is seen as the new one's
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
    return max(e["every_n_steps"] for e in events(folder) if e["event"] == "snapshot_interval")


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


# 2000 steps (one epoch) of a tiny model on one torchrun worker: as long a run as the (#24),
# in seconds. No checkpoint on disk before the end: a restore comes from memory.
RUN_2000 = [
    "data=synthetic",
    "data.num_samples=20000",
    "data.batch_size=8",
    "data.num_features=8",
    "model.hidden_sizes=[16]",
    "trainer.max_epochs=1",
    "restart.monitor_interval=0.1",
    "backend.nproc_per_node=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("every", [pytest.param("1", marks=pytest.mark.extended), "auto"])  # auto: the interval moves
def test_a_kill_at_a_random_step_loses_at_most_the_interval_in_force_and_the_records_stay_short(
    tmp_path: Path, every: str
) -> None:
    """README's promise (a death loses at most the interval in force, which the records say), on
    the records a person reads: events.jsonl (fault_fired, resumed, snapshot_interval), the console."""
    seed = int(os.environ.get("STEADFAST_TEST_SEED", random.randrange(10**6)))
    at = random.Random(seed).randrange(20, 1990)
    run_train(
        tmp_path, *RUN_2000, f"snapshot.every_n_steps={every}", "fault=kill_rank", f"fault.at_step={at}", "run.name=r", check=True
    )
    folder = run_dir(tmp_path, "r")
    recorded = events(folder)
    kinds = Counter(e["event"] for e in recorded)
    assert len(recorded) < 100 and summary(folder)["global_step"] == 2000, (seed, kinds)
    fired, resumed = event_of(folder, "fault_fired"), event_of(folder, "resumed")
    intervals = [e for e in recorded if e["event"] == "snapshot_interval" and e["restart"] == fired["restart"]]
    lost, bound = at - resumed["step"], _in_force(intervals, at - 1)
    assert fired["step"] == at and resumed["source"] == "memory" and 0 <= lost <= bound, (seed, at, resumed, intervals)
    assert every == "auto" or (bound == 1 and kinds["snapshot_interval"] == 2), (seed, intervals)  # one per attempt
    # rank 0's log (what its console shows) says each interval in force as it is recorded, and
    # numbers epochs as the progress line does
    log = (folder / "logs" / "rank0.log").read_text()
    said = [line for line in log.splitlines() if "Snapshots in memory:" in line]
    assert len(said) == kinds["snapshot_interval"], (seed, said)
    assert f"(epoch {resumed['epoch'] + 1}, batch {resumed['batch_in_epoch']})" in log and "progress: epoch 1/1" in log, seed


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
        created = wait_for(lambda: event_of(folder, "snapshot_interval"), 120, "the first snapshot", proc)
        workers = [b["pid"] for b in read_heartbeats(folder).values()]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its workers are orphaned (and get SIGINT from torch)
        proc.wait(timeout=30)
        # reaped: from now on the workers' fence (launcher_alive, just before the rename) sees it gone. Not the
        # moment of the kill: a SIGKILLed process is alive until the kernel has torn it down, and a commit
        # whose fence passed then is legitimate (a loaded machine made that window long enough to be hit)
        gone_at = time.time()
        # they end by themselves, within a second, saving nothing
        wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "the orphaned workers to end")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader: anything left of it
        except ProcessLookupError:
            pass
        proc.communicate(timeout=30)
    committed = [json.loads(m.read_text()) for m in (folder / "checkpoints").glob("step_*/manifest.json")]
    assert all(m["created"] < gone_at for m in committed), "an orphaned worker committed after its launcher was gone"
    segment = created["segment"]
    assert (shm.SHM_DIR / segment / "objects.a").is_file(), "the killed launcher left its snapshots"
    run_train(tmp_path, *args, check=True)  # the same command: removes them, and its own at the end
    assert not list(shm.SHM_DIR.glob(f"{segment.rsplit('-', 1)[0]}-*"))


class _Clock:
    """A loop's time as MemoryCadence sees it: the test moves `now`; a copy takes `cost(step)` seconds."""

    def __init__(self, cost: Callable[[int], float]) -> None:
        self.now, self.cost, self.copies = 0.0, cost, []

    def __call__(self) -> float:
        return self.now

    def copying(self, step: int) -> None:  # the snapshot fault's hook: called in the middle of each copy
        self.now += self.cost(step)
        self.copies.append(step)


def _drive(
    launch: shm.LaunchFolder,
    tmp_path: Path,
    every: Any,
    steps: range,
    step_s: Callable[[int], float],
    cost_s: Callable[[int], float],
) -> Tuple[List[int], List[Dict[str, Any]]]:
    """Steps as Run.step drives a MemoryCadence (the control exchange every 10 steps, then at_step),
    on a fake clock; returns the steps that were copied and the snapshot_interval events."""
    from steadfast.distributed.comm import Comm
    from steadfast.distributed.exchange import Exchange
    from steadfast.loop.memory_cadence import MemoryCadence
    from steadfast.telemetry.records import RunRecord

    clock = _Clock(cost_s)
    exchange = Exchange(Comm(), 10)
    cadence = MemoryCadence(
        memory_of(launch), every, exchange, RunRecord(tmp_path, 0).event, (_state(), {"rng": RNGState()}), clock.copying, clock
    )
    for step in steps:
        clock.now += step_s(step)
        if exchange.due(step):
            exchange.send(step)
        assert cadence.at_step(step)
    return clock.copies, [e for e in events(tmp_path) if e["event"] == "snapshot_interval"]


def _in_force(recorded: List[Dict[str, Any]], step: int) -> int:
    """The interval in force at `step`: an attempt's first record says it from the attempt's start."""
    return [e["every_n_steps"] for e in recorded if e["step"] <= step or e is recorded[0]][-1]


def _check_gaps(copies: List[int], recorded: List[Dict[str, Any]], started_from: int) -> None:
    """The promise: after the snapshot (or start) at s, the next comes before the interval in force
    has passed, so a death at k (its copy not taken) loses k - s <= the interval in force at k - 1."""
    for before, after in zip([started_from, *copies], copies):
        assert after - before <= _in_force(recorded, after - 1), (before, after, recorded)


def test_auto_settles_on_a_power_of_two_within_two_percent_and_records_each_change(
    launch: shm.LaunchFolder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from steadfast.loop.memory_cadence import MEMORY_SHARE

    caplog.set_level(logging.INFO, logger="steadfast.details.snapshots")
    jitter = random.Random(1)

    def step_s(step: int) -> float:  # 10 ms +-30%; a 2 s validation every 500 steps; 4x faster from step 800 to 1400
        base = 0.0025 if 800 <= step < 1400 else 0.010
        return (2.0 if step % 500 == 1 else 0.0) + base * jitter.uniform(0.7, 1.3)

    copies, recorded = _drive(launch, tmp_path, "auto", range(1, 2001), step_s, lambda step: 0.0024 * jitter.uniform(0.7, 1.3))
    every = [e["every_n_steps"] for e in recorded]
    # every step until timed; 2.4 ms of a 10 ms step is 12 intervals' worth at 2%: 16; the 4x faster
    # steps ask for 48: 64 at once; back at 10 ms, 12 <= 64 / 4: 16 again, once the fast windows are
    # older than the 8 it remembers
    assert every == [1, 16, 64, 16], recorded
    assert [e["step"] for e in recorded][0] == 1 and 800 < recorded[2]["step"] <= 820 and 1400 < recorded[3]["step"] <= 1500
    for e in recorded[1:]:  # each change a factor of 2 or more, and within the budget it was measured against
        ratio = e["every_n_steps"] / e["previous_every_n_steps"]
        assert (ratio >= 2 or ratio <= 0.5) and e["seconds"] / e["every_n_steps"] <= MEMORY_SHARE * e["step_seconds"], e
    _check_gaps(copies, recorded, 0)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Snapshots in memory")]
    assert len(said) == len(recorded) and "every step (auto) from step 1" in said[0], said
    # the second window's numbers (step 20) are agreed at the next exchange (pipelined)
    assert said[1].startswith("Snapshots in memory: every 16 steps (auto) from step 30 "), said


def test_a_fixed_interval_counts_from_where_the_attempt_started(launch: shm.LaunchFolder, tmp_path: Path) -> None:
    copies, recorded = _drive(launch, tmp_path, 3, range(101, 120), lambda step: 0.01, lambda step: 1.0)
    assert copies == [103, 106, 109, 112, 115, 118]  # resumed from step 100: from there, not from step 0
    assert [(e["step"], e["every_n_steps"], e["auto"]) for e in recorded] == [(103, 3, False)]  # a costly copy changes nothing
