"""checkpoint(): full and selective recompute, MUST_SWAP, swap_inputs, context_fn (SPEC 2, 4)."""

import dataclasses
import functools
import gc

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.core.activation_checkpoint import _selective
from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    checkpoint,
    checkpoint_wrapper,
    saved_activation_memory,
)

D = 16
MATMULS = [torch.ops.aten.addmm, torch.ops.aten.mm]


class Block(nn.Module):
    """Two Linears; tanh at the end saves its output, so a recompute needs every op."""

    def __init__(self, d: int = D, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return torch.tanh(x + self.drop(self.fc2(h)))


class Stack(nn.Module):
    def __init__(self, layers: int = 4, d: int = D, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, dropout) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


def make_pair(layers=4, dropout=0.0, **wrap_kwargs):
    """(reference model, the same model with every layer checkpoint-wrapped)."""
    torch.manual_seed(1)
    ref = Stack(layers, dropout=dropout)
    model = Stack(layers, dropout=dropout)
    model.load_state_dict(ref.state_dict())
    for i in range(layers):
        model.layers[i] = checkpoint_wrapper(model.layers[i], **wrap_kwargs)
    return ref, model


def chain(model):
    for a, b in zip(model.layers[:-1], model.layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)


def assert_equal_tensors(a_list, b_list):
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        assert torch.equal(a, b), (a - b).abs().max()


def train_and_compare(ref, model, steps=3, seed=0, batch=(4, D), after_forward=None):
    """SGD steps on both; losses, gradients and parameters must be bitwise equal."""
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        torch.manual_seed(seed + step)
        x = torch.randn(*batch)
        torch.manual_seed(100 + step)
        loss_ref = ref(x)
        loss_ref.backward()
        torch.manual_seed(100 + step)
        loss = model(x)
        if after_forward is not None:
            after_forward(step)
        loss.backward()
        assert torch.equal(loss, loss_ref)
        assert_equal_tensors([p.grad for p in model.parameters()],
                             [p.grad for p in ref.parameters()])
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    assert_equal_tensors(list(model.parameters()), list(ref.parameters()))


def guide_policy(ctx, op, *args, **kwargs):
    """The user guide's policy shape: compare op names as strings."""
    op_name_attr = getattr(op, "name", None)
    op_name = op_name_attr() if callable(op_name_attr) else (op_name_attr or str(op))
    if op_name in {"LayerNormExt", "aten.addmm.default"}:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


# ------------------------------------------------------------------ equality with no checkpoint

@pytest.mark.parametrize("wrap_kwargs", [
    {},                                                   # full recompute
    {"policy_fn": MATMULS},                               # selective: save matmuls (list)
    {"policy_fn": guide_policy},                          # selective: callable, guide style
    {"policy_fn": {"aten.addmm": CheckpointPolicy.PREFER_SAVE}},  # dict table
    {"swap_inputs": True},                                # inputs swapped (no schedule)
], ids=["full", "save_matmuls_list", "guide_callable", "dict", "swap_inputs_unscheduled"])
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_gradients_equal_reference_over_steps(wrap_kwargs):
    ref, model = make_pair(**wrap_kwargs)
    train_and_compare(ref, model)


def test_selective_must_swap_with_prefetch_chain(host_swap, caches):
    policy = {"aten.addmm": CheckpointPolicy.MUST_SWAP}
    ref, model = make_pair(layers=4, policy_fn=policy)
    chain(model)
    per_output = 4 * 2 * D * 4 + 4 * D * 4  # fc1 and fc2 outputs of one layer, fp32 bytes

    def after_forward(step):
        host_swap.synchronize()
        assert len(caches) == 4
        for i, cache in enumerate(caches):
            assert cache.stats()["swapped_tensors"] == 2
            sizes = [t.untyped_storage().nbytes() for t in cache.cached_tensors(swapped=True)]
            if i < 3:
                assert sizes == [0, 0], (i, sizes)  # offloaded: device memory released
            else:
                assert sizes == [4 * 2 * D * 4, 4 * D * 4]  # the last layer keeps its own
        stats = host_swap.stats()
        assert stats["offload_bytes"] == (step + 1) * 3 * per_output  # counters accumulate
        assert stats["offload_count"] == (step + 1) * 6
        caches.clear()

    train_and_compare(ref, model, after_forward=after_forward)
    stats = host_swap.stats()
    assert stats["reload_count"] == stats["offload_count"] == 6 * 3
    assert stats["on_demand_reloads"] == 0  # every reload was a prefetch of the schedule


def test_must_swap_with_group_swap_fuses_the_copies(host_swap):
    ref, model = make_pair(layers=3, policy_fn={"aten.addmm": CheckpointPolicy.MUST_SWAP},
                           group_swap=True)
    chain(model)

    def after_forward(step):
        host_swap.synchronize()
        stats = host_swap.stats()
        # The two small outputs of each released layer travel in one fused copy, out in
        # every forward and back in every earlier backward.
        assert stats["offload_count"] == (step + 1) * 4
        assert stats["fused_copies"] == (step + 1) * 2 + step * 2

    train_and_compare(ref, model, after_forward=after_forward)
    assert host_swap.stats()["on_demand_reloads"] == 0


def test_selective_submodule_inside_scheduled_layers(host_swap, caches):
    """The guide's composition: the chain is registered over plain layers, and a submodule
    of each is checkpoint-wrapped with MUST_SWAP: its outputs join the layer's group."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))

        def forward(self, x):
            return torch.tanh(x + self.mlp(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).sum()

    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    for layer in model.layers:
        layer.mlp = checkpoint_wrapper(layer.mlp,
                                       policy_fn={"aten.addmm": CheckpointPolicy.MUST_SWAP})
    chain(model)

    def after_forward(step):
        host_swap.synchronize()
        sizes = [[t.untyped_storage().nbytes() for t in c.cached_tensors(swapped=True)]
                 for c in caches]
        assert sizes == [[0, 0]] * 3 + [[4 * 2 * D * 4, 4 * D * 4]]
        caches.clear()

    train_and_compare(ref, model, after_forward=after_forward)
    assert host_swap.stats()["on_demand_reloads"] == 0


def test_checkpoint_swap_inputs_with_prefetch_chain(host_swap):
    ref, model = make_pair(layers=4, swap_inputs=True)
    chain(model)
    input_bytes = 4 * D * 4

    def after_forward(step):
        host_swap.synchronize()
        # Layer 0's input is held by the test; layers 1 and 2 hand theirs to the host;
        # the last layer keeps its input on device.
        assert host_swap.stats()["offload_bytes"] == (step + 1) * 2 * input_bytes

    train_and_compare(ref, model, after_forward=after_forward)
    assert host_swap.stats()["reload_bytes"] == 3 * 2 * input_bytes


def test_checkpoint_swap_inputs_functional(host_swap):
    lin1, lin2 = nn.Linear(D, D), nn.Linear(D, D)

    def first(h):
        return lin1(h)

    def second(h):
        return lin2(h)

    SwapManager().set_forward_prefetch_layer(first, second)
    x = torch.randn(8, D, requires_grad=True)
    h = x * 2 + 1  # saved by nothing but the region: it may leave the device
    y = checkpoint(first, h, swap_inputs=True)
    del h  # (the next region's end is the next release point)
    out = checkpoint(second, torch.tanh(y), swap_inputs=True)
    host_swap.synchronize()
    assert host_swap.stats()["offload_bytes"] == 8 * D * 4
    out.sum().backward()
    assert host_swap.stats()["reload_bytes"] == 8 * D * 4
    ref_x = x.detach().clone().requires_grad_(True)
    grads = [x.grad, *(p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters()))]
    for p in (*lin1.parameters(), *lin2.parameters()):
        p.grad = None
    lin2(torch.tanh(lin1(ref_x * 2 + 1))).sum().backward()
    ref = [ref_x.grad, *(p.grad for p in (*lin1.parameters(), *lin2.parameters()))]
    assert_equal_tensors(grads, ref)


# ------------------------------------------------------------------ FLOP counts

def flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def backward_flops(model, x):
    loss = model(x)
    return flops(loss.backward)


@pytest.mark.parametrize("policy, repeats_forward", [
    (None, True),
    (MATMULS, False),
    (lambda ctx, op, *a, **k: op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default),
     False),
    ({"aten.mm": CheckpointPolicy.MUST_SAVE}, True),  # Linear with bias runs addmm, not mm
], ids=["full", "save_matmuls", "save_matmuls_callable", "save_only_mm"])
def test_flop_count_shows_what_was_recomputed(policy, repeats_forward):
    ref, model = make_pair(layers=3, policy_fn=policy)
    x = torch.randn(4, D)
    forward = flops(lambda: ref(x))
    assert forward == 3 * (2 * 4 * D * 2 * D) * 2  # 3 layers x 2 Linears
    ref_backward = backward_flops(ref, x)
    got = backward_flops(model, x)
    assert got == ref_backward + (forward if repeats_forward else 0)


def test_flop_count_partial_policy_recomputes_exactly_the_unsaved_matmul():
    lin1, lin2 = nn.Linear(D, 3 * D), nn.Linear(3 * D, D // 2, bias=False)  # addmm, then mm

    def block(x):
        return torch.tanh(lin2(torch.relu(lin1(x))))

    x = torch.randn(4, D)
    addmm_flops, mm_flops = 2 * 4 * D * 3 * D, 2 * 4 * 3 * D * (D // 2)
    assert flops(lambda: block(x)) == addmm_flops + mm_flops
    ref_backward = backward_flops(lambda v: block(v).sum(), x)
    for policy, extra in ((["aten.addmm"], mm_flops), (["aten.mm"], addmm_flops),
                          (["aten.addmm", "aten.mm"], 0), ([], addmm_flops + mm_flops)):
        loss = checkpoint(block, x, policy_fn=policy).sum()
        assert flops(loss.backward) == ref_backward + extra, policy


# ------------------------------------------------------------------ RNG and autocast replay

@pytest.mark.parametrize("policy", [None, MATMULS, guide_policy], ids=["full", "list", "callable"])
def test_dropout_rng_is_replayed(policy):
    ref, model = make_pair(layers=3, dropout=0.5, policy_fn=policy)
    train_and_compare(ref, model, steps=2)


def test_two_dropouts_around_a_saved_matmul_stay_aligned():
    torch.manual_seed(3)
    w = torch.randn(D, D, requires_grad=True)

    def block(x):
        a = torch.nn.functional.dropout(x, 0.5)
        b = a @ w  # saved: not run again, but the RNG stream must still line up
        return torch.tanh(torch.nn.functional.dropout(b, 0.5))

    x = torch.randn(4, D, requires_grad=True)
    torch.manual_seed(7)
    ref = block(x).sum()
    g_ref = torch.autograd.grad(ref, [x, w])
    torch.manual_seed(7)
    out = checkpoint(block, x, policy_fn=[torch.ops.aten.mm.default]).sum()
    g = torch.autograd.grad(out, [x, w])
    assert torch.equal(out, ref)
    assert_equal_tensors(g, g_ref)


@pytest.mark.parametrize("policy", [None, MATMULS], ids=["full", "save_matmuls"])
def test_autocast_state_is_replayed(policy):
    ref, model = make_pair(layers=2, policy_fn=policy)
    x = torch.randn(4, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref = ref(x)
    loss_ref.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
    loss.backward()  # outside autocast: the recompute must still run in bfloat16
    assert torch.equal(loss, loss_ref)
    assert_equal_tensors([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


# ------------------------------------------------------------------ inputs and outputs


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


def nested_fn(x, w):
    a = torch.tanh(x @ w)
    b = torch.sigmoid(x)
    return (a, None, [b * 2, {"c": a * b, "n": 3}], Pair(a + 1, b.exp()))


def nested_loss(out):
    a, none, (b2, d), pair = out
    assert none is None and d["n"] == 3
    return a.sum() + b2.sum() + (d["c"] ** 2).sum() + pair.first.sum() + pair.second.sum()


@pytest.mark.parametrize("policy", [None, MATMULS], ids=["full", "save_matmuls"])
def test_nested_outputs_keep_their_gradients(policy):
    x = torch.randn(4, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    g_ref = torch.autograd.grad(nested_loss(nested_fn(x, w)), [x, w])
    out = checkpoint(nested_fn, x, w, policy_fn=policy)
    assert isinstance(out, tuple) and isinstance(out[2], list) and isinstance(out[3], Pair)
    assert out[0].requires_grad and out[2][1]["c"].requires_grad and out[3].second.requires_grad
    assert_equal_tensors(torch.autograd.grad(nested_loss(out), [x, w]), g_ref)


@pytest.mark.parametrize("policy", [None, MATMULS], ids=["full", "save_matmuls"])
def test_tensors_passed_as_kwargs(policy):
    def fn(x, *, weight, bias=None, debug=False):
        out = torch.tanh(x @ weight)
        out = out * 2 if debug else out
        return out + bias if bias is not None else out

    x = torch.randn(4, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    b = torch.randn(D, requires_grad=True)
    g_ref = torch.autograd.grad(fn(x, weight=w, bias=b, debug=True).pow(2).sum(), [x, w, b])
    # `debug` is checkpoint's own option (as in torch): a function kwarg of that name is
    # bound with functools.partial.
    out = checkpoint(functools.partial(fn, debug=True), x, weight=w, bias=b, policy_fn=policy)
    assert_equal_tensors(torch.autograd.grad(out.pow(2).sum(), [x, w, b]), g_ref)


@pytest.mark.parametrize("policy", [None, MATMULS], ids=["full", "save_matmuls"])
def test_inputs_without_grad_still_train_parameters(policy):
    ref, model = make_pair(layers=2, policy_fn=policy)
    x = torch.randn(4, D)  # requires_grad=False
    assert not x.requires_grad
    train_and_compare(ref, model, steps=2)
    loss = model(x)
    assert loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("policy", [None, MATMULS], ids=["full", "save_matmuls"])
def test_autograd_grad_with_a_subset_of_inputs(policy):
    w1 = torch.randn(D, D, requires_grad=True)
    w2 = torch.randn(D, D, requires_grad=True)

    def fn(x, a, b):
        return torch.tanh(torch.relu(x @ a) @ b)

    x = torch.randn(4, D, requires_grad=True)
    (g_ref,) = torch.autograd.grad(fn(x, w1, w2).sum(), [w1])
    out = checkpoint(fn, x, w1, w2, policy_fn=policy)
    (g,) = torch.autograd.grad(out.sum(), [w1])
    assert torch.equal(g, g_ref)
    assert w1.grad is None and w2.grad is None and x.grad is None


@pytest.mark.parametrize("policy", [None, MATMULS, {"aten.addmm": CheckpointPolicy.MUST_SWAP}],
                         ids=["full", "save_matmuls", "must_swap"])
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_retain_graph_second_backward(policy, host_swap):
    ref, model = make_pair(layers=2, policy_fn=policy)
    x = torch.randn(4, D)
    loss_ref = ref(x)
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_equal_tensors([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


@pytest.mark.parametrize("outer_policy", [None, MATMULS], ids=["outer_full", "outer_selective"])
@pytest.mark.parametrize("inner_policy", [None, MATMULS, "torch"],
                         ids=["inner_full", "inner_selective", "inner_torch"])
def test_nested_checkpoints(outer_policy, inner_policy):
    torch.manual_seed(0)
    w1 = torch.randn(D, D, requires_grad=True)
    w2 = torch.randn(D, D, requires_grad=True)

    def inner(h):
        return torch.tanh(h @ w2)

    def outer(x, nest):
        h = torch.relu(x @ w1)
        if nest == "torch":
            h = torch.utils.checkpoint.checkpoint(inner, h, use_reentrant=False)
        elif nest == "ours":
            h = checkpoint(inner, h, policy_fn=None if inner_policy == "torch" else inner_policy)
        else:
            h = inner(h)
        return torch.sigmoid(h @ w1)

    x = torch.randn(4, D, requires_grad=True)
    g_ref = torch.autograd.grad(outer(x, None).sum(), [x, w1, w2])
    nest = "torch" if inner_policy == "torch" else "ours"
    out = checkpoint(outer, x, nest, policy_fn=outer_policy)
    assert_equal_tensors(torch.autograd.grad(out.sum(), [x, w1, w2]), g_ref)
    # and ours inside torch's own checkpoint
    out = torch.utils.checkpoint.checkpoint(outer, x, "ours", use_reentrant=False)
    assert_equal_tensors(torch.autograd.grad(out.sum(), [x, w1, w2]), g_ref)


def test_no_grad_runs_the_function_plainly():
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return CheckpointPolicy.MUST_SAVE

    lin = nn.Linear(D, D)
    x = torch.randn(2, D)
    with torch.no_grad():
        out = checkpoint(lin, x, policy_fn=policy)
    assert torch.equal(out, lin(x).detach()) and not out.requires_grad
    assert calls == []


# ------------------------------------------------------------------ errors


def test_cached_tensor_mutated_after_the_region_raises_clearly():
    w = torch.randn(D, D, requires_grad=True)

    def fn(x):
        h = x @ w
        return h, torch.tanh(h)

    h, y = checkpoint(fn, torch.randn(4, D), policy_fn=[torch.ops.aten.mm])
    h.mul_(2)  # in place, after selective checkpoint cached h and before backward
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the output of aten\.mm\.default "
                                           r"\(call #0, shape \[4, 16\]\) that selective "
                                           r"checkpoint cached was modified in place"):
        y.sum().backward()


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_swapped_tensor_mutated_after_the_region_raises_clearly(host_swap):
    w = torch.randn(D, D, requires_grad=True)

    def fn(x):
        h = x @ w
        return h, torch.tanh(h)

    h, y = checkpoint(fn, torch.randn(4, D), policy_fn={"aten.mm": CheckpointPolicy.MUST_SWAP})
    h.add_(1)
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the output of aten\.mm\.default "
                                           r"\(call #0, shape \[4, 16\]\) that selective "
                                           r"checkpoint swapped \(MUST_SWAP\) was modified"):
        y.sum().backward()


@pytest.mark.parametrize("policy", [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP])
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_cached_tensor_mutated_inside_the_region_is_recomputed(policy, caches, host_swap,
                                                               monkeypatch):
    monkeypatch.setattr(_selective, "_warned_demoted", set())  # the warning is once per op
    w = torch.randn(D, D, requires_grad=True)

    def fn(x):
        h = x @ w
        y = torch.tanh(h)
        h.mul_(2)  # inside the region: the recompute replays mm and this write
        return torch.sigmoid(h) * y

    x = torch.randn(4, D, requires_grad=True)
    g_ref = torch.autograd.grad(fn(x).sum(), [x, w])
    with pytest.warns(UserWarning, match=r"hyper_parallel: the output of aten\.mm\.default "
                                         r"\(call #0\) was modified in place later in the same "
                                         r"checkpoint region.*recomputed in backward instead"):
        out = checkpoint(fn, x, policy_fn={"aten.mm": policy})
    assert caches[0].stats()["recompute_entries"] == 4  # mm (demoted), tanh, sigmoid, mul
    assert_equal_tensors(torch.autograd.grad(out.sum(), [x, w]), g_ref)


# torch.matmul returns aten::mm's (3-D @ 2-D) and aten::bmm's (4-D @ 4-D) output through
# aten::_unsafe_view: a tensor sharing the cached output's storage with a version counter of
# its own, so an in-place write to it leaves the cached output's version as it was (T5's
# attention: `scores = matmul(q, k^T); scores += position_bias`). Found by a fresh-user
# tester: silently wrong gradients (torch's own selective checkpoint gives the same ones).
_MATMUL_POLICIES = {
    "declarative": lambda ops: {op: CheckpointPolicy.MUST_SAVE for op in ops},
    "callable": lambda ops: (lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE
                             if str(op) in ops else CheckpointPolicy.PREFER_RECOMPUTE),
    "swap": lambda ops: {op: CheckpointPolicy.MUST_SWAP for op in ops},
}


def _attention(q, k, bias):
    scores = torch.matmul(q, k.transpose(-1, -2))  # aten.bmm, then aten._unsafe_view
    scores += bias
    return scores.softmax(-1)


@pytest.mark.parametrize("kind", list(_MATMUL_POLICIES))
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_a_write_through_unsafe_view_of_a_cached_output_is_recomputed(kind, caches, host_swap,
                                                                     monkeypatch):
    monkeypatch.setattr(_selective, "_warned_demoted", set())
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 3, 4, 5, generator=gen),
           torch.randn(1, 3, 4, 4, generator=gen)]

    def grads(run):
        xs = [t.clone().requires_grad_() for t in ins]
        return torch.autograd.grad(run(*xs).pow(2).sum(), xs)

    ref = grads(_attention)
    policy = _MATMUL_POLICIES[kind](["aten.bmm.default"])
    with pytest.warns(UserWarning, match=r"aten\.bmm\.default \(call #0\) was modified in "
                                         r"place later in the same checkpoint region"):
        got = grads(lambda *a: checkpoint(_attention, *a, policy_fn=policy))
    assert_equal_tensors(got, ref)
    assert caches[0].stats()["saved_entries"] + caches[0].stats()["swapped_entries"] == 0


@pytest.mark.parametrize("kind", list(_MATMUL_POLICIES))
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_a_write_through_unsafe_view_of_a_cached_mm_is_recomputed(kind, host_swap, monkeypatch):
    monkeypatch.setattr(_selective, "_warned_demoted", set())
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(2, 4, D, requires_grad=True)

    def mlp(x):
        h = x @ w  # 3-D @ 2-D: aten.mm on a flattened view, then aten._unsafe_view
        h += 1.0
        return (h @ w).tanh()

    ref = torch.autograd.grad(mlp(x).pow(2).sum(), [x, w])
    policy = _MATMUL_POLICIES[kind](["aten.mm.default"])
    with pytest.warns(UserWarning, match="modified in place later in the same checkpoint"):
        out = checkpoint(mlp, x, policy_fn=policy)
    assert_equal_tensors(torch.autograd.grad(out.pow(2).sum(), [x, w]), ref)


@pytest.mark.parametrize("kind", list(_MATMUL_POLICIES))
@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_a_write_through_unsafe_view_after_the_region_raises(kind, host_swap):
    """Written after the forward, through the region's output: the cached mm output would be
    handed back stale to the recompute of sin (which saved it): an error, like autograd's
    own for a saved tensor written in place."""
    w = torch.randn(D, D, requires_grad=True)

    def fn(x):
        h = x @ w
        return h, torch.sin(h)

    h, y = checkpoint(fn, torch.randn(2, 4, D), policy_fn=_MATMUL_POLICIES[kind](
        ["aten.mm.default"]))
    h.add_(1)
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the output of aten\.mm\.default "
                                           r"\(call #0\) that selective checkpoint cached was "
                                           r"modified in place after the region's forward "
                                           r"through a tensor sharing its memory"):
        y.sum().backward()


def test_a_write_through_unsafe_view_after_the_region_is_handed_back_when_allowed():
    """allow_cache_entry_mutation=True (torch's meaning): the modified value is used."""
    from hyper_parallel.core.activation_checkpoint import create_selective_checkpoint_contexts
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(2, 4, D)

    def fn(x):
        h = x @ w
        return h, torch.sin(h)

    ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default],
                            allow_cache_entry_mutation=True)
    h, y = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=ctx)
    h.add_(1)
    (gw,) = torch.autograd.grad(y.sum(), [w])
    # what a recompute from the modified mm output gives: d/dw sum(sin(x @ w + 1))
    (want,) = torch.autograd.grad(torch.sin((x @ w) + 1).sum(), [w])
    assert_equal_tensors([gw], [want])


def test_recompute_running_other_ops_raises_clearly():
    w = torch.randn(D, D, requires_grad=True)
    state = {"extra": False}

    def fn(x):
        if state["extra"]:  # global state that changes between forward and backward
            x @ w  # noqa: B018 - an extra call of the same op
        return torch.tanh(x @ w)

    # x does not require grad, so the extra mm saves a tensor like the first one did
    # and torch's metadata check passes; the call count is what differs.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute all of fn
        out = checkpoint(fn, torch.randn(4, D), policy_fn=[torch.ops.aten.mm])
    state["extra"] = True
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the recompute of a selective "
                                           r"checkpoint region ran aten\.mm\.default \(call #1\) "
                                           r"but its forward ran it 1 time\(s\)"):
        out.sum().backward()


@pytest.mark.parametrize("tensors", ["plain", "subclass"])
@pytest.mark.parametrize("native", [True, False], ids=["cpp", "python-modes"])
@pytest.mark.parametrize("policy", ["declarative", "callable"])
def test_recompute_running_an_op_on_other_shapes_raises_clearly(monkeypatch, policy, native,
                                                                 tensors):
    # The recompute's first mm is another call than the forward's first mm (state changed
    # between forward and backward): handing it the cached (4, D) output where (4, 2D) is
    # due would fail deep in autograd or, with equal shapes downstream, give wrong values.
    # With a tensor subclass (TwoTensor, as DTensor) the Python modes keep its outputs in
    # _subclass_outputs.py, which checks the same.
    from hyper_parallel.core.activation_checkpoint import _selective
    monkeypatch.setattr(_selective, "NATIVE", native and _selective.NATIVE)
    if tensors == "subclass":
        two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
        make = lambda *shape: two_tensor.TwoTensor(*(torch.randn(*shape),) * 2)  # noqa: E731
    else:
        make = torch.randn
    w = make(D, D).requires_grad_()
    w_wide = make(D, 2 * D).requires_grad_()
    state = {"wide_first": False}

    def fn(x):
        if state["wide_first"]:
            x @ w_wide  # noqa: B018 - another mm first
        return torch.tanh(x @ w)

    policies = {"declarative": [torch.ops.aten.mm],
                "callable": lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE
                                                      if op is torch.ops.aten.mm.default
                                                      else CheckpointPolicy.PREFER_RECOMPUTE)}
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        out = checkpoint(fn, make(4, D), policy_fn=policies[policy])
    state["wide_first"] = True
    with pytest.raises(RuntimeError, match=r"hyper_parallel: the recompute of a selective "
                                           r"checkpoint region ran aten\.mm\.default \(call #0\) "
                                           r"on inputs whose dtypes or shapes differ"):
        out.sum().backward()


def test_invalid_policy_result_names_op_and_value():
    with pytest.raises(ValueError, match=r"hyper_parallel: policy_fn for op aten\.mm\.default "
                                         r"returned 'save'"):
        checkpoint(lambda x, w: x @ w, torch.randn(2, D), torch.randn(D, D, requires_grad=True),
                   policy_fn=lambda ctx, op, *a, **k: "save")


# ------------------------------------------------------------------ context_fn


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_context_fn_composes_with_policy_fn():
    forward_log, recompute_log = OpLog(), OpLog()
    made = []

    def context_fn():
        made.append(1)
        return forward_log, recompute_log

    lin1, lin2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def block(x):
        return torch.tanh(lin2(torch.relu(lin1(x))))

    x = torch.randn(4, D, requires_grad=True)
    loss_ref = block(x).sum()
    g_ref = torch.autograd.grad(loss_ref, [x, lin1.weight, lin2.weight])
    out = checkpoint(block, x, policy_fn=[torch.ops.aten.addmm], context_fn=context_fn)
    assert made == [1] and forward_log.entered == 1 and recompute_log.entered == 0
    assert forward_log.ops.count("aten.addmm.default") == 2
    g = torch.autograd.grad(out.sum(), [x, lin1.weight, lin2.weight])
    assert recompute_log.entered == 1
    # The policy applied in recompute: the user's mode (outside ours) saw relu and tanh
    # run again, but not the saved addmm calls.
    assert "aten.relu.default" in recompute_log.ops and "aten.tanh.default" in recompute_log.ops
    assert "aten.addmm.default" not in recompute_log.ops
    assert_equal_tensors(g, g_ref)


def test_context_fn_alone_is_used_as_given():
    entered = []

    class Mark:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    lin = nn.Linear(D, D)
    out = checkpoint(lambda x: torch.tanh(lin(x)), torch.randn(2, D),
                     context_fn=lambda: (Mark("forward"), Mark("recompute")))
    assert entered == ["forward"]
    out.sum().backward()
    assert entered == ["forward", "recompute"]
    with pytest.raises(TypeError, match="hyper_parallel: context_fn must be a callable"):
        checkpoint(lin, torch.randn(2, D), context_fn=(Mark("a"), Mark("b")))


# ------------------------------------------------------------------ memory accounting


def test_meter_observes_tensors_cached_by_save_policies():
    def measure(policy):
        _, model = make_pair(layers=3, policy_fn=policy)
        x = torch.randn(4, D)
        with saved_activation_memory() as meter:
            loss = model(x)
        loss.backward()
        return meter.peak_bytes

    full = measure(None)
    inputs = 4 * 4 * D * 4  # each region keeps its input; the loss (x * x) saves one more
    assert full == inputs
    assert measure(MATMULS) == inputs + 3 * (4 * 2 * D * 4 + 4 * D * 4)
    assert measure({"aten.addmm": CheckpointPolicy.PREFER_SAVE}) == measure(MATMULS)
    assert measure({"aten.addmm": CheckpointPolicy.PREFER_RECOMPUTE}) == full


def test_caches_are_released_after_backward(caches):
    _, model = make_pair(layers=2, policy_fn=MATMULS)
    loss = model(torch.randn(4, D))
    assert [c.stats()["saved_tensors"] for c in caches] == [2, 2]
    loss.backward()
    for c in caches:
        s = c.stats()
        assert s["saved_tensors"] == 0 and s["replays"] == 2 and s["dropped_entries"] == 2
    del loss
    gc.collect()
