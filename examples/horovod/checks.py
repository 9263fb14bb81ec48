"""The app's own pre-flight check, run by the launcher before any worker starts (no torch, no Horovod)."""

from typing import List

from omegaconf import DictConfig, OmegaConf

from steadfast.contract.schemas import bad


def preflight(job_cfg: DictConfig) -> List[str]:
    """hvd.* calls need workers started by Horovod's runner: any other backend is refused."""
    name = OmegaConf.select(job_cfg, "backend.name")
    if name != "horovod":
        return [
            bad(
                "backend",
                name,
                "horovod only: examples/horovod is written with Horovod's own calls (hvd.*), "
                "which need workers started by Horovod's runner",
            )
        ]
    return []
