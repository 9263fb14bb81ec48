"""Hydra's own launcher test suites, run against the steadfast launcher (as Hydra's official
launcher plugins test themselves), in both of its modes: jobs one after another in the
launcher's process (the default) and jobs in parallel, one launcher process per job.

The apps of these suites configure no backend, so every job runs in-process (backend=local).
"""

from __future__ import annotations

from typing import Iterator

import pytest
from hydra.core.plugins import Plugins
from hydra.core.singleton import Singleton
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase

from hydra_plugins.steadfast_launcher.launcher import SteadfastLauncher


@pytest.fixture(autouse=True)
def hydra_version_base_unset() -> Iterator[None]:
    """The suites' apps set no version_base; a compose() in another test module leaves one behind
    (VersionBase is one of Hydra's singletons), which would change their defaults (hydra.job.chdir)."""
    saved = Singleton._instances.pop(VersionBase, None)  # type: ignore[attr-defined]
    yield
    if saved is not None:
        Singleton._instances[VersionBase] = saved  # type: ignore[attr-defined]


def test_discovery() -> None:
    """Hydra's plugin scan finds the launcher (the installed-environment variant is in test_plugin.py)."""
    assert SteadfastLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize("launcher_name, overrides", [("steadfast", [])])
class TestSteadfastLauncher(LauncherTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher_name, overrides", [("steadfast", ["hydra.launcher.max_parallel_jobs=2", "hydra.launcher.max_procs=2"])]
)
class TestSteadfastLauncherParallel(LauncherTestSuite):
    pass


@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        ({}, ["-m", "hydra/launcher=steadfast"]),
        ({"defaults": [{"override hydra/launcher": "steadfast"}]}, ["-m"]),
    ],
)
class TestSteadfastLauncherIntegration(IntegrationTestSuite):
    pass
