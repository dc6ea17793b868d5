"""Region modes of selective checkpoint (_selective.py): when a callable policy opens a
swap region (docs/design.md, "Selective checkpoint")."""

import warnings

import pytest
import torch
from torch import nn

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint

D = 8
_ADDMM = torch.ops.aten.addmm.default


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return torch.tanh(x + self.fc2(torch.relu(self.fc1(x))))


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is _ADDMM else CheckpointPolicy.PREFER_RECOMPUTE


def _swap_second_matmul(ctx, op, *args, **kwargs):
    if op is _ADDMM and args[2].shape[1] == D:  # fc2's addmm
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.fixture
def region_enters(monkeypatch):
    """Counts the swap regions opened (each one: a swap group, maybe hooks)."""
    calls = []
    original = _C.region_enter

    def counting(*args, **kwargs):
        calls.append(args[1])  # the region's name
        return original(*args, **kwargs)

    monkeypatch.setattr(_C, "region_enter", counting)
    return calls


def _run(policy_fn, layers=3, steps=2):
    """Grads of `layers` checkpointed layers against the same layers without checkpoint."""
    torch.manual_seed(3)
    model = nn.ModuleList(_Layer() for _ in range(layers))
    for step in range(steps):
        x = torch.randn(4, D, requires_grad=True)
        ref = x
        for layer in model:
            ref = layer(ref)
        ref.square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        model.zero_grad()
        x.grad = None
        out = x
        for layer in model:
            out = checkpoint(layer, out, policy_fn=policy_fn)
        out.square().sum().backward()
        got = [p.grad for p in model.parameters()] + [x.grad]
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        model.zero_grad()


def test_callable_policy_that_never_swaps_opens_no_swap_region(region_enters, caches):
    _run(_save_matmuls)
    assert region_enters == []
    assert sum(c.stats()["replays"] for c in caches) == 3 * 2 * 2  # the saves were used


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_callable_policy_opens_its_swap_region_at_the_first_must_swap(region_enters, caches,
                                                                     host_swap):
    _run(_swap_second_matmul)
    assert len(region_enters) == 3 * 2  # one per layer call, forward only (not recompute)
    stats = host_swap.stats()
    assert stats["offload_count"] == stats["reload_count"] == 3 * 2
    assert [c.stats()["swapped_entries"] for c in caches] == [0] * 6  # replayed, released


# ------------------------------------------------------------------ C++ interception

from hyper_parallel.core.activation_checkpoint import _selective  # noqa: E402

_SAVE_ADDMM = [torch.ops.aten.addmm]


@pytest.fixture
def python_modes(monkeypatch):
    """Counts the ops our Python region modes see."""
    seen = []
    for cls in (_selective._CachingMode, _selective._CachedMode):
        original = cls.__torch_dispatch__

        def spy(self, func, types, args=(), kwargs=None, original=original):
            seen.append(func)
            return original(self, func, types, args, kwargs)

        monkeypatch.setattr(cls, "__torch_dispatch__", spy)
    return seen


def _grads_of(model, x, policy_fn):
    out = x
    for layer in model:
        out = checkpoint(layer, out, policy_fn=policy_fn)
    out.square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    return got


def _reference(model, x):
    out = x
    for layer in model:
        out = layer(out)
    out.square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    return got


def test_declarative_policy_runs_in_cpp_without_a_python_call_per_op(python_modes, caches):
    assert _selective.NATIVE, _C.intercept_unavailable_reason()
    torch.manual_seed(0)
    model = nn.ModuleList(_Layer() for _ in range(2))
    x = torch.randn(4, D, requires_grad=True)
    expected = _reference(model, x)
    depth = []
    model[0].register_forward_pre_hook(
        lambda *a: depth.append((torch._C._len_torch_dispatch_stack(), _C.intercept_depth())))
    before = _C.intercepted_total()
    got = _grads_of(model, x, _SAVE_ADDMM)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert python_modes == []  # no Python mode saw any op
    assert depth == [(0, 1), (0, 1)]  # in forward and in recompute: no mode, one C++ region
    # Per layer: forward addmm, relu, addmm, add, tanh (5 ops; the region's transposes of
    # the weights are views: they are seen too); recompute reruns them up to the tanh.
    intercepted = _C.intercepted_total() - before
    assert intercepted >= 2 * 2 * 5
    assert [c.stats()["replays"] for c in caches] == [2, 2]  # both addmm of each layer


def test_declarative_policy_in_cpp_matches_the_python_modes(monkeypatch, caches):
    torch.manual_seed(0)
    model = nn.ModuleList(_Layer() for _ in range(2))
    x = torch.randn(4, D, requires_grad=True)
    native = _grads_of(model, x, {"aten.addmm": CheckpointPolicy.MUST_SAVE,
                                  "aten.relu": CheckpointPolicy.MUST_SAVE})
    native_stats = [c.stats() for c in caches]
    caches.clear()
    monkeypatch.setattr(_selective, "NATIVE", False)
    before = _C.intercepted_total()
    python = _grads_of(model, x, {"aten.addmm": CheckpointPolicy.MUST_SAVE,
                                  "aten.relu": CheckpointPolicy.MUST_SAVE})
    assert _C.intercepted_total() == before  # the Python modes ran this time
    for a, b in zip(native, python):
        assert torch.equal(a, b)
    assert [c.stats() for c in caches] == native_stats


def test_cpp_regions_on_two_threads_stay_apart():
    import threading

    results, errors = {}, []

    def train(tid):
        try:
            torch.manual_seed(tid)
            model = nn.ModuleList(_Layer() for _ in range(3))
            x = torch.randn(4, D, requires_grad=True)
            expected = _reference(model, x)
            for _ in range(5):
                got = _grads_of(model, x, _SAVE_ADDMM)
                results.setdefault(tid, []).append(
                    all(torch.equal(a, b) for a, b in zip(got, expected)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == {0: [True] * 5, 1: [True] * 5}


def test_exception_in_a_cpp_region_leaves_nothing_installed():
    layer = _Layer()

    def failing(x):
        layer(x)
        raise ValueError("boom")

    x = torch.randn(4, D, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        checkpoint(failing, x, policy_fn=_SAVE_ADDMM)
    assert _C.intercept_depth() == 0
    before = _C.intercepted_total()
    layer(x)  # outside any region: not intercepted
    assert _C.intercepted_total() == before
    torch.manual_seed(0)
    model = nn.ModuleList([layer])
    expected = _reference(model, x)
    for a, b in zip(_grads_of(model, x, _SAVE_ADDMM), expected):
        assert torch.equal(a, b)


def test_nested_cpp_regions_give_reference_gradients(caches):
    torch.manual_seed(0)
    inner = nn.ModuleList(_Layer() for _ in range(2))

    def outer(x):
        for layer in inner:
            x = checkpoint(layer, x, policy_fn=_SAVE_ADDMM)
        return x

    x = torch.randn(4, D, requires_grad=True)
    expected = _reference(inner, x)
    checkpoint(outer, x, policy_fn={"aten.tanh": CheckpointPolicy.MUST_SAVE}).square().sum() \
        .backward()
    got = [p.grad for p in inner.parameters()] + [x.grad]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert caches and all(c.stats()["replays"] > 0 for c in caches[:1])


def test_dropout_in_a_cpp_region_replays_the_rng_stream():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, D))
    x = torch.randn(4, D, requires_grad=True)
    torch.manual_seed(7)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    torch.manual_seed(7)
    checkpoint(layer, x, policy_fn=_SAVE_ADDMM).square().sum().backward()
    for a, b in zip([p.grad for p in layer.parameters()] + [x.grad], expected):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ random ops
# Random ops (tagged nondeterministic_seeded) are asked about like any other op; a cached one
# carries the RNG step it took in forward, replayed in recompute (_C.RngStep).

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _two_random_ops(x, w):
    """native_dropout (random, out of place), then bernoulli (random) that must draw in
    recompute what it drew in forward."""
    h, _ = _NATIVE_DROPOUT(x @ w, 0.5, True)
    mask = torch.bernoulli(torch.sigmoid(h).detach())
    return torch.tanh(h * mask + h)


def _grads_with_and_without_checkpoint(fn, policy_fn, **options):
    torch.manual_seed(0)
    x = torch.randn(6, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    torch.manual_seed(11)
    expected = torch.autograd.grad(fn(x, w).square().sum(), [x, w])
    state_ref = torch.get_rng_state()
    torch.manual_seed(11)
    out = checkpoint(fn, x, w, policy_fn=policy_fn, **options)
    got = torch.autograd.grad(out.square().sum(), [x, w])
    return got, expected, torch.equal(torch.get_rng_state(), state_ref)


def _save_dropout(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is _NATIVE_DROPOUT else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "python-modes"])
@pytest.mark.parametrize("policy", ["callable", "list", "swap-dict"])
def test_a_saved_random_op_keeps_the_recompute_rng_aligned(monkeypatch, caches, policy, native):
    monkeypatch.setattr(_selective, "NATIVE", native and _selective.NATIVE)
    policy_fn = {"callable": _save_dropout, "list": [_NATIVE_DROPOUT],
                 "swap-dict": {_NATIVE_DROPOUT: CheckpointPolicy.MUST_SWAP}}[policy]
    got, expected, rng_same = _grads_with_and_without_checkpoint(_two_random_ops, policy_fn)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert rng_same  # the training's RNG stream is where the run without checkpoint left it
    stats = caches[-1].stats()
    assert stats["dropped_entries"] == 1  # native_dropout's outputs cached, handed back once
    assert stats["recompute_entries"] >= 2  # mm, bernoulli, ... ran again


def test_sdpa_is_asked_and_saved(caches):
    asked = []

    def save_attention(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            asked.append(op)
        return CheckpointPolicy.MUST_SAVE if op is _SDPA_CPU else CheckpointPolicy.PREFER_RECOMPUTE

    def attention(x, w):
        q = (x @ w).view(2, 3, 2, D // 2).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return a.transpose(1, 2).reshape(6, D).tanh()

    for policy_fn in (save_attention, [_SDPA_CPU]):
        got, expected, _ = _grads_with_and_without_checkpoint(attention, policy_fn)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        assert caches[-1].stats()["dropped_entries"] == 1
    assert _SDPA_CPU in asked


def test_preserve_rng_state_false_never_rewinds_the_rng():
    # Recompute does not restore the forward's RNG state, so the generator is not at the
    # "before" state of the cached dropout: nothing is set (a set would rewind the RNG).
    torch.manual_seed(0)
    x = torch.randn(6, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    torch.manual_seed(11)
    out = checkpoint(_two_random_ops, x, w, policy_fn=[_NATIVE_DROPOUT], preserve_rng_state=False)
    after_forward = torch.get_rng_state()
    torch.rand(1)
    at_backward = torch.get_rng_state()
    out.square().sum().backward()
    final = torch.get_rng_state()
    # Only the recomputed bernoulli drew, from where the generator was at backward.
    torch.set_rng_state(at_backward)
    torch.bernoulli(torch.full((6, D), 0.5))
    assert torch.equal(final, torch.get_rng_state())
    assert not torch.equal(final, after_forward)


def test_rng_step_replays_only_from_its_before_state():
    step = _C.RngStep.before(torch.device("cpu"))
    before = torch.get_rng_state()
    torch.rand(3)
    after = torch.get_rng_state()
    assert step.after()  # the op moved the generator
    torch.manual_seed(5)  # elsewhere: replay leaves it
    elsewhere = torch.get_rng_state()
    assert not step.replay() and torch.equal(torch.get_rng_state(), elsewhere)
    torch.set_rng_state(before)
    assert step.replay() and torch.equal(torch.get_rng_state(), after)
    still = _C.RngStep.before(torch.device("cpu"))
    assert not still.after()  # nothing drew


def test_a_list_naming_an_op_that_is_never_cached_warns():
    with pytest.warns(UserWarning, match=r"aten.relu_.default is never cached .*writes its "
                                         r"arguments.* MUST_SAVE has no effect"):
        _selective.compile_policy([torch.ops.aten.relu_.default])
    with pytest.warns(UserWarning, match=r"aten.t is never cached .*view"):
        _selective.compile_policy({"aten.t": CheckpointPolicy.MUST_SWAP})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _selective.compile_policy([torch.ops.aten.native_dropout, "aten.addmm"])
        _selective.compile_policy({torch.ops.aten.relu_.default: CheckpointPolicy.MUST_RECOMPUTE})


_GRAD_INSIDE = r'''
import torch
from torch import nn
from hyper_parallel.core.activation_checkpoint import checkpoint, CheckpointPolicy
torch.manual_seed(0)
l1, l2 = nn.Linear(8, 8).double(), nn.Linear(8, 8).double()
def body(x, inner):
    h = l1(x)
    if inner:  # a gradient penalty: a backward inside the region
        g, = torch.autograd.grad(h.pow(2).sum(), h, create_graph=True)
        h = h + g
    return l2(h)
def callable_policy(ctx, op, *a, **k):
    return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default
            else CheckpointPolicy.PREFER_RECOMPUTE)
x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
def grads(call, inner):
    x.grad = None
    call(x, inner).pow(2).sum().backward()
    return x.grad
for inner in (True, False):
    ref = grads(body, inner)
    assert torch.equal(grads(lambda t, i: checkpoint(body, t, i), inner), ref)
for policy in ([torch.ops.aten.addmm.default], callable_policy):
    try:
        grads(lambda t, i: checkpoint(body, t, i, policy_fn=policy), True)
        raise SystemExit("no error")
    except RuntimeError as e:
        assert str(e).startswith("hyper_parallel: a backward inside a selective checkpoint "
                                 "region"), e
    # the next step, without the inner backward, is right
    ref = grads(body, False)
    assert torch.equal(grads(lambda t, i: checkpoint(body, t, i, policy_fn=policy), False), ref)
print("OK")
'''


def test_a_backward_inside_a_selective_region_is_a_clear_error_not_a_hang():
    # (tester, session 19) torch.autograd.grad of the region's own tensors inside a
    # selective region needs a recompute before the forward ended: a callable policy hung
    # on the cache's lock, a declarative one raised a misleading call-count error. Now a
    # clear error (torch's selective checkpoint refuses it too), and the next step works.
    # Full checkpoint supports it and matches plain autograd. Run in a child process: a
    # regression hangs.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _GRAD_INSIDE], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
