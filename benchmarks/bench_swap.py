"""Swap on the CPU backend: host-side cost per saved tensor and step time, hyper_parallel vs
torch.autograd.graph.save_on_cpu.

On a machine without an accelerator, hyper_parallel's swap runs with the CPU backend
(``SwapManager().set_cpu_swap(True)``): a saved host tensor's storage is copied into a
host-pool block by a worker thread and its memory released in place, then re-allocated
and copied back for backward. That is real work per tensor (bookkeeping, a copy each
way, an allocation), as on a GPU minus the device. torch's ``save_on_cpu`` does this on
CPU tensors:

* ``pin_memory=True``: ``torch.empty`` + ``copy_`` at pack (pinning is skipped without
  CUDA), the copy returned as is at unpack: one copy, synchronous; the original may be
  freed by autograd. The like-for-like contender.
* ``pin_memory=False``: ``tensor.cpu()`` is the tensor itself on CPU: no copy, no memory
  saved. Shown as the floor: the cost of a Python pack/unpack hook pair alone.

Part 1 (host cost per tensor): a stack of layers, each a chain of ``sin`` ops on small
tensors (each op saves one fresh storage), so the step is dominated by per-tensor work.
cost per tensor = (step time - step time without hooks) / saved tensors, in microseconds,
on the CPU-time clock (all threads of the process: our worker thread's copies count) and
on the wall clock (time the training thread waits). Swap layers are chained with
``set_forward_prefetch_layer``, as a user would.

Part 2 (step time): the Llama-style stack, every layer swapped, vs save_on_cpu around the
whole forward.

Usage: PYTHONPATH=src python benchmarks/bench_swap.py [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

try:
    from _common import (add_llama_args, bench_main, fmt_ratio, interleaved, machine_facts,
                         median, paired_ratio, print_facts, set_threads, table, verdict)
    from _models import LlamaStack
except ImportError:  # pragma: no cover
    from ._common import (add_llama_args, bench_main, fmt_ratio, interleaved, machine_facts,
                          median, paired_ratio, print_facts, set_threads, table, verdict)
    from ._models import LlamaStack


def _sin_layer(n_ops: int):
    def layer(x):
        for _ in range(n_ops):
            x = torch.sin(x)
        return x

    return layer


def _count_saved(run_forward) -> int:
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    out.sum().backward()
    return n[0]


def _memcpy_us(numel: int) -> float:
    src, dst = torch.randn(numel), torch.empty(numel)
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1e6


def _chain(layers) -> None:
    for a, b in zip(layers, layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)


def _unchain(layers) -> None:
    for layer in layers:
        SwapManager().unregister(layer)


class _Offloads:
    """Offloaded tensors per step of a contender, from SwapManager().stats() deltas."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.steps = 0

    def wrap(self, step):
        def run():
            s0 = SwapManager().stats()
            step()
            SwapManager().synchronize()
            s1 = SwapManager().stats()
            self.count += s1["offload_count"] - s0["offload_count"]
            self.bytes += s1["offload_bytes"] - s0["offload_bytes"]
            self.steps += 1

        run.step = step
        return run


def per_tensor(args, numel: int, tensors: int) -> dict:
    """Part 1: host cost per saved tensor."""
    n_ops = tensors // args.layers
    plain = [_sin_layer(n_ops) for _ in range(args.layers)]
    ours = [swap_wrapper(_sin_layer(n_ops)) for _ in range(args.layers)]
    ours_fused = [swap_wrapper(_sin_layer(n_ops), group_swap=True) for _ in range(args.layers)]
    _chain(ours)
    _chain(ours_fused)
    x = torch.randn(numel, requires_grad=True)

    def forward(layers):
        h = x
        for layer in layers:
            h = layer(h)
        return h

    phases: dict = {}  # step -> [(forward cpu s, backward cpu s)] per call

    def step_of(run_forward):
        def step():
            x.grad = None
            c0 = time.process_time()
            out = run_forward()
            c1 = time.process_time()
            out.sum().backward()
            phases.setdefault(step, []).append((c1 - c0, time.process_time() - c1))

        return step

    def with_ctx(ctx_factory, layers):
        def run_forward():
            with ctx_factory():
                return forward(layers)

        return run_forward

    saved = _count_saved(lambda: forward(plain))
    counters = {"ours swap": _Offloads(), "ours swap group_swap": _Offloads()}
    steps = {
        "no hooks": step_of(lambda: forward(plain)),
        "save_on_cpu(pin_memory=False) [no copy]": step_of(
            with_ctx(lambda: save_on_cpu(pin_memory=False), plain)),
        "save_on_cpu(pin_memory=True)": step_of(
            with_ctx(lambda: save_on_cpu(pin_memory=True), plain)),
        "ours swap": counters["ours swap"].wrap(step_of(lambda: forward(ours))),
        "ours swap group_swap": counters["ours swap group_swap"].wrap(
            step_of(lambda: forward(ours_fused))),
    }
    inner = {name: getattr(fn, "step", fn) for name, fn in steps.items()}
    times = interleaved(steps, rounds=args.rounds, warmup=args.warmup)
    base = times["no hooks"]

    def phase_median(name, k):
        return median([p[k] for p in phases[inner[name]][-args.rounds:]])

    cost = {}
    rows = []
    for name, t in times.items():
        cpu_us = (median(t.cpu) - median(base.cpu)) / saved * 1e6
        wall_us = (median(t.wall) - median(base.wall)) / saved * 1e6
        cost[name] = (cpu_us, wall_us)
        c = counters.get(name)
        if c is not None:
            moved = f"{c.count / max(c.steps, 1):.0f}"
        else:
            moved = f"{saved}" if "pin_memory=True" in name else "0"
        fwd_us = (phase_median(name, 0) - phase_median("no hooks", 0)) / saved * 1e6
        bwd_us = (phase_median(name, 1) - phase_median("no hooks", 1)) / saved * 1e6
        rows.append([name, f"{cpu_us:.2f}", f"{wall_us:.2f}", f"{fwd_us:.2f}", f"{bwd_us:.2f}",
                     f"{median(t.cpu) / median(base.cpu):.3f}", moved])
    ref = "save_on_cpu(pin_memory=True)"
    print(table(["contender", "host cost us/tensor (cpu)", "host cost us/tensor (wall)",
                 "of which forward (cpu)", "of which backward (cpu)", "step/no hooks (cpu)",
                 "tensors copied per step"], rows,
                title=f"\n## Swap host cost per saved tensor (CPU backend): {args.layers} "
                      f"layers x {n_ops} sin ops, {saved} saved tensors of {numel * 4} "
                      f"bytes per step"))
    out = {}
    for name in ("ours swap", "ours swap group_swap"):
        r_cpu = cost[name][0] / cost[ref][0]
        r_wall = cost[name][1] / cost[ref][1]
        out[name] = r_cpu
        print(f"target: {name} host cost per tensor < save_on_cpu(pin_memory=True)'s: "
              f"cpu {cost[name][0]:.2f} vs {cost[ref][0]:.2f} us = {r_cpu:.2f}x "
              f"-> {verdict(r_cpu < 1.0)}; wall {cost[name][1]:.2f} vs {cost[ref][1]:.2f} us "
              f"= {r_wall:.2f}x")
    print(f"(floor, a Python identity hook pair: "
          f"{cost['save_on_cpu(pin_memory=False) [no copy]'][0]:.2f} us/tensor cpu; one "
          f"{numel * 4}-byte tensor copy_ on this machine: {_memcpy_us(numel):.2f} us; "
          "save_on_cpu copies once and keeps the copy, ours copies out and back)")
    _unchain(ours)
    _unchain(ours_fused)
    return {"cost_us": cost, "ratio_vs_save_on_cpu": out}


def step_time(args) -> dict:
    """Part 2: Llama-style stack step time, every layer swapped."""
    torch.manual_seed(0)
    model = LlamaStack(args.llama_layers, args.hidden, args.heads, args.kv_heads, args.ffn,
                       args.seq)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    wrapped = [swap_wrapper(layer) for layer in model.layers]
    # A module has one hyper_parallel wrapper at a time: the fused contender wraps copies
    # of the layers (same weights).
    fused = [swap_wrapper(copy.deepcopy(layer), group_swap=True) for layer in model.layers]
    _chain(wrapped)
    _chain(fused)
    params = list(model.parameters()) + [p for w in fused for p in w.parameters()]

    def step_of(call_layer, ctx=None):
        def step():
            for p in params:
                p.grad = None
            x.grad = None
            if ctx is None:
                out = model(x, call_layer)
            else:
                with ctx():
                    out = model(x, call_layer)
            out.float().pow(2).mean().backward()

        return step

    counters = {"ours swap_wrapper": _Offloads(), "ours swap_wrapper group_swap": _Offloads()}
    steps = {
        "none": step_of(None),
        "save_on_cpu(pin_memory=True)": step_of(None, lambda: save_on_cpu(pin_memory=True)),
        "ours swap_wrapper": counters["ours swap_wrapper"].wrap(
            step_of(lambda i, layer, h, c, s: wrapped[i](h, c, s))),
        "ours swap_wrapper group_swap": counters["ours swap_wrapper group_swap"].wrap(
            step_of(lambda i, layer, h, c, s: fused[i](h, c, s))),
    }
    times = interleaved(steps, rounds=args.rounds, warmup=args.warmup)
    ref = "save_on_cpu(pin_memory=True)"
    rows = []
    for name, t in times.items():
        c = counters.get(name)
        rows.append([name, f"{median(t.cpu) / median(times['none'].cpu):.3f}",
                     fmt_ratio(t.cpu, times[ref].cpu), fmt_ratio(t.wall, times[ref].wall),
                     f"{c.bytes / max(c.steps, 1) / 2**20:.2f}" if c else "-"])
    print(table(["contender", "time/none (cpu)", "time/save_on_cpu (cpu) [IQR]",
                 "time/save_on_cpu (wall) [IQR]", "MiB offloaded per step"], rows,
                title=f"\n## Swap step time vs save_on_cpu (CPU backend): Llama-style, "
                      f"{args.llama_layers} layers, d={args.hidden}, batch {args.batch} x "
                      f"seq {args.seq}"))
    out = {}
    for name in ("ours swap_wrapper", "ours swap_wrapper group_swap"):
        r = paired_ratio(times[name].cpu, times[ref].cpu)
        rw = paired_ratio(times[name].wall, times[ref].wall)
        out[name] = r[0]
        print(f"{name} step time / save_on_cpu(pin_memory=True): cpu {r[0]:.3f} "
              f"(IQR {r[1]:.3f}-{r[2]:.3f}), wall {rw[0]:.3f}")
    _unchain(wrapped)
    _unchain(fused)
    return out


def run(args) -> dict:
    manager = SwapManager()
    was = manager.cpu_swap_enabled()
    manager.set_cpu_swap(True)
    try:
        sizes = [int(v) for v in str(args.numel).split(",")]
        counts = [int(v) for v in str(args.tensors).split(",")]
        parts = {f"{n * 4} B": per_tensor(args, n, k) for n, k in zip(sizes, counts)}
        first = parts[f"{sizes[0] * 4} B"]
        return {"per_tensor": first, "per_tensor_by_size": parts, "step": step_time(args)}
    finally:
        manager.synchronize()
        manager.set_cpu_swap(was)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensors", default="2000,400",
                   help="saved tensors per step, one per size (part 1)")
    p.add_argument("--layers", type=int, default=8, help="swap layers (part 1)")
    p.add_argument("--numel", default="256,65536",
                   help="floats per saved tensor, comma-separated sizes (part 1)")
    add_llama_args(p, "--llama-layers", rounds=15)


def main(argv=None) -> None:
    bench_main(__doc__, add_args, run, argv)


if __name__ == "__main__":
    main()
