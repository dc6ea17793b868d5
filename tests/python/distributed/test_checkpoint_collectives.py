"""Collectives inside checkpoint regions are kept from the forward, never re-issued.

Two gloo ranks. Each rank runs two checkpoint regions that each exchange a tensor with
an all_to_all, then backpropagates them one at a time, rank 0 first region first, rank 1
the other way round. A recompute that re-issued the collectives would pair rank 0's
first region with rank 1's second one (equal sizes: silently wrong values). Gradients
must equal, bitwise, those of the same code without checkpoint; a policy that asks
MUST_RECOMPUTE for the collective gets the mispairing, which shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint

from ._launch import launch

pytestmark = pytest.mark.distributed


def _exchange(kind, t):
    if kind == "c10d":
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t)
        return out
    return funcol.wait_tensor(funcol.all_to_all_single(t, None, None, dist.group.WORLD))


def _region(kind, w):
    def f(x):
        h = x @ w
        # The exchanged values scale h: they are saved for backward, so a recompute that
        # mispaired the collective would change w's gradient.
        return (h * _exchange(kind, h.detach())).tanh()
    return f


def _recompute_collectives(ctx, op, *args, **kwargs):
    if op.namespace in ("c10d", "_c10d_functional"):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _run(rank, world_size, kind, mode):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    gen = torch.Generator().manual_seed(100 + rank)
    x1, x2 = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    f = _region(kind, w)
    if mode == "plain":
        call = f
    elif mode == "checkpoint":
        call = lambda x: checkpoint(f, x)  # noqa: E731
    elif mode == "selective":
        call = lambda x: checkpoint(f, x, policy_fn=[torch.ops.aten.mm])  # noqa: E731
    else:
        call = lambda x: checkpoint(f, x, policy_fn=_recompute_collectives)  # noqa: E731
    y1, y2 = call(x1), call(x2)
    first, second = (y1, y2) if rank == 0 else (y2, y1)
    first.sum().backward()
    second.sum().backward()
    return w.grad


@pytest.mark.parametrize("kind", ["c10d", "functional"])
def test_collectives_in_checkpoint_regions_are_not_reissued(kind):
    plain = launch(_run, kind, "plain")
    for mode in ("checkpoint", "selective"):
        got = launch(_run, kind, mode)
        for rank in range(2):
            assert torch.equal(got[rank], plain[rank]), (mode, rank)
    # Overridden by the policy: recompute re-issues them in each rank's backward order.
    mispaired = launch(_run, kind, "recompute_collectives")
    assert not torch.equal(mispaired[0], plain[0])
