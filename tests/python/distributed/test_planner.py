"""The planner under torch.distributed: every rank profiles, the figures become the worst
over the ranks and rank 0's decision is everyone's (2 gloo ranks on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from ._launch import launch


class _Stack(nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def _plan_on_rank(rank, world_size):
    from hyper_parallel.core.activation_checkpoint import plan_activation_memory

    torch.manual_seed(0)
    model = _Stack(3, 16)
    # Rank 1 runs a larger batch: its bytes are the worst, so they must decide.
    x = torch.randn(8 * (rank + 1), 16)
    plan = plan_activation_memory(model, lambda: model(x).backward(), 0.5,
                                  candidates=["none", "checkpoint"])
    return plan.to_json(), plan.none_peak_bytes


def test_every_rank_gets_rank0s_plan_from_the_worst_figures():
    (json0, none0), (json1, none1) = launch(_plan_on_rank)
    assert json0 == json1
    # The larger batch's figures (rank 1's) were used on both ranks.
    assert none0 == none1
    torch.manual_seed(0)
    model = _Stack(3, 16)
    from hyper_parallel.core.activation_checkpoint import saved_activation_memory

    with saved_activation_memory() as meter:
        model(torch.randn(16, 16)).backward()
    assert none0 == meter.peak_bytes
