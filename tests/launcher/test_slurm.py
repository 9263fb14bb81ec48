"""cluster=slurm: the generated sbatch script and its submission.

The script's content is checked everywhere; where a Slurm controller answers (.ci/run starts a
single-node one with scripts/local_slurm.sh) `sbatch --test-only` checks the script and a real job
runs the training; the sweep path is exercised with a stand-in `sbatch` on PATH that records what it
was given.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import event_of, run_dir, run_train, slurm_answers


def _fake_sbatch(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.calls"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/bash\necho "$@" >> {log}\necho "$((4000 + $(wc -l < {log})))"\n')
    fake.chmod(0o755)
    return bin_dir


def test_script_has_one_agent_per_node_the_head_node_endpoint_requeue_and_signal(tmp_path: Path) -> None:
    proc = run_train(
        tmp_path,
        "cluster=slurm",
        "cluster.nodes=3",
        "cluster.min_nodes=2",
        "cluster.time_min=45",
        "cluster.partition=gpu",
        "cluster.gpus_per_node=4",
        "cluster.signal_grace_s=90",
        "cluster.submit=false",
        'cluster.extra_sbatch_args=["--account=proj"]',
        "run.name=big",
        "backend.nproc_per_node=4",
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = (run_dir(tmp_path, "big") / "slurm" / "job.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --time=45",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --signal=TERM@90",
        "#SBATCH --requeue",
        "#SBATCH --account=proj",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script, (line, script)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "-m pipeline.train" in srun
    assert 'backend.rdzv_endpoint="$HEAD_NODE":29400' in srun and "backend.nnodes=2:3" in srun
    assert "cluster=none" in srun and "cluster.nodes" not in srun and "backend.nproc_per_node=4" in srun
    # every node runs in the job's run folder, which is its sweep folder too (multirun.yaml inside it)
    assert f"hydra.sweep.dir={run_dir(tmp_path, 'big')} hydra.sweep.subdir=. run.name=big" in srun
    subprocess.run(["bash", "-n", str(run_dir(tmp_path, "big") / "slurm" / "job.sbatch")], check=True)


def test_slurm_accepts_the_script_with_test_only(tmp_path: Path) -> None:
    if not slurm_answers():
        pytest.skip("no Slurm controller answers `scontrol ping` here, so `sbatch --test-only` cannot run")
    proc = run_train(
        tmp_path, "cluster=slurm", "cluster.nodes=1", "cluster.time_min=5", "cluster.submit=false", "run.name=t", timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    test = subprocess.run(
        ["sbatch", "--test-only", str(run_dir(tmp_path, "t") / "slurm" / "job.sbatch")], capture_output=True, text=True
    )
    assert test.returncode == 0 and "to start at" in test.stderr + test.stdout, test.stderr


def test_each_job_of_a_sweep_is_submitted_as_its_own_slurm_job(tmp_path: Path) -> None:
    bin_dir = _fake_sbatch(tmp_path)
    env_path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    old = os.environ["PATH"]
    os.environ["PATH"] = env_path  # helpers.env() copies os.environ
    try:
        proc = run_train(tmp_path, "-m", "cluster=slurm", "cluster.nodes=2", "trainer.lr=0.01,0.02", timeout=60)
    finally:
        os.environ["PATH"] = old
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = (tmp_path / "sbatch.calls").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("--parsable ") and c.endswith("job.sbatch") for c in calls)
    scripts = [Path(c.split()[-1]) for c in calls]
    assert len({s.parent.parent for s in scripts}) == 2  # one run folder per point
    for script in scripts:
        assert event_of(script.parent.parent, "slurm_submitted")["slurm_job_id"].startswith("400")
    out = proc.stdout + proc.stderr
    assert "submitted as Slurm job 4001" in out and "submitted as Slurm job 4002" in out


def test_bad_cluster_values_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    proc = run_train(tmp_path, "cluster=slurm", "cluster.nodes=0", "cluster.submit=false", "run.name=x", timeout=60)
    assert proc.returncode != 0 and "cluster.nodes=0 is not allowed" in proc.stderr
    assert not (run_dir(tmp_path, "x") / "slurm").exists()


@pytest.mark.slow
def test_a_real_slurm_job_runs_the_training_to_completion(tmp_path: Path) -> None:
    """Needs a Slurm controller and a node that can read tmp_path (a single-node Slurm on localhost
    does: slurm-wlm + munge; see docs/multi-node.md, "Slurm")."""
    if not slurm_answers():
        pytest.skip("no Slurm controller answers `scontrol ping` here (a single-node slurmctld + slurmd + munge can provide one)")
    from helpers import QUICK, summary, wait_for

    proc = run_train(
        tmp_path,
        "cluster=slurm",
        "cluster.nodes=1",
        "cluster.time_min=5",
        "run.name=sl",
        *QUICK,
        "trainer.max_epochs=2",
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = run_dir(tmp_path, "sl")
    job_id = event_of(folder, "slurm_submitted")["slurm_job_id"]
    try:
        wait_for(
            lambda: (folder / "summary.json").is_file() and summary(folder).get("status") == "completed",
            180,
            f"Slurm job {job_id} to complete the training",
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert summary(folder)["world_size"] == 2
    assert (folder / "slurm" / f"{job_id}.out").is_file()
