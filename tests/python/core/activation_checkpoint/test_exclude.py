"""checkpoint_exclude_wrapper: parts of a checkpoint region that recompute does not run
(issue 16)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointError, CheckpointPolicy, checkpoint, checkpoint_exclude_wrapper,
    checkpoint_wrapper, is_recomputing)


class Router(nn.Module):
    """Stateful: counts its calls and the tokens it routed (must happen once per step)."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("tokens", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.tokens += x.shape[0]
        return torch.softmax(self.proj(x), -1)


class Block(nn.Module):
    def __init__(self, d=8, exclude=True, save_output=True):
        super().__init__()
        self.up = nn.Linear(d, d)
        router = Router(d)
        self.router = checkpoint_exclude_wrapper(router, save_output=save_output) if exclude \
            else router
        self.down = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return self.down(h * self.router(h)) + x


def _grads(model, x):
    x = x.detach().clone().requires_grad_()
    model(x).pow(2).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_excluded_part_runs_once_and_gradients_are_bitwise():
    torch.manual_seed(0)
    plain = Block(exclude=False)
    block = Block()
    block.load_state_dict(plain.state_dict())
    x = torch.randn(5, 8)
    want = _grads(plain, x)
    got = _grads(checkpoint_wrapper(block), x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    router = block.router._checkpoint_wrapped_module
    assert router.calls == 1 and int(router.tokens) == 5  # not replayed by the recompute


def test_without_exclusion_the_router_runs_twice():
    block = Block(exclude=False)
    _grads(checkpoint_wrapper(block), torch.randn(5, 8))
    # The Python side effect happens twice; the buffer write is already not replayed
    # (recompute never writes external state, issue 13).
    assert block.router.calls == 2 and int(block.router.tokens) == 5


def test_exclusion_with_a_policy_and_retain_graph():
    torch.manual_seed(1)
    plain = Block(exclude=False)
    block = Block()
    block.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    ref = plain(x).sum()
    want = torch.autograd.grad(ref, x, retain_graph=True)[0]
    out = checkpoint(block, x, policy_fn=[torch.ops.aten.mm, torch.ops.aten.addmm]).sum()
    g1 = torch.autograd.grad(out, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(out, x)[0]  # a second recompute replays from the start
    assert torch.equal(g1, want) and torch.equal(g2, want)
    assert block.router._checkpoint_wrapped_module.calls == 1


def test_excluded_function_called_twice_gets_each_output_back():
    calls = []

    def scale(t):
        calls.append(is_recomputing())
        return t * 3.0

    ex = checkpoint_exclude_wrapper(scale)
    x = torch.randn(6, requires_grad=True)
    out = checkpoint(lambda t: ex(ex(t.sin()).cos()).exp(), x)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    ((((xr.sin() * 3).cos()) * 3).exp()).sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert calls == [False, False]
    assert ex.save_output is True


def test_save_output_false_feeds_another_exclusion():
    def dispatch(t):
        return t * 2.0

    def combine(t):
        return t.sin()

    d = checkpoint_exclude_wrapper(dispatch, save_output=False)
    c = checkpoint_exclude_wrapper(combine)
    x = torch.randn(7, requires_grad=True)
    out = checkpoint(lambda t: c(d(t.tanh())).square(), x)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    ((xr.tanh() * 2.0).sin().square()).sum().backward()
    assert torch.equal(x.grad, xr.grad)


def test_an_op_reading_a_save_output_false_stand_in_raises_in_backward():
    """The output of a save_output=False exclusion feeding an ordinary op: recompute has no
    values for it, so the op must fail loudly (it used to read uninitialised memory and
    give wrong gradients without a word)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.out(torch.softmax(self.router(x), -1) * x)

    block = Block()
    block.router = checkpoint_exclude_wrapper(block.router, save_output=False)
    wrapped = checkpoint_wrapper(block)
    loss = wrapped(torch.randn(4, 8)).pow(2).sum()
    with pytest.raises(torch.utils.checkpoint.CheckpointError,
                       match=r"hyper_parallel: recompute ran aten\._softmax.*"
                             r"checkpoint_exclude_wrapper\(Linear, save_output=False\)"):
        loss.backward()
    assert all(p.grad is None for p in block.out.parameters())  # no gradient was written
    # the next step, with the exclusion used as documented, is right
    block.router = checkpoint_exclude_wrapper(block.router._checkpoint_wrapped_module)
    x = torch.randn(4, 8)
    wrapped(x).pow(2).sum().backward()
    ref = Block()
    ref.load_state_dict({k: v for k, v in block.state_dict().items()})
    ref(x).pow(2).sum().backward()
    for p, q in zip(block.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_kept_bytes_with_and_without_save_output():
    from hyper_parallel.core.activation_checkpoint import _exclude

    kept = []
    original = _exclude._Kept.__init__

    def spy(self, out, save_output, what):
        original(self, out, save_output, what)
        kept.append(self.value)

    _exclude._Kept.__init__ = spy
    combine = checkpoint_exclude_wrapper(lambda t: t.cos())
    try:
        for save in (True, False):
            ex = checkpoint_exclude_wrapper(lambda t: t * 2.0, save_output=save)
            x = torch.randn(256, requires_grad=True)
            checkpoint(lambda t: combine(ex(t.sin())).exp(), x).sum().backward()
    finally:
        _exclude._Kept.__init__ = original
    # kept[0], kept[2]: ex with save_output=True, then False; kept[1], kept[3]: combine's
    assert isinstance(kept[0].tensor, torch.Tensor) and kept[0].tensor.nbytes == 256 * 4
    assert not hasattr(kept[2], "tensor")  # only its shape is kept


def test_outside_checkpoint_it_is_a_plain_call():
    router = Router(4)
    ex = checkpoint_exclude_wrapper(router)
    y = ex(torch.randn(2, 4))
    assert y.shape == (2, 4) and router.calls == 1
    assert list(dict(ex.named_parameters())) == ["proj.weight", "proj.bias"]


def test_recompute_that_calls_it_more_often_raises():
    ex = checkpoint_exclude_wrapper(lambda t: t + 1)

    def fn(t):
        h = ex(t.sin())
        if is_recomputing():
            h = ex(h)
        return h.cos()

    out = checkpoint(fn, torch.randn(3, requires_grad=True), determinism_check="none")
    with pytest.raises(CheckpointError, match="hyper_parallel: checkpoint_exclude_wrapper"):
        out.sum().backward()


def test_bad_arguments():
    for err in (TypeError, ValueError):  # both: Python's convention and the reference's
        with pytest.raises(err, match="save_output must be a bool"):
            checkpoint_exclude_wrapper(nn.Linear(2, 2), save_output=1)
        with pytest.raises(err, match="module must be an nn.Module or a callable"):
            checkpoint_exclude_wrapper(3)


def test_reentrant_request_on_a_module_with_exclusions_runs_them_once():
    # torch's reentrant frame replays the whole body in backward: the router would run
    # twice. A module holding exclusions is checkpointed by our frame instead (warned).
    torch.manual_seed(0)
    block = Block()
    plain = Block(exclude=False)
    plain.load_state_dict(block.state_dict())
    x = torch.randn(4, 8)
    for wrapped in (checkpoint_wrapper(block, use_reentrant=True),
                    checkpoint_wrapper(nn.Sequential(nn.Identity(), block),
                                       use_reentrant=True)):
        block.router.calls = 0
        with pytest.warns(UserWarning, match="checkpointed with use_reentrant=False instead"):
            got = _grads(wrapped, x)
        assert all(torch.equal(a, b) for a, b in zip(got, _grads(plain, x)))
        assert block.router.calls == 1


def test_exclusion_a_reentrant_body_hides_refuses_instead_of_running_twice():
    # A plain function body cannot be looked into before it runs: the exclusion inside
    # raises before running (a collective must not run twice).
    calls = []

    def part(t):
        calls.append(1)
        return t * 2

    excluded = checkpoint_exclude_wrapper(part)
    with pytest.raises(CheckpointError, match="inside a use_reentrant=True checkpoint"):
        checkpoint(lambda t: excluded(t.sin()).cos(), torch.randn(3, requires_grad=True),
                   use_reentrant=True)
    assert calls == []


def test_deepcopy_keeps_working():
    block = Block()
    twin = copy.deepcopy(block)
    x = torch.randn(3, 8)
    for a, b in zip(_grads(checkpoint_wrapper(block), x), _grads(checkpoint_wrapper(twin), x)):
        assert torch.equal(a, b)
    assert twin.router._checkpoint_wrapped_module.calls == 1


class Nest(nn.Module):
    """A checkpointed block inside a checkpointed outer layer (regions nested)."""

    def __init__(self, d=8):
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.inner = Block(d)

    def forward(self, x):
        return torch.sin(self.inner(torch.tanh(self.pre(x))))


def test_nested_regions_run_the_part_once():
    """A region nested in a recomputed region runs its forward again; the excluded part in
    it must still not run (it gets the outer invocation's kept output), and the nested
    region's own recompute gets it back too."""
    torch.manual_seed(0)
    plain = Nest()
    model = copy.deepcopy(plain)
    router = model.inner.router
    plain.inner.router = router._checkpoint_wrapped_module.__class__(8)
    plain.inner.router.load_state_dict(router._checkpoint_wrapped_module.state_dict())
    x = torch.randn(5, 8)
    want = _grads(plain, x)
    model.inner = checkpoint_wrapper(model.inner)
    with pytest.warns(UserWarning, match="hyper_parallel"):  # nesting is warned about
        got = _grads(checkpoint_wrapper(model), x)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    inner = router._checkpoint_wrapped_module
    assert inner.calls == 1 and int(inner.tokens) == 5


def test_nested_function_regions_run_the_part_once():
    log = []
    ex = checkpoint_exclude_wrapper(lambda t: (log.append(is_recomputing()), t.softmax(-1))[1])
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(lambda t: checkpoint(lambda u: ex(u) * u, t).sin(), x).sum().backward()
    got = x.grad
    x.grad = None
    (lambda t: (t.softmax(-1) * t).sin())(x).sum().backward()
    assert log == [False] and torch.equal(got, x.grad)


class InPlaceAfter(nn.Module):
    """The region modifies the excluded part's output in place after it returns."""

    def __init__(self, d=8, exclude=True):
        super().__init__()
        self.router = checkpoint_exclude_wrapper(nn.Linear(d, d)) if exclude else nn.Linear(d, d)
        self.f = nn.Linear(d, d)

    def forward(self, x):
        r = self.router(x)
        r.mul_(2)
        return self.f(x) * r.sin()


@pytest.mark.parametrize("router_grad", [True, False])
def test_output_modified_in_place_after_the_part(router_grad):
    torch.manual_seed(0)
    plain = InPlaceAfter(exclude=False)
    model = InPlaceAfter()
    model.load_state_dict(plain.state_dict())  # wrapper names are clean
    for m in (plain, model):
        m.router.requires_grad_(router_grad)
    x = torch.randn(4, 8)
    want = _grads(plain, x)
    got = _grads(checkpoint_wrapper(model), x)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


def test_exclusions_under_debug_mode_warn_that_they_run_again():
    ex = checkpoint_exclude_wrapper(lambda t: t.softmax(-1))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="debug=True"):
        checkpoint(lambda t: ex(t) * t, x, debug=True).sum().backward()


def test_exclusions_in_a_compiled_checkpoint_region_warn_that_they_run_again():
    from hyper_parallel.core.activation_checkpoint import _compile

    _compile._warned.discard("checkpoint_exclude_wrapper")
    torch._dynamo.reset()
    block = torch.compile(checkpoint_wrapper(Block()), backend="aot_eager")
    with pytest.warns(UserWarning, match="torch.compile"):
        block(torch.randn(5, 8)).sum().backward()
