"""The launcher's watch over one launch: stop requests (preemption), hangs (_watchdog), attempts and failures.

A thread in the launcher process reads the workers' heartbeat files (steadfast.contract.heartbeat) of this
launch on this host, a few times a second:

- Stop requests. While a launch runs, SIGTERM/SIGINT/SIGHUP to the launcher only set the stop
  flag (stop_requested() in this process; neither torch elastic's agent nor Horovod's
  runner installs its own handlers for them, see _backends). Every registered worker then
  gets the same signal, including workers that register later (a group being restarted); they
  save at their next step boundary and return normally, so the backend sees a clean end. After
  `restart.preemption_grace_s` the backend is told to stop what still runs (its
  `stop_on_grace_expired`), and a few seconds later anything left is killed. Workers register right
  after installing their stop handlers, so a forwarded signal never kills a worker that cannot
  handle it.
- Hangs. The watchdog (_watchdog) finds the ranks whose progress has stopped, names the suspect
  from their stacks and kills them: torch elastic's agent then restarts the group, and Horovod's
  runner fails, so the launcher relaunches it; both count against `restart.max_restarts`.
- Attempts. When every worker of one incarnation of the group is gone, an `attempt_ended`
  event records the last step each rank reached (the report uses it to count lost work).
- Failures. When an incarnation fails, the supervisor decides which rank failed first and which
  failed because of it (`_diagnosis`), from the exit statuses the backend hands it (`worker_exits`,
  torch elastic's agent: every worker's, not only the one it happened to find first), the workers'
  own `worker_failed` records, the watchdog's findings and when it saw each worker end. The finding
  is one `attempt_failed` event and one line on the console and in train.log; the launcher's final
  message and summary.json lead with it. A backend that hands over no exit statuses (Horovod) gets
  its diagnosis from the rest, a moment after its workers are gone.
- Failures that recur. A failure that would come back on every attempt (`_diagnosis.recurrence`:
  compared with the launch's previous `attempt_failed`, whichever attempt or incarnation wrote it) is
  not restarted: the supervisor says why, and a backend that restarts the group itself is told to
  stop it (`on_recurring`, from the supervisor's thread); the relaunch loop reads `recurring`.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from steadfast.contract import events
from steadfast.contract.events import Event
from steadfast.contract.heartbeat import DONE_PHASE, read_heartbeats, stop_marker
from steadfast.contract.pids import alive, kill
from steadfast.contract.schemas import RestartConf
from steadfast.contract.stop import signal_name, stop_requested, stop_requested_at

from ._diagnosis import FATAL_SIGNALS, Diagnosis, RankEnd, crash_site, diagnose, raised, recurrence
from ._logfiles import DETAILS, files_only
from ._types import WorkerExit
from ._watchdog import Watchdog, stacks_file

log = logging.getLogger(__name__)
details = logging.getLogger(DETAILS)  # train.log only

HOST = socket.gethostname()
OVERDUE_S = 10.0  # after the grace and the backend's own stop, how long before the launcher abandons the launch
# How often the workers' heartbeats are read (about 0.2 ms a look). A restarted group (workers forked
# from the preloaded forkserver) can live a fraction of a second: every incarnation must be seen to
# record what it reached (attempt_ended).
POLL_S = 0.1
# Without exit statuses from the backend, how long after an incarnation's last worker is gone the
# supervisor waits (for the backend's report) before it diagnoses the failure from what it has.
EXITS_WAIT_S = 1.0
# The same for a backend that does not restart the group itself (Horovod's runner): it reports when it
# returns, after reaping every worker (Horovod terminates the others with a 5 s grace), and the
# attempt's end diagnoses at once (settle); this bounds the wait only if the runner does not return.
RUNNER_EXITS_WAIT_S = 10.0


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
    gone_at: Optional[float] = None  # wall clock, when the supervisor saw it gone
    exit: Optional[WorkerExit] = None  # how it ended, if the backend said
    hang: Optional[str] = None  # the watchdog found it stuck: what it found (suspects) or "" (waiting in a collective)
    waits: bool = False  # the watchdog found it waiting in a collective for a hung rank


@dataclass
class _Incarnation:
    restart: int
    pids: List[int] = field(default_factory=list)
    recorded: bool = False
    ended_at: Optional[float] = None  # monotonic, when its last worker was seen gone
    diagnosed: bool = False


def mark_stop(run_dir: Path, launch_id: str) -> None:
    """Tell this launch's workers that the stop signals they get now are the launcher's stop request
    (written before the first one is sent; see the workers' start-up guard in _worker)."""
    try:
        stop_marker(run_dir, launch_id).touch()
    except OSError:
        pass


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        restart: RestartConf,
        launch_id: str,
        on_grace_expired: Optional[Callable[[], bool]] = None,
        on_overdue: Optional[Callable[[], None]] = None,
        forwarded: Optional[Set[int]] = None,
        group_restarts: bool = False,
        on_recurring: Optional[Callable[[], bool]] = None,
        launched: Optional[float] = None,
        whole_job: bool = True,
    ) -> None:
        self.run_dir, self.conf, self.launch_id = run_dir, restart, launch_id
        self.group_restarts = group_restarts  # the backend restarts the group itself (torch elastic)
        self.exits_wait_s = EXITS_WAIT_S if group_restarts else RUNNER_EXITS_WAIT_S
        self.started = time.time()
        self.launched = launched if launched is not None else self.started  # the job's launch (all its attempts)
        # a failure that would come back on every attempt: (its incarnation, why it is not restarted, its line)
        self.recurring: Optional[Tuple[int, str, str]] = None
        self.on_recurring, self._told_recurring, self._stopping_group = on_recurring, False, False
        # the backend's thread is handing over exit statuses: a recurrence found then is stopped by that
        # thread as it returns (its signal must not land inside the backend's own call)
        self._in_exits = self._found_in_exits = False
        # one launcher of a multi-node job sees its own ranks only: the others' launchers might decide
        # otherwise and wait for it, so it never judges a failure recurring
        self.whole_job = whole_job
        self.diagnoses: List[Diagnosis] = []
        self.forwarded = forwarded if forwarded is not None else set()  # pids that got the stop signal (once each)
        self.on_grace_expired, self.on_overdue = on_grace_expired, on_overdue
        self._overdue = False
        self.poll = POLL_S
        self.watchdog = Watchdog(run_dir, restart.hang_timeout_s, restart.startup_timeout_s, self.poll)
        self.workers: Dict[int, _Worker] = {}
        self.incarnations: Dict[int, _Incarnation] = {}
        self.first_hang: Optional[str] = None  # the message of this launch's first hang
        self.grace_expired = False
        self._backend_stops = False
        self._forward_logged = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="steadfast-supervisor", daemon=True)

    def __enter__(self) -> "Supervisor":
        files_only(DETAILS)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        with self._lock:
            self._tick()
            for inc in self.incarnations.values():
                self._record_ended(inc)
                self._diagnose(inc)

    def _loop(self) -> None:
        while not self._closed.wait(self.poll):
            try:
                with self._lock:
                    self._tick()
                if self._take_stop(in_exits=False) and self.on_recurring is not None:
                    # diagnosed without the backend's exit statuses: have it stop the group from here
                    self._stopping_group = self.on_recurring()
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
                if not alive(pid):
                    continue  # gone before we saw it (an earlier attempt of this launch): not ours to watch
                w = self.workers[pid] = _Worker(rank=rank, pid=pid, restart=int(beat.get("restart", 0)), last_change=now)
                self.incarnations.setdefault(w.restart, _Incarnation(w.restart)).pids.append(pid)
            progress = (beat.get("beats"), beat.get("phase"))
            if progress != w.progress:
                w.progress, w.last_change = progress, now
                w.step, w.phase = int(beat.get("step", -1)), str(beat.get("phase"))
        for w in self.workers.values():
            if w.alive:
                w.alive = alive(w.pid)
                if not w.alive:
                    w.gone_at = time.time()
        for inc in self.incarnations.values():
            if not inc.recorded and not any(self.workers[p].alive for p in inc.pids):
                inc.ended_at = now
                self._record_ended(inc)
            if not inc.diagnosed and inc.ended_at is not None and now - inc.ended_at >= self.exits_wait_s:
                self._diagnose(inc)
        live = [w for w in self.workers.values() if w.alive and not w.handled]
        signum = stop_requested()
        if signum is not None:
            self._forward_stop(signum, live)
        else:
            stuck = self.watchdog.stuck(live, now)
            if stuck:
                peers = [w for w in live if w.restart == stuck[0].restart]
                message = self.watchdog.handle(stuck, now, peers)
                self.first_hang = self.first_hang or message

    def _record_ended(self, inc: _Incarnation) -> None:
        if inc.recorded or not inc.pids:
            return
        inc.recorded = True
        ranks = {self.workers[p].rank: self.workers[p].step for p in inc.pids}
        events.write(
            self.run_dir,
            events.AttemptEnded(
                restart=inc.restart,
                last_step=max(ranks.values()),
                steps={str(r): s for r, s in sorted(ranks.items())},
                phases={str(self.workers[p].rank): self.workers[p].phase for p in inc.pids},
            ),
        )

    # ---- failures ---------------------------------------------------------------------------------
    def _take_stop(self, in_exits: bool) -> bool:
        """True once, to the thread that is to stop the group: a failure that would recur, with
        restarts left to a backend that restarts the group itself (`in_exits`: the backend's thread, as
        it hands over exit statuses; else the supervisor's)."""
        with self._lock:
            found = self.recurring
            if found is None or self._told_recurring or not self.group_restarts or found[0] >= self.conf.max_restarts:
                return False
            if self._found_in_exits != in_exits:
                return False
            self._told_recurring = self._stopping_group = True
            return True

    def worker_exits(self, exits: List[WorkerExit]) -> bool:
        """The backend found a failure: how its workers ended (the backend's thread). An exit known by
        pid is matched by pid; one known by rank only, to that rank in the newest incarnation. True:
        the failure would recur, and the backend must stop the group rather than restart it."""
        with self._lock:
            self._in_exits = True
            try:
                self._diagnose_exits(exits)
            finally:
                self._in_exits = False
        return self._take_stop(in_exits=True)

    def _diagnose_exits(self, exits: List[WorkerExit]) -> None:
        """Match each exit to its worker and diagnose the incarnations they ended (under the lock)."""
        self._tick()
        newest = max(self.incarnations, default=0)
        touched = set()
        for ended in exits:
            w = self.workers.get(ended.pid) if ended.pid is not None else None
            if w is None and ended.pid is None and ended.rank is not None:
                w = next(
                    (
                        self.workers[p]
                        for p in self.incarnations.get(newest, _Incarnation(newest)).pids
                        if self.workers[p].rank == ended.rank
                    ),
                    None,
                )
            if w is None and ended.pid is not None:  # ended before its first heartbeat: known by its local rank
                rank = ended.local_rank if ended.local_rank is not None else -1
                w = self.workers[ended.pid] = _Worker(rank=rank, pid=ended.pid, restart=newest, last_change=0.0, alive=False)
                w.gone_at = time.time()
                self.incarnations.setdefault(newest, _Incarnation(newest)).pids.append(ended.pid)
            if w is not None:
                w.exit = ended
                touched.add(w.restart)
        for restart in sorted(touched):
            self._diagnose(self.incarnations[restart])

    def settle(self) -> None:
        """Diagnose now every incarnation whose workers are all gone (not waiting for exit statuses)."""
        with self._lock:
            self._tick()
            for inc in self.incarnations.values():
                if inc.ended_at is not None:
                    self._diagnose(inc)

    def _diagnose(self, inc: _Incarnation) -> None:
        if inc.diagnosed or not inc.pids:
            return
        inc.diagnosed = True
        if stop_requested() is not None:
            return  # stopped on request: whatever ended how, it is not a failure
        if self._stopping_group and self.recurring is not None and inc.restart > self.recurring[0]:
            return  # started before the backend could be stopped, and stopped by it: not a failure of its own
        workers = [self.workers[p] for p in inc.pids]
        errors = {
            r.pid: r
            for r in events.records(self.run_dir, since=self.started, kinds=(Event.WORKER_FAILED,))
            if isinstance(r, events.WorkerFailed)
        }
        ends = [self._rank_end(w, errors.get(w.pid)) for w in workers]
        found = diagnose(ends)
        if found is None:
            return
        self.diagnoses.append(found)
        before = events.newest(
            events.records(self.run_dir, since=self.launched, kinds=(Event.ATTEMPT_FAILED,)), events.AttemptFailed
        )
        why = recurrence(ends, before.raised if before is not None else None) if self.whole_job else None
        if why is not None:
            self.recurring, self._found_in_exits = (inc.restart, why, found.line()), self._in_exits
        cause = found.cause
        events.write(
            self.run_dir,
            events.AttemptFailed(
                restart=inc.restart,
                rank=cause.rank,
                worker_pid=cause.pid,
                step=cause.step if cause.step >= 0 else None,
                how=cause.how(),
                signal=cause.signal_name,
                exit_code=cause.exit_code if cause.signal_name is None else None,
                error=cause.error,
                where=cause.where,
                cause=found.line(),
                consequences=[c.record() for c in found.consequences],
                raised=raised(ends) or None,
                not_restarted=why,
            ),
        )
        if why is not None:
            log.warning("%s; %s", found.line(), why)
        elif self.group_restarts:
            left = self.conf.max_restarts - inc.restart
            then = (
                f"restarting the group (restart {inc.restart + 1} of {self.conf.max_restarts})"
                if left > 0
                else "no restarts left"
            )
            log.warning("%s; %s", found.line(), then)
        else:
            log.warning("%s", found.line())
        for c in found.consequences:
            details.warning("  consequence: rank %d (pid %d) %s", c.rank, c.pid, c.how())

    def _rank_end(self, w: _Worker, failed: Optional[events.WorkerFailed]) -> RankEnd:
        end = RankEnd(
            rank=w.rank,
            pid=w.pid,
            host=HOST,
            step=failed.step if failed is not None and failed.step is not None else w.step,
            ended_at=w.gone_at,
            exit_code=w.exit.exit_code if w.exit is not None else None,
            error=failed.error if failed is not None else None,
            where=failed.where if failed is not None else None,
            error_at=failed.time if failed is not None else None,
            stopped_by_backend=bool(w.exit and w.exit.stopped_by_backend and failed is None),
            hung=w.hang is not None,
            suspect=bool(w.hang),
            hang=w.hang or None,
            waiting=w.waits,
            finished=w.phase == DONE_PHASE,
            recurs=failed.recurs if failed is not None else None,
        )
        if end.signal_name in FATAL_SIGNALS and end.where is None:
            end.where = crash_site(stacks_file(self.run_dir, w.rank))
        return end

    # ---- preemption -----------------------------------------------------------------------------
    def _forward_stop(self, signum: int, live: List[_Worker]) -> None:
        name = signal_name(signum)
        if live:
            mark_stop(self.run_dir, self.launch_id)
        for w in live:
            if w.pid not in self.forwarded and w.phase not in ("stop", DONE_PHASE):
                self.forwarded.add(w.pid)
                kill(w.pid, signum)
        if live and not self._forward_logged:
            self._forward_logged = True
            log.warning(
                "%s: asked %d worker(s) to save and stop at their next step boundary (restart.preemption_grace_s=%g)",
                name,
                len(live),
                self.conf.preemption_grace_s,
            )
        waited = time.time() - (stop_requested_at() or time.time())
        if waited >= self.conf.preemption_grace_s and not self.grace_expired and live:
            self.grace_expired = True
            log.error(
                "%s: the workers did not stop within restart.preemption_grace_s=%g; stopping them "
                "(the newest committed checkpoint is intact)",
                name,
                self.conf.preemption_grace_s,
            )
            events.write(
                self.run_dir,
                events.PreemptionGraceExpired(
                    signal=name,
                    grace_s=self.conf.preemption_grace_s,
                    ranks={str(w.rank): {"step": w.step, "phase": w.phase} for w in live},
                ),
            )
            # the backend stops its own workers (so that torch elastic does not take our kill for a
            # failure and restart them); whatever is left a few seconds later is killed here
            self._backend_stops = bool(self.on_grace_expired and self.on_grace_expired())
        if self.grace_expired and (not self._backend_stops or waited >= self.conf.preemption_grace_s + 5):
            for w in live:
                w.handled = True
                kill(w.pid, signal.SIGKILL)
        if waited >= self.conf.preemption_grace_s + OVERDUE_S and not self._overdue and self.on_overdue is not None:
            # still not back (the backend waits for something that will not come, e.g. a
            # rendezvous): the launcher's own main thread gives up the launch
            self._overdue = True
            log.error("%s: the launch has not ended %g s after the grace; abandoning it", name, OVERDUE_S)
            self.on_overdue()
