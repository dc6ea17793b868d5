"""Swap every block of a small MLP stack to host memory, with the prefetch chain, in one call.

Runs on CPU (the CPU swap backend plays the copy stream) or on a GPU:

    PYTHONPATH=src python examples/swap_chain.py [--device cuda]

Prints the saved-activation peak with and without swap and checks that the gradients are
bitwise identical.
"""

import argparse
import copy

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    SwapManager,
    apply_activation_memory,
    saved_activation_memory,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        SwapManager().set_cpu_swap(True)  # host tensors become swappable (demo/test backend)

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(),
                                           nn.Linear(1024, 256)) for _ in range(6)]).to(device)
    swapped = copy.deepcopy(blocks)
    # Finds the six blocks, wraps each in swap_wrapper and registers the prefetch chain.
    print(apply_activation_memory(swapped, "swap"))

    x = torch.randn(64, 128, 256, device=device)
    with saved_activation_memory() as plain:
        blocks(x).square().mean().backward()
    with saved_activation_memory() as swap:
        swapped(x).square().mean().backward()

    same = all(torch.equal(a.grad, b.grad) for a, b in zip(blocks.parameters(), swapped.parameters()))
    stats = SwapManager().stats()
    print(f"saved-activation peak: none {plain.peak_bytes / 2**20:.1f} MiB, "
          f"swap {swap.peak_bytes / 2**20:.1f} MiB ({swap.peak_bytes / plain.peak_bytes:.2f}x)")
    print(f"offloaded {stats['offload_bytes'] / 2**20:.1f} MiB in {stats['offload_count']} storages, "
          f"reloaded {stats['reload_bytes'] / 2**20:.1f} MiB, on-demand reloads "
          f"{stats['on_demand_reloads']}")
    print(f"gradients bitwise equal: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
