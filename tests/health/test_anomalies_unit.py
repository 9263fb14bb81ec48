"""The parts of issue 36 that need no workers: the watch's rule (on the host and on the device's path),
the agreement on what the ranks saw, the data a rollback skips, the snapshots the guard keeps, the
refusal of a non-finite state, the replicas' fingerprint, the pre-flight's words."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from omegaconf import OmegaConf

from steadfast.checkpoint import memory as mem
from steadfast.checkpoint.codec import Loaded
from steadfast.checkpoint.finite import nonfinite
from steadfast.checkpoint.restore import check_fits
from steadfast.checkpoint.state import Progress
from steadfast.config import AnomalyConf
from steadfast.contract import shm
from steadfast.faults import flip_bit
from steadfast.health import replicas
from steadfast.health.guard import Guard
from steadfast.health.watch import BLOCK, Watch
from steadfast.loop.data import ResumableSampler, dropped

CONF = AnomalyConf(warmup_steps=20, ema_steps=10, spike_zscore=6.0, spike_ratio=2.0)  # anomaly=spikes, shorter


def watched(
    losses: List[float], later: bool = False, conf: AnomalyConf = CONF
) -> Tuple[Watch, List[Optional[Tuple[int, int, float]]]]:
    w = Watch(conf, judge_later=later)
    verdicts = []
    for step, x in enumerate(losses, start=1):
        w.observe(step, torch.tensor(x))
        got = w.verdict(step, at_once=True)
        verdicts.append(got[1] if got else None)
    return w, verdicts


def noisy(n: int, seed: int = 0) -> List[float]:
    rng = random.Random(seed)
    return [1.0 + 0.05 * rng.random() for _ in range(n)]


# ---- the watch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("later", [False, True], ids=["host", "device-path"])
def test_a_nan_loss_is_named_at_its_step_and_a_spike_only_after_the_warm_up(later: bool) -> None:
    _, early = watched([*noisy(10), 50.0], later)
    assert early[-1] == (0, 0, 0.0)  # 10 healthy losses < warmup_steps: no spike yet
    w, seen = watched([*noisy(BLOCK), 50.0, *noisy(5)], later)  # the first block's losses in the average
    assert seen[-1] is not None and seen[-1][:2] == (BLOCK + 1, 2) and seen[-1][2] == pytest.approx(50.0)
    _, nan = watched([*noisy(5), math.nan, *noisy(3)], later)
    assert nan[-1] is not None and nan[-1][:2] == (6, 1) and math.isnan(nan[-1][2])
    _, inf = watched([*noisy(5), math.inf], later)
    assert inf[-1] is not None and inf[-1][:2] == (6, 1)


def test_a_spike_needs_both_tests_and_never_enters_the_average() -> None:
    calm = noisy(2 * BLOCK)
    # 1.3 is many standard deviations above ~1.025 but not twice it: not a spike with spike_ratio=2
    assert watched([*calm, 1.3], conf=CONF)[1][-1] == (0, 0, 0.0)
    only_z = AnomalyConf(warmup_steps=20, ema_steps=10, spike_zscore=6.0)
    assert watched([*calm, 1.3], conf=only_z)[1][-1][:2] == (2 * BLOCK + 1, 2)  # type: ignore[index]
    none = AnomalyConf()  # the default: no spike rule
    assert watched([*calm, 1e9], conf=none)[1][-1] == (0, 0, 0.0)
    spiked, clean = Watch(CONF), Watch(CONF)
    at = BLOCK + 1  # blocks of steps 0-63, 64-127, ...: the second block's second step
    for step, x in enumerate([*calm[: at - 1], 1e6, *calm[at - 1 :]], start=1):
        spiked.observe(step, x)
        clean.observe(step, None if step == at else x)  # the same steps, that one without a loss
    last = 2 * BLOCK + 1
    assert spiked.verdict(last, True) == (last, (at, 2, 1e6))
    assert spiked.state_dict()["moments"].tolist() == clean.state_dict()["moments"].tolist()
    assert spiked.seen == clean.seen == 2 * BLOCK - 2  # steps 1-127 ended their blocks, the spike left out


def test_the_device_path_judges_as_the_host_and_both_resume_as_uninterrupted() -> None:
    losses = [*noisy(2 * BLOCK, seed=3), 9.0, *noisy(10, seed=4), math.nan, *noisy(7, seed=5)]
    host, host_seen = watched(losses)
    device, device_seen = watched(losses, later=True)
    assert [v[:2] if v else None for v in host_seen] == [v[:2] if v else None for v in device_seen]
    assert host.state_dict()["moments"].tolist() == pytest.approx(device.state_dict()["moments"].tolist())
    # stopped at any step and resumed from its state: the same verdicts as never stopped
    for at in (7, BLOCK, BLOCK + 3, 2 * BLOCK + 1):
        first, _ = watched(losses[:at])
        resumed = Watch(CONF)
        resumed.load_state_dict(first.state_dict())
        for step, x in enumerate(losses[at:], start=at + 1):
            resumed.observe(step, torch.tensor(x))
        assert resumed.verdict(len(losses), True) == host.verdict(len(losses), True), at
        assert resumed.state_dict()["moments"].tolist() == pytest.approx(host.state_dict()["moments"].tolist()), at


def test_the_watchs_state_keeps_its_shape_from_step_to_step_and_an_older_one_still_loads() -> None:
    """The block's buffered losses are padded to a whole block, so a snapshot's layout is reused
    between snapshots (checkpoint/reuse.py: a tensor of another shape plans the file anew); a state
    saved before, unpadded, resumes the same."""
    losses = noisy(BLOCK + 40)
    w, shapes = Watch(CONF), set()
    for step, x in enumerate(losses[: BLOCK - 1], start=1):
        w.observe(step, torch.tensor(x))
        shapes.add(tuple(w.state_dict()["values"].shape))
    assert shapes == {(BLOCK,)}
    at = BLOCK + 10
    first, _ = watched(losses[:at])
    state = first.state_dict()
    older = {k: v for k, v in state.items() if k != "count"}  # as saved before the padding
    older["values"] = state["values"][: state["count"]]
    assert len(older["values"]) == at - BLOCK + 1  # steps BLOCK..at: the block under way
    verdicts, moments = [], []
    for saved in (state, older):
        resumed = Watch(CONF)
        resumed.load_state_dict(saved)
        for step, x in enumerate(losses[at:], start=at + 1):
            resumed.observe(step, torch.tensor(x))
        verdicts.append(resumed.verdict(len(losses), True))
        moments.append(resumed.state_dict()["moments"].tolist())
    uninterrupted, _ = watched(losses)
    assert verdicts[0] == verdicts[1] == uninterrupted.verdict(len(losses), True)
    assert moments[0] == moments[1] == pytest.approx(uninterrupted.state_dict()["moments"].tolist())


@pytest.mark.parametrize("checks_nonfinite", [True, False])
def test_a_float_loss_is_judged_as_a_cpu_tensor_s(checks_nonfinite: bool) -> None:
    """The step boundary reads a CPU loss once and hands the watch a float (its path without the loop):
    the same verdicts and the same state as the same losses given as tensors, non-finite ones included,
    with the non-finite check on or off."""
    conf = AnomalyConf(warmup_steps=20, ema_steps=10, spike_zscore=6.0, spike_ratio=2.0, nonfinite=checks_nonfinite)
    losses = noisy(150)
    losses[40], losses[90], losses[100], losses[130] = 30.0, math.nan, math.inf, 25.0
    tensors, floats = Watch(conf), Watch(conf)
    for step, x in enumerate(losses, start=1):
        tensors.observe(step, torch.tensor(x, dtype=torch.float64))
        floats.observe(step, x)
        # a float is judged when something asks (a verdict, the block's end), as it would have been at its step
        assert str(floats.verdict(step, True)) == str(tensors.verdict(step, True)), step  # nan != nan
        assert floats.values == tensors.values, step
        if step % 45 == 0:  # a rollback past the first bad step: judging goes on from there
            tensors.first = floats.first = (0, 0, 0.0)
    assert str(floats.state_dict()) == str(tensors.state_dict())


def test_float_losses_are_judged_together_against_the_blocks_reference() -> None:
    """The per-step path only keeps a float loss; the steps not yet judged are judged in one pass when
    a verdict or the block's end asks (the reference computed once), with the verdicts and state of
    judging each at its step (test_a_float_loss_is_judged_as_a_cpu_tensor_s)."""
    w, references = Watch(CONF), []
    real = Watch._reference

    def reference(self: Watch) -> Any:
        references.append(self.block)
        return real(self)

    losses = [*noisy(BLOCK + 20), 50.0, *noisy(5)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Watch, "_reference", reference)
        for step, x in enumerate(losses, start=1):
            w.observe(step, x)
        assert references == [0]  # the first block's end (steps 1-63): one reference for its steps
        at = BLOCK + 21
        assert w.verdict(len(losses), False) == (len(losses), (at, 2, 50.0))
        assert references == [0, 1]  # the second block's steps so far, at once
    eager = Watch(CONF)  # asked at every step: each judged at its own
    for step, x in enumerate(losses, start=1):
        eager.observe(step, x)
        eager.verdict(step, False)
    assert eager.verdict(len(losses), False) == w.verdict(len(losses), False)
    assert str(eager.state_dict()) == str(w.state_dict())


def test_a_non_finite_gradient_norm_is_its_own_kind() -> None:
    w = Watch(CONF)
    w.observe(1, 1.0, grad_norm=torch.tensor(3.0))
    w.observe(2, 1.0, grad_norm=torch.tensor(math.inf))
    assert w.verdict(2, True) == (2, (2, 3, math.inf))


# ---- the agreement --------------------------------------------------------------------------------


class _Exchange:
    """The parts of Exchange the guard uses, with no ranks behind it."""

    step = 0

    def ride(self, rider: object) -> None:
        pass


def test_the_ranks_agree_on_the_first_step_any_of_them_saw_and_on_what_is_healthy() -> None:
    guard = Guard(Watch(CONF), _Exchange(), Progress(), None, 0)  # type: ignore[arg-type]
    guard._verdicts(10, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert guard.healthy_through == 10 and guard.found is None
    guard._verdicts(20, [[17.0, 2.0, 40.0], [0.0, 0.0, 0.0], [15.0, 1.0, math.nan]])
    found = guard.take()
    assert found is not None and (found.step, found.rank, found.kind, found.ranks, found.healthy) == (
        15,
        2,
        "nonfinite_loss",
        (0, 2),
        14,
    )
    assert guard.healthy_through == 14 and guard.take() is None
    assert guard.protect() == (14, 0)


def test_replicas_a_majority_names_the_odd_rank_two_ranks_name_both() -> None:
    guard = Guard(Watch(CONF), _Exchange(), Progress(), lambda: [], 4)  # type: ignore[arg-type]
    guard._prints(8, [5.0, 5.0, 5.0])
    assert guard.replicas_agree_at == 8 and guard.found is None
    guard._prints(12, [5.0, 7.0, 5.0])
    healed = guard.take()
    assert healed is not None and healed.divergence and healed.majority and healed.ranks == (1,) and healed.healthy == 8
    guard._prints(16, [5.0, 7.0])
    tie = guard.take()
    assert tie is not None and not tie.majority and tie.ranks == (0, 1)


def test_any_flipped_bit_of_any_tensor_changes_the_fingerprint() -> None:
    torch.manual_seed(0)
    params = [("a", torch.randn(5)), ("b", torch.randn(3, 2, dtype=torch.float64)), ("c", torch.randn(4).bfloat16())]
    before = replicas.fold(int(replicas.combined(replicas.sums(params))))
    assert before == float(int(before)) and 0 <= before < 2**52
    for _, t in params:
        for bit in range(8 * t.element_size()):
            copy = [(n, p.clone()) for n, p in params]
            target = next(p for n, p in copy if p.shape == t.shape and p.dtype == t.dtype)
            flip_bit(target, bit)
            assert replicas.fold(int(replicas.combined(replicas.sums(copy)))) != before, (t.dtype, bit)


def test_flip_bit_flips_one_bit_and_the_same_flip_undoes_it() -> None:
    p = torch.ones(3)
    flip_bit(p, 12)
    assert p[0].item() != 1.0 and p[1:].tolist() == [1.0, 1.0]
    flip_bit(p, 12)
    assert p.tolist() == [1.0, 1.0, 1.0]
    flip_bit(p, 31)
    assert p[0].item() == -1.0


# ---- the data a rollback skips ----------------------------------------------------------------


def test_a_skipped_range_leaves_the_epochs_order_for_every_rank_and_a_resume() -> None:
    p = Progress()
    whole = [ResumableSampler(64, 2, r, seed=3, batch_size=4, progress=p).order().tolist() for r in (0, 1)]
    everything = ResumableSampler(64, 2, 0, seed=3, batch_size=4, progress=p).epoch_order(0).tolist()
    p.skipped = [[0, 16, 8, 2, 1], [0, 16, 8, 2, 1], [1, 0, 8, 0, 1]]  # twice the same place: the next 8 go too
    order = ResumableSampler(64, 2, 0, seed=3, batch_size=4, progress=p).epoch_order(0).tolist()
    assert order == everything[:16] + everything[32:]
    ranks = [ResumableSampler(64, 2, r, seed=3, batch_size=4, progress=p) for r in (0, 1)]
    assert [len(s) for s in ranks] == [24, 24] and ranks[0].batches_left == 6
    p.sample_in_epoch = 20  # resumed after 20 samples of what is left
    rest = [s.order().tolist() for s in ranks]
    assert sorted(rest[0] + rest[1]) == sorted(order[20:]) and whole[0][0] == everything[0]


def test_a_foreign_loaders_batches_left_out_are_counted_after_the_earlier_skips() -> None:
    assert dropped([[0, 0, 0, 2, 2], [0, 0, 0, 2, 1]], 0) == {2, 3, 4}
    assert dropped([[0, 0, 0, 2, 2], [1, 0, 0, 0, 1]], 1) == {0}
    assert dropped([[0, 0, 0, 3, 1], [0, 0, 0, 1, 1]], 0) == {1, 3}


def test_progress_refuses_a_skip_list_that_is_not_one() -> None:
    p = Progress()
    p.load_state_dict({"skipped": [[1, 2, 3, 4, 5]], "rollbacks": [7], "diverged": [1]})
    assert p.skipped == [[1, 2, 3, 4, 5]]
    for bad in ({"skipped": [[1, 2]]}, {"skipped": [[1, 2, 3, 4, -5]]}, {"rollbacks": ["7"]}, {"diverged": 3}):
        with pytest.raises(ValueError, match="progress"):
            p.load_state_dict(bad)


# ---- the snapshots the guard keeps ------------------------------------------------------------


def test_a_snapshot_known_healthy_and_one_being_agreed_are_kept_beside_the_double_buffer(launch: shm.LaunchFolder) -> None:
    memory = mem.MemorySnapshots(shm.Segments(launch.name), rank=0, local_rank=0, world_size=1, copies=4)

    class Obj:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def state_dict(self) -> Dict[str, torch.Tensor]:
            return {"w": self.t}

    healthy, posted = 0, 0
    for step in range(1, 40):
        before = memory.steps()
        torn = step % 7 == 0  # a death in the middle of this copy: the snapshots before it are all there
        obj = Obj(torch.full((4,), float(step)))

        def halfway(torn: bool = torn) -> None:
            if torn:
                raise KeyboardInterrupt

        try:
            memory.take(step, memory.plan({"m": obj}, {"r": Obj(torch.zeros(1))}), halfway, protect=(healthy, posted))
        except KeyboardInterrupt:
            kept = memory.steps()
            assert before and before[0] in kept and (healthy == 0 or healthy in kept), (step, before, kept)
            continue
        if step % 5 == 0:  # a send covers the steps to here; its answer comes at the next one
            healthy, posted = posted, step
        kept = memory.steps()
        assert step in kept and (healthy == 0 or healthy in kept) and (posted in kept or posted == 0), (step, kept)
    memory.keep(2)
    assert all(len(b.slots) == 2 for b in memory.buffers.values())


# ---- a poisoned state is never committed ------------------------------------------------------


def test_non_finite_parameters_or_optimizer_state_are_found_but_a_buffers_infinity_is_not() -> None:
    model = torch.nn.Linear(3, 2)
    model.register_buffer("mask", torch.tensor([-math.inf, 0.0]))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert nonfinite({"model": model, "optimizer": opt}) is None
    with torch.no_grad():
        model.bias[1] = math.nan
    assert nonfinite({"model": model, "optimizer": opt}) == "model.bias"
    with torch.no_grad():
        model.bias[1] = 0.0
    opt.state[model.weight]["exp_avg_sq"][0, 0] = math.inf
    assert nonfinite({"model": model, "optimizer": opt}) == "optimizer.state.0.exp_avg_sq"


def test_a_checkpoint_read_back_with_a_nan_parameter_is_unusable() -> None:
    model = torch.nn.Linear(3, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved["weight"][0, 1] = math.nan
    with pytest.raises(ValueError, match="model.weight holds a NaN"):
        check_fits(Loaded({"model": saved}, {}, 1), {"model": model}, {})
    check_fits(Loaded({"model": model.state_dict()}, {}, 1), {"model": model}, {})


# ---- what a person gets wrong, before any worker starts ---------------------------------------


def test_bad_anomaly_keys_are_named_before_any_worker_starts(tmp_path: Path) -> None:
    from steadfast.config import settings_from
    from steadfast.preflight import _anomaly_problems

    s = settings_from({"anomaly": {"spike_ratio": 1.0, "max_rollbacks": -1, "ema_steps": 0, "spike_zscore": -2}})
    said = "\n".join(_anomaly_problems(s))
    for key in ("anomaly.spike_ratio", "anomaly.max_rollbacks", "anomaly.ema_steps", "anomaly.spike_zscore"):
        assert key in said, said
    assert not _anomaly_problems(settings_from(OmegaConf.create({"anomaly": {"skip": "window"}})))
    with pytest.raises(ValueError, match="everything.*batch, window"):
        settings_from({"anomaly": {"skip": "everything"}})


def test_the_learning_rate_is_scaled_inside_the_optimizers_step_only() -> None:
    from steadfast.health.recovery import Recovery

    progress = Progress(rollbacks=[5])
    conf = AnomalyConf(lr_scale=0.5, lr_scale_steps=2)
    recovery = Recovery.__new__(Recovery)  # only the learning rate's part: no ranks, no checkpoints
    recovery.conf, recovery.progress, recovery._lrs = conf, progress, []
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    recovery.watch_optimizer(opt)
    moved = []
    for step in range(3, 9):  # the step about to run is global_step + 1
        progress.global_step = step - 1
        before = p.item()
        p.grad = torch.ones(1)
        opt.step()
        moved.append(round(before - p.item(), 6))
        assert opt.param_groups[0]["lr"] == 0.1
    assert moved == [0.1, 0.1, 0.05, 0.05, 0.1, 0.1]  # steps 5 and 6 (the anomaly's and the next) at half
