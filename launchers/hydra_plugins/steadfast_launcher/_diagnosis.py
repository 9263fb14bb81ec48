"""Which failure of a worker group came first, and which were its consequences.

When one rank dies, its peers fail soon after: their next collective finds the connection reset or
closed, or times out; the backend then stops whatever still runs. Which rank the backend reports
first is an accident of polling order, so the launcher decides it from what it knows of each rank
of the incarnation (`RankEnd`): how the process ended (a signal or an exit code, when the backend
tells), the exception the worker recorded (`worker_failed`), whether the watchdog killed it as the
hung rank, and when it ended.

The rule (`diagnose`): a rank is a *consequence* when the backend or the launcher stopped it after
another rank failed, or when its error says that a peer went away (one of `PEER_LOST_TYPES`, by its type); every other failed
rank is a *cause* candidate. The first candidate in time is the cause. Without candidates (every
rank only saw its peers go): when some timed out waiting, the others were alive and silent, and
the first of those is the cause; else the first failure in time is. A hang the watchdog found is
always the cause: the ranks it killed were stuck, not failed.

It also reads the Python stacks a worker wrote (faulthandler: on the watchdog's request, or as a
fatal signal came): which frame its main thread was in, and whether that is a wait for its peers.

A failure that would come back on every attempt is not restarted (`recurrence`): one whose code said
so (a full disk in a save, a config error a worker found), one every rank raised alike at the same
step, and the same errors at the same step on the same ranks as the attempt before.

A leaf: no torch, no Hydra.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from steadfast.contract.failures import printable

# A rank lost a peer when the exception it recorded is one of the libraries' own types for that
# (torch.distributed's, Gloo's as torch raises them, Horovod's, the OS's connection errors): judged by
# the type name the worker recorded (`worker_failed`'s error starts with it), never by words in the
# message, which is the user's (a worker's own TimeoutError("timed out reading s3://...") is its own
# failure). A bare RuntimeError counts only when its text starts with Gloo's or c10d's source marker
# or one of Gloo's own messages (torch raises Gloo's errors as RuntimeError).
PEER_LOST_TYPES = frozenset(
    {
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "HorovodInternalError",
        "HorovodShutdownError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
    }
)
_LIBRARY_MARK = re.compile(
    r"^RuntimeError: (\[[^\]]*(gloo|c10d)[^\]]*\]|Application timeout caused pair closure|Connection closed by peer)"
)
_TYPE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")


def error_type(error: str) -> Optional[str]:
    """The exception's type name a worker's record starts with ('DistNetworkError: ...')."""
    m = _TYPE.match(error)
    return m.group(1).rsplit(".", 1)[-1] if m else None


def is_peer_lost(error: str) -> bool:
    return error_type(error) in PEER_LOST_TYPES or _LIBRARY_MARK.match(error) is not None


# Signals whose Python stacks faulthandler writes before the process ends.
FATAL_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"})
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)

# A main thread whose innermost Python frame is in one of these waits for its peers (steadfast's
# comm modules wait for Horovod's collectives in Python: Horovod's own wait spins).
_COLLECTIVE = (
    "/torch/distributed/",
    "/torch/autograd/",
    "/torch/nn/parallel/",
    "/horovod/",
    "/steadfast/distributed/comm",
    "/steadfast/distributed/_horovod",
)
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


@dataclass
class RankEnd:
    """How one rank of an incarnation ended, as far as the launcher knows."""

    rank: int
    pid: int
    host: str
    step: int = -1  # the last step its heartbeat showed
    ended_at: Optional[float] = None  # when it ended (its own record's time, or when the launcher saw it gone)
    exit_code: Optional[int] = None  # from the backend: negative is the signal that ended it
    error: Optional[str] = None  # the exception it recorded (worker_failed)
    where: Optional[str] = None
    error_at: Optional[float] = None
    stopped_by_backend: bool = False  # still running when the backend stopped the group (after another's failure)
    hung: bool = False  # the watchdog found it stuck and killed it (suspect=True: not waiting in a collective)
    suspect: bool = False
    hang: Optional[str] = None  # the watchdog's finding, for the suspect
    waiting: bool = False  # the watchdog found it waiting in a collective for the suspect (stuck or not yet)
    unresponsive: bool = False  # alive when its peers timed out waiting for it (set by `diagnose`)
    finished: bool = False  # its task reached its end (its last heartbeat said so)
    recurs: Optional[str] = None  # its error comes back on every attempt, as the code that raised it knew: why

    @property
    def signal_name(self) -> Optional[str]:
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    @property
    def failed(self) -> bool:
        completed = self.finished and self.error is None and self.exit_code in (None, 0) and not self.hung
        return not completed

    @property
    def peer_lost(self) -> bool:
        """Its own record says it failed because a peer went away."""
        return self.error is not None and is_peer_lost(self.error)

    @property
    def time(self) -> float:
        known = [t for t in (self.error_at, self.ended_at) if t is not None]
        return min(known) if known else float("inf")

    def how(self) -> str:
        """How it ended, in a few words: 'killed by SIGKILL', 'raised RuntimeError: ...', 'exited with code 3'."""
        if self.hung and self.suspect and self.hang:
            return f"hung: {self.hang}"
        if self.hung:
            return "stuck, killed by the watchdog"
        if self.error is not None and not self.peer_lost:
            return f"raised {first_line(self.error)}"
        if self.unresponsive:
            return "stopped responding: its peers timed out waiting for it"
        if self.signal_name:
            if self.stopped_by_backend:
                return f"stopped by the backend ({self.signal_name})"
            return f"killed by {self.signal_name}"
        if self.error is not None:
            return f"lost a peer ({first_line(self.error, 160)})"
        if self.stopped_by_backend:
            return "stopped by the backend"
        if self.exit_code not in (None, 0):
            return f"exited with code {self.exit_code}"
        return "ended without an exit status or a recorded error (killed by a signal?)"

    def record(self) -> Dict[str, Any]:
        """Its fields for an event (what is known)."""
        out: Dict[str, Any] = {"rank": self.rank, "host": self.host, "pid": self.pid, "how": self.how()}
        if self.step >= 0:
            out["step"] = self.step
        if self.signal_name:
            out["signal"] = self.signal_name
        elif self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.error is not None:
            out["error"] = first_line(self.error, 500)
        if self.where is not None:
            out["where"] = self.where
        return out


@dataclass
class Diagnosis:
    cause: RankEnd
    consequences: List[RankEnd] = field(default_factory=list)

    def line(self) -> str:
        """'rank 1 (pid 812 on vm) killed by SIGKILL at step 1449; rank 0 failed as a consequence'."""
        c = self.cause
        if c.hung and c.suspect:  # the watchdog's finding says where and how long
            text = f"rank {c.rank} (pid {c.pid} on {c.host}) {c.how()}"
            waiting = [r for r in self.consequences if r.waiting or (r.hung and not r.suspect)]
            if waiting:
                text += f"; rank(s) {', '.join(str(r.rank) for r in waiting)} waiting for it in a collective"
            return printable(text + "; killed by the watchdog")
        at = f" at step {c.step}" if c.step >= 0 else ""
        where = f" (at {c.where})" if c.where and not c.peer_lost else ""
        text = f"rank {c.rank} (pid {c.pid} on {c.host}) {c.how()}{at}{where}"
        if self.consequences:
            ranks = ", ".join(str(r.rank) for r in self.consequences)
            text += f"; rank(s) {ranks} failed as a consequence"
        return printable(text)


def first_line(text: str, limit: int = 300) -> str:
    stripped = text.strip()
    line = printable(stripped.splitlines()[0] if stripped else text)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def diagnose(ends: Sequence[RankEnd]) -> Optional[Diagnosis]:
    """The first failure among `ends` and its consequences (None: no rank failed)."""
    failed = [e for e in ends if e.failed]
    if not failed:
        return None
    hung = [e for e in failed if e.hung and e.suspect]
    candidates = hung or [e for e in failed if not e.peer_lost and not e.stopped_by_backend and not e.hung]
    timed_out = [e for e in failed if e.peer_lost and TIMED_OUT.search(e.error or "")]
    if not candidates and timed_out:
        # every failure was a peer's: those that timed out waited for the others, alive and silent
        # (what those then saw, a connection closed by the rank that gave up, is not their cause)
        candidates = [e for e in failed if e not in timed_out]
        for e in candidates:
            e.unresponsive = True
    pool = candidates or failed
    cause = min(pool, key=lambda e: (e.time, e.rank))
    return Diagnosis(cause, [e for e in sorted(failed, key=lambda e: e.rank) if e is not cause])


# ---- failures a restart cannot cure ---------------------------------------------------------------
def raised(ends: Sequence[RankEnd]) -> List[Dict[str, Any]]:
    """Each rank's own error (not a lost peer): {rank, step, error}, by rank. An attempt_failed records
    it, and the next attempt's failure is compared with it."""
    return [
        {"rank": e.rank, "step": e.step, "error": first_line(e.error, 500)}
        for e in sorted(ends, key=lambda e: e.rank)
        if e.error is not None and not e.peer_lost and not e.hung
    ]


def _at(errors: Sequence[Mapping[str, Any]]) -> str:
    steps = sorted({int(e["step"]) for e in errors})
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


def recurrence(ends: Sequence[RankEnd], before: Optional[Sequence[Mapping[str, Any]]]) -> Optional[str]:
    """Why the failure of an incarnation's `ends` would come back on every attempt (the line said when
    the job is not restarted), or None. `before`: what the failed attempt before it raised (`raised`).

    Only errors the workers recorded count: a signal, a hang or a lost peer may be cured by a restart.
    An error recurs when the code that raised it said so (a full disk in a save, a config error a worker
    found), when every rank raised the same one at the same step (two ranks or more), or when the same
    ranks raised the same errors at the same steps as in the attempt before.
    """
    own = raised(ends)
    if not own or any(e.hung and e.suspect for e in ends):
        return None
    known = [e for e in ends if e.recurs and e.error is not None and not e.peer_lost]
    if known:
        first = min(known, key=lambda e: (e.time, e.rank))
        at = f" at step {first.step}" if first.step >= 0 else ""
        return printable(f"{first.recurs} (rank {first.rank}{at}): it fails the same way on every attempt; not restarted")
    ranks = ", ".join(str(e["rank"]) for e in own)
    if len(ends) >= 2 and len(own) == len(ends) and len({(e["step"], e["error"]) for e in own}) == 1:
        return f"every rank ({ranks}) raised the same error at {_at(own)}: a code or config error; not restarted"
    if before is not None and [dict(b) for b in before] == own:
        return f"the same error at {_at(own)} on rank(s) {ranks} in two attempts in a row: a code or config error; not restarted"
    return None


# ---- the Python stacks a worker wrote (faulthandler) ---------------------------------------------
def _thread_blocks(dump: str) -> List[Tuple[str, List[Tuple[str, int, str]]]]:
    """Each thread's header line and frames (innermost first), in one faulthandler dump."""
    blocks: List[Tuple[str, List[Tuple[str, int, str]]]] = []
    for line in dump.splitlines():
        if "(most recent call first)" in line:
            blocks.append((line, []))
        elif blocks:
            m = _FRAME.match(line)
            if m:
                blocks[-1][1].append((m.group(1), int(m.group(2)), m.group(3)))
    return blocks


def thread_frames(dump: str, ident: int) -> List[Tuple[str, int, str]]:
    """The frames of the thread `ident` (threading.get_ident()) in one dump; else the main thread's."""
    named = f"hread 0x{ident:016x} "  # faulthandler's "Thread 0x..." and "Current thread 0x..."
    return next((frames for header, frames in _thread_blocks(dump) if named in header), None) or main_thread_frames(dump)


def main_thread_frames(dump: str) -> List[Tuple[str, int, str]]:
    """The frames (innermost first) of the main thread in one faulthandler dump."""
    blocks = [frames for _, frames in _thread_blocks(dump)]
    for frames in reversed(blocks):  # the main thread started first: usually listed last
        if frames and not (frames[-1][0].endswith("threading.py") and frames[-1][2].startswith("_bootstrap")):
            return frames
    return blocks[-1] if blocks else []


def waits_in_collective(frames: List[Tuple[str, int, str]]) -> bool:
    return bool(frames) and any(part in frames[0][0] for part in _COLLECTIVE)


def describe_frame(frame: Optional[Tuple[str, int, str]]) -> str:
    return f"{frame[0]}:{frame[1]} in {frame[2]}" if frame else "unknown (no stack was written)"


def crash_site(stacks: Path) -> Optional[str]:
    """Where the crashing thread was, from the stacks faulthandler wrote as a fatal signal came."""
    try:
        with open(stacks, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            dump = f.read().decode(errors="replace")
    except OSError:
        return None
    crash = dump.rsplit("Fatal Python error", 1)
    if len(crash) < 2:
        return None
    current = crash[1].split("Current thread", 1)
    frames = main_thread_frames("Current thread" + current[1] if len(current) > 1 else crash[1])
    return describe_frame(frames[0]) if frames else None
