"""Scheduled recompute: handles, sessions, prefired recompute (issue 16)."""

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.core.activation_checkpoint import (
    CheckpointError, RecomputeHandle, checkpoint, checkpoint_wrapper, clear_recompute_session,
    get_recompute_state, is_recomputing, recompute_handle, recompute_handle_collector_ctx,
    recompute_session_ctx)
from hyper_parallel.core.activation_checkpoint import _scheduled


def _block(calls):
    def block(x, w):
        calls.append(is_recomputing())
        return F.gelu(x @ w)
    return block


def _reference(x, w):
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    return torch.autograd.grad(F.gelu(xr @ wr).sum(), (xr, wr))


def test_without_session_a_split_backward_recomputes_twice():
    calls = []
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = checkpoint(_block(calls), x, w)
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    torch.autograd.grad(out.sum(), w)
    assert calls == [False, True, True]  # torch's frame: one recompute per graph task


def test_prefired_recompute_serves_dx_and_dw():
    calls = []
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ex, ew = _reference(x, w)
    with recompute_handle_collector_ctx() as handles:
        out = checkpoint(_block(calls), x, w)
    assert len(handles) == 1 and isinstance(handles[0], RecomputeHandle)
    sid = ("micro-batch", 0)
    try:
        with recompute_session_ctx(sid, retain_on_unpack=True):
            assert recompute_handle(handles[0], sid) is True
            assert calls == [False, True]  # ran now, before any backward
            assert recompute_handle(handles[0], sid) is False  # once per session
            dx = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
            dw = torch.autograd.grad(out.sum(), w)[0]
    finally:
        clear_recompute_session(sid)
    assert calls == [False, True]
    assert torch.equal(dx, ex) and torch.equal(dw, ew)


def test_one_session_serves_several_regions_and_frees_on_last_read():
    calls = []
    x = torch.randn(4, 4, requires_grad=True)
    w1, w2 = torch.randn(4, 6, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    refs = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    expected = torch.autograd.grad(F.silu(F.gelu(refs[0] @ refs[1]) @ refs[2]).sum(), refs)

    def second(h, w):
        calls.append("second")
        return F.silu(h @ w)

    with recompute_handle_collector_ctx() as handles:
        h = checkpoint(_block(calls), x, w1)
        out = checkpoint(second, h, w2)
    sid = "two-regions"
    for handle in handles:
        recompute_handle(handle, sid)
    with recompute_session_ctx(sid, retain_on_unpack=True):
        dx = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    with recompute_session_ctx(sid, retain_on_unpack=False):
        dw1, dw2 = torch.autograd.grad(out.sum(), (w1, w2))
    clear_recompute_session(sid)
    clear_recompute_session(sid)  # twice is fine
    assert calls == [False, "second", True, "second"]
    for got, want in zip((dx, dw1, dw2), expected):
        assert torch.equal(got, want)
    assert _scheduled.session_count() == 0


def test_session_without_prefire_recomputes_once_for_both_passes():
    calls = []
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ex, ew = _reference(x, w)
    with recompute_handle_collector_ctx():
        out = checkpoint(_block(calls), x, w)
    with recompute_session_ctx(7, retain_on_unpack=True):
        dx = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
        dw = torch.autograd.grad(out.sum(), w)[0]
    clear_recompute_session(7)
    assert calls == [False, True]
    assert torch.equal(dx, ex) and torch.equal(dw, ew)


def test_forward_inside_a_session_retains_for_dx_then_dw_without_prefire():
    # A schedule that runs the forward inside the session (no collector, no prefire): the
    # first backward of the session recomputes, the second reads what it kept.
    calls = []
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ex, ew = _reference(x, w)
    with recompute_session_ctx("mb", retain_on_unpack=True):
        out = checkpoint(_block(calls), x, w)
    with recompute_session_ctx("mb", retain_on_unpack=True):
        dx = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    assert calls == [False, True]
    with recompute_session_ctx("mb", retain_on_unpack=False):
        dw = torch.autograd.grad(out.sum(), w)[0]
    clear_recompute_session("mb")
    assert calls == [False, True]
    assert torch.equal(dx, ex) and torch.equal(dw, ew)
    assert _scheduled.session_count() == 0


def test_handle_recompute_method_is_recompute_handle():
    calls = []
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ex, ew = _reference(x, w)
    with recompute_handle_collector_ctx() as handles:
        out = checkpoint(_block(calls), x, w)
    assert handles[0].recompute("h") is True and handles[0].recompute("h") is False
    with recompute_session_ctx("h", retain_on_unpack=True):
        dx, dw = torch.autograd.grad(out.sum(), (x, w))
    clear_recompute_session("h")
    assert calls == [False, True]
    assert torch.equal(dx, ex) and torch.equal(dw, ew)


def test_repeated_steps_do_not_share_sessions():
    calls = []
    w = torch.randn(4, 4, requires_grad=True)
    block = checkpoint_wrapper(_block(calls))
    for step in range(3):
        x = torch.randn(4, 4, requires_grad=True)
        ex, ew = _reference(x, w)
        with recompute_handle_collector_ctx() as handles:
            out = block(x, w)
        recompute_handle(handles[0], ("step", step))
        with recompute_session_ctx(("step", step), retain_on_unpack=True):
            dx = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
        with recompute_session_ctx(("step", step)):
            dw = torch.autograd.grad(out.sum(), w)[0]
        clear_recompute_session(("step", step))
        assert torch.equal(dx, ex) and torch.equal(dw, ew)
    assert calls == [False, True] * 3


def test_prefire_replays_dropout_rng():
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(3)
    want = F.dropout(x, 0.5, training=True)
    (gx,) = torch.autograd.grad(want.sum(), x)
    torch.manual_seed(3)
    with recompute_handle_collector_ctx() as handles:
        out = checkpoint(lambda t: F.dropout(t, 0.5, training=True) * 1.0, x)
    torch.randn(100)  # the global RNG moves on before the prefire
    recompute_handle(handles[0], "rng")
    with recompute_session_ctx("rng"):
        (got,) = torch.autograd.grad(out.sum(), x)
    clear_recompute_session("rng")
    assert torch.equal(out, want) and torch.equal(got, gx)


def test_no_handle_without_grad_or_on_failure():
    with recompute_handle_collector_ctx() as handles:
        with torch.no_grad():
            checkpoint(lambda t: t.sin(), torch.ones(3))

        def boom(t):
            raise RuntimeError("forward failed")
        with pytest.raises(RuntimeError, match="forward failed"):
            checkpoint(boom, torch.ones(3, requires_grad=True))
    assert handles == []


def test_dead_handle_is_a_noop_and_bad_arguments_are_clear():
    with recompute_handle_collector_ctx() as handles:
        out = checkpoint(lambda t: t.sin(), torch.ones(3, requires_grad=True))
    out.sum().backward()
    del out
    assert not handles[0].alive
    for i in range(50):  # a dead handle creates no session (they would pile up)
        assert recompute_handle(handles[0], ("gone", i)) is False
    assert _scheduled.session_count() == 0
    # Wrong kinds raise an error that is a TypeError and a ValueError (the reference's type).
    for err in (TypeError, ValueError):
        with pytest.raises(err, match="hyper_parallel: recompute_handle's handle must be "
                                      "produced by recompute_handle_collector_ctx"):
            recompute_handle(object(), "s")
        with pytest.raises(err, match="session_id must be hashable"):
            recompute_handle(handles[0], ["list"])
        with pytest.raises(err, match="retain_on_unpack must be bool"):
            with recompute_session_ctx("s", retain_on_unpack=1):
                pass
    for call in (lambda: recompute_handle(handles[0], None),
                 lambda: recompute_session_ctx(None).__enter__()):
        with pytest.raises(ValueError, match="session_id must not be None"):
            call()
    assert _scheduled.session_count() == 0  # nothing was created by the refused calls
    with recompute_session_ctx("a"):
        with pytest.raises(RuntimeError, match="sessions do not nest"):
            with recompute_session_ctx("b"):
                pass
    for sid in ("s", "a", "b"):
        clear_recompute_session(sid)


def test_recompute_state_in_forward_and_recompute():
    seen = []

    def fn(t):
        state = get_recompute_state()
        seen.append((state is not None, state.is_recomputing, is_recomputing()))
        return t.sin()

    assert get_recompute_state() is None and not is_recomputing()
    out = checkpoint(fn, torch.ones(3, requires_grad=True))
    out.sum().backward()
    assert seen == [(True, False, False), (True, True, True)]
    assert get_recompute_state() is None


def test_checkpoint_error_is_torchs():
    assert CheckpointError is torch.utils.checkpoint.CheckpointError
    assert issubclass(CheckpointError, RuntimeError)
