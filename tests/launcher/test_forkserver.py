"""The default start method's safety: the forkserver torch elastic forks workers from (see
hydra_plugins.steadfast_launcher._forkserver).

- after its imports the server has one thread (a fork copies only the calling thread: with a
  single thread nothing can be copied half-held) and holds none of the launcher's files;
- importing what it preloads makes no CUDA call (a CUDA call before a fork breaks CUDA in the child);
- a worker forked from it runs with the launcher's environment of this launch (not the one the
  server started with) plus what torch elastic set for it, as a spawned worker would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT
from hydra_plugins.steadfast_launcher import _forkserver


def _python(script: str, cwd: Path, timeout: float = 240) -> dict:
    path = cwd / "script.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "launchers")])}
    done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_preloaded_server_has_one_thread_and_none_of_the_launcher_s_files(tmp_path: Path) -> None:
    found = _python(
        """
        import json, multiprocessing, os
        from hydra_plugins.steadfast_launcher import _forkserver
        from hydra_plugins.steadfast_launcher._compat.forkserver import server_pid

        def child(queue):
            queue.put(os.getppid())

        if __name__ == "__main__":
            held = open("launcher-file", "w")  # a file the launcher has open (a run lock, a log)
            _forkserver.start()
            ctx = multiprocessing.get_context("forkserver")
            queue = ctx.SimpleQueue()
            worker = ctx.Process(target=child, args=(queue,))
            worker.start()  # returns once the server has imported PRELOAD and forked
            parent = queue.get()
            worker.join()
            server = server_pid()
            fds = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]
            print(json.dumps({"server": server, "worker_parent": parent, "threads": len(os.listdir(f"/proc/{server}/task")),
                              "fds": fds, "held": os.path.realpath(held.name)}))
        """,
        tmp_path,
    )
    assert found["worker_parent"] == found["server"]
    assert found["threads"] == 1, found
    assert found["held"] not in found["fds"], found


def test_importing_the_preload_list_makes_no_cuda_call(tmp_path: Path) -> None:
    found = _python(
        f"""
        import json, torch
        calls = []
        def recorder(name, fn):
            def wrapped(*args, **kwargs):
                calls.append(name)
                return fn(*args, **kwargs)
            return wrapped
        for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
            setattr(torch.cuda, name, recorder(name, getattr(torch.cuda, name)))
        for name in ("_cuda_getDeviceCount", "_cuda_init"):  # absent from CPU builds
            if hasattr(torch._C, name):
                setattr(torch._C, name, recorder(name, getattr(torch._C, name)))
        import importlib
        for module in {list(_forkserver.PRELOAD)!r}:
            importlib.import_module(module)
        print(json.dumps({{"calls": calls, "initialized": torch.cuda.is_initialized()}}))
        """,
        tmp_path,
    )
    assert found == {"calls": [], "initialized": False}


def test_a_forked_worker_gets_the_launch_s_environment_and_what_elastic_set(tmp_path: Path) -> None:
    found = _python(
        """
        import json, multiprocessing, os
        from pathlib import Path
        from hydra_plugins.steadfast_launcher import _forkserver

        def nothing():
            pass

        def worker(ref, queue):
            os.environ["RANK"] = "1"  # what torch elastic's wrapper sets before it calls the entrypoint
            os.environ["SHARED"] = "elastic"
            _forkserver.adopt_environment(ref)
            import numpy
            queue.put((dict(os.environ), float(numpy.random.random())))

        if __name__ == "__main__":
            os.environ.update(AT_SERVER_START="1", CHANGED="before", SHARED="launcher")
            _forkserver.start()
            ctx = multiprocessing.get_context("forkserver")
            queue = ctx.SimpleQueue()
            first = ctx.Process(target=nothing)
            first.start()
            first.join()  # wait for the server's imports: they record its environment
            del os.environ["AT_SERVER_START"]
            os.environ.update(CHANGED="after", NEW="1")  # what the launcher sets for one launch (STEADFAST_*, env_set)
            ref = _forkserver.environment_file(Path("."))
            launcher = dict(os.environ)
            draws = []
            for _ in range(2):
                p = ctx.Process(target=worker, args=(ref, queue))
                p.start()
                env, draw = queue.get()
                p.join()
                draws.append(draw)
            print(json.dumps({"env": env, "launcher": launcher, "draws": draws}))
        """,
        tmp_path,
    )
    assert found["env"] == {**found["launcher"], "RANK": "1", "SHARED": "elastic"}
    assert "AT_SERVER_START" not in found["env"] and "PYTORCH_NVML_BASED_CUDA_CHECK" not in found["env"]
    assert found["draws"][0] != found["draws"][1]  # numpy's random state is not the server's copy
