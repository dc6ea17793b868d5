"""swap / swap_wrapper / SwapManager schedule on the CPU swap backend (SPEC 2-4)."""

import copy
import gc
import threading

import pytest
import torch
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    saved_activation_memory,
    swap,
    swap_wrapper,
)

from ._models import Stack, assert_bitwise, grads, run_reversed_accumulation, twin

# Several tests swap a single unscheduled region on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")


def wrap_chain(model, **kwargs):
    layers = model.layers
    for i in range(len(layers)):
        layers[i] = swap_wrapper(layers[i], **kwargs)
    for i in range(len(layers) - 1):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    return model


def capture_groups(model):
    """Forward hooks on each wrapped block's first Linear record the running swap group."""
    groups = []
    for layer in model.layers:
        layer.fc1.register_forward_hook(lambda *a: groups.append(_C.current_group()))
    return groups


def test_chain_frees_all_but_last_layer_and_is_bitwise_equal(cpu_swap, dev):
    ref = Stack(layers=4).to(dev)
    model = wrap_chain(twin(ref))
    groups = capture_groups(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, 32, device=dev)
        groups.clear()
        loss = model(x)
        cpu_swap.synchronize()
        # End of forward: every swapped layer but the last released its saved storages.
        # The model input `x` is still referenced by this test, so it stays resident.
        first = [n for n in groups[0].storage_nbytes if n >= 0]
        assert sorted(first)[-1] == x.untyped_storage().nbytes() and sum(first) == x.nbytes
        for g in groups[1:-1]:
            sizes = [n for n in g.storage_nbytes if n >= 0]
            assert sizes and all(n == 0 for n in sizes), sizes
            assert set(g.residencies) <= {"offloading", "host"}
        assert all(n > 0 for n in groups[-1].storage_nbytes)
        loss_ref = ref(x)
        assert torch.equal(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_bitwise(grads(model), grads(ref))
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    assert_bitwise(list(model.parameters()), list(ref.parameters()))
    stats = SwapManager().stats()
    assert stats["offload_bytes"] > 0
    assert stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0  # the schedule prefetched everything


def test_stats_keys_and_reset():
    keys = {"offload_bytes", "offload_count", "reload_bytes", "reload_count", "resident_bytes",
            "peak_resident_bytes", "pinned_bytes_in_use", "pinned_bytes_cached", "fused_copies",
            "stall_seconds", "on_demand_reloads"}
    assert keys <= set(SwapManager().stats())
    assert SwapManager() is SwapManager()


class ViewsLayer(nn.Module):
    """Saves several views of one storage: transposed, offset slice, stride-0 expand."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        base = x @ self.w                      # (6, 6), a fresh storage
        t = base.t()                           # transposed view
        s = base[2:, 1:]                       # offset, non-contiguous view
        e = base[:1, :].expand(6, 6)           # stride-0 view
        return (t * t).sum() + (s * s.sin()).sum() + (e * e).sum()


def test_views_of_one_storage_are_copied_once_and_restored(cpu_swap, dev):
    torch.manual_seed(1)
    ref = ViewsLayer().to(dev)
    model = twin(ref)
    x = torch.randn(6, 6, requires_grad=True, device=dev)
    x2 = x.detach().clone().requires_grad_()
    out = swap(model, x2)  # unscheduled: offloaded at the end of forward, reloaded on demand
    stats = SwapManager().stats()
    # Saved: x and w (a leaf and a parameter: never swapped), three views of `base` (one
    # storage, copied once: 6*6 float32) and sin(s) (4*5 float32).
    assert stats["offload_count"] == 2
    assert stats["offload_bytes"] == 6 * 6 * 4 + 4 * 5 * 4
    out.backward()
    ref_out = ref(x)
    ref_out.backward()
    assert torch.equal(out, ref_out)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(model.w.grad, ref.w.grad)
    stats = SwapManager().stats()
    assert stats["reload_bytes"] == stats["offload_bytes"]


class SharedInputLayer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, shared):
        return self.lin(x) * shared + x


def test_shared_input_and_long_skip_stay_resident_while_needed(cpu_swap, dev):
    """A tensor read by every layer (like rotary embeddings) and a skip connection that
    a later forward op reads must never be freed while forward still needs them."""
    torch.manual_seed(2)
    layers = nn.ModuleList(SharedInputLayer() for _ in range(4)).to(dev)
    ref = copy.deepcopy(layers)
    for i in range(4):
        layers[i] = swap_wrapper(layers[i])
    for i in range(3):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])

    def run(mods, x):
        shared = torch.sigmoid(x * 0.5)  # activation shared by all layers
        skip = x * 2                      # read again after the stack
        h = x
        for m in mods:
            h = m(h, shared)
        return ((h + skip) * shared).sum()

    x = torch.randn(3, 16, requires_grad=True, device=dev)
    xr = x.detach().clone().requires_grad_()
    out, out_ref = run(layers, x), run(ref, xr)
    assert torch.equal(out, out_ref)
    out.backward()
    out_ref.backward()
    assert torch.equal(x.grad, xr.grad)
    assert_bitwise(grads(layers), grads(ref))
    assert SwapManager().stats()["deferred_frees"] > 0


class IntegerSaves(nn.Module):
    """Saves int64 indices (gather) and a bool mask (masked_fill/where)."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        idx = torch.argsort(h, dim=-1)                # int64, saved by gather
        g = torch.gather(h, -1, idx)
        mask = h > 0                                  # bool, saved by where
        return torch.where(mask, g, h * 0.1)


def test_integer_and_bool_saved_tensors_round_trip(cpu_swap, dev):
    torch.manual_seed(3)
    ref = IntegerSaves().to(dev)
    model = twin(ref)
    x = torch.randn(5, 16, device=dev)
    out = swap(model, x)
    assert SwapManager().stats()["offload_count"] >= 3
    out.sum().backward()
    ref(x).sum().backward()
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)


def test_parameters_buffers_and_host_tensors_untouched():
    # CPU swap off: host tensors are never swapped.
    model = Stack(layers=2)
    wrap_chain(model)
    model(torch.randn(2, 4, 32)).backward()
    assert SwapManager().stats()["offload_count"] == 0


def test_parameters_and_buffers_never_swapped(cpu_swap, dev):
    model = wrap_chain(Stack(layers=3).to(dev))
    loss = model(torch.randn(2, 4, 32, device=dev))
    cpu_swap.synchronize()
    for p in model.parameters():
        assert p.untyped_storage().nbytes() > 0
        assert _C.residency(p) is None
    for b in model.buffers():
        assert b.untyped_storage().nbytes() > 0
        assert _C.residency(b) is None
    loss.backward()


class _FrozenBlock(nn.Module):
    """State autograd saves that only the module walk can exclude: a frozen weight of a
    submodule reached twice (shared), a grandchild's buffer, and a buffer of the block."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.proj.weight.requires_grad_(False)
        self.again = self.proj  # the same submodule under a second name
        self.deep = nn.Sequential(nn.Module())
        self.deep[0].register_buffer("gain", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("scale", torch.full((16,), 2.0))
        self.register_module("empty", None)  # a None entry of _modules

    def forward(self, x):
        h = self.again(self.proj(x)) * self.scale  # mul saves the buffer
        return torch.sin(h * self.deep[0].gain)


def test_module_state_of_nested_and_shared_submodules_never_swapped(cpu_swap, dev):
    # The exclusion walk (C++, issue 17) reaches every parameter and buffer that
    # module.parameters() / buffers() yield: frozen weights, shared and nested submodules.
    ref = nn.Sequential(*[_FrozenBlock() for _ in range(3)]).to(dev)
    model = copy.deepcopy(ref)
    for i in range(3):
        model[i] = swap_wrapper(model[i])
    for a, b in zip(model, list(model)[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    x = torch.randn(4, 16, device=dev, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    cpu_swap.reset_stats()
    out = model(x)
    cpu_swap.synchronize()
    state = [*model.parameters(), *model.buffers()]
    assert len(state) == 3 * 4  # weight, bias, gain, scale per block
    for t in state:
        assert _C.residency(t) is None, "a parameter or buffer was given a swap record"
        assert t.untyped_storage().nbytes() > 0
    assert cpu_swap.stats()["offload_count"] > 0  # the activations were swapped
    out.sum().backward()
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)


class _UsesOuterState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.frozen = nn.Parameter(torch.rand(16) + 0.5, requires_grad=False)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x):
        return torch.sin(self.lin(x) * self.scale * self.frozen)  # mul saves both


@pytest.mark.parametrize("how", ["method", "lambda", "function_wrapper"])
def test_frozen_parameters_owned_elsewhere_are_never_swapped(cpu_swap, dev, how):
    # A region whose target is not the module that owns the state (its bound forward, a
    # closure, a function wrapper): no module walk can exclude it. Every nn.Parameter is
    # still never given a record (issue 17 tester F1); a buffer another object references
    # keeps its storage and values (it is never released while referenced).
    ref = _UsesOuterState().to(dev)
    m = copy.deepcopy(ref)
    x = torch.randn(4, 16, device=dev, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    if how == "method":
        out = swap(m.forward, x)
    elif how == "lambda":
        out = swap(lambda t: m(t), x)
    else:
        out = swap_wrapper(m.forward)(x)
    cpu_swap.synchronize()
    assert _C.residency(m.frozen) is None
    assert m.frozen.untyped_storage().nbytes() > 0 and m.scale.untyped_storage().nbytes() > 0
    assert _C.residency(m.scale) in (None, "device")  # referenced by m: never released
    out.sum().backward()
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(m.lin.weight.grad, ref.lin.weight.grad)
    assert torch.equal(m.scale, ref.scale) and torch.equal(m.frozen, ref.frozen)


def test_two_forwards_before_backward(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    x1, x2 = torch.randn(2, 4, 32, device=dev), torch.randn(2, 4, 32, device=dev)
    l1, l2 = model(x1), model(x2)          # two invocations per layer, two chains
    (l1 + l2).backward()
    (ref(x1) + ref(x2)).backward()
    assert_bitwise(grads(model), grads(ref))
    assert SwapManager().stats()["on_demand_reloads"] == 0


def test_gradient_accumulation_order_reversed(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    x1, x2 = torch.randn(2, 4, 32, device=dev), torch.randn(2, 4, 32, device=dev)
    run_reversed_accumulation(model, ref, x1, x2)
    assert_bitwise(grads(model), grads(ref))


def test_retain_graph_second_backward(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    x = torch.randn(2, 4, 32, device=dev)
    loss, loss_ref = model(x), ref(x)
    loss.backward(retain_graph=True)
    loss.backward()
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    assert_bitwise(grads(model), grads(ref))


def test_autograd_grad_with_subset_of_inputs(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    x = torch.randn(2, 4, 32, requires_grad=True, device=dev)
    xr = x.detach().clone().requires_grad_()
    (gx,) = torch.autograd.grad(model(x), [x])
    (gr,) = torch.autograd.grad(ref(xr), [xr])
    assert torch.equal(gx, gr)
    # Only the first layer's weight: the backward must still reach it through all layers.
    w = model.layers[0].fc1.weight
    (gw,) = torch.autograd.grad(model(x), [w])
    (gwr,) = torch.autograd.grad(ref(xr), [ref.layers[0].fc1.weight])
    assert torch.equal(gw, gwr)


class Boom(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.fail = False

    def forward(self, x):
        h = torch.relu(self.lin(x))
        if self.fail:
            raise RuntimeError("boom")
        return h


def test_exception_in_forward_leaves_nothing_installed(cpu_swap, dev):
    torch.manual_seed(4)
    layers = nn.ModuleList(Boom() for _ in range(3)).to(dev)
    ref = copy.deepcopy(layers)
    for i in range(3):
        layers[i] = swap_wrapper(layers[i])
    for i in range(2):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    layers[1].fail = True
    x = torch.randn(4, 32, device=dev)
    with pytest.raises(RuntimeError, match="boom"):
        h = x
        for m in layers:
            h = m(h)
    assert _C.current_group() is None
    # No hook left: a plain op's saved tensor is not packed by us.
    before = SwapManager().stats()["offload_count"]
    y = (torch.randn(3, requires_grad=True, device=dev) * torch.randn(3, device=dev)).sum()
    y.backward()
    gc.collect()
    layers[1].fail = False
    h, hr = x, x
    for m, r in zip(layers, ref):
        h, hr = m(h), r(hr)
    h.sum().backward()
    hr.sum().backward()
    assert_bitwise(grads(layers), grads(ref))
    assert SwapManager().stats()["offload_count"] > before


class FailingBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if FailingBackward.armed:
            raise RuntimeError("backward failed")
        return g


def test_backward_failing_half_way_then_next_step(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    x = torch.randn(2, 4, 32, device=dev)
    FailingBackward.armed = True
    loss = model(FailingBackward.apply(x.requires_grad_()))
    with pytest.raises(RuntimeError, match="backward failed"):
        loss.backward()
    FailingBackward.armed = False
    del loss
    gc.collect()
    cpu_swap.synchronize()
    assert SwapManager().stats()["pinned_bytes_in_use"] == 0  # no host block held
    model.zero_grad()
    xx = torch.randn(2, 4, 32, device=dev)
    model(xx).backward()
    ref(xx).backward()
    assert_bitwise(grads(model), grads(ref))


def test_deepcopied_model_has_its_own_schedule(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref))
    clone = copy.deepcopy(model)
    ids = [layer.__dict__["_hyper_parallel_layer"].layer_id for layer in model.layers]
    cids = [layer.__dict__["_hyper_parallel_layer"].layer_id for layer in clone.layers]
    assert not set(ids) & set(cids)
    assert all(_C.layer_scheduled(i) for i in cids)
    groups = capture_groups(clone)
    x = torch.randn(2, 4, 32, device=dev)
    loss = clone(x)
    cpu_swap.synchronize()
    assert all(n == 0 for n in groups[1].storage_nbytes if n >= 0)
    loss.backward()
    ref(x).backward()
    assert_bitwise(grads(clone), grads(ref))


def test_two_threads_drive_the_manager(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    models = [wrap_chain(twin(ref)) for _ in range(2)]
    refs = [twin(ref) for _ in range(2)]
    inputs = [torch.randn(2, 4, 32, device=dev) for _ in range(2)]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                models[i](inputs[i]).backward()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i in range(2):
        for _ in range(5):
            refs[i](inputs[i]).backward()
        assert_bitwise(grads(models[i]), grads(refs[i]))


class InPlaceAfterSave(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        y = h.sin()        # saves h
        h.mul_(2)          # modifies the saved tensor afterwards
        return y + h


def test_in_place_write_after_save_is_detected(cpu_swap, dev):
    out = swap(InPlaceAfterSave().to(dev), torch.randn(3, 8, device=dev))
    with pytest.raises(RuntimeError, match="hyper_parallel: .*modified by an in-place"):
        out.sum().backward()


def test_host_pool_steady_state_over_50_steps(cpu_swap, dev):
    model = wrap_chain(Stack(layers=3).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4, 32, device=dev)
    allocations = []
    for _ in range(50):
        model(x).backward()
        opt.step()
        opt.zero_grad()
        cpu_swap.synchronize()
        allocations.append(SwapManager().stats()["host_allocations"])
    assert allocations[-1] == allocations[2]  # no new host memory after warm-up
    assert SwapManager().stats()["host_reuses"] > 0
    assert SwapManager().stats()["pinned_bytes_in_use"] == 0


def test_group_swap_fuses_and_matches(cpu_swap, dev):
    ref = Stack(layers=3).to(dev)
    model = wrap_chain(twin(ref), group_swap=True)
    x = torch.randn(2, 4, 32, device=dev)
    model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))
    stats = SwapManager().stats()
    assert stats["fused_copies"] > 0
    assert stats["transfers"] < stats["offload_count"] + stats["reload_count"]


def test_policy_fn_keeps_small_tensors(cpu_swap, dev):
    ref = Stack(layers=2).to(dev)
    big = 4 * 8 * 32 * 4 * 4  # the fc1 output bytes
    seen = []

    def policy(t):
        seen.append(t.numel())
        return CheckpointPolicy.MUST_SWAP if t.numel() * t.element_size() >= big \
            else CheckpointPolicy.MUST_SAVE

    model = wrap_chain(twin(ref), policy_fn=policy)
    x = torch.randn(4, 8, 32, device=dev)
    model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))
    stats = SwapManager().stats()
    assert seen and 0 < stats["offload_count"] < len(seen)
    assert stats["offload_bytes"] % big == 0


def test_policy_fn_invalid_value_is_a_clear_error(cpu_swap, dev):
    model = swap_wrapper(nn.Linear(4, 4).to(dev), policy_fn=lambda t: CheckpointPolicy.MUST_RECOMPUTE)
    with pytest.raises(ValueError, match="hyper_parallel: the swap policy_fn returned"):
        model(torch.randn(2, 4, device=dev)).sum()
    assert _C.current_group() is None
    torch.nn.Linear(2, 2).to(dev)(torch.randn(1, 2, device=dev)).sum().backward()  # hooks are gone


def test_torch_checkpoint_policy_values_accepted(cpu_swap, dev):
    from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

    model = swap_wrapper(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(dev),
                         policy_fn=lambda t: TorchPolicy.MUST_CPU_OFFLOAD)
    model(torch.randn(2, 4, device=dev)).sum().backward()
    assert SwapManager().stats()["offload_count"] > 0


def test_unscheduled_swap_warns_and_reloads_on_demand(cpu_swap, dev):
    def block(x, w):
        return torch.tanh(torch.sin(x @ w))

    w = torch.randn(8, 8, requires_grad=True, device=dev)
    x = torch.randn(4, 8, device=dev)
    with pytest.warns(UserWarning, match="set_forward_prefetch_layer"):
        out = swap_wrapper(block)(x, w)
    out.sum().backward()
    g = w.grad.clone()
    w.grad = None
    block(x, w).sum().backward()
    assert torch.equal(g, w.grad)
    stats = SwapManager().stats()
    assert stats["offload_count"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) + 1.0, torch.tanh(self.b(x))


class InPlaceConsumer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair):
        h, g = pair
        h.add_(1)  # modifies the previous layer's output in place
        return torch.relu(self.lin(h + g))


def test_tuple_outputs_and_in_place_on_previous_output_prefetch(cpu_swap, dev):
    torch.manual_seed(5)
    first, second, third = (TupleOut().to(dev), InPlaceConsumer().to(dev),
                             nn.Sequential(nn.Linear(16, 16), nn.GELU()).to(dev))
    refs = copy.deepcopy([first, second, third])
    a, b, c = swap_wrapper(first), swap_wrapper(second), swap_wrapper(third)
    SwapManager().set_forward_prefetch_layer(a, b)
    SwapManager().set_forward_prefetch_layer(b, c)
    x = torch.randn(4, 16, device=dev)
    out = c(b(a(x))).sum()
    out_ref = refs[2](refs[1](refs[0](x))).sum()
    assert torch.equal(out, out_ref)
    out.backward()
    out_ref.backward()
    for m, r in zip((first, second, third), refs):
        assert_bitwise(grads(m), grads(r))
    assert SwapManager().stats()["on_demand_reloads"] == 0


def test_meter_shows_swap_saves_memory(cpu_swap, dev):
    ref = Stack(layers=4).to(dev)
    model = wrap_chain(twin(ref))
    x = torch.randn(4, 8, 32, device=dev)
    with saved_activation_memory() as m_ref:
        ref(x).backward()
    with saved_activation_memory() as m_swap:
        model(x).backward()
    assert m_ref.peak_bytes > 0
    assert m_swap.peak_bytes < 0.6 * m_ref.peak_bytes


def test_prefetch_depth_validation():
    with pytest.raises(ValueError, match="hyper_parallel: prefetch depth"):
        SwapManager().set_prefetch_depth(-1)


def test_prefetch_depth_two(cpu_swap, dev):
    SwapManager().set_prefetch_depth(2)
    ref = Stack(layers=4).to(dev)
    model = wrap_chain(twin(ref))
    x = torch.randn(2, 4, 32, device=dev)
    model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))
    assert SwapManager().stats()["on_demand_reloads"] == 0


def test_swap_inside_checkpoint_is_recomputed_not_swapped(cpu_swap, dev):
    """A swap region nested in a checkpoint's forward must not hide the checkpoint's
    saved-tensor hook: the checkpoint recomputes, gradients stay exact."""
    from hyper_parallel.core.activation_checkpoint import checkpoint

    ref = Stack(layers=2).to(dev)
    inner = twin(ref)
    x = torch.randn(2, 4, 32, device=dev)

    def run(m, x):
        h = x
        for layer in m.layers:
            h = swap(layer, h)
        return m.head(h).sum()

    out = checkpoint(run, inner, x)
    out.backward()
    ref(x).backward()
    assert_bitwise(grads(inner), grads(ref))
    assert SwapManager().stats()["offload_count"] == 0


def test_registered_plain_module_inside_checkpoint(cpu_swap, dev):
    from torch.utils.flop_counter import FlopCounterMode

    from hyper_parallel.core.activation_checkpoint import checkpoint

    ref = Stack(layers=2).to(dev)
    model = twin(ref)
    SwapManager().set_forward_prefetch_layer(model.layers[0], model.layers[1])
    x = torch.randn(2, 4, 32, device=dev)
    loss = checkpoint(model.layers[0], x)
    loss = model.head(model.layers[1](loss)).sum()
    with FlopCounterMode(display=False) as recompute:
        loss.backward()
    loss_ref = ref(x)
    with FlopCounterMode(display=False) as plain:
        loss_ref.backward()
    assert_bitwise(grads(model), grads(ref))
    assert recompute.get_total_flops() > plain.get_total_flops()  # layer 0 was recomputed


def test_exception_from_a_wrapped_layer_propagates_unchanged(cpu_swap, dev):
    # The wrappers run their region in one C++ call (_C.run_region): the layer's own
    # exception object (not a copy or a wrapped error) reaches the caller, and the next
    # step runs normally with bitwise gradients.
    class LayerFailure(Exception):
        pass

    failure = LayerFailure("layer 1 failed")
    fail = {"on": True}
    w = torch.randn(8, 8, device=dev, requires_grad=True)

    def layer(x):
        y = torch.tanh(x @ w)
        if fail["on"]:
            raise failure
        return y

    wrapped = [swap_wrapper(layer), swap_wrapper(layer)]
    SwapManager().set_forward_prefetch_layer(wrapped[0], wrapped[1])
    x = torch.randn(4, 8, device=dev)
    with pytest.raises(LayerFailure) as info:
        wrapped[1](wrapped[0](x))
    assert info.value is failure
    assert _C.current_group() is None
    fail["on"] = False
    (g,) = torch.autograd.grad(wrapped[1](wrapped[0](x)).sum(), [w])
    (gr,) = torch.autograd.grad(layer(layer(x)).sum(), [w])
    assert torch.equal(g, gr)


# ---------------------------------------------------------------- no plain storage
class _SparseLayer(nn.Module):
    """Saves sparse tensors for backward (torch.sparse.mm and a CSR matmul save their
    sparse operand), next to ordinary strided ones."""

    def __init__(self, layout):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.layout = layout

    def forward(self, x):
        h = torch.relu(self.lin(x))
        # A device without sparse kernels (hpsim) runs the sparse op on the host: its
        # dense tensors are still swapped, the host sparse one is skipped.
        host = x.device.type != "cpu"
        w = self.lin.weight.cpu() if host else self.lin.weight
        h = h.cpu() if host else h
        if self.layout == "coo":
            y = torch.sparse.mm(h.to_sparse(), w)
        else:
            y = h.to_sparse_csr() @ w
        return (y.to(x.device) * x).sum()


def _sparse_reference(layout, dev):
    torch.manual_seed(0)
    model = _SparseLayer(layout).to(dev)
    x = torch.randn(6, 8, device=dev, requires_grad=True)
    return model, x


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("how", ["swap", "swap_wrapper", "async_save_on_cpu"])
def test_sparse_saved_tensors_are_skipped_as_no_storage(cpu_swap, dev, layout, how):
    """Tester fault: 'Cannot access storage of SparseTensorImpl' from every swap path."""
    from hyper_parallel.core.activation_checkpoint import async_save_on_cpu

    ref, xr = _sparse_reference(layout, dev)
    ref(xr).backward()
    model, x = _sparse_reference(layout, dev)
    SwapManager().reset_stats()
    if how == "swap":
        out = swap(model, x)
    elif how == "swap_wrapper":
        out = swap_wrapper(model)(x)
    else:
        with async_save_on_cpu():
            out = model(x)
    out.backward()
    SwapManager().synchronize()
    assert torch.equal(out, ref(xr.detach()))
    assert torch.equal(x.grad, xr.grad)
    assert_bitwise(grads(model), grads(ref))
    no_storage = SwapManager().stats()["skipped"]["no_storage"]
    assert no_storage["count"] >= 1
    assert no_storage["bytes"] > 0  # a sparse tensor's index and value bytes


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:Sparse .* support")
def test_ineligible_reason_of_tensors_without_plain_storage(cpu_swap, dev):
    dense = torch.randn(4, 4)
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    for t in (dense.to_sparse(), torch.randn(4, 4).to_sparse_csr(),
              torch.randn(4, 4).to_sparse_csc(), torch.randn(4, 4).to_sparse_bsr((2, 2)),
              nested):
        assert _C.ineligible_reason(t) == "tensor without storage"
        assert _C.residency(t) is None
    assert _C.ineligible_reason(torch.empty(3, device="meta")) == "meta or fake tensor"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_saved_tensor_is_skipped_and_grads_match(cpu_swap):
    def fn(a):
        nt = torch.nested.as_nested_tensor([a[:2], a[2:]])
        return (nt * nt).to_padded_tensor(0.0).sum()

    x = torch.randn(5, 3, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    fn(xr).backward()
    SwapManager().reset_stats()
    swap(fn, x).backward()
    SwapManager().synchronize()
    assert torch.equal(x.grad, xr.grad)
    assert SwapManager().stats()["skipped"]["no_storage"]["count"] >= 1


def test_swap_group_swap_must_be_bool():
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"^hyper_parallel: swap's group_swap must be a bool "
                                            r"\(True or False\); got"):
            swap(model, x, group_swap=bad)
    with pytest.raises(TypeError, match=r"^hyper_parallel: swap_tensor_wrapper's group_swap "):
        from hyper_parallel.core.activation_checkpoint import swap_tensor_wrapper
        swap_tensor_wrapper(x, group_swap="yes")


# ---------------------------------------------------------------- one C++ call per region


def test_a_module_wrapper_that_raises_leaves_no_running_wrapper(cpu_swap, dev):
    # SwapWrapper.forward is one C++ call (_C.swap_forward, issue 17) that also keeps the
    # thread's stack of running wrappers: the layer's own exception object reaches the
    # caller, the stack is as it was, and the next step is bitwise.
    from hyper_parallel.core.activation_checkpoint import _wrappers

    class Failure(Exception):
        pass

    failure = Failure("block 1 failed")
    model = Stack(layers=3).to(dev)
    ref = twin(model)
    fail = {"on": True}

    def maybe_fail(module, args):
        if fail["on"]:
            raise failure

    model.layers[1].fc1.register_forward_pre_hook(maybe_fail)
    wrap_chain(model)
    x = torch.randn(4, 32, device=dev)
    with pytest.raises(Failure) as info:
        model(x)
    assert info.value is failure
    assert _wrappers._tls.__dict__.get("running", []) == []
    assert _C.current_group() is None
    fail["on"] = False
    model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))


def test_a_wrapper_called_inside_another_at_run_time_warns_once(cpu_swap):
    # Not nested in the module tree (no warning at wrapping time), but one wrapper's forward
    # calls the other: the C++ call path sees the running wrapper and warns, naming both.
    inner = swap_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return calls[0](self.fc(x))

    calls = [inner]
    outer = swap_wrapper(Outer())
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"swap_wrapper\(Sequential\) is nested inside "
                                         r"swap_wrapper\(Outer\)"):
        outer(x).sum().backward()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "hyper_parallel. swap region")
        outer(x).sum().backward()  # the pair was named once


def test_steady_state_regions_reuse_their_pack_hooks(cpu_swap, dev):
    # A region's pack hook stays referenced by autograd until the tensors saved under it
    # are freed; after that the next region reuses the object instead of making a new one
    # (issue 17): steady-state steps make none, and gradients stay bitwise.
    model = Stack(layers=6).to(dev)
    ref = twin(model)
    wrap_chain(model)
    x = torch.randn(4, 32, device=dev)
    for _ in range(2):
        model(x).backward()
    made = _C.region_counters()["pack_hooks_made"]
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(x).backward()
    assert _C.region_counters()["pack_hooks_made"] == made
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))
