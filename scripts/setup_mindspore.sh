#!/usr/bin/env bash
# Creates (once) the virtual environment in which the MindSpore backend is tested, and
# prints its Python interpreter on the last line of stdout.
#
# MindSpore lives in its own environment, never beside the main one: it pins numpy < 2
# (with numpy 2 its NumPy-1 extensions fail to import) and brings ~2.8 GB of its own
# libraries. The environment also gets the torch version the C++ extension
# hyper_parallel._C was built against (the MindSpore backend reuses the framework-neutral
# objects of that extension: docs/design.md, "Backends"), and pytest.
#
# Idempotent: a stamp file records what was installed; a second run only checks it.
# Environment:
#   PYTHON                 interpreter the venv is made from (default python3; it must be
#                          the one _C is built for, so the same ABI tag)
#   HP_MINDSPORE_VENV      where the venv lives (default ~/.cache/hyper_parallel/venv-mindspore)
#   HP_MINDSPORE_VERSION   default 2.10.0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MS_VERSION=${HP_MINDSPORE_VERSION:-2.10.0}
VENV=${HP_MINDSPORE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hyper_parallel/venv-mindspore}
TORCH_VERSION=$("$PY" -c "from importlib.metadata import version; print(version('torch').split('+')[0])")
PYTEST_PIN=$(grep -E '^pytest==' requirements.txt)
WANT="mindspore==$MS_VERSION numpy<2 torch==$TORCH_VERSION $PYTEST_PIN python=$("$PY" -c 'import sys; print(sys.version.split()[0])')"
STAMP="$VENV/.hyper_parallel-stamp"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if ! "$PY" -c "import venv, ensurepip" 2>/dev/null; then
  echo "[setup-mindspore] installing python3-venv (apt)" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
echo "[setup-mindspore] creating $VENV ($WANT)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# torch first, from the same index as the main environment (a local CPU wheel on this
# project's machines); then MindSpore with numpy held below 2.
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "$PYTEST_PIN" >&2
"$VENV/bin/python" -m pip install -q "mindspore==$MS_VERSION" "numpy<2" >&2
"$VENV/bin/python" -c "import mindspore, torch, numpy; assert numpy.__version__ < '2'" >&2
echo "$WANT" > "$STAMP"
echo "$VENV/bin/python"
