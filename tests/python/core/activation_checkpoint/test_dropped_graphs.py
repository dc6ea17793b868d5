"""A graph built in the forward and dropped without a backward (a metric logged from the
activations: ``h.norm().item()``) frees what it saved, whatever pack hook saved it.

A pack hook that returns a saved tensor with its grad_fn closes a cycle when the tensor
is an output of the node saving it (``norm`` saves its own result): the node owns the
SavedVariable, which owns the tensor, which owns the node. Autograd's nodes are not
traversed by Python's collector, so the cycle lived forever, with every tensor the node
saved; a registered activation it had saved stayed on the device, never offloaded
(tester D, session 20; test_diagnostics.py, "after_a_logged_norm"). The hooks now hold
a detached alias (BindSwap.cpp, pass_through; _exclude.py; torch's own docs detach in pack
hooks for this reason).
"""

import gc
import weakref

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, checkpoint, checkpoint_exclude_wrapper, saved_activation_memory, swap)


def _dropped_norm(h):
    """h.norm() built and dropped; a weak reference to the norm's output."""
    n = h.norm()
    ref = weakref.ref(n)
    del n
    return ref


def test_the_meter_frees_a_dropped_graphs_saved_output():
    h = torch.randn(16, 8, requires_grad=True) * 2
    with saved_activation_memory() as meter:
        ref = _dropped_norm(h)
        del h
        gc.collect()
        assert ref() is None
        assert meter.sample() == 0  # nothing it saved is alive any more (h neither)


def test_a_swap_region_frees_a_dropped_graphs_tensors_it_kept_on_device(cpu_swap, dev):
    # MUST_SAVE: the region passes every saved tensor through, on the device.
    h = torch.randn(16, 8, device=dev, requires_grad=True) * 2
    refs = []

    def body(t):
        refs.append(_dropped_norm(t))
        return t.sin()

    out = swap(body, h, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    gc.collect()
    assert refs[0]() is None
    out.sum().backward()


def test_a_checkpoint_exclusion_frees_a_dropped_graphs_saved_output(dev):
    refs = []

    class Logged(nn.Module):
        def forward(self, t):
            refs.append(_dropped_norm(t))
            return t * 2

    torch.manual_seed(0)
    part = checkpoint_exclude_wrapper(Logged())
    lin = nn.Linear(8, 8).to(dev)
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    checkpoint(lambda t: part(lin(t)).sin(), x).sum().backward()
    gc.collect()
    assert refs and all(r() is None for r in refs)
