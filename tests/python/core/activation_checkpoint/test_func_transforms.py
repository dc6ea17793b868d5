"""Regions inside torch.func transforms (_region.in_func_transform).

torch.func supports no saved-tensor hooks, so torch's own checkpoint raises inside
``torch.func.grad`` and ``vmap``. Ours runs the region's function plainly there (correct
gradients, no memory saved) and warns once; outside a transform the regions work as
before."""

import copy
import warnings

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    STRATEGIES,
    apply_activation_memory,
    checkpoint,
    checkpoint_wrapper,
    saved_activation_memory,
    swap,
    swap_wrapper,
)
from hyper_parallel.core.activation_checkpoint import _region

pytestmark = [
    pytest.mark.filterwarnings("ignore:hyper_parallel. a checkpoint or swap region runs inside "
                               "a torch.func transform"),
    pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning"),
]

W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def _f(t):
    return torch.sin(t @ W).tanh()


REGIONS = {
    "checkpoint": lambda t: checkpoint(_f, t),
    "selective": lambda t: checkpoint(_f, t, policy_fn=[torch.ops.aten.mm]),
    "checkpoint_swap_inputs": lambda t: checkpoint(_f, t, swap_inputs=True),
    "swap": lambda t: swap(_f, t),
    "swap_wrapper": swap_wrapper(_f),
    "checkpoint_wrapper": checkpoint_wrapper(_f),
}


@pytest.mark.parametrize("region", list(REGIONS))
def test_grad_and_vmap_through_a_region_match_the_plain_function(region, host_swap):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    call = REGIONS[region]
    want = torch.func.grad(lambda t: _f(t).sum())(x)
    got = torch.func.grad(lambda t: call(t).sum())(x)
    assert torch.equal(got, want)
    batched = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(torch.func.vmap(call)(batched), torch.func.vmap(_f)(batched))
    # jacrev (vjp inside) and the region still saving outside a transform afterwards
    assert torch.equal(torch.func.jacrev(call)(x[:1]), torch.func.jacrev(_f)(x[:1]))
    y = x.clone().requires_grad_()
    with saved_activation_memory() as meter:
        call(y).sum().backward()
    plain = x.clone().requires_grad_()
    _f(plain).sum().backward()
    assert torch.equal(y.grad, plain.grad)
    if region in ("checkpoint", "checkpoint_wrapper"):
        assert meter.peak_bytes < 4 * 8 * 4 * 2  # recomputed: only the input is kept


@pytest.mark.parametrize("plan", [s for s in STRATEGIES if s != "none"])
def test_functional_call_under_grad_of_a_model_with_a_plan(plan, host_swap):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    x = torch.randn(4, 8)

    def grads(m):
        params = dict(m.named_parameters())
        return torch.func.grad(
            lambda p: torch.func.functional_call(m, p, (x,)).square().sum())(params)

    want = grads(model)
    applied = copy.deepcopy(model)
    apply_activation_memory(applied, plan, layers=["0", "1", "2"])
    got = grads(applied)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_warns_once_with_the_prefix(monkeypatch):
    monkeypatch.setattr(_region, "_warned_func_transform", False)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.grad(lambda t: checkpoint(_f, t).sum())(x)
        torch.func.grad(lambda t: checkpoint(_f, t).sum())(x)
    mine = [w for w in caught if "torch.func transform" in str(w.message)]
    assert len(mine) == 1
    assert str(mine[0].message).startswith("hyper_parallel: ")
    assert mine[0].filename == __file__  # points at the caller, not the library


def test_outside_a_transform_nothing_is_reported():
    assert not _region.in_func_transform()
    seen = []
    torch.func.grad(lambda t: seen.append(_region.in_func_transform()) or _f(t).sum())(
        torch.randn(4, 8))
    assert seen == [True]
