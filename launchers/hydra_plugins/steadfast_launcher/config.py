"""Registers the launcher's and the library's schemas in Hydra's ConfigStore, and the resolvers
that name run folders (imported by Hydra's plugin scan before any app's config is composed).

`hydra/launcher=steadfast` selects the launcher; the `backend`, `restart`, `cluster`, `checkpoint`,
`fault` and `logger` schemas are for the YAML options in `steadfast/conf/` (and an app's own) to
extend through their defaults list, so unknown keys there are errors too.
"""

from hydra.core.config_store import ConfigStore

from steadfast.config import register_configs
from steadfast.contract import naming
from steadfast.contract.schemas import SteadfastLauncherConf

ConfigStore.instance().store(group="hydra/launcher", name="steadfast", node=SteadfastLauncherConf, provider="steadfast")
register_configs()
naming.register_resolvers()
