#!/usr/bin/env bash
# GPU machine check, one command: builds against the installed (CUDA) torch, runs the swap
# and checkpoint suites on the accelerator (HP_TEST_DEVICE=cuda: the real stream backend),
# prints device peak memory with and without swap, then the strategy benchmark (step time,
# device peak, D2H/H2D bandwidth, hidden copy fraction, vs torch's tools; 4 layers, 3
# rounds, to fit a short device lease; run benchmarks/run_gpu.py alone for the full size).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'hyper_parallel: no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
ctest --test-dir "${HP_BUILD_DIR:-build}" --output-on-failure --no-tests=error -j4
HP_TEST_DEVICE=cuda "$PY" -m pytest tests/python/core/activation_checkpoint -q "$@"
"$PY" benchmarks/gpu_swap_memory.py
mkdir -p out
"$PY" benchmarks/run_gpu.py --layers 4 --rounds 3 --json out/gpu_benchmark.json
