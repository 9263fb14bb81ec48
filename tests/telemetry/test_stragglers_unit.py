"""Stragglers without processes: the naming rule (margin, floor, consecutive windows, recovery), what the
step timer counts as a rank's local work (on a fake clock), that timing adds no collective, the
window's exchange and the records it leaves, the report's reading of them, and the keys' checks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from steadfast.distributed.comm import Comm, Pending
from steadfast.telemetry import _stragglers as stragglers
from steadfast.telemetry._stragglers import StepTimer, StragglerRule
from steadfast.telemetry.metrics import Telemetry
from steadfast.telemetry.records import RunRecord

MS = 0.001


# ---- the rule ----------------------------------------------------------------------------------------
def _feed(rule: StragglerRule, windows: List[List[float]]) -> List[tuple]:
    """Every change the rule announced: (window index, rank, 'named' | 'recovered')."""
    out = []
    for i, local in enumerate(windows):
        named, recovered = rule.update(local)
        out += [(i, s.rank, "named") for s in named] + [(i, s.rank, "recovered") for s in recovered]
    return out


def test_a_rank_over_the_margin_for_the_windows_in_a_row_is_named_once() -> None:
    rule = StragglerRule(0.25, 3)
    slow = [10 * MS, 13 * MS, 10 * MS]  # rank 1: +30% over the others' median
    assert _feed(rule, [slow] * 6) == [(2, 1, "named")]  # the third window in a row, and only then
    assert set(rule.named) == {1} and rule.describe() == "rank 1 (+30%)"


def test_under_the_margin_or_the_floor_nobody_is_named() -> None:
    assert _feed(StragglerRule(0.25, 1), [[10 * MS, 12 * MS, 10 * MS]] * 5) == []  # +20% < 25%
    # +100%, but only 1 ms per step more: jitter on a tiny model, under the floor
    assert _feed(StragglerRule(0.25, 1), [[1 * MS, 2 * MS, 1 * MS]] * 5) == []
    assert _feed(StragglerRule(0.25, 1, floor_s=0.5 * MS), [[1 * MS, 2 * MS, 1 * MS]]) == [(0, 1, "named")]


def test_the_windows_must_be_consecutive() -> None:
    fast, slow = [10 * MS, 10 * MS], [10 * MS, 20 * MS]
    assert _feed(StragglerRule(0.25, 3), [slow, slow, fast, slow, slow, fast, slow]) == []
    assert _feed(StragglerRule(0.25, 3), [slow, slow, fast, slow, slow, slow]) == [(5, 1, "named")]


def test_a_named_rank_recovers_after_as_many_windows_and_is_said_once() -> None:
    fast, slow = [10 * MS, 10 * MS], [10 * MS, 20 * MS]
    rule = StragglerRule(0.25, 2)
    changes = _feed(rule, [slow, slow, slow, fast, slow, fast, fast, fast, fast])
    assert changes == [(1, 1, "named"), (6, 1, "recovered")]  # one fast window in between is not a recovery
    assert rule.named == {} and rule.describe() == ""


def test_two_ranks_compare_with_the_peer_and_the_faster_is_never_named() -> None:
    rule = StragglerRule(0.25, 1)
    (named,), _ = rule.update([10 * MS, 20 * MS])
    assert named.rank == 1 and named.ratio == pytest.approx(2.0)  # the median of the others: rank 0's
    assert named.fields(40, 1, False) == {
        "rank": 1,
        "ratio": 2.0,
        "local_ms": 20.0,
        "median_ms": 10.0,
        "windows": 1,
        "step": 40,
        "recovered": False,
    }


@pytest.mark.parametrize("margin", [0, 0.0, None])
def test_a_margin_of_zero_or_null_is_off(margin: Any) -> None:
    rule = StragglerRule(margin, 1)
    assert not rule.on and _feed(rule, [[1 * MS, 100 * MS]] * 3) == []


def test_alone_or_without_timed_steps_nothing_is_decided() -> None:
    rule = StragglerRule(0.25, 1)
    assert _feed(rule, [[50 * MS], [0.0, 50 * MS]]) == []


# ---- the timer, on a fake clock ----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work(nn.Module):
    """A forward that takes `seconds` on the fake clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds, self.lin = clock, seconds, nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.seconds
        return self.lin(x)


class Waits(nn.Module):
    """A wrapper whose forward waits `seconds` (as DDP's buffer broadcast, FSDP's all-gather) before the inner one."""

    def __init__(self, inner: nn.Module, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.seconds
        return self.inner(x)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(stragglers.time, "perf_counter", fake)
    return fake


def _timer(clock: Clock, forward_is_local: bool = True) -> tuple:
    inner = Work(clock, 3.0)
    outer = Waits(inner, clock, 100.0)
    timer = StepTimer()
    timer.watch(outer, inner, forward_is_local)
    timer.mark()
    return timer, outer


def test_local_time_is_loading_and_forward_not_the_waits_around_them(clock: Clock) -> None:
    timer, model = _timer(clock)
    x = torch.zeros(1, 2)
    for _ in range(2):
        clock.now += 5.0  # loading the batch
        model(x)  # 100 s waiting in the wrapper, 3 s of forward
        clock.now += 50.0  # backward: the gradient all-reduce waits for the slowest rank
        timer.step()
        clock.now += 7.0  # the library's own work at the boundary
        timer.mark()
    assert timer.window() == pytest.approx(8.0) and timer.window() == 0.0  # 5 + 3 per step; then a new window


def test_with_accumulation_the_last_micro_batch_counts_and_fsdp_only_the_first_forward(clock: Clock) -> None:
    x = torch.zeros(1, 2)
    for fsdp, expected in ((False, 2.0 + 103.0 + 4.0 + 2.0 + 3.0), (True, 2.0)):
        timer, model = _timer(clock, forward_is_local=not fsdp)
        clock.now += 2.0
        model(x)  # a micro-batch without a collective (no_sync): local, its backward too
        clock.now += 4.0
        clock.now += 2.0
        model(x)  # the step's last micro-batch
        clock.now += 50.0
        timer.step()
        assert timer.window() == pytest.approx(expected), fsdp


def test_without_a_model_or_after_validation_forwards(clock: Clock) -> None:
    bare = StepTimer()
    bare.mark()
    clock.now += 12.0
    bare.step()
    assert bare.window() == pytest.approx(12.0)  # no hooks: from boundary to run.step
    timer, model = _timer(clock)
    model.inner(torch.zeros(1, 2))  # validation with the inner model, between two epochs
    clock.now += 30.0
    timer.mark()  # the epoch's start
    clock.now += 1.0
    model(torch.zeros(1, 2))
    timer.step()
    assert timer.window() == pytest.approx(4.0)


class FakeEvent:
    """A CUDA event: recorded at the fake clock's time; complete once the test says the device got there."""

    device_at = 0.0  # the fake device has run everything recorded up to this time

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float = -1.0
        self.clock: Clock

    def record(self) -> None:
        self.at = self.clock.now

    def query(self) -> bool:
        return self.at <= FakeEvent.device_at

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert end.query(), "read before it completed"
        return 1000.0 * (end.at - self.at)


def test_on_cuda_forward_times_come_from_events_read_once_complete_never_waited_for(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: List[FakeEvent] = []

    def event(enable_timing: bool = False) -> FakeEvent:
        e = FakeEvent(enable_timing)
        e.clock = clock
        made.append(e)
        return e

    monkeypatch.setattr(torch.cuda, "Event", event)
    model = Work(clock, 3.0)
    timer = StepTimer(cuda=True)
    timer.watch(model, model, True)
    timer.mark()
    for _ in range(3):
        clock.now += 1.0
        model(torch.zeros(1, 2))
        timer.step()
        timer.mark()
    FakeEvent.device_at = made[3].at  # the device finished the second step's forward only
    assert timer.window() == pytest.approx(1.0 + 3.0)  # loading (host clock) + the two forwards read
    FakeEvent.device_at = clock.now
    assert timer.window() == pytest.approx(3.0)  # no step since: the third forward, read now
    assert len(made) == 6  # one pair per step until pairs are read back and reused
    clock.now += 1.0
    model(torch.zeros(1, 2))
    timer.step()
    assert len(made) == 6


# ---- no collective per step; the window's exchange ----------------------------------------------------
class TwoRanks(Comm):
    """Rank `rank` of two, in one process: the window's all-reduce adds the other rank's slots (a
    rank whose local time per step is `peer_ms`); every collective is counted."""

    world_size = 2

    def __init__(self, rank: int, peer_ms: float) -> None:
        super().__init__()
        self.rank, self.peer_ms = rank, peer_ms
        self.collectives: List[str] = []

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        self.collectives.append("start_sum")
        peer = torch.zeros_like(tensor)
        # one window per message (steadfast/distributed/exchange.py): its 2 summed numbers, then each rank's [memory, local time]
        mine, theirs = 2 + 2 * self.rank + 1, 2 + 2 * (1 - self.rank) + 1
        peer[theirs] = self.peer_ms / 1000 if tensor[mine] > 0 else 0.0
        return Pending(lambda: tensor + peer)

    def __getattribute__(self, name: str) -> Any:
        if name in ("all_reduce_sum", "any", "max_each", "start_max_each", "gather_object", "broadcast_object", "barrier"):
            self.collectives.append(name)
        return super().__getattribute__(name)


def _steps(t: Telemetry, model: nn.Module, steps: range) -> None:
    for step in steps:
        model(torch.zeros(4, 2))
        t.add_loss(torch.tensor(1.0))
        t.after_step(step, 0)
        t.timer.mark()


def test_timing_each_step_adds_no_collective_and_rides_the_window_all_reduce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "all_gather_object", "send", "recv"):
        monkeypatch.setattr(torch.distributed, name, lambda *a, **k: pytest.fail("a collective in the step timing"))
    counts = []
    for watched in (False, True):
        comm = TwoRanks(0, peer_ms=0.0)
        t = Telemetry(comm, RunRecord(tmp_path, 0), "none", 10.0, 5, time.time(), 0)
        model = nn.Linear(2, 1)
        if watched:
            t.timer.watch(model, model, True)
        _steps(t, model, range(1, 21))
        counts.append(list(comm.collectives))
    assert counts[0] == counts[1] == ["start_sum"] * 4  # one per logging window, timed or not


def _metrics(folder: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _events(folder: Path) -> List[Dict[str, Any]]:
    path = folder / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("rank", [0, 1])
def test_the_slow_rank_writes_its_own_event_and_rank_0_shows_it(tmp_path: Path, rank: int) -> None:
    """Rank 1 is slow (its local time per step, 20 ms, against rank 0's real sub-millisecond one),
    seen from each rank: both name it at the same window; the event is rank 1's, the line rank 0's."""
    folder = tmp_path / f"rank{rank}"
    folder.mkdir()
    comm = TwoRanks(rank, peer_ms=20.0 if rank == 0 else 0.3)
    t = Telemetry(comm, RunRecord(folder, rank), "lines", 0.0, 5, time.time(), 0, straggler_margin=0.25, straggler_windows=3)
    model = nn.Linear(2, 1)
    t.timer.watch(model, model, True)
    if rank == 1:  # its own local time: 20 ms per step, on the real clock
        model.register_forward_pre_hook(lambda m, a: time.sleep(0.02))
    _steps(t, model, range(1, 21))  # windows of steps 5, 10, 15 read at 10, 15, 20: named at 20
    t.close()
    mine = [e for e in _events(folder) if e["event"] == "straggler"]
    if rank == 1:
        (e,) = mine
        assert (e["rank"], e["step"], e["windows"], e["recovered"]) == (1, 15, 3, False) and e["ratio"] > 1.25
        assert e["local_ms"] >= 20 and e["host"] and e["pid"] and e["restart"] == 0
    else:
        assert mine == [] and t.display.slow.startswith("rank 1 (+")
        assert "| slow: rank 1 (+" in t.display.text(20, 0)
        rows = _metrics(folder)
        assert [r["step"] for r in rows] == [5, 10, 15, 20] and all(len(r["local_ms_per_rank"]) == 2 for r in rows)
        # each rank's own slot: the peer's 20 ms as it sent them, rank 0's its own measurement (on the real
        # clock, however long a loaded machine made it)
        assert all(r["local_ms_per_rank"][1] == 20.0 and r["local_ms_per_rank"][0] > 0 for r in rows)


# ---- the report --------------------------------------------------------------------------------------
def test_the_report_names_the_straggler_and_reads_per_rank_times_validated(tmp_path: Path) -> None:
    from steadfast.report import analysis, text
    from steadfast.report.plot import plot_run
    from steadfast.report.records import RunRecords, metric_rows

    events = [
        {"time": 0, "event": "launch"},
        {"time": 1, "event": "attempt_started", "restart": 0},
        {"time": 1.5, "event": "first_step", "restart": 0, "step": 1},
        {
            "time": 3,
            "event": "straggler",
            "host": "node7",
            "pid": 9,
            "restart": 0,
            "rank": 1,
            "ratio": 1.48,
            "local_ms": 22.2,
            "median_ms": 15.0,
            "windows": 3,
            "step": 30,
            "recovered": False,
        },  # fmt: skip
        {
            "time": 4,
            "event": "straggler",
            "host": "node7",
            "pid": 9,
            "restart": 0,
            "rank": 1,
            "ratio": 1.02,
            "local_ms": 15.3,
            "median_ms": 15.0,
            "windows": 3,
            "step": 60,
            "recovered": True,
        },  # fmt: skip
        {"time": 4.5, "event": "straggler", "rank": "one", "ratio": "big", "recovered": "yes"},  # damaged: shown as '-'
        {"time": 5, "event": "training_completed", "restart": 0, "step": 80},
        {"time": 6, "event": "job_completed"},
    ]
    raw = [
        {"time": 1.5 + s / 100, "step": s, "loss": 1.0, "restart": 0, "local_ms_per_rank": [15.0, 22.2 if s < 60 else 15.3]}
        for s in range(10, 81, 10)
    ]
    raw += [{"time": 5.5, "step": 90, "local_ms_per_rank": ["x", 1]}, {"time": 5.6, "step": 91, "local_ms_per_rank": [-1.0]}]
    rows, unusable = metric_rows(raw)
    assert unusable == 0 and rows[0].local_ms_per_rank == (15.0, 22.2) and rows[-2].local_ms_per_rank is None
    assert rows[-1].local_ms_per_rank is None
    report = analysis.analyse(RunRecords(folder=tmp_path, events=events, metrics=rows))
    out = text.format_run(report)
    assert "straggler: rank 1 on node7 slower than the others from step 30" in out and "+48%" in out
    assert "straggler no longer: rank 1 on node7 from step 60" in out
    assert "straggler: rank - slower" in out  # the damaged record: its fields dropped, never trusted
    picture = plot_run(report, tmp_path / "report.png")
    assert picture.stat().st_size > 30_000


# ---- the keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,key",
    [
        ("logger.straggler_margin=-0.1", "logger.straggler_margin"),
        ("logger.straggler_windows=0", "logger.straggler_windows"),
        ("fault.delay_s=0", "fault.delay_s"),
    ],
)
def test_bad_straggler_keys_are_named(override: str, key: str) -> None:
    from helpers import problems

    found = problems("fault=slow_rank", override)
    assert len(found) == 1 and found[0].startswith(f"{key}=") and "is not allowed" in found[0], found


def test_the_slow_rank_preset_composes_and_naming_can_be_turned_off() -> None:
    from helpers import composed, problems

    assert problems("fault=slow_rank", "logger.straggler_margin=null") == []
    assert problems("fault=slow_rank", "logger.straggler_margin=0") == []
    cfg = composed("fault=slow_rank")
    assert (cfg.fault.kind.value, cfg.fault.rank, cfg.fault.delay_s) == ("slow_rank", 1, 0.02)
    assert (cfg.logger.straggler_margin, cfg.logger.straggler_windows) == (0.25, 3)
