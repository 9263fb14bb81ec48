"""The fit check of an optimizer's state against the live parameters (restore.optimizer_misfit), and
through a real replicated save and load (check_fits): an optimizer over the same parameters in
another order, whose fresh empty state let the old check pass and whose first step() then raised."""

from __future__ import annotations

from pathlib import Path

import torch

from steadfast.checkpoint.restore import check_fits, optimizer_misfit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _stepped(params: list) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    return opt


def test_same_order_fits() -> None:
    model = _model()
    saved = _stepped(list(model.parameters())).state_dict()
    assert optimizer_misfit(torch.optim.Adam(list(_model().parameters())), saved) is None


def test_reordered_parameters_do_not_fit_and_would_fail_at_step() -> None:
    model = _model()
    saved = _stepped(list(model.parameters())).state_dict()
    live = _model()
    reordered = torch.optim.Adam(list(reversed(list(live.parameters()))), lr=0.1)
    problem = optimizer_misfit(reordered, saved)
    assert problem is not None and "exp_avg" in problem and "param_groups[0].params[0]" in problem
    # what the check prevents: loading passes, the first step raises
    reordered.load_state_dict(saved)
    sum(p.sum() for p in live.parameters()).backward()
    try:
        reordered.step()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the reordered optimizer stepped; the test no longer shows the failure")


def test_group_and_count_mismatch() -> None:
    model = _model()
    params = list(model.parameters())
    saved = _stepped(params).state_dict()
    two = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    assert "param_groups: 1 in the checkpoint, 2 here" in str(optimizer_misfit(two, saved))
    fewer = torch.optim.Adam(params[:3])
    assert "4 parameters in the checkpoint, 3 here" in str(optimizer_misfit(fewer, saved))
    assert optimizer_misfit(fewer, {"state": []}) is not None
    assert optimizer_misfit(fewer, "x") is not None


def test_check_fits_names_the_object(tmp_path: Path) -> None:
    from steadfast.checkpoint.codec import Loaded

    model = _model()
    saved = _stepped(list(model.parameters())).state_dict()
    live = _model()
    reordered = torch.optim.Adam(list(reversed(list(live.parameters()))))
    try:
        check_fits(Loaded({"optimizer": saved}, None, 1), {"optimizer": reordered}, {})
    except ValueError as exc:
        assert str(exc).startswith("does not fit this run's optimizer: optimizer.state.")
    else:
        raise AssertionError("a reordered optimizer's state was found to fit")
