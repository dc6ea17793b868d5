"""Region modes of selective checkpoint (_selective.py): when a callable policy opens a
swap region (docs/design.md, "Selective checkpoint")."""

import pytest
import torch
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint

D = 8
_ADDMM = torch.ops.aten.addmm.default


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return torch.tanh(x + self.fc2(torch.relu(self.fc1(x))))


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is _ADDMM else CheckpointPolicy.PREFER_RECOMPUTE


def _swap_second_matmul(ctx, op, *args, **kwargs):
    if op is _ADDMM and args[2].shape[1] == D:  # fc2's addmm
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.fixture
def region_enters(monkeypatch):
    """Counts the swap regions opened (each one: a swap group, maybe hooks)."""
    calls = []
    original = _C.region_enter

    def counting(*args, **kwargs):
        calls.append(args[1])  # the region's name
        return original(*args, **kwargs)

    monkeypatch.setattr(_C, "region_enter", counting)
    return calls


def _run(policy_fn, layers=3, steps=2):
    """Grads of `layers` checkpointed layers against the same layers without checkpoint."""
    torch.manual_seed(3)
    model = nn.ModuleList(_Layer() for _ in range(layers))
    for step in range(steps):
        x = torch.randn(4, D, requires_grad=True)
        ref = x
        for layer in model:
            ref = layer(ref)
        ref.square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        model.zero_grad()
        x.grad = None
        out = x
        for layer in model:
            out = checkpoint(layer, out, policy_fn=policy_fn)
        out.square().sum().backward()
        got = [p.grad for p in model.parameters()] + [x.grad]
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        model.zero_grad()


def test_callable_policy_that_never_swaps_opens_no_swap_region(region_enters, caches):
    _run(_save_matmuls)
    assert region_enters == []
    assert sum(c.stats()["replays"] for c in caches) == 3 * 2 * 2  # the saves were used


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_callable_policy_opens_its_swap_region_at_the_first_must_swap(region_enters, caches,
                                                                     host_swap):
    _run(_swap_second_matmul)
    assert len(region_enters) == 3 * 2  # one per layer call, forward only (not recompute)
    stats = host_swap.stats()
    assert stats["offload_count"] == stats["reload_count"] == 3 * 2
    assert [c.stats()["swapped_entries"] for c in caches] == [0] * 6  # replayed, released
