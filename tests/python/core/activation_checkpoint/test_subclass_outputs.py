"""Selective checkpoint caching tensor-subclass outputs on the Python-mode path
(_subclass_outputs.py): a callable policy sees a subclass's ops (DTensor's) before the
subclass unwraps them, and the C++ cache holds plain tensors only. Tested with torch's
TwoTensor (a traceable wrapper subclass, as DTensor is) on one process; the 2-rank TP
test covers DTensor (tests/python/distributed/test_tensor_parallel.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
TwoTensor = two_tensor.TwoTensor
MM = torch.ops.aten.mm.default


def _two(*shape, seed):
    a = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return TwoTensor(a, a * 2)


def _save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func is MM
        return func(*args, **(kwargs or {}))


def _grads(fn, x, w, count=False, retain=False):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(x, w).sum()
    counter = _CountMM()
    with counter if count else _nothing():
        out.backward(retain_graph=retain)
    if retain:
        first = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        out.backward()
        assert all(torch.equal(a, b) for a, b in zip(first, (x.grad, w.grad)))
    return (x.grad, w.grad), counter.mm


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _block(t, w):
    return torch.sin(t @ w).tanh()


def _same(a, b):
    return all(torch.equal(p.a, q.a) and torch.equal(p.b, q.b) for p, q in zip(a, b))


@pytest.mark.parametrize("retain", [False, True])
def test_cached_subclass_output_is_handed_back_not_recomputed(retain):
    x, w = _two(4, 8, seed=0), _two(8, 8, seed=1)
    want, _ = _grads(_block, x, w)
    got, mm_selective = _grads(lambda t, v: checkpoint(_block, t, v, policy_fn=_save_mm), x, w,
                               count=True, retain=retain)
    _, mm_full = _grads(lambda t, v: checkpoint(_block, t, v), x, w, count=True)
    assert _same(got, want)
    assert mm_full - mm_selective == 1  # the forward's mm ran again under full recompute only


def test_written_later_in_the_forward_is_recomputed_with_the_write():
    def block(t, w):
        h = t @ w
        h.mul_(2)  # the cached output is written in the same forward
        return torch.sin(h)

    x, w = _two(4, 8, seed=0), _two(8, 8, seed=1)
    want, _ = _grads(block, x, w)
    got, _ = _grads(lambda t, v: checkpoint(block, t, v, policy_fn=_save_mm), x, w)
    assert _same(got, want)


def test_written_after_the_forward_raises_or_is_handed_back_when_allowed():
    kept = []

    def block(t, w):
        h = t @ w
        kept.append(h)
        return torch.sin(h)

    x, w = _two(4, 8, seed=0).requires_grad_(), _two(8, 8, seed=1).requires_grad_()
    out = checkpoint(block, x, w, policy_fn=_save_mm)
    with torch.no_grad():
        kept[-1].add_(1)
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the output of aten\.mm\.default "
                                           r"\(call #0\) that selective checkpoint cached was "
                                           r"modified in place"):
        out.sum().backward()
    out = checkpoint(block, x, w, policy_fn=_save_mm, allow_cache_entry_mutation=True)
    with torch.no_grad():
        kept[-1].add_(1)
    out.sum().backward()  # the written value is handed back (torch's meaning)


def test_plain_and_subclass_calls_of_one_op_keep_their_call_indices():
    """mm on plain tensors (the C++ cache) then twice on TwoTensor (this table): the
    recompute's calls the C++ cache hands back were not counted here, so the third mm got
    the second's output (a tester: silently wrong gradients, max error 16.9)."""

    def block(p, wp, t, w1, w2):
        a = torch.sin(p @ wp)
        b = torch.sin(t @ w1)
        c = torch.sin(t @ w2)
        return a.sum() + (b * c).sum()

    def grads(call):
        p = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)).requires_grad_()
        wp = torch.randn(8, 8, generator=torch.Generator().manual_seed(6)).requires_grad_()
        t, w1, w2 = (_two(*shape, seed=s).requires_grad_()
                     for shape, s in (((4, 8), 1), ((8, 8), 2), ((8, 8), 3)))
        call(p, wp, t, w1, w2).backward()
        return [p.grad, wp.grad, t.grad.a, t.grad.b, w1.grad.a, w1.grad.b, w2.grad.a,
                w2.grad.b]

    want = grads(block)
    got = grads(lambda *a: checkpoint(block, *a, policy_fn=_save_mm))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
