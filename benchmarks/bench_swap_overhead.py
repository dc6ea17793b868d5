"""Host overhead of a swap region per layer, fitted as a + b*k for k saved tensors per layer,
hyper_parallel's swap vs torch.autograd.graph.save_on_cpu, on the training thread's clock.

A stack of `--layers` layers; layer = ``x * 1.0`` (saves nothing) followed by k ``sin`` ops
on a small tensor (each saves one fresh storage), so k = 0 is a region with nothing
eligible (its fixed cost alone) and each added op adds one saved tensor. Contenders, every
one per layer (one region, or one hook context, per layer):

* ``none``: the plain layer.
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` entered around each
  layer (on a CPU-only machine: ``torch.empty`` + ``copy_`` at pack, the copy returned at
  unpack).
* ``ours swap``: ``swap_wrapper`` layers chained with ``set_forward_prefetch_layer``, CPU swap
  backend (a worker thread copies each storage out and back).

Clocks: ``main`` is ``time.thread_time()`` of the thread running the steps (what a
training loop pays); ``worker`` is the CPU time of every other thread of the process over
the same steps (our copy workers), from ``/proc/self/task/*/schedstat``. overhead per
layer = (step time - none's) / layers, in microseconds; the fit is least squares over the
k values. Timing: interleaved rounds, order rotated per round, each round `--steps` steps
per contender; the garbage collector runs as it would in training (never forced, never
disabled) for every contender alike. 1 torch thread.

Also printed, from SwapManager().stats(): copy-worker wake-ups and release points per
step (target: at most one wake-up per release point, none when nothing was queued).

``--modules`` makes every layer an ``nn.Module`` (one parameter, one buffer) for every
contender: the path of a real model's blocks (module wrapper, state exclusion).

``--instructions`` counts instructions instead (callgrind, every thread of the process,
one child process per contender and k): the same fits and ratio as counts that neither the
machine's load nor its clock speed moves. On a shared machine whose step times swing by
1.5x between runs this is the figure that repeats; it does not see cache misses or stalls,
which the timed mode does.

Usage: PYTHONPATH=src python benchmarks/bench_swap_overhead.py [--rounds 15] [--quick]
       [--modules] [--instructions]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch.autograd.graph import save_on_cpu

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

try:
    from _common import bench_main, median, table
except ImportError:  # pragma: no cover
    from ._common import bench_main, median, table


def _layer(k: int):
    def layer(x):
        x = x * 1.0
        for _ in range(k):
            x = torch.sin(x)
        return x

    return layer


class _Block(torch.nn.Module):
    """The same layer as an nn.Module with a parameter and a buffer (``--modules``): what
    a model's blocks are, so the region also excludes the module's state."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.unused = torch.nn.Parameter(torch.zeros(1))
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        x = x * 1.0
        for _ in range(self.k):
            x = torch.sin(x)
        return x


def other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the calling one (Linux schedstat)."""
    me = threading.get_native_id()
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    return total * 1e-9


def fit_line(ks, ys) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b*k."""
    n = len(ks)
    mk, my = sum(ks) / n, sum(ys) / n
    sxx = sum((k - mk) ** 2 for k in ks)
    b = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sxx
    return my - b * mk, b


def build(args, k: int):
    """The contenders at k saved tensors per layer, as zero-argument step functions, and a
    function that unregisters the swap layers."""
    make = _Block if args.modules else _layer
    plain = [make(k) for _ in range(args.layers)]
    ours = [swap_wrapper(make(k)) for _ in range(args.layers)]
    for a, b in zip(ours, ours[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    x = torch.randn(args.numel, requires_grad=True)

    def none():
        h = x
        for layer in plain:
            h = layer(h)
        h.sum().backward()

    def soc():
        h = x
        for layer in plain:
            with save_on_cpu(pin_memory=True):
                h = layer(h)
        h.sum().backward()

    def swap():
        h = x
        for layer in ours:
            h = layer(h)
        h.sum().backward()

    def close():
        for layer in ours:
            SwapManager().unregister(layer)

    return {"none": none, "save_on_cpu": soc, "ours swap": swap}, close


def measure(args, k: int) -> dict:
    """Per-step medians (main s, worker s, wall s) of each contender at k tensors/layer."""
    contenders, close = build(args, k)
    names = list(contenders)
    per = {n: {"main": [], "worker": [], "wall": []} for n in names}
    for fn in contenders.values():
        for _ in range(args.warmup_steps):
            fn()
    SwapManager().synchronize()
    s0 = SwapManager().stats()
    swap_steps = 0
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = contenders[name]
            w0, m0, t0 = other_threads_cpu_s(), time.thread_time(), time.perf_counter()
            for _ in range(args.steps):
                fn()
            m1, t1 = time.thread_time(), time.perf_counter()
            if name == "ours swap":
                SwapManager().synchronize()  # the worker's share of these steps, all of it
                swap_steps += args.steps
            w1 = other_threads_cpu_s()
            per[name]["main"].append((m1 - m0) / args.steps)
            per[name]["wall"].append((t1 - t0) / args.steps)
            per[name]["worker"].append((w1 - w0) / args.steps)
    s1 = SwapManager().stats()
    close()
    out = {n: {c: median(v) for c, v in per[n].items()} for n in names}
    for key, name in (("worker_wakeups", "wakeups"), ("release_points", "release_points")):
        # (an older build without these counters reports -1)
        out["ours swap"][name] = ((s1.get(key, -swap_steps) - s0.get(key, 0)) / swap_steps)
    return out


# The instruction count of the steps alone: the child runs uninstrumented (fast) until the
# steps, then switches callgrind's instrumentation and collection on and off around them
# with valgrind's client requests (CALLGRIND_START_INSTRUMENTATION and friends, from
# <valgrind/callgrind.h>, in a tiny library built with the system C compiler).
_CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no"]
_TOGGLE_C = """#include <valgrind/callgrind.h>
void hp_count_begin(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION;
                            CALLGRIND_TOGGLE_COLLECT; }
void hp_count_end(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS;
                          CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _build_toggle(tmp: str) -> str:
    """Builds the client-request library in `tmp`; its path."""
    src, lib = os.path.join(tmp, "toggle.c"), os.path.join(tmp, "libtoggle.so")
    with open(src, "w") as f:
        f.write(_TOGGLE_C)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    done = subprocess.run([cc or "cc", "-O1", "-shared", "-fPIC", src, "-o", lib],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit("bench_swap_overhead: --instructions builds a 3-line C library with "
                         "valgrind's <valgrind/callgrind.h> (Debian: apt-get install valgrind "
                         f"gcc); the compiler said:\n{done.stderr[-1000:]}")
    return lib


def count_child(args) -> None:
    """In a callgrind child: warm up one contender, then count `--steps` steps of it and one
    SwapManager().synchronize() (the copy worker's share)."""
    import ctypes

    toggle = ctypes.CDLL(args.count_lib)
    manager = SwapManager()
    manager.set_cpu_swap(True)
    contenders, close = build(args, int(args.ks))
    fn = contenders[args.count_child]
    for _ in range(args.warmup_steps):
        fn()
    manager.synchronize()
    toggle.hp_count_begin()
    for _ in range(args.steps):
        fn()
    manager.synchronize()
    toggle.hp_count_end()
    close()


# Events read from a callgrind dump: instructions, and with --cache-sim its simulated
# first-level instruction and data read misses and mispredicted conditional and indirect
# branches (callgrind's I1mr, D1mr, Bcm, Bim).
_EVENTS = ("Ir", "I1mr", "D1mr", "Bcm", "Bim")


def _instructions(args, lib: str, name: str, k: int) -> dict:
    """Events (all threads) of `args.steps` steps of contender `name` at k: {"Ir": n, ...},
    the miss and mispredict counts too with --cache-sim."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        sim = ["--cache-sim=yes", "--branch-sim=yes"] if args.cache_sim else []
        cmd = _CALLGRIND + sim + [f"--callgrind-out-file={out}", sys.executable,
                            os.path.abspath(__file__), "--count-child", name, "--count-lib",
                            lib, "--ks", str(k),
                            "--steps", str(args.steps), "--warmup-steps",
                            str(args.warmup_steps), "--layers", str(args.layers), "--numel",
                            str(args.numel), "--threads", str(args.threads)]
        if args.modules:
            cmd.append("--modules")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"bench_swap_overhead: the callgrind child for {name} at k = {k} "
                               f"failed:\n{done.stderr[-2000:]}")
        totals: dict = {}
        for part in os.listdir(tmp):  # the dump of the counted steps: callgrind.out.1
            if part.startswith("callgrind.out.") and part.rsplit(".", 1)[1].isdigit():
                with open(os.path.join(tmp, part)) as f:
                    names: list = []
                    for line in f:
                        if line.startswith("events:"):
                            names = line.split()[1:]
                        elif line.startswith("summary:") and names:
                            values = dict(zip(names, (int(v) for v in line.split()[1:])))
                            if values.get("Ir", 0) > totals.get("Ir", 0):
                                totals = values
    if totals.get("Ir", 0) == 0:
        raise RuntimeError("bench_swap_overhead: callgrind counted nothing (were the client "
                           "requests seen?); use the timed mode.")
    return {e: totals[e] for e in _EVENTS if e in totals}


def run_instructions(args) -> dict:
    """Instructions per layer over none's, per contender and k (callgrind, one child process
    per contender and k, two at a time): a count that the machine's load does not move."""
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_swap_overhead: --instructions needs valgrind "
                         "(apt-get install valgrind).")
    ks = [int(v) for v in args.ks.split(",")]
    names = ["none", "save_on_cpu", "ours swap"]
    jobs = [(n, k) for k in ks for n in names]
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        lib = _build_toggle(tmp)
        events = dict(zip(jobs, pool.map(lambda j: _instructions(args, lib, *j), jobs)))
    counts = {j: e["Ir"] for j, e in events.items()}
    per_layer = {(n, k): (counts[(n, k)] - counts[("none", k)]) / (args.steps * args.layers)
                 for n, k in jobs}
    rows = [[k, f"{counts[('none', k)] / args.steps / 1e3:.0f}",
             f"{per_layer[('save_on_cpu', k)] / 1e3:.2f}",
             f"{per_layer[('ours swap', k)] / 1e3:.2f}",
             f"{per_layer[('ours swap', k)] / per_layer[('save_on_cpu', k)]:.2f}"] for k in ks]
    print(table(["k tensors/layer", "none k-instructions/step", "save_on_cpu k-instr/layer",
                 "ours k-instr/layer", "ours / save_on_cpu"], rows,
                title=f"\n## Swap host overhead per layer in instructions (callgrind, all "
                      f"threads): {args.layers} {'module' if args.modules else 'function'} "
                      f"layers, {args.numel * 4}-byte tensors, {args.steps} steps each"))
    fits = {}
    for name in ("save_on_cpu", "ours swap"):
        a, b = fit_line(ks, [per_layer[(name, k)] for k in ks])
        fits[name] = (a, b)
        print(f"fit {name}: a = {a / 1e3:.2f}k instructions fixed + b = {b / 1e3:.2f}k per "
              f"tensor")
    k2 = 2 if 2 in ks else ks[len(ks) // 2]
    ratio = per_layer[("ours swap", k2)] / per_layer[("save_on_cpu", k2)]
    print(f"ours / save_on_cpu host instructions at {k2} tensors per layer: {ratio:.2f} "
          f"({'<=' if ratio <= 1.0 else '>'} 1.0)")
    misses = {}
    if args.cache_sim:
        # What a count of instructions does not see: the same work can run slower when its
        # code and data are not in the first-level caches (32 KiB each on the simulated
        # machine, callgrind's model of the host's) or its branches are mispredicted.
        rows = []
        for k in ks:
            for n in ("save_on_cpu", "ours swap"):
                per = {e: (events[(n, k)].get(e, 0) - events[("none", k)].get(e, 0))
                       / (args.steps * args.layers) for e in _EVENTS}
                misses[f"{n} k={k}"] = per
                rows.append([k, n] + [f"{per[e]:.0f}" for e in _EVENTS])
        print(table(["k tensors/layer", "contender", "instructions", "I1 misses",
                     "D1 read misses", "cond. mispredicts", "indirect mispredicts"], rows,
                    title="\n## Per layer over none (callgrind --cache-sim --branch-sim)"))
    return {"instructions_per_layer": {f"{n} k={k}": v for (n, k), v in per_layer.items()},
            "fits": fits, "ratio_k2": ratio, "misses_per_layer": misses}


def run(args) -> dict:
    if args.count_child:
        return count_child(args)
    if args.cache_sim and not args.instructions:
        raise SystemExit("bench_swap_overhead: --cache-sim is a part of --instructions; "
                         "pass both.")
    if args.instructions:
        return run_instructions(args)
    manager = SwapManager()
    was = manager.cpu_swap_enabled()
    manager.set_cpu_swap(True)
    ks = [int(v) for v in args.ks.split(",")]
    try:
        results = {k: measure(args, k) for k in ks}
    finally:
        manager.synchronize()
        manager.set_cpu_swap(was)
    L = args.layers

    def per_layer_us(k, name, clock):
        return (results[k][name][clock] - results[k]["none"][clock]) / L * 1e6

    rows = []
    for k in ks:
        r = results[k]
        rows.append([k, f"{r['none']['main'] * 1e3:.3f}",
                     f"{per_layer_us(k, 'save_on_cpu', 'main'):.1f}",
                     f"{per_layer_us(k, 'ours swap', 'main'):.1f}",
                     f"{per_layer_us(k, 'ours swap', 'worker'):.1f}",
                     f"{per_layer_us(k, 'save_on_cpu', 'wall'):.1f}",
                     f"{per_layer_us(k, 'ours swap', 'wall'):.1f}",
                     f"{r['ours swap']['wakeups']:.2f}", f"{r['ours swap']['release_points']:.2f}"])
    print(table(["k tensors/layer", "none ms/step (main)", "save_on_cpu us/layer (main)",
                 "ours us/layer (main)", "ours worker us/layer", "save_on_cpu us/layer (wall)",
                 "ours us/layer (wall)", "wake-ups/step", "release points/step"], rows,
                title=f"\n## Swap host overhead per layer: {L} layers, {args.numel * 4}-byte "
                      f"tensors, medians of {args.rounds} rounds x {args.steps} steps"))
    fits = {}
    for name, clock in (("save_on_cpu", "main"), ("ours swap", "main"),
                        ("ours swap", "worker")):
        a, b = fit_line(ks, [per_layer_us(k, name, clock) for k in ks])
        fits[f"{name} ({clock})"] = (a, b)
        print(f"fit {name} ({clock} thread): a = {a:.1f} us fixed + b = {b:.2f} us per tensor")
    a_ours = fits["ours swap (main)"][0]
    if 0 in ks:
        # The definition: a region with nothing eligible (k = 0), measured; the
        # fit's intercept is printed too (it also absorbs the first tensor's batch cost).
        k0 = per_layer_us(0, "ours swap", "main")
        print(f"target: fixed cost of a swap region (k = 0, nothing eligible) <= 10 us: "
              f"{k0:.1f} us -> {'MET' if k0 <= 10 else 'MISSED'} (fit intercept a = "
              f"{a_ours:.1f} us)")
    else:
        print(f"target: fixed cost of a swap region <= 10 us (fit intercept, k = 0 not run): "
              f"{a_ours:.1f} us -> {'MET' if a_ours <= 10 else 'MISSED'}")
    k2 = 2 if 2 in ks else ks[len(ks) // 2]
    ratio = per_layer_us(k2, "ours swap", "main") / per_layer_us(k2, "save_on_cpu", "main")
    print(f"target: ours / save_on_cpu host overhead at {k2} tensors per layer (main thread) "
          f"<= 1.0: {ratio:.2f} -> {'MET' if ratio <= 1.0 else 'MISSED'}")
    wake = max(results[k]["ours swap"]["wakeups"] / max(results[k]["ours swap"]["release_points"],
                                                        1e-9) for k in ks)
    print(f"wake-ups per release point (max over k): {wake:.2f}; at k = 0: "
          f"{results[ks[0]]['ours swap']['wakeups']:.2f} per step")
    return {"fits_us": fits, "ratio_k2": ratio, "results": {str(k): v for k, v in results.items()}}


def add_args(p) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--numel", type=int, default=256, help="floats per saved tensor")
    p.add_argument("--ks", default="0,1,2,4,8", help="saved tensors per layer")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="steps per contender per round")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--modules", action="store_true",
                   help="layers are nn.Modules (a parameter and a buffer each) for every "
                        "contender, swapped through module swap_wrappers")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions under callgrind (valgrind) instead of timing: "
                        "one child process per contender and k, a count the machine's load "
                        "does not move (--steps steps each, default 20)")
    p.add_argument("--cache-sim", action="store_true",
                   help="with --instructions: also simulate the caches and branch predictor "
                        "and print first-level misses and mispredicts per layer over none "
                        "(slower)")
    p.add_argument("--count-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--count-lib", default=None, help=argparse.SUPPRESS)


def main(argv=None) -> None:
    bench_main(__doc__, add_args, run, argv)


if __name__ == "__main__":
    main()
