"""`--help` of any app on the library: its config groups and their options (the typed `schema*`
entries the YAML options extend are hidden), registered as the `steadfast_help_groups` resolver
when Hydra's plugin scan imports the launcher's config module. The library's `steadfast` config
uses it in its help template; the built-in trainer in its own."""

from __future__ import annotations

from typing import Any, Dict, List

from omegaconf import OmegaConf

from .contract.keys import GROUPS

# What each group is for, shown under it: the library's groups, and any an app adds (pipeline/help.py).
GROUP_HELP: Dict[str, str] = dict(GROUPS)


def help_groups(choices: Any, config_name: Any = None) -> str:
    """The app's config groups and their options, the chosen one marked. With the primary config's
    name, groups on its `hydra.searchpath` are listed too."""
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


def register_resolver() -> None:
    OmegaConf.register_new_resolver("steadfast_help_groups", help_groups, replace=True)
