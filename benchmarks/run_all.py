"""All CPU benchmarks in one run: full checkpoint, selective checkpoint and swap, each
against PyTorch's own tool on the same model and inputs, printed as ratios, then a summary
of where we stand against each target.

    PYTHONPATH=src python benchmarks/run_all.py            # about 2-3 minutes on 2 cores
    PYTHONPATH=src python benchmarks/run_all.py --quick    # fewer rounds, under a minute

The GPU benchmark is separate: ``python benchmarks/run_gpu.py`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_checkpoint  # noqa: E402
import bench_selective  # noqa: E402
import bench_swap  # noqa: E402
from _common import (  # noqa: E402
    load_average, machine_facts, print_facts, set_threads, table, verdict)


def _sub_args(module, rounds: int | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_args(p)
    args = p.parse_args([])
    if rounds is not None:
        args.rounds = rounds
    return args


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="7 rounds per benchmark")
    p.add_argument("--rounds", type=int, default=None, help="rounds for every benchmark")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: "
                   "the copy worker of the CPU swap backend gets the other core)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    rounds = 7 if args.quick else args.rounds
    set_threads(args.threads)
    t0 = time.perf_counter()
    print("# hyper_parallel CPU benchmarks (ratios; 'cpu' = process CPU time, 'wall' = "
          "elapsed; medians of interleaved rounds, [IQR] of per-round ratios)")
    facts = machine_facts()
    print_facts(facts)

    ck = bench_checkpoint.run(_sub_args(bench_checkpoint, rounds))
    sel = bench_selective.run(_sub_args(bench_selective, rounds))
    sw = bench_swap.run(_sub_args(bench_swap, rounds))

    fit = sel["fit"]
    fit_ratio = fit["ours declarative"]["vs_none"]["b_us"] / fit["torch SAC"]["vs_none"]["b_us"]
    llama = ck["llama"]["time_ratio"]
    tiny = ck["tiny (per-region overhead)"]["time_ratio"]
    rows = [
        ["full checkpoint: step time <= 1.02 x torch (Llama-style)",
         f"checkpoint() {llama['ours checkpoint()']:.3f}, wrapper "
         f"{llama['ours checkpoint_wrapper']:.3f}",
         verdict(max(llama.values()) <= bench_checkpoint.TARGET)],
        ["full checkpoint: same, tiny layers (per-region cost)",
         f"checkpoint() {tiny['ours checkpoint()']:.3f}, wrapper "
         f"{tiny['ours checkpoint_wrapper']:.3f}",
         verdict(max(tiny.values()) <= bench_checkpoint.TARGET)],
        ["full checkpoint: peak saved bytes = torch's",
         f"{ck['llama']['saved_ratio']['ours checkpoint_wrapper']:.3f}",
         verdict(abs(ck["llama"]["saved_ratio"]["ours checkpoint_wrapper"] - 1) < 1e-9)],
        ["selective: per-op overhead <= torch SAC's (policy_fn)",
         f"{sel['per_op_ratio']['ours policy_fn']:.3f} x",
         verdict(sel["per_op_ratio"]["ours policy_fn"] <= 1.0)],
        ["selective: declarative per-op overhead <= 0.6 x torch SAC's",
         f"{sel['per_op_ratio']['ours declarative']:.3f} x",
         verdict(sel["per_op_ratio"]["ours declarative"] <= 0.6)],
        ["selective: declarative b of a + b*k vs none, / torch SAC's (<= 0.6 x)",
         f"{fit_ratio:.3f} x", verdict(fit_ratio <= 0.6)],
        ["selective: step time vs torch SAC ('save mm')",
         f"policy_fn {sel['step_ratio']['ours policy_fn']:.3f}, declarative "
         f"{sel['step_ratio']['ours declarative']:.3f}",
         verdict(max(sel["step_ratio"].values()) <= 1.0)],
    ]
    for size, part in sw["per_tensor_by_size"].items():
        r = part["ratio_vs_save_on_cpu"]
        rows.append([f"swap: host cost per tensor < save_on_cpu's ({size} tensors)",
                     f"{r['ours swap']:.2f} x (group_swap {r['ours swap group_swap']:.2f} x)",
                     verdict(r["ours swap"] < 1.0)])
    rows += [
        ["swap: step time vs save_on_cpu (Llama-style, info)",
         f"{sw['step']['ours swap_wrapper']:.3f}", "-"],
    ]
    print(table(["target", "measured (cpu clock)", "verdict"], rows, title="\n## Summary"))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at the end: {load_average()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "checkpoint": ck, "selective": sel, "swap": sw}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
