"""Library mode (docs/platforms.md): the own-loop app of docs/own-loop.md, unchanged, as one rank of a
job that another platform started: how each platform is recognised, its exit codes, a group the
platform initialised, the watchdog in the worker; then real jobs: a plain `torchrun --max-restarts=3`
and `srun` in a real Slurm job (skipped where no Slurm controller answers). In each a worker is
SIGKILLed and the run ends with the same weights as the app under the steadfast launcher with a worker
killed; a SIGTERM ends at an agreed, committed step and the same command continues. Kubernetes:
test_kubernetes.py; Ray Train: test_ray.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from platform_runs import APP, assert_restored_from_memory, beat_of, kill, make_app, output, torchrun_cmd

from helpers import committed_steps, env, events, run_dir, slurm_answers, summary, wait_for
from steadfast.contract import platforms
from steadfast.contract.exits import EXIT_PLATFORM_PREEMPTED, RETRIED_BY_KUBEFLOW, exit_code
from steadfast.contract.schemas import RestartConf

# ---- recognising a platform, exit codes (no processes) --------------------------------------------


def test_each_platform_is_recognised_from_its_variables_and_ours_never() -> None:
    torchrun = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "9",
        "TORCHELASTIC_RUN_ID": "r",
        "GROUP_RANK": "0",
    }
    found = platforms.detect(torchrun)
    assert found is not None and found.name == "torchelastic" and (found.rank, found.world_size) == (1, 2)
    assert found.job == "torchelastic r@h:9" and found.torch_environ() == {}
    srun = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"}
    srun.update(SLURM_JOB_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[07-08]", SLURM_NODEID="1")
    found = platforms.detect(srun)
    assert found is not None and found.name == "slurm" and (found.rank, found.world_size, found.node) == (3, 4, "1")
    assert found.torch_environ() == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "20077",
    }
    assert platforms.detect({**srun, **torchrun}).name == "torchelastic"  # type: ignore[union-attr]  # torchrun under srun
    ray = {"RAY_JOB_ID": "01000000", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41000"}
    found = platforms.detect({**ray, "NODE_RANK": "1", "LOCAL_RANK": "0", "RAY_RAYLET_PID": "9"})
    assert found is not None and found.name == "ray" and (found.rank, found.world_size, found.node) == (1, 2, "1")
    assert found.job == "ray 01000000@10.0.0.5:41000" and found.torch_environ() == {}
    pod = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2", "PET_NNODES": "3"}
    found = platforms.detect(pod)
    assert found is not None and found.name == "torch-env" and found.node == "2" and found.job == "torch-env job-master-0:23456"
    assert platforms.detect({**srun, "SLURM_NTASKS": "1"}) is None  # one task: a launcher of ours starts the workers
    assert platforms.detect({**torchrun, "STEADFAST_RUN_DIR": "/r"}) is None  # a worker the steadfast launcher started
    assert platforms.detect({**srun, platforms.ENV_LAUNCHER_TASKS: "1"}) is None  # our sbatch script's launchers
    assert platforms.detect({"PATH": "/bin"}) is None
    assert platforms.first_host("cpu1") == "cpu1" and platforms.first_host("a[1,3-5],b") == "a1"


def test_preemption_exit_codes_for_a_person_and_for_a_platform() -> None:
    assert exit_code(signal.SIGTERM) == 75 and exit_code(signal.SIGINT) == 130
    assert exit_code(signal.SIGTERM, library=True) == EXIT_PLATFORM_PREEMPTED == 143 and 143 in RETRIED_BY_KUBEFLOW
    assert exit_code(signal.SIGHUP, configured=138) == 138 and exit_code(signal.SIGINT, configured=138, library=True) == 130
    assert RestartConf(preemption_exit_code=143).problems() == []
    (problem,) = RestartConf(preemption_exit_code=0).problems()
    assert problem.startswith("restart.preemption_exit_code=0") and "1-255" in problem


def test_a_restarted_group_meets_in_a_namespace_nobody_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch elastic's shared store keeps the keys of every earlier incarnation; each incarnation's
    ranks agree on a generation of their own, even with a stale request left in the store."""
    import torch.distributed as dist

    from steadfast.distributed import group_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    server.append(group_store.ASKS, "stale-nonce;")  # an incarnation whose rank 0 died before answering

    def incarnation() -> List[Optional[str]]:
        got: List[Optional[str]] = [None] * 3

        def rank(r: int) -> None:
            store = group_store.fresh_store(r, 3, 30)
            assert store is not None
            store.set(f"hello{r}", "x")  # under the generation's prefix
            got[r] = "ok"

        threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return got

    assert incarnation() == ["ok"] * 3
    assert server.add(group_store.COUNTER, 0) == 1
    assert incarnation() == ["ok"] * 3
    assert server.add(group_store.COUNTER, 0) == 2
    assert server.check([f"steadfast/{g}/hello{r}" for g in (1, 2) for r in range(3)])
    assert not server.check([group_store.ASKS])  # every request answered and cleared


def test_a_process_group_the_platform_initialised_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train initialises the default group before the training function runs: the library uses it
    (a second one would meet on the same port), destroys only its own control group, and refuses a
    group that is not the rank the variables say."""
    import torch.distributed as dist

    from steadfast.distributed.comm import TorchDistComm

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comm = TorchDistComm(timeout_s=30)
        assert comm.owns_group is False and comm.max_each([1.0, 2.0]) == [1.0, 2.0]
        comm.shutdown()
        assert dist.is_initialized() and dist.get_world_size() == 1  # still the platform's
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match="rank 0 of 1, but RANK=0 and WORLD_SIZE=2"):
            TorchDistComm(timeout_s=30)
    finally:
        dist.destroy_process_group()


WATCHED = """
import sys, threading, time
from pathlib import Path
from steadfast.contract.heartbeat import start_heartbeat
from steadfast.contract.schemas import RestartConf
from hydra_plugins.steadfast_launcher._selfwatch import SelfWatch

run = Path(sys.argv[1])


def stuck_in_the_loop():
    time.sleep(120)


def task():  # in a thread of its own, as Ray Train runs the training function
    start_heartbeat(run, 1).beat(5, "train")
    SelfWatch(run, 1, RestartConf(hang_timeout_s=1.0, startup_timeout_s=1.0)).start()
    stuck_in_the_loop()


thread = threading.Thread(target=task)
thread.start()
thread.join()
"""


def test_a_worker_without_progress_writes_its_stacks_and_ends_itself(tmp_path: Path) -> None:
    """Library mode's watchdog lives in the worker: no progress for restart.hang_timeout_s, and the
    worker records where its task was (in the task's thread, which under Ray Train is not the main
    one) and kills itself with SIGKILL for its platform to restart it."""
    proc = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "no progress for" in proc.stderr and "ending this worker (SIGKILL)" in proc.stderr, proc.stderr
    (hang,) = [e for e in events(tmp_path) if e["event"] == "hang_detected"]
    assert hang["rank"] == 1 and hang["step"] == 5 and hang["where"].endswith("in stuck_in_the_loop"), hang
    assert "stuck_in_the_loop" in (tmp_path / "logs" / "stacks" / "rank1.txt").read_text()


# ---- real processes ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_inside_a_platform_job_is_refused_in_one_line(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    pod = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "1", "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "lr=0.1,0.2"],
        cwd=app,
        env={**env(), **pod},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    assert len(lines) == 1 and "a sweep cannot run inside a job that a platform that sets torch's variables" in lines[0], lines
    assert not (app / "outputs").exists() or not any((app / "outputs").rglob("*.yaml")), list((app / "outputs").rglob("*"))


@pytest.mark.slow
@pytest.mark.alone
def test_plain_torchrun_with_kills_and_a_preemption_ends_with_the_launchers_weights(
    tmp_path: Path, platform_reference: Dict[str, Any]
) -> None:
    """`torchrun --nproc-per-node=2 --max-restarts=3 train.py`: rank 1 SIGKILLed twice (torch elastic
    restarts the group; each restart restores the snapshot in memory), then SIGTERM to torchrun
    (the workers agree on a step and commit it); the same command again finishes the run."""
    app = make_app(tmp_path)
    folder = run_dir(app, "own_default")
    command = torchrun_cmd("--nproc-per-node=2", "--max-restarts=3", "train.py", *APP)
    proc = subprocess.Popen(
        command, cwd=app, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    reached = []
    try:
        for restart, step in enumerate((20, 60)):
            beat = wait_for(lambda r=restart, s=step: beat_of(folder, 1, r, s), 120, f"rank 1 past step {step}", proc)
            reached.append(kill(folder, beat["pid"]))
        wait_for(lambda: beat_of(folder, 0, 2, 100), 120, "rank 0 past step 100 after two restarts", proc)
        os.kill(proc.pid, signal.SIGTERM)  # what a scheduler does to the job's main process
        code = proc.wait(timeout=120)
    finally:
        out = output(proc)
    stopped = summary(folder)
    assert stopped["status"] == "preempted" and stopped["stop_saved"] is True, (stopped, out[-3000:])
    assert stopped["stop_step"] in committed_steps(folder) and stopped["stop_step"] >= 100, stopped
    assert stopped["restarts"] == 2 and len(stopped["failures"]) == 2, stopped
    assert all(f.startswith("rank 1 ") and "killed by a signal" in f for f in stopped["failures"]), stopped["failures"]
    assert code != 0, out[-2000:]  # torchrun's own code after a SIGTERM (1): the workers exited 143
    assert_restored_from_memory(folder, reached)

    again = subprocess.run(command, cwd=app, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = summary(folder)
    assert done["status"] == "completed" and done["resumed_from_step"] == stopped["stop_step"], done
    assert done["model_sha256"] == platform_reference["model_sha256"], (done, platform_reference)


@pytest.mark.slow
@pytest.mark.alone
def test_srun_with_a_task_killed_and_a_preemption_ends_with_the_launchers_weights(
    tmp_path: Path, platform_reference: Dict[str, Any]
) -> None:
    """`srun --ntasks=2 python train.py` in a real Slurm job (a single-node Slurm: scripts/local_slurm.sh).
    Nothing restarts a task: rank 1 SIGKILLed at step 30 ends the step, and the same command again
    resumes from the snapshot in memory; `scancel --signal=TERM` (what Slurm sends at a preemption,
    and before the time limit with --signal) stops every task at an agreed, committed step, exit 143;
    the same command again finishes the run."""
    if not slurm_answers():
        pytest.skip("no Slurm controller answers `scontrol ping` here (bash scripts/local_slurm.sh starts one, as root)")
    app = make_app(tmp_path)
    folder = run_dir(app, "own_default")
    name = f"steadfast-{tmp_path.name}"  # scancel finds the job by it
    command = ["srun", "--ntasks=2", f"--job-name={name}", sys.executable, "train.py", *APP]

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            command, cwd=app, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

    try:
        proc = start()
        try:
            beat = wait_for(lambda: beat_of(folder, 1, 0, 30), 120, "rank 1 past step 30", proc)
            reached = [kill(folder, beat["pid"])]
            killed = proc.wait(timeout=120)  # srun ends the step: rank 0 lost its peer and exits 143
        finally:
            out = output(proc)
        assert killed != 0 and summary(folder)["status"] == "failed", out[-3000:]

        proc = start()  # the same command: an incarnation of the same launch, restart 1
        try:
            wait_for(lambda: beat_of(folder, 0, 1, 100), 120, "rank 0 past step 100 in the second srun", proc)
            subprocess.run(["scancel", "--signal=TERM", f"--name={name}"], check=True, timeout=30)
            code = proc.wait(timeout=120)
        finally:
            out = output(proc)
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30)
    assert code == 143, out[-3000:]  # every task's restart.preemption_exit_code
    stopped = summary(folder)
    assert stopped["status"] == "preempted" and stopped["stop_saved"] is True, (stopped, out[-3000:])
    assert stopped["stop_step"] in committed_steps(folder) and stopped["stop_step"] >= 100, stopped
    assert stopped["restarts"] == 1 and len(stopped["failures"]) == 1, stopped
    assert stopped["failures"][0].startswith("rank 1 ") and "killed by a signal" in stopped["failures"][0], stopped
    assert_restored_from_memory(folder, reached)

    again = subprocess.run(command, cwd=app, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = summary(folder)
    assert done["status"] == "completed" and done["resumed_from_step"] == stopped["stop_step"], done
    assert done["model_sha256"] == platform_reference["model_sha256"], (done, platform_reference)
