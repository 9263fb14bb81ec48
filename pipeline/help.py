"""`--help`: the app's config groups and their options (registered as the `steadfast_help_groups` resolver)."""

from __future__ import annotations

from typing import Any, Dict, List

from omegaconf import OmegaConf

GROUP_HELP: Dict[str, str] = {
    "backend": "how the workers start: torch elastic (torchrun), Horovod, or in this process",
    "restart": "what happens when a worker fails: restart.max_restarts, restart.monitor_interval",
    "checkpoint": "when checkpoints are written and how many are kept",
    "model": "the network; model._target_=my.module.MyNet plugs in your own",
    "data": "the dataset; data._target_ plugs in your own",
    "task": "what is optimised and measured (the loss); task._target_ plugs in your own",
    "fault": "fault injection, to rehearse recovery",
    "logger": "progress display, and metrics also to TensorBoard, metrics.csv or MLflow (logger=tensorboard, csv, mlflow; several: logger.sinks=[csv,mlflow])",
    "cluster": "where jobs run: here (none) or submitted to Slurm",
    "experiment": "committed presets (pipeline/conf/experiment/)",
}


def help_groups(choices: Any, config_name: Any = None) -> str:
    """The app's config groups and their options for `--help` (the typed schema_* entries hidden).
    With the primary config's name, groups on its `hydra.searchpath` are listed too."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    choices = dict(choices or {})
    lines: List[str] = []

    def walk(parent: str) -> None:
        for group in sorted(loader.get_group_options(parent, ObjectType.GROUP, config_name=config_name)):
            full = f"{parent}/{group}" if parent else group
            if full == "hydra" or full.startswith("hydra/"):
                continue
            options = [
                o
                for o in loader.get_group_options(full, results_filter=ObjectType.CONFIG, config_name=config_name)
                if not o.startswith("schema") and o != "steadfast"
            ]
            if options:
                default = choices.get(full)
                shown = ", ".join(f"{o} (default)" if o == default else o for o in options)
                how = GROUP_HELP.get(full, "")
                if full not in choices:
                    how = f"{how}; optional: +{full}=NAME" if how else f"optional: +{full}=NAME"
                lines.append(f"  {full}: {shown}" + (f"\n      {how}" if how else ""))
            walk(full)

    walk("")
    return "\n".join(lines)


OmegaConf.register_new_resolver("steadfast_help_groups", help_groups, replace=True)
