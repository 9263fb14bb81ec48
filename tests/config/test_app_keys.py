"""The app's keys checked and shown (an own-loop app, tests/apps/user_code, run as `python train.py`;
nothing here starts a worker): `--help` lists every group's real options; a mistyped key gets the
nearest one; `+KEY` that nothing declares is refused; an optional schema types the app's keys like
the library's; an app key that takes a library group's name is refused with its name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest
from omegaconf import OmegaConf

from helpers import ROOT, env
from steadfast import app_keys

APP = ROOT / "tests" / "apps" / "user_code"
SCHEMA = "hydra.launcher.app_schema=__main__:Config"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("keys") / "project"
    shutil.copytree(APP, cwd)
    return cwd


def app(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=120)


def refused(cwd: Path, *args: str) -> str:
    """The first line of a launch refused before any worker started (nothing written)."""
    proc = app(cwd, *args)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert not (cwd / "outputs").exists() or not any((cwd / "outputs").iterdir()), "a refused launch wrote a run folder"
    return (proc.stderr or proc.stdout).strip().splitlines()[0]


def test_help_of_an_own_loop_app_lists_the_real_options_of_every_group(project: Path) -> None:
    proc = app(project, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = proc.stdout.split("== Config groups")[1].split("== Config (")[0]
    assert "schema" not in groups, groups  # the old help: backend: schema_horovod, schema_local, schema_torchrun
    for needle in (
        "backend: horovod, local, torchrun (default)",
        "checkpoint: best_val_loss, every_10_epochs, every_epoch (default)",
        "restart: default, none (default)",
    ):
        assert needle in groups, (needle, groups)
    assert "fail_at_step: 0" in proc.stdout.split("== Config (")[1]  # the app's own keys
    assert "$" not in proc.stdout.split("== Config (")[0], "unsubstituted template variables"


def test_a_mistyped_key_names_the_nearest_one(project: Path) -> None:
    first = refused(project, "sampels=64")
    assert first.startswith("Could not override 'sampels': the config has no such key (did you mean samples?)"), first
    assert "+sampels" not in first  # Hydra's advice to add it with +


def test_a_key_added_with_plus_that_nothing_declares_is_refused(project: Path) -> None:
    first = refused(project, "+sampels=64")
    assert first == (
        "Invalid config: +sampels: not a key of the app's config (did you mean samples?). `+` adds a key that nothing "
        "declares: declare it in the app's config file (with a default) or in its schema (hydra.launcher.app_schema)"
    ), first


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "epochs=1.5",
            "Invalid config: epochs=1.5 is not allowed: Value '1.5' of type 'float' could not be converted to Integer (the app's schema Config)",
        ),
        (
            "+sampels=64",
            "Invalid config: sampels: not a key of the app's schema Config (did you mean samples?); its keys: seed, epochs, samples, fail_at_step, lock",
        ),
    ],
)
def test_the_apps_schema_types_its_keys_before_any_worker_starts(project: Path, override: str, expected: str) -> None:
    assert refused(project, SCHEMA, override) == expected


def test_an_app_key_that_takes_a_library_groups_name_is_refused_with_it(tmp_path: Path) -> None:
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    config = cwd / "conf" / "config.yaml"
    config.write_text(config.read_text().replace("  - backend: torchrun\n", "").replace("seed: 0\n", "seed: 0\nbackend: nccl\n"))
    first = refused(cwd)
    assert first.startswith("Invalid config: backend='nccl': `backend` is the library's config group (how the workers start"), (
        first
    )
    assert "rename the app's key" in first


# ---- the schema's checks, without Hydra --------------------------------------------------------------
@dataclass
class Optim:
    lr: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])


@dataclass
class Schema:
    epochs: int = 3
    name: str = "x"
    optim: Optim = field(default_factory=Optim)


def _problems(**app: object) -> List[str]:
    job = OmegaConf.create({"hydra": {"launcher": {"app_schema": f"{__name__}:Schema"}}, "run": {"name": "r"}, **app})
    task = OmegaConf.create({k: v for k, v in job.items() if k != "hydra"})
    return app_keys.problems(job, task)


def test_a_config_that_fits_the_schema_passes_and_the_library_keys_are_not_the_apps() -> None:
    assert _problems(epochs=5, optim={"lr": 0.01}, backend={"name": "torchrun"}, checkpoint={"every_n_epochs": 1}) == []


def test_the_schemas_problems_name_the_key_at_any_depth() -> None:
    assert _problems(optim={"lrr": 0.01}) == [
        "optim.lrr: not a key of the app's schema Optim (did you mean optim.lr?); its keys: lr, betas"
    ]
    assert _problems(optim={"lr": float("inf")})[0].startswith("optim.lr=inf is not allowed: a finite number")
    assert _problems(epochs="many")[0].startswith(
        "epochs='many' is not allowed: Value 'many' of type 'str' could not be converted to Integer"
    )


def test_a_schema_that_is_not_there_or_not_a_dataclass_is_named() -> None:
    job = OmegaConf.create({"hydra": {"launcher": {"app_schema": f"{__name__}:nothing"}}})
    assert "hydra.launcher.app_schema" in app_keys.problems(job, OmegaConf.create({}))[0]
    job.hydra.launcher.app_schema = f"{__name__}:_problems"
    assert "a dataclass of the app's own keys" in app_keys.problems(job, OmegaConf.create({}))[0]
