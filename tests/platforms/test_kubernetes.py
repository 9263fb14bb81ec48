"""docs/kubernetes.md's manifests rehearsed with real processes (Kubernetes itself cannot run here): the
own-loop app started from each manifest's command as two processes, one per "pod", with exactly the
variables each pod gets and an emptyDir of its own for /dev/shm, and the operator's part (which
exit codes it retries, whether it recreates one pod or all) as the small loop below. A pod is
SIGKILLed and the run ends with the weights of the app under the steadfast launcher.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from platform_runs import APP, beat_of, kill, make_app, output

from helpers import GUIDE, env, events, marked_files, run_dir, summary, wait_for
from steadfast.contract.exits import RETRIED_BY_KUBEFLOW

K8S_GUIDE = GUIDE.with_name("kubernetes.md")


def manifest(name: str) -> Dict[str, Any]:
    """One of docs/kubernetes.md's manifests, with the pod template's parts every manifest there must
    have checked: one container whose command is the app's, /dev/shm a memory emptyDir, the run folder
    on a claim under the working directory."""
    import yaml

    found = yaml.safe_load(marked_files(K8S_GUIDE)[name])
    templates = [s["template"] for s in found["spec"].get("pytorchReplicaSpecs", {}).values()]
    templates += [j["template"]["spec"]["template"] for j in found["spec"].get("replicatedJobs", [])]
    for pod in templates:
        (container,) = pod["spec"]["containers"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert container["command"] == ["python", "train.py"], container
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", mounts
        assert "persistentVolumeClaim" in mounts[container["workingDir"] + "/outputs"], mounts
    return found


class Operator:
    """Kubernetes' part for pods of one worker each, all on this machine: every pod starts with the
    variables it gets and an emptyDir of its own for /dev/shm (STEADFAST_SHM_DIR). A pod that exits with
    a code in `retried` is recreated, with a fresh emptyDir (`restart_all`: every pod is stopped with
    SIGTERM, as a pod's deletion does, and all are recreated, as a JobSet restarts); any other failure
    fails the job."""

    def __init__(
        self, app: Path, world_size: int, variables: Any, retried: Any, restart_all: bool = False, port: Optional[int] = None
    ) -> None:
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.app, self.world_size, self.port = app, world_size, port
        self.variables, self.retried, self.restart_all = variables, set(retried), restart_all
        self.pods: Dict[int, subprocess.Popen] = {}
        self.restarts: List[int] = []
        self.logs: Dict[int, List[str]] = {r: [] for r in range(world_size)}
        self.created = 0
        for rank in range(world_size):
            self._start(rank)

    def _start(self, rank: int) -> None:
        self.created += 1
        empty_dir = self.app / "emptydirs" / f"pod{rank}-{self.created}"
        empty_dir.mkdir(parents=True)
        self.pods[rank] = subprocess.Popen(
            [sys.executable, "train.py", *APP],  # the manifests' command, with the test's overrides
            cwd=self.app,
            env={**env(), **self.variables(self.port, rank), "PYTHONUNBUFFERED": "1", "STEADFAST_SHM_DIR": str(empty_dir)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def step(self) -> Optional[bool]:
        """Recreate what the policy recreates; True once every pod succeeded (the job did)."""
        for rank, pod in list(self.pods.items()):
            if pod.poll() is None or pod.returncode == 0:
                continue
            code = pod.returncode if pod.returncode > 0 else 128 - pod.returncode  # a container's exit code
            self.logs[rank].append(output(pod))
            if code not in self.retried or len(self.restarts) >= 8:
                raise AssertionError(f"pod {rank} failed with exit code {code}: the job fails\n{self.logs[rank][-1][-3000:]}")
            self.restarts.append(code)
            if not self.restart_all:
                self._start(rank)
                continue
            for other, left in self.pods.items():
                if left.poll() is None:
                    os.killpg(left.pid, signal.SIGTERM)  # the pod deleted: SIGTERM, then SIGKILL after its grace period
                    try:
                        left.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    self.logs[other].append(output(left))
            for other in range(self.world_size):
                self._start(other)
            return None
        return all(p.poll() == 0 for p in self.pods.values()) or None

    def stop(self) -> None:
        for pod in self.pods.values():
            output(pod)


def pytorchjob_variables(port: int, rank: int) -> Dict[str, str]:
    """What the training operator sets in the pod of `rank` (its envvar.go; MASTER_ADDR is the master pod's service)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }


def run_operator(app: Path, operator_of: Any) -> Tuple[Operator, List[int]]:
    """The job on `operator_of(app)`, rank 1's pod SIGKILLed once it passes step 50, until the job succeeds."""
    folder = run_dir(app, "own_default")
    operator = operator_of(app)
    try:

        def past(step: int = 50) -> Any:
            operator.step()
            return beat_of(folder, 1, 0, step)

        beat = wait_for(past, 120, "rank 1 past step 50")
        reached = [kill(folder, beat["pid"])]
        wait_for(operator.step, 240, "the job to succeed")
    finally:
        operator.stop()
    return operator, reached


def assert_resumed_from_disk_exact(folder: Path, reached: List[int], reference: Dict[str, Any]) -> None:
    """Recreated pods have fresh emptyDirs: the run resumed from its newest checkpoint on disk, ends exact."""
    done = summary(folder)
    assert done["status"] == "completed" and done["model_sha256"] == reference["model_sha256"], (done, reference)
    assert done["restarts"] >= 1 and done["failures"][0].startswith("rank 1 (pid "), done
    assert "killed by a signal" in done["failures"][0] and "rank(s) 0 failed as a consequence" in done["failures"][0], done
    first, *later = [e for e in events(folder) if e["event"] == "resumed"]
    assert first["source"] == "disk" and 40 <= first["step"] <= reached[0], (reached, first)
    assert all(e["step"] >= first["step"] for e in later), later  # a pod recreated again resumes where the run stood


@pytest.mark.slow
@pytest.mark.alone
def test_a_pytorchjob_with_a_pod_killed_restarts_and_ends_with_the_launchers_weights(
    tmp_path: Path, platform_reference: Dict[str, Any]
) -> None:
    """docs/kubernetes.md's PyTorchJob: two pods of `python train.py` with the operator's variables,
    restartPolicy ExitCode (a pod exiting with a code IsRetryableExitCode retries is recreated)."""
    specs = manifest("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    assert {s["restartPolicy"] for s in specs.values()} == {"ExitCode"} and sum(s["replicas"] for s in specs.values()) == 2
    app = make_app(tmp_path)
    operator, reached = run_operator(app, lambda app: Operator(app, 2, pytorchjob_variables, RETRIED_BY_KUBEFLOW))
    assert 137 in operator.restarts and set(operator.restarts) <= set(RETRIED_BY_KUBEFLOW), operator.restarts
    assert_resumed_from_disk_exact(run_dir(app, "own_default"), reached, platform_reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.alone
def test_a_jobset_with_a_pod_killed_restarts_every_pod_and_ends_with_the_launchers_weights(
    tmp_path: Path, platform_reference: Dict[str, Any]
) -> None:
    """docs/kubernetes.md's JobSet: the variables its pod template sets (RANK: the completion index),
    its pod failure policy (FailJob on any exit but the retryable ones) and its restart of every pod."""
    jobset = manifest("jobset.yaml")["spec"]
    assert jobset["failurePolicy"]["rules"] == [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    (workers,) = jobset["replicatedJobs"]
    job = workers["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "NotIn", rule
    given = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    assert set(given) == {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}, given
    assert (
        given["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    world = job["parallelism"]
    assert given["WORLD_SIZE"]["value"] == str(world) == "2"

    def variables(port: int, rank: int) -> Dict[str, str]:  # the manifest's; its MASTER_ADDR is pod 0's name there
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": given["WORLD_SIZE"]["value"],
            "RANK": str(rank),
        }

    app = make_app(tmp_path)
    operator, reached = run_operator(
        app, lambda app: Operator(app, world, variables, rule["onExitCodes"]["values"], restart_all=True)
    )
    assert operator.restarts[0] in (137, 143), operator.restarts
    assert_resumed_from_disk_exact(run_dir(app, "own_default"), reached, platform_reference)
