"""ignore_sac_ops: ops that selective checkpoint passes through untouched (issue 16)."""

import warnings

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, checkpoint, ignore_sac_ops, is_recomputing)
from hyper_parallel.core.activation_checkpoint import _ignored_ops

_lib = torch.library.Library("hp_ignored_test", "DEF")
_lib.define("tick(Tensor x) -> Tensor")
_lib.impl("tick", lambda x: x.clone(), "CompositeExplicitAutograd")
_lib.define("tock(Tensor x) -> Tensor")
_lib.impl("tock", lambda x: x.clone(), "CompositeExplicitAutograd")


def _save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _region(op, x, extra_in_recompute):
    h = x.sin()
    op(h)  # bookkeeping: its output is unused
    if is_recomputing() and extra_in_recompute:
        op(h)  # runs a different number of times in recompute
    return (h * 2).cos()


def _grad(op, extra):
    x = torch.linspace(-1, 1, 16, requires_grad=True)
    out = checkpoint(_region, op, x, extra, policy_fn=_save_all)
    (g,) = torch.autograd.grad(out.sum(), x)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(((xr.sin() * 2).cos()).sum(), xr)
    return g, want


def test_an_op_that_runs_more_often_in_recompute_breaks_replay_unless_ignored():
    with pytest.raises(RuntimeError):
        _grad(torch.ops.hp_ignored_test.tick.default, True)
    ignore_sac_ops([torch.ops.hp_ignored_test.tick.default, None])
    g, want = _grad(torch.ops.hp_ignored_test.tick.default, True)
    assert torch.equal(g, want)
    assert _ignored_ops.is_sac_ignored(torch.ops.hp_ignored_test.tick.default)


def test_a_packet_ignores_every_overload():
    assert not _ignored_ops.is_sac_ignored(torch.ops.hp_ignored_test.tock.default)
    ignore_sac_ops([torch.ops.hp_ignored_test.tock])
    assert _ignored_ops.is_sac_ignored(torch.ops.hp_ignored_test.tock.default)
    g, want = _grad(torch.ops.hp_ignored_test.tock.default, True)
    assert torch.equal(g, want)


def test_default_set_covers_fsdp_and_profiler_namespaces():
    import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp)

    assert _ignored_ops.is_sac_ignored(torch.ops.profiler._record_function_enter_new.default)
    assert _ignored_ops.is_sac_ignored(torch.ops.profiler._record_function_exit._RecordFunction)
    fsdp = getattr(torch.ops, "fsdp", None)
    if fsdp is not None and hasattr(fsdp, "all_gather_copy_in"):
        assert _ignored_ops.is_sac_ignored(fsdp.all_gather_copy_in.default)
    assert not _ignored_ops.is_sac_ignored(torch.ops.aten.mm.default)


def test_record_function_inside_a_selective_region():
    x = torch.randn(8, requires_grad=True)

    def fn(t):
        with torch.profiler.record_function("inside"):
            h = t.exp()
        if is_recomputing():
            with torch.profiler.record_function("only-in-recompute"):
                pass
        return h.sin()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checkpoint(fn, x, policy_fn=_save_all)
        (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(g, x.exp().cos() * x.exp())


def test_bad_entries_add_nothing():
    with pytest.raises(TypeError, match="hyper_parallel: ignore_sac_ops got 'aten.mm'"):
        ignore_sac_ops([torch.ops.aten.sin.default, "aten.mm"])
    assert not _ignored_ops.is_sac_ignored(torch.ops.aten.sin.default)
    with pytest.raises(TypeError, match="expects an iterable"):
        ignore_sac_ops(3)
