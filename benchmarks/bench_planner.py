"""The planner against hand-picked strategies, and its cost model against measurements.

A transformers Llama (``LlamaForCausalLM``, randomly initialised, ``--layers`` >= 8) is
profiled once per copy-speed ratio by :func:`profile_activation_memory`. On the CPU the
swap engine's CPU backend runs with a per-byte delay set so that one layer's offload takes
``ratio`` x that layer's forward time (ratios 0.5, 1, 2); on an accelerator the link is
the real one (one ratio, "real"). For each budget (20/40/60/80 % of "none"'s measured
peak), the planner's plan is applied and measured (peak of saved-activation bytes with
the library's meter over the whole step; median step time of ``--steps``) and compared
with the best hand strategy that meets the budget, measured the same way: every uniform
strategy, "mixed", and ``--random`` random per-layer assignments (seeded). Every measured
plan is also predicted by the cost model (prediction error of peak and step time).

Targets (issue 11): planner's measured peak <= budget; its step time <= 1.05 x the best
hand strategy within the budget; prediction errors <= 10 %.

Writes a table (stdout), ``--json`` (default out/bench_planner.json) and ``--png``
(default out/bench_planner.png: predicted vs measured step time; budget vs step time,
planner line against hand-strategy points).

Usage: PYTHONPATH=src python benchmarks/bench_planner.py [--layers 8] [--random 20]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_facts, mib, print_facts, set_threads, table  # noqa: E402

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    InfeasibleBudgetError,
    SwapManager,
    apply_activation_memory,
    profile_activation_memory,
    remove_activation_memory,
    saved_activation_memory,
)
from hyper_parallel.core.activation_checkpoint._planner import predict  # noqa: E402
from hyper_parallel.demo.model import build_config, build_model  # noqa: E402

UNIFORM = ("none", "checkpoint", "selective", "swap", "selective_swap", "checkpoint_swap")
BUDGETS = (0.2, 0.4, 0.6, 0.8)


def _sync(device):
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure(model, step, plan, device, steps: int) -> dict:
    """Peak (meter over the whole step) and median step time of ``plan`` applied."""
    manager = SwapManager()
    apply_activation_memory(model, plan)
    try:
        times, peak = [], 0
        for i in range(steps + 1):
            _sync(device)
            t0 = time.perf_counter()
            with saved_activation_memory() as meter:
                step()
            _sync(device)
            manager.synchronize()
            if i > 0:  # the first step warms the host pool up
                times.append(time.perf_counter() - t0)
            peak = max(peak, meter.peak_bytes)
            for p in model.parameters():
                p.grad = None
        return {"peak_bytes": int(peak), "step_seconds": statistics.median(times)}
    finally:
        remove_activation_memory(model)


def run(args) -> dict:
    device = torch.device(args.device if args.device != "auto" else (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"))
    set_threads(args.threads)
    print_facts(machine_facts(device.type))
    config = build_config(layers=args.layers, hidden=args.hidden, heads=args.heads,
                          seq_len=args.seq, attn="eager")
    model = build_model(config, seed=0).to(device)
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen).to(device)

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()

    manager = SwapManager()
    names = [f"model.layers.{i}" for i in range(args.layers)]
    rng = random.Random(0)
    hand = {s: s for s in UNIFORM}
    hand["mixed"] = "mixed"
    for i in range(args.random):
        hand[f"random{i}"] = {n: rng.choice(UNIFORM) for n in names}

    on_cpu = device.type == "cpu"
    ratios = args.ratios if on_cpu else ["real"]
    if on_cpu:
        manager.set_cpu_swap(True, delay_ns_per_byte=0.0)
        base = profile_activation_memory(model, step, candidates=["none", "swap"])
        fwd = statistics.median(c.forward_seconds for c in base.costs["none"])
        off = statistics.median(c.offload_bytes for c in base.costs["swap"][:-1])
        print(f"layer forward {fwd * 1e3:.2f} ms, offload {mib(off)} MiB per layer (median)")
    results = {"facts": machine_facts(device.type), "args": vars(args), "ratios": {}}
    for ratio in ratios:
        if on_cpu:
            delay = float(ratio) * fwd / off * 1e9
            manager.set_cpu_swap(True, delay_ns_per_byte=delay)
            print(f"\n== ratio {ratio}: CPU swap delay {delay:.3f} ns/byte")
        else:
            print("\n== real copy link")
        t0 = time.perf_counter()
        profile = profile_activation_memory(model, step)
        profile_seconds = time.perf_counter() - t0
        none_peak = profile.none_peak_bytes
        measured = {}
        for label, plan in hand.items():
            measured[label] = {**measure(model, step, plan, device, args.steps),
                               **_pred(profile, plan, names)}
        rows, points = [], []
        for fraction in BUDGETS:
            budget = int(fraction * none_peak)
            t1 = time.perf_counter()
            try:
                plan = profile.plan(budget)
            except InfeasibleBudgetError as err:
                print(f"budget {fraction:.0%}: infeasible (smallest {mib(err.min_peak_bytes)})")
                rows.append([f"{fraction:.0%}", mib(budget), "infeasible", "", "", "", "", ""])
                continue
            plan_ms = (time.perf_counter() - t1) * 1e3
            got = measure(model, step, plan, device, args.steps)
            fits = {k: v for k, v in measured.items() if v["peak_bytes"] <= budget}
            best = min(fits, key=lambda k: fits[k]["step_seconds"]) if fits else None
            ratio_best = got["step_seconds"] / fits[best]["step_seconds"] if best else None
            err_peak = plan.predicted_peak_bytes / max(1, got["peak_bytes"]) - 1
            err_time = plan.predicted_step_seconds / got["step_seconds"] - 1
            counts = {}
            for s in plan.strategies.values():
                counts[s] = counts.get(s, 0) + 1
            points.append({"fraction": fraction, "budget_bytes": budget, "plan": plan.strategies,
                           "counts": counts, "measured": got, "plan_ms": plan_ms,
                           "predicted_peak_bytes": plan.predicted_peak_bytes,
                           "predicted_step_seconds": plan.predicted_step_seconds,
                           "best_hand": best,
                           "best_hand_step_seconds": fits[best]["step_seconds"] if best else None,
                           "vs_best": ratio_best, "peak_error": err_peak,
                           "time_error": err_time})
            rows.append([f"{fraction:.0%}", mib(budget), mib(got["peak_bytes"]),
                         "yes" if got["peak_bytes"] <= budget else "NO",
                         f"{got['step_seconds'] * 1e3:.1f}",
                         f"{best} {fits[best]['step_seconds'] * 1e3:.1f}" if best else "none fits",
                         f"{ratio_best:.3f}" if ratio_best else "-",
                         f"{err_peak:+.1%} / {err_time:+.1%}"])
            print(f"budget {fraction:.0%}: {', '.join(f'{n} {s}' for s, n in counts.items())}"
                  f" (solved in {plan_ms:.1f} ms)")
        print(table(["budget", "MiB", "planner peak", "<= budget", "planner ms",
                     "best hand (ms)", "planner/best", "pred. err peak / time"], rows,
                    title=f"ratio {ratio}: none peak {mib(none_peak)} MiB, "
                          f"none {measured['none']['step_seconds'] * 1e3:.1f} ms; "
                          f"profiled in {profile_seconds:.1f} s"))
        errs_p = [abs(v["predicted_peak_bytes"] / max(1, v["peak_bytes"]) - 1)
                  for v in measured.values()]
        errs_t = [abs(v["predicted_step_seconds"] / v["step_seconds"] - 1)
                  for v in measured.values()]
        print(f"hand plans ({len(measured)}): prediction error |peak| median "
              f"{statistics.median(errs_p):.1%} max {max(errs_p):.1%}; |step time| median "
              f"{statistics.median(errs_t):.1%} max {max(errs_t):.1%}")
        results["ratios"][str(ratio)] = {"profile_seconds": profile_seconds,
                                         "none_peak_bytes": none_peak, "hand": measured,
                                         "planner": points}
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")
    _plot(results, args.png)
    print(f"wrote {args.png}")
    return results


def _pred(profile, plan, names) -> dict:
    if plan == "mixed":
        plan = ["checkpoint" if i % 2 == 0 else "swap" for i in range(len(names))]
    elif isinstance(plan, str):
        plan = [plan] * len(names)
    p = predict(profile, plan)
    return {"predicted_peak_bytes": p["peak_bytes"], "predicted_step_seconds": p["step_seconds"]}


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = results["ratios"]
    fig, axes = plt.subplots(1, 1 + len(ratios), figsize=(5 * (1 + len(ratios)), 4.2))
    ax = axes[0]
    for ratio, r in ratios.items():
        xs = [v["step_seconds"] * 1e3 for v in r["hand"].values()] + \
             [p["measured"]["step_seconds"] * 1e3 for p in r["planner"]]
        ys = [v["predicted_step_seconds"] * 1e3 for v in r["hand"].values()] + \
             [p["predicted_step_seconds"] * 1e3 for p in r["planner"]]
        ax.scatter(xs, ys, s=12, label=f"ratio {ratio}")
    lim = ax.get_xlim()
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("cost model: predicted vs measured")
    ax.legend(fontsize=7)
    for ax, (ratio, r) in zip(axes[1:], ratios.items()):
        none = r["none_peak_bytes"]
        ax.scatter([v["peak_bytes"] / none for v in r["hand"].values()],
                   [v["step_seconds"] * 1e3 for v in r["hand"].values()], s=12, c="gray",
                   label="hand strategies (measured peak)")
        pts = r["planner"]
        ax.plot([p["fraction"] for p in pts], [p["measured"]["step_seconds"] * 1e3 for p in pts],
                "o-", c="C3", label="planner (at its budget)")
        ax.set_xlabel("peak / none's peak (budget for the planner)")
        ax.set_ylabel("step (ms)")
        ax.set_title(f"offload / forward = {ratio}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measured plan")
    p.add_argument("--random", type=int, default=20, help="random per-layer assignments")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="out/bench_planner.json")
    p.add_argument("--png", default="out/bench_planner.png")
    args = p.parse_args(argv)
    if args.layers < 8:
        p.error("--layers must be >= 8 (issue 11's benchmark shape)")
    run(args)


if __name__ == "__main__":
    main()
