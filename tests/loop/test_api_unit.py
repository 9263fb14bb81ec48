"""The own-loop API's pieces, without processes: cadence, the stop agreement, the sampler's position
after a resume at any point, the loader's batches, and what a checkpoint collects."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from steadfast.checkpoint.state import PerRank, Progress, RNGState, is_per_rank, unwrap
from steadfast.contract import stop
from steadfast.distributed.comm import Comm
from steadfast.distributed.exchange import Exchange
from steadfast.loop.agreement import StopAgreement
from steadfast.loop.cadence import FLOOR_S, FLOOR_SAVES, Cadence, young_daly
from steadfast.loop.data import ResumableSampler, TensorBatches, make_loader


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- cadence ----------------------------------------------------------------------------------------
def test_step_and_epoch_cadence() -> None:
    c = Cadence(every_n_epochs=2, every_n_steps=5, every_n_seconds=None)
    assert [s for s in range(1, 16) if c.step_due(s)] == [5, 10, 15]
    assert [e for e in range(1, 7) if c.epoch_due(e)] == [2, 4, 6]
    assert not c.timed and not c.time_due()
    assert not Cadence(None, None, 30).step_due(30) and not Cadence(None, None, 30).epoch_due(1)


def test_time_cadence_counts_from_the_last_save() -> None:
    clock = Clock()
    c = Cadence(None, None, 30, clock=clock)
    clock.now += 29.9
    assert not c.time_due()
    clock.now += 0.1
    assert c.time_due()
    c.saved(0.5)
    assert not c.time_due()
    clock.now += 30
    assert c.time_due()


def test_auto_interval_is_young_daly_with_floors_and_is_recorded() -> None:
    assert young_daly(2.0, 3600.0) == pytest.approx((2 * 2.0 * 3600.0) ** 0.5)
    assert young_daly(0.001, 10.0) == FLOOR_S  # cheap saves, frequent failures: never below the floor
    assert young_daly(10.0, 20.0) == FLOOR_SAVES * 10.0  # never more than 1/20 of the time saving
    clock, seen = Clock(), []
    c = Cadence(None, None, "auto", run_seconds=3000.0, failures=2, clock=clock, on_interval=lambda **f: seen.append(f))
    assert c.timed
    clock.now += 600
    c.saved(1.0)  # mtbf = (3000 + 600) / 3
    assert c.seconds == pytest.approx((2 * 1.0 * 1200.0) ** 0.5)
    assert seen and seen[-1]["how"] == "young_daly" and seen[-1]["mtbf_seconds"] == pytest.approx(1200.0)
    seen.clear()
    c.saved(1.0)  # the same interval again: not recorded twice
    assert not seen


def test_auto_saves_first_after_the_floor_until_a_save_is_measured() -> None:
    # no save measured yet and failures every ~8 s: the first save comes after the floor, before the
    # next failure (an assumed cost of 1 s gave 20 s, and such a run never committed anything)
    assert Cadence(None, None, "auto", run_seconds=30.0, failures=3).seconds == FLOOR_S
    # the newest save's cost from the run's events (an earlier attempt's): Young/Daly from the start
    known = Cadence(None, None, "auto", run_seconds=3000.0, failures=2, save_cost=2.0, clock=Clock())
    assert known.seconds == pytest.approx(young_daly(2.0, 1000.0))


# ---- the stop agreement -----------------------------------------------------------------------------
@pytest.fixture
def clean_stop():
    stop.clear_stop()
    yield
    stop.clear_stop()


def test_a_stop_is_acted_on_at_the_check_after_the_one_that_carried_it(clean_stop: None) -> None:
    agreement = StopAgreement(Exchange(Comm(), every_n_steps=1))
    assert agreement.at_step(1).stop is None
    stop.request_stop(signal.SIGTERM)
    assert agreement.at_step(2).stop is None  # started now (pipelined), read at the next check
    assert agreement.at_step(3).stop == signal.SIGTERM


def test_checks_only_every_n_steps_and_now_waits(clean_stop: None) -> None:
    agreement = StopAgreement(Exchange(Comm(), every_n_steps=4))
    stop.request_stop(signal.SIGINT)
    seen = [(s, agreement.at_step(s).stop) for s in range(1, 13)]
    assert [s for s, got in seen if got] == [8, 12]  # started at 4, read at 8
    assert agreement.now(12) == signal.SIGINT


def test_a_timed_save_is_agreed_once(clean_stop: None) -> None:
    agreement = StopAgreement(Exchange(Comm(), every_n_steps=1))
    due = iter([True, False, False])  # rank 0's clock at the steps it is asked: 1, 3, 4
    asked: List[bool] = []

    def rank0_clock() -> bool:
        value = next(due)
        asked.append(value)
        return value

    controls = [agreement.at_step(s, rank0_clock) for s in range(1, 5)]
    assert [c.save_due for c in controls] == [False, True, False, False]
    assert len(asked) == 3  # not asked at the step that saves: its save resets the clock


# ---- data ------------------------------------------------------------------------------------------
def _read(samplers: List[ResumableSampler], steps: int, batch: int) -> List[int]:
    out: List[int] = []
    iters = [iter(s) for s in samplers]
    for _ in range(steps):
        for it in iters:
            out += list(itertools.islice(it, batch))
    return out


@pytest.mark.parametrize("total,world,batch", [(103, 1, 4), (103, 2, 4), (64, 4, 3), (50, 3, 5)])
def test_a_resume_at_any_step_reads_the_rest_of_the_epoch_exactly(total: int, world: int, batch: int) -> None:
    progress = Progress()
    whole = [list(ResumableSampler(total, world, r, seed=7, batch_size=batch, progress=progress)) for r in range(world)]
    steps = -(-len(whole[0]) // batch)
    for done in range(steps + 1):
        progress.sample_in_epoch = done * batch * world
        resumed = [list(ResumableSampler(total, world, r, seed=7, batch_size=batch, progress=progress)) for r in range(world)]
        assert resumed == [w[done * batch :] for w in whole], done


def test_the_sampler_follows_the_runs_progress_and_shuffles_per_epoch() -> None:
    progress = Progress()
    s = ResumableSampler(20, 1, 0, seed=1, batch_size=4, progress=progress)
    first = list(s)
    progress.epoch = 1
    second = list(s)
    assert sorted(first) == sorted(second) == list(range(20)) and first != second
    assert list(ResumableSampler(20, 1, 0, shuffle=False, progress=Progress())) == list(range(20))


def test_tensor_batches_are_the_dataloaders_batches() -> None:
    x, y = torch.randn(37, 3), torch.arange(37)
    sampler = ResumableSampler(37, 2, 1, seed=3, batch_size=5, progress=Progress())
    ours = list(TensorBatches((x, y), sampler, 5))
    theirs = list(DataLoader(TensorDataset(x, y), batch_size=5, sampler=sampler))
    assert len(ours) == len(theirs) == 4
    for (a, b), (c, d) in zip(ours, theirs):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert isinstance(make_loader(TensorDataset(x, y), 5, sampler), TensorBatches)
    assert isinstance(make_loader(TensorDataset(x, y), 5, sampler, num_workers=1), DataLoader)


# ---- what a checkpoint collects ---------------------------------------------------------------------
def test_per_rank_objects_and_unwrapping() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(4)), batch_size=2)
    assert is_per_rank(loader) and is_per_rank(PerRank(Progress())) and not is_per_rank(Progress())
    model = torch.nn.Linear(2, 2)
    assert unwrap(model) is model


def test_rng_state_round_trips_every_generator() -> None:
    import random

    import numpy as np

    state = RNGState().state_dict()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    RNGState().load_state_dict(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]


@pytest.mark.parametrize(
    "state,key",
    [
        ({"global_step": "abc"}, "global_step"),
        ({"epoch": -5}, "epoch"),
        ({"batch_in_epoch": True}, "batch_in_epoch"),
        ({"sample_in_epoch": 1.5}, "sample_in_epoch"),
        ({"global_step": 2**62}, "global_step"),
        ({"first_world_size": 0}, "first_world_size"),
        ({"first_world_size": "2"}, "first_world_size"),
        ({"state_dict": 1}, "state_dict"),  # an unknown key: it replaced the method
        ({"epoch": 3, "extra": 1}, "extra"),
    ],
)
def test_progress_refuses_a_wrong_value_by_name_and_sets_nothing(state: Dict[str, Any], key: str) -> None:
    progress = Progress(epoch=1, batch_in_epoch=2, sample_in_epoch=3, global_step=4, first_world_size=2)
    with pytest.raises(ValueError, match=key):
        progress.load_state_dict(state)
    assert progress == Progress(epoch=1, batch_in_epoch=2, sample_in_epoch=3, global_step=4, first_world_size=2)
    assert callable(progress.state_dict)
    with pytest.raises(ValueError, match="must be a dict"):
        progress.load_state_dict([("epoch", 1)])  # type: ignore[arg-type]
    progress.load_state_dict({"epoch": 7, "global_step": 70})  # an older checkpoint's keys: the others keep their values
    assert progress == Progress(epoch=7, batch_in_epoch=2, sample_in_epoch=3, global_step=70, first_world_size=2)


def _short_torch(state: Dict[str, Any]) -> None:
    state["torch"] = state["torch"][:100]


def _wrong_numpy(state: Dict[str, Any]) -> None:
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, keys[:10], pos, has_gauss, cached)


def _wrong_python(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    state["python"] = (version, internal[:-1] + (10**6,), gauss)  # an index past the end


@pytest.mark.parametrize(
    "damage,key",
    [
        (_short_torch, "torch"),
        (_wrong_numpy, "numpy"),
        (_wrong_python, "python"),
        (lambda s: s.pop("cuda"), "cuda"),
        (lambda s: s.update(cuda=7), "cuda"),
    ],
)
def test_an_rng_state_that_does_not_fit_is_refused_before_any_generator_is_set(damage: Any, key: str) -> None:
    import random

    import numpy as np

    from steadfast.checkpoint.state import seed_everything

    seed_everything(1)
    saved = RNGState().state_dict()  # valid everywhere but in the damaged part
    damage(saved)
    seed_everything(2)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    seed_everything(2)
    with pytest.raises(ValueError, match=key):
        RNGState().load_state_dict(saved)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]


def test_the_checkpointer_refuses_reserved_names_and_objects_without_state(tmp_path: Path) -> None:
    from helpers import checkpointer

    ckpt = checkpointer(tmp_path / "ckpt", tmp_path)
    with pytest.raises(ValueError, match="reserved"):
        ckpt.track(Progress(), {"progress": Progress()})
    with pytest.raises(TypeError, match="state_dict"):
        ckpt.track(Progress(), {"thing": object()})
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader: Any = StatefulDataLoader(TensorDataset(torch.zeros(4)), batch_size=2)
    ckpt.track(Progress(), {"model": torch.nn.Linear(2, 2), "loader": loader})
    assert set(ckpt.objects) == {"model", "progress"} and set(ckpt.per_rank) == {"rng", "loader"}


def test_a_rank_waits_for_rank_0s_store_to_listen_and_never_past_its_deadline() -> None:
    import socket
    import threading
    import time

    from steadfast.distributed.comm import await_store

    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))  # bound, not listening yet: connections are refused, as before rank 0 starts
        port = str(store.getsockname()[1])
        waiter = threading.Thread(target=await_store, args=("127.0.0.1", port, 120.0), daemon=True)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "returned while nothing listened"
        store.listen()
        waiter.join(30)
        assert not waiter.is_alive(), "still waiting although the store listens"
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        free = str(unused.getsockname()[1])
    began = time.monotonic()
    await_store("127.0.0.1", free, 0.3)  # nothing ever listens: gives up at its deadline (init_process_group waits on)
    assert 0.3 <= time.monotonic() - began < 30, "waited until its deadline, then returned"
    await_store(None, None, 120.0)  # no store address (a launch without one): nothing to wait for
