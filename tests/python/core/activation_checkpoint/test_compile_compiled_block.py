"""checkpoint_wrapper(torch.compile(block)), checkpoint(torch.compile(f)) and
swap_wrapper(torch.compile(block)): the compiled graph runs in every forward and in every
recompute, and swap moves the compiled function's saved tensors (issue 12, item 2)."""

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import (
    checkpoint, checkpoint_wrapper, swap_wrapper)

from ._compile_support import (
    CountingBackend, assert_same, fresh, graph_breaks, train_steps, twin_block)

aten = torch.ops.aten


@pytest.mark.parametrize("kwargs", [{}, {"policy_fn": [aten.addmm]}], ids=["full", "list"])
def test_checkpoint_wrapper_of_a_compiled_block(kwargs):
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(checkpoint_wrapper(eager_block, **kwargs), x0, steps=3)
    counting = CountingBackend()
    compiled = train_steps(checkpoint_wrapper(torch.compile(block, backend=counting), **kwargs),
                           x0, steps=3)
    assert graph_breaks() == {} and counting.compiles == 1
    assert counting.runs == 6  # forward and recompute of every step ran compiled
    assert compiled[3] == eager[3]
    assert_same(eager, compiled)


def test_functional_checkpoint_of_a_compiled_function():
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    counting = CountingBackend()
    compiled_fn = torch.compile(lambda x: block(x), backend=counting)
    eager = train_steps(lambda x: checkpoint(eager_block, x), x0, steps=3,
                        params=eager_block.parameters())
    compiled = train_steps(lambda x: checkpoint(compiled_fn, x), x0, steps=3,
                           params=block.parameters())
    assert counting.compiles == 1 and counting.runs == 6
    assert compiled[3] == eager[3]
    assert_same(eager, compiled)


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
def test_swap_wrapper_of_a_compiled_block_swaps_its_saved_tensors(host_swap):
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(eager_block, x0, steps=1)
    counting = CountingBackend()
    compiled_block = torch.compile(block, backend=counting)
    saved_by_compiled = train_steps(compiled_block, x0, steps=1)[3]
    host_swap.reset_stats()
    compiled = train_steps(swap_wrapper(compiled_block), x0, steps=1)
    host_swap.synchronize()
    stats = host_swap.stats()
    assert counting.compiles == 1 and counting.runs == 2
    # Every byte the compiled block saves for backward went to the host and came back.
    assert stats["offload_bytes"] == saved_by_compiled > 0
    assert stats["reload_bytes"] == stats["offload_bytes"]
    assert_same(eager, compiled)


def test_inductor_block_inside_checkpoint_wrapper():
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(checkpoint_wrapper(eager_block), x0)
    counting = CountingBackend("inductor")
    compiled = train_steps(checkpoint_wrapper(torch.compile(block, backend=counting)), x0)
    assert counting.compiles == 1 and counting.runs == 4
    assert compiled[3] == eager[3]
    assert_same(eager, compiled, exact=False)
