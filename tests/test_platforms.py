"""Library mode (docs/platforms.md): the own-loop app of docs/own-loop.md, unchanged, as one rank of a
job that another platform started: a plain `torchrun --max-restarts=3`, and processes started with
exactly the variables a Kubeflow PyTorchJob sets, restarted when they exit with a code its training
operator retries (a pod restart, emulated). In each a worker is SIGKILLed and the run ends with the
same weights as the app under the steadfast launcher with a worker killed; a SIGTERM under torchrun
ends at an agreed, committed step and the same command continues. Kubernetes itself cannot run here:
the operator's part is the small loop below (which exit codes it retries: its IsRetryableExitCode).
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
from test_docs import GUIDE, marked_files

from helpers import committed_steps, env, events, run_dir, slurm_answers, summary, wait_for
from steadfast.contract import platforms
from steadfast.contract.exits import EXIT_PLATFORM_PREEMPTED, RETRIED_BY_KUBEFLOW, exit_code
from steadfast.contract.heartbeat import read_heartbeats
from steadfast.contract.pids import alive
from steadfast.contract.schemas import RestartConf

# 192 steps, a snapshot in memory at every step, a checkpoint every 40 steps. The run is still
# outputs/own_default: epochs is in the app's run.safe_to_change, snapshot.* and checkpoint.* never
# name a run.
APP = ["epochs=6", "snapshot.every_n_steps=1", "checkpoint=every_n_steps", "checkpoint.every_n_steps=40"]


def make_app(folder: Path) -> Path:
    for path, text in marked_files(GUIDE).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def torchrun_cmd(*args: str) -> List[str]:
    script = Path(sys.executable).with_name("torchrun")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, *args]


def output(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return out or ""


def beat_of(folder: Path, rank: int, restart: int, step: int) -> Any:
    beat = read_heartbeats(folder).get(rank)
    ok = beat and beat.get("restart") == restart and beat.get("phase") == "train" and beat["step"] >= step
    return beat if ok else None


def kill(folder: Path, pid: int) -> int:
    """SIGKILL `pid`; once it is gone, the furthest step any rank's heartbeat shows (its restart
    starts seconds later: imports)."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, f"pid {pid} gone")
    return max(b["step"] for b in read_heartbeats(folder).values())


def assert_restored_from_memory(folder: Path, reached: List[int]) -> None:
    """Each restart restored the newest snapshot in memory: at most one step (the interval) behind
    the furthest step reached (from disk only when the kill landed on a checkpoint's step)."""
    restored = [e for e in events(folder) if e["event"] == "resumed"]
    assert len(restored) == len(reached), restored
    for got, furthest in zip(restored, reached):
        assert got["source"] == "memory" or got["step"] % 40 == 0, restored
        assert 0 <= furthest - got["step"] <= 1, (reached, restored)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any) -> Dict[str, Any]:
    """The app under the steadfast launcher (`python train.py`), rank 1 killed at step 50 by the
    library's rehearsal: its summary."""
    app = make_app(tmp_path_factory.mktemp("reference"))
    fault = ["fault=kill_rank", "fault.rank=1", "fault.at_step=50"]
    proc = subprocess.run(
        [sys.executable, "train.py", *APP, *fault], cwd=app, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (found,) = (app / "outputs").glob("*/summary.json")
    result = summary(found.parent)
    assert result["status"] == "completed" and result["restarts"] == 1, result
    return result


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


WATCHED = """
import sys, time
from pathlib import Path
from steadfast.contract.heartbeat import start_heartbeat
from steadfast.contract.schemas import RestartConf
from hydra_plugins.steadfast_launcher._selfwatch import SelfWatch

run = Path(sys.argv[1])
start_heartbeat(run, 1).beat(5, "train")
SelfWatch(run, 1, RestartConf(hang_timeout_s=1.0, startup_timeout_s=1.0)).start()


def stuck_in_the_loop():
    time.sleep(120)


stuck_in_the_loop()
"""


def test_a_worker_without_progress_writes_its_stacks_and_ends_itself(tmp_path: Path) -> None:
    """Library mode's watchdog lives in the worker: no progress for restart.hang_timeout_s, and the
    worker records where it was and kills itself with SIGKILL for its platform to restart it."""
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
    tmp_path: Path, reference: Dict[str, Any]
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
    assert done["model_sha256"] == reference["model_sha256"], (done, reference)


@pytest.mark.slow
@pytest.mark.alone
def test_srun_with_a_task_killed_and_a_preemption_ends_with_the_launchers_weights(tmp_path: Path, reference: Dict[str, Any]) -> None:
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
    assert done["model_sha256"] == reference["model_sha256"], (done, reference)


class Operator:
    """Kubeflow's training operator for a PyTorchJob of one process per pod, restartPolicy ExitCode: a pod
    whose container exits with a code it retries is started again (same variables), any other failure
    fails the job."""

    def __init__(self, app: Path, world_size: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app, self.world_size = app, world_size
        self.pods: Dict[int, subprocess.Popen] = {}
        self.restarts: List[int] = []
        self.logs: Dict[int, List[str]] = {r: [] for r in range(world_size)}
        for rank in range(world_size):
            self._start(rank)

    def variables(self, rank: int) -> Dict[str, str]:
        """What the operator sets in the pod of `rank` (its envvar.go; MASTER_ADDR is the master pod's service)."""
        return {
            "PYTHONUNBUFFERED": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(rank),
            "PET_NNODES": str(self.world_size),
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(self.port),
        }

    def _start(self, rank: int) -> None:
        self.pods[rank] = subprocess.Popen(
            [sys.executable, "train.py", *APP],
            cwd=self.app,
            env={**env(), **self.variables(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def step(self) -> Optional[bool]:
        """Restart what the operator restarts; True once every pod succeeded (the job did)."""
        for rank, pod in list(self.pods.items()):
            if pod.poll() is None or pod.returncode == 0:
                continue
            code = pod.returncode if pod.returncode > 0 else 128 - pod.returncode  # a container's exit code
            self.logs[rank].append(output(pod))
            if code not in RETRIED_BY_KUBEFLOW or len(self.restarts) >= 8:
                raise AssertionError(f"pod {rank} failed with exit code {code}: the job fails\n{self.logs[rank][-1][-3000:]}")
            self.restarts.append(code)
            self._start(rank)
        return all(p.poll() == 0 for p in self.pods.values()) or None

    def stop(self) -> None:
        for pod in self.pods.values():
            output(pod)


@pytest.mark.slow
@pytest.mark.alone
def test_a_pytorchjob_with_a_pod_killed_restarts_and_ends_with_the_launchers_weights(
    tmp_path: Path, reference: Dict[str, Any]
) -> None:
    app = make_app(tmp_path)
    folder = run_dir(app, "own_default")
    operator = Operator(app, 2)
    try:

        def past(step: int = 30) -> Any:
            operator.step()
            return beat_of(folder, 1, 0, step)

        beat = wait_for(past, 120, "rank 1 past step 30")
        reached = [kill(folder, beat["pid"])]
        wait_for(operator.step, 240, "the job to succeed")
    finally:
        operator.stop()
    assert 137 in operator.restarts and set(operator.restarts) <= set(RETRIED_BY_KUBEFLOW), operator.restarts
    done = summary(folder)
    assert done["status"] == "completed" and done["model_sha256"] == reference["model_sha256"], (done, reference)
    assert done["restarts"] >= 1 and done["failures"][0].startswith("rank 1 (pid "), done
    assert "killed by a signal" in done["failures"][0] and "rank(s) 0 failed as a consequence" in done["failures"][0], done
    first, *later = [e for e in events(folder) if e["event"] == "resumed"]
    assert first["source"] == "memory" and 0 <= reached[0] - first["step"] <= 1, (reached, first)
    assert all(e["step"] >= first["step"] for e in later), later  # a pod restarted again resumes where the run stood
