"""The planner against hand-picked strategies, and its cost model against measurements.

A transformers Llama (``LlamaForCausalLM``, randomly initialised, ``--layers`` >= 8) is
profiled once per copy-speed ratio by :func:`profile_activation_memory`. On the CPU the
swap engine's CPU backend runs with a per-byte delay set so that one layer's offload takes
``ratio`` x that layer's forward time (ratios 0.5, 1, 2); on an accelerator the link is
the real one (one ratio, "real"). For each budget (20/40/60/80 % of "none"'s measured
peak), the planner's plan (as ``plan_activation_memory`` returns it: solved from one
profile per ratio, run on the model, solved again below the budget while it measures over
it; "solved in" times the solver alone) is applied and measured (peak of saved-activation bytes with
the library's meter over the whole step) and compared with the best hand strategy that
meets the budget, measured the same way: every uniform strategy, "mixed", and
``--random`` random per-layer assignments (seeded). Timing: ``--rounds`` rounds, in each
of which every plan (hand and planner) is applied in turn and runs one warm-up and
``--steps`` timed steps; a plan's step time is the median of all its timed steps, so
drift of a shared machine hits all plans alike. The peak is the library's meter over the
warm-up step; the timed steps run without it, as a user's steps do. On the CPU (Linux) steps are timed, as the
profiler times layers, on the wall clock less the time the training thread waited,
runnable, for a CPU that another process held (``_clock.unpreempted_clock``): on a shared
2-core machine that wait was most of the step-to-step spread. Every measured plan is also predicted by
the cost model (prediction error of peak and step time). The load average is printed
before and after each block. Then the solver alone: the profile's layers tiled to 10, 50,
100 and 200 layers, solved at 40 % of the predicted "none" peak (milliseconds, labels).

Targets (issue 11): planner's measured peak <= budget; its step time <= 1.05 x the best
hand strategy within the budget; prediction errors <= 10 %.

Writes a table (stdout), ``--json`` (default out/bench_planner.json) and ``--png``
(default out/bench_planner.png: predicted vs measured step time; budget vs step time,
planner line against hand-strategy points).

Usage: PYTHONPATH=src python benchmarks/bench_planner.py [--layers 8] [--random 20] [--quick]
       PYTHONPATH=src python benchmarks/bench_planner.py --solve-only   (the solver alone)
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import load_average, machine_facts, mib, print_facts, set_threads, table  # noqa: E402

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    InfeasibleBudgetError,
    SwapManager,
    apply_activation_memory,
    profile_activation_memory,
    remove_activation_memory,
    saved_activation_memory,
)
from hyper_parallel._extension import _C  # noqa: E402
from hyper_parallel.core.activation_checkpoint._planner import (  # noqa: E402
    _cpp_profile, plan_from_profile, predict)
from hyper_parallel.core.activation_checkpoint._clock import (  # noqa: E402
    step_clock, unpreempted_available)
from hyper_parallel.core.activation_checkpoint._profile import (  # noqa: E402
    ActivationProfile,
    CopyLink,
)
from hyper_parallel.demo.model import build_config, build_model  # noqa: E402

UNIFORM = ("none", "checkpoint", "selective", "swap", "selective_swap", "checkpoint_swap")
BUDGETS = (0.2, 0.4, 0.6, 0.8)


def _sync(device):
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_once(model, step, plan, device, steps: int) -> tuple[int, list[float]]:
    """Peak (meter over the whole warm-up step) and the times of ``steps`` steps of
    ``plan`` applied, after that warm-up step (which also warms the host pool up). The
    timed steps run without the meter, as a user's do (it costs about 10 % of this
    model's step on the CPU); the profile's times are scaled to such steps
    (``ActivationProfile.timing_scales``)."""
    manager = SwapManager()
    apply_activation_memory(model, plan)
    try:
        times, peak = [], 0
        clock = step_clock(device)  # what the profile times with
        for i in range(steps + 1):
            # No collection inside a timed step (a full gc.collect() before each, as
            # _common's protocol does, costs 0.3 s with transformers loaded: it doubled
            # the run).
            gc.disable()
            try:
                _sync(device)
                t0 = clock()
                if i == 0:
                    with saved_activation_memory() as meter:
                        step()
                    peak = meter.peak_bytes
                else:
                    step()
                _sync(device)
                manager.synchronize()
                if i > 0:
                    times.append(clock() - t0)
            finally:
                gc.enable()
            for p in model.parameters():
                p.grad = None
        return int(peak), times
    finally:
        remove_activation_memory(model)


def measure_all(model, step, plans: dict, device, steps: int, rounds: int) -> dict:
    """Every plan measured in ``rounds`` interleaved rounds (a seeded shuffle of the plans
    each round): peak (the largest) and the median step time over all timed steps."""
    peaks = {k: 0 for k in plans}
    times = {k: [] for k in plans}
    order = list(plans)
    shuffle = random.Random(1)
    for _ in range(rounds):
        # A new order each round: no plan is always timed at the same phase of a round
        # (the planner's plans used to come last in every round).
        shuffle.shuffle(order)
        for label in order:
            plan = plans[label]
            peak, ts = measure_once(model, step, plan, device, steps)
            peaks[label] = max(peaks[label], peak)
            times[label] += ts
    return {k: {"peak_bytes": peaks[k], "step_seconds": statistics.median(times[k])}
            for k in plans}


def confirm(model, step, plans: dict, device, rounds: int, seed: int) -> dict:
    """Paired rounds over a few plans: in each round every plan (a new seeded order) runs one
    warm-up and one timed step; returns each plan's timed steps, one per round, aligned by
    round, so that a ratio of two plans can be taken round by round (drift slower than a
    round cancels)."""
    times = {k: [] for k in plans}
    order = list(plans)
    shuffle = random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for label in order:
            times[label] += measure_once(model, step, plans[label], device, 1)[1]
    return times


def median_ratio_ci(a: list[float], b: list[float], seed: int, resamples: int = 2000,
                    level: float = 0.9) -> tuple[float, float, float]:
    """The median of the per-round ratios a[i] / b[i] and its percentile-bootstrap
    confidence interval at ``level`` (rounds resampled with replacement; Efron and
    Tibshirani, An Introduction to the Bootstrap, 1993, ch. 13)."""
    rs = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(rs, k=len(rs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return (statistics.median(rs), meds[int(tail * resamples)],
            meds[min(resamples - 1, int((1 - tail) * resamples))])


def solve_times(profile: ActivationProfile, sizes=(10, 50, 100, 200),
                copy_ratio: float | None = None) -> list[dict]:
    """The solver alone on the profile's layers tiled to each size (40 % of the predicted
    none peak, the engine's prefetch depth): milliseconds (best of 3), labels kept, whether
    the search was exact and, when it fell back, its proven gap to the optimum (plan /
    lower bound - 1). ``copy_ratio``: the link slowed (both directions) so that the
    median layer's "swap" offload takes that many times its forward (the saturated case)."""
    out = []
    n0 = len(profile.layer_names)
    d2h, h2d = profile.d2h, profile.h2d
    if copy_ratio is not None:
        fwd = statistics.median(c.forward_seconds for c in profile.costs["none"])
        off = statistics.median(c.offload_bytes for c in profile.costs["swap"][:-1])
        per_byte = copy_ratio * fwd / off
        d2h = CopyLink(d2h.latency_seconds, per_byte)
        h2d = CopyLink(h2d.latency_seconds, per_byte)
    for n in sizes:
        tiled = ActivationProfile(
            layer_names=[f"layers.{i}" for i in range(n)], strategies=profile.strategies,
            costs={s: [c[i % n0] for i in range(n)] for s, c in profile.costs.items()},
            base_bytes=profile.base_bytes, tail_bytes=profile.tail_bytes,
            tail_seconds=profile.tail_seconds, outside_seconds=profile.outside_seconds,
            d2h=d2h, h2d=h2d)
        cpp = _cpp_profile(tiled, SwapManager().get_prefetch_depth())
        none = predict(tiled, ["none"] * n)["peak_bytes"]
        best, found = float("inf"), None
        for _ in range(3):
            t0 = time.perf_counter()
            found = _C.Planner(cpp).solve(int(0.4 * none))
            best = min(best, time.perf_counter() - t0)
        stats = dict(found[2]) if found else {}
        gap = None
        if found and not stats.get("exact", True) and \
                math.isfinite(stats.get("lower_bound_seconds", float("nan"))):
            gap = found[1]["step_seconds"] / stats["lower_bound_seconds"] - 1
        out.append({"layers": n, "options": len(profile.strategies), "ms": best * 1e3,
                    "feasible": found is not None, "gap": gap, **stats})
    return out


def synthetic_profile(n: int, seed: int, copy_ratio: float):
    """A synthetic planner profile shaped like PlannerTest's: ``n`` layers of random sizes
    (4 to 40 MiB) x 6 options (none, checkpoint, selective, swap, selective_swap,
    checkpoint_swap); the link set so that an average layer's swap offload takes
    ``copy_ratio`` x its forward (2.0: the saturated case)."""
    rng = random.Random(seed)
    mi = 1 << 20
    p = _C.PlannerProfile()
    p.options = list(UNIFORM)
    p.base_bytes, p.tail_bytes, p.outside_seconds = 2 * mi, 16 * mi, 0.01
    p.tail_seconds = 0.004 * rng.uniform(0.8, 1.2)
    layers, per_byte = [], 0.0
    for _ in range(n):
        saved = rng.randint(4, 40) * mi
        inputs = max(mi, (saved // 8) // mi * mi)
        matmul = max(mi, (saved // 3) // mi * mi)
        f = 0.01 * rng.uniform(0.8, 1.2)
        b = 2 * f * rng.uniform(0.8, 1.2)
        ck_b, sel_b = b + f * rng.uniform(0.8, 1.2), b + 0.4 * f * rng.uniform(0.8, 1.2)
        C = _C.PlannerOptionCost
        layers.append([C(saved, 0, f, b), C(inputs, 0, f, ck_b), C(inputs + matmul, 0, f, sel_b),
                       C(inputs, saved - inputs, 1.05 * f, 1.02 * b),
                       C(inputs, matmul, f, sel_b), C(0, inputs, f, ck_b)])
        per_byte += copy_ratio * f / (saved - inputs)
    p.layers = layers
    p.set_links(1e-4, per_byte / n, 1e-4, per_byte / n)
    p.prefetch_depth = 1
    return p


def solve_only(sizes=(10, 30, 100), ratios=(0.5, 2.0), fractions=(0.25, 0.5),
               repeats: int = 7) -> list[dict]:
    """The solver alone on synthetic profiles (no model, no torch work): median
    milliseconds of ``repeats`` solves per (layers, copy ratio, budget fraction of the
    all-"none" peak), with whether the plan is exact and its proven gap."""
    rows = []
    for n in sizes:
        for ratio in ratios:
            prof = synthetic_profile(n, 11, ratio)
            none = _C.planner_evaluate(prof, [0] * n)["peak_bytes"]
            planner = _C.Planner(prof)
            for fraction in fractions:
                ts, found = [], None
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    found = planner.solve(int(fraction * none))
                    ts.append(time.perf_counter() - t0)
                stats = dict(found[2]) if found else {}
                gap = None
                if found and math.isfinite(stats.get("lower_bound_seconds", float("nan"))):
                    # (an exact plan has no gap; the bound also holds the traffic term)
                    gap = (0.0 if stats.get("exact") else
                           found[1]["step_seconds"] / stats["lower_bound_seconds"] - 1)
                rows.append({"layers": n, "ratio": ratio, "fraction": fraction,
                             "ms": statistics.median(ts) * 1e3, "gap": gap,
                             "feasible": found is not None, **stats})
    return rows


def _solve_table(sizes: list[dict], title: str) -> str:
    return table(["layers", "options", "solve ms (best of 3)", "labels kept", "widest layer",
                  "exact", "proven gap"],
                 [[r["layers"], r["options"], f"{r['ms']:.2f}", r.get("labels_kept", "-"),
                   r.get("widest_layer", "-"), "yes" if r.get("exact") else "no",
                   "-" if r["gap"] is None else f"{r['gap']:.2%}"] for r in sizes],
                 title=title)


def run(args) -> dict:
    device = torch.device(args.device if args.device != "auto" else (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"))
    set_threads(args.threads)
    print_facts(machine_facts(device.type))
    print("step clock: " + ("wall less the training thread's run-queue wait (schedstat)"
                            if device.type == "cpu" and unpreempted_available()
                            else "wall (perf_counter)"))
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
        load_before = load_average()
        t0 = time.perf_counter()
        profile = profile_activation_memory(model, step)
        profile_seconds = time.perf_counter() - t0
        none_peak = profile.none_peak_bytes
        plans, plan_ms = {}, {}
        for fraction in BUDGETS:
            budget = int(fraction * none_peak)
            t1 = time.perf_counter()
            try:
                profile.plan(budget)  # the solver alone, timed
                plan_ms[fraction] = (time.perf_counter() - t1) * 1e3
                # what plan_activation_memory returns: the plan run on the model, solved
                # again below the budget while it measures over it
                plans[fraction] = plan_from_profile(profile, budget, model=model, step_fn=step)
            except InfeasibleBudgetError as err:
                print(f"budget {fraction:.0%}: infeasible (smallest {mib(err.min_peak_bytes)})")
                plan_ms.setdefault(fraction, (time.perf_counter() - t1) * 1e3)
        everything = {**hand, **{f"planner{f}": p for f, p in plans.items()}}
        all_measured = measure_all(model, step, everything, device, args.steps, args.rounds)
        measured = {label: {**all_measured[label], **_pred(profile, plan, names)}
                    for label, plan in hand.items()}
        load_after = load_average()
        rows, points = [], []
        for fraction in BUDGETS:
            budget = int(fraction * none_peak)
            if fraction not in plans:
                rows.append([f"{fraction:.0%}", mib(budget), "infeasible", "", "", "", "", ""])
                continue
            plan = plans[fraction]
            got = all_measured[f"planner{fraction}"]
            fits = {k: v for k, v in measured.items() if v["peak_bytes"] <= budget}
            best = min(fits, key=lambda k: fits[k]["step_seconds"]) if fits else None
            ratio_best = got["step_seconds"] / fits[best]["step_seconds"] if best else None
            err_peak = plan.predicted_peak_bytes / max(1, got["peak_bytes"]) - 1
            err_time = plan.predicted_step_seconds / got["step_seconds"] - 1
            counts = {}
            for s in plan.strategies.values():
                counts[s] = counts.get(s, 0) + 1
            points.append({"fraction": fraction, "budget_bytes": budget, "plan": plan.strategies,
                           "counts": counts, "measured": got, "plan_ms": plan_ms[fraction],
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
                  f" (solved in {plan_ms[fraction]:.1f} ms)")
        print(table(["budget", "MiB", "planner peak", "<= budget", "planner ms",
                     "best hand (ms)", "planner/best", "pred. err peak / time"], rows,
                    title=f"ratio {ratio}: none peak {mib(none_peak)} MiB, "
                          f"none {measured['none']['step_seconds'] * 1e3:.1f} ms; "
                          f"profiled in {profile_seconds:.1f} s (timing scales "
                          f"{min(profile.timing_scales.values()):.3f}-"
                          f"{max(profile.timing_scales.values()):.3f}); load average "
                          f"{load_before}"
                          f" -> {load_after}"))
        errs_p = [abs(v["predicted_peak_bytes"] / max(1, v["peak_bytes"]) - 1)
                  for v in measured.values()]
        errs_t = [abs(v["predicted_step_seconds"] / v["step_seconds"] - 1)
                  for v in measured.values()]
        print(f"hand plans ({len(measured)}): prediction error |peak| median "
              f"{statistics.median(errs_p):.1%} max {max(errs_p):.1%}; |step time| median "
              f"{statistics.median(errs_t):.1%} max {max(errs_t):.1%}")
        # The noise floor: the same uniform plans, timed once while profiling and again
        # here; a prediction cannot be closer than two measurements of one plan.
        again = [abs(profile.measured[s]["step_seconds"] / measured[s]["step_seconds"] - 1)
                 for s in profile.strategies if s in measured]
        print(f"noise floor: the {len(again)} uniform plans timed while profiling vs here: "
              f"|difference| median {statistics.median(again):.1%} max {max(again):.1%}")
        confirmed = _confirm_block(model, step, device, args, hand, measured, plans, points,
                                   profile, names)
        results["ratios"][str(ratio)] = {"profile_seconds": profile_seconds,
                                         "timing_scales": profile.timing_scales,
                                         "none_peak_bytes": none_peak, "hand": measured,
                                         "planner": points, "load_before": load_before,
                                         "noise_floor": again,
                                         "load_after": load_after, "confirmed": confirmed}
        last_profile = profile
    sizes = solve_times(last_profile)
    print(_solve_table(sizes, "solver alone: the last profile's layers tiled, budget 40 % of none"))
    saturated = solve_times(last_profile, copy_ratio=2.0)
    print(_solve_table(saturated, "the same with the link slowed to 2x a forward per offload "
                                  "(saturated)"))
    results["solve_times"] = sizes
    results["solve_times_saturated"] = saturated
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")
    _plot(results, args.png)
    print(f"wrote {args.png}")
    return results


def _confirm_block(model, step, device, args, hand, measured, plans, points, profile,
                   names) -> list[dict]:
    """The paired confirmation of one ratio (``--confirm`` rounds; 0: none). Picking the
    best of many hand plans by one noisy measurement each favours the one measured
    luckiest (the winner's curse), and the profile was timed a minute before: so for each
    budget the planner's plan, the ``--confirm-hands`` fastest hand plans within the budget
    (by the rounds above) and "none" are timed again, side by side in paired rounds.
    Reported per budget: the median per-round ratio planner / hand against the hand plan
    it compares worst with, with its 90 % bootstrap interval; the step-time prediction
    error against the median of these steps; and the same error taken relative to "none"
    in the same rounds (predicted plan / none over the median per-round measured plan /
    none), which the machine's drift between the profile and now does not move."""
    if args.confirm <= 0:
        return []
    out, rows = [], []
    pred_none = _pred(profile, "none", names)["predicted_step_seconds"]
    for point in points:
        fraction, budget = point["fraction"], point["budget_bytes"]
        fits = sorted((k for k, v in measured.items() if v["peak_bytes"] <= budget),
                      key=lambda k: measured[k]["step_seconds"])[:args.confirm_hands]
        if not fits:
            continue
        group = {"planner": plans[fraction], "none": "none",
                 **{k: hand[k] for k in fits if k != "none"}}
        times = confirm(model, step, group, device, args.confirm, seed=int(fraction * 100))
        vs = {k: median_ratio_ci(times["planner"], times[k], seed=1) for k in fits}
        worst = max(vs, key=lambda k: vs[k][0])
        med, lo, hi = vs[worst]
        got = statistics.median(times["planner"])
        err = point["predicted_step_seconds"] / got - 1
        rel_meas = statistics.median(p / n for p, n in zip(times["planner"], times["none"]))
        rel_err = point["predicted_step_seconds"] / pred_none / rel_meas - 1
        out.append({"fraction": fraction, "hands": fits, "times": times, "worst_hand": worst,
                    "vs_hand": {k: list(v) for k, v in vs.items()},
                    "planner_step_seconds": got, "time_error": err,
                    "time_error_vs_none": rel_err})
        rows.append([f"{fraction:.0%}", ", ".join(fits), worst,
                     f"{point['vs_best']:.3f}", f"{med:.3f} [{lo:.3f}, {hi:.3f}]",
                     f"{got * 1e3:.1f}", f"{err:+.1%}", f"{rel_err:+.1%}"])
    print(table(["budget", "hand plans re-timed", "worst for planner", "planner/best (screening)",
                 "planner/hand paired [90% CI]", "planner ms", "pred. err time",
                 "pred. err time / none"], rows,
                title=f"paired confirmation: {args.confirm} rounds of 1 warm-up + 1 timed step "
                      f"per plan; load average {load_average()}"))
    return out


def _pred(profile, plan, names) -> dict:
    if plan == "mixed":
        plan = ["checkpoint" if i % 2 == 0 else "swap" for i in range(len(names))]
    elif isinstance(plan, str):
        plan = [plan] * len(names)
    # Hand plans run at the engine's offload window (default 2), the planner's at 0; the
    # cost model predicts each at its own (predict's default is the engine's window).
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
    p.add_argument("--steps", type=int, default=2, help="timed steps per plan and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all plans")
    p.add_argument("--random", type=int, default=20, help="random per-layer assignments")
    p.add_argument("--confirm", type=int, default=24,
                   help="paired confirmation rounds per budget (0: skip; see _confirm_block)")
    p.add_argument("--confirm-hands", type=int, default=2,
                   help="fastest hand plans within the budget re-timed in the confirmation")
    p.add_argument("--quick", action="store_true",
                   help="6 random assignments, 2 rounds, 8 confirmation rounds (a smoke run, "
                        "a few minutes)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="out/bench_planner.json")
    p.add_argument("--png", default="out/bench_planner.png")
    p.add_argument("--solve-only", action="store_true",
                   help="only the solver on synthetic profiles (10/30/100 layers, copies at "
                        "0.5x and 2x a forward): median ms, exact, proven gap")
    args = p.parse_args(argv)
    if args.solve_only:
        print(f"load average before: {load_average()}")
        rows = solve_only()
        print(table(["layers", "copy / forward", "budget / none", "solve ms (median of 7)",
                     "labels kept", "exact", "proven gap"],
                    [[r["layers"], r["ratio"], r["fraction"], f"{r['ms']:.1f}",
                      r.get("labels_kept", "-"), "yes" if r.get("exact") else "no",
                      "-" if r["gap"] is None else f"{r['gap']:.2%}"] for r in rows],
                    title="solver alone, synthetic profiles (6 options, 4-40 MiB layers)"))
        print(f"load average after: {load_average()}")
        return rows
    if args.quick:
        args.random, args.rounds, args.confirm = 6, 2, min(args.confirm, 8)
    if args.layers < 8:
        p.error("--layers must be >= 8 (issue 11's benchmark shape)")
    run(args)


if __name__ == "__main__":
    main()
