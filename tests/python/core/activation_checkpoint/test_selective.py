"""Region modes of selective checkpoint (_selective.py): when a callable policy opens a
swap region (docs/design.md, "Selective checkpoint")."""

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
