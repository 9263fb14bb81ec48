"""Checkpoints in an S3 bucket: checkpoint.dir=s3://bucket/prefix (AWS, or any S3 API: SeaweedFS,
MinIO, Ceph...), through boto3 (`pip install steadfast[s3]`).

The endpoint, the region and the keys are taken the way the AWS CLI takes them, from the
environment and nowhere else: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/config, an instance's role. None of them is in the
run's config, and none is written to a record: messages name the bucket, the prefix and the endpoint.

Layout: checkpoint `step_N` is the objects `<prefix>/step_N/<file>`, and it is committed when
`<prefix>/step_N/manifest.json` exists. An object store has no rename, so a save writes its files in
place and puts the manifest last (a PUT is atomic: an object is there whole or not at all): a save
cut short leaves files without a manifest, which nothing lists and the next save of that step (or
the next run's start) removes. A committed `step_N` already there when a save of the same step
begins is set aside first (copied to `.unusable-step_N-replaced-<id>/`, then removed, its manifest
first). Setting aside copies every object, then removes the manifest (the checkpoint is no longer
committed), then the rest; discarding removes the manifest first too. Each file is hashed (xxh3-128,
what the manifest records) before it is handed to the client; boto3 adds its own checksum to each
PUT, which the server checks, so a rank's check of what it wrote compares sizes; the commit's
read-back (rank 0 writing every file) and every resume check every byte against the manifest.
Requests are retried by boto3 (standard mode); a save that still fails fails like a full disk: the
newest committed checkpoint stays as it was.
"""

from __future__ import annotations

import io
import os
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import xxhash

from .base import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TMP_PREFIX,
    TRASH_PREFIX,
    Batch,
    FileCheckError,
    Files,
    Store,
    StoreError,
    checksum_of,
    register,
    set_aside_name,
    step_dir_name,
    step_of,
)

BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
READ_CHUNK = 16 << 20
MULTIPART_ABOVE = 1 << 30  # one PUT up to this (S3 takes 5 GiB); above, parts of 64 MiB, 4 at a time
CHECK_TIMEOUT_S = 5  # the pre-flight's: an endpoint that does not answer in this is reported, not waited for


def parse_location(location: str) -> Tuple[str, str]:
    """(bucket, prefix without slashes at either end) of `s3://bucket/prefix`; ValueError naming what is allowed."""
    rest = location[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not BUCKET.fullmatch(bucket):
        raise ValueError(
            f"checkpoint.dir={location}: {bucket!r} is not a bucket name (3 to 63 lowercase letters, digits, '.' and '-'); "
            "use s3://bucket/prefix"
        )
    return bucket, prefix.strip("/")


def _client(check: bool = False) -> Any:
    """An S3 client configured from the environment only (see the module's docstring)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise StoreError("checkpoint.dir=s3://... needs boto3: pip install 'steadfast[s3]' (or boto3)") from None
    session = boto3.session.Session()
    timeouts = (
        {"connect_timeout": CHECK_TIMEOUT_S, "read_timeout": CHECK_TIMEOUT_S, "retries": {"max_attempts": 1, "mode": "standard"}}
        if check
        else {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 6, "mode": "standard"}}
    )
    config = Config(max_pool_connections=16, **timeouts)
    return session.client("s3", region_name=session.region_name or "us-east-1", config=config)


_CLIENTS: Dict[Any, Any] = {}  # one per process (a forked child makes its own) and environment
_LOCK = threading.Lock()


def client(check: bool = False) -> Any:
    key = (os.getpid(), check, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = _client(check)
        return _CLIENTS[key]


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str((response or {}).get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _missing(exc: BaseException) -> bool:
    return _code(exc) in ("404", "NoSuchKey", "NotFound")


class _Pieces(io.RawIOBase):
    """Buffers read in order as one seekable stream (a PUT's body, without joining them into one copy)."""

    def __init__(self, views: List[memoryview]) -> None:
        self.views, self.total, self.pos = views, sum(v.nbytes for v in views), 0
        self.starts = [0]
        for v in views:
            self.starts.append(self.starts[-1] + v.nbytes)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.total}[whence]
        self.pos = max(0, min(self.total, base + offset))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < out.nbytes and self.pos < self.total:
            i = next(k for k in range(len(self.views)) if self.starts[k + 1] > self.pos)
            at = self.pos - self.starts[i]
            n = min(out.nbytes - done, self.views[i].nbytes - at)
            out[done : done + n] = self.views[i][at : at + n]
            done += n
            self.pos += n
        return done


class BucketFiles(Files):
    """A committed checkpoint's objects, each checked against the manifest's size before it is read."""

    def __init__(self, store: "BucketStore", name: str, sizes: Dict[str, int]) -> None:
        self.store, self.name, self.sizes = store, name, sizes
        self._checked: Dict[str, int] = {}
        self._held: Dict[str, memoryview] = {}

    def where(self, name: str) -> str:
        return f"{self.store.where(self.name)}/{name}" if name else self.store.where(self.name)

    def hold(self, name: str, data: Any) -> None:
        self._held[name] = memoryview(data)

    def size(self, name: str) -> int:
        if name not in self._checked:
            if name not in self.sizes:
                raise FileCheckError(f"{self.where(name)}: not in the manifest", "missing")
            actual = self.store.object_size(self.store.key(self.name, name), self.where(name))
            if actual != self.sizes[name]:
                raise FileCheckError(f"{self.where(name)}: size is {actual} bytes, the manifest says {self.sizes[name]}", "size")
            self._checked[name] = actual
        return self._checked[name]

    def read(self, name: str, offset: int, length: int) -> Any:
        held = self._held.get(name)
        if held is not None:
            if offset + length > held.nbytes:
                raise FileCheckError(f"{self.where(name)}: ended before byte {offset + length}", "size")
            return held[offset : offset + length]
        if offset + length > self.size(name):
            raise FileCheckError(f"{self.where(name)}: ended before byte {offset + length}", "size")
        buf = bytearray(length)
        if length:
            self._into(name, memoryview(buf), offset, None)
        return buf

    def _into(self, name: str, view: memoryview, offset: int, digest: Any) -> None:
        """Fill `view` from the object at `offset` (hashing what arrives into `digest`)."""
        end = offset + view.nbytes - 1
        body = self.store.call(
            "read", self.where(name), "get_object", Key=self.store.key(self.name, name), Range=f"bytes={offset}-{end}"
        )["Body"]
        pos = 0
        try:
            while pos < view.nbytes:
                chunk = body.read(min(READ_CHUNK, view.nbytes - pos))
                if not chunk:
                    raise FileCheckError(f"{self.where(name)}: ended after {offset + pos} bytes", "size")
                view[pos : pos + len(chunk)] = chunk
                if digest is not None:
                    digest.update(chunk)
                pos += len(chunk)
        finally:
            body.close()

    def read_verified(self, name: str, size: int, checksum: str) -> bytearray:
        if self.size(name) != size:
            raise FileCheckError(f"{self.where(name)}: size is {self.size(name)} bytes, the manifest says {size}", "size")
        buf, digest = bytearray(size), xxhash.xxh3_128()
        if size:
            self._into(name, memoryview(buf), 0, digest)
        self._check(name, digest, checksum)
        return buf

    def verify(self, name: str, size: int, checksum: Optional[str]) -> None:
        if self.size(name) != size:
            raise FileCheckError(f"{self.where(name)}: size is {self.size(name)} bytes, the manifest says {size}", "size")
        if checksum is None:
            return
        digest, chunk = xxhash.xxh3_128(), memoryview(bytearray(min(size, READ_CHUNK) or 1))
        for start in range(0, size, READ_CHUNK):
            part = chunk[: min(READ_CHUNK, size - start)]
            self._into(name, part, start, digest)
        self._check(name, digest, checksum)

    def _check(self, name: str, digest: Any, checksum: Optional[str]) -> None:
        if checksum is not None and checksum_of(digest) != checksum:
            raise FileCheckError(
                f"{self.where(name)}: checksum mismatch (the object was changed or damaged after it was written)", "checksum"
            )


@register
class BucketStore(Store):
    scheme = "s3"

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.bucket, self.prefix = parse_location(location)
        self._replaced: Dict[str, str] = {}  # staged name -> where the committed checkpoint it replaces went

    # ---- names and requests -------------------------------------------------------------------
    def where(self, name: str = "") -> str:
        path = "/".join(p for p in (self.prefix, name) if p)
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def key(self, name: str, file: str = "") -> str:
        return "/".join(p for p in (self.prefix, name, file) if p)

    def _endpoint(self) -> str:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's endpoint"

    def _error(self, what: str, where: str, exc: BaseException) -> StoreError:
        code = _code(exc)
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            why = "no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
        elif code in ("NoSuchBucket",) or (code in ("404", "NotFound") and what == "check"):
            why = f"bucket {self.bucket} does not exist at {self._endpoint()}; create it, or choose another checkpoint.dir"
        elif code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            why = f"access denied ({code}): check the keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        elif type(exc).__name__ in (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
        ):
            why = f"the S3 endpoint {self._endpoint()} does not answer ({type(exc).__name__}); check AWS_ENDPOINT_URL and the network"
        else:
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
        return StoreError(f"checkpoint.dir={self.location}: cannot {what} {where}: {why}")

    def call(self, what: str, where: str, method: str, check: bool = False, **kwargs: Any) -> Any:
        """client.<method>(Bucket=..., **kwargs); a failure is a StoreError naming `what`, `where` and the
        cause (a missing object: FileCheckError 'missing')."""
        try:
            return getattr(client(check), method)(Bucket=self.bucket, **kwargs)
        except StoreError:
            raise
        except Exception as exc:  # botocore's errors, and the transport's
            if _missing(exc) and what != "check":
                raise FileCheckError(f"{where}: missing", "missing") from None
            raise self._error(what, where, exc) from None

    def object_size(self, key: str, where: str) -> int:
        return int(self.call("read", where, "head_object", Key=key)["ContentLength"])

    def _keys(self, under: str = "") -> List[Tuple[str, int]]:
        """(key relative to the prefix, size) of every object under `<prefix>/<under>`."""
        base = self.key(under)
        start = f"{base}/" if base else ""
        out = []
        try:
            pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
            for page in pages:
                out += [(o["Key"][len(start) :], int(o["Size"])) for o in page.get("Contents", [])]
        except Exception as exc:
            raise self._error("list", self.where(under), exc) from None
        return out

    def _delete(self, name: str, files: Sequence[str]) -> None:
        keys = [self.key(name, f) for f in files]
        for i in range(0, len(keys), 1000):
            self.call(
                "remove",
                self.where(name),
                "delete_objects",
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def _exists(self, name: str, file: str) -> bool:
        try:
            self.object_size(self.key(name, file), self.where(name))
            return True
        except FileCheckError:
            return False

    # ---- writing --------------------------------------------------------------------------------
    def prepare(self) -> None:
        problem = self.problem()
        if problem:
            raise StoreError(problem)
        by_name: Dict[str, List[str]] = {}
        for key, _ in self._keys():
            name, _, file = key.partition("/")
            by_name.setdefault(name, []).append(file)
        for name, files in by_name.items():
            leftover = name.startswith((TMP_PREFIX, TRASH_PREFIX)) or (step_of(name) is not None and MANIFEST not in files)
            if leftover:
                self._delete(name, files)

    def stage(self, step: int) -> str:
        name = step_dir_name(step)
        if self._exists(name, MANIFEST):  # committed: kept, under another name, before anything is written over it
            self._replaced[name] = self.set_aside(name, "replaced")
        else:  # a save of this step cut short before: its files, never committed
            self._delete(name, [file for file, _ in self._keys(name)])
        return name

    def write(
        self, staged: str, file: str, pieces: Sequence[Any], batch: Optional[Batch] = None, verify: bool = False
    ) -> Tuple[int, str]:
        views = [memoryview(p).cast("B") for p in pieces]
        views = [v for v in views if v.nbytes]
        digest = xxhash.xxh3_128()
        for v in views:
            digest.update(v)
        body, total, where = _Pieces(views), sum(v.nbytes for v in views), f"{self.where(staged)}/{file}"
        if total <= MULTIPART_ABOVE:
            self.call("write", where, "put_object", Key=self.key(staged, file), Body=body, ContentLength=total)
        else:
            from boto3.s3.transfer import TransferConfig

            config = TransferConfig(multipart_threshold=MULTIPART_ABOVE, multipart_chunksize=64 << 20, max_concurrency=4)
            try:
                client().upload_fileobj(body, self.bucket, self.key(staged, file), Config=config)
            except Exception as exc:
                raise self._error("write", where, exc) from None
        if verify:
            actual = self.object_size(self.key(staged, file), where)
            if actual != total:
                raise FileCheckError(f"{where}: {actual} bytes in the bucket after writing {total}", "size")
        return total, checksum_of(digest)

    def commit(self, staged: str, step: int, manifest: bytes, batch: Batch, fence: Any = None) -> Tuple[str, Optional[str]]:
        if fence is not None:
            fence()  # the orphan fence, right before the manifest that commits
        self.call("commit", self.where(staged), "put_object", Key=self.key(staged, MANIFEST), Body=manifest)
        return staged, self._replaced.pop(staged, None)

    def abandon(self, staged: str) -> None:
        try:
            if not self._exists(staged, MANIFEST):  # never a committed checkpoint's files
                self._delete(staged, [file for file, _ in self._keys(staged)])
        except OSError:
            pass  # left for the next save of this step, or the next run's start

    # ---- reading --------------------------------------------------------------------------------
    def names(self) -> List[str]:
        keys = self._keys()  # StoreError when it cannot be listed now: never "no checkpoints"
        return sorted(
            {
                k.partition("/")[0]
                for k, _ in keys
                if k.endswith(f"/{MANIFEST}") and k.count("/") == 1 and step_of(k.partition("/")[0]) is not None
            }
        )

    def read_manifest(self, name: str) -> bytes:
        where = f"{self.where(name)}/{MANIFEST}"
        response = self.call("read", where, "get_object", Key=self.key(name, MANIFEST), Range=f"bytes=0-{MAX_MANIFEST_BYTES}")
        data = bytes(response["Body"].read(MAX_MANIFEST_BYTES + 1))
        if len(data) > MAX_MANIFEST_BYTES:
            raise FileCheckError(f"{where}: more than the {MAX_MANIFEST_BYTES} bytes allowed", "size")
        return data

    def open(self, name: str, sizes: Dict[str, int]) -> Files:
        return BucketFiles(self, name, sizes)

    # ---- lifecycle ------------------------------------------------------------------------------
    def set_aside(self, name: str, reason: str) -> str:
        target = set_aside_name(name, reason)
        files = [file for file, _ in self._keys(name)]
        ordered = sorted(files, key=lambda f: f == MANIFEST)  # the manifest copied last: the copy is whole or not a checkpoint
        for file in ordered:
            source = {"Bucket": self.bucket, "Key": self.key(name, file)}
            self.call("set aside", self.where(name), "copy_object", Key=self.key(target, file), CopySource=source)
        self._delete(name, [MANIFEST])  # no longer committed
        self._delete(name, [f for f in files if f != MANIFEST])
        return target

    def discard(self, name: str) -> None:
        self._delete(name, [MANIFEST])  # invisible at once, even if the removal below is interrupted
        self._delete(name, [file for file, _ in self._keys(name)])

    def problem(self) -> Optional[str]:
        try:
            self.call("check", self.where(), "head_bucket", check=True)
            probe = self.key(f"{TMP_PREFIX}probe-{os.getpid()}")
            self.call("check", self.where(), "put_object", check=True, Key=probe, Body=b"ok")
            self.call("check", self.where(), "delete_object", check=True, Key=probe)
        except OSError as exc:
            return str(exc)
        return None
