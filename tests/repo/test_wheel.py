"""The package as a user installs it: the wheel built from this repository, installed into a new
environment without an editable path, used from a folder outside the repository.

The new environment borrows the test environment's third-party packages (torch, Hydra, ...) through
a path file, so no multi-GB download happens here; the test environment's own path files (the
editable install of this repository among them) are not processed there, so the repository is not
on its sys.path: every module of ours comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path
from typing import Dict

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

OWN_LOOP_APP = """
import hydra
import torch
import torch.nn.functional as F
from torch import nn

import steadfast as sf


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=0) as run:
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 8, generator=g)
        y = (x.sum(1) > 0).long()
        loader = run.loader(torch.utils.data.TensorDataset(x, y), batch_size=16)
        run.resume(model=model, optimizer=optimizer)
        for _ in run.epochs(cfg.epochs):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                run.step(loss)
        return run.finish()


if __name__ == "__main__":
    main()
"""

OWN_LOOP_CONFIG = """
defaults:
  - steadfast
  - backend: torchrun
  - restart: default
  - checkpoint: every_epoch
  - _self_
epochs: 2
snapshot:
  every_n_steps: 0
run:
  name: own_${steadfast_run_name:${hydra:overrides.task},${run.safe_to_change}}
  safe_to_change: [epochs]
hydra:
  searchpath:
    - pkg://steadfast.conf
"""

PLAIN_APP = """
import hydra


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    print("plain app ran")
    return 7


if __name__ == "__main__":
    main()
"""


BUILD_LEFTOVERS = (".git", ".venv", "build", "dist", "*.egg-info", "outputs", "multirun", "__pycache__", ".*_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """A new environment with the wheel of this repository installed (and nothing of it editable)."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    # built from a copy: setuptools writes build/ and *.egg-info into the source tree, and two test
    # processes building in the repository at once collide there (and the tree is the user's)
    source = root / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("steadfast-*.whl")
    env_dir = root / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    )
    # the test environment's packages (torch, Hydra, ...), without processing its path files
    (purelib / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    work = root / "project"  # the user's project: outside the repository
    work.mkdir()
    return {"python": python, "bin": env_dir / "bin", "work": work}


def clean_env(installed: Dict[str, Path]) -> Dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    e["PATH"] = f"{installed['bin']}{os.pathsep}{e.get('PATH', '')}"
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run(installed: Dict[str, Path], *cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, env=clean_env(installed), capture_output=True, text=True, timeout=300)


def test_every_module_of_ours_comes_from_the_wheel(installed: Dict[str, Path]) -> None:
    proc = run(
        installed,
        str(installed["python"]),
        "-c",
        textwrap.dedent(
            """
            import importlib.util, json, pkgutil, sys
            import steadfast, pipeline, hydra_plugins.steadfast_launcher as launcher
            names = []
            for package in (steadfast, pipeline, launcher):
                names.append(package.__name__)
                names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                          if not m.name.startswith("pipeline.conf") and not m.name.startswith("steadfast.conf.")]
            files = {n: importlib.util.find_spec(n).origin for n in names}  # found, not run
            print(json.dumps({"files": files, "path": sys.path}))
            """
        ),
        cwd=installed["work"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert str(ROOT) not in got["path"] and str(ROOT / "launchers") not in got["path"]
    outside = {n: f for n, f in got["files"].items() if not f or str(ROOT) in f}
    assert not outside, outside
    assert "hydra_plugins.steadfast_launcher._backends.torchrun" in got["files"]


def test_the_package_is_typed_and_an_own_loop_install_is_light(installed: Dict[str, Path]) -> None:
    """py.typed ships (an app's type checker reads sf.Run's hints); scikit-learn, the built-in
    trainer's data, is only in the `trainer` extra."""
    proc = run(
        installed,
        str(installed["python"]),
        "-c",
        "import importlib.metadata as m, json; d = m.distribution('steadfast');"
        "print(json.dumps({'requires': d.requires, 'files': [str(f) for f in d.files]}))",
        cwd=installed["work"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert "steadfast/py.typed" in got["files"]
    sklearn = [r for r in got["requires"] if r.startswith("scikit-learn")]
    assert sklearn == ['scikit-learn; extra == "trainer"'], got["requires"]


def test_an_own_loop_app_outside_the_repository_trains(installed: Dict[str, Path]) -> None:
    app = installed["work"] / "own"
    (app / "conf").mkdir(parents=True)
    (app / "train.py").write_text(OWN_LOOP_APP)
    (app / "conf" / "config.yaml").write_text(OWN_LOOP_CONFIG)
    proc = run(installed, str(installed["python"]), "train.py", cwd=app)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((app / "outputs" / "own_default" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["epochs_completed"] == 2


def test_a_plain_hydra_app_selects_the_launcher(installed: Dict[str, Path]) -> None:
    app = installed["work"] / "plain"
    app.mkdir()
    (app / "app.py").write_text(PLAIN_APP)
    proc = run(installed, str(installed["python"]), "app.py", "-m", "hydra/launcher=steadfast", "+x=1,2", cwd=app)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("plain app ran") == 2, proc.stdout


def test_the_built_in_trainer_runs_from_the_installed_command(installed: Dict[str, Path]) -> None:
    cwd = installed["work"] / "builtin"
    cwd.mkdir()
    command = installed["bin"] / "steadfast-train"
    proc = run(
        installed,
        str(command),
        "data=synthetic",
        "data.num_samples=256",
        "trainer.max_epochs=2",
        "checkpoint=every_epoch",
        "snapshot=off",
        "run.name=builtin",
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((cwd / "outputs" / "builtin" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
