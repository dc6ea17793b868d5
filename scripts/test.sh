#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs all tests: the GoogleTest suite through CTest and
# the Python suite through pytest. Fails on any failure and when a suite runs no test.
# Extra arguments go to pytest (e.g. -k swap).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${HP_BUILD_DIR:-build}
bash scripts/setup.sh
PY_BIN=$("$PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")
export PATH="$PY_BIN:$PATH"
echo "[test] C++ (ctest)"
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j2
echo "[test] Python (pytest)"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest tests/python "$@"
# The device tests again, on the simulated accelerator (tests/sim): the accelerator copy
# engine, pinned pool and in-place free/refill through PrivateUse1, and the race tests.
echo "[test] Python on the simulated accelerator (HP_TEST_DEVICE=hpsim, -m device)"
HP_TEST_DEVICE=hpsim PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest tests/python -m device "$@"
