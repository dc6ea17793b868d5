"""Selective checkpoint: keep the matmul outputs, recompute the cheap ops, or swap them.

    PYTHONPATH=src python examples/selective_checkpoint.py [--device cuda]

For one MLP stack it counts the FLOPs run in backward (torch.utils.flop_counter) under
full recompute, under a policy that saves matmul outputs, and under one that swaps them to
host memory (MUST_SWAP, with the prefetch chain), and checks the gradients against the
run without checkpoint.
"""

import argparse
import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    apply_activation_memory,
    remove_activation_memory,
)

MATMULS = [torch.ops.aten.mm, torch.ops.aten.addmm]


def swap_matmuls(ctx, op, *args, **kwargs):
    """Offload matmul outputs to host; recompute everything else."""
    if str(op) in {"aten.mm.default", "aten.addmm.default"}:
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


def backward_flops(model, x) -> int:
    loss = model(x).square().mean()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        SwapManager().set_cpu_swap(True)

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128),
                                         nn.LayerNorm(128)) for _ in range(4)]).to(device)
    x = torch.randn(32, 128, device=device)
    reference = copy.deepcopy(base)
    ref_flops = backward_flops(reference, x)
    ok = True
    # One call per plan: it finds the four blocks, wraps them (checkpoint_wrapper with the
    # policy) and, when the plan swaps, registers the prefetch chain over them.
    for name, plan, policy in (("full recompute", "checkpoint", None),
                               ("save matmuls (op list, decided in C++)", "selective", MATMULS),
                               ("swap matmuls (MUST_SWAP)", "selective_swap", swap_matmuls)):
        SwapManager().reset()
        model = copy.deepcopy(base)
        apply_activation_memory(model, plan, policy_fn=policy)
        flops = backward_flops(model, x)
        same = all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
                   for a, b in zip(reference.parameters(), model.parameters()))
        ok &= same
        stats = SwapManager().stats()
        print(f"{name:<42} backward FLOPs {flops / ref_flops:5.2f}x of no-checkpoint, "
              f"offloaded {stats['offload_bytes'] / 2**10:7.1f} KiB, gradients equal: {same}")
        remove_activation_memory(model)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
