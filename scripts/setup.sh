#!/usr/bin/env bash
# Sets up everything hyper_parallel needs on a Debian-like machine, unattended and
# idempotently (a second run only re-checks and does an incremental build):
#   1. GoogleTest headers and libraries (apt: libgtest-dev), if missing;
#   2. pinned Python packages (requirements.txt) and torch, if missing;
#   3. the CMake build (C++ core, hyper_parallel._C, GoogleTests) in build/.
# Environment: PYTHON (default python3), HP_BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${HP_BUILD_DIR:-build}

if [ ! -f /usr/include/gtest/gtest.h ]; then
  echo "[setup] installing libgtest-dev (apt)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null
fi

if ! "$PY" scripts/check_requirements.py >/dev/null; then
  echo "[setup] installing Python packages"
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
  fi
  "$PY" -m pip install -q -r requirements.txt
  "$PY" scripts/check_requirements.py
fi

# Ninja and cmake come from pip (requirements.txt); put that bin dir first.
PY_BIN=$("$PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")
export PATH="$PY_BIN:$PATH"

if [ ! -f "$BUILD_DIR/build.ninja" ] || ! grep -q "^HP_BUILD_TESTS:BOOL=ON" "$BUILD_DIR/CMakeCache.txt"; then
  echo "[setup] configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHP_BUILD_TESTS=ON \
        -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
fi
# One build at a time (several shells may share the tree).
exec 9>"$BUILD_DIR/.build.lock"
flock 9
cmake --build "$BUILD_DIR" -j"$(nproc)"
