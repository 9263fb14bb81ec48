"""torch elastic's etcd rendezvous against a real etcd server (Debian's etcd-server, v2 API on)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest

from helpers import QUICK, event_of, free_port, run_dir, run_train, summary, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.extended]

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


@pytest.fixture
def etcd_server(tmp_path: Path):
    if not Path(ETCD).is_file():
        pytest.skip("no etcd server binary (/usr/bin/etcd): `apt-get install etcd-server` (scripts/setup.sh does it as root)")
    if find_spec("etcd") is None:
        pytest.skip("python-etcd is not installed: pip install -e '.[etcd]'")
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            ETCD,
            "--name",
            "test",
            "--data-dir",
            str(tmp_path / "etcd-data"),
            "--enable-v2",
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "etcd.log", "w"),
    )

    def up() -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{client}/v2/keys", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_for(up, 30, "etcd to serve the v2 API", proc)
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("rdzv", ["etcd-v2"])  # "etcd" (the older etcd rendezvous) passes too: add it to check
def test_two_workers_meet_through_a_real_etcd(tmp_path: Path, etcd_server: int, rdzv: str) -> None:
    proc = run_train(
        tmp_path,
        *QUICK,
        "trainer.max_epochs=2",
        f"backend.rdzv_backend={rdzv}",
        f"backend.rdzv_endpoint=127.0.0.1:{etcd_server}",
        "run.name=etcd",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = run_dir(tmp_path, "etcd")
    s = summary(folder)
    assert s["status"] == "completed" and s["world_size"] == 2
    assert event_of(folder, "rendezvous")["run_id"] == "etcd"
