#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo, no MPI/TF/MXNet) into a Python environment.
#
# Usage: bash scripts/install_horovod.sh [PYTHON]
#   PYTHON  interpreter of the target environment (default: python3); torch must
#           already be installed there. This script never installs or upgrades torch.
#
# Recipe (see shared notes on Horovod): horovod 0.28.1 is the last release and does not
# build against torch >= 2.1 as published, because it compiles its torch extension as
# C++14. We download the sdist, switch both CMakeLists.txt to C++17, build a wheel with
# the system cmake (3.x) and without build isolation (so it sees the installed torch),
# and cache the wheel keyed by torch version and Python tag:
#   ${STEADFAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/steadfast}/wheels/horovod-0.28.1-torch-<ver>-<pytag>/
# Later runs install from the cache without rebuilding.
#
# Environment:
#   STEADFAST_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/steadfast)
#   HOROVOD_CMAKE     cmake binary to use (default: /usr/bin/cmake if present, else cmake on PATH)

set -euo pipefail

HVD_VERSION=0.28.1
PYTHON=${1:-python3}

log() { printf '[horovod] %s\n' "$*"; }
die() { printf '[horovod] ERROR: %s\n' "$*" >&2; exit 1; }

TMP_ROOT=""
PARTIAL_WHEEL=""
cleanup() {
    if [[ -n "$PARTIAL_WHEEL" && -e "$PARTIAL_WHEEL" ]]; then rm -f -- "$PARTIAL_WHEEL"; fi
    if [[ -n "$TMP_ROOT" && -d "$TMP_ROOT" ]]; then rm -rf -- "$TMP_ROOT"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- target interpreter --------------------------------------------------------------
if ! PY_PATH=$(command -v -- "$PYTHON"); then
    die "Python interpreter '$PYTHON' not found"
fi
"$PY_PATH" -c 'import sys' >/dev/null 2>&1 || die "'$PYTHON' is not a working Python interpreter"
pip_() { "$PY_PATH" -m pip "$@"; }
pip_ --version >/dev/null 2>&1 || die "pip is not available for $PYTHON"

# Directory of console scripts (the venv's bin/), where horovodrun gets installed.
SCRIPTS_DIR=$("$PY_PATH" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')

# torch version (from metadata: fast, no torch import) and Python tag, e.g. 2.13.0+cpu / cp311
TORCH_VERSION=$("$PY_PATH" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null) \
    || die "torch is not installed in $PYTHON's environment; install torch first"
PY_TAG=$("$PY_PATH" -c 'import sys; i = sys.implementation; print(("cp" if i.name == "cpython" else i.name) + "%d%d" % sys.version_info[:2])')

# Runs `horovodrun --check-build` for the target environment; prints its output.
check_build() {
    if [[ -x "$SCRIPTS_DIR/horovodrun" ]]; then
        "$SCRIPTS_DIR/horovodrun" --check-build 2>&1
    else
        "$PY_PATH" -m horovod.runner.launch --check-build 2>&1
    fi
}
# True if the check-build output lists both PyTorch and Gloo as available.
check_build_ok() {
    grep -q '\[X\] PyTorch' <<<"$1" && grep -q '\[X\] Gloo' <<<"$1"
}

# --- skip if already installed and working --------------------------------------------
# Fast in-process equivalent of check-build's "[X] PyTorch" and "[X] Gloo" (~1.5 s instead
# of ~7 s: check-build probes every framework in a subprocess). The full check-build still
# runs after an install.
HVD_PROBE='import importlib.metadata as m, horovod.torch as h
print(m.version("horovod") if h.gloo_built() else "")'
INSTALLED_VERSION=$("$PY_PATH" -c "$HVD_PROBE" 2>/dev/null || true)
if [[ -n "$INSTALLED_VERSION" ]] && { [[ -x "$SCRIPTS_DIR/horovodrun" ]] || "$PY_PATH" -c 'import horovod.runner.launch' >/dev/null 2>&1; }; then
    log "horovod $INSTALLED_VERSION already installed with PyTorch+Gloo for $PY_PATH (torch $TORCH_VERSION); skipping"
    exit 0
fi
if "$PY_PATH" -c 'import importlib.metadata as m; m.version("horovod")' >/dev/null 2>&1; then
    log "horovod is installed but 'import horovod.torch' fails or lacks Gloo; reinstalling $HVD_VERSION"
fi

CACHE_ROOT=${STEADFAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/steadfast}
CACHE_DIR="$CACHE_ROOT/wheels/horovod-$HVD_VERSION-torch-$TORCH_VERSION-$PY_TAG"
log "target: $PY_PATH (torch $TORCH_VERSION, $PY_TAG)"
log "wheel cache: $CACHE_DIR"
mkdir -p -- "$CACHE_DIR"

find_cached_wheel() {
    # Only complete wheels: partial copies are named .partial-* and never match.
    compgen -G "$CACHE_DIR/horovod-$HVD_VERSION-*.whl" | head -n 1 || true
}

# Horovod's runtime deps (also needed at build time: setup.py imports packaging).
# Installed normally; none of them depends on torch.
log "installing runtime dependencies: cloudpickle psutil pyyaml packaging"
pip_ install --quiet cloudpickle psutil pyyaml packaging

WHEEL=$(find_cached_wheel)
if [[ -n "$WHEEL" ]]; then
    log "installing cached wheel $(basename -- "$WHEEL") (no build)"
    if ! pip_ install --quiet --no-deps --force-reinstall -- "$WHEEL"; then
        log "cached wheel failed to install; removing it and rebuilding"
        rm -f -- "$WHEEL"
        WHEEL=""
    fi
fi

if [[ -z "$WHEEL" ]]; then
    # --- build tools ---------------------------------------------------------------
    if [[ -z "${HOROVOD_CMAKE:-}" ]]; then
        if [[ -x /usr/bin/cmake ]]; then
            HOROVOD_CMAKE=/usr/bin/cmake
        elif command -v cmake >/dev/null 2>&1; then
            HOROVOD_CMAKE=$(command -v cmake)
        else
            die "cmake not found; install it (e.g. apt-get install cmake build-essential) and rerun"
        fi
    fi
    [[ -x "$HOROVOD_CMAKE" ]] || die "cmake '$HOROVOD_CMAKE' is not executable"
    CMAKE_VERSION=$("$HOROVOD_CMAKE" --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
    [[ -n "$CMAKE_VERSION" ]] || die "could not determine the version of $HOROVOD_CMAKE"
    command -v g++ >/dev/null 2>&1 || die "g++ not found; install a C++ compiler (e.g. apt-get install g++ build-essential) and rerun"
    command -v make >/dev/null 2>&1 || die "make not found; install it (e.g. apt-get install make build-essential) and rerun"
    PY_INCLUDE=$("$PY_PATH" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [[ -f "$PY_INCLUDE/Python.h" ]] || die "Python headers not found ($PY_INCLUDE/Python.h); install the python3-dev package for this interpreter"
    "$PY_PATH" -c 'import setuptools' >/dev/null 2>&1 || die "setuptools is not installed in $PYTHON's environment (needed to build without build isolation)"
    log "build tools: cmake $CMAKE_VERSION ($HOROVOD_CMAKE), $(g++ --version | head -n 1)"

    TMP_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
    SRC_DIR="$TMP_ROOT/horovod-$HVD_VERSION"

    log "downloading horovod==$HVD_VERSION sdist"
    pip_ download --quiet --no-binary :all: --no-deps "horovod==$HVD_VERSION" -d "$TMP_ROOT/dl"
    SDIST=$(compgen -G "$TMP_ROOT/dl/horovod-$HVD_VERSION.tar.gz" || true)
    [[ -n "$SDIST" ]] || die "sdist horovod-$HVD_VERSION.tar.gz not found after pip download"
    tar xzf "$SDIST" -C "$TMP_ROOT"

    # torch >= 2.1 headers need C++17; horovod 0.28.1 compiles with C++14 (upstream PR #3998, unreleased).
    for f in "$SRC_DIR/CMakeLists.txt" "$SRC_DIR/horovod/torch/CMakeLists.txt"; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || die "patch target not found in $f"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    done
    log "patched CMAKE_CXX_STANDARD 14 -> 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt"

    JOBS=$(nproc 2>/dev/null || echo 2)
    log "building wheel with $JOBS parallel jobs (takes a few minutes)"
    BUILD_START=$(date +%s)
    # /usr/bin first so a PyPI cmake 4.x in the venv is not picked up (it rejects Gloo's
    # cmake_minimum_required); CMAKE_POLICY_VERSION_MINIMUM covers the case where only cmake 4 exists.
    if ! env PATH="/usr/bin:$PATH" \
        HOROVOD_CMAKE="$HOROVOD_CMAKE" \
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$JOBS" \
        "$PY_PATH" -m pip wheel --no-build-isolation --no-deps -w "$TMP_ROOT/wheel" "$SRC_DIR" \
        >"$TMP_ROOT/build.log" 2>&1; then
        tail -n 60 "$TMP_ROOT/build.log" >&2
        die "building the horovod $HVD_VERSION wheel failed (last 60 lines of the build log above)"
    fi
    BUILD_SECONDS=$(( $(date +%s) - BUILD_START ))
    BUILT=$(compgen -G "$TMP_ROOT/wheel/horovod-$HVD_VERSION-*.whl" | head -n 1 || true)
    [[ -n "$BUILT" ]] || die "pip wheel succeeded but produced no horovod wheel"
    log "built $(basename -- "$BUILT") in ${BUILD_SECONDS}s"

    # Atomic publish: copy to a temp name in the cache folder, then rename.
    WHEEL="$CACHE_DIR/$(basename -- "$BUILT")"
    PARTIAL_WHEEL="$CACHE_DIR/.partial-$$-$(basename -- "$BUILT")"
    cp -- "$BUILT" "$PARTIAL_WHEEL"
    mv -f -- "$PARTIAL_WHEEL" "$WHEEL"
    PARTIAL_WHEEL=""
    log "cached wheel at $WHEEL"

    log "installing $(basename -- "$WHEEL")"
    pip_ install --quiet --no-deps --force-reinstall -- "$WHEEL"
fi

# --- verify -----------------------------------------------------------------------
NEW_TORCH_VERSION=$("$PY_PATH" -c 'import importlib.metadata as m; print(m.version("torch"))')
[[ "$NEW_TORCH_VERSION" == "$TORCH_VERSION" ]] \
    || die "torch changed from $TORCH_VERSION to $NEW_TORCH_VERSION during the install; this should not happen"

log "verifying: horovodrun --check-build"
if ! OUT=$(check_build); then
    printf '%s\n' "$OUT"
    die "horovodrun --check-build failed"
fi
printf '%s\n' "$OUT"
check_build_ok "$OUT" \
    || die "horovod installed but check-build does not list [X] PyTorch and [X] Gloo"
log "horovod $HVD_VERSION with PyTorch and Gloo installed for $PY_PATH"
