"""Review fixes: op lookups in sets and dicts, attribute injection through a
wrapper, torch.utils.checkpoint's options and a malformed ``context_fn``."""

import contextlib
import copy
import itertools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_wrapper,
    swap_wrapper,
)

from ._models import OpsNet as Net

aten = torch.ops.aten
D = Net.D


def assert_same(got, ref):
    got, ref = list(got), list(ref)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()


def run_policy(policy, caches):
    """One checkpointed step vs the plain step (bitwise gradients); returns the region's
    (saved, recompute) entry counts."""
    net = Net()
    x = torch.randn(4, D, requires_grad=True)
    params = [x, *net.parameters()]
    ref = torch.autograd.grad(net(x).pow(2).sum(), params)
    out = checkpoint(net, x, policy_fn=policy)
    stats = caches[-1].stats()
    assert_same(torch.autograd.grad(out.pow(2).sum(), params), ref)
    return stats["saved_entries"], stats["recompute_entries"]


# ------------------------------------------------------------------ A. op lookups

@pytest.mark.parametrize("decide", [
    lambda op: op in {aten.addmm.default, aten.mm.default},
    lambda op: {aten.addmm.default: True, aten.mm.default: True}.get(op, False),
    lambda op: op in [aten.addmm.default, aten.mm.default],
    lambda op: op is aten.addmm.default or op is aten.mm.default,
    lambda op: op.overloadpacket in {aten.addmm, aten.mm},
    lambda op: {aten.addmm: True, aten.mm: True}.get(op.overloadpacket, False),
    lambda op: op.name() in {"aten::addmm", "aten::mm"},
    lambda op: str(op) in {"aten.addmm.default", "aten.mm.default"},
    lambda op: str(op.overloadpacket) in {"aten.addmm", "aten.mm"},
], ids=["set-overloads", "dict-overloads", "list-overloads", "identity", "set-packet-attr",
        "dict-packet-attr", "set-schema-name", "set-str", "set-packet-name"])
def test_policy_fn_lookup_forms_save_the_matmuls(decide, caches):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if decide(op) else CheckpointPolicy.PREFER_RECOMPUTE

    # addmm and mm saved; relu and tanh recomputed; gradients bitwise as without checkpoint.
    assert run_policy(policy, caches) == (2, 2)


# ------------------------------------------------------------------ B. wrapper setattr

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.gain = 2.0

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale * self.gain


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum()


@pytest.mark.parametrize("wrap", [checkpoint_wrapper, swap_wrapper])
def test_module_set_through_wrapper_replaces_the_inner_one(wrap):
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    for i in range(len(model.layers)):
        model.layers[i] = wrap(model.layers[i])
    torch.manual_seed(1)
    new_fc = nn.Linear(4, 4)
    ref.layers[0].fc = copy.deepcopy(new_fc)
    model.layers[0].fc = new_fc

    inner = model.layers[0]._checkpoint_wrapped_module
    assert inner.fc is new_fc and model.layers[0].fc is new_fc
    assert "fc" not in model.layers[0]._modules

    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    # (A parent's named_parameters() keeps the wrapper's child name, as with torch's own
    # checkpoint wrapper; state_dict() and the wrapper's named_parameters() strip it.)
    assert [n.replace("_checkpoint_wrapped_module.", "") for n in names] == \
        [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.layers[0].named_parameters()] == \
        [n for n, _ in ref.layers[0].named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert_same(model.state_dict().values(), ref.state_dict().values())

    x = torch.randn(3, 4)
    ref_loss, loss = ref(x), model(x)
    assert torch.equal(loss, ref_loss)
    ref_loss.backward()
    loss.backward()
    assert new_fc.weight.grad is not None
    assert_same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_parameter_buffer_and_tensor_set_through_wrapper():
    block = Block()
    wrapper = checkpoint_wrapper(block)
    weight = nn.Parameter(torch.eye(4))
    wrapper.fc.weight = weight  # attribute of a submodule: plain Python
    assert block.fc.weight is weight
    new_bias = nn.Parameter(torch.zeros(4))
    wrapper.fc.bias = new_bias
    scale = torch.full((4,), 3.0)
    wrapper.scale = scale  # buffer of the wrapped module
    assert block.scale is scale and "scale" in block._buffers
    assert "scale" not in wrapper._buffers and "scale" not in wrapper.__dict__
    wrapper.gain = 1.0
    assert block.gain == 1.0 and "gain" not in wrapper.__dict__
    assert list(wrapper.state_dict()) == list(block.state_dict())

    # A parameter of the wrapped module set through the wrapper.
    lin = nn.Linear(4, 4)
    lin_wrapper = checkpoint_wrapper(lin)
    new_w = nn.Parameter(torch.randn(4, 4))
    lin_wrapper.weight = new_w
    assert lin.weight is new_w and "weight" not in lin_wrapper._parameters
    x = torch.randn(2, 4, requires_grad=True)
    lin_wrapper(x).sum().backward()
    assert torch.equal(new_w.grad, torch.ones(2, 4).t() @ x.detach())

    # Forward uses what was set through the wrapper.
    x = torch.randn(3, 4)
    expected = torch.tanh(x @ weight.t() + new_bias) * scale * 1.0
    assert torch.equal(wrapper(x), expected)


def test_wrapper_keeps_own_and_new_attributes():
    block = Block()
    wrapper = checkpoint_wrapper(block)
    wrapper._hp_private = 1  # wrapper's own private state
    assert wrapper.__dict__["_hp_private"] == 1 and not hasattr(block, "_hp_private")
    extra = nn.Linear(4, 4)
    wrapper.extra = extra  # a name the wrapped module lacks: on the wrapper
    assert wrapper._modules["extra"] is extra and not hasattr(block, "extra")
    wrapper.extra = nn.Linear(4, 4)  # the wrapper owns it now: stays there
    assert wrapper._modules["extra"] is not extra and not hasattr(block, "extra")
    del wrapper.extra
    assert "extra" not in wrapper._modules
    wrapper.eval()
    assert not wrapper.training and not block.training


def test_delattr_through_wrapper_acts_on_wrapped_module():
    block = Block()
    wrapper = checkpoint_wrapper(block)
    del wrapper.gain
    assert not hasattr(block, "gain")
    del wrapper.fc
    assert "fc" not in block._modules
    with pytest.raises(AttributeError):
        del wrapper.missing


# ------------------------------------------------------------------ C. torch's options

def plain_grads(fn, x, params):
    return torch.autograd.grad(fn(x).pow(2).sum(), [x, *params])


def test_use_reentrant_false_is_accepted():
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    x = torch.randn(3, D, requires_grad=True)
    ref = plain_grads(lin, x, lin.parameters())
    for kwargs in ({"use_reentrant": False}, {"use_reentrant": None}):
        out = checkpoint(lin, x, **kwargs)
        assert_same(torch.autograd.grad(out.pow(2).sum(), [x, *lin.parameters()]), ref)
    out = checkpoint(lin, x, use_reentrant=False, policy_fn=[aten.addmm])
    assert_same(torch.autograd.grad(out.pow(2).sum(), [x, *lin.parameters()]), ref)


def test_use_reentrant_true_with_our_options_is_a_clear_error():
    lin = nn.Linear(D, D)
    x = torch.randn(3, D, requires_grad=True)
    with pytest.raises(ValueError, match="^hyper_parallel: use_reentrant=True .*policy_fn"):
        checkpoint(lin, x, use_reentrant=True, policy_fn=[torch.ops.aten.addmm])
    with torch.no_grad(), pytest.raises(ValueError, match="^hyper_parallel: .*swap_inputs"):
        checkpoint(lin, x, use_reentrant=True, swap_inputs=True)
    with pytest.raises(ValueError, match="^hyper_parallel: .*non-reentrant"):
        checkpoint_wrapper(lin, use_reentrant=True, early_stop=False)


def test_checkpoint_wrapper_accepts_torch_options():
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    ref_lin = copy.deepcopy(lin)
    wrapper = checkpoint_wrapper(lin, use_reentrant=False, preserve_rng_state=True,
                                 determinism_check="none")
    x = torch.randn(3, D, requires_grad=True)
    ref = plain_grads(ref_lin, x, ref_lin.parameters())
    out = wrapper(x)
    assert_same(torch.autograd.grad(out.pow(2).sum(), [x, *lin.parameters()]), ref)


def dropout_fn(x):
    return torch.nn.functional.dropout(x.sin(), p=0.5, training=True).pow(2)


def test_preserve_rng_state_reaches_torch():
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(3)
    ref, = torch.autograd.grad(dropout_fn(x).sum(), x)
    torch.manual_seed(3)
    out = checkpoint(dropout_fn, x, preserve_rng_state=True)
    got, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(got, ref)
    # Without the RNG state replayed the recompute draws another mask: other gradients
    # (what torch.utils.checkpoint does with preserve_rng_state=False).
    torch.manual_seed(3)
    out = checkpoint(dropout_fn, x, preserve_rng_state=False)
    torch.manual_seed(3)
    out_t = torch_checkpoint.checkpoint(dropout_fn, x, use_reentrant=False,
                                        preserve_rng_state=False)
    assert torch.equal(out, out_t) and torch.equal(out, dropout_fn_seeded(x, 3))
    torch.manual_seed(4)
    got, = torch.autograd.grad(out.sum(), x)
    torch.manual_seed(4)
    got_t, = torch.autograd.grad(out_t.sum(), x)
    assert not torch.equal(got, ref)
    assert torch.equal(got, got_t)


def dropout_fn_seeded(x, seed):
    torch.manual_seed(seed)
    return dropout_fn(x)


def shape_changing_fn():
    """sin saves an input of shape [8] in forward and [1, 8] in recompute (the gradient
    is the same after autograd sums it back to [8])."""
    calls = itertools.count()

    def fn(x):
        if next(calls) == 0:
            return torch.sin(x)
        return torch.sin(x.reshape(1, 8)).reshape(8)

    return fn


def test_determinism_check_reaches_torch():
    x = torch.randn(8, requires_grad=True)
    out = checkpoint(shape_changing_fn(), x)
    with pytest.raises(torch_checkpoint.CheckpointError, match="different metadata"):
        torch.autograd.grad(out.sum(), x)
    out = checkpoint(shape_changing_fn(), x, determinism_check="none")
    got, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(got, x.detach().cos())
    with pytest.raises(ValueError, match="^hyper_parallel: .*determinism_check"):
        checkpoint(torch.sin, x, determinism_check="strict")


def test_debug_reaches_torch():
    x = torch.randn(8, requires_grad=True)
    lin = nn.Linear(8, 8)
    ref = plain_grads(lin, x, lin.parameters())
    out = checkpoint(lin, x, debug=True)
    assert_same(torch.autograd.grad(out.pow(2).sum(), [x, *lin.parameters()]), ref)
    out = checkpoint(shape_changing_fn(), x, debug=True)
    with pytest.raises(torch_checkpoint.CheckpointError, match="original forward"):
        torch.autograd.grad(out.sum(), x)


def test_debug_with_policy_or_context_fn_is_a_clear_error():
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(ValueError, match="^hyper_parallel: .*debug"):
        checkpoint(torch.sin, x, debug=True, policy_fn=[aten.sin])
    with pytest.raises(ValueError, match="^hyper_parallel: .*debug"):
        checkpoint(torch.sin, x, debug=True,
                   context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    with pytest.raises(ValueError, match="^hyper_parallel: .*debug"):
        checkpoint_wrapper(nn.Linear(8, 8), debug=True, policy_fn=[aten.addmm])
    with torch_checkpoint.set_checkpoint_debug_enabled(True):
        with pytest.raises(ValueError, match="^hyper_parallel: .*debug"):
            checkpoint(torch.sin, x, policy_fn=[aten.sin])


def test_function_kwargs_still_reach_the_function():
    def fn(x, *, scale, shift=0.0):
        return x * scale + shift

    x = torch.randn(4, requires_grad=True)
    out = checkpoint(fn, x, scale=torch.tensor(2.0), shift=1.0, use_reentrant=False)
    assert torch.equal(out, x * 2.0 + 1.0)
    got, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(got, torch.full((4,), 2.0))


# ------------------------------------------------------------------ C. context_fn result

@pytest.mark.parametrize("result", [
    3,
    None,
    (contextlib.nullcontext(),),
    (contextlib.nullcontext(), contextlib.nullcontext(), contextlib.nullcontext()),
    (contextlib.nullcontext(), 5),
    ("a", contextlib.nullcontext()),
], ids=["int", "none", "one", "three", "second-not-cm", "first-not-cm"])
@pytest.mark.parametrize("with_policy", [False, True])
def test_context_fn_bad_result_is_a_clear_type_error(result, with_policy):
    lin = nn.Linear(D, D)
    x = torch.randn(3, D, requires_grad=True)
    kwargs = {"policy_fn": [aten.addmm]} if with_policy else {}
    with pytest.raises(TypeError, match="^hyper_parallel: checkpoint context_fn"):
        checkpoint(lin, x, context_fn=lambda: result, **kwargs)


@pytest.mark.parametrize("with_policy", [False, True])
def test_context_fn_good_result_runs_both_contexts(with_policy):
    entered = []

    @contextlib.contextmanager
    def mark(tag):
        entered.append(tag)
        yield

    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    x = torch.randn(3, D, requires_grad=True)
    ref = plain_grads(lin, x, lin.parameters())
    kwargs = {"policy_fn": [aten.addmm]} if with_policy else {}
    for as_list in (False, True):
        entered.clear()

        def context_fn():
            pair = (mark("forward"), mark("recompute"))
            return list(pair) if as_list else pair

        out = checkpoint(lin, x, context_fn=context_fn, **kwargs)
        assert entered == ["forward"]
        got = torch.autograd.grad(out.pow(2).sum(), [x, *lin.parameters()])
        assert_same(got, ref)
        assert entered == ["forward", "recompute"]


def test_use_reentrant_true_delegates_to_torchs_reentrant_checkpoint():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(3, D, requires_grad=True)
    torch.manual_seed(1)
    want = lin(x)
    want.sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in lin.parameters()]
    x.grad = None
    lin.zero_grad()
    torch.manual_seed(1)
    out = checkpoint(lin, x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"  # torch's frame
    out.sum().backward()
    assert torch.equal(out, want)
    for a, b in zip([x.grad] + [p.grad for p in lin.parameters()], want_grads):
        assert torch.equal(a, b)
    wrapped = checkpoint_wrapper(lin, use_reentrant=True)
    assert type(wrapped(x).grad_fn).__name__ == "CheckpointFunctionBackward"
