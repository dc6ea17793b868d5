"""Nothing our wrappers do per call (the manager singleton and its lock, group lookups,
thread-local region stacks, the schedule, stats) breaks a graph or recompiles on later
steps (issue 12, item 4)."""

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    checkpoint_wrapper, swap_tensor_wrapper, swap_wrapper)

from ._compile_support import CountingBackend, TinyBlock, fresh, graph_breaks, unique_graphs

aten = torch.ops.aten


class Registering(TinyBlock):
    """Registers a tensor with the current swap group (per call, inside the region)."""

    def forward(self, x):
        return swap_tensor_wrapper(super().forward(x))


def _model(order: str) -> nn.ModuleList:
    torch.manual_seed(0)
    if order == "traced":  # compile(wrapper(layer))
        layers = nn.ModuleList([swap_wrapper(Registering()), checkpoint_wrapper(TinyBlock()),
                                checkpoint_wrapper(TinyBlock(), policy_fn=[aten.addmm])])
    else:  # wrapper(compile(layer))
        layers = nn.ModuleList([Registering(), TinyBlock(), TinyBlock()])
    return layers


@pytest.mark.filterwarnings("ignore:hyper_parallel")
@pytest.mark.parametrize("order", ["traced", "compiled_inside"])
def test_later_steps_neither_break_nor_recompile(order, host_swap):
    fresh()
    counting = CountingBackend()
    layers = _model(order)
    if order == "traced":
        for layer in layers:
            layer.compile(backend=counting)
    else:
        for layer in layers:
            layer.compile(backend=counting)
        layers = nn.ModuleList([swap_wrapper(layers[0]), checkpoint_wrapper(layers[1]),
                                checkpoint_wrapper(layers[2], policy_fn=[aten.addmm])])
    for a, b in zip(layers, layers[1:]):
        host_swap.set_forward_prefetch_layer(a, b)
    x0 = torch.randn(4, 8)

    def step():
        x = x0.clone().requires_grad_()
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        host_swap.stats()
        return x.grad

    first = step()
    compiles, graphs, breaks, runs = counting.compiles, unique_graphs(), graph_breaks(), \
        counting.runs
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            host_swap.reset_stats()
            assert torch.equal(step(), first)
    assert counting.compiles == compiles and unique_graphs() == graphs
    assert graph_breaks() == breaks
    assert counting.runs == 3 * runs  # every step ran the same compiled graphs
    host_swap.synchronize()
    assert host_swap.stats()["offload_bytes"] > 0  # the first layer was swapped in the last step
