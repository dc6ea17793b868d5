"""apply_activation_memory under DistributedDataParallel (torch's DDP, the most common data
parallel wrapper).

Two gloo ranks on CPU with the CPU swap backend. Every plan is compared bitwise with the
same DDP model without a plan: DDP's reducer all-reduces gradients from hooks that fire
during backward, while recompute and reloads run inside the same backward, so any
reordering or a gradient produced twice would show. Also DDP's options that interact with
recompute (static_graph, find_unused_parameters), gradient accumulation under no_sync(),
and a plan applied to ``ddp.module`` after DDP was built.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ._launch import Stack, assert_equal_runs, batch, launch, loss_of, param_name, train, twin

pytestmark = pytest.mark.distributed

STEPS = 3
LAYERS = ["layers.0", "layers.1", "layers.2"]
PLANS = ["checkpoint", "selective", "swap", "mixed", "selective_swap", "checkpoint_swap"]


def _rank_inputs(rank, world_size):
    return [batch(s).chunk(world_size)[rank] for s in range(STEPS)]


def _ddp_plan(rank, world_size, plan, options, apply_after):
    from hyper_parallel.core.activation_checkpoint import SwapManager, apply_activation_memory

    base = Stack()
    inputs = _rank_inputs(rank, world_size)
    reference = train(DDP(twin(base), **options), inputs)
    model = twin(base)
    if apply_after:
        ddp = DDP(model, **options)
        apply_activation_memory(ddp.module, plan, layers=LAYERS)
    else:
        apply_activation_memory(model, plan, layers=LAYERS)
        ddp = DDP(model, **options)
    SwapManager().reset_stats()
    run = train(ddp, inputs)
    assert_equal_runs(run, reference, f"DDP {plan} {options} vs DDP")
    SwapManager().synchronize()
    return SwapManager().stats()["offload_bytes"]


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_under_ddp_matches_plain_ddp(plan):
    offloaded = launch(_ddp_plan, plan, {}, False)
    swaps = plan in ("swap", "mixed", "selective_swap", "checkpoint_swap")
    assert all((b > 0) == swaps for b in offloaded), offloaded


@pytest.mark.parametrize("options", [{"static_graph": True}, {"find_unused_parameters": True},
                                     {"gradient_as_bucket_view": True}],
                         ids=["static_graph", "find_unused", "bucket_view"])
@pytest.mark.parametrize("plan", ["checkpoint", "selective", "swap"])
def test_ddp_options(plan, options):
    launch(_ddp_plan, plan, options, False)


@pytest.mark.parametrize("plan", ["checkpoint", "swap"])
def test_a_plan_applied_to_the_module_of_a_built_ddp(plan):
    launch(_ddp_plan, plan, {}, True)


def _ddp_no_sync(rank, world_size, plan):
    from hyper_parallel.core.activation_checkpoint import apply_activation_memory

    base = Stack()
    micro = [batch(s).chunk(world_size)[rank].chunk(2) for s in range(STEPS)]

    def accumulate(model):
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        grads = []
        for first, second in micro:
            with ddp.no_sync():  # no all-reduce for the first micro-batch
                loss_of(ddp(first)).backward()
            loss_of(ddp(second)).backward()
            grads.append({param_name(n): p.grad.clone() for n, p in ddp.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        return grads

    want = accumulate(twin(base))
    model = twin(base)
    apply_activation_memory(model, plan, layers=LAYERS)
    got = accumulate(model)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), (plan, step, name)


@pytest.mark.parametrize("plan", ["checkpoint", "selective_swap"])
def test_gradient_accumulation_under_no_sync(plan):
    launch(_ddp_no_sync, plan)
