"""Faults found by a fresh-user review, kept as regression tests."""

import copy
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    checkpoint,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)

pytestmark = pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class RegisteringMLP(MLP):
    def forward(self, x):
        return x + self.fc2(F.gelu(swap_tensor_wrapper(self.fc1(x))))


# -- in-place writes to tensors the hooks let pass through are still detected ------------

def test_in_place_on_checkpoint_input_is_detected(cpu_swap, dev):
    lin = nn.Linear(16, 16).to(dev)
    SwapManager().set_forward_prefetch_layer(lin, nn.Linear(1, 1))  # a region is opened
    x = torch.randn(4, 16, device=dev)
    y = checkpoint(lin, x, swap_inputs=False)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="hyper_parallel: .*modified by an in-place"):
        y.pow(2).sum().backward()


def test_in_place_on_parameter_inside_swap_wrapper_is_detected(cpu_swap, dev):
    lin = nn.Linear(16, 16).to(dev)
    m = swap_wrapper(lin)
    loss = m(torch.randn(4, 16, device=dev, requires_grad=True)).pow(2).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer step before this backward
    with pytest.raises(RuntimeError, match="hyper_parallel: .*modified by an in-place"):
        loss.backward()


def test_in_place_on_must_save_tensor_is_detected(cpu_swap, dev):
    m = swap_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(dev),
                     policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    x = torch.randn(3, 8, device=dev)
    y = m(x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="hyper_parallel: .*modified by an in-place"):
        y.sum().backward()


# -- one invocation is one region ------------------------------------------------------

def test_functional_swap_on_registered_layers_offloads(cpu_swap, dev):
    layers = nn.ModuleList(MLP() for _ in range(4)).to(dev)
    ref = copy.deepcopy(layers)
    for i in range(3):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    x = torch.randn(8, 32, device=dev)
    h, hr = x, x
    for m, r in zip(layers, ref):
        h, hr = swap(m, h), r(hr)
    h.pow(2).sum().backward()
    hr.pow(2).sum().backward()
    stats = SwapManager().stats()
    assert stats["offload_bytes"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0
    for a, b in zip(layers.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_register_then_wrap_offloads(cpu_swap, dev):
    layers = nn.ModuleList(MLP() for _ in range(4)).to(dev)
    for i in range(3):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    for i in range(4):
        layers[i] = swap_wrapper(layers[i])
    h = torch.randn(8, 32, device=dev)
    for m in layers:
        h = m(h)
    h.pow(2).sum().backward()
    stats = SwapManager().stats()
    assert stats["offload_bytes"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]


# -- threads ------------------------------------------------------------------------------

def test_two_threads_on_one_registered_model_leave_no_current_group(cpu_swap, dev):
    layers = nn.ModuleList(RegisteringMLP() for _ in range(4)).to(dev)
    ref = copy.deepcopy(layers)
    for i in range(3):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    inputs = [torch.randn(8, 32, device=dev) for _ in range(2)]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                h = inputs[i]
                for m in layers:
                    h = m(h)
                h.pow(2).sum().backward()
            assert _C.current_group() is None
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert _C.current_group() is None
    for x in inputs:
        for _ in range(5):
            h = x
            for r in ref:
                h = r(h)
            h.pow(2).sum().backward()
    for a, b in zip(layers.parameters(), ref.parameters()):
        diff = (a.grad - b.grad).abs().max().item()
        assert diff <= 1e-4 * b.grad.abs().max().item(), diff  # accumulation order differs


# -- lifetime -------------------------------------------------------------------------------

def test_manual_groups_do_not_accumulate(cpu_swap, dev):
    fc1, fc2 = nn.Linear(64, 128).to(dev), nn.Linear(128, 64).to(dev)
    x = torch.randn(16, 64, device=dev)
    for i in range(20):
        with SwapManager().group_context(f"step{i}"):
            h = swap_tensor_wrapper(fc1(x))
            out = fc2(F.gelu(h))
            del h
        SwapManager().launch_offload(f"step{i}")
        out.pow(2).sum().backward()
        del out
    gc.collect()
    SwapManager().synchronize()
    assert SwapManager().stats()["live_records"] == 0
    # The names stay known: loading a group that died is a no-op, not an error.
    SwapManager().launch_load("step3")
    SwapManager().wait_load("step3")


def test_deepcopy_then_unregister_removes_the_copy_hooks(cpu_swap, dev):
    layers = nn.ModuleList(RegisteringMLP() for _ in range(3)).to(dev)
    for i in range(2):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    clone = copy.deepcopy(layers)
    SwapManager().unregister(clone)
    assert all(len(m._forward_pre_hooks) + len(m._forward_hooks) == 0 for m in clone)
    for i in range(2):
        SwapManager().set_forward_prefetch_layer(clone[i], clone[i + 1])
    assert all(len(m._forward_pre_hooks) + len(m._forward_hooks) == 3 for m in clone)


def test_reset_stats_keeps_the_chain(cpu_swap, dev):
    layers = nn.ModuleList(swap_wrapper(MLP()) for _ in range(3)).to(dev)
    for i in range(2):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    x = torch.randn(8, 32, device=dev)
    first = None
    for _ in range(3):
        h = x
        for m in layers:
            h = m(h)
        h.pow(2).sum().backward()
        stats = SwapManager().stats()
        first = first or stats["offload_bytes"]
        assert stats["offload_bytes"] == first and stats["on_demand_reloads"] == 0
        SwapManager().reset_stats()


def test_bad_manager_arguments_are_clear():
    with pytest.raises(ValueError, match="hyper_parallel: prefetch depth"):
        SwapManager().set_prefetch_depth("x")
    with pytest.raises(TypeError, match="hyper_parallel: set_forward_prefetch_layer expects"):
        SwapManager().set_forward_prefetch_layer(None, nn.Linear(2, 2))


def test_region_end_on_another_thread_is_an_error():
    group = _C.begin_forward(-1, "t", False, False)
    errors = []

    def end():
        try:
            _C.end_forward(group)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=end)
    t.start()
    t.join()
    assert errors and "hyper_parallel: a swap region ended on a thread" in errors[0]
    _C.end_forward(group)  # the right thread can still end it


def test_chain_edits_are_explicit():
    from torch import nn as _nn

    a, b, c = _nn.Linear(2, 2), _nn.Linear(2, 2), _nn.Linear(2, 2)
    SwapManager().set_forward_prefetch_layer(a, b)
    with pytest.warns(UserWarning, match="replaces the successor"):
        SwapManager().set_forward_prefetch_layer(a, c)
    w = swap_wrapper(_nn.Linear(2, 2))
    with pytest.raises(ValueError, match="hyper_parallel: .*a wrapper and the module it wraps"):
        SwapManager().set_forward_prefetch_layer(w, w._checkpoint_wrapped_module)
    for m in (a, b, c, w):
        SwapManager().unregister(m)
