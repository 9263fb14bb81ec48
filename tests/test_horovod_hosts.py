"""backend.hosts passes through to Horovod's runner (which reaches the other hosts over ssh)."""

from __future__ import annotations

from pathlib import Path

import pytest

horovod = pytest.importorskip("horovod", reason="Horovod is not installed: bash scripts/install_horovod.sh $(which python)")


def test_hosts_reach_horovod_run_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from hydra_plugins.steadfast_launcher._backends.horovod import HorovodBackend
    from hydra_plugins.steadfast_launcher._payload import PayloadRef
    from hydra_plugins.steadfast_launcher._types import Job
    from steadfast.contract.schemas import HorovodBackendConf, RestartConf

    seen = {}

    def fake_run(fn, args=(), **kwargs):
        seen.update(kwargs)
        return [{"status": "completed"}] * kwargs["num_proc"]

    monkeypatch.setattr(horovod, "run", fake_run)
    backend = HorovodBackendConf(np=4, hosts="h1:2,h2:2")
    assert backend.problems() == []
    job = Job(idx=0, overrides=[], config=OmegaConf.create({}), backend=backend, restart=RestartConf())
    result = HorovodBackend(backend).launch(PayloadRef("payload", "0" * 64, 0), job, {}, tmp_path)
    assert seen["hosts"] == "h1:2,h2:2" and seen["num_proc"] == 4 and seen["use_gloo"]
    assert result == {"status": "completed"}
