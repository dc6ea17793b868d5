"""Swap overlap on the simulated accelerator: how much of the copy time the schedule hides.

The device is tests/sim's hpsim (a source checkout built with scripts/setup.sh): compute
runs in stream order on the compute stream's worker, D2H and H2D on their own side streams,
and every copy between device and pinned host memory sleeps for its bytes x link delay,
so copies take real time without using a core. On an 8-layer stack, every layer swapped
and chained with set_forward_prefetch_layer, the link delay is chosen so that one layer's
offload takes `ratio` x one layer's forward, for ratio = 0.5, 1, 2. Then

    hidden = 1 - (t_swap - t_none) / t_copy

with t_none the step (forward + backward) without swap, t_swap with swap at that delay,
and t_copy the link time of the step's copies ((offload + reload bytes) x delay). Also:
`hidden excl. overhead` uses t_swap(0), swap with a free link, in place of t_none (the
engine's host cost taken out); the three are timed interleaved, and `bound`, the best `hidden` the schedule allows: D2H copies run one after
another from the end of layer 0's forward, the first reload (layer 6) waits for the last
D2H, the H2D copies then run one after another, and layer 0's backward follows its reload,
so t_swap >= t_f + T_d2h + T_h2d + t_b (t_f, t_b: one layer's forward / backward).

Usage: PYTHONPATH=src python benchmarks/bench_overlap_hpsim.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import copy
import pathlib
import sys

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper  # noqa: E402

try:
    from _common import bench_main, interleaved, median, table
except ImportError:  # pragma: no cover
    from ._common import bench_main, interleaved, median, table


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def add_args(p) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--ratios", default="0.5,1,2")


def run(args) -> None:
    from tests.sim import hpsim

    dev = hpsim.load()
    torch.manual_seed(0)
    plain = nn.Sequential(*[Mlp(args.hidden) for _ in range(args.layers)]).to(dev)
    swapped = copy.deepcopy(plain)
    for i in range(args.layers):
        swapped[i] = swap_wrapper(swapped[i])
    for a, b in zip(list(swapped)[:-1], list(swapped)[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    x = torch.randn(args.tokens, args.hidden).to(dev)
    sync = lambda: torch.hpsim.synchronize(0)  # noqa: E731

    def step(model):
        def go():
            model(x).sum().backward()
        return go

    def forward_only():
        with torch.no_grad():
            plain(x)

    # One layer's forward time, and the bytes one swapped layer offloads.
    base = interleaved({"none": step(plain), "fwd": forward_only}, rounds=args.rounds, sync=sync)
    t_none0, t_fwd = median(base["none"].wall), median(base["fwd"].wall)
    t_f = t_fwd / args.layers
    t_b = (t_none0 - t_fwd) / args.layers
    SwapManager().reset_stats()
    step(swapped)()
    sync()
    stats = SwapManager().stats()
    per_step = stats["offload_bytes"] + stats["reload_bytes"]
    per_layer = stats["offload_bytes"] / (args.layers - 1)
    print(f"  one layer: forward {t_f * 1e3:.2f} ms, backward {t_b * 1e3:.2f} ms, "
          f"offloads {per_layer / 2**20:.2f} MiB; a step moves {per_step / 2**20:.2f} MiB")

    def at_delay(delay, model):
        go = step(model)

        def run_at():
            hpsim.configure(link_ns_per_byte=delay)
            go()
        return run_at

    rows = []
    overhead = []
    for ratio in (float(r) for r in args.ratios.split(",")):
        delay = ratio * t_f * 1e9 / per_layer  # ns per byte
        SwapManager().reset_stats()
        # The three contenders interleaved, so the machine's drift hits them alike.
        t = interleaved({"none": at_delay(delay, plain), "swap0": at_delay(0.0, swapped),
                         "swap": at_delay(delay, swapped)}, rounds=args.rounds, sync=sync)
        hpsim.configure()
        stats = SwapManager().stats()
        t_none, t_swap0, t_swap = (median(t[k].wall) for k in ("none", "swap0", "swap"))
        overhead.append(t_swap0 / t_none - 1)
        t_copy = per_step * delay * 1e-9
        hidden = 1 - (t_swap - t_none) / t_copy
        hidden_excl = 1 - (t_swap - t_swap0) / t_copy
        n_off = args.layers - 1
        lower = t_f + 2 * n_off * ratio * t_f + t_b
        bound = min(1.0, 1 - max(0.0, lower - t_none) / t_copy)
        rows.append([f"{ratio:g}", f"{delay:.1f}", f"{t_none * 1e3:.1f}", f"{t_swap0 * 1e3:.1f}",
                     f"{t_swap * 1e3:.1f}", f"{t_copy * 1e3:.1f}", f"{hidden:.2f}",
                     f"{hidden_excl:.2f}", f"{bound:.2f}", stats["on_demand_reloads"]])
    print("  engine host cost (swap at delay 0 vs none): "
          + ", ".join(f"{100 * o:+.1f}%" for o in overhead))
    print(table(["offload/forward", "link ns/B", "t_none ms", "t_swap(0) ms", "t_swap ms", "t_copy ms",
                 "hidden", "hidden excl. overhead", "bound", "on-demand reloads"], rows,
                title=f"Swap overlap on hpsim: {args.layers} layers, hidden {args.hidden}, "
                      f"{args.tokens} tokens (medians of {args.rounds} rounds)"))


if __name__ == "__main__":
    bench_main(__doc__, add_args, run)
