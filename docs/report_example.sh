#!/usr/bin/env bash
# Makes docs/report.png: one run that meets a crash, a preemption and a hang, and finishes.
#   launch 1: rank 1 is SIGKILLed at step 250 (torch elastic restarts the group, which restores the
#             newest snapshot in shared memory, a few steps back; the disk checkpoint is step 200),
#             then the launcher gets SIGTERM after the checkpoint of step 500 (exit code 75);
#   launch 2: the same run again; rank 1 hangs at step 650, the watchdog finds it after 5 s,
#             the group restarts from its newest snapshot and the run completes.
# Usage: bash docs/report_example.sh [work folder]   (about a minute on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
export PYTHONPATH="$ROOT:$ROOT/launchers${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
JOB=(data=synthetic data.num_samples=16000 data.num_features=32 "model.hidden_sizes=[1024,1024]" data.batch_size=32
     trainer.max_epochs=4 checkpoint=every_n_steps checkpoint.every_n_steps=100 restart.hang_timeout_s=5
     restart.monitor_interval=0.1 logger.progress=none run.name=report_example "hydra.sweep.dir=$WORK")
RUN="$WORK/report_example"
rm -rf "$RUN"

"$PY" -m pipeline.train "${JOB[@]}" fault=kill_rank fault.rank=1 fault.at_step=250 > "$WORK/launch1.log" 2>&1 &
launcher=$!
until grep -q '"event": "checkpoint_saved".*"step": 500' "$RUN/events.jsonl" 2>/dev/null; do
  kill -0 $launcher 2>/dev/null || { echo "launch 1 ended early"; tail -20 "$WORK/launch1.log"; exit 1; }
  sleep 0.1
done
kill -TERM $launcher
set +e; wait $launcher; code=$?; set -e
echo "launch 1: exit code $code (75: preempted, run again to continue)"

"$PY" -m pipeline.train "${JOB[@]}" fault=hang_rank fault.rank=1 fault.at_step=650 > "$WORK/launch2.log" 2>&1
echo "launch 2: exit code 0"
"$PY" -m pipeline.report "$RUN"
cp "$RUN/report.png" "$ROOT/docs/report.png"
