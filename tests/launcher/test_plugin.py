"""Hydra finds the launcher in the installed environment, and start-up never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, env, run_train

CLEAN_ENV = {k: v for k, v in env().items() if k != "PYTHONPATH"}  # as installed by scripts/setup.sh


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True, timeout=120)


def test_plugin_is_discovered_after_install_without_importing_torch(tmp_path: Path) -> None:
    proc = python(
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.launcher import Launcher\n"
        "names = [c.__name__ for c in Plugins.instance().discover(Launcher)]\n"
        "assert 'SteadfastLauncher' in names, names\n"
        "assert 'torch' not in sys.modules, 'plugin discovery imported torch'\n"
        "print('ok')\n",
        tmp_path,  # not the repo: the plugin must come from the installed environment
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_help_and_cfg_do_not_import_torch(tmp_path: Path) -> None:
    for flag in ("--help", "--cfg job", "--info"):
        proc = python(
            "import atexit, runpy, sys\n"
            "atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'))\n"
            f"sys.argv = ['train', *{flag.split()!r}]\n"
            "runpy.run_module('pipeline.train', run_name='__main__')\n",
            tmp_path,
        )
        assert proc.stdout.strip().splitlines()[-1] == "NO-TORCH", (flag, proc.stdout[-2000:], proc.stderr[-2000:])


def test_help_lists_the_config_groups(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.train", "--help"],
        cwd=tmp_path,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for group in ("backend:", "restart:", "checkpoint:", "model:", "data:"):
        assert group in proc.stdout, proc.stdout


def test_local_backend_runs_in_process(tmp_path: Path) -> None:
    proc = run_train(
        tmp_path,
        "backend=local",
        "data=synthetic",
        "data.num_samples=256",
        "trainer.max_epochs=2",
        "checkpoint=every_epoch",
        "run.name=local",
        check=True,
    )
    assert proc.returncode == 0
    import json

    s = json.loads((tmp_path / "outputs" / "local" / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 1 and s["epochs_completed"] == 2
    assert (ROOT / "steadfast" / "conf" / "backend" / "local.yaml").exists()


@pytest.mark.extended
def test_each_job_of_a_sweep_is_composed_once(tmp_path: Path) -> None:
    """The sweeper composes every job to validate it; the launcher reuses that composition instead of
    composing the job again (a composition is a good part of a job's start-up)."""
    proc = python(
        "import atexit, runpy, sys\n"
        "from hydra._internal.config_loader_impl import ConfigLoaderImpl\n"
        "composed = []\n"
        "original = ConfigLoaderImpl.load_sweep_config\n"
        "def counting(self, master_config, sweep_overrides):\n"
        "    composed.append(sweep_overrides[-1])\n"
        "    return original(self, master_config, sweep_overrides)\n"
        "ConfigLoaderImpl.load_sweep_config = counting\n"
        "atexit.register(lambda: print('COMPOSED', sorted(composed)))\n"
        "sys.argv = ['train', '-m', 'backend=local', 'data=synthetic', 'data.num_samples=64', 'trainer.max_epochs=1',\n"
        "            'snapshot=off', 'trainer.seed=1,2']\n"
        "runpy.run_module('pipeline.train', run_name='__main__')\n",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line == "COMPOSED ['trainer.seed=1', 'trainer.seed=2']", (line, proc.stderr[-2000:])
    summaries = sorted(tmp_path.glob("outputs/sweeps/*/*/summary.json"))
    assert len(summaries) == 2 and all('"completed"' in p.read_text() for p in summaries), summaries
