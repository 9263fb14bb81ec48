"""Snapshots in shared memory are their user's alone, and nothing in a segment can hurt its reader
(#23: steadfast/contract/shm.py, steadfast/checkpoint/memory.py).

Real folders, files, processes and signals: the launch's private folder made as the launcher makes
it, snapshots written and read as workers do, a launcher killed with SIGKILL, a writer whose file is
truncated under it, and (as root) another user, uid 65534, in a process of its own.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import env, memory_of
from steadfast.checkpoint import tensorfile
from steadfast.checkpoint.memory import HEADER, HEADER_BYTES, MAGIC, Keyed, MemorySnapshots, announce_off, open_memory
from steadfast.checkpoint.state import Progress, RNGState
from steadfast.contract import shm
from steadfast.contract.env import LaunchEnv

OTHER_UID = 65534  # nobody


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for /dev/shm with its permissions (1777: anyone may create, only owners remove),
    where another user can reach it: under /dev/shm itself when there is one."""
    import steadfast.checkpoint.memory as snapshots

    folder = Path(tempfile.mkdtemp(prefix="sf-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(folder, 0o1777)
    monkeypatch.setattr(shm, "SHM_DIR", folder)
    monkeypatch.setattr(snapshots, "SHM_DIR", folder)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False, timeout=60)


def _snap(memory: MemorySnapshots, step: int, value: float = 0.0) -> None:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value or float(step))
    memory.take(step, memory.plan({"model": model, "progress": Progress(global_step=step)}, {"rng": RNGState()}))


def _slot_bytes(memory: MemorySnapshots, payload: bytes, seq: int, step: int, digest: bytes) -> bytes:
    return HEADER.pack(MAGIC, seq, step, len(payload), digest, memory.world_size).ljust(HEADER_BYTES, b"\0") + payload


def _write(path: Path, data: bytes) -> None:
    """Replace a slot file's bytes in place (as its owner: the file keeps its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _tensor_file(tree: Any) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in tensorfile.plan(tree).buffers())


# ---- the launch's folder ------------------------------------------------------------------------
def test_the_launch_folder_is_private_and_its_key_never_leaves_it(launch: shm.LaunchFolder, tmp_path: Path) -> None:
    st = os.lstat(launch.path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    key = launch.path / shm.KEY_FILE
    assert stat.S_IMODE(os.lstat(key).st_mode) == 0o600 and len(key.read_bytes()) == shm.KEY_BYTES
    name = launch.name
    assert name.startswith(f"steadfast-{shm.run_key(tmp_path / 'run')}-") and len(name.rsplit("-", 1)[1]) == 32  # 128 bits
    environ = LaunchEnv(backend="local", collective="none", run_dir=tmp_path, snapshot=name).to_environ()
    secret = key.read_bytes()
    assert not any(secret.hex() in v or secret.hex().upper() in v for v in environ.values())  # only the folder's name travels
    assert shm.Segments(name).key == secret


def _cadence_refuses(launch: shm.LaunchFolder, tmp_path: Path) -> str:
    """What the workers say when they find the launch's folder not private: snapshots off, and why."""
    from steadfast.telemetry.records import RunRecord

    (tmp_path / "records").mkdir(exist_ok=True)
    record = RunRecord(tmp_path / "records", 0)
    memory, why = open_memory(1, launch.name, 0, 0, 1)
    assert memory is None and why
    announce_off(record.event, why)
    events = [json.loads(line) for line in (tmp_path / "records" / "events.jsonl").read_text().splitlines()]
    return next(e["reason"] for e in events if e["event"] == "snapshot_unavailable")


def test_a_folder_that_is_not_private_is_never_used(launch: shm.LaunchFolder, tmp_path: Path) -> None:
    os.chmod(launch.path, 0o755)
    with pytest.raises(shm.NotPrivate, match="mode 0o755"):
        shm.Segments(launch.name)
    assert "mode 0o755" in _cadence_refuses(launch, tmp_path)
    os.chmod(launch.path, 0o700)
    os.chown(launch.path, OTHER_UID, OTHER_UID)
    with pytest.raises(shm.NotPrivate, match=f"belongs to uid {OTHER_UID}"):
        shm.Segments(launch.name)
    os.chown(launch.path, os.geteuid(), os.getegid())
    link = shm.SHM_DIR / f"{launch.name[:-4]}link"
    link.symlink_to(launch.path)
    with pytest.raises(OSError):  # ELOOP: never followed
        shm.Segments(link.name)
    key = launch.path / shm.KEY_FILE
    key.rename(launch.path / "elsewhere")
    (launch.path / shm.KEY_FILE).symlink_to(launch.path / "elsewhere")
    with pytest.raises(OSError):
        shm.Segments(launch.name)
    for bad in ("../etc", "other-name", ""):
        with pytest.raises(shm.NotPrivate):
            shm.Segments(bad)


# ---- slot files: created exclusively, never followed, checked -----------------------------------
@pytest.mark.timeout(60)
def test_a_symlink_fifo_or_file_not_ours_at_a_slot_name_is_never_used(launch: shm.LaunchFolder, tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("someone's data")
    (launch.path / "rank0.a").symlink_to(target)
    with pytest.raises(OSError):
        _snap(memory_of(launch), 1)
    assert target.read_text() == "someone's data"  # the snapshot's bytes went through the link
    (launch.path / "rank0.a").unlink()

    os.mkfifo(launch.path / "rank0.a")
    started = time.monotonic()
    memory = memory_of(launch)
    assert memory.steps() == [] and memory.own.slots[0].read() is None  # a FIFO hung the snapshot and the restore
    with pytest.raises(shm.NotPrivate, match="not a regular file"):
        _snap(memory, 1)
    assert time.monotonic() - started < 10
    (launch.path / "rank0.a").unlink()

    planted = launch.path / "rank0.a"  # a file someone else made there, open to everyone
    planted.touch()
    os.chown(planted, OTHER_UID, OTHER_UID)
    os.chmod(planted, 0o666)
    with pytest.raises(shm.NotPrivate, match=f"belongs to uid {OTHER_UID}"):
        _snap(memory_of(launch), 1)
    assert planted.stat().st_size == 0  # not written into
    os.chown(planted, os.geteuid(), os.getegid())
    assert memory_of(launch).own.slots[0].header() is None  # ours now, but readable by everyone: refused
    with pytest.raises(shm.NotPrivate, match="mode 0o666"):
        _snap(memory_of(launch), 1)
    planted.unlink()
    _snap(memory_of(launch), 1)
    assert {stat.S_IMODE(p.stat().st_mode) for p in launch.path.iterdir()} == {0o600}


# ---- what a reader accepts: only this launch's own, whole snapshots ---------------------------
def test_a_snapshot_of_another_launch_or_forged_without_the_key_never_verifies(shm_dir: Path, tmp_path: Path) -> None:
    ours, theirs = shm.LaunchFolder(tmp_path / "run"), shm.LaunchFolder(tmp_path / "run")
    ours.create()
    theirs.create()
    try:
        _snap(memory_of(theirs), 5)
        for name in ("objects.a", "rank0.a"):  # another launch's slots, byte for byte (the old pid-reuse case)
            fd = os.open(ours.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, (theirs.path / name).read_bytes())
            os.close(fd)
        memory = memory_of(ours)
        assert memory.steps() == [5] and memory.load(5) is None  # listed by its header, refused by its digest
        assert memory_of(theirs).load(5) is not None

        # the review's forgery: step 1,000,000, every weight 1337, the digest recomputed (unkeyed)
        model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            model.weight.fill_(1337.0)
        forged = _tensor_file({"model": model.state_dict(), "progress": Progress(global_step=10**6).state_dict()})
        for digest in (xxhash.xxh3_128(forged).digest(), Keyed(b"\0" * 32).digest(9, 10**6, len(forged), 1, b"\0" * 16)):
            _write(ours.path / "objects.a", _slot_bytes(memory, forged, 9, 10**6, digest))
            assert memory.objects.slots[0].read() is None
        genuine = Keyed(shm.Segments(ours.name).key)  # only with the key (its owner's) does a slot verify
        data_hash = xxhash.xxh3_128(forged, seed=genuine.seed).digest()
        _write(
            ours.path / "objects.a", _slot_bytes(memory, forged, 9, 10**6, genuine.digest(9, 10**6, len(forged), 1, data_hash))
        )
        assert memory.objects.slots[0].read()[2]["model"]["weight"][0, 0].item() == 1337.0  # type: ignore[index]
    finally:
        ours.remove()
        theirs.remove()


def test_a_header_claiming_more_than_the_file_holds_allocates_nothing(launch: shm.LaunchFolder) -> None:
    """A 4.6 KB file whose header claimed 3 GiB made the reader allocate and zero 3 GiB (5.2 s);
    2**63 raised OverflowError out of it."""
    memory = memory_of(launch)
    _snap(memory, 1)
    slot = memory.objects.slots[0]
    raw = (launch.path / "objects.a").read_bytes()
    _, seq, step, size, digest, world = HEADER.unpack(raw[: HEADER.size])
    for claim in (3 << 30, 2**63, 2**64 - 1, size + 1):
        _write(slot.path, HEADER.pack(MAGIC, seq, step, claim, digest, world) + raw[HEADER.size :])
        tracemalloc.start()
        started = time.monotonic()
        try:
            assert slot.header() is None and slot.read() is None and memory.load(1) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < len(raw) + (1 << 20) and time.monotonic() - started < 5, (claim, peak)


def test_a_snapshot_whose_tensor_cannot_be_built_is_unusable(launch: shm.LaunchFolder) -> None:
    """Through shared memory too (#23 item 2): verified bytes whose empty tensor overflows torch's
    strides made torch.empty raise RuntimeError out of Slot.read."""
    memory = memory_of(launch)
    text = json.dumps({"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}).encode()
    payload = len(text).to_bytes(8, "little") + text
    keyed = Keyed(memory.segments.key)
    digest = keyed.digest(3, 7, len(payload), 1, xxhash.xxh3_128(payload, seed=keyed.seed).digest())
    fd = memory.segments.open("objects.a", "create")
    os.write(fd, _slot_bytes(memory, payload, 3, 7, digest))
    os.close(fd)
    assert memory.objects.slots[0].header() is not None  # whole and keyed: only its contents are wrong
    assert memory.objects.slots[0].read() is None


TRUNCATED_WRITER = """
import os, sys
from pathlib import Path
import torch
from steadfast.contract import shm
from steadfast.checkpoint.memory import MemorySnapshots
from steadfast.checkpoint.state import Progress, RNGState
shm.SHM_DIR = Path(sys.argv[1])
folder = shm.LaunchFolder(Path(sys.argv[2]))
folder.create()
memory = MemorySnapshots(shm.Segments(folder.name), 0, 0, 1)
state = {"model": torch.nn.Linear(512, 512), "progress": Progress()}
memory.take(1, memory.plan(state, {"rng": RNGState()}))
# someone truncates the slot being written, half-way through the copy
memory.take(2, memory.plan(state, {"rng": RNGState()}), lambda: os.truncate(folder.path / "objects.b", 0))
reader = MemorySnapshots(shm.Segments(folder.name), 0, 0, 1)
print(reader.load(2) is None, reader.load(1) is not None, flush=True)
folder.remove()
"""


def test_a_segment_truncated_while_it_is_written_never_kills_the_writer(shm_dir: Path, tmp_path: Path) -> None:
    """The writer copied through a mapping: a store past the end of a truncated file is SIGBUS."""
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATED_WRITER, str(shm_dir), str(tmp_path / "run")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.split() == ["True", "True"]  # that snapshot never verifies; the one before is intact


# ---- random damage: never raises out of the reader, never verifies -----------------------------
@st.composite
def damage(draw: Any) -> Dict[str, Any]:
    kind = draw(st.sampled_from(["flip header", "flip payload", "truncate", "field", "bytes", "shift"]))
    return {"kind": kind, "data": draw(st.data())}


def _damaged(template: bytes, size: int, how: Dict[str, Any]) -> bytes:
    kind, data = how["kind"], how["data"]
    out = bytearray(template)
    if kind in ("flip header", "flip payload"):
        low, high = (0, HEADER.size) if kind == "flip header" else (HEADER_BYTES, HEADER_BYTES + size)
        for pos, bit in data.draw(st.lists(st.tuples(st.integers(low, high - 1), st.integers(0, 7)), min_size=1, max_size=6)):
            out[pos] ^= 1 << bit
        if out == template:  # the flips undid each other
            out[low] ^= 1
        return bytes(out)
    if kind == "truncate":
        return bytes(out[: data.draw(st.integers(0, HEADER_BYTES + size - 1))])
    if kind == "field":
        fields = list(HEADER.unpack(template[: HEADER.size]))
        at = data.draw(st.sampled_from([1, 2, 3, 5]))  # sequence, step, size, world size
        fields[at] = data.draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 64)).filter(lambda v: v != fields[at]))
        return HEADER.pack(*fields) + template[HEADER.size :]
    if kind == "shift":  # bytes inserted before the payload
        return bytes(out[:HEADER_BYTES]) + data.draw(st.binary(min_size=1, max_size=64)) + bytes(out[HEADER_BYTES:])
    return data.draw(st.binary(max_size=HEADER_BYTES + 256))


_genuine: Dict[str, bytes] = {}


@settings(max_examples=200, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=damage())
def test_a_damaged_segment_never_raises_out_of_the_reader_and_never_verifies(
    launch: shm.LaunchFolder, how: Dict[str, Any]
) -> None:
    memory = memory_of(launch)
    slot = memory.objects.slots[0]
    if launch.name not in _genuine:  # one genuine snapshot per test run: every example damages a copy of it
        _snap(memory, 1)
        _genuine[launch.name] = slot.path.read_bytes()
        assert slot.read() is not None
    template = _genuine[launch.name]
    size = HEADER.unpack(template[: HEADER.size])[3]
    _write(slot.path, _damaged(template, size, how))
    assert slot.read() is None
    slot.header()
    memory.steps()
    assert memory.load(1) is None
    _write(slot.path, template)  # the next example starts from the genuine one


# ---- another user ---------------------------------------------------------------------------------
OTHER_USER = r"""
import errno, json, os, sys
shm_dir, folder, old_name = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "done"
    except OSError as exc:
        out[what] = errno.errorcode.get(exc.errno, str(exc.errno))
attempt("list the folder", lambda: os.listdir(folder))
attempt("read a slot", lambda: open(os.path.join(folder, "objects.a"), "rb").read())
attempt("write a slot", lambda: open(os.path.join(folder, "objects.a"), "r+b").write(b"x"))
attempt("read the key", lambda: open(os.path.join(folder, "key"), "rb").read())
attempt("create a file in it", lambda: os.close(os.open(os.path.join(folder, "objects.c"), os.O_CREAT | os.O_WRONLY, 0o666)))
attempt("remove a slot", lambda: os.unlink(os.path.join(folder, "objects.a")))
attempt("rename the folder", lambda: os.rename(folder, folder + "-mine"))
# what it can do: make things at names it chooses in the shared folder, open to everyone
def plant():
    fd = os.open(os.path.join(shm_dir, old_name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)
attempt("plant a file at the old predictable name", plant)
squat = folder.rsplit("-", 1)[0] + "-" + "0" * 32
attempt("make a folder with this run's prefix", lambda: (os.mkdir(squat, 0o777), os.chmod(squat, 0o777)))
print(json.dumps(out))
"""


def _as_other_user() -> None:
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)


def _other_users_python() -> str:
    """An interpreter the other user may run (this one may sit in a folder only root can enter)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run([candidate, "-c", "pass"], preexec_fn=_as_other_user, capture_output=True, timeout=60)
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    pytest.skip("no Python interpreter that uid 65534 may run")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user (uid 65534)")
def test_another_user_can_neither_read_nor_write_nor_pre_create_a_runs_snapshots(
    launch: shm.LaunchFolder, shm_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"  # the launch fixture's run folder
    memory = memory_of(launch)
    _snap(memory, 1)
    before = {p.name: p.read_bytes() for p in launch.path.iterdir()}
    old_name = f"steadfast-{shm.run_key(run)}-{os.getpid()}.objects.a"  # how segments were named before #23
    proc = subprocess.run(
        [_other_users_python(), "-I", "-c", OTHER_USER, str(shm_dir), str(launch.path), old_name],
        preexec_fn=_as_other_user,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    refused = {k: v for k, v in got.items() if not k.startswith(("plant", "make"))}
    assert refused == {k: "EACCES" for k in refused} | {"rename the folder": "EPERM"}, got  # the sticky bit: EPERM
    assert got["plant a file at the old predictable name"] == got["make a folder with this run's prefix"] == "done"
    _snap(memory, 2)  # the run goes on: nothing of the other user's is written into, read, or removed
    assert (shm_dir / old_name).stat().st_size == 0 and (shm_dir / old_name).stat().st_uid == OTHER_UID
    squat = shm_dir / f"{launch.name.rsplit('-', 1)[0]}-{'0' * 32}"
    assert shm.remove_orphans(run, keep=launch.name) == [] and squat.is_dir()  # not ours: never touched
    assert sorted(p.name for p in launch.path.iterdir()) == sorted([*before, "objects.b", "rank0.b"])
    assert memory.steps() == [2, 1] and (launch.path / shm.KEY_FILE).read_bytes() == before[shm.KEY_FILE]
    assert all(p.stat().st_uid == os.geteuid() and stat.S_IMODE(p.stat().st_mode) == 0o600 for p in launch.path.iterdir())
