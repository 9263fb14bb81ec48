"""Running the real entrypoint in a scratch folder and reading what it leaves behind."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

# Small and quick: synthetic data, 2 torchrun workers, a few epochs.
QUICK = [
    "data=synthetic",
    "data.num_samples=512",
    "data.batch_size=16",
    "trainer.max_epochs=4",
    "checkpoint=every_epoch",
    "restart.monitor_interval=0.1",
    "snapshot=off",  # the disk tier: tests/checkpoint/test_snapshots.py turns the memory tier on where it tests it
]


class Box:
    """A Stateful holding any state: what a test checkpoints when the object itself does not matter."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class Recorder:
    """An on_event callback (a CheckpointManager's, say) that keeps what it is told."""

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []

    def __call__(self, kind: Any, **fields: Any) -> None:
        from steadfast.contract.events import Event

        self.events.append({"event": Event(kind).value, **fields})

    def of(self, kind: Any) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind.value]


def manager(folder: Path, keep_last: int = 2, events: Any = None, **kw: Any) -> Any:
    """A real CheckpointManager of one rank (no process group) saving to `folder`."""
    from steadfast.checkpoint.manager import CheckpointManager
    from steadfast.distributed.comm import Comm

    return CheckpointManager(folder, Comm(), keep_last, {"a": 1}, events or (lambda *a, **k: None), **kw)


def model_state(step: int) -> Dict[str, Box]:
    """A model's state that differs at every step."""
    import torch

    return {"model": Box({"w": torch.full((1000,), float(step)), "b": torch.arange(7.0) + step})}


# ---- the built-in trainer's config composed in this process ---------------------------------------
CONF = ROOT / "conf"


def composed(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def problems(*overrides: str) -> List[str]:
    """What the pre-flight (the library's checks and the trainer's) finds in the composed config."""
    from hydra.core.hydra_config import HydraConfig

    import pipeline.config as schema
    from steadfast import preflight as library

    cfg = composed(*overrides)
    HydraConfig.instance().set_config(cfg)
    return library.check(cfg) + schema.preflight(cfg)


# ---- the documents' marked code ---------------------------------------------------------------------
GUIDE = ROOT / "docs" / "own-loop.md"
FILE_BLOCK = re.compile(r"^<!-- file: (\S+) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)


def marked_files(document: Path) -> Dict[str, str]:
    """The blocks of `document` marked `<!-- file: PATH -->`, by PATH."""
    found: Dict[str, str] = {}
    for path, text in FILE_BLOCK.findall(document.read_text()):
        assert path not in found, f"{document.name}: two blocks marked {path}"
        found[path] = text
    return found


def env() -> Dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "launchers"), e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("HYDRA_FULL_ERROR", None)
    return e


def train_cmd(*overrides: str) -> List[str]:
    return [sys.executable, "-m", "pipeline.train", *overrides]


def run_train(cwd: Path, *overrides: str, timeout: float = 240, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(*overrides), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def start_train(cwd: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_cmd(*overrides),
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def slurm_answers() -> bool:
    """A Slurm controller answers here (.ci/run starts a single-node one: scripts/local_slurm.sh)."""
    return bool(
        shutil.which("sbatch")
        and shutil.which("scontrol")
        and subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30).stdout.count("UP")
    )


def free_port() -> int:
    """A TCP port of localhost nothing listens on now (a rendezvous endpoint, a server's port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dir(cwd: Path, name: str) -> Path:
    return cwd / "outputs" / name


def summary(folder: Path) -> Dict[str, Any]:
    return json.loads((folder / "summary.json").read_text())


def events(folder: Path) -> List[Dict[str, Any]]:
    path = folder / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed_steps(folder: Path) -> List[int]:
    ckpts = folder / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckpts.glob("step_*") if (p / "manifest.json").is_file())


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, proc: Optional[subprocess.Popen] = None, every: float = 0.05
) -> Any:
    """Poll `predicate` every `every` seconds until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process ended (exit {proc.returncode}) while waiting for {what}:\n{proc.stdout.read()[-4000:] if proc.stdout else ''}"
            )
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def event_of(folder: Path, kind: str, **match: Any) -> Optional[Dict[str, Any]]:
    for e in events(folder):
        if e.get("event") == kind and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def stop(proc: subprocess.Popen) -> str:
    """End a started launch (and its workers) and return its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return out or ""


def made_once(factory: Any, name: str, make: Callable[[Path], Dict[str, Any]], timeout: float = 600) -> Dict[str, Any]:
    """What `make(folder)` returns (JSON: paths as strings), made once for the whole test session.

    pytest-xdist gives each of its processes a session of its own, so a session fixture would run
    once per process: here the first process to ask makes it, under a lock in the folder the
    processes share, and the others read what it wrote. `make` must leave its folder as it found
    it once returned: tests that change a reference run work on a copy.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(factory.mktemp(name))
    shared = factory.getbasetemp().parent
    made = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout} s waiting for another test process to make {name}") from None
                time.sleep(0.05)
        if made.is_file():
            return json.loads(made.read_text())
        value = make(factory.mktemp(name))
        made.write_text(json.dumps(value))
        return value


def reference_run(factory: Any, name: str, *overrides: str) -> Dict[str, Any]:
    """An uninterrupted run `run.name=<name>` of `overrides`, made once per test session (made_once):
    its folder (read only: a test that runs in it or writes to it works on a copy), its summary and
    the launcher's output."""

    def make(cwd: Path) -> Dict[str, Any]:
        proc = run_train(cwd, *overrides, f"run.name={name}", check=True)
        folder = run_dir(cwd, name)
        return {"dir": str(folder), "summary": summary(folder), "output": proc.stderr + proc.stdout}

    made = made_once(factory, name, make)
    return {**made, "dir": Path(made["dir"])}


def restores(folder: Path) -> List[Dict[str, Any]]:
    """Every `resumed` event after a failed attempt, with `reached`: the furthest step any rank had
    reached in that attempt (its attempt_ended)."""
    out, reached = [], None
    for e in events(folder):
        if e["event"] == "attempt_ended":
            reached = e["last_step"]
        elif e["event"] == "resumed" and reached is not None:
            out.append({**e, "reached": reached})
            reached = None
    return out


def first_values(folder: Path) -> Dict[Tuple[int, str], float]:
    """Each (step, metric) number of metrics.jsonl with its first value (a step trained again after a
    resume is logged again, with its restart): what metrics.csv and an MLflow run hold, once each."""
    out: Dict[Tuple[int, str], float] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("time", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault((row["step"], key), float(value))
    return out


def assert_metrics_csv_matches(folder: Path) -> None:
    """metrics.csv (logger.sinks has csv): one row per step, in order, and every number of
    metrics.jsonl in it, its first value, exactly."""
    with open(folder / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    assert steps and steps == sorted(set(steps)), steps
    cells = {(int(r["step"]), k): float(v) for r in rows for k, v in r.items() if k not in ("step", "time") and v != ""}
    assert cells == first_values(folder)


def checkpointer(where: Any, folder: Path) -> Any:
    """A Checkpointer of one rank (no launcher, no faults) saving to `where`, recording into `folder`."""
    from steadfast.checkpoint.tracked import Checkpointer
    from steadfast.config import FaultConf, Settings
    from steadfast.contract.env import LaunchEnv
    from steadfast.distributed.comm import Comm
    from steadfast.faults import FaultInjector
    from steadfast.telemetry.records import RunRecord

    return Checkpointer(
        where,
        Comm(),
        Settings(),
        {},
        RunRecord(folder, 0),
        LaunchEnv(backend="local", collective="none", run_dir=folder),
        FaultInjector(FaultConf(), 0, folder, print),
        lambda phase: None,
    )


# ---- a local S3 server (SeaweedFS, scripts/s3_server.sh) ---------------------------------------------
def _ports_free(base: int) -> bool:
    import socket

    for port in [base + i for i in range(5)] + [base + i + 10000 for i in range(5)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


class S3Server:
    """SeaweedFS started by scripts/s3_server.sh in `folder`, on free ports, with keys made up for
    this server: `env` is what a client needs (AWS_ENDPOINT_URL and the keys), `bucket` one made empty."""

    def __init__(self, folder: Path) -> None:
        import random
        import secrets

        base = next(b for b in (random.randrange(20000, 29990, 10) for _ in range(200)) if _ports_free(b))
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{base}",
            "AWS_ACCESS_KEY_ID": f"steadfast-{secrets.token_hex(6)}",
            "AWS_SECRET_ACCESS_KEY": f"secret-{secrets.token_hex(16)}",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.log = open(folder / "weed.log", "wb")
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "s3_server.sh"), str(folder), str(base)],
            env={**os.environ, **self.env, "VENV": str(Path(sys.executable).parent.parent)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready(folder)
        except BaseException:
            self.close()
            raise

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def _wait_ready(self, folder: Path, timeout: float = 90) -> None:
        """Until a bucket can be made and an object written (the volume server takes a moment after the S3 port opens)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited {self.proc.returncode}: {(folder / 'weed.log').read_text()[-2000:]}")
            try:
                c = self.client()
                c.create_bucket(Bucket="ready")
                c.put_object(Bucket="ready", Key="probe", Body=b"ok")
                return
            except Exception as exc:  # not answering yet
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"the S3 server did not take a write within {timeout} s: {last}")

    def bucket(self, name: str) -> str:
        """A fresh bucket `name` (its objects removed if it was there)."""
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=name):
            for o in page.get("Contents", []):
                c.delete_object(Bucket=name, Key=o["Key"])
        return name

    def keys(self, bucket: str) -> List[str]:
        c = self.client()
        return sorted(
            o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)  # its data is a test's: not worth a slow shutdown
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()


def memory_of(launch: Any, world_size: int = 1) -> Any:
    """A worker's snapshots in the launch's folder (`launch` fixture), as a new process makes them: the
    folder opened and checked afresh."""
    from steadfast.checkpoint.memory import MemorySnapshots
    from steadfast.contract import shm

    return MemorySnapshots(shm.Segments(launch.name), rank=0, local_rank=0, world_size=world_size)
