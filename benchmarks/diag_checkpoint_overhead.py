"""Diagnostic (not a benchmark of record): where the per-region cost of our full
checkpoint goes, by ablation on the tiny Llama-style stack of bench_checkpoint.py.

Variants, interleaved with torch's checkpoint as the reference:

* ``ours``: ``checkpoint(layer, ...)`` as shipped;
* ``no region``: the swap ``Region`` replaced by a null context (no C++ group, no pack
  hook around torch's frame): what remains is the Python glue. (A checkpoint region
  excludes no module state, and a swap region walks it in C++ since issue 17, so there
  is no parameter walk left to ablate.)

It monkeypatches private names of hyper_parallel for the duration of each step, so it
may need updating when those change. Usage:
PYTHONPATH=src python benchmarks/diag_checkpoint_overhead.py [--rounds 31]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.utils.checkpoint as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    interleaved, machine_facts, paired_ratio, print_facts, set_threads, table)
from _models import LlamaStack  # noqa: E402

import hyper_parallel.core.activation_checkpoint._checkpoint as _ck  # noqa: E402
from hyper_parallel.core.activation_checkpoint import checkpoint  # noqa: E402


class _NullRegion:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def attach_backward(self, outputs) -> None:
        pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args(argv)
    set_threads(1)
    print_facts(machine_facts())
    torch.manual_seed(0)
    layers = 8
    model = LlamaStack(layers, 32, 4, 2, 88, 16)
    x = torch.randn(1, 16, 32, requires_grad=True)

    original_region = _ck.Region

    def step_of(call_layer, null_region=False):
        def step():
            if null_region:
                _ck.Region = _NullRegion
            try:
                model(x, call_layer).float().pow(2).mean().backward()
            finally:
                _ck.Region = original_region

        return step

    ours = lambda i, layer, h, c, s: checkpoint(layer, h, c, s)  # noqa: E731
    steps = {
        "torch": step_of(lambda i, layer, h, c, s: tc.checkpoint(layer, h, c, s,
                                                                 use_reentrant=False)),
        "ours": step_of(ours),
        "ours, no region": step_of(ours, null_region=True),
    }
    times = interleaved(steps, rounds=args.rounds, warmup=3)
    rows = []
    for name, t in times.items():
        r, lo, hi = paired_ratio(t.cpu, times["torch"].cpu)
        rows.append([name, f"{r:.3f} [{lo:.3f}-{hi:.3f}]"])
    print(table(["variant", "time/torch (cpu) [IQR]"], rows,
                title=f"\n## Per-region cost of full checkpoint, tiny stack ({layers} regions)"))


if __name__ == "__main__":
    main()
