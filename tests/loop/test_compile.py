"""torch.compile and the library: the step timer's hooks add no graph break to a compiled model,
whether the loop compiles before `run.setup` (nanoGPT's order, then DDP) or after it; compiled
before, the forward is still timed. Dynamo counts the graph breaks with and without the hooks.
The compile cache: one private folder per run and machine (steadfast/contract/compile_cache.py),
named to every worker before the task runs, so a restart loads what the first attempt compiled (a
real launch of tests/apps/compiled, killed once)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import ROOT, env, run_dir, summary
from steadfast.contract import compile_cache
from steadfast.telemetry._stragglers import StepTimer

APP = ROOT / "tests" / "apps" / "compiled"


def _model() -> nn.Module:
    """With a buffer (BatchNorm): run.setup hooks the DDP wrapper too (its forward broadcasts buffers)."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def group() -> object:
    """A process group of one (Gloo): DDP as run.setup makes it on torchrun."""
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        yield dist.group.WORLD
        dist.destroy_process_group()


def _watch_as_run_setup_does(timer: StepTimer, model: nn.Module, wrapped: nn.Module) -> None:
    outer = wrapped if any(True for _ in model.buffers()) else model  # steadfast/run.py: Run.setup
    timer.watch(outer, model, forward_is_local=True)


def _train(compiled: nn.Module, timer: StepTimer) -> int:
    """Three steps; how many of their forwards the timer saw begin."""
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    x, seen = torch.randn(8, 8), 0
    for _ in range(3):
        timer.mark()
        loss = compiled(x).square().mean()
        seen += timer._arrival is not None
        loss.backward()
        optimizer.step()
        timer.step()
    return seen


def _graph_breaks(build: Callable[[bool], tuple]) -> Dict[object, int]:
    """The graph breaks Dynamo counts training `build(hooked)`'s model, without and with the hooks
    (and under "timed", the forwards the hooked timer saw)."""
    found = {}
    for hooked in (False, True):
        torch._dynamo.reset()
        counters.clear()
        compiled, timer = build(hooked)
        seen = _train(compiled, timer)
        found[hooked] = sum(counters["graph_break"].values())
        if hooked:
            found["timed"] = seen
    return found


@pytest.mark.parametrize("wrapper", ["none", "ddp"])
def test_a_model_compiled_after_setup_gets_no_graph_break_from_the_hooks(group: object, wrapper: str) -> None:
    """`model = run.setup(model); model = torch.compile(model)`: the hooks are inside the compiled
    region (the old hooks broke the graph at every clock read: six breaks in three steps). "none":
    the model itself, as run.setup returns it on Horovod, backend=local, parallel=none; "ddp": the
    DDP wrapper around a model without buffers (the hooks on the model inside)."""

    def build(hooked: bool) -> tuple:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        wrapped = DDP(model) if wrapper == "ddp" else model
        timer = StepTimer()
        if hooked:
            _watch_as_run_setup_does(timer, model, wrapped)
        return torch.compile(wrapped, backend="eager"), timer

    found = _graph_breaks(build)
    assert found[True] == found[False], found
    if wrapper == "none":
        assert found[True] == 0, found


def test_a_model_compiled_before_setup_has_no_graph_break_and_its_forward_is_timed(group: object) -> None:
    """nanoGPT's order: `model = torch.compile(model)`, then DDP (run.setup): the hooks sit on the
    compiled module, outside its graph, and still see each forward."""

    def build(hooked: bool) -> tuple:
        compiled = torch.compile(_model(), backend="eager")
        wrapped = DDP(compiled)
        timer = StepTimer()
        if hooked:
            _watch_as_run_setup_does(timer, compiled, wrapped)
        return wrapped, timer

    found = _graph_breaks(build)
    assert found[True] == found[False] == 0, found
    assert found["timed"] == 3, found  # every forward seen, in eager code around the compiled graph


# ---- the compile cache ---------------------------------------------------------------------------------
@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A temporary folder of the test's own, and no cache named in the environment."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv(compile_cache.INDUCTOR_ENV, raising=False)
    return tmp_path


def test_the_cache_is_a_private_folder_per_run(cache_env: Path) -> None:
    assert compile_cache.use(cache_env / "outputs" / "a") is None
    chosen = Path(os.environ[compile_cache.INDUCTOR_ENV])
    assert chosen == compile_cache.folder(cache_env / "outputs" / "a") != compile_cache.folder(cache_env / "outputs" / "b")
    for folder in (chosen, chosen.parent):
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert compile_cache.use(cache_env / "outputs" / "a") is None  # a restart: the same folder, kept
    assert Path(os.environ[compile_cache.INDUCTOR_ENV]) == chosen


def test_the_users_own_cache_is_kept_and_torchs_default_is_not_a_choice(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, str(cache_env / "mine"))
    assert compile_cache.use(cache_env / "run") is None and os.environ[compile_cache.INDUCTOR_ENV] == str(cache_env / "mine")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, os.path.abspath(default_cache_dir()))  # what importing torch._dynamo sets
    assert compile_cache.use(cache_env / "run") is None
    assert os.environ[compile_cache.INDUCTOR_ENV] == str(compile_cache.folder(cache_env / "run"))


@pytest.mark.parametrize("planted", ["symlink", "open_mode"])
def test_a_folder_that_is_not_private_is_never_used(cache_env: Path, planted: str) -> None:
    """Someone else's folder (here: a symlink, or a folder others may enter) at the cache's name: the
    cache holds pickles torch loads, so it is refused and torch's default is left in place."""
    target = compile_cache.folder(cache_env / "run")
    target.parent.mkdir(mode=0o700)
    if planted == "symlink":
        (cache_env / "elsewhere").mkdir()
        target.symlink_to(cache_env / "elsewhere")
    else:
        target.mkdir()
        target.chmod(0o777)
    why = compile_cache.use(cache_env / "run")
    assert why is not None and str(target) in why and "torch.compile uses its default cache" in why
    assert compile_cache.INDUCTOR_ENV not in os.environ


def _compiled_launch(cwd: Path, *overrides: str) -> List[Dict[str, Any]]:
    """The compiled app's lines, one per attempt (rank 0, after its first step)."""
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line.partition("COMPILED ")[2]) for line in proc.stdout.splitlines() if "COMPILED " in line]


@pytest.mark.slow
def test_a_compiled_model_has_no_graph_break_and_its_cache_is_the_runs(tmp_path: Path) -> None:
    """A real launch (Dynamo only, cheap): the workers' cache is the run's private folder from the
    task's start, and the library adds no graph break to a model compiled before run.setup (then DDP)."""
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    lines = _compiled_launch(cwd, "backend_compiler=eager")
    folder = run_dir(cwd, "compiled_backend_compiler=eager")
    assert summary(folder)["status"] == "completed"
    assert lines == [{"graph_breaks": 0, "hits": 0, "misses": 0, "cache": str(compile_cache.folder(folder))}]
    shutil.rmtree(compile_cache.folder(folder), ignore_errors=True)


@pytest.mark.slow
@pytest.mark.extended
def test_a_restart_loads_what_the_first_attempt_compiled(tmp_path: Path) -> None:
    """Inductor, one worker killed after step 3: the first attempt compiles (cache misses), the restart
    loads the compiled graphs from the run's cache (hits, no miss). About 25 s here, nearly all of it
    the first compile: in the extended tier."""
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    lines = _compiled_launch(cwd, "fault=kill_rank", "fault.at_step=3")
    folder = run_dir(cwd, "compiled_fault.at_step=3,fault=kill_rank")
    try:
        assert summary(folder)["status"] == "completed" and summary(folder)["restarts"] == 1
        first, restart = lines
        assert first["misses"] >= 1 and first["hits"] == 0, lines
        assert restart["hits"] == first["misses"] and restart["misses"] == 0, lines
        assert first["cache"] == restart["cache"] == str(compile_cache.folder(folder))
        assert first["graph_breaks"] == restart["graph_breaks"] == 0
    finally:
        shutil.rmtree(compile_cache.folder(folder), ignore_errors=True)
