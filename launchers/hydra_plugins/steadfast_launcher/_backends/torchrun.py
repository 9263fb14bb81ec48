"""backend=torchrun: the workers run under torch elastic's agent (`elastic_launch`, the engine behind
`torchrun`), which restarts the whole worker group on failure, up to restart.max_restarts."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Dict, Optional

from steadfast.contract.env import TORCH
from steadfast.contract.schemas import RestartConf, TorchrunBackendConf
from steadfast.contract.stop import STOP_SIGNALS, Stopped, restore_handlers

from .. import _forkserver
from .._payload import PayloadRef
from .._types import Interrupted, Job, WorkerFailure
from .._worker import run_rank
from .base import Backend, restore_environment, saved_environment

_AGENT_STOP = signal.SIGUSR2  # what the launcher's supervisor sends the agent when a stop's grace runs out
AGENT_SIGNALS = f"{_AGENT_STOP.name},SIGQUIT"  # the signals the agent handles itself

log = logging.getLogger(__name__)


class TorchrunBackend(Backend):
    schema = TorchrunBackendConf
    collective = TORCH
    restarts_itself = True  # the elastic agent restarts the worker group, up to restart.max_restarts
    conf: TorchrunBackendConf

    def reference_world_size(self) -> int:
        return self.conf.node_range()[1] * self.procs_per_node

    def multi_node_identity(self, run_dir: Path) -> Optional[str]:
        low, high = self.conf.node_range()
        if high <= 1:
            return None
        rdzv_id = self.conf.rdzv_id or run_dir.name
        return f"{self.conf.rdzv_backend}:{rdzv_id}@{self.conf.rdzv_endpoint}"

    def stop_on_grace_expired(self) -> bool:
        """SIGUSR2 to the agent (in the launcher's main thread), if its handler is in place: it then
        stops its workers itself instead of taking the supervisor's kill for a failure."""
        handler = signal.getsignal(_AGENT_STOP)
        if not callable(handler) or threading.current_thread() is threading.main_thread():
            return False
        signal.pthread_kill(threading.main_thread().ident, _AGENT_STOP)  # type: ignore[arg-type]
        return True

    def root_cause(self, error: BaseException, run_dir: Path, attempt: int = 0) -> str:
        """One line naming the first failed rank and why (not just 'child failed')."""
        return root_cause(error)

    def launch(self, payload: PayloadRef, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
        forkserver = self.conf.start_method == "forkserver"
        if forkserver:  # first: the server imports torch while this process does (2 cores: in parallel)
            _forkserver.start()
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        # Restarted workers reading stale keys from a shared rendezvous store fail to connect
        # (pytorch #135712); a store per rendezvous round makes restarts reliable.
        # The agent must not take over SIGTERM/SIGINT/SIGHUP: its handler would stop the workers and
        # never collect what they return, so they would linger until killed at the end of the grace.
        # The launcher's handlers stay; its supervisor forwards the signal; the workers save and return
        # normally; the agent sees a clean end. SIGUSR2 stays the agent's: the supervisor sends it to
        # the agent when the grace runs out, and the agent then stops its workers itself.
        agent_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_SIGNALS_TO_HANDLE": AGENT_SIGNALS, **env}
        saved = saved_environment(agent_env)
        os.environ.update(agent_env)  # spawned workers inherit the agent's environment
        logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
        render_tracebacks_first("torch.distributed.elastic")
        config = launch_config(self.conf, job.restart, run_id=run_dir.name, log_dir=run_dir / "logs" / "elastic")
        handlers = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, _AGENT_STOP, signal.SIGQUIT)}  # the agent keeps its own
        # Forked workers do not inherit this process's environment: they are handed it (see _forkserver).
        args = (payload, _forkserver.environment_file(Path(payload.path).parent)) if forkserver else (payload,)
        try:
            results = elastic_launch(config, run_rank)(*args)
        except ChildFailedError as err:
            raise WorkerFailure(self.root_cause(err, run_dir), restarts=job.restart.max_restarts) from None
        except SignalException as err:  # the agent was asked to stop (and has stopped its workers): not a failure
            raise Interrupted(f"torch elastic agent stopped by {err.sigval.name}", signum=int(err.sigval)) from None
        except Exception as err:  # rendezvous and agent errors
            raise WorkerFailure(f"torch elastic agent: {type(err).__name__}: {err}") from err
        finally:
            restore_handlers(handlers)
            restore_environment(saved)
        stopped = [v for v in results.values() if isinstance(v, Stopped)]
        if stopped:  # the workers saved and stopped on purpose (a stop request, a memory guard): not a failure
            return stopped[0]
        return results.get(0)  # rank 0's return value (None on a node that does not host rank 0)


class _TracebackRendered(logging.Filter):
    """Puts the traceback of a record of logger `name` (or below) into its text and drops exc_info,
    before torch's log formatter sees it; other records pass untouched.

    That formatter (torch._logging's TorchLogsFormatter) imports torch._dynamo to read one setting
    whenever a record carries exc_info, and torch elastic's agent logs every worker failure that
    way: the first restart of every launch waited for that import (1.1 s of 1.7 s here). The text
    is the same: logging's own formatException, which that formatter would use."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and super().filter(record):
            if not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


def render_tracebacks_first(name: str) -> None:
    """Add _TracebackRendered to every handler a record of logger `name` reaches (once)."""
    logger: Optional[logging.Logger] = logging.getLogger(name)
    while logger is not None:
        for handler in logger.handlers:
            if not any(isinstance(f, _TracebackRendered) and f.name == name for f in handler.filters):
                handler.addFilter(_TracebackRendered(name))
        logger = logger.parent if logger.propagate else None


def launch_config(backend: TorchrunBackendConf, restart: RestartConf, run_id: str, log_dir: Path) -> Any:
    """A LaunchConfig with only the fields the installed torch has (they change between releases)."""
    from torch.distributed.launcher.api import LaunchConfig

    low, high = backend.node_range()
    endpoint = backend.rdzv_endpoint
    rdzv_configs: Dict[str, Any] = {"timeout": backend.rdzv_timeout_s}
    if backend.rdzv_last_call_s is not None:
        rdzv_configs["last_call_timeout"] = backend.rdzv_last_call_s
    if backend.rdzv_node_timeout_s is not None:  # torch takes a node for lost after 3 missed keep-alives
        rdzv_configs["keep_alive_interval"] = max(1, backend.rdzv_node_timeout_s // 3)
        rdzv_configs["keep_alive_max_attempt"] = 3
    if backend.rdzv_backend == "static":
        endpoint = f"{backend.master_addr}:{backend.master_port}"
        rdzv_configs["rank"] = backend.node_rank
    elif not endpoint:
        endpoint = "localhost:0"  # as `torchrun --standalone`: the agent hosts the store on a free port
    wanted: Dict[str, Any] = dict(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=backend.nproc_per_node,
        run_id=re.sub(r"[^A-Za-z0-9_.-]", "_", backend.rdzv_id or run_id),
        rdzv_backend=backend.rdzv_backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=restart.max_restarts,
        monitor_interval=restart.monitor_interval,
        start_method=backend.start_method,
        local_addr=backend.local_addr,
        # SIGTERM/SIGINT/SIGHUP to the agent: it forwards the signal to every worker (they save and
        # stop at their next step boundary) and kills what still runs after this long.
        shutdown_timeout=int(math.ceil(restart.preemption_grace_s)),
        signals_to_handle=AGENT_SIGNALS,  # see launch(): the agent leaves SIGTERM/SIGINT/SIGHUP to the launcher
    )
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    if "logs_specs" in names:  # torch >= 2.3
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

        wanted["logs_specs"] = DefaultLogsSpecs(log_dir=str(log_dir))
    else:
        wanted["log_dir"] = str(log_dir)
    required = {
        f.name
        for f in dataclasses.fields(LaunchConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(wanted)
    if missing:
        raise RuntimeError(f"this torch's LaunchConfig needs fields the launcher does not set: {sorted(missing)}")
    return LaunchConfig(**{k: v for k, v in wanted.items() if k in names})


def root_cause(err: Any) -> str:  # a ChildFailedError
    """One line naming the first failed rank and why (not just 'child failed')."""
    rank, failure = err.get_first_failure()
    message = failure.message
    where = ""
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stack)
        if frames:
            where = f" (at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]})"
        message = message.get("message", "")
    message = str(message).strip().splitlines()[-1] if str(message).strip() else "no error recorded"
    return f"rank {rank} (pid {failure.pid}, exit code {failure.exitcode}): {message}{where}"
