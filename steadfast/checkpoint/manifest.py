"""What makes a checkpoint committed, how to list them, and which config changes a resume accepts.

Cheap (no torch): the launcher's pre-flight uses it to refuse a bad resume before workers start.

A checkpoint is `step_<9 digits>` in its store (a folder, or a prefix in a bucket: storage/) holding
its files and `manifest.json`, written last by the store's commit. Only those with a manifest are
committed; anything else in the store is invisible to resume. Every manifest carries `commit`, a
sequence number one above the highest in the folder when it was committed: checkpoints are ordered
by it (never by step number, file time or name), so a run that starts again at step 100 next to
older checkpoints at step 5000 still has the newest one. A commit is at most MAX_COMMIT (more saves
than any run makes), so a manifest crafted with a larger one is unusable rather than chosen, and the
next commit always validates: at MAX_COMMIT itself (reachable only by a crafted manifest) the
sequence stays there and equal commits are ordered by step. Unusable checkpoints are moved aside to
`.unusable-step_<N>-<reason>-<id>`, which nothing lists. Retention ranks by step, the folder's name
(`expendable`): a commit that a flipped bit raised cannot make it remove the newest work. With
`checkpoint.monitor` a manifest also records that metric's value (`metric`), which retention ranks
by too (retention.py): retention reads nothing but the manifests.

A manifest checks itself (`seal`, `parse`): its first line holds `digest`, the xxh3-128 of every byte
after that line, checked before anything in it is parsed or used. A manifest without one was written
by an earlier version and is still read (its fields validated like any other; `Listed.sealed` says
which), unless something in it looks like a digest: a bit flipped in the name "digest" or in the
first line is damage, not an old manifest. Every manifest read back is then validated (types,
bounds, names, the folder's step): the fields every checkpoint has here, then those of its format by
that format's own check (formatspec.py: a format this process has no spec of is unusable); any
failure is a ManifestError (a ValueError), never another exception.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import xxhash

from ..contract.keys import checked_on_resume
from . import formatspec
from . import retention as rt
from .formatspec import TENSOR_KEY as TENSOR_KEY
from .formatspec import integer as _int
from .piecetable import SHARDED
from .piecetable import tensor_table_problem as tensor_table_problem
from .replicated_spec import REPLICATED
from .storage import Store, split, store_for
from .storage.base import CHECKSUM as FILE_CHECKSUM
from .storage.base import MANIFEST as MANIFEST
from .storage.base import SET_ASIDE_PREFIX as SET_ASIDE_PREFIX
from .storage.base import STEP_DIR as STEP_DIR
from .storage.base import TMP_PREFIX as TMP_PREFIX
from .storage.base import TRASH_PREFIX as TRASH_PREFIX
from .storage.base import StoreError, step_of
from .storage.base import set_aside_name as set_aside_name
from .storage.base import step_dir_name as step_dir_name

# the built-in formats' numbers (and the tensor table's check, above) under the names earlier code knew
# them by; each format owns its number and its fields (formatspec.py), and validate names none
FORMAT, SHARDED_FORMAT = REPLICATED.number, SHARDED.number
MAX_FILES = 1 << 16  # a sharded checkpoint has a file per rank
MAX_FILE_BYTES = 1 << 50
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}\.bin")
CHECKSUM = re.compile(re.escape(FILE_CHECKSUM) + r":[0-9a-f]{32}")
META_COUNTS = ("epoch", "batch_in_epoch", "global_step", "sample_in_epoch")  # non-negative ints when present
MAX_COMMIT = 2**53  # one save a millisecond for 285,000 years; an exact integer in any JSON reader
MAX_STEP = 10**18 - 1  # what a folder name holds (18 digits); the loop's own counts stop far below (state.MAX_COUNT)
DIGEST = "digest"  # the manifest's own checksum, on its first line (seal)
PARAMS = "params"  # optimizer name -> its param groups' parameters, by name (optimizers.manifest_fields)
MAX_PARAMS = 1 << 20  # parameter names in all, over every optimizer and group
# the monitored metric at the save: {"name", "value": the value given to run.log since the save
# before (null: none, or not a finite number), "step": the step it was logged at (null with it)}
METRIC = "metric"
METRIC_NAME = re.compile(r"[^\x00-\x1f]{1,200}")
RESERVED = frozenset(
    {"format", "step", "commit", "world_size", "created", "files", "config", "full_config", DIGEST, PARAMS, "tensors"}
)
_SEALED = re.compile(rb'\{\n "' + DIGEST.encode() + rb'": "(' + CHECKSUM.pattern.encode() + rb')",\n')


class ManifestError(ValueError):
    """A manifest that cannot be used: missing, unreadable, not JSON, or not what a manifest holds."""


@dataclass(frozen=True)
class Listed:
    """A committed checkpoint folder as listed: its manifest, or why it cannot be read."""

    step: int
    path: str  # where it is (its store's location of it): what messages and records name
    manifest: Optional[Dict[str, Any]]
    error: Optional[str] = None

    @property
    def name(self) -> str:
        """Its name in its store (`step_000000100`)."""
        return self.path.rstrip("/").rpartition("/")[2]

    @property
    def commit(self) -> int:
        return self.manifest["commit"] if self.manifest is not None else 0

    @property
    def sealed(self) -> bool:
        """Whether the manifest carries its own digest (one written by an earlier version does not)."""
        return self.manifest is not None and DIGEST in self.manifest


def _digest(body: bytes) -> str:
    return f"{FILE_CHECKSUM}:{xxhash.xxh3_128(body).hexdigest()}"


def seal(manifest: Dict[str, Any], encoded: str = "") -> bytes:
    """The bytes of manifest.json for these fields (a `digest` among them is replaced): JSON whose
    first line holds the digest of every byte after it. `encoded`: more fields, after these, as
    _sealer.encode_fields gave them (encoded once for many manifests)."""
    return sealed_text(json.dumps({k: v for k, v in manifest.items() if k != DIGEST}, indent=1, default=str), encoded)


def sealed_text(text: str, encoded: str) -> bytes:
    """seal's bytes from json.dumps(fields, indent=1) and the fields `encoded` after them."""
    if not text.startswith("{\n"):
        raise ValueError("a manifest holds at least one field")
    body = f"{text[2:-2]}{encoded}\n}}\n".encode()  # text ends with "\n}"
    return f'{{\n "{DIGEST}": "{_digest(body)}",\n'.encode() + body


def parse(raw: bytes, where: Any) -> Any:
    """The JSON value of manifest.json's bytes, its digest checked first (see the module's docstring);
    not yet validated. Raises ManifestError, nothing else."""
    sealed = _SEALED.match(raw)
    if sealed is not None and _digest(raw[sealed.end() :]) != sealed.group(1).decode():
        raise ManifestError(f"{where}: its digest does not match its contents (the manifest is damaged)")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError is a ValueError
        raise ManifestError(f"{where}: unreadable manifest ({type(exc).__name__}: {str(exc)[:200]})") from None
    if sealed is None and isinstance(value, dict):
        if DIGEST in value or any(isinstance(v, str) and CHECKSUM.fullmatch(v) for v in value.values()):
            raise ManifestError(f"{where}: its digest is not on its first line, or its name is damaged (the manifest is damaged)")
    return value


def validate(data: Any, where: Any, step: Optional[int] = None) -> Dict[str, Any]:
    """`data` if it is a valid manifest (of the folder for `step`, when given); else ManifestError."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"{where}: {what}")

    if not isinstance(data, dict):
        raise bad(f"not a JSON object (a {type(data).__name__})")
    form = formatspec.spec_of(data.get("format"))
    if form is None:
        raise bad(
            f"format {str(data.get('format'))[:20]!r}; this version reads formats {', '.join(map(str, formatspec.numbers()))}"
        )
    if not _int(data.get("step"), 0, MAX_STEP):
        raise bad(f"'step' must be an integer from 0 to {MAX_STEP}")
    if step is not None and data["step"] != step:
        raise bad(f"says step {data['step']}, but its folder is {step_dir_name(step)}")
    if not _int(data.get("commit"), 1, MAX_COMMIT):
        raise bad(f"'commit' must be an integer from 1 to {MAX_COMMIT}")
    if not _int(data.get("world_size"), 1, 2**31):
        raise bad("'world_size' must be a positive integer")
    for key in META_COUNTS:
        if key in data and not _int(data[key], 0, 2**62):
            raise bad(f"'{key}' must be a non-negative integer")
    if (
        not isinstance(data.get("created"), (int, float))
        or isinstance(data.get("created"), bool)
        or not math.isfinite(data["created"])
    ):
        raise bad("'created' must be a number")
    for key in ("config", "full_config"):
        if not isinstance(data.get(key), dict):
            raise bad(f"'{key}' must be a JSON object")
    files = data.get("files")
    if not isinstance(files, dict) or not 1 <= len(files) <= MAX_FILES:
        raise bad(f"'files' must map 1 to {MAX_FILES} file names to their size and checksum")
    for name, spec in files.items():
        if not FILE_NAME.fullmatch(name):
            raise bad(f"file name {name[:100]!r} is not a plain name like model.bin")
        if not isinstance(spec, dict) or not _int(spec.get("bytes"), 0, MAX_FILE_BYTES):
            raise bad(f"{name}: 'bytes' must be an integer from 0 to {MAX_FILE_BYTES}")
        if not isinstance(spec.get("checksum"), str) or not CHECKSUM.fullmatch(spec["checksum"]):
            raise bad(f"{name}: 'checksum' must be {FILE_CHECKSUM}:<32 hex digits> (it is required)")
    if DIGEST in data and not (isinstance(data[DIGEST], str) and CHECKSUM.fullmatch(data[DIGEST])):
        raise bad(f"'{DIGEST}' must be {FILE_CHECKSUM}:<32 hex digits>")
    if PARAMS in data and not _param_names_ok(data[PARAMS]):
        raise bad(f"'{PARAMS}' must map optimizer names to lists of param groups, each a list of parameter names or nulls")
    if METRIC in data:
        problem = _metric_problem(data[METRIC], data["step"])
        if problem:
            raise bad(f"'{METRIC}': {problem}")
    try:
        problem = form.fields(data)
    except Exception as exc:  # a format's own check that raises: the manifest is unusable all the same
        problem = f"format {form.number} ({form.name}): its fields cannot be checked ({type(exc).__name__}: {str(exc)[:200]})"
    if problem:
        raise bad(problem)
    return data


def finite(value: Any) -> Optional[float]:
    """`value` as a float if it is a finite real number (not a bool); else None. Never raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


def metric_field(name: str, value: Any, step: Optional[int]) -> Dict[str, Any]:
    """The manifest's `metric`: `name`'s `value`, logged at `step` (a value that is not a finite number, or none: null)."""
    number = finite(value)
    return {"name": name, "value": number, "step": step if number is not None else None}


def _metric_problem(field: Any, step: int) -> Optional[str]:
    if not isinstance(field, dict) or set(field) != {"name", "value", "step"}:
        return "must be an object of exactly name, value and step"
    if not isinstance(field["name"], str) or not METRIC_NAME.fullmatch(field["name"]):
        return "'name' must be a metric's name (1 to 200 characters)"
    if field["value"] is None and field["step"] is None:
        return None
    if finite(field["value"]) is None or not _int(field["step"], 0, step):
        return f"'value' must be a finite number and 'step' the step it was logged at (0 to {step}), or both null"
    return None


def _param_names_ok(params: Any) -> bool:
    if not isinstance(params, dict):
        return False
    groups = [g for v in params.values() if isinstance(v, list) for g in v]
    return (
        all(isinstance(v, list) for v in params.values())
        and all(isinstance(g, list) for g in groups)
        and sum(len(g) for g in groups) <= MAX_PARAMS
        and all(n is None or (isinstance(n, str) and TENSOR_KEY.fullmatch(n)) for g in groups for n in g)
    )


def _as_store(where: Union[str, Path, Store]) -> Store:
    return where if isinstance(where, Store) else store_for(where)


def read_in(store: Store, name: str) -> Dict[str, Any]:
    """The validated manifest of checkpoint `name` in `store`. Raises ManifestError (it is unusable),
    or StoreError (the store cannot be reached now: nothing is known against it), nothing else."""
    where = f"{store.where(name)}/{MANIFEST}"
    try:
        data = store.read_manifest(name)
    except StoreError:
        raise
    except (OSError, ValueError, MemoryError) as exc:  # FileCheckError is a ValueError
        raise ManifestError(f"{where}: unreadable manifest ({type(exc).__name__}: {str(exc)[:200]})") from None
    return validate(parse(data, where), where, step_of(name))


def read(ckpt: Union[str, Path]) -> Dict[str, Any]:
    """The validated manifest of the checkpoint at `ckpt` (its folder, or its location in a store).
    Raises ManifestError, nothing else."""
    try:
        store, name = split(ckpt)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    return read_in(store, name)


def scan(where: Union[str, Path, Store]) -> List[Listed]:
    """Every committed checkpoint in the store at `where` (a folder, a location, a Store): readable
    ones newest first by commit sequence (then step), then those whose manifest cannot be used, by
    step. A missing folder is empty; a location no store has is a ValueError, a store that cannot be
    reached now a StoreError (never an empty list: a resume must not start afresh beside checkpoints
    it could not see)."""
    store = _as_store(where)
    readable, unreadable = [], []
    for name in store.names():
        step = step_of(name)
        if step is None:
            continue
        try:
            readable.append(Listed(step, store.where(name), read_in(store, name)))
        except ManifestError as exc:
            unreadable.append(Listed(step, store.where(name), None, str(exc)))
    readable.sort(key=lambda c: (c.commit, c.step, c.name), reverse=True)
    unreadable.sort(key=lambda c: (c.step, c.name), reverse=True)
    return readable + unreadable


def committed(where: Union[str, Path, Store]) -> List[Tuple[int, str]]:
    """(step, location) of every committed checkpoint, newest first (see scan)."""
    return [(c.step, c.path) for c in scan(where)]


def newest_manifest(where: Union[str, Path, Store]) -> Optional[Dict[str, Any]]:
    """The manifest of the newest committed checkpoint whose manifest is valid; None if there is none."""
    for c in scan(where):
        if c.manifest is not None:
            return c.manifest
    return None


def recorded(c: Listed) -> rt.Saved:
    """What retention knows of a listed checkpoint whose manifest is valid."""
    m = c.manifest or {}
    metric = m.get(METRIC) or {}
    return rt.Saved(c.step, c.commit, m.get("epoch", 0), m.get("batch_in_epoch", 0), metric.get("name"), metric.get("value"))


def expendable(listed: List[Listed], policy: rt.Policy, keep: Iterable[str]) -> List[str]:
    """The committed checkpoints of `listed` (scan's order) whose manifest is valid and that
    retention.kept does not keep, nor `keep`. By step, the folder's name: a commit raised by a
    flipped bit (in a manifest without a digest) cannot make the newest work go; a manifest that
    cannot be read is never removed here."""
    usable, asked = [c for c in listed if c.manifest is not None], set(keep)
    pinned = {c.step for c in usable if c.path in asked}
    kept = rt.kept([recorded(c) for c in usable], policy, pinned)
    return [c.path for c in usable if c.step not in kept]


def best(listed: List[Listed], policy: rt.Policy) -> Optional[Tuple[Listed, float]]:
    """The best checkpoint of `listed` by `policy.monitor`, and its value (None: none has a value)."""
    usable = [c for c in listed if c.manifest is not None]
    top = rt.ranked([recorded(c) for c in usable], policy)[:1]
    for c in usable:
        if top and c.step == top[0].step and c.commit == top[0].commit:
            return c, float(top[0].value or 0.0)
    return None


def next_commit(where: Union[str, Path, Store]) -> int:
    """One above the highest commit in the store, never above MAX_COMMIT (see the module's docstring)."""
    return commit_after(c.commit for c in scan(where))


def commit_after(commits: Iterable[int]) -> int:
    """The commit number a save takes after these: one above the highest, never above MAX_COMMIT."""
    return min(1 + max(commits, default=0), MAX_COMMIT)


def flatten(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def training_config(config: Dict[str, Any], safe_to_change: Iterable[str] = ()) -> Dict[str, Any]:
    """The keys of a resolved job config that must match on resume (flattened, dotted): see contract.keys."""
    safe = list(safe_to_change)
    return {k: v for k, v in flatten(config) if checked_on_resume(k, safe)}


def changes(old: Dict[str, Any], new: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, checkpoint's value, current value) for every key that differs; '<absent>' when missing."""
    absent = "<absent>"
    return [
        (k, old.get(k, absent), new.get(k, absent))
        for k in sorted(set(old) | set(new))
        if old.get(k, absent) != new.get(k, absent)
    ]


def describe_changes(diff: List[Tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)
