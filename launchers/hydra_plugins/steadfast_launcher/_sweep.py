"""Running the jobs of one launch: one at a time in the launcher's process, or several at once,
packed onto the machine, one launcher process per job (`_jobproc`); the sweep ledger kept up to
date after every change (`_ledger`); stop signals; the table at the end.

Generic: nothing here knows the training pipeline or which backend a job uses.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List, Optional, Sequence, Set

from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides

from steadfast.contract import summary
from steadfast.contract.exits import exit_code
from steadfast.contract.keys import override_key
from steadfast.contract.stop import signal_name

from . import _backends, _ending, _ledger, _packing, _payload
from ._compat.hydra_job_return import returned
from ._context import LaunchContext
from ._job import run_one
from ._jobproc import JobProcess
from ._ledger import COMPLETED, FAILED, INTERRUPTED, NOT_RUN, PENDING, RUNNING, SKIPPED, Ledger
from ._signals import handling_signals
from ._types import Interrupted, Job, JobFailed, Refused, Settings, first_line, job_return

log = logging.getLogger(__name__)

STOP_GRACE_S = 90.0  # a parallel job gets this long to stop after a forwarded signal, then it is killed
SCRATCH_PREFIX = "steadfast-jobs-"  # a parallel sweep's private folder: the jobs' payloads and results


class Sweep:
    """Runs the jobs of one launch() call and keeps the ledger and the table up to date."""

    def __init__(self, ctx: LaunchContext, jobs: List[Job], settings: Settings, ledger: Optional[Ledger], sweep_dir: str) -> None:
        self.ctx, self.jobs, self.settings, self.ledger, self.sweep_dir = ctx, jobs, settings, ledger, sweep_dir
        self.returns: Dict[int, JobReturn] = {}
        self.status: Dict[int, str] = {}
        self.results: Dict[int, Any] = {}
        self.refused: Set[int] = set()  # jobs refused before anything was written (a folder in use)
        self.signum: Optional[int] = None
        self.failed_first: Optional[Job] = None  # the failure that stopped the sweep (fail_fast)
        self.in_job = False
        self._second_signal = False

    # ---- ledger

    def _folder(self, job: Job) -> str:
        assert job.run_dir is not None
        try:
            return str(job.run_dir.relative_to(os.path.abspath(self.sweep_dir)))
        except ValueError:
            return str(job.run_dir)

    def _shown_folder(self, job: Job) -> str:
        """For the table: relative to the sweep folder, or (one job, whose run folder is the sweep folder) to here."""
        folder = self._folder(job)
        return os.path.relpath(str(job.run_dir)) if folder == "." else folder

    def completed_result(self, job: Job) -> Optional[List[Any]]:
        """[value] if the ledger says this very job completed earlier (same config, folder still there)."""
        if self.ledger is None or not self.settings.skip_completed:
            return None
        rec = self.ledger.get(job.key)
        if not rec or rec.get("status") != COMPLETED or rec.get("config_sha256") != job.digest:
            return None
        if rec.get("run_dir") != self._folder(job) or not (job.run_dir and job.run_dir.is_dir()):
            return None
        ok, value = _ledger.decode_result(rec)
        return [value] if ok else None

    def _record(self, job: Job, **fields: Any) -> None:
        if self.ledger is not None:
            self.ledger.update(
                job.key,
                overrides=list(job.overrides),
                run_dir=self._folder(job),
                job_num=job.idx,
                config_sha256=job.digest,
                **fields,
            )

    def _try_skip(self, job: Job) -> bool:
        found = self.completed_result(job)
        if found is None:
            return False
        value = found[0]
        self.returns[job.idx] = job_return(job, JobStatus.COMPLETED, value)
        self.status[job.idx], self.results[job.idx] = SKIPPED, value
        log.info("%s completed in an earlier run of this sweep: skipped (result %s)", job.label, describe_result(value))
        return True

    def _started(self, job: Job) -> None:
        attempts = ((self.ledger.get(job.key) or {}).get("attempts", 0) if self.ledger else 0) + 1
        self._record(job, status=RUNNING, attempts=attempts, started_at=round(time.time(), 3), ended_at=None)

    def _finished(self, job: Job, ret: JobReturn, interrupted: bool = False) -> None:
        self.returns[job.idx] = ret
        recorded = summary.read(job.run_dir)
        restarts = recorded["restarts"] if isinstance(recorded.get("restarts"), int) else job.restarts
        rec = (self.ledger.get(job.key) or {}) if self.ledger else {}
        wall = round(time.time() - rec["started_at"], 3) if rec.get("started_at") else None
        fields: Dict[str, Any] = dict(restarts=restarts, ended_at=round(time.time(), 3), wall_seconds=wall)
        for stale in ("result", "result_pickle", "result_unavailable", "result_repr"):
            rec.pop(stale, None)
        value = returned(ret)
        if interrupted:
            self.status[job.idx] = INTERRUPTED
            fields.update(status=INTERRUPTED, error=first_line(value))
        elif ret.status == JobStatus.COMPLETED:
            self.status[job.idx], self.results[job.idx] = COMPLETED, value
            fields.update(status=COMPLETED, error=None, **_ledger.encode_result(value))
        else:
            self.status[job.idx] = FAILED
            fields.update(status=FAILED, error=str(value).strip())
            if isinstance(value, Refused):
                self.refused.add(job.idx)
            if self.failed_first is None:
                self.failed_first = job
        self._record(job, **fields)
        line = _ending.end_line(job, self.signum if interrupted else None)
        if line is not None:
            (log.info if self.status[job.idx] == COMPLETED else log.warning)("%s", line)

    # ---- the run

    def run(self, table: bool) -> List[JobReturn]:
        parallel = self.settings.max_parallel_jobs > 1 and sum(1 for j in self.jobs if self.completed_result(j) is None) > 1
        try:
            if parallel:
                self._run_parallel()
            else:
                self._run_sequential()
        finally:
            self._fill_not_run()
            if table:  # a single job's end is its own line (see _finished)
                self._print_table()
        if self.signum is not None:
            configured = self.jobs[0].restart.preemption_exit_code if self.jobs else None
            if table:
                log.warning(
                    "Stopped by %s. Run the same command again to resume: completed jobs are skipped, "
                    "interrupted ones resume from their checkpoints (exit code %d).",
                    signal_name(self.signum, unknown="a signal"),
                    exit_code(self.signum, configured),
                )
            sys.exit(exit_code(self.signum, configured))
        return [self.returns[j.idx] for j in self.jobs]

    def all_refused(self) -> bool:
        """Every job was refused before it wrote anything: the launch as a whole was refused."""
        return bool(self.jobs) and all(j.idx in self.refused for j in self.jobs)

    def stop_reason(self) -> str:
        if self.signum is None and self.failed_first is not None:
            return f"stopped because {self.failed_first.label} failed and hydra.launcher.fail_fast=true"
        return f"stopped by {signal_name(self.signum, unknown='a signal')}"

    def _stopping(self) -> bool:
        return self.signum is not None or (self.settings.fail_fast and self.failed_first is not None)

    def _fill_not_run(self) -> None:
        for job in self.jobs:
            if job.idx in self.returns:
                continue
            why = f"not run: the sweep was {self.stop_reason()}"
            self.returns[job.idx] = job_return(job, JobStatus.FAILED, JobFailed(f"{job.label} was {why}"))
            self.status[job.idx] = NOT_RUN
            if self.ledger is not None and (self.ledger.get(job.key) or {}).get("status") in (None, RUNNING):
                self._record(job, status=PENDING)

    def _interrupted_return(self, job: Job, why: str) -> JobReturn:
        return job_return(
            job,
            JobStatus.FAILED,
            JobFailed(
                f"{job.label} was interrupted ({why}); run the command again to resume it from its checkpoints", job.restarts
            ),
        )

    def _print_table(self) -> None:
        varying = _varying(self.jobs)
        rows: List[Dict[str, Any]] = []
        for job in self.jobs:
            status = self.status.get(job.idx, NOT_RUN)
            recorded = summary.read(job.run_dir) if status != NOT_RUN else {}
            restarts = recorded["restarts"] if isinstance(recorded.get("restarts"), int) else job.restarts
            shown = (
                [o for o in filter_overrides(job.overrides) if override_key(o) in varying]
                if varying
                else filter_overrides(job.overrides)
            )
            rows.append(
                dict(
                    job=job.idx,
                    overrides=" ".join(shown) or "(defaults)",
                    status=status,
                    restarts=restarts if status != NOT_RUN else "",
                    result=describe_result(self.results.get(job.idx)),
                    folder=self._shown_folder(job),
                )
            )
        counts: Dict[str, int] = {}
        for row in rows:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        lines = [f"Sweep summary: {', '.join(f'{n} {s}' for s, n in counts.items())}"]
        lines.append(
            f"  sweep folder: {os.path.relpath(os.path.abspath(self.sweep_dir))}"
            + (f" (ledger: {self.ledger.path.name})" if self.ledger is not None else "")
        )
        if varying:
            lines.append("  overrides: those the jobs differ in (all of them are in the ledger)")
        log.info("%s\n%s", "\n".join(lines), format_table(rows))
        failed = [j for j in self.jobs if self.status.get(j.idx) == FAILED]
        if failed:
            log.error("%d of %d job(s) failed: %s", len(failed), len(self.jobs), ", ".join(f"#{j.idx}" for j in failed))

    # ---- one at a time, in this process

    def _on_signal_sequential(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signum = self.signum or signum
        if self.in_job:
            raise Interrupted(signum=signum)

    def _run_sequential(self) -> None:
        config = self.ctx.config
        with handling_signals(self._on_signal_sequential) as reinstall:
            for job in self.jobs:
                if self._stopping():
                    break
                if self._try_skip(job):
                    continue
                log.info("Launching %s on %s", job.label, _backends.of(job.backend).describe())
                self._started(job)
                try:
                    self.in_job = True
                    ret = run_one(self.ctx.hydra_context, self.ctx.task_function, job)
                except KeyboardInterrupt as stop:
                    self.in_job = False
                    self.signum = getattr(stop, "signum", None) or self.signum or signal.SIGINT
                    self._finished(job, self._interrupted_return(job, self.stop_reason()), interrupted=True)
                    break
                finally:
                    self.in_job = False
                    reinstall()
                    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
                self._finished(job, ret)

    # ---- several at once, one launcher process per job

    def _on_signal_parallel(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            self._second_signal = True
        self.signum = self.signum or signum

    def _run_parallel(self) -> None:
        box = _packing.machine(self.settings.max_procs)
        log.info(
            "Running up to %d jobs at once on %d %s%s",
            self.settings.max_parallel_jobs,
            box.capacity,
            {"gpu": "GPUs", "cpu": "CPU cores", "slots": "worker slots (hydra.launcher.max_procs)"}[box.kind],
            "" if box.kind == "slots" else f" ({', '.join(box.labels)})",
        )
        pending = list(self.jobs)
        running: Dict[int, JobProcess] = {}
        forwarded_at: Optional[float] = None
        with handling_signals(self._on_signal_parallel), _payload.scratch(SCRATCH_PREFIX) as scratch:
            while pending or running:
                if self._stopping():
                    pending_stop = [p for p in running.values() if not p.stop_sent]
                    for proc in pending_stop:
                        proc.stop(self.signum or signal.SIGTERM)
                    if pending_stop and forwarded_at is None:
                        forwarded_at = time.monotonic()
                    if self._second_signal or (forwarded_at is not None and time.monotonic() - forwarded_at > STOP_GRACE_S):
                        for proc in running.values():
                            proc.kill()
                else:
                    self._start_fitting(pending, running, box, scratch)
                    if not running:
                        break
                time.sleep(0.1)
                for idx, proc in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[idx]
                    box.give_back(proc.units)
                    status, ret, note = proc.outcome()
                    if status == INTERRUPTED:
                        ret = self._interrupted_return(proc.job, self.stop_reason() + note)
                    assert ret is not None
                    self._finished(proc.job, ret, interrupted=status == INTERRUPTED)
                if self._stopping() and not running:
                    break

    def _start_fitting(self, pending: List[Job], running: Dict[int, JobProcess], box: _packing.Machine, scratch: Path) -> None:
        """Start every pending job that fits now (first fit, in sweep order)."""
        while True:
            busy = [p.job.run_dir for p in running.values()]
            folders = {j.idx: j.run_dir for j in pending}
            idx = _packing.pick(
                [(j.idx, j.procs) for j in pending], box, len(running), self.settings.max_parallel_jobs, busy, folders
            )
            if idx is None:
                return
            job = next(j for j in pending if j.idx == idx)
            pending.remove(job)
            if self._try_skip(job):
                continue
            if job.procs > box.capacity:
                log.warning(
                    "%s needs %d worker processes, more than the %d this machine has: it runs alone",
                    job.label,
                    job.procs,
                    box.capacity,
                )
            units = box.take(job.procs)
            self._started(job)
            running[job.idx] = JobProcess(self.ctx, job, box, units, scratch)


def _varying(jobs: List[Job]) -> set:
    """The override keys whose values differ between these jobs (empty for a single job)."""
    if len(jobs) < 2:
        return set()
    values = [{override_key(o): o.split("=", 1)[-1] for o in job.overrides} for job in jobs]
    keys = set().union(*values)
    return {k for k in keys if len({v.get(k) for v in values}) > 1}


# ---- the table


def describe_result(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, (int, float)):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def format_table(rows: List[Dict[str, Any]]) -> str:
    """Rows with keys job, overrides, status, restarts, result, folder."""
    head = ("job", "overrides", "status", "restarts", "result", "run folder")
    keys = ("job", "overrides", "status", "restarts", "result", "folder")
    body = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 60)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths)):
            if len(cell) > w:
                cell = cell[: w - 3] + "..."
            out.append(cell.rjust(w) if i in (0, 3) else cell.ljust(w))
        return "  ".join(out).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])
