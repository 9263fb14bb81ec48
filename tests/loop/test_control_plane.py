"""The library's per-step work stays off the training stream (steadfast/distributed/comm.py, steadfast/distributed/exchange.py).

A real `steadfast.Run` in this process, on a one-rank torch.distributed group (DDP over Gloo, or
NCCL where CUDA is present), trains a small model with every collective of torch.distributed's
Python API counted: the library issues none on the training group, at a step or anywhere else
after set-up, and on the control plane at most one message at each exchange step, started without
waiting (one rank alone starts none: a message's sums are its own numbers; the gradients' own all-reduce
is DDP's, in C++, and not counted). With CUDA the library's per-step
calls (the loader's next batch, the forward with the step timer's hooks, run.step) run under
`torch.cuda.set_sync_debug_mode("error")`: nothing reads a device value back, at a log step or an
exchange either (the model is not wrapped there: the check is of the library, not of DDP).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from steadfast import Run
from steadfast.contract.env import TORCH, LaunchEnv
from steadfast.distributed.comm import Comm, Pending
from steadfast.distributed.exchange import CONTROL_INTERVAL_S, MAX_EVERY, Exchange

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)
EVERY = 8  # stop_check_every_n_steps: the control plane's message every 8 steps
LOG = 5  # log_every_n_steps: the metrics windows (they ride the messages)
STEPS = 40  # one epoch


Call = Tuple[str, Any, bool]  # (function, group, async_op)


def _launch(folder: Path, monkeypatch: pytest.MonkeyPatch, snapshot: str = "") -> None:
    """The environment a one-rank torchrun launch gives its worker (`snapshot`: its node's snapshot folder)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = LaunchEnv(backend="torchrun", collective=TORCH, run_dir=folder, collective_timeout_s=60, snapshot=snapshot).to_environ()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A one-rank torchrun launch's worker environment, its run folder."""
    folder = tmp_path / "run"
    folder.mkdir()
    _launch(folder, monkeypatch)
    threads = torch.get_num_threads()
    yield folder
    torch.set_num_threads(threads)


def _count(monkeypatch: pytest.MonkeyPatch) -> List[Call]:
    calls: List[Call] = []

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, kwargs.get("group"), bool(kwargs.get("async_op"))))
            return real(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, counted(name, getattr(dist, name)))
    return calls


def _train(run: Run, sync_debug: bool, calls: List[Call]) -> Tuple[List[List[Call]], List[Call]]:
    """One epoch of STEPS steps; the calls made in each step (its batch, forward, backward and
    run.step), and those of the epoch's end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    wrapped, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run.resume(model=model, optimizer=optimizer)
    data = TensorDataset(torch.randn(STEPS * 4, 8), torch.randint(0, 2, (STEPS * 4,)))
    loader = run.loader(data, batch_size=4)
    per_step: List[List[Call]] = []
    mark = len(calls)
    for _ in run.epochs(1):
        batches = iter(loader)
        while True:
            with _no_sync(sync_debug):
                batch = next(batches, None)
            if batch is None:
                break
            x, y = (t.to(run.device, non_blocking=True) for t in batch)
            with _no_sync(sync_debug):
                out = wrapped(x)
            F.cross_entropy(out, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with _no_sync(sync_debug):
                run.step(F.cross_entropy(out.detach(), y))
            per_step.append(calls[mark:])
            mark = len(calls)
    return per_step, calls[mark:]


class _no_sync:
    """torch.cuda.set_sync_debug_mode("error") inside: a host-device synchronisation raises."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")


def _on_training_group(call: Call) -> bool:
    return call[1] is None or call[1] is dist.group.WORLD


def test_no_collective_on_the_training_group_and_one_control_message_per_exchange(
    launched: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Run({"logger": {"progress": "none"}}, log_every_n_steps=LOG, stop_check_every_n_steps=EVERY, num_threads=1) as run:
        calls = _count(monkeypatch)
        per_step, epoch_end = _train(run, False, calls)
        assert len(per_step) == STEPS
        for step, made in enumerate(per_step, 1):
            assert not [c for c in made if _on_training_group(c)], (step, made)
            # the control plane: one all-reduce at an exchange step, not waited for (alone: none); nothing between them
            message = step % EVERY == 0 and run.comm.world_size > 1
            assert made == ([("all_reduce", run.comm.control, True)] if message else []), (step, made)
        # the epoch's end reads what is in flight, waited for: allowed (alone, there is nothing to wait for)
        assert (epoch_end or run.comm.world_size == 1) and not [c for c in epoch_end if _on_training_group(c)], epoch_end
        mark = len(calls)
    assert len(calls) > mark and not [c for c in calls if _on_training_group(c)], calls[mark:]  # the final save too
    rows = [r for r in (launched / "metrics.jsonl").read_text().splitlines() if '"loss"' in r and "val_" not in r]
    assert len(rows) == STEPS // LOG  # every window's row, though they travelled with the exchanges


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the host-device synchronisations are what it checks")
def test_the_per_step_calls_never_wait_for_the_device(launched: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {"logger": {"progress": "none"}, "parallel": {"kind": "none"}}
    with Run(cfg, log_every_n_steps=LOG, stop_check_every_n_steps=EVERY, num_threads=1) as run:
        assert run.device.type == "cuda"
        calls = _count(monkeypatch)
        per_step, _ = _train(run, True, calls)  # raises at the first synchronisation in a library call
        assert len(per_step) == STEPS and not [c for made in per_step for c in made if _on_training_group(c)]
    rows = [r for r in (launched / "metrics.jsonl").read_text().splitlines() if '"loss"' in r and "val_" not in r]
    assert len(rows) == STEPS // LOG


class _RankZeroOfTwo(Comm):
    """Rank 0 of two in one process: the all-reduce adds the peer's message (`peer`), and counts."""

    world_size = 2

    def __init__(self, peer: List[float]) -> None:
        super().__init__()
        self.peer, self.sums = peer, 0

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        self.sums += 1
        return Pending(lambda: tensor + torch.tensor(self.peer, dtype=tensor.dtype))


def test_one_message_carries_every_part_and_each_gets_its_answer_at_the_next_exchange() -> None:
    # rank 0 posts shared [1] and own [2, 3], its rider own [5]; the peer (rank 1) the same parts:
    # shared [10], own [20, 30] and [50]. The message: the shared sums, then rank 0's row, rank 1's row.
    comm = _RankZeroOfTwo([10.0, 0.0, 0.0, 0.0, 20.0, 30.0, 50.0])
    exchange = Exchange(comm, 4)
    got: List[Any] = []
    exchange.ride(lambda step, at_once: exchange.post([], [5.0], lambda shared, own: got.append(("rider", shared, own))))
    assert [s for s in range(1, 9) if exchange.due(s)] == [4, 8]
    exchange.post([1.0], [2.0, 3.0], lambda shared, own: got.append(("part", shared, own)))
    exchange.send(4)
    assert comm.sums == 1 and got == []  # started, not waited for
    exchange.send(8)  # reads the message of step 4 first, then sends the rider's alone
    assert got == [("part", [11.0], [[2.0, 3.0], [20.0, 30.0]]), ("rider", [], [[5.0], [50.0]])]
    assert comm.sums == 2 and exchange.sent_at == 8


class _Alone(Comm):
    """One rank whose collective must not be started: alone, the message's sums are its own numbers."""

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        raise AssertionError("a rank alone started a collective")


def test_alone_a_message_is_its_own_numbers_read_at_the_next_exchange_as_floats() -> None:
    exchange = Exchange(_Alone(), 4)
    got: List[Any] = []
    exchange.ride(lambda step, at_once: exchange.post([], [5], lambda shared, own: got.append(("rider", shared, own))))
    exchange.post([1.0, True], [2, 3.5], lambda shared, own: got.append(("part", shared, own)))
    exchange.send(4)
    assert got == []  # read at the next exchange, as a message in flight is
    exchange.send(8)
    assert got == [("part", [1.0, 1.0], [[2.0, 3.5]]), ("rider", [], [[5.0]])]
    assert all(type(v) is float for _, shared, own in got for v in [*shared, *own[0]])  # as an all-reduce answers


def test_the_automatic_interval_is_a_power_of_two_of_about_the_control_interval() -> None:
    exchange = Exchange(Comm(), None)
    assert exchange.every == 1  # until a time per step is known
    for seconds in (0.0001, 0.001, 0.003, 0.05, 1.0):
        exchange.retune(seconds)
        assert exchange.every & (exchange.every - 1) == 0
        assert exchange.every in (1, MAX_EVERY) or CONTROL_INTERVAL_S / 2 < exchange.every * seconds <= CONTROL_INTERVAL_S
    fixed = Exchange(Comm(), 3)
    fixed.retune(0.001)
    assert fixed.every == 3
    paced = Exchange(Comm(), None)  # every message carries rank 0's time per step since the one before
    for step in (1, 2, 3):
        time.sleep(0.002)
        paced.send(step)
    assert paced.every > 1  # the second message's answer, read at step 3, set it


def test_the_steps_between_due_steps_only_count_and_every_part_gets_its_own(
    launched: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run.step does its whole boundary only where a part other than the metrics has work
    (steadfast/loop/boundary.py): the first step, the control plane's message (every 8), the step
    cadence (every 7); at the others it only counts, and closes the metrics windows (every 5) that fall
    there, and what it counts is all in the records: each window's loss is the mean of every step's loss
    in it, its learning rate the one at its step, and the checkpoints are at the cadence."""
    from steadfast.loop.boundary import StepBoundary

    whole: List[int] = []
    real_due = StepBoundary.due

    def due(self: StepBoundary, step: int, epoch: int, loss: Any, *more: Any) -> Any:
        whole.append(step)
        return real_due(self, step, epoch, loss, *more)

    monkeypatch.setattr(StepBoundary, "due", due)
    losses: List[float] = []
    real_step = Run.step

    def step(self: Run, loss: Any = None, *more: Any) -> None:
        losses.append(float(loss))
        assert self.optimizer is not None
        self.optimizer.param_groups[0]["lr"] = (self.global_step + 1) / 1000  # a schedule: each step's own
        real_step(self, loss, *more)

    monkeypatch.setattr(Run, "step", step)
    cfg = {"logger": {"progress": "none"}, "checkpoint": {"every_n_steps": 7, "every_n_epochs": None}}
    with Run(cfg, log_every_n_steps=LOG, stop_check_every_n_steps=EVERY, num_threads=1) as run:
        _train(run, False, [])
    assert whole == [s for s in range(1, STEPS + 1) if s == 1 or s % EVERY == 0 or s % 7 == 0]
    rows = [json.loads(r) for r in (launched / "metrics.jsonl").read_text().splitlines() if '"loss"' in r and "val_" not in r]
    assert [r["step"] for r in rows] == list(range(LOG, STEPS + 1, LOG))
    for r in rows:
        window = losses[r["step"] - LOG : r["step"]]
        assert r["loss"] == pytest.approx(sum(window) / LOG, rel=1e-5), (r, window)
        assert r["lr"] == r["step"] / 1000, r
    records = [json.loads(line) for line in (launched / "events.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in records if e["event"] == "checkpoint_saved"]
    assert saved == [7, 14, 21, 28, 35, STEPS]  # the cadence's steps, and the last one at the end


def test_the_heartbeats_file_is_never_behind_a_snapshot_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step only counts in memory (its file is written by a thread within PUBLISH_S), but the
    file has a step before a snapshot of it is taken: a rank killed outright is named at a step at least
    as new as the one its group resumes from (tests/platform_runs.py's kills rely on it)."""
    from steadfast.checkpoint.memory import MemorySnapshots
    from steadfast.contract import heartbeat, shm
    from steadfast.contract.files import HEARTBEAT_DIR

    folder = tmp_path / "run"
    folder.mkdir()
    segment = shm.LaunchFolder(folder)  # what the launcher makes for a node: its private snapshot folder
    segment.create()
    _launch(folder, monkeypatch, segment.name)
    monkeypatch.setitem(heartbeat._state, "heartbeat", None)
    heartbeat.start_heartbeat(folder, 0)
    seen: List[Tuple[int, int]] = []  # (the snapshot's step, the step the rank's file said as it was taken)
    real_take = MemorySnapshots.take

    def take(self: MemorySnapshots, step: int, *more: Any, **kw: Any) -> None:
        record = heartbeat.read_heartbeat(folder / HEARTBEAT_DIR / "rank0")
        seen.append((step, record["step"] if record else -1))
        real_take(self, step, *more, **kw)

    monkeypatch.setattr(MemorySnapshots, "take", take)
    threads = torch.get_num_threads()
    try:
        cfg = {"logger": {"progress": "none"}, "snapshot": {"every_n_steps": 4}}
        with Run(cfg, log_every_n_steps=LOG, stop_check_every_n_steps=EVERY, num_threads=1) as run:
            _train(run, False, [])
    finally:
        torch.set_num_threads(threads)
        segment.remove()
    assert len(seen) >= STEPS // 4 - 1, seen
    assert all(said == step for step, said in seen), seen


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full: a device every write to fails with ENOSPC")
def test_an_error_leaving_the_run_is_the_one_raised_when_closing_fails_too(
    launched: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop's own error leaves `with Run(...)` as it is, though writing the last metrics rows fails
    too (a full disk: metrics.jsonl is /dev/full here); the second failure is logged, and the run's
    other ends (the heartbeat's `done`, the process groups) still happen."""
    (launched / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(ZeroDivisionError, match="the loop's own"):
        with Run({"logger": {"progress": "none"}}, log_every_n_steps=1, num_threads=1) as run:
            model = nn.Linear(2, 1)
            wrapped, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            run.resume(model=model, optimizer=optimizer)
            for step in range(3):
                run.step(float(step))
            raise ZeroDivisionError("the loop's own error")
    assert "No space left on device" in caplog.text
    assert not dist.is_initialized()  # the process groups were shut down all the same
