"""Registers the launcher's schemas in Hydra's ConfigStore (imported by Hydra's plugin scan).

`hydra/launcher=steadfast` selects the launcher; the `backend` and `restart` schemas are for an
app's YAML files to extend through their defaults list, so unknown keys there are errors too.
"""
from hydra.core.config_store import ConfigStore

from ._schemas import (  # noqa: F401  (re-exported: the public names of the schemas)
    BackendConf,
    ConfigError,
    HorovodBackendConf,
    LocalBackendConf,
    RestartConf,
    SteadfastLauncherConf,
    TorchrunBackendConf,
    backend_from,
    bad,
    restart_from,
)

cs = ConfigStore.instance()
cs.store(group="hydra/launcher", name="steadfast", node=SteadfastLauncherConf, provider="steadfast")
# Schemas for the app-level groups; YAML files in an app's `backend/` and `restart/` groups
# extend them through their defaults list, so unknown keys in those files are errors too.
cs.store(group="backend", name="schema_torchrun", node=TorchrunBackendConf, provider="steadfast")
cs.store(group="backend", name="schema_horovod", node=HorovodBackendConf, provider="steadfast")
cs.store(group="backend", name="schema_local", node=LocalBackendConf, provider="steadfast")
cs.store(group="restart", name="schema", node=RestartConf, provider="steadfast")
