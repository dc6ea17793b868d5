"""Regions' host cost counters (issue 17): hook-stack scans only after a region went stale,
backward start as a C++ node pre-hook, copy-worker wake-ups per release point."""

import gc

import torch

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import (
    SwapManager,
    saved_activation_memory,
    swap_wrapper,
)


def _layer(k):
    def layer(x):
        x = x * 1.0  # saves nothing
        for _ in range(k):
            x = torch.sin(x)
        return x

    return layer


def _chain(k, n=4):
    layers = [swap_wrapper(_layer(k)) for _ in range(n)]
    for a, b in zip(layers, layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    return layers


def _step(layers, x):
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    return x.grad


def _top():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_steady_state_regions_never_scan_the_hook_stack(host_swap):
    layers = _chain(2)
    x = torch.randn(64, requires_grad=True)
    _step(layers, x)
    before = _C.region_counters()["hook_scans"]
    for _ in range(3):
        x.grad = None
        _step(layers, x)
    assert _C.region_counters()["hook_scans"] == before
    assert _top() is None


def test_abandoned_region_hook_is_popped_by_the_next_entry(host_swap):
    layers = _chain(2)
    x = torch.randn(64, requires_grad=True)
    _step(layers, x)
    token = _C.region_enter(-1, "lost", False, False, None, _C.PackMode.SWAP_ALL, None, True)
    assert token.pushed and _top() is not None
    del token  # dropped while open: its hook stays on the stack, inert
    gc.collect()
    assert _top() is not None
    before = _C.region_counters()["hook_scans"]
    x.grad = None
    grad = _step(layers, x).clone()
    assert _C.region_counters()["hook_scans"] > before
    assert _top() is None
    # Clean again: the following steps scan nothing.
    before = _C.region_counters()["hook_scans"]
    x.grad = None
    assert torch.equal(_step(layers, x), grad)
    assert _C.region_counters()["hook_scans"] == before


def test_reset_makes_the_next_entry_scan(host_swap):
    layers = _chain(1)
    x = torch.randn(64, requires_grad=True)
    _step(layers, x)
    _C.reset(True)  # a new engine generation (SwapManager().reset() also scans at once)
    for a, b in zip(layers, layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    before = _C.region_counters()["hook_scans"]
    x.grad = None
    _step(layers, x)
    assert _C.region_counters()["hook_scans"] == before + 1


def test_backward_start_is_one_cpp_hook_per_output_node_and_bitwise(host_swap):
    ref_x = torch.randn(64, requires_grad=True)
    _step([_layer(3) for _ in range(4)], ref_x)
    layers = _chain(3)
    x = ref_x.detach().clone().requires_grad_()
    s0, h0 = SwapManager().stats(), _C.region_counters()["backward_hooks"]
    _step(layers, x)
    SwapManager().synchronize()
    s1, h1 = SwapManager().stats(), _C.region_counters()["backward_hooks"]
    assert torch.equal(x.grad, ref_x.grad)
    assert h1 - h0 == 4  # one output node per layer
    assert s1["prefetch_points"] - s0["prefetch_points"] == 4  # each layer's backward began
    assert s1["offload_count"] - s0["offload_count"] == 9  # layers 0-2, 3 tensors each
    assert s1["reload_count"] - s0["reload_count"] == 9
    assert s1["on_demand_reloads"] == s0["on_demand_reloads"]  # the hooks prefetched


def test_meter_keeps_the_python_backward_hook(host_swap):
    ref_x = torch.randn(64, requires_grad=True)
    _step([_layer(2) for _ in range(3)], ref_x)
    layers = _chain(2, n=3)
    x = ref_x.detach().clone().requires_grad_()
    h0 = _C.region_counters()["backward_hooks"]
    s0 = SwapManager().stats()
    with saved_activation_memory() as meter:
        _step(layers, x)
    assert _C.region_counters()["backward_hooks"] == h0
    assert SwapManager().stats()["prefetch_points"] - s0["prefetch_points"] == 3
    assert torch.equal(x.grad, ref_x.grad)
    assert meter.peak_bytes > 0


def test_worker_wakes_at_most_once_per_release_or_prefetch_point(host_swap):
    layers = _chain(4, n=6)
    x = torch.randn(256, requires_grad=True)
    _step(layers, x)
    SwapManager().synchronize()
    s0 = SwapManager().stats()
    for _ in range(3):
        x.grad = None
        _step(layers, x)
    SwapManager().synchronize()
    s1 = SwapManager().stats()
    points = (s1["release_points"] - s0["release_points"]
              + s1["prefetch_points"] - s0["prefetch_points"])
    assert s1["release_points"] - s0["release_points"] == 18
    assert 0 < s1["worker_wakeups"] - s0["worker_wakeups"] <= points
    assert s1["offload_count"] - s0["offload_count"] == 3 * 5 * 4


def test_nothing_queued_wakes_no_worker(host_swap):
    layers = _chain(0, n=4)  # nothing saved: regions and hooks only
    x = torch.randn(256, requires_grad=True)
    _step(layers, x)
    s0 = SwapManager().stats()
    for _ in range(3):
        x.grad = None
        _step(layers, x)
    SwapManager().synchronize()
    s1 = SwapManager().stats()
    assert s1["release_points"] - s0["release_points"] == 12
    assert s1["worker_wakeups"] == s0["worker_wakeups"]
    assert s1["offload_count"] == s0["offload_count"]


def test_small_copies_run_inline_when_the_worker_idles(host_swap):
    SwapManager().set_cpu_swap(True, delay_ns_per_byte=0.0)
    ref_x = torch.randn(256, requires_grad=True)
    _step([_layer(2) for _ in range(4)], ref_x)
    layers = _chain(2)
    x = ref_x.detach().clone().requires_grad_()
    s0 = SwapManager().stats()
    _step(layers, x)
    SwapManager().synchronize()
    s1 = SwapManager().stats()
    assert torch.equal(x.grad, ref_x.grad)
    assert s1["offload_count"] - s0["offload_count"] == 6
    assert s1["reload_count"] - s0["reload_count"] == 6
    # Offload, release and reload batches of 1 KiB tensors: nothing ever waited in a queue.
    assert s1["inline_copies"] - s0["inline_copies"] >= 6
    assert s1["worker_wakeups"] == s0["worker_wakeups"]



# The hook stack is read, pushed and popped in C++ (at::SavedTensorDefaultHooks); these
# check it is the very stack saved_tensors_hooks uses and that torch's own rules hold.


def _probed_chain(tops, n=2):
    def layer(x):
        tops.append(_top())  # inside the region
        return torch.sin(torch.sin(x * 1.0))

    layers = [swap_wrapper(layer) for _ in range(n)]
    for a, b in zip(layers, layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    return layers


def _reference_grad(x, n):
    ref = x.detach().clone().requires_grad_()
    h = ref
    for _ in range(n):
        h = torch.sin(torch.sin(h * 1.0))
    h.sum().backward()
    return ref.grad


def test_region_pushes_on_the_stack_saved_tensors_hooks_uses(host_swap):
    outer_packed, tops = [], []
    layers = _probed_chain(tops)

    def outer_pack(t):
        outer_packed.append(t.shape)
        return t

    x = torch.randn(64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda t: t):
        h = layers[0](x)
        assert _top()[0] is outer_pack  # the region popped its own hook, not the user's
        h = layers[1](h)
        h = h * h  # outside every region: the user's hook packs it
    h.sum().backward()
    assert [type(top[0]) for top in tops] == [_C.PackHook, _C.PackHook]
    assert tops[0][1] is tops[1][1] is _C.unpack_hook
    assert outer_packed == [torch.Size([64]), torch.Size([64])]  # only h * h's two operands
    ref = x.detach().clone().requires_grad_()
    g = ref
    for _ in range(2):
        g = torch.sin(torch.sin(g * 1.0))
    (g * g).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert _top() is None


def test_user_hooks_inside_a_region_are_innermost_and_left_alone(host_swap):
    packed = []

    def inner_pack(t):
        packed.append(t.shape)
        return t

    def layer(x):
        x = torch.sin(x)
        with torch.autograd.graph.saved_tensors_hooks(inner_pack, lambda t: t):
            x = torch.cos(x)
        return torch.sin(x)

    a, b = swap_wrapper(layer), swap_wrapper(layer)
    SwapManager().set_forward_prefetch_layer(a, b)
    x = torch.randn(32, requires_grad=True)
    b(a(x)).sum().backward()
    assert packed == [torch.Size([32])] * 2  # cos's input in each layer, and only it
    ref = x.detach().clone().requires_grad_()
    layer(layer(ref)).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert _top() is None


def test_disabled_hooks_raise_torchs_error_and_leave_the_engine_usable(host_swap):
    tops = []
    layers = _probed_chain(tops)
    x = torch.randn(64, requires_grad=True)
    reason = "no hooks in this block, says the user"
    with torch.autograd.graph.disable_saved_tensors_hooks(reason):
        try:
            layers[0](x)
        except RuntimeError as e:
            assert reason in str(e)
        else:
            raise AssertionError("a swap region pushed hooks while they were disabled")
    assert tops == [] and _top() is None  # the layer never ran, nothing was left pushed
    grad = _step(layers, x).clone()
    assert torch.equal(grad, _reference_grad(x, 2))
    assert _top() is None
