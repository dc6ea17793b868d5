#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: a Llama-architecture model trained
# on real text under every activation strategy. Arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# --help needs no build: answer it before setting anything up.
for arg in "$@"; do
  case "$arg" in
    -h|--help) exec "$PY" -m hyper_parallel.demo --help ;;
  esac
done
bash scripts/setup.sh >&2
# With no arguments: the defaults, writing the JSON results and the plot under out/.
if [ "$#" -eq 0 ]; then
  set -- --json out/demo.json --plot out/demo.png --trace out/trace.json
  mkdir -p out
fi
exec "$PY" -m hyper_parallel.demo "$@"
