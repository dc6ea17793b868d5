"""Device peak memory and step time with and without swap, on an accelerator.

A stack of MLP blocks large enough that each layer's activations take tens of MiB; for
each configuration the script reports the allocator's peak bytes during one training step
(after a warm-up step) and the median step time, as ratios against no swap in the same run.

Usage: python benchmarks/gpu_swap_memory.py [--layers 8] [--hidden 4096] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(kind: str, base: nn.ModuleList, group_swap: bool = False) -> nn.ModuleList:
    layers = copy.deepcopy(base)
    if kind == "none":
        return layers
    for i in range(len(layers)):
        if kind == "checkpoint":
            layers[i] = checkpoint_wrapper(layers[i])
        else:
            layers[i] = swap_wrapper(layers[i], group_swap=group_swap)
    if kind != "checkpoint":
        for i in range(len(layers) - 1):
            SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    return layers


def step(layers, x):
    h = x
    for layer in layers:
        h = layer(h)
    h.float().pow(2).mean().backward()


def measure(layers, x, steps: int):
    step(layers, x)  # warm-up: host pool and allocator caches fill here
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(layers, x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return torch.cuda.max_memory_allocated() - base, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hyper_parallel: this benchmark needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    base = nn.ModuleList(Block(args.hidden) for _ in range(args.layers)).cuda().to(dtype)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
    results = {}
    for kind, fuse in (("none", False), ("checkpoint", False), ("swap", False), ("swap", True)):
        SwapManager().reset()
        layers = build(kind, base, group_swap=fuse)
        name = kind + ("+group_swap" if fuse else "")
        peak, seconds = measure(layers, x, args.steps)
        stats = SwapManager().stats()
        results[name] = (peak, seconds, stats)
        SwapManager().unregister(layers)
        del layers
        torch.cuda.empty_cache()
    none_peak, none_time, _ = results["none"]
    print(f"{'strategy':<18}{'peak MiB':>10}{'peak/none':>11}{'step ms':>10}{'time/none':>11}"
          f"{'offload MiB':>13}{'on-demand':>11}")
    for name, (peak, seconds, stats) in results.items():
        print(f"{name:<18}{peak / 2**20:>10.1f}{peak / none_peak:>11.3f}{seconds * 1e3:>10.2f}"
              f"{seconds / none_time:>11.3f}{stats['offload_bytes'] / 2**20:>13.1f}"
              f"{stats['on_demand_reloads']:>11d}")


if __name__ == "__main__":
    main()
