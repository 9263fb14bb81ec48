"""The committed presets (conf/experiment/): each composes and passes the pre-flight checks, and
its quick variant (the preset with 1 epoch) trains end to end."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from helpers import ROOT, run_train, summary
from pipeline import config as schema  # registers the schemas in the ConfigStore (at import, once)
from steadfast import preflight as library

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
EXPECTED = {  # what each preset is for
    "digits_quick": {
        "backend.name": "torchrun",
        "trainer.max_epochs": 3,
        "restart.max_restarts": 0,
        "checkpoint.every_n_epochs": 1,
    },
    "digits": {"model.name": "cnn", "trainer.optimizer": "adamw", "trainer.scheduler": "cosine", "restart.max_restarts": 3},
    "classic": {
        "backend.name": "torchrun",
        "backend.rdzv_backend": "c10d",
        "restart.max_restarts": 3,
        "checkpoint.every_n_epochs": 10,
    },
    "horovod": {"backend.name": "horovod", "backend.np": 2, "restart.max_restarts": 3},
}


def test_the_required_presets_exist() -> None:
    assert set(EXPECTED) <= set(PRESETS), PRESETS


@pytest.mark.usefixtures("hydra_restore_singletons")  # compose() sets Hydra's global state (version base, ...)
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_passes_preflight(preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # pre-flight probes the (relative) run folder
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={preset}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        for key, value in EXPECTED.get(preset, {}).items():
            found = OmegaConf.select(cfg, key)
            assert getattr(found, "value", found) == value, (preset, key)
        problems = library.check(cfg) + schema.preflight(cfg)
        if preset == "horovod" and find_spec("horovod") is None:
            problems = [p for p in problems if "Horovod is not installed" not in p]
        assert problems == []
        assert cfg.run.name == f"experiment={preset}"


# Presets whose one epoch is long: their quick variant also cuts the data (the model, optimizer,
# schedule and cadence stay the preset's). charlm: 110 steps of a 4-layer transformer, ~65 s here.
CUT_DATA = {"charlm": ["data.max_chars=60000"]}


@pytest.mark.extended
@pytest.mark.slow
def test_every_preset_runs_its_quick_variant(tmp_path: Path) -> None:
    """One sweep over the presets, each cut to 1 epoch (and the long ones to less data, each in a
    launch of its own): every job a real distributed run."""
    presets = [p for p in PRESETS if p != "horovod" or find_spec("horovod") is not None]
    swept = [p for p in presets if p not in CUT_DATA]
    run_train(
        tmp_path,
        "-m",
        f"+experiment={','.join(swept)}",
        "trainer.max_epochs=1",
        "restart.monitor_interval=0.1",
        timeout=400,
        check=True,
    )
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    folders = {p: sweep / f"experiment={p}" for p in swept}
    for preset in sorted(set(presets) & set(CUT_DATA)):
        run_train(
            tmp_path,
            f"+experiment={preset}",
            "trainer.max_epochs=1",
            "restart.monitor_interval=0.1",
            *CUT_DATA[preset],
            f"run.name={preset}",
            timeout=400,
            check=True,
        )
        folders[preset] = tmp_path / "outputs" / preset
    assert set(folders) == set(presets)
    for preset, folder in folders.items():
        s = summary(folder)
        assert s["status"] == "completed" and s["epochs_completed"] == 1 and s["world_size"] == 2, (preset, s)
