"""swap_tensor_wrapper and the manual group API (SPEC 2)."""

import copy

import pytest
import torch
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_tensor_wrapper

from ._models import assert_bitwise, grads


class GuideBlock(nn.Module):
    """The guide's pattern: a plain module that registers two of its activations."""

    def __init__(self, d=16):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm1 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.norm2 = nn.LayerNorm(d)
        self.registered = []

    def forward(self, x):
        attn_out, _ = self.attn(x, x, x)
        attn_out = swap_tensor_wrapper(attn_out, tag="attn_out")
        x = x + attn_out
        x = self.norm1(x)
        x = swap_tensor_wrapper(x, tag="norm1_out")
        self.registered.append(_C.current_group())
        x = x + self.ffn(x)
        return self.norm2(x)


def test_registered_tensors_follow_the_schedule(cpu_swap, dev):
    torch.manual_seed(0)
    blocks = nn.ModuleList(GuideBlock() for _ in range(3)).to(dev)
    ref = copy.deepcopy(blocks)
    for i in range(2):
        SwapManager().set_forward_prefetch_layer(blocks[i], blocks[i + 1])
    x = torch.randn(2, 5, 16, device=dev)
    h, hr = x, x
    for b, r in zip(blocks, ref):
        h, hr = b(h), r(hr)
    cpu_swap.synchronize()
    assert torch.equal(h, hr)
    first = blocks[0].registered[-1]
    # attn_out is only read by the add (nothing saves it) so it died with the forward;
    # norm1_out is saved by the ffn's first Linear: offloaded in place.
    alive = [n for n in first.storage_nbytes if n >= 0]
    assert alive and all(n == 0 for n in alive), alive
    last = blocks[2].registered[-1]
    assert all(n > 0 for n in last.storage_nbytes if n >= 0)  # last layer stays
    h.sum().backward()
    hr.sum().backward()
    assert_bitwise(grads(blocks), grads(ref))
    stats = SwapManager().stats()
    assert stats["offload_count"] >= 2 and stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0


def test_registration_returns_target_unchanged_and_skips_ineligible(cpu_swap, dev):
    d = {"a": torch.randn(3, device=dev), "b": [torch.ones(2, device=dev), 5, None]}
    with SwapManager().group_context("g"):
        out = swap_tensor_wrapper(d)
        p = nn.Parameter(torch.randn(3, device=dev))
        assert swap_tensor_wrapper(p) is p
        group = _C.current_group()
        assert group.num_records == 2   # the two tensors; the parameter is never registered
    assert out is d


def test_outside_any_region_warns_once_and_does_nothing(cpu_swap, dev):
    import hyper_parallel.core.activation_checkpoint._swap as swap_module

    swap_module._warned_outside = False
    t = torch.randn(4, device=dev)
    with pytest.warns(UserWarning, match="outside any swap region"):
        assert swap_tensor_wrapper(t) is t
    assert SwapManager().stats()["offload_count"] == 0


def test_in_place_write_after_registration_is_an_error(cpu_swap, dev):
    lin = nn.Linear(4, 4).to(dev)
    other = nn.Linear(4, 4).to(dev)
    SwapManager().set_forward_prefetch_layer(lin, other)

    def bad_forward(x):
        h = x * 2
        swap_tensor_wrapper(h)
        h.add_(1)
        return h

    lin.forward = bad_forward
    with pytest.raises(RuntimeError, match="hyper_parallel: a tensor registered with "
                                           "swap_tensor_wrapper .* modified in place"):
        lin(torch.randn(2, 4, device=dev))
    assert _C.current_group() is None
    SwapManager().unregister(lin)
    SwapManager().unregister(other)


def test_manual_group_offload_and_load(cpu_swap, dev):
    manager = SwapManager()
    w = torch.randn(8, 8, device=dev, requires_grad=True)
    x = torch.randn(4, 8, device=dev)
    with manager.group_context("manual"):
        assert manager.get_current_group_name() == "manual"
        h = torch.sin(x @ w)
        y = swap_tensor_wrapper(torch.cos(h))  # registered; saved by the product below
        out = (y * h).sum()
        group = _C.current_group()
    assert manager.get_current_group_name() is None
    del y
    manager.launch_offload("manual")
    manager.wait_offload("manual")
    assert group.storage_nbytes == [0]
    assert group.residencies == ["host"]
    manager.launch_load("manual")
    manager.wait_load("manual")
    assert group.residencies == ["device"]
    out.backward()
    g = w.grad.clone()
    w.grad = None
    h = torch.sin(x @ w)
    (torch.cos(h) * h).sum().backward()
    assert torch.equal(g, w.grad)


def test_unknown_group_name_is_a_clear_error():
    with pytest.raises(ValueError, match="hyper_parallel: no live swap group named 'nope'"):
        SwapManager().launch_offload("nope")


def test_set_current_group_name(cpu_swap, dev):
    with SwapManager().group_context("first"):
        SwapManager().set_current_group_name("renamed")
        assert SwapManager().get_current_group_name() == "renamed"
        swap_tensor_wrapper(torch.randn(4, device=dev) * 2)
    SwapManager().launch_offload("renamed")  # findable under the new name
    with pytest.raises(RuntimeError, match="hyper_parallel: set_current_group_name"):
        SwapManager().set_current_group_name("x")
