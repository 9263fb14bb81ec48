"""One sweep job in its own launcher process, for sweeps that run jobs in parallel
(hydra.launcher.max_parallel_jobs > 1): `JobProcess` in the sweep's launcher, `main` in the child
(`python -m hydra_plugins.steadfast_launcher._jobproc PAYLOAD SHA256 SIZE RESULT`).

Hydra's process-wide state (HydraConfig, the working directory, logging, signal handlers,
environment variables the backends set) is per process, so jobs that run at once never share it.
The child gets the job composed and checked by the parent, Hydra's singletons and the task
function through a payload file in the sweep's private scratch folder (0700; checked against the
sha256 on its command line before it is unpickled), runs it exactly as the sequential path does
(`run_one`), and leaves its outcome in RESULT in the same folder, which the parent reads when the
child ends. The child's output is forwarded line by line, prefixed with the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import IO, Any, Dict, List, Optional, TextIO, Tuple

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

from steadfast.contract.stop import signal_name

from . import _backends, _payload
from ._compat.hydra_job_return import returned
from ._context import LaunchContext
from ._job import run_one
from ._ledger import COMPLETED, FAILED, INTERRUPTED
from ._packing import Machine
from ._payload import PayloadRef
from ._signals import handling_signals
from ._types import Interrupted, Job, JobFailed, job_return

log = logging.getLogger(__name__)
_print_lock = threading.Lock()


class JobProcess:
    """The parent's handle on one job's launcher process, which runs in its own session."""

    def __init__(self, ctx: LaunchContext, job: Job, box: Machine, units: List[int], scratch: Path) -> None:
        self.job, self.units, self.stop_sent = job, units, False
        self.result_path = scratch / f"job{job.idx}.result"
        config = ctx.config
        ref = _payload.write(
            scratch,
            f"job{job.idx}.payload",
            {
                "parent": os.getpid(),
                "hydra_state": Singleton.get_state(),
                "hydra_context": ctx.hydra_context,
                "task_function": ctx.task_function,
                "job": job,
                "hydra_logging": config.hydra.hydra_logging,
                "verbose": config.hydra.verbose,
                "cpus": list(units) if box.kind == "cpu" else None,
            },
        )
        env = dict(os.environ)
        ours = [os.getcwd() if p == "" else p for p in sys.path if p == "" or not p.startswith((sys.prefix, sys.base_prefix))]
        env["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(ours), env.get("PYTHONPATH", "")]).strip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        where = ""
        if box.kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(box.labels[u] for u in units)
            where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}"
        elif box.kind == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(units) // max(1, job.procs))))
            where = f" on CPU {','.join(str(u) for u in units)}"
        log.info("Launching %s on %s%s", job.label, _backends.of(job.backend).describe(), where)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", __name__, ref.path, ref.sha256, str(ref.size), str(self.result_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        prefix = f"[job #{job.idx}] "
        self.threads = [
            threading.Thread(target=_forward, args=(stream, sink, prefix), daemon=True)
            for stream, sink in ((self.popen.stdout, sys.stdout), (self.popen.stderr, sys.stderr))
        ]
        for t in self.threads:
            t.start()

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self, signum: int) -> None:
        """Forward a stop request to the job's launcher process; its agent stops the workers."""
        self.stop_sent = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signum)

    def kill(self) -> None:
        """The whole job (its launcher process and every worker): they share its session's process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def outcome(self) -> Tuple[str, Optional[JobReturn], str]:
        """(status, the job's JobReturn, a note) once the process has ended. INTERRUPTED comes with
        no JobReturn (the sweep words it), and a note when the process ended without a result."""
        for t in self.threads:
            t.join(timeout=5)
        try:
            with open(self.result_path, "rb") as f:  # in the sweep's private scratch folder, never outputs/
                out = cloudpickle.load(f)
        except Exception:  # missing, cut short, or unpicklable: the process ended without a result
            out = None
        job = self.job
        if not isinstance(out, dict):
            code = self.popen.returncode
            how = f"killed by {signal_name(-code, unknown='a signal')}" if code is not None and code < 0 else f"exit code {code}"
            if self.stop_sent:
                return INTERRUPTED, None, f"; its launcher process ended ({how})"
            return (
                FAILED,
                job_return(
                    job,
                    JobStatus.FAILED,
                    JobFailed(f"{job.label}: its launcher process ended ({how}) without a result; see its output above"),
                ),
                "",
            )
        job.restarts = out.get("restarts", 0)
        if out["status"] == INTERRUPTED:
            return INTERRUPTED, None, ""
        return out["status"], out["ret"], ""


def _forward(stream: IO[bytes], sink: TextIO, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with _print_lock:
            try:
                sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                sink.flush()
            except (OSError, ValueError):
                pass
    stream.close()


# ---- in the job's own launcher process ---------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when the launcher that started it dies (Linux), so the agent stops its workers."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _portable(ret: JobReturn) -> JobReturn:
    """The JobReturn as the parent can unpickle it: an exception or value that does not survive becomes a JobFailed."""
    try:
        cloudpickle.loads(cloudpickle.dumps(ret))
        return ret
    except Exception as exc:
        value = returned(ret)
        if ret.status == JobStatus.COMPLETED:
            ret.status = JobStatus.FAILED
            ret.return_value = JobFailed(f"the task's return value could not be pickled back to the launcher: {exc}")
        else:
            ret.return_value = JobFailed(f"{type(value).__name__}: {value}")
        return ret


def main(payload: PayloadRef, result_path: str) -> int:
    p: Dict[str, Any] = _payload.load(payload)
    if p.get("cpus"):
        os.sched_setaffinity(0, p["cpus"])
    _die_with_parent(p["parent"])

    from hydra.core.utils import configure_log, setup_globals

    Singleton.set_state(p["hydra_state"])
    setup_globals()
    configure_log(p["hydra_logging"], p["verbose"])
    job: Job = p["job"]
    state: Dict[str, Any] = {"signum": None, "in_job": True}

    def on_signal(signum: int, frame: Optional[FrameType]) -> None:
        state["signum"] = state["signum"] or signum
        if state["in_job"]:
            raise Interrupted(signum=signum)

    out: Dict[str, Any]
    with handling_signals(on_signal):
        try:
            ret = run_one(p["hydra_context"], p["task_function"], job)
            status = COMPLETED if ret.status == JobStatus.COMPLETED else FAILED
            out = {"status": status, "ret": _portable(ret), "restarts": job.restarts}
        except KeyboardInterrupt as stop:
            state["in_job"] = False
            out = {"status": INTERRUPTED, "signum": getattr(stop, "signum", None) or state["signum"], "restarts": job.restarts}
        except Exception as exc:  # outside the task (run_job's own work): report it as the job's failure
            state["in_job"] = False
            traceback.print_exc()
            ret = job_return(job, JobStatus.FAILED, JobFailed(f"{job.label}: {type(exc).__name__}: {exc}"))
            out = {"status": FAILED, "ret": _portable(ret), "restarts": job.restarts}
        state["in_job"] = False
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(PayloadRef(sys.argv[1], sys.argv[2], int(sys.argv[3])), sys.argv[4]))
