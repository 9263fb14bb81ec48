#!/usr/bin/env bash
# `make test`: the whole suite in two phases.
#   1. every test not marked `alone`, in TEST_PROCS processes (pytest-xdist; default 2, the cores here):
#      most of a test's time is its workers starting, meeting and being restarted, so two at once
#      take about 0.6 of the time of one after the other;
#   2. the tests marked `alone` (they time a kill or a second node against a worker's progress),
#      one at a time with nothing else running.
# TEST_TIER=all (make test-all) adds the tests marked `extended`: a second test of a promise the
# default tier covers already (Horovod's variant of a torchrun scenario, another example app, another
# fault timing) and the benchmarks' smoke runs. The default tier keeps make test within 12 minutes
# on a fresh clone of a 2-core machine; the whole suite takes about twice that.
# Arguments go to both phases. A phase that selects no test (exit code 5) is not a failure, unless
# neither selects any.
set -u
PY=${PY:-.venv/bin/python}
ran=0
phase() {
  # the slowest tests named at the end: what to look at first when the suite nears its 12 minutes
  "$PY" -m pytest --durations=15 --durations-min=10 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then return 0; fi
  ran=1
  return "$rc"
}
case "${TEST_TIER:-default}" in
  all) tier="" ;;
  default) tier=" and not extended" ;;
  *) echo "TEST_TIER=${TEST_TIER} is not a tier: default (make test) or all (make test-all)" >&2; exit 2 ;;
esac
phase -n "${TEST_PROCS:-2}" --dist worksteal -m "not alone$tier" "$@" || exit $?
phase -m "alone$tier" "$@" || exit $?
[ "$ran" -eq 1 ] || exit 5
