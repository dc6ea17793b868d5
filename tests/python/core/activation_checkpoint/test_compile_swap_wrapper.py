"""torch.compile(swap_wrapper(block)): the body is one compiled graph; the region's entry
and exit are the only graph breaks, and the compiled body's saved tensors are swapped
(issue 12, item 3)."""

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

from ._compile_support import (
    CountingBackend, assert_same, fresh, graph_breaks, train_steps, twin_block, unique_graphs)


def _region_breaks() -> int:
    """Graph breaks at our region entry and exit; fails on any other break."""
    breaks = graph_breaks()
    ours = {k: v for k, v in breaks.items()
            if "swap_region_enter" in k or "swap_region_exit" in k}
    assert ours == breaks, list(breaks)
    return len(ours)


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
def test_body_compiled_breaks_only_at_region_entry_and_exit(host_swap):
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(eager_block, x0, steps=1)
    plain = CountingBackend()
    saved_by_compiled = train_steps(torch.compile(twin_block()[1], backend=plain), x0,
                                    steps=1)[3]
    fresh()
    counting = CountingBackend()
    compiled = train_steps(torch.compile(swap_wrapper(block), backend=counting), x0, steps=1)
    host_swap.synchronize()
    stats = host_swap.stats()
    assert _region_breaks() == 2
    assert unique_graphs() == 1 and counting.compiles == 1 and counting.runs == 1
    assert stats["offload_bytes"] == saved_by_compiled > 0
    assert stats["reload_bytes"] == stats["offload_bytes"]
    assert_same(eager, compiled)


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fail = False

    def forward(self, x):
        y = self.fc(x).sin()
        if self.fail:
            raise RuntimeError("boom")
        return y


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
def test_a_failing_body_leaves_nothing_installed(host_swap):
    fresh()
    boom = Boom()
    wrapper = torch.compile(swap_wrapper(boom), backend="aot_eager")
    x = torch.randn(2, 8, requires_grad=True)
    wrapper(x).sum().backward()
    boom.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        wrapper(x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert SwapManager().get_current_group_name() is None
    boom.fail = False
    grad = x.grad.clone()
    wrapper(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * grad)


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
def test_compiled_wrapper_takes_its_host_blocks_from_its_cpu_pool(host_swap):
    # torch.compile(swap_wrapper(block, cpu_pool=pool)) offloads into `pool` as eager does
    # (the region opened around the compiled body is given the pool), so its cap holds.
    from hyper_parallel.core.activation_checkpoint import PinnedMemoryPool

    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    pool = PinnedMemoryPool(1 << 20)
    engine_before = host_swap.stats()["pinned_bytes_in_use"]
    compiled = torch.compile(swap_wrapper(block, cpu_pool=pool), backend=CountingBackend())
    x = x0.clone().requires_grad_()
    out = compiled(x)
    host_swap.synchronize()
    assert pool.stats()["bytes_in_use"] > 0  # the offloaded activations are in the pool
    assert host_swap.stats()["pinned_bytes_in_use"] == engine_before
    out.sum().backward()
    host_swap.synchronize()
    assert pool.stats()["bytes_in_use"] == 0
    assert torch.equal(x.grad, train_steps(eager_block, x0, steps=1)[1])
    tiny = PinnedMemoryPool(256)  # smaller than one offloaded activation: refused as in eager
    fresh()
    with pytest.raises(RuntimeError, match="hyper_parallel: host pool full"):
        torch.compile(swap_wrapper(twin_block()[1], cpu_pool=tiny),
                      backend=CountingBackend())(x0.clone().requires_grad_()).sum().backward()


def test_a_chain_over_the_compiled_wrappers_links_the_wrappers_inside(host_swap):
    """Layers as they sit in the model after torch.compile(swap_wrapper(layer)) are torch's
    OptimizedModules; a chain declared over them linked nothing (a tester: every region
    warned it was in no prefetch schedule) unless given layer._orig_mod."""
    import warnings

    fresh()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        for _ in range(3))
    import copy

    plain = copy.deepcopy(layers)
    for i in range(3):
        layers[i] = torch.compile(swap_wrapper(layers[i]), backend="aot_eager")
    for a, b in zip(layers, layers[1:]):
        host_swap.set_forward_prefetch_layer(a, b)
    x = torch.randn(2, 4, 8)

    def run(stack):
        h = x
        for layer in stack:
            h = layer(h)
        h.square().mean().backward()
        return [p.grad for p in stack.parameters()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(layers)
    assert not [w for w in caught if "prefetch schedule" in str(w.message)]
    host_swap.synchronize()
    assert host_swap.stats()["on_demand_reloads"] == 0
    assert host_swap.stats()["offload_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, run(plain)))
    from hyper_parallel.core.activation_checkpoint._swap_manager import layer_node

    assert layer_node(layers[1]._orig_mod) is not None
    host_swap.unregister_forward_prefetch_layer(layers[1])  # through the compiled module
    assert layer_node(layers[1]._orig_mod) is None


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
def test_fullgraph_names_the_swap_region_and_what_to_do(host_swap):
    """fullgraph=True cannot hold a swap region's two graph breaks; dynamo's error used to
    say 'reason: None' and hint at removing a torch.compiler.disable call the user never
    wrote (a tester)."""
    fresh()
    _, block = twin_block()
    compiled = torch.compile(swap_wrapper(block), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"(?s)hyper_parallel: a swap region opens and closes "
                                        r"outside the compiled graph.*fullgraph=True"):
        compiled(torch.randn(4, 8))


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
@pytest.mark.parametrize("form", ["function_wrapper", "swap_call"])
def test_function_wrappers_and_swap_calls_compile_like_the_module_wrapper(form, host_swap):
    """A swap_wrapper'd function and a swap(block, x) call traced by dynamo: regions opened
    and closed around the compiled body, as for the module wrapper, where they fell into
    dynamo's fallback for a builtin it cannot trace (warnings about _C.swap_forward, a
    tester)."""
    import warnings

    from hyper_parallel.core.activation_checkpoint import swap

    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(eager_block, x0, steps=1)
    fresh()
    call = swap_wrapper(lambda t: block(t)) if form == "function_wrapper" else (
        lambda t: swap(block, t))
    compiled = torch.compile(call, backend="aot_eager")

    class Holder(torch.nn.Module):  # train_steps takes a module
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, t):
            return compiled(t)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_steps(Holder(), x0, steps=1)
    assert not [w for w in caught if "Dynamo does not know" in str(w.message)]
    host_swap.synchronize()
    assert host_swap.stats()["offload_bytes"] > 0
    assert_same(eager, got)
