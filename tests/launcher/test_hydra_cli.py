"""The usual Hydra commands work on the app: --cfg job/hydra, --info, --help, shell completion.

None of them starts a worker (or imports torch: see test_plugin.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, env

PRESETS = tuple(sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))


def cli(cwd: Path, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.train", *args],
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def test_cfg_job_prints_the_composed_job(tmp_path: Path) -> None:
    out = cli(tmp_path, "--cfg", "job").stdout
    assert not any(line.startswith("hydra:") for line in out.splitlines()), "--cfg job leaves Hydra's own node out"
    for needle in ("backend:\n  name: torchrun", "nproc_per_node: 2", "objective: val_loss", "max_restarts: 3"):
        assert needle in out, (needle, out)
    assert not list(tmp_path.glob("outputs/*")), "--cfg must not create run folders"


def test_cfg_job_composes_a_preset(tmp_path: Path) -> None:
    out = cli(tmp_path, "--cfg", "job", "+experiment=digits_quick", "trainer.lr=0.2").stdout
    assert "max_epochs: 3" in out and "lr: 0.2" in out and "max_restarts: 0" in out and "every_n_epochs: 1" in out


def test_cfg_hydra_shows_the_launcher_and_its_sweep_settings(tmp_path: Path) -> None:
    out = cli(tmp_path, "--cfg", "hydra").stdout
    for needle in (
        "mode: MULTIRUN",
        "_target_: hydra_plugins.steadfast_launcher.launcher.SteadfastLauncher",
        "max_parallel_jobs: 1",
        "fail_fast: false",
        "skip_completed: true",
        "steadfast_sweep_dir:outputs",
    ):
        assert needle in out, (needle, out)
    shown = cli(tmp_path, "--cfg", "hydra", "-p", "hydra.launcher.max_parallel_jobs", "hydra.launcher.max_parallel_jobs=3").stdout
    assert shown.strip().endswith("3"), shown


def test_info_lists_the_plugins_and_the_search_path(tmp_path: Path) -> None:
    out = cli(tmp_path, "--info").stdout
    assert "SteadfastLauncher" in out and "conf" in out and "Defaults List" in out, out
    assert "experiment" not in out.split("Defaults List")[1].split("Config")[0], "presets are optional, not defaults"


def test_help_lists_groups_options_presets_and_sweep_settings(tmp_path: Path) -> None:
    out = cli(tmp_path, "--help").stdout
    groups = out.split("== Config groups")[1].split("== Sweeps")[0]
    assert "backend: horovod, local, torchrun (default)" in groups, groups
    assert "schema" not in groups, "the typed schema_* entries of the ConfigStore are not options"
    assert "experiment: " + ", ".join(PRESETS) in groups and "+experiment=NAME" in groups, groups
    for needle in ("hydra.launcher.max_parallel_jobs", "hydra.launcher.fail_fast", "trainer.objective", "Usage:"):
        assert needle in out, needle
    assert "$" not in out.split("== Config (")[0], "unsubstituted template variables"


def test_shell_completion_install_and_query(tmp_path: Path) -> None:
    script = cli(tmp_path, "--shell-completion", "install=bash").stdout
    assert "hydra_bash_completion()" in script and "complete -o nospace" in script

    def query(line: str) -> list[str]:
        return cli(tmp_path, "-sc", "query=bash", extra_env={"COMP_LINE": line}).stdout.split()

    assert "backend=" in query("steadfast-train back")
    assert {"backend=torchrun", "backend=horovod", "backend=local"} <= set(query("steadfast-train backend="))
    assert set(query("steadfast-train +experiment=")) == {f"+experiment={p}" for p in PRESETS}
    assert query("steadfast-train trainer.obj") == ["trainer.objective="]
    assert "hydra.launcher.max_parallel_jobs=" in query("steadfast-train hydra.launcher.max_p")


def test_shell_completion_works_in_bash_with_the_installed_command(tmp_path: Path) -> None:
    """`eval "$(steadfast-train -sc install=bash)"` then TAB: the real bash function, end to end."""
    exe = shutil.which("steadfast-train", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None or shutil.which("bash") is None:
        pytest.skip("steadfast-train is not installed (pip install -e .) or bash is missing")
    line = "steadfast-train +experiment=digits_q"
    script = (
        f'export PATH="{Path(exe).parent}:$PATH"\n'
        'eval "$(steadfast-train -sc install=bash)"\n'
        f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; COMP_WORDS=({line}); COMP_CWORD=1\n'
        "hydra_bash_completion\n"
        'echo "REPLY: ${COMPREPLY[*]}"\n'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert "REPLY: +experiment=digits_quick" in proc.stdout, (proc.stdout, proc.stderr)
