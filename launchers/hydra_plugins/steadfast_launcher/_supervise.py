"""The launcher's watch over one launch: stop requests (preemption) and the hang watchdog.

A thread in the launcher process reads the workers' heartbeat files (steadfast.contract.heartbeat) of this
launch on this host, a few times a second:

- Stop requests. While a launch runs, SIGTERM/SIGINT/SIGHUP to the launcher only set the stop
  flag (stop_requested() in this process; neither torch elastic's agent nor Horovod's
  runner installs its own handlers for them, see the adapters). Every registered worker then
  gets the same signal, including workers that register later (a group being restarted); they
  save at their next step boundary and return normally, so the backend sees a clean end. After
  `restart.preemption_grace_s` the backend is told to stop what still runs (the adapter's
  `on_grace_expired`), and a few seconds later anything left is killed. Workers register right
  after installing their stop handlers, so a forwarded signal never kills a worker that cannot
  handle it.
- Hangs. A rank whose progress counter has not moved for `restart.hang_timeout_s` (measured on
  this launcher's clock, never by comparing clocks of hosts) is stuck. Its peers soon stop
  moving too, waiting for it in a collective. Every stuck worker is asked for its Python stacks
  (SIGUSR1 -> faulthandler, appended to logs/stacks/rank<r>.txt); a rank whose main thread is
  not inside a collective is the suspect. The stuck workers are killed: torch elastic's agent
  then restarts the group, and Horovod's runner fails, so the launcher relaunches it; both count
  against `restart.max_restarts`.
- Attempts. When every worker of one incarnation of the group is gone, an `attempt_ended`
  event records the last step each rank reached (the report uses it to count lost work).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from steadfast.contract import events, summary
from steadfast.contract.events import Event
from steadfast.contract.env import ENV_ATTEMPT, ENV_LAUNCH_ID, ENV_LAUNCH_TIME
from steadfast.contract.exits import EXIT_PREEMPTED
from steadfast.contract.files import STACKS_DIR
from steadfast.contract.heartbeat import DONE_PHASE, STACK_SIGNAL, read_heartbeats
from steadfast.contract.summary import Status
from steadfast.contract.stop import PREEMPTED, STOP_SIGNALS, Stopped, request_stop, restore_handlers, signal_name, stop_requested, stop_requested_at
from steadfast.contract.schemas import RestartConf

log = logging.getLogger(__name__)

HOST = socket.gethostname()
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')
# A main thread whose innermost Python frame is in one of these waits for its peers.
_COLLECTIVE = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/", "/horovod/")
STARTUP_PHASES = ("start", "init", "restore")  # before a worker's first step: restart.startup_timeout_s
OVERDUE_S = 10.0  # after the grace and the backend's own stop, how long before the launcher abandons the launch


@dataclass
class _Worker:
    rank: int
    pid: int
    restart: int
    last_change: float
    progress: Tuple[Any, ...] = ()
    step: int = -1
    phase: str = "start"
    alive: bool = True
    handled: bool = False  # killed by the watchdog or after the grace


@dataclass
class _Incarnation:
    restart: int
    pids: List[int] = field(default_factory=list)
    recorded: bool = False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def main_thread_frames(dump: str) -> List[Tuple[str, int, str]]:
    """The frames (innermost first) of the main thread in one faulthandler dump."""
    blocks: List[List[Tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if "(most recent call first)" in line:
            blocks.append([])
        elif blocks:
            m = _FRAME.match(line)
            if m:
                blocks[-1].append((m.group(1), int(m.group(2)), m.group(3)))
    for frames in reversed(blocks):  # the main thread started first: usually listed last
        if frames and not (frames[-1][0].endswith("threading.py") and frames[-1][2].startswith("_bootstrap")):
            return frames
    return blocks[-1] if blocks else []


def waits_in_collective(frames: List[Tuple[str, int, str]]) -> bool:
    return bool(frames) and any(part in frames[0][0] for part in _COLLECTIVE)


def describe_frame(frame: Optional[Tuple[str, int, str]]) -> str:
    return f"{frame[0]}:{frame[1]} in {frame[2]}" if frame else "unknown (no stack was written)"


class Supervisor:
    def __init__(self, run_dir: Path, restart: RestartConf, launch_id: str,
                 on_grace_expired: Optional[Callable[[], bool]] = None, on_overdue: Optional[Callable[[], None]] = None,
                 forwarded: Optional[set] = None) -> None:
        self.run_dir, self.conf, self.launch_id = run_dir, restart, launch_id
        self.forwarded = forwarded if forwarded is not None else set()  # pids that got the stop signal (once each)
        self.on_grace_expired, self.on_overdue = on_grace_expired, on_overdue
        self._overdue = False
        self.hang_timeout = restart.hang_timeout_s
        self.poll = min(1.0, max(0.1, self.hang_timeout / 20)) if self.hang_timeout else 0.25
        # declared hung when the counter has been still for this long: detection, which also
        # waits for the next poll, then stays within the timeout
        self.threshold = max(self.hang_timeout - self.poll, self.hang_timeout / 2) if self.hang_timeout else None
        startup = restart.startup_timeout_s or self.hang_timeout
        self.startup_threshold = max(startup - self.poll, startup / 2) if self.threshold and startup else None
        self.workers: Dict[int, _Worker] = {}
        self.incarnations: Dict[int, _Incarnation] = {}
        self.first_hang: Optional[str] = None  # the message of this launch's first hang
        self.last_hang: Optional[str] = None
        self.grace_expired = False
        self._backend_stops = False
        self._forward_logged = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="steadfast-supervisor", daemon=True)

    def __enter__(self) -> "Supervisor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        with self._lock:
            self._tick()
            for inc in self.incarnations.values():
                self._record_ended(inc)

    def _loop(self) -> None:
        while not self._closed.wait(self.poll):
            try:
                with self._lock:
                    self._tick()
            except Exception:  # supervision must never die silently
                log.exception("launcher supervisor: unexpected error (supervision continues)")

    # ---- one look at the workers --------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        for rank, beat in read_heartbeats(self.run_dir).items():
            if beat.get("launch") != self.launch_id or beat.get("host") != HOST:
                continue  # an earlier launch's file, or a rank on another node (its launcher watches it)
            pid = int(beat["pid"])
            w = self.workers.get(pid)
            if w is None:
                if not _alive(pid):
                    continue  # gone before we saw it (an earlier attempt of this launch): not ours to watch
                w = self.workers[pid] = _Worker(rank=rank, pid=pid, restart=int(beat.get("restart", 0)), last_change=now)
                self.incarnations.setdefault(w.restart, _Incarnation(w.restart)).pids.append(pid)
            progress = (beat.get("beats"), beat.get("phase"))
            if progress != w.progress:
                w.progress, w.last_change = progress, now
                w.step, w.phase = int(beat.get("step", -1)), str(beat.get("phase"))
        for w in self.workers.values():
            if w.alive:
                w.alive = _alive(w.pid)
        for inc in self.incarnations.values():
            if not inc.recorded and not any(self.workers[p].alive for p in inc.pids):
                self._record_ended(inc)
        live = [w for w in self.workers.values() if w.alive and not w.handled]
        signum = stop_requested()
        if signum is not None:
            self._forward_stop(signum, live)
        elif self.threshold is not None:
            stuck = [w for w in live if w.phase != DONE_PHASE
                     and now - w.last_change >= (self.startup_threshold if w.phase in STARTUP_PHASES else self.threshold)]
            if stuck:
                self._handle_hang(stuck, now)

    def _record_ended(self, inc: _Incarnation) -> None:
        if inc.recorded or not inc.pids:
            return
        inc.recorded = True
        ranks = {self.workers[p].rank: self.workers[p].step for p in inc.pids}
        events.append(self.run_dir, Event.ATTEMPT_ENDED, restart=inc.restart, last_step=max(ranks.values()),
                              steps={str(r): s for r, s in sorted(ranks.items())},
                              phases={str(self.workers[p].rank): self.workers[p].phase for p in inc.pids})

    # ---- preemption -----------------------------------------------------------------------------
    def _forward_stop(self, signum: int, live: List[_Worker]) -> None:
        name = signal_name(signum)
        for w in live:
            if w.pid not in self.forwarded and w.phase not in ("stop", DONE_PHASE):
                self.forwarded.add(w.pid)
                _kill(w.pid, signum)
        if live and not self._forward_logged:
            self._forward_logged = True
            log.warning("%s: asked %d worker(s) to save and stop at their next step boundary (restart.preemption_grace_s=%g)",
                        name, len(live), self.conf.preemption_grace_s)
        waited = time.time() - (stop_requested_at() or time.time())
        if waited >= self.conf.preemption_grace_s and not self.grace_expired and live:
            self.grace_expired = True
            log.error("%s: the workers did not stop within restart.preemption_grace_s=%g; stopping them "
                      "(the newest committed checkpoint is intact)", name, self.conf.preemption_grace_s)
            events.append(self.run_dir, Event.PREEMPTION_GRACE_EXPIRED, signal=name,
                                  grace_s=self.conf.preemption_grace_s,
                                  ranks={str(w.rank): {"step": w.step, "phase": w.phase} for w in live})
            # the backend stops its own workers (so that torch elastic does not take our kill for a
            # failure and restart them); whatever is left a few seconds later is killed here
            self._backend_stops = bool(self.on_grace_expired and self.on_grace_expired())
        if self.grace_expired and (not self._backend_stops or waited >= self.conf.preemption_grace_s + 5):
            for w in live:
                w.handled = True
                _kill(w.pid, signal.SIGKILL)
        if waited >= self.conf.preemption_grace_s + OVERDUE_S and not self._overdue and self.on_overdue is not None:
            # still not back (the backend waits for something that will not come, e.g. a
            # rendezvous): the launcher's own main thread gives up the launch
            self._overdue = True
            log.error("%s: the launch has not ended %g s after the grace; abandoning it", name, OVERDUE_S)
            self.on_overdue()

    # ---- hangs ----------------------------------------------------------------------------------
    def _handle_hang(self, stuck: List[_Worker], now: float) -> None:
        stuck.sort(key=lambda w: w.rank)
        sizes: Dict[int, int] = {}
        for w in stuck:
            path = self._stacks(w.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            header = (f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} watchdog: rank {w.rank} (pid {w.pid}, restart "
                      f"{w.restart}) made no progress for {now - w.last_change:.1f} s; last step {w.step}, phase {w.phase} ====\n")
            with open(path, "a") as f:
                f.write(header)
            sizes[w.rank] = path.stat().st_size
            _kill(w.pid, STACK_SIGNAL)
        dumps = self._wait_for_stacks(stuck, sizes)
        frames = {w.rank: main_thread_frames(dumps.get(w.rank, "")) for w in stuck}
        suspects = [w for w in stuck if not waits_in_collective(frames[w.rank])] or stuck
        first = suspects[0]
        waiting = [w for w in stuck if w not in suspects]
        seconds = now - first.last_change
        message = (f"rank {first.rank} hung: no progress for {seconds:.1f} s at step {first.step} (phase {first.phase}), "
                   f"at {describe_frame(frames[first.rank][0] if frames[first.rank] else None)}")
        if len(suspects) > 1:
            message += f"; also stuck: rank(s) {', '.join(str(w.rank) for w in suspects[1:])}"
        if waiting:
            message += f"; rank(s) {', '.join(str(w.rank) for w in waiting)} waiting for it in a collective"
        stacks = [str(self._stacks(w.rank)) for w in stuck]
        events.append(self.run_dir, Event.HANG_DETECTED, rank=first.rank, step=first.step, phase=first.phase,
            seconds_without_progress=round(seconds, 2), hang_timeout_s=self.hang_timeout, restart=first.restart,
            where=describe_frame(frames[first.rank][0] if frames[first.rank] else None),
            suspects=[w.rank for w in suspects], waiting=[w.rank for w in waiting], stacks=stacks,
        )
        log.error("%s. Stacks: %s. Killing the stuck worker(s) so the group restarts.", message, ", ".join(stacks))
        for w in stuck:
            w.handled = True
            _kill(w.pid, signal.SIGKILL)
        self.first_hang = self.first_hang or message
        self.last_hang = message

    def _stacks(self, rank: int) -> Path:
        return self.run_dir / STACKS_DIR / f"rank{rank}.txt"

    def _wait_for_stacks(self, stuck: List[_Worker], sizes: Dict[int, int], timeout: float = 3.0) -> Dict[int, str]:
        """Wait until every stuck worker's dump has landed (its file stopped growing), up to `timeout`."""
        deadline = time.monotonic() + timeout
        seen: Dict[int, int] = {}
        while time.monotonic() < deadline:
            now_sizes = {w.rank: self._stacks(w.rank).stat().st_size for w in stuck}
            grown = all(now_sizes[r] > sizes[r] for r in now_sizes)
            if grown and now_sizes == seen:
                break
            seen = now_sizes
            time.sleep(0.05)
        out = {}
        for w in stuck:
            with open(self._stacks(w.rank), "rb") as f:
                f.seek(sizes[w.rank])
                out[w.rank] = f.read().decode(errors="replace")
        return out


# ---- one launch of the workers, as the launcher's relaunch loop sees it ---------------------------

def run_attempt(adapter: Any, payload: bytes, job: Any, env: Dict[str, str], run_dir: Path) -> Any:
    """`adapter.run` under supervision; turns the ways a launch can end into what _core expects.

    - a result: returned;
    - a `Stopped` marker from the workers (they saved and stopped on purpose): for a
      preemption, `Interrupted` (the sweep stops; exit code EXIT_PREEMPTED after SIGTERM); for any
      other stop (e.g. trainer.max_rss_mb), `JobFailed` (not restarted: it would happen again);
    - a stop request that ended the launch otherwise (grace expired, a worker killed by it before
      it could save): `Interrupted` as well; the newest committed checkpoint is intact;
    - a worker failure: `WorkerFailure`, named after the watchdog's finding if it killed a hung rank.

    For the launch's duration SIGTERM/SIGINT/SIGHUP in the launcher set the stop flag and are
    passed on to the registered workers, which stop cleanly (see _LauncherSignals, Supervisor).
    """
    from ._core import Interrupted, JobFailed, WorkerFailure

    env.setdefault(ENV_LAUNCH_ID, f"{os.getpid()}-{env.get(ENV_LAUNCH_TIME, time.time())}")
    if env.get(ENV_ATTEMPT, "0") == "0":
        log.info("Logs: %s (launcher), %s (one per rank)%s", _launcher_log(run_dir), run_dir / "logs" / "rank<r>.log",
                 f", {run_dir / 'logs' / 'horovod'} (Horovod's per-rank output)" if job.backend.name == "horovod" else "")
    handler = _LauncherSignals(run_dir, env[ENV_LAUNCH_ID], in_process=job.backend.name == "local",
                               interrupted=Interrupted)
    previous = handler.install()
    launched = time.time()
    result: Any = None
    try:
        if stop_requested() is not None:
            raise KeyboardInterrupt("stop requested before the workers started")
        supervisor = (Supervisor(run_dir, job.restart, env[ENV_LAUNCH_ID], getattr(adapter, "on_grace_expired", None),
                                 on_overdue=handler.interrupt_main, forwarded=handler.forwarded)
                      if job.backend.name != "local" else contextlib.nullcontext())
        with supervisor as sup:
            try:
                result = adapter.run(payload, job, env, run_dir)
            except WorkerFailure as failure:
                if stop_requested() is None:
                    if sup is not None and sup.last_hang:  # the watchdog knows more than "killed by SIGKILL"
                        failure.args = (f"{sup.last_hang} (killed by the watchdog after restart.hang_timeout_s="
                                        f"{job.restart.hang_timeout_s:g})",)
                    raise
                log.warning("%s", failure.args[0])
            except KeyboardInterrupt as stop:
                request_stop(getattr(stop, "signum", None) or signal.SIGINT)
            else:
                if not isinstance(result, Stopped):
                    return result
                if result.reason != PREEMPTED:
                    status = Status(result.reason) if result.reason in {s.value for s in Status} else Status.FAILED
                    summary.write(run_dir, status, since=_launch_time(env), restarts=int(env.get(ENV_ATTEMPT, "0")),
                                  wall_seconds=time.time() - _launch_time(env), error=result.message, stop_step=result.step)
                    events.append(run_dir, Event.JOB_STOPPED, reason=result.reason, step=result.step, message=result.message)
                    raise JobFailed(f"{job.label} stopped: {result.message}\nRun folder: {run_dir}")
        signum = stop_requested() or getattr(result, "signal", None) or signal.SIGTERM
        message = _preempted(run_dir, job, launched, signum, env)
        log.warning("%s", message)
        raise Interrupted(message, signum=signum)
    finally:
        restore_handlers(previous)


class _LauncherSignals:
    """SIGTERM/SIGINT/SIGHUP in the launcher during a launch. A stop request is passed on to the
    workers (the supervisor forwards it) and the launcher waits for them to save and stop. The
    launch is abandoned at once instead (an exception in the main thread, as torch elastic's own
    handler would do) when there is nothing to wait for: no worker of this launch has registered
    yet (the agent may be waiting in a rendezvous), on a second signal, or when the supervisor
    finds the launch overdue. The in-process backend (`local`) is never abandoned on the first
    signal: its worker is this thread, and it stops at its next step boundary."""

    def __init__(self, run_dir: Path, launch_id: str, in_process: bool, interrupted: Any) -> None:
        self.run_dir, self.launch_id, self.in_process, self.interrupted = run_dir, launch_id, in_process, interrupted
        self.count, self.force = 0, False
        self.forwarded: set = set()  # shared with the supervisor: every worker gets the signal once

    def install(self) -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in STOP_SIGNALS}

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        request_stop(signum)
        if self.force or self.count > 1:
            raise self.interrupted(f"stopped by {signal_name(signum)}", signum=signum)
        if self.in_process:
            return
        workers = self._registered()
        if not workers:
            raise self.interrupted(f"stopped by {signal_name(signum)}", signum=signum)
        for pid in workers:  # at once; the supervisor passes it on to workers that register later
            self.forwarded.add(pid)
            _kill(pid, signum)

    def _registered(self) -> List[int]:
        return [int(b["pid"]) for b in read_heartbeats(self.run_dir).values()
                if b.get("launch") == self.launch_id and b.get("host") == HOST and _alive(int(b.get("pid", 0)))]

    def interrupt_main(self) -> None:
        import _thread

        self.force = True
        _thread.interrupt_main(stop_requested() or signal.SIGTERM)


def _launch_time(env: Dict[str, str]) -> float:
    try:
        return float(env.get(ENV_LAUNCH_TIME) or time.time())
    except ValueError:
        return time.time()


def _preempted(run_dir: Path, job: Any, since: float, signum: int, env: Dict[str, str]) -> str:
    """Summary and message of a stop on request: where the workers stopped, and whether it is committed."""
    stop = events.last(events.read(run_dir, since=since, kinds=(Event.PREEMPTED,)), Event.PREEMPTED)
    name = str(stop.get("signal")) if stop and stop.get("signal") else signal_name(signum)
    if stop and stop.get("saved"):
        how = f"stopped at step {stop.get('step')}, checkpoint committed: no step lost"
    else:
        how = ("stopped before the workers could save (restart.preemption_grace_s="
               f"{job.restart.preemption_grace_s:g}); they resume from the newest committed checkpoint")
    summary.write(run_dir, Status.PREEMPTED, since=since, restarts=int(env.get(ENV_ATTEMPT, "0")),
                  wall_seconds=time.time() - _launch_time(env), stop_signal=name)
    return (f"{job.label} preempted by {name}: {how}. Run the same command again to continue "
            f"(exit code {EXIT_PREEMPTED} after SIGTERM).")


def _launcher_log(run_dir: Path) -> str:
    """Hydra's job log file (the launcher's messages for this job), or logs/launcher.log if Hydra writes none."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    path = run_dir / "logs" / "launcher.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return str(path)
