"""Opt-in start-up tracing for the benchmarks, without touching the project's code.

Active only when STEADFAST_BENCH_TRACE names a file and this folder is on PYTHONPATH (Python
imports `sitecustomize` at start-up; child processes inherit both). Every Python process then
appends JSON lines to that file: when the process was created (from /proc), when it reached
this module, when watched modules start and finish importing, and when watched functions
(Hydra compose and plugin scan, the launcher's steps, torch elastic's rendezvous and worker
start/stop, init_process_group, the library's set-up and checkpoint discovery, ...) start and
end. Workers forked from the launcher's forkserver inherit the server's tracer (the server is a
Python process of its own): their records carry their own pid. bench/startup.py and
bench/recovery.py turn the records into breakdowns. Without the variable this does nothing.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from typing import Any, Callable

_PATH = os.environ.get("STEADFAST_BENCH_TRACE")

# Modules whose import is timed (first import in each process).
WATCH_IMPORTS = {
    "hydra",
    "omegaconf",
    "torch",
    "torch._dynamo",
    "numpy",
    "cloudpickle",
    "horovod.torch",
    "horovod.runner",
    "pipeline.train",
    "pipeline.trainer",
    "pipeline.data",
    "steadfast.run",
    "steadfast.checkpoint.manager",
    "hydra_plugins.steadfast_launcher",
    "hydra_plugins.steadfast_launcher._core",
    "hydra_plugins.steadfast_launcher._worker",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
}

_L = "hydra_plugins.steadfast_launcher"
# module -> [(attribute path, label)]: functions wrapped when the module has been imported.
WRAP = {
    "hydra.core.plugins": [
        ("Plugins._scan_all_plugins", "hydra_plugin_scan"),
        ("Plugins.instantiate_launcher", "hydra_instantiate_launcher"),
    ],
    "hydra._internal.config_loader_impl": [
        ("ConfigLoaderImpl.load_configuration", "hydra_compose"),
        ("ConfigLoaderImpl.load_sweep_config", "hydra_sweep_config"),
    ],
    f"{_L}._core": [("launch", "launcher_launch")],
    f"{_L}._compose": [("prepare", "launcher_prepare"), ("preflight", "launcher_preflight")],
    f"{_L}._job": [("_run", "launcher_run_job")],
    f"{_L}._backends.torchrun": [("TorchrunBackend.launch", "torchrun_adapter_run"), ("launch_config", "torchrun_launch_config")],
    f"{_L}._backends.horovod": [("HorovodBackend.launch", "horovod_adapter_run")],
    f"{_L}._forkserver": [("start", "forkserver_start"), ("adopt_environment", "worker_adopt_environment")],
    f"{_L}._worker": [("run_rank", "worker_run_rank")],
    "torch.distributed": [("init_process_group", "init_process_group")],
    "torch.distributed.elastic.agent.server.api": [
        ("SimpleElasticAgent._rendezvous", "agent_rendezvous"),
        ("SimpleElasticAgent._restart_workers", "agent_restart_workers"),
        ("SimpleElasticAgent._initialize_workers", "agent_initialize_workers"),
    ],
    "torch.distributed.elastic.agent.server.local_elastic_agent": [
        ("LocalElasticAgent._start_workers", "agent_start_workers"),
        ("LocalElasticAgent._stop_workers", "agent_stop_workers"),
        ("LocalElasticAgent._monitor_workers", "agent_monitor"),
    ],
    "torch.nn.parallel.distributed": [("DistributedDataParallel.__init__", "ddp_init")],
    "steadfast.run": [("Run.__init__", "run_init"), ("Run.setup", "run_setup"), ("Run.resume", "trainer_resume")],
    "pipeline.trainer": [("build_data", "build_data"), ("build_model", "build_model")],
    "steadfast.distributed": [("init", "comm_init")],
    "horovod.torch": [("init", "horovod_init")],
}
QUIET = {"agent_monitor"}  # polled: only calls that return a non-HEALTHY state are recorded; the rest are counted
_quiet_stats: dict = {}


def record(what: str, **fields: object) -> None:
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "ppid": os.getppid(), "what": what, **fields}) + "\n"
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # type: ignore[arg-type]
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _process_created() -> float:
    """When this process was created, as time.time() (10 ms resolution)."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def _wrap(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        if label in ("torchrun_adapter_run", "horovod_adapter_run") and len(args) > 1 and hasattr(args[1], "size"):
            record("payload", bytes=int(args[1].size))  # the job payload every worker reads (a PayloadRef's file)
        if label not in QUIET:
            record(label + ":start")
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            record(label + ":end", start=start, error=type(exc).__name__)
            raise
        if label not in QUIET:
            record(label + ":end", start=start)
        else:
            durations = _quiet_stats.setdefault(label, [])
            if len(durations) < 100_000:
                durations.append(time.time() - start)
            state = getattr(getattr(result, "state", None), "name", None)
            if state not in (None, "HEALTHY"):
                record(label + ":" + state, start=start)
        return result

    wrapper.__steadfast_traced__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(name: str, module: object) -> None:
    for dotted, label in WRAP.get(name, []):
        target = module
        parts = dotted.split(".")
        for part in parts[:-1]:
            target = getattr(target, part, None)
        if target is None:
            continue
        raw = inspect.getattr_static(target, parts[-1], None)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        fn = raw.__func__ if kind else raw
        if fn is None or getattr(fn, "__steadfast_traced__", False):
            continue
        wrapped = _wrap(label, fn)
        setattr(target, parts[-1], kind(wrapped) if kind else wrapped)


class _Finder:
    """Times the watched imports and wraps functions of watched modules once they are loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in WATCH_IMPORTS and name not in WRAP:
            return None
        start = time.time()
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            try:
                original(module)
            finally:
                if name in WATCH_IMPORTS:
                    record("import:" + name, start=start)
                _patch(name, module)

        loader.exec_module = exec_module
        return spec


def _at_exit() -> None:
    for label, durations in _quiet_stats.items():
        ordered = sorted(durations)
        record(
            label + ":stats", calls=len(ordered), seconds=sum(ordered), median_s=ordered[len(ordered) // 2] if ordered else None
        )


STACK_SIGNAL = None


if _PATH:
    import atexit
    import faulthandler
    import signal

    atexit.register(_at_exit)
    # `kill -<SIGRTMIN+3> <pid>` writes every thread's Python stack to <trace>.stacks (for a hung run).
    STACK_SIGNAL = signal.SIGRTMIN + 3
    _stacks = open(_PATH + ".stacks", "a")
    faulthandler.register(STACK_SIGNAL, file=_stacks, all_threads=True, chain=False)
    record("process", created=_process_created(), argv=sys.argv[:3], executable=os.path.basename(sys.executable))
    for _name, _module in list(sys.modules.items()):
        if _name in WRAP:
            _patch(_name, _module)
    sys.meta_path.insert(0, _Finder())
