"""async_save_on_cpu: a with-block whose saved tensors are swapped (issue 16)."""

import copy

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    AsyncSaveOnCpu, CheckpointPolicy, PinnedMemoryPool, SwapManager, async_save_on_cpu)

D = 32


def _model(dev):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D), nn.Sigmoid()).to(dev)


def test_saved_tensors_are_offloaded_and_gradients_are_bitwise(cpu_swap, dev):
    model = _model(dev)
    ref = copy.deepcopy(model)
    x = torch.randn(16, D, device=dev)
    SwapManager().reset_stats()
    xs = x.clone().requires_grad_()
    with async_save_on_cpu() as block:
        out = model(xs).square().sum()
    assert isinstance(block, AsyncSaveOnCpu)
    SwapManager().synchronize()
    st = SwapManager().stats()
    # Tanh output (16x64), Linear-2 input (same storage), Sigmoid output (16x32), square
    # input (same), and the input x: each storage once.
    assert st["offload_bytes"] >= 16 * 2 * D * 4 + 16 * D * 4
    out.backward()
    assert SwapManager().stats()["reload_bytes"] == st["offload_bytes"]
    xr = x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    assert torch.equal(xs.grad, xr.grad)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_policy_keeps_chosen_tensors_and_pool_is_used(cpu_swap, dev):
    model = _model(dev)
    pool = PinnedMemoryPool(1 << 20)
    big = 16 * 2 * D * 4

    def policy(t):
        return CheckpointPolicy.MUST_SWAP if t.nbytes >= big else CheckpointPolicy.MUST_SAVE

    SwapManager().reset_stats()
    with async_save_on_cpu(policy_fn=policy, cpu_pool=pool):
        out = model(torch.randn(16, D, device=dev, requires_grad=True)).sum()
    SwapManager().synchronize()
    assert SwapManager().stats()["offload_bytes"] == big  # only the 16x64 Tanh output
    assert pool.stats()["bytes_in_use"] == big
    out.backward()
    assert pool.stats()["bytes_in_use"] == 0


def test_block_is_entered_once_and_exceptions_leave_nothing(cpu_swap, dev):
    block = async_save_on_cpu()
    with block:
        with pytest.raises(RuntimeError, match="already entered"):
            block.__enter__()
    with pytest.raises(ValueError, match="boom"):
        with async_save_on_cpu():
            torch.randn(4, device=dev, requires_grad=True).exp()
            raise ValueError("boom")
    assert SwapManager().get_current_group_name() is None
    with pytest.raises(TypeError, match="policy_fn must be a callable"):
        async_save_on_cpu(policy_fn=3)


def test_async_save_group_swap_must_be_bool():
    from hyper_parallel.core.activation_checkpoint import async_save_on_cpu

    with pytest.raises(TypeError, match=r"^hyper_parallel: async_save_on_cpu's group_swap must "
                                        r"be a bool \(True or False\); got 'yes'"):
        async_save_on_cpu(group_swap="yes")
