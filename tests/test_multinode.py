"""Beyond one machine, rehearsed on this one: several launchers ("nodes") on localhost join one
job through a shared rendezvous endpoint (see README, "Beyond one machine")."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from helpers import QUICK, event_of, run_dir, start_train, stop, summary, wait_for

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_args(port: int, nnodes: str = "2", name: str = "big", *extra: str) -> list:
    return [*QUICK, "trainer.max_epochs=2", f"backend.nnodes={nnodes}", "backend.nproc_per_node=1",
            f"backend.rdzv_endpoint=localhost:{port}", f"run.name={name}", "backend.rdzv_timeout_s=60", *extra]


def finish(proc, timeout: float = 150) -> tuple:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_two_agents_complete_one_job_and_an_unrelated_launch_is_refused(tmp_path: Path) -> None:
    port = free_port()
    a = start_train(tmp_path, *node_args(port))
    b = start_train(tmp_path, *node_args(port))
    try:
        folder = run_dir(tmp_path, "big")
        wait_for(lambda: event_of(folder, "rendezvous"), 90, "the two nodes' rendezvous", a)
        # a single-node launch on the same folder while the multi-node job holds it: refused
        other = start_train(tmp_path, *QUICK, "run.name=big")
        rc, out = finish(other, 60)
        assert rc != 0 and "is in use by multi-node job c10d:big@localhost" in out, out[-3000:]
        # another multi-node job (another endpoint) on the same folder: refused too
        other = start_train(tmp_path, *node_args(free_port()))
        rc, out = finish(other, 60)
        assert rc != 0 and "is in use by multi-node job" in out, out[-3000:]
        (rc_a, out_a), (rc_b, out_b) = finish(a), finish(b)
    finally:
        stop(a), stop(b)
    assert rc_a == 0, out_a[-4000:]
    assert rc_b == 0, out_b[-4000:]
    s = summary(folder)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["epochs_completed"] == 2
    assert event_of(folder, "rendezvous")["world_size"] == 2


def test_a_node_that_sees_another_run_folder_is_refused(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    a = start_train(tmp_path / "n0", *node_args(port, "2", "big", "restart.max_restarts=0"))
    b = start_train(tmp_path / "n1", *node_args(port, "2", "big", "restart.max_restarts=0"))
    try:
        (rc_a, out_a), (rc_b, out_b) = finish(a), finish(b)
    finally:
        stop(a), stop(b)
    assert rc_a != 0 and rc_b != 0
    both = out_a + out_b
    assert "not every worker sees the run folder" in both, both[-6000:]
    assert str(tmp_path / "n1" / "outputs" / "big") in both or str(tmp_path / "n0" / "outputs" / "big") in both
    assert f"on {socket.gethostname()}" in both
