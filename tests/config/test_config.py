"""Config schemas, run names, pre-flight checks and the LaunchConfig mapping (no workers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import pipeline.config as schema
from helpers import CONF, composed, problems
from hydra_plugins.steadfast_launcher._backends.horovod import HorovodBackendConf
from hydra_plugins.steadfast_launcher._backends.torchrun import TorchrunBackendConf
from steadfast import preflight as library
from steadfast.contract import naming
from steadfast.contract.schemas import RestartConf

SAFE = list(OmegaConf.load(CONF / "train.yaml").run.safe_to_change)


def test_defaults_compose_and_pass_preflight() -> None:
    cfg = composed()
    assert cfg.backend.name == "torchrun" and cfg.backend.nproc_per_node == 2
    assert cfg.restart.max_restarts == 3 and cfg.checkpoint.every_n_epochs == 10
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.launcher._target_.endswith("SteadfastLauncher")
    assert problems() == []


@pytest.mark.parametrize(
    "group,options",
    [
        ("backend", ["torchrun", "local"]),
        ("restart", ["default", "none"]),
        ("checkpoint", ["every_10_epochs", "every_epoch", "every_n_steps", "best_val_loss"]),
        ("model", ["mlp", "cnn"]),
        ("data", ["digits", "synthetic"]),
        ("fault", ["none", "kill_rank", "hang_rank", "exception"]),
    ],
)
def test_every_preset_composes(group: str, options: list[str]) -> None:
    for option in options:
        assert problems(f"{group}={option}") == [], option


@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.max_epochs=0", "trainer.max_epochs"),
        ("restart.max_restarts=-1", "restart.max_restarts"),
        ("checkpoint.every_n_epochs=0", "checkpoint.every_n_epochs"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("checkpoint.keep_best=-1", "checkpoint.keep_best"),
        ("checkpoint.keep_best=2", "checkpoint.keep_best"),  # without checkpoint.monitor
        ("checkpoint.monitor=", "checkpoint.monitor"),
        ("checkpoint.monitor=val_los", "checkpoint.monitor"),  # not a metric the trainer logs
        ("backend.nproc_per_node=0", "backend.nproc_per_node"),
        ("backend.nnodes=2:1", "backend.nnodes"),
        ("data.val_fraction=1.5", "data.val_fraction"),
    ],
)
def test_out_of_range_values_are_named(override: str, key: str) -> None:
    from hydra.core.hydra_config import HydraConfig

    from hydra_plugins.steadfast_launcher._backends import backend_from
    from hydra_plugins.steadfast_launcher._types import restart_from

    cfg = composed(override)
    HydraConfig.instance().set_config(cfg)
    found = (
        library.check(cfg) + schema.preflight(cfg) + backend_from(cfg.backend).problems() + restart_from(cfg.restart).problems()
    )
    assert found and any(key in p for p in found), found


@pytest.mark.parametrize(
    "override,key,allowed",
    [
        ("trainer.optimizer=rmsprop", "trainer.optimizer", "sgd"),
        ("trainer.scheduler=linear", "trainer.scheduler", "cosine"),
        ("trainer.objective=loss", "trainer.objective", "val_accuracy"),
        ("trainer.on_world_size_change=grow", "trainer.on_world_size_change", "keep_global_batch"),
        ("logger.progress=fancy", "logger.progress", "lines"),
        ("checkpoint.mode=median", "checkpoint.mode", "max"),
        ("fault.kind=meteor", "fault.kind", "corrupt_checkpoint"),
    ],
)
def test_bad_choices_fail_at_composition_naming_the_key_and_the_choices(override: str, key: str, allowed: str) -> None:
    with pytest.raises(Exception) as err:
        composed(override)
    text = f"{err.value}\n{err.value.__cause__}"  # as Hydra prints it: the override, then what is allowed
    assert text.startswith(f"Error merging override {override}") and key in text and allowed in text, text


def test_no_cadence_at_all_is_refused() -> None:
    found = problems("checkpoint.every_n_epochs=null")
    assert any("at least one of checkpoint.every_n_epochs" in p for p in found)


def test_run_name_is_deterministic_and_ignores_safe_keys() -> None:
    assert naming.run_name([]) == "default"
    a = naming.run_name(["trainer.lr=0.1", "model=cnn"])
    assert a == naming.run_name(["model=cnn", "trainer.lr=0.1"]) == "model=cnn,trainer.lr=0.1"
    assert (
        naming.run_name(["trainer.lr=0.1", "trainer.max_epochs=50", "checkpoint=every_epoch", "resume=never"], SAFE)
        == "trainer.lr=0.1"
    )
    long = naming.run_name([f"model.hidden_sizes=[{','.join(['512'] * 40)}]"])
    assert len(long) <= naming.MAX_NAME and "/" not in long
    assert long != naming.run_name([f"model.hidden_sizes=[{','.join(['512'] * 41)}]"])


def test_run_name_default_comes_from_the_overrides() -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = composed("trainer.lr=0.3", "trainer.max_epochs=2")
    HydraConfig.instance().set_config(cfg)
    assert cfg.run.name == "trainer.lr=0.3"
    folder = os.path.join(str(OmegaConf.select(cfg, "hydra.sweep.dir")), str(OmegaConf.select(cfg, "hydra.sweep.subdir")))
    assert os.path.normpath(folder) == os.path.join("outputs", "trainer.lr=0.3")  # one job: outputs/<run.name>


def test_launch_config_mapping(tmp_path: Path) -> None:
    from hydra_plugins.steadfast_launcher._backends.torchrun import launch_config

    lc = launch_config(
        TorchrunBackendConf(nproc_per_node=3, nnodes="1:2", rdzv_endpoint="node0:29400"),
        RestartConf(max_restarts=5, monitor_interval=0.25),
        run_id="my/run",
        log_dir=tmp_path,
    )
    assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node) == (1, 2, 3)
    assert (lc.max_restarts, lc.monitor_interval) == (5, 0.25)
    assert lc.rdzv_backend == "c10d" and lc.rdzv_endpoint == "node0:29400"
    assert lc.run_id == "my_run"  # a valid rendezvous id
    standalone = launch_config(TorchrunBackendConf(), RestartConf(), run_id="r", log_dir=tmp_path)
    assert standalone.rdzv_endpoint == "localhost:0"  # like --standalone: a free port
    static = launch_config(
        TorchrunBackendConf(rdzv_backend="static", master_port=29999, node_rank=0), RestartConf(), "r", tmp_path
    )
    assert static.rdzv_endpoint == "127.0.0.1:29999" and static.rdzv_configs["rank"] == 0
    quick = launch_config(
        TorchrunBackendConf(nnodes="1:2", rdzv_endpoint="n:1", rdzv_node_timeout_s=6, rdzv_is_host=False),
        RestartConf(),
        "r",
        tmp_path,
    )
    assert (quick.rdzv_configs["keep_alive_interval"], quick.rdzv_configs["keep_alive_max_attempt"]) == (2, 3)
    assert quick.rdzv_configs["is_host"] is False
    assert "keep_alive_interval" not in standalone.rdzv_configs and "is_host" not in standalone.rdzv_configs  # torch's default


def test_backend_problems() -> None:
    assert TorchrunBackendConf().problems() == []
    assert any("rdzv_endpoint" in p for p in TorchrunBackendConf(nnodes="2").problems())
    assert any("backend.np" in p for p in HorovodBackendConf(np=0).problems())
    assert any("mutually exclusive" in p for p in HorovodBackendConf(hosts="a:1", host_discovery_script="x.sh").problems())
    assert any("min_np" in p for p in HorovodBackendConf(min_np=3, max_np=2).problems())
    assert any("backend.rdzv_node_timeout_s" in p and ">= 3" in p for p in TorchrunBackendConf(rdzv_node_timeout_s=1).problems())
    assert any("backend.rdzv_is_host" in p for p in TorchrunBackendConf(rdzv_backend="static", rdzv_is_host=True).problems())
