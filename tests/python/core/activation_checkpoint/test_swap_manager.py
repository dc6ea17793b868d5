"""SwapManager's manual group API (issue 16): ensure/abort/release groups, counts, the
last group of a chain, unregistering one layer, copy_stream=, unknown names."""

import pytest
import torch
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import (
    SwapGroupError, SwapManager, swap_tensor_wrapper, swap_wrapper)


def _manual(name, dev, n=256):
    """(input, loss, group) of a manual group holding one registered 4*n-byte tensor,
    which autograd saves after its registration (so the group's handles are its only
    references once this returns)."""
    x = torch.randn(n, device=dev, requires_grad=True)
    with SwapManager().group_context(name) as group:
        h = swap_tensor_wrapper(x * 2)
        y = (h * h).sum()
    return x, y, group


def _check_grad(x):
    xr = x.detach().clone().requires_grad_()
    ((xr * 2) * (xr * 2)).sum().backward()
    assert torch.equal(x.grad, xr.grad)


def test_unknown_names_raise_runtime_error_like_the_reference():
    m = SwapManager()
    for call in (m.launch_offload, m.wait_offload, m.launch_load, m.wait_load, m.abort_group):
        with pytest.raises(RuntimeError, match="hyper_parallel: no live swap group named 'nope'"):
            call("nope")
    assert issubclass(SwapGroupError, ValueError)  # what earlier releases raised
    m.release_group_storage("nope")  # ignored, as in the reference


def test_ensure_group_creates_once_and_counts(cpu_swap, dev):
    m = SwapManager()
    assert m.active_group_count() == 0
    g = m.ensure_group("pre")
    assert g.name == "pre" and g.num_records == 0
    assert m.ensure_group("pre") is g
    assert m.active_group_count() == 1
    m.launch_offload("pre")  # an empty group moves nothing
    m.release_group_storage("pre")
    assert m.active_group_count() == 0


def test_abort_group_brings_the_data_back_and_forgets_the_name(cpu_swap, dev):
    m = SwapManager()
    x, y, group = _manual("step", dev)
    m.launch_offload("step")
    m.wait_offload("step")
    assert group.residencies == ["host"] and group.storage_nbytes == [0]  # offloaded in place
    m.abort_group("step")
    assert group.residencies == ["device"] and group.storage_nbytes == [256 * 4]
    with pytest.raises(SwapGroupError):
        m.launch_load("step")
    y.backward()
    _check_grad(x)


def test_active_group_count_drops_to_zero_after_backward(cpu_swap, dev):
    m = SwapManager()
    y1 = _manual("a", dev)[1]
    y2 = _manual("b", dev)[1]
    assert m.active_group_count() == 2
    for name in ("a", "b"):
        m.launch_offload(name)
    (y1 + y2).backward()
    del y1, y2
    assert m.active_group_count() == 0


def test_is_last_group_and_unregister_one_layer(cpu_swap, dev):
    m = SwapManager()
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3)).to(dev)
    for a, b in zip(layers, layers[1:]):
        m.set_forward_prefetch_layer(a, b)
    names = []

    def probe(module, args):  # runs after the schedule's pre-hook opened the layer's group
        names.append((m.get_current_group_name(), m.is_last_group()))

    pre = [layer.register_forward_pre_hook(probe) for layer in layers]
    h = torch.randn(2, 8, device=dev, requires_grad=True)
    for layer in layers:
        h = layer(h)
    assert [last for _, last in names] == [False, False, True]
    assert m.is_last_group(names[2][0]) is True and m.is_last_group(names[0][0]) is False
    assert m.is_last_group("no-such-group") is False
    h.sum().backward()
    for hook in pre:
        hook.remove()
    m.unregister_forward_prefetch_layer(layers[2])
    assert "_hyper_parallel_layer" not in layers[2].__dict__
    assert not layers[2]._forward_pre_hooks and not layers[2]._forward_hooks
    assert layers[1].__dict__["_hyper_parallel_layer"].next is None
    assert layers[0].__dict__["_hyper_parallel_layer"].next is not None
    m.unregister_forward_prefetch_hooks(layers)
    assert all("_hyper_parallel_layer" not in layer.__dict__ for layer in layers)


def test_copy_stream_is_accepted_and_checked(cpu_swap, dev):
    m = SwapManager()
    x, y, group = _manual("streamed", dev)
    stream = torch.Stream(device=dev) if dev.type != "cpu" else None
    m.launch_offload("streamed", copy_stream=stream)
    m.wait_offload("streamed")
    assert group.residencies == ["host"]
    m.launch_load("streamed", copy_stream=stream)
    m.wait_load("streamed")
    assert group.residencies == ["device"] and group.storage_nbytes == [256 * 4]
    with pytest.raises(TypeError, match="copy_stream must be a torch stream"):
        m.launch_load("streamed", copy_stream="side")
    y.backward()
    _check_grad(x)


def test_a_wait_before_its_launch_raises_and_moves_nothing(cpu_swap, dev):
    # A manual schedule that waits for copies it never started has a bug: the wait would
    # return with the data still on device (or still on host).
    m = SwapManager()
    x, y, group = _manual("early", dev)
    for wait, launch in ((m.wait_offload, "launch_offload"), (m.wait_load, "launch_load")):
        with pytest.raises(SwapGroupError, match=rf"before {launch}: .* call {launch}\('early'\)"):
            wait("early")
    assert group.residencies == ["device"] and group.storage_nbytes == [256 * 4]
    m.launch_offload("early")
    with pytest.raises(RuntimeError, match="before launch_load"):  # offloaded, not reloading
        m.wait_load("early")
    m.wait_offload("early")
    assert group.residencies == ["host"] and group.storage_nbytes == [0]
    m.launch_load("early")
    m.wait_load("early")
    assert group.residencies == ["device"] and group.storage_nbytes == [256 * 4]
    y.backward()
    _check_grad(x)


@pytest.mark.parametrize("bad", [5, None, b"g"])
def test_group_names_must_be_str_at_the_call(bad):
    """Tester fault: group_context(5) was accepted (and only a generator was built)."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    with pytest.raises(TypeError, match=r"^hyper_parallel: group_context's name must be a str"):
        SwapManager().group_context(bad)  # raised before any `with`
    with pytest.raises(ValueError, match=r"^hyper_parallel: set_current_group_name's name "):
        SwapManager().set_current_group_name(bad)
    with SwapManager().group_context("ok") as group:  # a str still works
        assert group is not None


@pytest.mark.parametrize("bad", [5, None, b"g"])
def test_every_group_method_takes_a_str_name(bad):
    """Tester fault: launch_offload(5) reported "no live swap group named '5'" (the int made a
    str) where group_context(5) raised ArgumentKindError for the same mistake."""
    from hyper_parallel.core.activation_checkpoint import ArgumentKindError

    m = SwapManager()
    calls = [m.launch_offload, m.wait_offload, m.launch_load, m.wait_load, m.ensure_group,
             m.abort_group, m.release_group_storage]
    if bad is not None:  # is_last_group(None) asks about the current group
        calls.append(m.is_last_group)
    for call in calls:
        with pytest.raises(ArgumentKindError, match=rf"^hyper_parallel: {call.__name__}'s "
                                                    r"name must be a str"):
            call(bad)
    with pytest.raises(SwapGroupError):  # a str name never used: as before
        m.launch_offload("never-used-name")


@pytest.mark.parametrize("bad", [5, None, "model.layers.0", torch.zeros(1)])
def test_unregister_refuses_what_cannot_have_been_registered(bad):
    """Tester fault: unregister(5), unregister(None) and unregister("model.layers.0") did
    nothing and said nothing (a name or a parameter passed by mistake was never reported)."""
    from hyper_parallel.core.activation_checkpoint import ArgumentKindError

    with pytest.raises(ArgumentKindError, match=r"^hyper_parallel: SwapManager\(\)\.unregister "
                                                r"takes the module \(or function\)"):
        SwapManager().unregister(bad)


def test_unregister_of_a_module_or_function_never_registered_is_a_no_op():
    SwapManager().unregister(nn.Linear(2, 2))
    SwapManager().unregister(torch.sin)
    layer = swap_wrapper(nn.Linear(2, 2))
    SwapManager().unregister(layer)
    SwapManager().unregister(layer)  # twice: nothing left to remove
