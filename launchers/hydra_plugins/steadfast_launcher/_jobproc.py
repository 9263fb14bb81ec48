"""One sweep job in its own launcher process: `python -m hydra_plugins.steadfast_launcher._jobproc PAYLOAD RESULT`.

Started by the launcher when jobs run in parallel (hydra.launcher.max_parallel_jobs > 1). The
job was composed and checked by the parent; here it runs exactly as in the sequential path
(`_core.run_one`: Hydra's run_job, then the backend), with Hydra's state restored from the
parent. The outcome (the JobReturn, or 'interrupted') goes to RESULT, written atomically; the
parent reads it when this process ends.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from typing import Any, Dict


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when the launcher that started it dies (Linux), so the agent stops its workers."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _portable(ret: Any) -> Any:
    """The JobReturn as the parent can unpickle it: an exception or value that does not survive becomes a JobFailed."""
    import cloudpickle
    from hydra.core.utils import JobStatus

    from ._core import JobFailed

    try:
        cloudpickle.loads(cloudpickle.dumps(ret))
        return ret
    except Exception as exc:
        value = ret._return_value
        if ret.status == JobStatus.COMPLETED:
            ret.status = JobStatus.FAILED
            ret.return_value = JobFailed(f"the task's return value could not be pickled back to the launcher: {exc}")
        else:
            ret.return_value = JobFailed(f"{type(value).__name__}: {value}")
        return ret


def main(payload_path: str, result_path: str) -> int:
    import cloudpickle

    with open(payload_path, "rb") as f:
        p: Dict[str, Any] = cloudpickle.load(f)
    if p.get("cpus"):
        os.sched_setaffinity(0, p["cpus"])
    _die_with_parent(p["parent"])

    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, configure_log, setup_globals

    from . import _core, _sweep

    Singleton.set_state(p["hydra_state"])
    setup_globals()
    configure_log(p["hydra_logging"], p["verbose"])
    job = p["job"]
    state = {"signum": None, "in_job": True}

    def on_signal(signum: int, frame: Any) -> None:
        state["signum"] = state["signum"] or signum
        if state["in_job"]:
            raise _core.Interrupted(signum=signum)

    out: Dict[str, Any]
    with _core.handling_signals(on_signal):
        try:
            ret = _core.run_one(p["hydra_context"], p["task_function"], job)
            status = _sweep.COMPLETED if ret.status == JobStatus.COMPLETED else _sweep.FAILED
            out = {"status": status, "ret": _portable(ret), "restarts": job.restarts}
        except KeyboardInterrupt as stop:
            state["in_job"] = False
            out = {"status": _sweep.INTERRUPTED, "signum": getattr(stop, "signum", None) or state["signum"], "restarts": job.restarts}
        except Exception as exc:  # outside the task (run_job's own work): report it as the job's failure
            state["in_job"] = False
            traceback.print_exc()
            ret = _core._job_return(job, JobStatus.FAILED, _core.JobFailed(f"{job.label}: {type(exc).__name__}: {exc}"))
            out = {"status": _sweep.FAILED, "ret": _portable(ret), "restarts": job.restarts}
        state["in_job"] = False
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
