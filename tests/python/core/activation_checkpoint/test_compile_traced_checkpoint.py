"""torch.compile(checkpoint_wrapper(block)): the wrapper is traced into one graph with no
break, routed to torch's compiled checkpoint, and keeps the eager policy's saving
(issue 12, item 1)."""

import contextlib
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, checkpoint, checkpoint_wrapper)

from hyper_parallel.core.activation_checkpoint import _compile

from ._compile_support import (
    CountingBackend, assert_same, fresh, graph_breaks, train_steps, twin_block, unique_graphs)

aten = torch.ops.aten
P = CheckpointPolicy
TP = torch_checkpoint.CheckpointPolicy

# Each of the five values on some op of TinyBlock (addmm x2, gelu, layer_norm, sin, mul);
# MUST_SWAP is kept on device under compile (with a warning), as eager does on the host
# without HYPER_PARALLEL_CPU_SWAP. The kept outputs are all read by backward: eager
# keeps whatever the policy says (also outputs backward never reads), the partitioner
# only what backward reads, so the bytes are equal only for such policies (see
# test_unread_outputs_are_not_saved_under_compile).
_FIVE = {"aten.native_layer_norm.default": P.MUST_SAVE, "aten.gelu.default": P.PREFER_SAVE,
         "aten.sin.default": P.MUST_RECOMPUTE, "aten.mul.Tensor": P.PREFER_RECOMPUTE,
         "aten.addmm.default": P.MUST_SWAP}
_FIVE_TORCH = {"aten.addmm.default": TP.MUST_SAVE, "aten.gelu.default": TP.PREFER_SAVE,
               "aten.native_layer_norm.default": TP.MUST_RECOMPUTE}


def five_values(ctx, op, *args, **kwargs):
    return _FIVE.get(str(op), P.PREFER_RECOMPUTE)


def torch_enum(ctx, op, *args, **kwargs):
    return _FIVE_TORCH.get(str(op), TP.PREFER_RECOMPUTE)


def save_addmm(ctx, op, *args, **kwargs):
    return op == aten.addmm.default  # a bool, as torch allows


CASES = {
    "full": {},
    "list": {"policy_fn": [aten.addmm]},
    "dict": {"policy_fn": {aten.gelu: P.MUST_SAVE, "*": P.PREFER_RECOMPUTE}},
    "callable_five_values": {"policy_fn": five_values},
    "callable_torch_enum": {"policy_fn": torch_enum},
    "callable_bool": {"policy_fn": save_addmm},
}


def _compiled_and_eager(kwargs, backend="aot_eager", steps=2):
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    eager = train_steps(checkpoint_wrapper(eager_block, **kwargs), x0, steps)
    counting = CountingBackend(backend)
    compiled = train_steps(torch.compile(checkpoint_wrapper(block, **kwargs),
                                         backend=counting), x0, steps)
    return eager, compiled, counting


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.filterwarnings("ignore:hyper_parallel. CheckpointPolicy.MUST_SWAP")
def test_one_graph_no_break_same_saving_bitwise(case):
    eager, compiled, counting = _compiled_and_eager(CASES[case])
    assert graph_breaks() == {}
    assert unique_graphs() == 1 and counting.compiles == 1
    assert counting.runs == 2  # the compiled graph ran at every step (no eager fallback)
    assert compiled[3] == eager[3], (compiled[3], eager[3])  # peak saved bytes
    assert_same(eager, compiled)


@pytest.mark.parametrize("policy", [P.MUST_SAVE, P.PREFER_SAVE])
def test_unread_outputs_are_not_saved_under_compile(policy):
    # The output of sin is not read by backward (d(0.5 * s)/ds is a constant): eager
    # caches it as told, the partitioner drops it, so compiled saves less, never more.
    def save_sin(ctx, op, *args, **kwargs):
        return policy if op == aten.sin.default else P.PREFER_RECOMPUTE

    eager, compiled, counting = _compiled_and_eager({"policy_fn": save_sin})
    full = _compiled_and_eager({})[0]
    assert counting.runs == 2 and compiled[3] == full[3] < eager[3]
    assert_same(eager, compiled)


def test_policy_saving_is_kept():
    # The saving is real: a saved addmm costs bytes over full checkpoint, and MUST_SAVE
    # of everything costs more again (the policy reaches torch's partitioner).
    full = _compiled_and_eager({})[1][3]
    some = _compiled_and_eager({"policy_fn": [aten.addmm]})[1][3]
    assert some > full


def test_context_fn_of_torch_selective_contexts():
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   [aten.addmm.default])
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    # Our eager list policy saves the same op outputs (torch's eager storage is not a
    # saved tensor, so it is compared against our eager policy, not its own eager run).
    eager = train_steps(checkpoint_wrapper(eager_block, policy_fn=[aten.addmm]), x0)
    counting = CountingBackend()
    compiled = train_steps(torch.compile(checkpoint_wrapper(block, context_fn=context_fn),
                                         backend=counting), x0)
    assert graph_breaks() == {} and unique_graphs() == 1 and counting.runs == 2
    assert compiled[3] == eager[3]
    assert_same(eager, compiled)


@pytest.fixture
def unwarned(monkeypatch):
    monkeypatch.setattr(_compile, "_warned", set())


def test_must_swap_is_reported_and_saved_on_device(unwarned):
    def swap_addmm(ctx, op, *args, **kwargs):
        return P.MUST_SWAP if op == aten.addmm.default else P.PREFER_RECOMPUTE

    with pytest.warns(UserWarning, match="MUST_SWAP has no compiled counterpart"):
        _, compiled, counting = _compiled_and_eager({"policy_fn": swap_addmm})
    saved = _compiled_and_eager({"policy_fn": [aten.addmm]})[0]
    assert counting.runs == 2 and compiled[3] == saved[3]  # kept like MUST_SAVE


def test_swap_inputs_is_reported(unwarned):
    with pytest.warns(UserWarning, match="swap_inputs=True has no compiled counterpart"):
        eager, compiled, _ = _compiled_and_eager({"swap_inputs": True})
    assert graph_breaks() == {}
    assert_same(eager, compiled)


def test_policy_and_context_fn_together_fail_clearly():
    fresh()
    _, block = twin_block()
    wrapper = checkpoint_wrapper(block, policy_fn=[aten.addmm], context_fn=lambda: (
        contextlib.nullcontext(), contextlib.nullcontext()))
    with pytest.raises(Exception, match="takes policy_fn or context_fn, not both"):
        torch.compile(wrapper, backend="aot_eager")(torch.randn(2, 8, requires_grad=True))


def test_context_fn_without_dispatch_modes_fails_clearly():
    fresh()
    _, block = twin_block()
    wrapper = checkpoint_wrapper(block, context_fn=lambda: (
        contextlib.nullcontext(), contextlib.nullcontext()))
    with pytest.raises(Exception, match="must return two TorchDispatchModes"):
        torch.compile(wrapper, backend="aot_eager")(torch.randn(2, 8, requires_grad=True))


def test_functional_checkpoint_and_wrapped_function_inside_a_compiled_function():
    fresh()
    eager_block, block = twin_block()
    x0 = torch.randn(4, 8)
    wrapped = checkpoint_wrapper(block.fc1, policy_fn=[aten.addmm])

    def f(blk, fc1):
        def run(x):
            h = checkpoint(blk, x, policy_fn=[aten.addmm])
            return wrapped(h) if fc1 is None else fc1(h)
        return run

    eager = train_steps(f(eager_block, eager_block.fc1), x0, params=eager_block.parameters())
    counting = CountingBackend()
    compiled = train_steps(torch.compile(f(block, None), backend=counting), x0,
                           params=block.parameters())
    assert graph_breaks() == {} and unique_graphs() == 1 and counting.runs == 2
    assert_same(eager, compiled)


def test_inductor():
    eager, compiled, counting = _compiled_and_eager({"policy_fn": [aten.addmm]},
                                                    backend="inductor")
    assert graph_breaks() == {} and counting.compiles == 1 and counting.runs == 2
    assert compiled[3] == eager[3]
    assert_same(eager, compiled, exact=False)


def test_functional_checkpoint_options_are_checked_under_compile():
    fresh()
    _, block = twin_block()
    f = torch.compile(lambda x: checkpoint(block, x, use_reentrant=True), backend="aot_eager")
    with pytest.raises(Exception, match="always non-reentrant"):
        f(torch.randn(2, 8, requires_grad=True))


@pytest.mark.parametrize("form", ["list", "callable"])
def test_our_contexts_given_to_torchs_checkpoint_under_compile(form):
    """torch.compile over torch's own checkpoint with context_fn = our
    create_selective_checkpoint_contexts: traced, torch's own selective modes decide with
    our policy (eager regions of this form are intercepted in C++ or by our modes, which
    torch cannot compile); gradients and saving as torch's own contexts give."""
    from hyper_parallel.core.activation_checkpoint import create_selective_checkpoint_contexts

    def ours_callable(ctx, op, *args, **kwargs):
        return P.MUST_SAVE if op is aten.addmm.default else P.PREFER_RECOMPUTE

    ours = [aten.addmm.default] if form == "list" else ours_callable

    def torchs(ctx, op, *args, **kwargs):
        return TP.MUST_SAVE if op is aten.addmm.default else TP.PREFER_RECOMPUTE

    results = []
    for contexts in (functools.partial(create_selective_checkpoint_contexts, ours),
                     functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                       torchs)):
        fresh()
        block, _ = twin_block()
        step = torch.compile(lambda x, block=block, contexts=contexts: torch_checkpoint.checkpoint(
            block, x, use_reentrant=False, context_fn=contexts), backend="aot_eager")
        results.append(train_steps(step, torch.randn(4, 8), params=block.parameters()))
    assert_same(results[0], results[1])
    assert results[0][3] == results[1][3]  # the same saved bytes


def test_a_full_recompute_region_is_torchs_own_compiled_checkpoint(monkeypatch):
    """No policy, context_fn or swap option: torch's compiled checkpoint as it is, with no
    context_fn (one made torch log its in-place advice for selective regions on every
    process, which torch's own checkpoint does not: a tester); with a policy, ours."""
    seen = []
    real = torch_checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append("context_fn" in kwargs)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_compile.torch_checkpoint, "checkpoint", spy)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)
    _compile.checkpoint(block, (x,), {})
    _compile.checkpoint(block, (x,), {}, policy_fn=[torch.ops.aten.mm])
    assert seen == [False, True]
