#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs all tests: the GoogleTest suite through CTest, the
# Python suite through pytest (again on the simulated accelerator for the device tests), and the MindSpore backend's suite (tests/mindspore) in its
# own virtual environment (scripts/setup_mindspore.sh: created once, then cached). Fails on
# any failure and when a suite runs no test.
# Extra arguments go to the torch pytest run (e.g. -k swap); the MindSpore suite then runs
# only with HP_MINDSPORE=1. HP_MINDSPORE=0 skips it always.
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

MS_DEFAULT=1
if [ "$#" -gt 0 ]; then MS_DEFAULT=0; fi
if [ "${HP_MINDSPORE:-$MS_DEFAULT}" = 1 ]; then
  echo "[test] MindSpore backend (pytest, own venv)"
  MS_PY=$(bash scripts/setup_mindspore.sh | tail -n 1)
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$MS_PY" -m pytest tests/mindspore -q \
    -p no:cacheprovider
fi
