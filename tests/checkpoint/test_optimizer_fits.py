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


def _names_by_generator(objects: dict) -> dict:
    """param_names as named_parameters(remove_duplicate=False) gives them: what every manifest records."""
    named: dict = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for key, param in obj.named_parameters(remove_duplicate=False):
                named.setdefault(id(param), f"{name}.{key}")
    return {
        name: [[named.get(id(p)) for p in group["params"]] for group in obj.param_groups]
        for name, obj in objects.items()
        if isinstance(obj, torch.optim.Optimizer) and any(id(p) in named for g in obj.param_groups for p in g["params"])
    }


def test_a_managers_parameter_names_follow_every_change_of_its_modules() -> None:
    """The names a manager records (kept between saves while the modules' tables are as they were) are
    at every save those named_parameters gives: a shared parameter by its first name, a parameter
    replaced, moved, removed or set to None, a module replaced, a class that lists its own."""
    from steadfast.checkpoint.optimizers import ParamNames

    torch.manual_seed(0)
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Sequential(torch.nn.Linear(2, 3)))
    other = torch.nn.Linear(3, 3)
    extra = torch.nn.Parameter(torch.zeros(1))

    class Renamed(torch.nn.Linear):
        def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return ((f"own_{k}", p) for k, p in super().named_parameters(*args, **kwargs))

    def changes():  # type: ignore[no-untyped-def]
        yield "as built"
        yield "nothing changed"
        model[3][0].weight = torch.nn.Parameter(torch.ones(3, 2))  # replaced
        yield "a parameter replaced"
        model[3][0].bias = None
        yield "a parameter set to None"
        other.moved = model[3][0].weight  # also under another module
        yield "a parameter under a second module"
        model[3] = torch.nn.Linear(2, 3)
        yield "a module replaced"
        del other.moved
        yield "a parameter removed"
        model[1] = Renamed(2, 2)
        yield "a module listing its parameters its own way"

    names = ParamNames()
    for what in changes():
        params = list({id(p): p for m in (model, other) for p in m.parameters()}.values())
        objects = {"model": model, "other": other, "opt": torch.optim.SGD([{"params": params}, {"params": [extra]}], lr=0.1)}
        assert param_names_of(names, objects) == _names_by_generator(objects), what


def param_names_of(names, objects):  # type: ignore[no-untyped-def]
    from steadfast.checkpoint import manifest as mf

    return names.fields(objects).get(mf.PARAMS, {})


def test_a_managers_parameter_names_follow_a_class_that_lists_its_parameters_its_own_way_later() -> None:
    """Names kept from a save are not reused once a module's class lists its parameters its own way
    (the modules and their tables unchanged: only the class)."""
    from steadfast.checkpoint.optimizers import ParamNames

    class Later(torch.nn.Linear):
        pass

    model = Later(2, 2)
    objects = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    names = ParamNames()
    assert param_names_of(names, objects) == _names_by_generator(objects)
    Later.named_parameters = lambda self, *a, **k: (  # type: ignore[method-assign,assignment]
        (f"own_{key}", p) for key, p in torch.nn.Linear.named_parameters(self, *a, **k)
    )
    assert param_names_of(names, objects) == _names_by_generator(objects)
