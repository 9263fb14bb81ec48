"""backend=horovod: the workers run under Horovod's own runner (`horovod.run`, Gloo controller).

Horovod has no agent that restarts failed workers: when one dies, its runner stops the others
and fails. So the launcher relaunches the whole job (up to restart.max_restarts, counted in
STEADFAST_ATTEMPT) and every launch resumes from the newest committed checkpoint.

Elastic mode (backend.min_np, backend.max_np, backend.host_discovery_script, reset_limit,
blacklist_cooldown_range) is passed through to horovod.run, which then discovers hosts and
starts between min_np and max_np workers. The workers do not use `hvd.elastic.run`, so a lost
worker still ends the Horovod job and recovery comes from the relaunch. On one host this is
also all Horovod itself could do: it blacklists the host of a failed worker, which holds every
slot, and stops; and it needs backend.network_interface=lo there, or its driver waits for a
second host until the elastic timeout.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from steadfast.contract.backends import BackendConf, BackendSpec, RankEnv
from steadfast.contract.env import HOROVOD
from steadfast.contract.schemas import FLOAT_MAX, bad
from steadfast.contract.stop import STOP_SIGNALS, Stopped, StopReason, restore_handlers, signal_name, stop_requested

from .._compat.horovod_runner import Exit, runner_patched
from .._logfiles import printable_streams
from .._types import Completed, Failed, Outcome, WorkerExit
from ._registry import register
from .base import Attempt, Backend, restore_environment, saved_environment

_FAILED = re.compile(r"Process name: (\S+)\s+Exit code: (-?\d+)")
_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")
_NONE = "no error recorded"
LOGS = Path("logs") / "horovod"  # in the run folder: Horovod's per-rank output, one folder per attempt
CONTROLLERS = ("gloo", "mpi")


@dataclass
class HorovodBackendConf(BackendConf):
    """Horovod over Gloo; keys mirror `horovodrun`'s flags."""

    name: str = "horovod"
    np: int = 2
    hosts: Optional[str] = None  # default: localhost:<np>
    controller: str = "gloo"
    start_timeout: int = 30
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    network_interface: Optional[str] = None
    reset_limit: Optional[int] = None
    blacklist_cooldown_range: Optional[List[int]] = None

    @property
    def procs_per_node(self) -> int:
        return self.np

    def problems(self, prefix: str = "backend") -> List[str]:
        out = super().problems(prefix)
        if self.np < 1:
            out.append(bad(f"{prefix}.np", self.np, "an integer >= 1"))
        if self.controller not in CONTROLLERS:
            out.append(bad(f"{prefix}.controller", self.controller, f"one of {', '.join(CONTROLLERS)}"))
        elif self.controller == "mpi":
            out.append(
                bad(f"{prefix}.controller", "mpi", "only 'gloo' is built here (the MPI controller needs an MPI build of Horovod)")
            )
        if not 1 <= self.start_timeout <= FLOAT_MAX:
            out.append(bad(f"{prefix}.start_timeout", self.start_timeout, f"seconds, 1 to {FLOAT_MAX:g}"))
        if self.hosts and self.host_discovery_script:
            out.append(f"{prefix}.hosts and {prefix}.host_discovery_script are mutually exclusive: set one")
        if self.hosts and not re.fullmatch(r"[^,:\s]+(:\d+)?(,[^,:\s]+(:\d+)?)*", self.hosts):
            out.append(bad(f"{prefix}.hosts", self.hosts, "HOST:SLOTS[,HOST:SLOTS...]"))
        for key in ("min_np", "max_np", "reset_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                out.append(bad(f"{prefix}.{key}", value, "an integer >= 1, or null"))
        if self.min_np is not None and self.max_np is not None and self.min_np > self.max_np:
            out.append(f"{prefix}.min_np={self.min_np} is greater than {prefix}.max_np={self.max_np}")
        if self.min_np is not None and not self.host_discovery_script and len((self.hosts or "localhost").split(",")) < 2:
            # horovod.run refuses elastic mode on fixed hosts with fewer than 2 hosts
            out.append(
                f"{prefix}.min_np (elastic mode) needs {prefix}.host_discovery_script, or {prefix}.hosts with at least 2 hosts"
            )
        if self.blacklist_cooldown_range is not None and (
            len(self.blacklist_cooldown_range) != 2
            or not 0 <= self.blacklist_cooldown_range[0] <= self.blacklist_cooldown_range[1]
        ):
            out.append(
                bad(
                    f"{prefix}.blacklist_cooldown_range",
                    list(self.blacklist_cooldown_range),
                    "[MIN_S, MAX_S] with 0 <= MIN_S <= MAX_S",
                )
            )
        return out


@register
class HorovodBackend(Backend):
    spec = BackendSpec(
        name="horovod",
        schema=HorovodBackendConf,
        collective=HOROVOD,
        world_size_keys=("np",),
        rank_env=RankEnv(
            rank="HOROVOD_RANK",
            world_size="HOROVOD_SIZE",
            local_rank="HOROVOD_LOCAL_RANK",
            local_world_size="HOROVOD_LOCAL_SIZE",
            address="HOROVOD_GLOO_RENDEZVOUS_ADDR",
            port="HOROVOD_GLOO_RENDEZVOUS_PORT",
        ),
        cannot_shard="Horovod has no sharded data parallelism",
    )
    conf: HorovodBackendConf

    def __init__(self, conf: HorovodBackendConf) -> None:
        super().__init__(conf)
        self._stop_events: List[threading.Event] = []  # the runner's shutdown events, set when the grace runs out

    def problems(self) -> List[str]:
        from importlib.util import find_spec

        out = super().problems()
        if find_spec("horovod") is None:
            out.append(
                "backend=horovod: Horovod is not installed. Install it with `bash scripts/install_horovod.sh "
                "$(which python)` (builds a patched Horovod 0.28.1 with PyTorch and Gloo), or choose backend=torchrun"
            )
        return out

    def log_folders(self, run_dir: Path) -> List[str]:
        return [f"{run_dir / LOGS} (Horovod's per-rank output)"]

    def stop_on_grace_expired(self) -> bool:
        """Horovod's runner stops its middlemen; the supervisor kills the workers at once (Horovod restarts nothing)."""
        for event in self._stop_events:
            event.set()
        return False

    def launch(self, attempt: Attempt) -> Outcome:
        import horovod

        b = self.conf
        logs = attempt.run_dir / LOGS / f"attempt_{attempt.number}"
        logs.mkdir(parents=True, exist_ok=True)
        # horovod.run has no env argument: every worker gets a copy of this process's environment.
        # Workers are plain subprocesses (not spawned by multiprocessing), so hand them our sys.path.
        ours = [os.getcwd() if p == "" else p for p in sys.path if not p.startswith((sys.prefix, sys.base_prefix))]
        worker_env = {**attempt.env, "PYTHONPATH": os.pathsep.join([*ours, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
        # Collectives get a deadline: Horovod shuts down when some ranks have waited this long for others.
        timeout = attempt.restart.collective_timeout_s
        worker_env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(min(60, max(1, timeout // 2)))))
        worker_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(timeout)))
        saved_env = saved_environment(worker_env)
        saved_signals = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._stop_events.clear()  # the runner's, set when the grace runs out (see runner_patched)
        exits: List[Exit] = []  # every worker's, as the runner reaps them
        os.environ.update(worker_env)
        try:
            with runner_patched(self._stop_events, exits), printable_streams():  # it copies the workers' output raw
                results = horovod.run(
                    attempt.entry,
                    args=(attempt.payload,),  # a small reference: each worker reads the payload file itself
                    num_proc=b.np,
                    hosts=b.hosts or (None if b.host_discovery_script else f"localhost:{b.np}"),
                    host_discovery_script=b.host_discovery_script,
                    min_num_proc=b.min_np,
                    max_num_proc=b.max_np,
                    reset_limit=b.reset_limit,
                    cooldown_range=tuple(b.blacklist_cooldown_range) if b.blacklist_cooldown_range else None,
                    network_interfaces=[n for n in b.network_interface.split(",") if n] if b.network_interface else None,
                    start_timeout=b.start_timeout,
                    use_gloo=b.controller == "gloo",
                    use_mpi=b.controller == "mpi",
                    output_filename=str(logs),
                    executable=sys.executable,
                )
        except Exception as err:
            signum = stop_requested()
            if signum is not None:
                return Stopped(
                    StopReason.PREEMPTED, message=f"the Horovod job was stopped by {signal_name(signum)}", signal=signum
                )
            if attempt.on_exits is not None:  # how each worker ended, or the one the runner's error names
                attempt.on_exits(worker_exits(exits) or first_exit(err))
            return Failed(root_cause(err, logs))
        finally:
            restore_handlers(saved_signals)
            restore_environment(saved_env)
        stopped = [v for v in results if isinstance(v, Stopped)]
        if stopped:  # the workers saved and stopped on purpose (a stop request, a memory guard): not a failure
            return stopped[0]
        return Completed(results[0])  # the list is in rank order


def worker_exits(exits: List[Exit]) -> List[WorkerExit]:
    """The workers that ended non-zero, from the statuses the runner recorded (a shell's 128+N, or -N
    from a process it ran directly, is signal N). One that ended by SIGTERM after another had failed
    was stopped by the runner, which terminates the rest so; any other status is the worker's own."""
    out = []
    for rank, status, after_failure in exits:
        if status == 0:
            continue
        signum = -status if status < 0 else _signal_of(status)
        stopped = after_failure and signum == signal.SIGTERM
        out.append(WorkerExit(-signum if signum else status, stopped_by_backend=stopped, rank=rank))
    return out


def first_exit(err: BaseException) -> List[WorkerExit]:
    """The worker the runner's error names (a rank and its shell's exit status: 128+N is signal N)."""
    found = _FAILED.search(str(err))
    if not found or not found.group(1).isdigit():
        return []
    code = int(found.group(2))
    signum = _signal_of(code)
    return [WorkerExit(-signum if signum else code, rank=int(found.group(1)))]


def _signal_of(status: int) -> Optional[int]:
    """The signal a shell's exit status 128+N says killed the process (None for any other status)."""
    return status - 128 if status > 128 and status - 128 in signal.valid_signals() else None


def root_cause(err: BaseException, logs: Path) -> str:
    """One line: which rank failed first and why (the exception in its stderr, if it left one)."""
    text = str(err).strip()
    found = _FAILED.search(text)
    if not found:  # not a worker exit: a start-up, rendezvous or elastic driver error
        return f"horovod runner: {type(err).__name__}: {text.splitlines()[0] if text else 'no message'}"
    name, code = found.group(1), int(found.group(2))
    how, signum = f"exit code {code}", _signal_of(code)
    if signum:
        how += f", killed by {signal.Signals(signum).name}"
    if not name.isdigit():  # elastic mode names workers HOST[LOCAL_RANK]
        return f"worker {name} ({how})"
    causes = {int(p.parent.name.rpartition(".")[2]): _last_exception(p) for p in logs.glob("rank.*/stderr")}
    cause = causes.get(int(name), _NONE)
    if "HorovodInternalError" in cause:  # its collective failed because another rank failed: name that one
        for rank, other in sorted(causes.items()):
            if other != _NONE and "HorovodInternalError" not in other:
                return f"rank {rank}: {other} (rank {name} exited first, {how})"
    return f"rank {name} ({how}): {cause}"


def _last_exception(stderr: Path) -> str:
    """The exception line of the last traceback in a worker's stderr (Horovod prefixes each line)."""
    lines = [_PREFIX.sub("", line) for line in stderr.read_text(errors="replace").splitlines()]
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith("Traceback (most recent call last):")]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            if line.strip() and not line[0].isspace():
                return line.strip()
    return _NONE
