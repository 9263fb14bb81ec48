"""cluster=slurm: each job becomes one Slurm batch job, submitted with a generated sbatch script.

Why a generated script rather than submitit: the script is a plain file in the run folder that a
person can read, re-submit by hand (`sbatch run_dir/slurm/job.sbatch`) and check with
`sbatch --test-only`; and the allocation runs exactly the command a user would type on a node
(`python -m <app> ... cluster=none`, the app named by hydra.launcher.app or the module this launcher
was started as), so nothing is pickled across Python versions.

Inside the allocation, `srun` starts one launcher (one torch elastic agent) per node; they meet at
a c10d rendezvous hosted on the first node of the allocation, all in the same run folder (shared
storage), which the multi-node run lock admits. `--signal=TERM@<grace>` makes Slurm send SIGTERM to
the launchers that long before the time limit: the workers save at the next step boundary and the
launchers exit with EXIT_PREEMPTED (75, or restart.preemption_exit_code); the script then requeues the job (`scontrol requeue`), and
the requeued job resumes in the same run folder. `--requeue` lets Slurm requeue it after a node
failure or a preemption by a higher-priority job too.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from steadfast.contract import events
from steadfast.contract.exits import exit_code
from steadfast.contract.files import atomic_write
from steadfast.contract.platforms import ENV_LAUNCHER_TASKS

from ._types import Job, cluster_from, job_return

log = logging.getLogger(__name__)

SCRIPT_NAME = "job.sbatch"


def cluster_of(config: DictConfig) -> Dict[str, Any]:
    """The job's cluster settings (hydra.launcher.cluster), as plain values."""
    import dataclasses

    return dataclasses.asdict(cluster_from(OmegaConf.select(config, "hydra.launcher.cluster")))


def app_command(app: Optional[str]) -> List[str]:
    """How a node starts the app: `-m MODULE` (hydra.launcher.app, or the module this process runs as), or its script."""
    if app:
        return ["-m", app]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ["-m", spec.name.removesuffix(".__main__")]
    return [os.path.abspath(sys.argv[0])]


def node_overrides(overrides: Sequence[str], cluster: Dict[str, Any], run_dir: Path) -> List[str]:
    """The command line each node runs: the job's own overrides, without the cluster group, in the
    same run folder, as one multi-node torchrun job whose rendezvous is on the first node."""
    kept = [
        o
        for o in overrides
        if not re.match(
            r"^[~+]*(cluster|hydra\.sweep\.dir|hydra\.sweep\.subdir|run\.name|backend\.nnodes|backend\.rdzv_endpoint)\b", o
        )
    ]
    nodes = int(cluster["nodes"])
    low = cluster.get("min_nodes") or nodes
    nnodes = f"{low}:{nodes}" if low != nodes else str(nodes)
    return [
        *kept,
        "cluster=none",
        f"backend.nnodes={nnodes}",
        "backend.rdzv_endpoint=$HEAD_NODE:" + str(cluster.get("rdzv_port", 29400)),
        f"hydra.sweep.dir={run_dir}",
        "hydra.sweep.subdir=.",
        f"run.name={run_dir.name}",
    ]


def sbatch_script(
    overrides: Sequence[str],
    cluster: Dict[str, Any],
    run_dir: Path,
    job_name: str,
    python: str = sys.executable,
    workdir: Optional[str] = None,
    app: Optional[str] = None,
    preemption_exit_code: Optional[int] = None,
) -> str:
    grace = int(cluster.get("signal_grace_s", 120))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={int(cluster['nodes'])}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={int(cluster['time_min'])}",
        f"#SBATCH --output={run_dir}/slurm/%j.out",
        f"#SBATCH --signal=TERM@{grace}",
        f"#SBATCH --chdir={workdir or os.getcwd()}",
    ]
    if cluster.get("partition"):
        lines.append(f"#SBATCH --partition={cluster['partition']}")
    if cluster.get("gpus_per_node"):
        lines.append(f"#SBATCH --gpus-per-node={int(cluster['gpus_per_node'])}")
    if cluster.get("cpus_per_node"):
        lines.append(f"#SBATCH --cpus-per-task={int(cluster['cpus_per_node'])}")
    lines.append("#SBATCH --requeue" if cluster.get("requeue", True) else "#SBATCH --no-requeue")
    lines += [f"#SBATCH {a}" for a in cluster.get("extra_sbatch_args") or []]
    args = " ".join(
        o.replace("$HEAD_NODE", '"$HEAD_NODE"') if o.startswith("backend.rdzv_endpoint=$HEAD_NODE") else shlex.quote(o)
        for o in node_overrides(overrides, cluster, run_dir)
    )
    requeue = "1" if cluster.get("requeue", True) else "0"
    preempted = exit_code(signal.SIGTERM, preemption_exit_code)
    lines += [
        "# Generated by the steadfast launcher (cluster=slurm). One launcher (one torch elastic agent)",
        "# per node; they meet at a c10d rendezvous on the first node of the allocation.",
        "set -u",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "export HEAD_NODE",
        # the srun tasks below are launchers (one per node), not workers: they start the workers themselves
        f"export {ENV_LAUNCHER_TASKS}=1",
        # srun forwards SIGTERM from --signal to every task; --kill-on-bad-exit=0 keeps the other
        # nodes running when one fails (elastic jobs continue on the survivors).
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.quote(python)} {' '.join(map(shlex.quote, app_command(app)))} {args}",
        "rc=$?",
        f'if [ "$rc" -eq {preempted} ] && [ {requeue} -eq 1 ]; then',
        '  echo "steadfast: stopped before the time limit with a checkpoint committed; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def submit(script: Path, sbatch: Optional[str] = None, array: Optional[str] = None) -> str:
    """sbatch the script; returns Slurm's job id."""
    sbatch = sbatch or shutil.which("sbatch")
    if not sbatch:
        raise RuntimeError(
            f"cluster=slurm needs `sbatch` on PATH (run the launch on a Slurm login node); the generated script is {script}"
        )
    cmd = [sbatch, "--parsable", *(["--array", array] if array else []), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def submit_jobs(jobs: List[Job]) -> List[JobReturn]:
    """cluster=slurm: every job becomes one Slurm batch job (a sweep: one per point). The cluster
    settings were checked with the rest of the jobs' config (pre-flight)."""
    returns = []
    for job in jobs:
        assert job.run_dir is not None
        cluster = cluster_of(job.config)
        script = job.run_dir / "slurm" / SCRIPT_NAME
        script.parent.mkdir(parents=True, exist_ok=True)
        app = OmegaConf.select(job.config, "hydra.launcher.app")
        name = f"steadfast-{job.run_dir.name}"
        text = sbatch_script(
            job.overrides, cluster, job.run_dir, name, app=app, preemption_exit_code=job.restart.preemption_exit_code
        )
        atomic_write(script, text)
        if not cluster.get("submit", True):
            log.info("%s: wrote %s (cluster.submit=false: not submitted)", job.label, script)
            returns.append(job_return(job, JobStatus.COMPLETED, {"slurm_script": str(script)}))
            continue
        job_id = submit(script)
        events.write(job.run_dir, events.SlurmSubmitted(slurm_job_id=job_id, script=str(script), nodes=cluster["nodes"]))
        log.info(
            "%s: submitted as Slurm job %s (%d node(s)); script %s, output %s/slurm/<job id>.out",
            job.label,
            job_id,
            cluster["nodes"],
            script,
            job.run_dir,
        )
        returns.append(job_return(job, JobStatus.COMPLETED, {"slurm_job_id": job_id, "slurm_script": str(script)}))
    return returns


def wanted(jobs: List[Job]) -> bool:
    """Does any job of this launch ask for Slurm (cluster=slurm)?"""
    return any(cluster_of(j.config).get("name") == "slurm" for j in jobs)
