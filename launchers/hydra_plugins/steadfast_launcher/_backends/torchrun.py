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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from steadfast.contract.backends import TORCH_DISTRIBUTED, BackendConf, BackendSpec
from steadfast.contract.env import TORCH
from steadfast.contract.schemas import RestartConf, bad
from steadfast.contract.stop import STOP_SIGNALS, Stopped, StopReason, request_stop, restore_handlers, signal_name

from .. import _forkserver
from .._compat import elastic_exits
from .._compat.torch_logging import render_tracebacks_first
from .._logfiles import files_only
from .._types import Completed, Failed, Outcome
from ._registry import register
from .base import Attempt, Backend, restore_environment, saved_environment

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

_AGENT_STOP = signal.SIGUSR2  # what the launcher's supervisor sends the agent when a stop's grace runs out
AGENT_SIGNALS = f"{_AGENT_STOP.name},SIGQUIT"  # the signals the agent handles itself
RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")

log = logging.getLogger(__name__)


@dataclass
class TorchrunBackendConf(BackendConf):
    """torch elastic (the engine behind `torchrun`); keys mirror torchrun's flags."""

    name: str = "torchrun"
    nproc_per_node: int = 2
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""  # empty: a free local port, like `torchrun --standalone`
    rdzv_id: str = ""  # empty: the run folder's name, so every node of a job agrees
    rdzv_timeout_s: int = 900
    # Elastic jobs: once MIN nodes have joined a rendezvous round, how long it waits for more
    # (up to MAX) before it starts with what it has. null: torch's default (30 s).
    rdzv_last_call_s: Optional[int] = None
    # Elastic jobs: how long a node's agent may go silent before the other nodes take it for lost and
    # re-rendezvous without it (a keep-alive every third of it). null: torch's default (15 s).
    rdzv_node_timeout_s: Optional[int] = None
    # c10d: whether this node hosts the rendezvous store. null: torch decides (a node whose own address
    # the endpoint names hosts it; several such nodes, e.g. on one machine: the first to bind the port).
    # false: this node only connects to it, waiting for the host (up to 60 s), so it may start first.
    rdzv_is_host: Optional[bool] = None
    master_addr: str = "127.0.0.1"  # only for rdzv_backend=static
    master_port: Optional[int] = None  # only for rdzv_backend=static
    node_rank: int = 0  # only for rdzv_backend=static
    local_addr: Optional[str] = None
    start_method: str = "forkserver"  # torch elastic forks its workers from a server that imported torch once

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node

    def node_range(self) -> tuple[int, int]:
        text = str(self.nnodes)
        low, _, high = text.partition(":")
        return int(low), int(high or low)

    def problems(self, prefix: str = "backend") -> List[str]:
        out = super().problems(prefix)
        if self.nproc_per_node < 1:
            out.append(bad(f"{prefix}.nproc_per_node", self.nproc_per_node, "an integer >= 1"))
        if not re.fullmatch(r"\d+(:\d+)?", str(self.nnodes)):
            out.append(bad(f"{prefix}.nnodes", self.nnodes, 'a node count "N" or a range "MIN:MAX"'))
        else:
            low, high = self.node_range()
            if low < 1 or high < low:
                out.append(bad(f"{prefix}.nnodes", self.nnodes, "1 <= MIN <= MAX"))
            elif high > 1 and not self.rdzv_endpoint and self.rdzv_backend != "static":
                out.append(f"{prefix}.nnodes={self.nnodes!r} needs {prefix}.rdzv_endpoint=HOST:PORT that every node can reach")
        if self.rdzv_backend not in RDZV_BACKENDS:
            out.append(bad(f"{prefix}.rdzv_backend", self.rdzv_backend, f"one of {', '.join(RDZV_BACKENDS)}"))
        if self.rdzv_backend == "static" and self.master_port is None:
            out.append(f"{prefix}.rdzv_backend='static' needs {prefix}.master_port")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            out.append(bad(f"{prefix}.master_port", self.master_port, "a TCP port, 1-65535"))
        if self.rdzv_endpoint and not re.fullmatch(r"[^:\s]+(:\d{1,5})?", self.rdzv_endpoint):
            out.append(bad(f"{prefix}.rdzv_endpoint", self.rdzv_endpoint, "HOST or HOST:PORT"))
        if self.rdzv_timeout_s < 1:
            out.append(bad(f"{prefix}.rdzv_timeout_s", self.rdzv_timeout_s, "seconds >= 1"))
        if self.rdzv_last_call_s is not None and self.rdzv_last_call_s < 1:
            out.append(bad(f"{prefix}.rdzv_last_call_s", self.rdzv_last_call_s, "seconds >= 1, or null (torch's 30 s)"))
        if self.rdzv_node_timeout_s is not None and self.rdzv_node_timeout_s < 3:
            out.append(bad(f"{prefix}.rdzv_node_timeout_s", self.rdzv_node_timeout_s, "seconds >= 3, or null (torch's 15 s)"))
        if self.rdzv_is_host is not None and self.rdzv_backend != "c10d":
            out.append(bad(f"{prefix}.rdzv_is_host", self.rdzv_is_host, "null unless rdzv_backend=c10d (it hosts the store)"))
        if self.start_method not in START_METHODS:
            out.append(bad(f"{prefix}.start_method", self.start_method, f"one of {', '.join(START_METHODS)}"))
        return out


@register
class TorchrunBackend(Backend):
    spec = BackendSpec(
        name="torchrun",
        schema=TorchrunBackendConf,
        collective=TORCH,
        world_size_keys=("nproc_per_node", "nnodes"),
        rank_env=TORCH_DISTRIBUTED,  # the agent sets what torchrun sets
    )
    restarts_itself = True  # the elastic agent restarts the worker group, up to restart.max_restarts
    conf: TorchrunBackendConf
    _not_restarting = False  # the launcher stopped the agent: its failure would come back on every attempt

    @classmethod
    def warm_up(cls, node: Mapping[str, Any]) -> None:
        """Start the forkserver now if the launch will most likely fork its workers from it: its imports
        (torch, ~3 s here) are the longest part of a launch's start-up. A job that does not use it leaves
        it idle, and it ends with the launcher either way."""
        if node.get("start_method") == "forkserver":
            _forkserver.start()

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

    def stop_restarting(self) -> bool:
        """The agent stops its workers (the same SIGUSR2 as after the grace), and `launch` takes its
        stop for this failure's end, not for a stop request. From the supervisor's thread."""
        self._not_restarting = True
        return self.stop_on_grace_expired()

    def _stop_agent_here(self) -> None:
        """The same, from the agent's own thread as it found the failure (elastic_exits): its handler
        raises there, so it never starts the next incarnation."""
        self._not_restarting = True
        if callable(signal.getsignal(_AGENT_STOP)):
            signal.pthread_kill(threading.main_thread().ident, _AGENT_STOP)  # type: ignore[arg-type]

    def launch(self, attempt: Attempt) -> Outcome:
        self._not_restarting = False
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
        agent_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_SIGNALS_TO_HANDLE": AGENT_SIGNALS, **attempt.env}
        saved = saved_environment(agent_env)
        os.environ.update(agent_env)  # spawned workers inherit the agent's environment
        logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
        # the agent's account of a failure (a worker's traceback, its restarts) goes to train.log; the
        # console gets the supervisor's one line per failure and restart
        files_only("torch.distributed.elastic", "torch.multiprocessing")
        render_tracebacks_first("torch.distributed.elastic")
        run_dir = attempt.run_dir
        config = launch_config(self.conf, attempt.restart, run_id=run_dir.name, log_dir=run_dir / "logs" / "elastic")
        handlers = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, _AGENT_STOP, signal.SIGQUIT)}  # the agent keeps its own
        # Forked workers do not inherit this process's environment: they are handed it (see _forkserver).
        payload = attempt.payload
        args = (payload, _forkserver.environment_file(Path(payload.path).parent)) if forkserver else (payload,)
        try:
            with elastic_exits.observe(attempt.on_exits, self._stop_agent_here):
                results = elastic_launch(config, attempt.entry)(*args)
        except ChildFailedError as err:
            return Failed(root_cause(err), restarts=attempt.restart.max_restarts)
        except SignalException as err:  # the agent was asked to stop (and has stopped its workers): not a failure
            if self._not_restarting:  # ... unless the launcher stopped it because its failure would recur
                return Failed("torch elastic agent stopped by the launcher: its failure would recur")
            request_stop(int(err.sigval))  # a stop request to this process, as the signal was
            message = f"torch elastic agent stopped by {signal_name(int(err.sigval))}"
            return Stopped(StopReason.PREEMPTED, message=message, signal=int(err.sigval))
        except Exception as err:  # rendezvous and agent errors
            return Failed(f"torch elastic agent: {type(err).__name__}: {err}")
        finally:
            restore_handlers(handlers)
            restore_environment(saved)
        stopped = [v for v in results.values() if isinstance(v, Stopped)]
        if stopped:  # the workers saved and stopped on purpose (a stop request, a memory guard): not a failure
            return stopped[0]
        return Completed(results.get(0))  # rank 0's return value (None on a node that does not host rank 0)


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
    if backend.rdzv_is_host is not None:
        rdzv_configs["is_host"] = backend.rdzv_is_host
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


def root_cause(err: "ChildFailedError") -> str:
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
