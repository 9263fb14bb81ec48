"""Which failure came first: the launcher's rule (`_diagnosis.diagnose`) on the ends a worker group
has, and the patch that gives it every worker's exit status from torch elastic (real processes)."""

from __future__ import annotations

import os
import signal
import time
from typing import List

import pytest

from hydra_plugins.steadfast_launcher import _compat
from hydra_plugins.steadfast_launcher._compat import elastic_exits
from hydra_plugins.steadfast_launcher._diagnosis import RankEnd, diagnose
from hydra_plugins.steadfast_launcher._types import WorkerExit

RESET = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32176: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
CLOSED = "RuntimeError: [../gloo/transport/tcp/pair.cc:589] Connection closed by peer [127.0.0.1]:1234"
TIMEOUT = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete"


def end(rank: int, **kw: object) -> RankEnd:
    return RankEnd(rank=rank, pid=100 + rank, host="vm", step=kw.pop("step", 70), **kw)  # type: ignore[arg-type]


def test_a_killed_rank_is_the_cause_even_when_its_peer_failed_and_was_seen_first() -> None:
    # the survivor's error was recorded before the launcher saw the killed rank gone
    ends = [
        end(0, exit_code=1, error=RESET, error_at=10.00, ended_at=10.02, finished=True),
        end(1, exit_code=-9, ended_at=10.05),
    ]
    found = diagnose(ends)
    assert found is not None
    assert found.cause.rank == 1 and found.cause.how() == "killed by SIGKILL"
    assert [c.rank for c in found.consequences] == [0]
    assert found.line().startswith("rank 1 (pid 101 on vm) killed by SIGKILL at step 70; rank(s) 0 failed as a consequence")
    assert found.consequences[0].record()["how"].startswith("lost a peer")


def test_a_segfault_is_the_cause_and_where_it_crashed_is_named() -> None:
    ends = [
        end(0, exit_code=-11, ended_at=5.0, where="steadfast/faults.py:125 in _fire"),
        end(1, exit_code=1, error=CLOSED, error_at=5.01),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 0
    assert "killed by SIGSEGV at step 70 (at steadfast/faults.py:125 in _fire)" in found.line()


def test_an_exception_is_the_cause_and_a_peer_stopped_by_the_backend_a_consequence() -> None:
    ends = [
        end(0, exit_code=-15, stopped_by_backend=True, ended_at=3.2),
        end(
            1,
            exit_code=1,
            error="InjectedFault: fault=exception injected at step 20 on rank 1",
            where="faults.py:9 in _fire",
            error_at=3.1,
        ),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1
    assert found.cause.how().startswith("raised InjectedFault: fault=exception")
    assert found.consequences[0].how() == "stopped by the backend (SIGTERM)"


def test_of_two_failures_of_their_own_the_earlier_is_the_cause() -> None:
    ends = [
        end(0, exit_code=-9, ended_at=7.5),
        end(1, exit_code=1, error="ValueError: bad batch", error_at=7.0),
        end(2, exit_code=1, error=RESET, error_at=7.1),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1 and [c.rank for c in found.consequences] == [0, 2]


def test_the_watchdogs_hung_rank_is_the_cause_not_the_ranks_waiting_for_it() -> None:
    ends = [
        end(0, exit_code=-9, hung=True, ended_at=1.0),
        end(
            1,
            exit_code=-9,
            hung=True,
            suspect=True,
            hang="no progress for 4.0 s at step 20 (phase train), at faults.py:130 in _fire",
            ended_at=1.0,
        ),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1
    assert found.line() == (
        "rank 1 (pid 101 on vm) hung: no progress for 4.0 s at step 20 (phase train), at faults.py:130 in _fire; "
        "rank(s) 0 waiting for it in a collective; killed by the watchdog"
    )


def test_a_peer_found_waiting_before_it_counts_as_stuck_is_named_waiting() -> None:
    """Its counter was written a poll after the suspect's (a heartbeat's count is written within 50 ms):
    not killed by the watchdog, stopped by the backend, and still named waiting, as the watchdog found."""
    hang = "no progress for 4.0 s at step 20 (phase train), at faults.py:130 in _fire"
    ends = [
        end(0, exit_code=-15, stopped_by_backend=True, waiting=True, ended_at=1.1),
        end(1, exit_code=-9, hung=True, suspect=True, hang=hang, ended_at=1.0),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1
    assert (
        found.line() == f"rank 1 (pid 101 on vm) hung: {hang}; rank(s) 0 waiting for it in a collective; killed by the watchdog"
    )
    assert found.consequences[0].how() == "stopped by the backend (SIGTERM)"


def test_peers_that_timed_out_name_the_rank_that_was_alive_and_silent() -> None:
    ends = [end(0, exit_code=1, error=TIMEOUT, error_at=9.0), end(1, exit_code=-15, stopped_by_backend=True, ended_at=9.2)]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1
    assert found.cause.how() == "stopped responding: its peers timed out waiting for it"


def test_without_exit_statuses_a_rank_that_never_finished_is_the_cause() -> None:
    # Horovod's runner hands over no exit statuses: what is left is the workers' records and heartbeats
    ends = [end(0, error=RESET, error_at=2.0, finished=True), end(1, ended_at=2.1)]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1
    assert "ended without an exit status" in found.cause.how()


def test_a_clean_end_is_no_failure() -> None:
    assert diagnose([end(0, exit_code=0, finished=True), end(1, finished=True)]) is None


def _kill_one(local_rank: int) -> None:
    if local_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the survivor: still running when the agent finds the failure


def test_torch_elastic_hands_every_workers_exit_to_the_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "_checked", {})
    assert elastic_exits.EXIT_STATUSES.problem() is None, "the patch no longer fits: read _compat/elastic_exits.py"
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    seen: List[List[WorkerExit]] = []
    stops: List[int] = []

    def observer(exits: List[WorkerExit]) -> bool:
        seen.append(exits)
        return True  # the failure would recur: the agent is to be stopped (here: the stop is recorded)

    with elastic_exits.observe(observer, lambda: stops.append(len(seen))):
        context = start_processes(
            name="diagnosis",
            entrypoint=_kill_one,
            args={0: (0,), 1: (1,)},
            envs={0: {}, 1: {}},
            logs_specs=DefaultLogsSpecs(log_dir=None),
            start_method="fork",
        )
        pids = context.pids()
        result = context.wait(timeout=60, period=0.05)
    assert result is not None and result.is_failed()
    assert len(seen) == 1, seen
    assert stops == [1], "an observer that answers True has the agent stopped, after it saw the exits"
    exits = {e.pid: e for e in seen[0]}
    assert exits[pids[1]].exit_code == -signal.SIGKILL and not exits[pids[1]].stopped_by_backend
    assert exits[pids[0]].stopped_by_backend and exits[pids[0]].local_rank == 0


def test_peers_that_timed_out_name_the_silent_rank_even_when_it_failed_afterwards() -> None:
    # the silent rank's own error came later: the rank that gave up closed the connection
    ends = [
        end(0, exit_code=1, error="RuntimeError: Application timeout caused pair closure", error_at=9.0),
        end(1, exit_code=1, error=CLOSED, error_at=9.1),
    ]
    found = diagnose(ends)
    assert found is not None and found.cause.rank == 1 and found.cause.unresponsive
