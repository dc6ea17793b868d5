"""The public API on MindSpore Cells (PyNative, CPU): a 4-layer Cell stack trained 3 steps
under checkpoint / selective / swap with a chain / mixed, against the plain stack.

Gradients and losses are compared bitwise (np.array_equal: every op here is
deterministic on CPU), saved bytes with the library's meter, copies with the backend's
counters, and kernels that MUST_SAVE keeps with a counting MsDispatchMode.
"""

import contextlib
import subprocess
import sys
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, SwapManager, checkpoint, checkpoint_wrapper, saved_activation_memory, swap,
    swap_tensor_wrapper, swap_wrapper)
from hyper_parallel.core.activation_checkpoint._mindspore import _selective
from hyper_parallel.core.activation_checkpoint._mindspore._records import STORE

HIDDEN, BATCH, STEPS, LR = 32, 8, 3, 0.05


class Block(nn.Cell):
    def __init__(self, register=False):
        super().__init__()
        self.fc1 = nn.Dense(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Dense(2 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm((HIDDEN,))
        self.register = register

    def construct(self, x):
        h = ops.gelu(self.fc1(x))
        if self.register:
            h = swap_tensor_wrapper(h, tag="ffn_hidden")
        return self.norm(x + self.fc2(h))


class Stack(nn.Cell):
    def __init__(self, register=False):
        super().__init__()
        self.layers = nn.CellList([Block(register) for _ in range(4)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


_INIT: dict = {}


def make_model(register=False):
    """A fresh stack with the same initial parameters every time."""
    ms.set_seed(0)
    model = Stack(register)
    params = model.trainable_params()
    if not _INIT:
        _INIT.update({p.name: p.asnumpy().copy() for p in params})
    for p in params:
        p.set_data(Tensor(_INIT[p.name].copy()))
    return model


def data():
    rng = np.random.default_rng(0)
    return [Tensor(rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)) for _ in range(STEPS)]


def train(model, meter=True):
    """3 SGD steps; returns (losses, grads per step, meter peak bytes of the first step)."""
    params = model.trainable_params()

    def loss_fn(x):
        return (model(x) ** 2).mean()

    step = ms.value_and_grad(loss_fn, None, weights=params)
    losses, grads, peak = [], [], None
    for i, x in enumerate(data()):
        ctx = saved_activation_memory("mindspore", parameters=model.get_parameters()) \
            if meter and i == 0 else contextlib.nullcontext()
        with ctx as m:
            loss, g = step(x)
        if m is not None:
            peak = m.peak_bytes
        losses.append(loss.asnumpy())
        grads.append([t.asnumpy() for t in g])
        for p, t in zip(params, g):
            p.set_data(p - LR * t)
    return losses, grads, peak


def chain(model):
    for a, b in zip(model.layers[:-1], model.layers[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)


@pytest.fixture(scope="module")
def reference():
    return train(make_model())


def assert_bitwise(result, reference):
    losses, grads, _ = result
    ref_losses, ref_grads, _ = reference
    assert all(np.array_equal(a, b) for a, b in zip(losses, ref_losses))
    for step, (gs, rs) in enumerate(zip(grads, ref_grads)):
        for g, r in zip(gs, rs):
            assert np.array_equal(g, r), f"step {step}: max |diff| {np.abs(g - r).max()}"


def test_checkpoint_wrapper_bitwise_and_saves_memory(reference):
    model = make_model()
    for i in range(4):
        model.layers[i] = checkpoint_wrapper(model.layers[i])
    result = train(model)
    assert_bitwise(result, reference)
    assert result[2] < 0.5 * reference[2]
    # Parameter names are the unwrapped model's (checkpoints load across both).
    assert [p.name for p in model.trainable_params()] == list(_INIT)


class OpCounter(ms.MsDispatchMode):
    """A user's recompute context: counts the kernels that run."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __ms_dispatch__(self, func, args, kwargs=None):
        self.counts[func.name] = self.counts.get(func.name, 0) + 1
        return func(*args)


def all_five(ctx, op, *args, **kwargs):
    # The guide's idiom for reading an op name.
    name_attr = getattr(op, "name", None)
    name = name_attr() if callable(name_attr) else (name_attr or str(op))
    return {"MatMul": CheckpointPolicy.MUST_SAVE, "BiasAdd": CheckpointPolicy.PREFER_SAVE,
            "Erf": CheckpointPolicy.MUST_SWAP, "Mul": CheckpointPolicy.MUST_RECOMPUTE}.get(
        name, CheckpointPolicy.PREFER_RECOMPUTE)


def test_selective_all_five_policies(reference, monkeypatch):
    caches, recompute_counters = [], []
    monkeypatch.setattr(_selective, "cache_observers", [caches.append])

    def context_fn():
        counter = OpCounter()
        recompute_counters.append(counter)
        return contextlib.nullcontext(), counter

    model = make_model()
    for i in range(4):
        model.layers[i] = checkpoint_wrapper(model.layers[i], policy_fn=all_five,
                                             context_fn=context_fn)
    chain(model)
    result = train(model)
    assert_bitwise(result, reference)
    assert result[2] < reference[2]
    # The user's MsDispatchMode saw the recompute; MUST_SAVE / PREFER_SAVE kernels did not
    # run again, the others did.
    recomputed = recompute_counters[0].counts
    assert "MatMul" not in recomputed and "BiasAdd" not in recomputed
    assert recomputed["Mul"] > 0 and recomputed["LayerNorm"] > 0
    assert caches[0].saved == 4 and caches[0].replayed == 5 and caches[0].swapped == 1
    # MUST_SWAP (the gelu's Erf output) went to the host pool and came back.
    stats = SwapManager().stats()
    assert stats["offload_count"] >= 3 * 3 and stats["reload_bytes"] == stats["offload_bytes"]


def test_selective_op_name_list_and_table(reference):
    model = make_model()
    for i in range(4):
        model.layers[i] = checkpoint_wrapper(model.layers[i], policy_fn=["MatMul", "LayerNorm"])
    assert_bitwise(train(model), reference)
    with pytest.raises(ValueError, match="hyper_parallel: .*not a MindSpore op name"):
        checkpoint_wrapper(Block(), policy_fn=["aten.mm.default"])


def test_swap_chain_bitwise_offloads_and_prefetches(reference):
    model = make_model()
    for i in range(4):
        model.layers[i] = swap_wrapper(model.layers[i])
    chain(model)
    result = train(model)
    assert_bitwise(result, reference)
    stats = SwapManager().stats()
    assert stats["offload_bytes"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0  # every reload was a prefetch of the chain
    assert stats["pinned_bytes_in_use"] == 0  # every host block is back in the pool
    assert result[2] < 0.5 * reference[2]


def test_swap_pool_is_reused_after_warmup():
    model = make_model()
    for i in range(4):
        model.layers[i] = swap_wrapper(model.layers[i])
    chain(model)
    train(model, meter=False)
    allocated = STORE.pool.allocated_total
    train(model, meter=False)
    assert allocated > 0 and STORE.pool.allocated_total == allocated


def test_mixed_checkpoint_and_swap(reference):
    model = make_model()
    for i in range(4):
        model.layers[i] = (checkpoint_wrapper if i % 2 == 0 else swap_wrapper)(model.layers[i])
    chain(model)
    result = train(model)
    assert_bitwise(result, reference)
    assert SwapManager().stats()["offload_bytes"] > 0
    assert result[2] < 0.5 * reference[2]


def test_swap_tensor_wrapper_in_plain_chained_cells(reference):
    model = make_model(register=True)
    chain(model)
    result = train(model)
    assert_bitwise(result, reference)
    stats = SwapManager().stats()
    # Layers 0-2 offload their registered hidden state (layer 3, the last, keeps it).
    assert stats["offload_count"] == 3 * STEPS
    assert stats["offload_bytes"] == 3 * STEPS * BATCH * 2 * HIDDEN * 4
    assert result[2] < reference[2]


def test_functions_of_mindspore_tensors_and_swap_policy():
    block = make_model().layers[0]
    x = Tensor(np.ones((BATCH, HIDDEN), np.float32))

    def fn(t):
        return block(t)

    def grads(run):
        return ms.grad(lambda t: run(t).sum(), grad_position=0)(x).asnumpy()

    plain = grads(fn)
    small_kept = swap_wrapper(fn, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE
                              if t.nbytes < 1024 else CheckpointPolicy.MUST_SWAP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unscheduled regions: no overlap
        assert np.array_equal(grads(lambda t: checkpoint(fn, t, swap_inputs=True)), plain)
        assert SwapManager().stats()["offload_count"] == 1  # the region's input
        assert np.array_equal(grads(checkpoint_wrapper(fn)), plain)
        assert np.array_equal(grads(small_kept), plain)
        with pytest.raises(ValueError, match="hyper_parallel: the swap policy_fn returned"):
            grads(lambda t: swap(fn, t, policy_fn=lambda _: CheckpointPolicy.MUST_RECOMPUTE))
    # The error left MindSpore usable: the next step is the plain step again.
    assert np.array_equal(grads(fn), plain)
    assert SwapManager().stats()["offload_count"] > 0


def test_graph_mode_maps_checkpoint_wrapper_to_cell_recompute():
    ms.set_context(mode=ms.GRAPH_MODE)
    block = Block()
    calls = []
    block.recompute = lambda **kw: calls.append(kw)
    assert checkpoint_wrapper(block) is block and calls == [{}]
    with pytest.raises(RuntimeError, match="hyper_parallel: swap_wrapper on MindSpore needs "
                                           "PyNative mode"):
        swap_wrapper(Block())
    with pytest.raises(RuntimeError, match="PyNative"):
        checkpoint_wrapper(Block(), policy_fn=["MatMul"])
    with pytest.raises(RuntimeError, match="PyNative"):
        checkpoint(Block(), Tensor(np.ones((1, HIDDEN), np.float32)))


def test_package_and_torch_calls_never_import_mindspore():
    # In this environment MindSpore is importable, so an accidental import would happen.
    code = (
        "import sys, torch\n"
        "from hyper_parallel.core.activation_checkpoint import checkpoint, swap_wrapper\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "checkpoint(lin, torch.randn(2, 4, requires_grad=True)).sum().backward()\n"
        "swap_wrapper(lambda x: x * 2)(torch.ones(2, requires_grad=True))\n"
        "assert 'mindspore' not in sys.modules, 'mindspore was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_chain_of_cells_unregister_and_wrapper_refusal():
    model = make_model(register=True)
    chain(model)
    wrapped = swap_wrapper(Block())
    with pytest.raises(ValueError, match="hyper_parallel: set_forward_prefetch_layer"):
        SwapManager().set_forward_prefetch_layer(wrapped, wrapped._checkpoint_wrapped_module)
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_wrapper(wrapped)
    SwapManager().unregister(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # swap_tensor_wrapper outside any region
        train(model, meter=False)
    assert SwapManager().stats()["offload_count"] == 0  # no region, nothing registered
