"""Hydra's message for `KEY=VALUE` on a key the config does not have: "Could not override 'lrr'. To
append to your config use +lrr=0.1". In an app on the library that advice leads to a key the app
never reads (the library's pre-flight refuses `+` keys that nothing declares), and the message
does not say which key was meant. Wrapped, for configs that select the steadfast launcher: the
message names the nearest key at that level ("did you mean lr?") and how to declare a new one.
Hydra composes the app's config before any launcher exists, so this is installed when Hydra's
plugin scan imports the launcher's config module; it wraps the loader's static
`_apply_overrides_to_config`, whose message it rewrites, nothing else.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, List, Optional

from omegaconf import DictConfig, OmegaConf

from . import Patch, applies

_MESSAGE = re.compile(r"Could not override '([^']+)'\.")


def _shape() -> Optional[str]:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    found = inspect.getattr_static(ConfigLoaderImpl, "_apply_overrides_to_config", None)
    if not isinstance(found, staticmethod):
        return "ConfigLoaderImpl._apply_overrides_to_config is not a static method"
    params = list(inspect.signature(found.__func__).parameters)
    return (
        None
        if params == ["overrides", "cfg"]
        else f"ConfigLoaderImpl._apply_overrides_to_config{tuple(params)} is not (overrides, cfg)"
    )


NEAREST_KEY = Patch(
    "an unknown key's message names the nearest key",
    "hydra-core",
    ">=1.3,<1.4",
    _shape,
    "a mistyped key gets Hydra's own message (its advice to add the key with +)",
)


def message(key: str, cfg: DictConfig) -> str:
    from steadfast.app_keys import did_you_mean

    parent = key.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else cfg
    known: List[str] = [str(k) for k in node if str(k) != "hydra"] if isinstance(node, DictConfig) else []
    listed = f"; the keys there: {', '.join(known)}" if 0 < len(known) <= 12 else ""
    return (
        f"Could not override '{key}': the config has no such key{did_you_mean(key, known)}{listed}. "
        "A new key of the app is declared in its config file (with a default) or its schema (hydra.launcher.app_schema)"
    )


def install() -> None:
    """Wrap Hydra's application of overrides (once; not at all where the patch does not apply)."""
    if not applies(NEAREST_KEY):
        return
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    original: Callable[..., Any] = inspect.getattr_static(ConfigLoaderImpl, "_apply_overrides_to_config").__func__
    if getattr(original, "_steadfast", False):
        return

    def apply(overrides: List[Any], cfg: DictConfig) -> None:
        try:
            original(overrides, cfg)
        except ConfigCompositionException as exc:
            found = _MESSAGE.match(str(exc))
            ours = "steadfast" in str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
            if found is None or not ours:
                raise
            raise ConfigCompositionException(message(found.group(1), cfg)) from None

    apply._steadfast = True  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply)  # type: ignore[method-assign]
