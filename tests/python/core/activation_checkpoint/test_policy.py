"""Selective checkpoint policies: every form and every value, with real inputs (SPEC 2)."""

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint
from hyper_parallel.core.activation_checkpoint import _selective
from hyper_parallel.core.activation_checkpoint._selective import compile_policy

from ._models import OpsNet as Net

D = Net.D


def decisions(cache):
    """(saved, swapped, recompute) entries of a region's cache, read after its forward."""
    s = cache.stats()
    return s["saved_entries"], s["swapped_entries"], s["recompute_entries"]


def run(policy, caches=None):
    """Checks one checkpointed step against the same step without checkpoint (bitwise
    gradients); returns the region's decisions when ``caches`` (the fixture) is given."""
    net = Net()
    x = torch.randn(4, D, requires_grad=True)
    params = [x, *net.parameters()]
    ref = torch.autograd.grad(net(x).pow(2).sum(), params)
    out = checkpoint(net, x, policy_fn=policy)
    seen = decisions(caches[-1]) if caches else None
    got = torch.autograd.grad(out.pow(2).sum(), params)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    return seen


def forward_once(policy):
    net = Net()
    return checkpoint(net, torch.randn(4, D, requires_grad=True), policy_fn=policy)


# ------------------------------------------------------------------ every value is legal

@pytest.mark.parametrize("value, kind", [
    (CheckpointPolicy.MUST_SAVE, "saved"),
    (CheckpointPolicy.PREFER_SAVE, "saved"),
    (CheckpointPolicy.MUST_RECOMPUTE, "recompute"),
    (CheckpointPolicy.PREFER_RECOMPUTE, "recompute"),
    (CheckpointPolicy.MUST_SWAP, "swapped"),
    (True, "saved"),
    (False, "recompute"),
    (torch_checkpoint.CheckpointPolicy.MUST_SAVE, "saved"),
    (torch_checkpoint.CheckpointPolicy.PREFER_SAVE, "saved"),
    (torch_checkpoint.CheckpointPolicy.MUST_RECOMPUTE, "recompute"),
    (torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE, "recompute"),
    (torch_checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD, "swapped"),
    (torch_checkpoint.CheckpointPolicy.PREFER_CPU_OFFLOAD, "swapped"),
])
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_every_policy_value_is_honoured(value, kind, caches, host_swap):
    def policy(ctx, op, *args, **kwargs):
        return value if op == torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    # The region records addmm, relu, mm and tanh; addmm follows `value`, the rest recompute.
    expected = {"saved": (1, 0, 3), "swapped": (0, 1, 3), "recompute": (0, 0, 4)}[kind]
    assert run(policy, caches) == expected


def test_bool_results_match_torch_semantics(caches):
    # True: MUST_SAVE, False: PREFER_RECOMPUTE
    assert run(lambda ctx, op, *a, **k: op == torch.ops.aten.mm.default, caches) == (1, 0, 3)


# ------------------------------------------------------------------ invalid results

@pytest.mark.parametrize("bad", [7, "MUST_SAVE", None, 1.0, CheckpointPolicy])
def test_invalid_result_is_a_value_error_naming_op_and_value(bad):
    with pytest.raises(ValueError) as info:
        forward_once(lambda ctx, op, *a, **k: bad)
    msg = str(info.value)
    assert msg.startswith("hyper_parallel: policy_fn for op aten.addmm.default returned ")
    assert repr(bad) in msg
    assert "CheckpointPolicy" in msg


def test_invalid_result_in_recompute_is_also_rejected():
    def policy(ctx, op, *args, **kwargs):
        return "oops" if ctx.is_recompute else CheckpointPolicy.PREFER_RECOMPUTE

    out = forward_once(policy)
    with pytest.raises(ValueError, match="hyper_parallel: policy_fn for op .* returned 'oops'"):
        out.sum().backward()


# ------------------------------------------------------------------ lists of ops

@pytest.mark.parametrize("ops, saved", [
    ([torch.ops.aten.addmm.default], 1),               # one overload
    ([torch.ops.aten.addmm], 1),                       # packet: every overload
    ([torch.ops.aten.addmm, torch.ops.aten.mm], 2),
    (("aten.addmm.default", "aten.mm"), 2),             # names, tuple
    ({"aten::mm"}, 1),                                  # schema spelling, set
    ([], 0),                                            # nothing saved: full recompute
])
def test_list_saves_exactly_those_ops(ops, saved, caches):
    assert run(ops, caches) == (saved, 0, 4 - saved)  # of addmm, relu, mm, tanh


def test_packet_matches_every_overload():
    table = compile_policy([torch.ops.aten.mm]).table
    for overload in torch.ops.aten.mm.overloads():
        assert table.lookup(f"aten.mm.{overload}") == CheckpointPolicy.MUST_SAVE
    assert table.lookup("aten.addmm.default") == CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("item, pattern", [
    ("aten.mmm", r"no op named 'aten\.mmm' is registered"),
    ("aten.mm.nope", r"'aten\.mm' has no overload 'nope'"),
    ("mm", r"'mm' is not an op name"),
    ("LayerNormExt", r"'LayerNormExt' is not an op name"),
    (torch.nn.functional.linear, r"is not an op.*policy sees the ATen ops"),
    (42, r"42 is not an op"),
])
def test_list_entries_that_would_match_nothing_are_rejected(item, pattern):
    with pytest.raises(ValueError, match="hyper_parallel: policy_fn list: .*" + pattern):
        forward_once([item])


def test_list_policy_makes_no_python_call_per_op(monkeypatch, caches):
    def forbidden(*args, **kwargs):
        raise AssertionError("a Python policy call happened")

    monkeypatch.setattr(_selective, "SelectiveCheckpointContext", forbidden)
    monkeypatch.setattr(_selective, "to_policy", forbidden)
    assert run([torch.ops.aten.mm], caches) == (1, 0, 3)


# ------------------------------------------------------------------ dict tables

def test_dict_maps_ops_to_policies_with_a_default(caches, host_swap):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = run({torch.ops.aten.addmm: CheckpointPolicy.MUST_SWAP, "aten.mm.default": True},
                    caches)
        second = run({"aten.addmm": torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE,
                      "*": CheckpointPolicy.MUST_SAVE}, caches)
    assert first == (1, 1, 2)
    assert second == (3, 0, 1)  # "*" saves every op not listed: relu, mm and tanh


def test_dict_with_an_invalid_value_names_the_entry():
    with pytest.raises(ValueError, match=r"hyper_parallel: policy_fn entry 'aten\.mm' returned "
                                         r"'save'"):
        forward_once({"aten.mm": "save"})


def test_other_policy_types_are_type_errors():
    with pytest.raises(TypeError, match="hyper_parallel: policy_fn must be a callable"):
        forward_once(123)


def test_table_object_can_be_passed_directly(caches):
    table = _C.OpPolicyTable(CheckpointPolicy.PREFER_RECOMPUTE)
    table.set("aten.mm", CheckpointPolicy.PREFER_SAVE)
    assert run(table, caches) == (1, 0, 3)
    assert "aten.mm" in repr(table)


# ------------------------------------------------------------------ what the policy sees

def test_policy_sees_op_names_and_is_recompute():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((ctx.is_recompute, str(op), op.name(), ctx.op_output is not None))
        return CheckpointPolicy.MUST_SAVE if str(op) == "aten.addmm.default" else False

    out = forward_once(policy)
    forward_calls = list(seen)
    assert [c[1] for c in forward_calls] == ["aten.addmm.default", "aten.relu.default",
                                             "aten.mm.default", "aten.tanh.default"]
    # op.name() is torch's schema name, as torch's own selective checkpoint shows it.
    assert [c[2] for c in forward_calls] == ["aten::addmm", "aten::relu", "aten::mm",
                                             "aten::tanh"]
    assert all(not c[0] and c[3] for c in forward_calls)
    seen.clear()
    out.sum().backward()
    # Recompute asks again with is_recompute=True (the forward decision is replayed).
    assert seen and all(c[0] and not c[3] for c in seen)
    assert "aten.addmm.default" in [c[1] for c in seen]


def test_policy_context_is_an_instance_of_torchs_context():
    # A policy written for torch may check isinstance(ctx, SelectiveCheckpointContext).
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(isinstance(ctx, torch.utils.checkpoint.SelectiveCheckpointContext))
        return op is torch.ops.aten.addmm.default

    forward_once(policy).sum().backward()
    assert len(seen) > 4 and all(seen)  # forward and recompute


def test_policy_receives_torchs_own_op_overload():
    ops = []

    def policy(ctx, op, *args, **kwargs):
        ops.append(op)
        return op is torch.ops.aten.addmm.default

    forward_once(policy)
    op = ops[0]
    # The very object torch's selective checkpoint passes: every idiom behaves as there.
    assert op is torch.ops.aten.addmm.default and isinstance(op, torch._ops.OpOverload)
    assert op in {torch.ops.aten.addmm.default} and op == torch.ops.aten.addmm.default
    assert op.name() == "aten::addmm" and str(op) == "aten.addmm.default"
    assert op.overloadpacket is torch.ops.aten.addmm


def test_stateful_policy_counting_forward_calls(caches):
    count = {"mm": 0}

    def every_other_matmul(ctx, op, *args, **kwargs):
        if op not in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if ctx.is_recompute:
            return CheckpointPolicy.PREFER_RECOMPUTE  # the forward decision is replayed anyway
        count["mm"] += 1
        return CheckpointPolicy.MUST_SAVE if count["mm"] % 2 else CheckpointPolicy.MUST_RECOMPUTE

    assert run(every_other_matmul, caches) == (1, 0, 3)
    assert count["mm"] == 2  # the region's two matmuls, in forward only


def test_mutating_view_and_random_ops_are_never_cached(caches):
    names = []

    def save_everything(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            names.append(str(op))
        # (outputs written in place later in the region, like mul's by relu_ below, are
        # recomputed instead)
        return CheckpointPolicy.PREFER_SAVE

    w = torch.randn(D, D, requires_grad=True)

    def fn(x):
        h = torch.nn.functional.dropout(x @ w, 0.5)  # native_dropout: random
        h = h.t().contiguous().t()                    # t: views; clone (contiguous) copies
        h = (h * 2).relu_()                           # in place
        return torch.tanh(h)

    x = torch.randn(4, D, requires_grad=True)
    torch.manual_seed(11)
    g_ref = torch.autograd.grad(fn(x).sum(), [x, w])
    torch.manual_seed(11)
    g = torch.autograd.grad(checkpoint(fn, x, policy_fn=save_everything).sum(), [x, w])
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)
    # Random ops are asked too (a cached one replays its RNG step in recompute).
    assert {"aten.mm.default", "aten.tanh.default", "aten.bernoulli_.float"} - set(names) == {
        "aten.bernoulli_.float"}  # in place: never asked
    assert not any(n.startswith(("aten.t.", "aten.relu_", "aten.detach")) for n in names), names
