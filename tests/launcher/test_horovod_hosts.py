"""backend.hosts passes through to Horovod's runner (which reaches the other hosts over ssh)."""

from __future__ import annotations

from pathlib import Path

import pytest

horovod = pytest.importorskip("horovod", reason="Horovod is not installed: bash scripts/install_horovod.sh $(which python)")


def test_hosts_reach_horovod_run_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra_plugins.steadfast_launcher._backends import Attempt
    from hydra_plugins.steadfast_launcher._backends.horovod import HorovodBackend, HorovodBackendConf
    from hydra_plugins.steadfast_launcher._payload import PayloadRef
    from hydra_plugins.steadfast_launcher._types import Completed
    from hydra_plugins.steadfast_launcher._worker import run_rank
    from steadfast.contract.schemas import RestartConf

    seen = {}

    def fake_run(fn, args=(), **kwargs):
        seen.update(kwargs)
        return [{"status": "completed"}] * kwargs["num_proc"]

    monkeypatch.setattr(horovod, "run", fake_run)
    backend = HorovodBackendConf(np=4, hosts="h1:2,h2:2")
    assert backend.problems() == []
    attempt = Attempt(run_rank, PayloadRef("payload", "0" * 64, 0), {}, tmp_path, RestartConf())
    outcome = HorovodBackend(backend).launch(attempt)
    assert seen["hosts"] == "h1:2,h2:2" and seen["num_proc"] == 4 and seen["use_gloo"]
    assert outcome == Completed({"status": "completed"})
