"""The training entrypoint: `python -m pipeline.train [overrides]`.

Hydra composes the config; the steadfast launcher validates it, freezes it into the run folder
and calls `main` on every worker rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from . import config, help  # noqa: F401  (register the schemas and the --help resolver)


def main(cfg: DictConfig) -> Any:
    from .trainer import train  # torch is imported by the workers, not by Hydra's start-up

    result = train(cfg)
    # The job's return value goes back to Hydra (and to a sweeper such as Optuna): the chosen metric.
    return result[str(cfg.trainer.get("objective") or "val_loss")]


def config_path() -> str:
    """The trainer's config groups and presets: the repository's top-level conf/ in a checkout; a
    wheel installs that folder as the package pipeline.conf (setup.py), found as pkg://pipeline/conf."""
    here = Path(__file__).resolve().parent
    if (here / "conf" / "train.yaml").is_file():
        return "conf"  # installed: beside this module, so Hydra reads it as package data
    return str(here.parent / "conf")


@hydra.main(version_base="1.3", config_path=config_path(), config_name="train")
def cli(cfg: DictConfig) -> Any:
    return main(cfg)


if __name__ == "__main__":
    cli()
