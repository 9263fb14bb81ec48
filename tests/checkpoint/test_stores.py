"""Checkpoints anywhere: the Store seam (a toy store added from a test, as a new store is added),
and checkpoint.dir=s3://... against a real S3 server (SeaweedFS, started by the `s3_server` fixture
through scripts/s3_server.sh): saving, retention, the fall-back from crafted, truncated and missing
objects, the pre-flight's errors, and a run killed and resumed from the bucket in a fresh folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from helpers import QUICK, Box, S3Server, checkpointer, event_of, events, run_dir, run_train, summary
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint.manager import CheckpointError, CheckpointManager
from steadfast.checkpoint.replicated import STATE_FILE
from steadfast.checkpoint.storage import base, store_for
from steadfast.checkpoint.storage.base import Batch, FileCheckError, Files, Store
from steadfast.contract.events import Event
from steadfast.distributed.comm import Comm

STEPS = ["checkpoint=every_n_steps", "checkpoint.every_n_steps=6"]  # as tests/test_e2e_recovery.py: mid-epoch saves


class Recorder:
    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []

    def __call__(self, kind: Event, **fields: Any) -> None:
        self.events.append({"event": Event(kind).value, **fields})

    def steps(self, kind: Event) -> List[Any]:
        return [e["step"] for e in self.events if e["event"] == kind.value]


def state(step: int) -> Dict[str, Box]:
    return {"model": Box({"w": torch.full((5000,), float(step)), "b": torch.arange(7.0) + step})}


def save_steps(m: CheckpointManager, steps: Sequence[int]) -> None:
    for step in steps:
        m.save(step, state(step), {"rng": Box({"seed": torch.tensor([step])})}, {"epoch": step})
        m.wait()


def restored_step(m: CheckpointManager) -> Optional[int]:
    target = {"model": Box({"w": torch.zeros(5000), "b": torch.zeros(7)})}
    r = m.restore(target, {"rng": Box({"seed": torch.tensor([0])})}, False)
    if r is None:
        return None
    assert float(target["model"].state["w"][0]) == r.step  # the bytes of that step, loaded
    return r.step


# ---- a toy store, added the way a new store is: one class with @register ------------------------
class _MemoryFiles(Files):
    def __init__(self, files: Dict[str, bytes], where: str) -> None:
        self.files, self._where = files, where

    def where(self, name: str) -> str:
        return f"{self._where}/{name}"

    def size(self, name: str) -> int:
        if name not in self.files:
            raise FileCheckError(f"{self.where(name)}: missing", "missing")
        return len(self.files[name])

    def read(self, name: str, offset: int, length: int) -> Any:
        return bytearray(self.files[name][offset : offset + length])

    def read_verified(self, name: str, size: int, checksum: str) -> bytearray:
        self.verify(name, size, checksum)
        return bytearray(self.files[name])

    def verify(self, name: str, size: int, checksum: Optional[str]) -> None:
        import xxhash

        if self.size(name) != size:
            raise FileCheckError(f"{self.where(name)}: size", "size")
        if checksum is not None and base.checksum_of(xxhash.xxh3_128(self.files[name])) != checksum:
            raise FileCheckError(f"{self.where(name)}: checksum", "checksum")


TOY: Dict[str, Dict[str, bytes]] = {}  # checkpoint or staged name -> file -> bytes


@base.register
class ToyStore(Store):
    """A dict in this process: what a new store is (its scheme, stage/write/commit, list, read, set aside)."""

    scheme = "toy"

    def where(self, name: str = "") -> str:
        return f"{self.location}/{name}" if name else self.location

    def prepare(self) -> None:
        pass

    def stage(self, step: int) -> str:
        name = base.unique(base.TMP_PREFIX, base.step_dir_name(step))
        TOY[name] = {}
        return name

    def write(
        self, staged: str, file: str, pieces: Sequence[Any], batch: Optional[Batch] = None, verify: bool = False
    ) -> Tuple[int, str]:
        import xxhash

        data = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
        TOY[staged][file] = data
        return len(data), base.checksum_of(xxhash.xxh3_128(data))

    def commit(self, staged: str, step: int, manifest: bytes, batch: Batch, fence: Any = None) -> Tuple[str, Optional[str]]:
        TOY[staged][base.MANIFEST] = manifest
        TOY[base.step_dir_name(step)] = TOY.pop(staged)
        return base.step_dir_name(step), None

    def abandon(self, staged: str) -> None:
        TOY.pop(staged, None)

    def names(self) -> List[str]:
        return [n for n, files in TOY.items() if base.step_of(n) is not None and base.MANIFEST in files]

    def read_manifest(self, name: str) -> bytes:
        return TOY[name][base.MANIFEST]

    def open(self, name: str, sizes: Dict[str, int]) -> Files:
        return _MemoryFiles(TOY[name], self.where(name))

    def set_aside(self, name: str, reason: str) -> str:
        target = base.set_aside_name(name, reason)
        TOY[target] = TOY.pop(name)
        return target

    def discard(self, name: str) -> None:
        TOY.pop(name)

    def problem(self) -> Optional[str]:
        return None


def test_a_new_store_is_one_class_and_its_registration() -> None:
    TOY.clear()
    events = Recorder()
    m = CheckpointManager("toy://anywhere", Comm(), 2, {"a": 1}, events)
    save_steps(m, [1, 2, 3])
    assert sorted(n for n in TOY if not n.startswith(".")) == ["step_000000002", "step_000000003"]  # retention
    assert [c.step for c in mf.scan("toy://anywhere")] == [3, 2]
    TOY["step_000000003"][STATE_FILE] = TOY["step_000000003"][STATE_FILE][:-1]  # truncated: falls back
    assert restored_step(m) == 2
    assert events.steps(Event.CHECKPOINT_INVALID) == [3] and [n for n in TOY if n.startswith(mf.SET_ASIDE_PREFIX)]
    m.close()
    with pytest.raises(ValueError, match="no store for nope://"):
        store_for("nope://x")


# ---- S3: in this process, against the server ----------------------------------------------------
@pytest.fixture
def bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    name = "t-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    return s3_server.bucket(name)


def test_saves_commit_with_the_manifest_last_and_retention_works_on_the_bucket(s3_server: S3Server, bucket: str) -> None:
    where = f"s3://{bucket}/runs/a"
    s3_server.client().put_object(Bucket=bucket, Key="runs/a/step_000000009/state.bin", Body=b"a save cut short")
    m = CheckpointManager(where, Comm(), 2, {"a": 1}, Recorder())
    assert "runs/a/step_000000009/state.bin" not in s3_server.keys(bucket)  # never committed: removed at start
    save_steps(m, [1, 2, 3])
    assert s3_server.keys(bucket) == [f"runs/a/step_00000000{s}/{f}" for s in (2, 3) for f in (mf.MANIFEST, STATE_FILE)]
    assert [(c.step, c.path) for c in mf.scan(where)] == [(3, f"{where}/step_000000003"), (2, f"{where}/step_000000002")]
    assert restored_step(m) == 3
    m.close()


def test_crafted_truncated_and_missing_objects_fall_back_and_are_set_aside(s3_server: S3Server, bucket: str) -> None:
    where, c = f"s3://{bucket}/run", s3_server.client()
    m = CheckpointManager(where, Comm(), 5, {"a": 1}, Recorder())
    save_steps(m, [1, 2, 3, 4, 5])
    m.close()
    key = "run/step_00000000{}/{}".format
    whole = c.get_object(Bucket=bucket, Key=key(5, STATE_FILE))["Body"].read()
    c.put_object(Bucket=bucket, Key=key(5, STATE_FILE), Body=whole[:-100])  # truncated
    c.delete_object(Bucket=bucket, Key=key(4, STATE_FILE))  # missing
    c.put_object(Bucket=bucket, Key=key(3, mf.MANIFEST), Body=b'{"format": 4, "step": 3}')  # a crafted manifest
    flipped = bytearray(whole)
    flipped[-1] ^= 0xFF
    c.put_object(Bucket=bucket, Key=key(2, STATE_FILE), Body=bytes(flipped))  # a flipped byte
    events = Recorder()
    m = CheckpointManager(where, Comm(), 5, {"a": 1}, events)
    assert restored_step(m) == 1
    assert sorted(events.steps(Event.CHECKPOINT_INVALID)) == [2, 3, 4, 5]
    assert [s for s, _ in mf.committed(where)] == [1]
    aside = {k.split("/")[1] for k in s3_server.keys(bucket) if k.split("/")[1].startswith(mf.SET_ASIDE_PREFIX)}
    assert sorted(a.split("-")[1] for a in aside) == ["step_000000002", "step_000000003", "step_000000004", "step_000000005"]
    save_steps(m, [2])  # the run goes on from step 1, into the bucket
    assert [s for s, _ in mf.committed(where)] == [2, 1]
    m.close()


def test_the_pre_flight_names_checkpoint_dir_for_a_missing_bucket_bad_keys_or_no_endpoint(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store_for(f"s3://{bucket}/x").problem() is None
    missing = store_for("s3://no-such-bucket-here/x").problem()
    assert missing and missing.startswith("checkpoint.dir=s3://no-such-bucket-here/x") and "does not exist" in missing
    with pytest.raises(ValueError, match="not a bucket name"):
        store_for("s3://A_B/x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert "access denied" in (store_for(f"s3://{bucket}/x").problem() or "")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
    unreachable = store_for(f"s3://{bucket}/x").problem()
    assert unreachable and "does not answer" in unreachable and f"checkpoint.dir=s3://{bucket}/x" in unreachable
    with pytest.raises(CheckpointError, match="does not answer"):
        CheckpointManager(f"s3://{bucket}/x", Comm(), 2, {"a": 1}, Recorder())


# ---- S3: real runs ------------------------------------------------------------------------------
def _files_text(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode(errors="replace") for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_killed_run_resumes_from_the_bucket_in_a_fresh_folder_and_ends_exact(
    tmp_path: Path, baseline: dict, s3_server: S3Server, bucket: str
) -> None:
    args = [*QUICK, *STEPS, "run.name=r", "restart=none", f"checkpoint.dir=s3://{bucket}/r"]
    first, fresh = tmp_path / "machine-a", tmp_path / "machine-b"
    first.mkdir()
    fresh.mkdir()
    assert run_train(first, *args, "fault=kill_rank", "fault.at_step=25").returncode != 0
    assert [s for s, _ in mf.committed(f"s3://{bucket}/r")][0] == 24
    assert not (run_dir(first, "r") / "checkpoints").exists() and not (first / "s3:").exists()  # nothing on the local disk
    run_train(fresh, *args, check=True)  # another machine: no local files at all
    folder = run_dir(fresh, "r")
    resumed = event_of(folder, "resumed")
    assert resumed is not None and resumed["step"] == 24 and resumed["path"] == f"s3://{bucket}/r/step_000000024"
    s = summary(folder)
    assert s["status"] == "completed" and s["model_sha256"] == baseline["summary"]["model_sha256"]
    assert not [k for k in s3_server.keys(bucket) if k.split("/")[1].startswith((mf.TMP_PREFIX, mf.TRASH_PREFIX))]
    for where in (run_dir(first, "r"), folder):  # the keys are the environment's, never in a record
        text = _files_text(where)
        assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in text and s3_server.env["AWS_ACCESS_KEY_ID"] not in text


@pytest.mark.slow
def test_a_missing_bucket_is_refused_before_any_worker_starts(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    proc = run_train(tmp_path, *QUICK, "run.name=r", "checkpoint.dir=s3://no-such-bucket-here/r", timeout=120)
    assert proc.returncode != 0
    assert "checkpoint.dir=s3://no-such-bucket-here/r" in proc.stderr and "does not exist" in proc.stderr
    folder = run_dir(tmp_path, "r")
    assert not folder.exists() or not [e for e in events(folder) if e["event"] in ("attempt_started", "rendezvous")]


def _dead_endpoint(monkeypatch: pytest.MonkeyPatch) -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    return url


def test_a_save_the_bucket_cannot_take_does_not_stop_training_and_the_next_one_commits(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from steadfast.checkpoint.state import Progress

    where = f"s3://{bucket}/run"
    ck = checkpointer(where, tmp_path)
    progress = Progress()
    ck.track(progress, {"model": torch.nn.Linear(2, 2)})
    for step in (1, 2, 3):
        progress.global_step = step
        with monkeypatch.context() as m:
            if step == 2:
                _dead_endpoint(m)
            ck.save(progress)  # step 2: the endpoint is gone, and training goes on
    failed = [e for e in events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [2] and where in failed[0]["error"] and "does not answer" in failed[0]["error"]
    assert [s for s, _ in mf.committed(where)] == [3, 1]
    ck.close()


def test_a_forked_child_names_its_staged_saves_apart_from_its_parent() -> None:
    """A staged save's name has a random part drawn without a system call (base.unique): a forked
    child, which starts with its parent's state, draws its own names, never the parent's next ones."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next names, to the parent
        os.close(read)
        os.write(write, "\n".join(base.unique(base.TMP_PREFIX, "step_1") for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    try:
        child = set(os.read(read, 1 << 16).decode().split("\n"))
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    parent = {base.unique(base.TMP_PREFIX, "step_1") for _ in range(4)}
    assert len(child) == 4 and len(parent) == 4 and not child & parent
