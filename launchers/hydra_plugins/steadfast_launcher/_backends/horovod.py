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

import functools
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from steadfast.contract.env import ENV_ATTEMPT, HOROVOD
from steadfast.contract.schemas import HorovodBackendConf
from steadfast.contract.stop import STOP_SIGNALS, Stopped, restore_handlers, signal_name, stop_requested

from .._payload import PayloadRef
from .._types import Interrupted, Job, WorkerFailure
from .._worker import run_rank
from .base import Backend, restore_environment, saved_environment

_FAILED = re.compile(r"Process name: (\S+)\s+Exit code: (-?\d+)")
_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")
_NONE = "no error recorded"
LOGS = Path("logs") / "horovod"  # in the run folder: Horovod's per-rank output, one folder per attempt
# Horovod 0.28.1's horovod.run hands every worker HOROVOD_CYCLE_TIME='(None,)' and
# HOROVOD_CACHE_CAPACITY='(None,)' (its runner/__init__.py sets `cycle_time_ms = None,` and
# `cache_capacity = None,`: tuples), whatever the environment says. The C++ side parses both with
# strto*, so they become 0, and fixed (the autotuner may not change them): a background thread
# that never waits between cycles, spinning on one of the cores the workers train on, and no
# response cache, so every cycle negotiates every tensor by name. These are the values the
# workers get instead; a value in the launcher's environment wins. Chosen from bench/horovod.py's
# measurement (see bench/NOTES.md): Horovod's own defaults for the two it meant to leave alone.
TUNING = {"HOROVOD_CYCLE_TIME": "1", "HOROVOD_CACHE_CAPACITY": "1024"}


class HorovodBackend(Backend):
    schema = HorovodBackendConf
    collective = HOROVOD
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

    def root_cause(self, error: BaseException, run_dir: Path, attempt: int = 0) -> str:
        return root_cause(error, run_dir / LOGS / f"attempt_{attempt}")

    def launch(self, payload: PayloadRef, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
        import horovod
        from horovod.runner import gloo_run
        from horovod.runner import launch as runner_launch
        from horovod.runner.common.util import config_parser
        from horovod.runner.http import http_server

        b = self.conf
        attempt = int(env.get(ENV_ATTEMPT, "0"))
        logs = run_dir / LOGS / f"attempt_{attempt}"
        logs.mkdir(parents=True, exist_ok=True)
        # horovod.run has no env argument: every worker gets a copy of this process's environment.
        # Workers are plain subprocesses (not spawned by multiprocessing), so hand them our sys.path.
        ours = [os.getcwd() if p == "" else p for p in sys.path if not p.startswith((sys.prefix, sys.base_prefix))]
        worker_env = {**env, "PYTHONPATH": os.pathsep.join([*ours, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
        # Collectives get a deadline: Horovod shuts down when some ranks have waited this long for others.
        worker_env.setdefault(
            "HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(min(60, max(1, job.restart.collective_timeout_s // 2))))
        )
        worker_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(job.restart.collective_timeout_s)))
        saved_env = saved_environment(worker_env)
        saved_signals = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        # Horovod's runner would swap SIGINT/SIGTERM for an event that terminates the workers after a
        # fixed 5 s. Instead the launcher's handlers stay (they only set the stop flag), the launcher's
        # supervisor forwards the signal to the workers, which save and stop, and it sets these events
        # (Horovod then stops whatever still runs) only after restart.preemption_grace_s.
        self._stop_events.clear()

        def event_without_handlers() -> threading.Event:
            self._stop_events.append(threading.Event())
            return self._stop_events[-1]

        register = gloo_run.register_shutdown_event
        gloo_run.register_shutdown_event = event_without_handlers
        parse_args = config_parser.set_env_from_args
        config_parser.set_env_from_args = tuned(parse_args)
        runner_gloo_built = runner_launch.gloo_built
        known = gloo_built()
        if known is not None:
            runner_launch.gloo_built = lambda verbose=False: known
        serve_forever = http_server.KVStoreHTTPServer.serve_forever
        http_server.KVStoreHTTPServer.serve_forever = functools.partialmethod(
            http_server.HTTPServer.serve_forever, poll_interval=SERVER_POLL_S
        )
        os.environ.update(worker_env)
        try:
            results = horovod.run(
                run_rank,
                args=(payload,),  # a small reference: each worker reads the payload file itself
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
            if stop_requested() is not None:
                signum = stop_requested()
                raise Interrupted(f"the Horovod job was stopped by {signal_name(signum)}", signum=signum) from None
            raise WorkerFailure(self.root_cause(err, run_dir, attempt)) from None
        finally:
            gloo_run.register_shutdown_event = register
            config_parser.set_env_from_args = parse_args
            runner_launch.gloo_built = runner_gloo_built
            http_server.KVStoreHTTPServer.serve_forever = serve_forever
            restore_handlers(saved_signals)
            restore_environment(saved_env)
        stopped = [v for v in results if isinstance(v, Stopped)]
        if stopped:  # the workers saved and stopped on purpose (a stop request, a memory guard): not a failure
            return stopped[0]
        return results[0]  # the list is in rank order


# horovod.run's store of the workers' results answers through socketserver's serve_forever, which
# notices the runner's shutdown() only at its next poll (0.5 s by default): every launch and every
# relaunch ended with that wait.
SERVER_POLL_S = 0.02
# What horovod.run's `gloo_built` asks (in a forked child that imports torch: 1.6 s of every
# launch here), made the way Horovod's own basics.py makes it, the extension's horovod_gloo_built
# through ctypes, in a new interpreter that loads the library without importing torch (0.25 s).
_GLOO_BUILT = """
import ctypes, importlib.util, os, sysconfig
spec = importlib.util.find_spec("horovod")
library = os.path.join(os.path.dirname(spec.origin), "torch", "mpi_lib_v2" + sysconfig.get_config_var("EXT_SUFFIX"))
print(int(ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL).horovod_gloo_built()))
"""


@functools.lru_cache(maxsize=None)
def gloo_built() -> Optional[bool]:
    """Whether Horovod's PyTorch extension has Gloo; None if this cannot tell (horovod.run then
    makes its own check, and says what is wrong)."""
    try:
        done = subprocess.run([sys.executable, "-c", _GLOO_BUILT], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip()
    return answer == "1" if done.returncode == 0 and answer in ("0", "1") else None


def tuned(set_env_from_args: Callable[[Dict[str, str], Any], None]) -> Callable[[Dict[str, str], Any], None]:
    """Horovod's `config_parser.set_env_from_args` (what horovod.run builds the workers' environment
    with), followed by TUNING: explicit values instead of the '(None,)' it writes."""

    def with_tuning(env: Dict[str, str], args: Any) -> None:
        set_env_from_args(env, args)
        env.update({key: os.environ.get(key) or value for key, value in TUNING.items()})

    return with_tuning


def root_cause(err: BaseException, logs: Path) -> str:
    """One line: which rank failed first and why (the exception in its stderr, if it left one)."""
    text = str(err).strip()
    found = _FAILED.search(text)
    if not found:  # not a worker exit: a start-up, rendezvous or elastic driver error
        return f"horovod runner: {type(err).__name__}: {text.splitlines()[0] if text else 'no message'}"
    name, code = found.group(1), int(found.group(2))
    how = f"exit code {code}"
    if code > 128 and code - 128 in signal.valid_signals():
        how += f", killed by {signal.Signals(code - 128).name}"
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
