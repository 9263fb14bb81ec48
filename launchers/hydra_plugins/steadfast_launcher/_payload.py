"""Pickled hand-overs between the launcher and the processes it starts, through private files.

The launcher writes what a process needs (a job's task function, frozen config and Hydra's
state) into a folder only its user can enter (mode 0700, under the system's temporary folder,
never the run folder: nothing in outputs/ is ever unpickled) and passes only a `PayloadRef`:
the path and the sha256 of the bytes. The reader checks the sha256, which came over a channel the
launcher controls (the spawn pipe, horovod.run's arguments, a command line), before it
unpickles anything.

Why a file: multiprocessing's spawn writes a worker's arguments into a pipe while the parent
still holds the pipe's read end, so arguments larger than the pipe buffer (64 KiB) block the
parent until the worker has imported its main module and read them; a worker killed in that
window left torch elastic's agent blocked in that write forever (no restart, no error). A
reference of a few hundred bytes never blocks.

What cloudpickle does not do by itself: code pickled by value (the app's `__main__`) keeps the file
it came from, so a worker's traceback names the user's file and line (cloudpickle writes
"<dynamic-code>"), and a module object that replaced itself in sys.modules with a subclass of
ModuleType (`from torch.backends import cudnn`) travels by name, as plain modules do. An object that
still cannot be pickled is named, with the function that refers to it, before any worker starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import os
import shutil
import stat
import sys
import tempfile
import types
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Set, Tuple

import cloudpickle

from steadfast.contract.files import read_regular
from steadfast.contract.pids import alive


class PayloadError(RuntimeError):
    """A payload file that is missing, changed or not ours: never unpickled."""


@dataclass(frozen=True)
class PayloadRef:
    path: str
    sha256: str
    size: int


def private_folder(prefix: str) -> Path:
    """A new folder only this user can enter (0700), checked after creation. Its name carries this
    process's id, so a later launcher removes it if this one was killed before it could."""
    _remove_orphans(prefix)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        shutil.rmtree(path, ignore_errors=True)
        raise PayloadError(f"temporary folder {path} is not private (mode {oct(stat.S_IMODE(st.st_mode))}, owner {st.st_uid})")
    return path


def _remove_orphans(prefix: str) -> None:
    """This user's folders of `prefix` whose launcher process is gone (killed with SIGKILL)."""
    root = Path(tempfile.gettempdir())
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix) :].partition("-")[0]
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A private folder for the duration of a job (or a sweep), removed afterwards."""
    path = private_folder(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_BY_VALUE_CODE = cloudpickle.Pickler.dispatch_table[types.CodeType]
_NO_FILE = "<dynamic-code>"  # what cloudpickle writes for the file of code it pickles by value


def _code_with_its_file(code: types.CodeType) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    rebuild, args = _BY_VALUE_CODE(code)
    if code.co_filename.startswith("<"):  # typed in, or generated: no file to point at
        return rebuild, args
    where = os.path.abspath(code.co_filename)
    return rebuild, tuple(where if isinstance(a, str) and a == _NO_FILE else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_with_its_file}, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(value: object) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def unpicklable(function: Callable[..., Any]) -> Optional[str]:
    """Why the task function cannot be sent to the workers, naming what it refers to; None if it can."""
    try:
        dumps(function)
        return None
    except Exception as exc:
        found = _culprit(function, set())
        if found is None:
            return (
                f"the task function {_where(function)} cannot be pickled to send it to the workers: {type(exc).__name__}: {exc}"
            )
        name, value, holder, error = found
        return (
            f"the task function cannot be sent to the workers: {_where(holder)} refers to `{name}`, "
            f"a {type(value).__module__}.{type(value).__qualname__}, which cannot be pickled ({error}). "
            f"Create or import `{name}` inside the function that uses it instead of at module level"
        )


def _where(function: Callable[..., Any]) -> str:
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", repr(function))
    return f"{name} ({os.path.relpath(code.co_filename)}:{code.co_firstlineno})" if code is not None else name


def _referred(function: types.FunctionType) -> List[Tuple[str, Any]]:
    """What a function refers to: the globals its code (and the code nested in it) names, its
    closure's cells, its defaults."""
    names: List[str] = []
    todo = [function.__code__]
    while todo:
        code = todo.pop()
        names += code.co_names
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    found = [(n, function.__globals__[n]) for n in dict.fromkeys(names) if n in function.__globals__]
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    found += [(f"default {i}", v) for i, v in enumerate(function.__defaults__ or ())]
    return found + list((function.__kwdefaults__ or {}).items())


def _culprit(function: Any, seen: Set[int]) -> Optional[Tuple[str, Any, Any, str]]:
    """(name, value, the function referring to it, the error) of the first value it refers to that
    cannot be pickled, looking into the functions pickled by value (the app's own) it refers to."""
    function = getattr(function, "__wrapped__", function)
    if not isinstance(function, types.FunctionType) or id(function) in seen:
        return None
    seen.add(id(function))
    for name, value in _referred(function):
        try:
            dumps(value)
            continue
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        deeper = _culprit(value, seen)
        return deeper or (name, value, function, error)
    return None


def write(folder: Path, name: str, value: object) -> PayloadRef:
    data = dumps(value)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return PayloadRef(str(path), hashlib.sha256(data).hexdigest(), len(data))


def load(ref: PayloadRef) -> Any:
    """The value behind `ref`, unpickled only if the file holds exactly the bytes the launcher wrote."""
    data = read_regular(ref.path, ref.size)
    if data is None or len(data) != ref.size:
        raise PayloadError(f"job payload {ref.path}: missing, or not the file the launcher wrote")
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise PayloadError(f"job payload {ref.path}: its sha256 does not match what the launcher wrote; not unpickled")
    return cloudpickle.loads(data)
