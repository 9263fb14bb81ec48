#!/usr/bin/env bash
# `make lint`: ruff's lint, ruff's format check and mypy, as configured in pyproject.toml, in that
# order; stops at the first that fails and says which.
set -u
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
check() {
  local name=$1
  shift
  "$@" && return 0
  local rc=$?
  echo "lint: $name failed (exit code $rc)" >&2
  exit "$rc"
}
check "ruff check" "$VENV/bin/ruff" check .
check "ruff format --check" "$VENV/bin/ruff" format --check .
check mypy "$VENV/bin/mypy"
