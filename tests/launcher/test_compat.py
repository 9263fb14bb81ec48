"""Every patch of a third-party internal (hydra_plugins.steadfast_launcher._compat): one test each that
fails when the installed version leaves the range the patch was written for or the internal it
touches changes shape, and the gate itself (a patch that does not apply is skipped whole, with a
warning, never half-applied)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List

import pytest

from hydra_plugins.steadfast_launcher import _compat
from hydra_plugins.steadfast_launcher._compat import Patch, elastic_worker, forkserver, hydra_compositions, torch_logging


def _holds(patch: Patch) -> None:
    problem = patch.problem()
    assert problem is None, (
        f"the patch '{patch.name}' no longer fits ({problem}): read what it does in "
        "hydra_plugins/steadfast_launcher/_compat/, check the new version's internal and widen its range or rewrite it"
    )


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gate checked afresh (the process caches what it found)."""
    monkeypatch.setattr(_compat, "_checked", {})


def test_the_gate_refuses_another_version_and_a_changed_internal(unchecked: None, caplog: pytest.LogCaptureFixture) -> None:
    fits = Patch("a test patch", "hydra-core", ">=1.3,<1.4", lambda: None, "nothing")
    assert fits.problem() is None and _compat.applies(fits)
    older = dataclasses.replace(fits, name="another version", versions="<1.0")
    assert "written for hydra-core<1.0, installed 1.3" in str(older.problem())
    changed = dataclasses.replace(fits, name="a changed internal", shape=lambda: "f takes no g")
    gone = dataclasses.replace(fits, name="a missing internal", shape=lambda: [].pop())
    assert changed.problem() == "f takes no g" and str(gone.problem()).startswith("IndexError")
    absent = dataclasses.replace(fits, name="an absent package", package="no-such-distribution")
    assert absent.problem() == "no-such-distribution is not installed"
    caplog.set_level(logging.WARNING)
    assert not _compat.applies(changed) and not _compat.applies(changed)
    assert [r.getMessage() for r in caplog.records].count(
        "steadfast: skipped the patch 'a changed internal' (f takes no g); without it nothing"
    ) == 1


# ---- Horovod's runner ------------------------------------------------------------------------------


@pytest.fixture
def runner() -> Any:
    pytest.importorskip("horovod", reason="Horovod is not installed: bash scripts/install_horovod.sh $(which python)")
    from hydra_plugins.steadfast_launcher._compat import horovod_runner

    return horovod_runner


@pytest.mark.parametrize("name", ["SHUTDOWN", "WORKER_TUNING", "GLOO_CHECK", "RESULT_STORE", "EXIT_STATUSES"])
def test_horovods_runner_still_has_what_each_patch_replaces(runner: Any, name: str) -> None:
    _holds(getattr(runner, name))


def _runner_internals() -> Dict[str, Any]:
    from horovod.runner import gloo_run
    from horovod.runner import launch as runner_launch
    from horovod.runner.common.util import config_parser
    from horovod.runner.http import http_server

    return {
        "register_shutdown_event": gloo_run.register_shutdown_event,
        "set_env_from_args": config_parser.set_env_from_args,
        "gloo_built": runner_launch.gloo_built,
        "serve_forever": vars(http_server.KVStoreHTTPServer).get("serve_forever"),
        "_exec_command_fn": gloo_run._exec_command_fn,
    }


def test_the_runner_is_patched_for_a_launch_and_put_back(runner: Any, unchecked: None) -> None:
    before = _runner_internals()
    events: List[Any] = []
    with runner.runner_patched(events, []):
        during = _runner_internals()
        from horovod.runner import gloo_run

        gloo_run.register_shutdown_event().set()
    assert all(during[k] is not before[k] for k in before) and events and events[0].is_set()
    assert _runner_internals() == before


def test_a_patch_whose_gate_fails_is_not_applied(runner: Any, unchecked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "SHUTDOWN", dataclasses.replace(runner.SHUTDOWN, versions="==0.0.1"))
    before = _runner_internals()
    with runner.runner_patched([]):
        during = _runner_internals()
    assert during["register_shutdown_event"] is before["register_shutdown_event"]  # skipped whole
    assert during["set_env_from_args"] is not before["set_env_from_args"]  # the others still apply


# ---- Hydra's config loader, multiprocessing's forkserver, torch ------------------------------------


def test_hydras_config_loader_still_composes_a_sweep_job_so(unchecked: None) -> None:
    _holds(hydra_compositions.REUSE)


def test_a_loader_is_left_alone_where_the_reuse_does_not_apply(unchecked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hydra_compositions, "REUSE", dataclasses.replace(hydra_compositions.REUSE, versions="<1.0"))

    class Loader:
        def load_sweep_config(self, master_config: Any, sweep_overrides: List[str]) -> Any:
            return ("composed", tuple(sweep_overrides))

    loader = Loader()
    reused = hydra_compositions.ReusedCompositions.install(loader)
    assert loader.load_sweep_config.__func__ is Loader.load_sweep_config  # type: ignore[attr-defined]
    assert reused.compose(None, ["a=1"]) == ("composed", ("a=1",))  # type: ignore[arg-type]


def test_the_forkserver_still_keeps_its_pid_and_alive_fd(unchecked: None) -> None:
    _holds(forkserver.SERVER)


def test_torch_elastics_worker_wrapper_still_takes_the_event(unchecked: None) -> None:
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401  (what a worker under the agent has imported)

    _holds(elastic_worker.WRAPPER_WAIT)


def test_torchs_log_formatter_is_still_where_the_filter_expects_it(unchecked: None) -> None:
    _holds(torch_logging.RENDERED_FIRST)


def test_hydras_job_return_still_keeps_what_a_job_returned(unchecked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.steadfast_launcher._compat import hydra_job_return

    _holds(hydra_job_return.RETURN_VALUE)
    failure, done = JobReturn(status=JobStatus.FAILED), JobReturn(status=JobStatus.COMPLETED)
    failure.return_value, done.return_value = ValueError("boom"), 42
    assert isinstance(hydra_job_return.returned(failure), ValueError) and hydra_job_return.returned(done) == 42
    monkeypatch.setattr(_compat, "_checked", {hydra_job_return.RETURN_VALUE.name: "skipped in this test"})
    assert isinstance(hydra_job_return.returned(failure), ValueError)  # the same, through the public property


def test_hydras_override_message_is_still_where_the_nearest_key_replaces_it(unchecked: None) -> None:
    """Hydra's own raise, caught by the wrapper (installed by the launcher's config module): for a
    config that selects the steadfast launcher, the nearest key instead of the advice to use +."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from hydra_plugins.steadfast_launcher._compat import hydra_overrides

    _holds(hydra_overrides.NEAREST_KEY)
    hydra_overrides.install()
    overrides = OverridesParser.create().parse_overrides(["sampels=3"])
    for target, expected in (
        ("hydra_plugins.steadfast_launcher.launcher.SteadfastLauncher", "did you mean samples?"),
        ("other", "use +"),
    ):
        cfg = OmegaConf.create({"samples": 1, "hydra": {"launcher": {"_target_": target}}})
        OmegaConf.set_struct(cfg, True)
        with pytest.raises(ConfigCompositionException, match=expected):
            ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)
