"""checkpoint_wrapper / swap_wrapper after tensor parallel (parallelize_module).

Two gloo ranks on CPU with the CPU swap backend. Each MLP is split colwise (``up``) and
rowwise (``down``); the wrappers are applied after parallelize_module, as the user guide
shows. Saved activations that are DTensors are swapped through their local shards and
come back as DTensors with the same placements. Every run is compared bitwise with the
same TP model without wrappers, and within a tight tolerance with a single-process model
(the rowwise all-reduce sums two partial products, which reorders float sums).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from ._launch import (
    Stack,
    assert_close_runs,
    assert_equal_runs,
    batch,
    launch,
    mesh_1d,
    local,
    train,
    twin,
)

pytestmark = pytest.mark.distributed

STEPS = 3


def _mesh(world_size):
    return mesh_1d(world_size, "tp")


def _tp(model, mesh):
    from hyper_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        parallelize_module(layer, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _inputs():
    return [batch(s) for s in range(STEPS)]  # tensor parallel: every rank sees the batch


# --------------------------------------------------------------------------- TP + swap
def _tp_swap(rank, world_size):
    from torch.distributed.tensor import DTensor

    from hyper_parallel._extension import _C
    from hyper_parallel.core.activation_checkpoint import (
        CheckpointPolicy,
        SwapManager,
        swap_wrapper,
    )

    manager = SwapManager()
    mesh = _mesh(world_size)
    base = Stack()
    reference = train(twin(base), _inputs())
    plain = _tp(twin(base), mesh)

    offered = []

    def policy(t):  # sees every eligible saved tensor; DTensors as DTensors
        offered.append((type(t).__name__, tuple(repr(p) for p in getattr(t, "placements", ())),
                        t.requires_grad and t.is_leaf))
        return CheckpointPolicy.MUST_SWAP

    swapped = _tp(twin(base), mesh)
    for i, layer in enumerate(swapped.layers):
        swapped.layers[i] = swap_wrapper(layer, policy_fn=policy)
    for i in range(len(swapped.layers) - 1):
        manager.set_forward_prefetch_layer(swapped.layers[i], swapped.layers[i + 1])

    run = train(swapped, _inputs())
    manager.synchronize()
    stats = manager.stats()
    assert_equal_runs(run, train(plain, _inputs()), "TP+swap vs TP")
    assert_close_runs(run, reference, "TP+swap vs single process")

    # The colwise input (replicated) and the rowwise input (sharded on the last dim) are
    # saved as DTensors and offered to the policy; parameters never are.
    placements = {p for kind, p, _ in offered if kind == "DTensor"}
    assert placements == {("Replicate()",), ("Shard(dim=1)",)}, placements
    assert not any(is_param for _, _, is_param in offered), offered
    for name, p in swapped.named_parameters():
        assert _C.residency(p) is None, name
        if isinstance(p, DTensor):
            assert _C.ineligible_reason(p) == "parameter or view of a parameter", name
    assert stats["offload_bytes"] > 0
    assert stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0
    assert stats["live_records"] == 0
    return stats["offload_bytes"], sorted(placements)


def test_tp_swap_matches_reference():
    results = launch(_tp_swap)
    assert results[0] == results[1]
    assert results[0][1] == [("Replicate()",), ("Shard(dim=1)",)]


# --------------------------------------------------------------------- TP + checkpoint
def _tp_checkpoint(rank, world_size):
    from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper

    mesh = _mesh(world_size)
    base = Stack()
    reference = train(twin(base), _inputs())
    plain = _tp(twin(base), mesh)
    wrapped = _tp(twin(base), mesh)
    calls = []
    for i, layer in enumerate(wrapped.layers):
        layer.register_forward_pre_hook(
            lambda m, a: calls.append(torch._C._current_graph_task_id() != -1))
        wrapped.layers[i] = checkpoint_wrapper(layer)

    run = train(wrapped, _inputs())
    assert calls == ([False] * 3 + [True] * 3) * STEPS, calls  # forward, then recompute
    assert_equal_runs(run, train(plain, _inputs()), "TP+checkpoint vs TP")
    assert_close_runs(run, reference, "TP+checkpoint vs single process")
    assert SwapManager().stats()["offload_bytes"] == 0
    return len(calls)


def test_tp_checkpoint_matches_reference():
    assert launch(_tp_checkpoint) == [6 * STEPS] * 2


# ------------------------------------------------------------ TP + selective checkpoint
def _tp_selective(rank, world_size, policy):
    from hyper_parallel.core.activation_checkpoint import (
        CheckpointPolicy,
        checkpoint_wrapper,
        saved_activation_memory,
    )

    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    policies = {
        "declarative": [torch.ops.aten.mm, torch.ops.aten.addmm],
        "callable": lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if op in mm
                                              else CheckpointPolicy.PREFER_RECOMPUTE),
    }
    mesh = _mesh(world_size)
    base = Stack()
    plain = _tp(twin(base), mesh)

    def wrapped(**options):
        model = _tp(twin(base), mesh)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, **options)
        return model

    def saved(model):
        with saved_activation_memory() as meter:
            out = model(batch(0))
        out.square().mean().backward()
        return meter.peak_bytes

    selective = wrapped(policy_fn=policies[policy])
    run = train(selective, _inputs())
    assert_equal_runs(run, train(plain, _inputs()), f"TP+selective ({policy}) vs TP")
    # The matmul outputs of the sharded layers are cached: more is saved than under full
    # recompute, which keeps each layer's input only. (Here more than without checkpoint
    # too: the rowwise layer's partial product, input of the all-reduce, is cached and
    # autograd would not save it.)
    full, sel = saved(wrapped()), saved(selective)
    assert full < sel, (full, sel)
    return sel


@pytest.mark.parametrize("policy", ["declarative", "callable"])
def test_tp_selective_checkpoint_caches_the_sharded_matmuls(policy):
    launch(_tp_selective, policy)


# ------------------------------------------------ a saved DTensor: swap and come back
class _SaveSquare(torch.autograd.Function):
    """y = x * x, saving x; backward records what it gets back."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        from hyper_parallel._extension import _C

        (x,) = ctx.saved_tensors
        _SaveSquare.seen.append((type(x).__name__, x.placements, x.device_mesh, x.shape,
                                 x._local_tensor.clone(), _C.residency(x)))
        return grad * 2 * x


def _dtensor_roundtrip(rank, world_size):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hyper_parallel._extension import _C
    from hyper_parallel.core.activation_checkpoint import (
        CheckpointPolicy,
        SwapManager,
        swap,
        swap_tensor_wrapper,
    )

    manager = SwapManager()
    mesh = _mesh(world_size)
    values = torch.randn(8, 6)  # the same on both ranks (seeded)
    local_rows = values.chunk(world_size)[rank]
    _SaveSquare.seen = []

    def region(src):
        h = src * 3  # a DTensor activation, sharded on rows; only the saved copy keeps it
        return _SaveSquare.apply(h)

    src = distribute_tensor(values, mesh, [Shard(0)]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no schedule: offloaded at the end of forward
        out = swap(region, src)
    manager.synchronize()
    after_forward = manager.stats()
    out.sum().backward()
    stats = manager.stats()

    kind, placements, dmesh, shape, local_values, residency = _SaveSquare.seen[0]
    assert kind == "DTensor" and placements == (Shard(0),) and dmesh == mesh
    assert shape == values.shape and residency == "device"
    assert torch.equal(local_values, local_rows * 3)
    assert torch.equal(src.grad._local_tensor, (local_rows * 3) * 2 * 3)
    local_bytes = local_rows.numel() * local_rows.element_size()
    assert after_forward["offload_bytes"] == local_bytes, after_forward
    assert after_forward["resident_bytes"] == 0, after_forward
    assert stats["reload_bytes"] == local_bytes and stats["reload_count"] == 1, stats

    # Written in place after it was saved: the unpack (SwapEngine::unpack) refuses it.
    def modified(src):
        h = src * 3
        y = _SaveSquare.apply(h)
        h.mul_(2)
        return y

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = swap(modified, src)
    try:
        out.sum().backward()
    except RuntimeError as err:
        assert "hyper_parallel:" in str(err) and "in-place" in str(err), err
    else:
        raise AssertionError("an in-place write to a swapped DTensor was not detected")

    # swap_tensor_wrapper registers a DTensor through its local shard (a parameter: not at
    # all); the saved DTensor then follows the manual group's offload and load.
    manager.reset()
    _SaveSquare.seen = []
    param = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    with manager.group_context("dt"):
        h = src * 3
        assert swap_tensor_wrapper(h) is h and swap_tensor_wrapper(param) is param
        group = _C.current_group()
        assert (group.num_records, group.record_bytes) == (1, local_bytes)
        out = _SaveSquare.apply(h)
    del h, group
    manager.launch_offload("dt")
    manager.wait_offload("dt")
    manager.synchronize()
    assert manager.stats()["offload_bytes"] == local_bytes, manager.stats()
    manager.launch_load("dt")
    manager.wait_load("dt")
    src.grad = None
    out.sum().backward()
    assert torch.equal(src.grad._local_tensor, (local_rows * 3) * 2 * 3)
    assert _SaveSquare.seen[0][0] == "DTensor" and _SaveSquare.seen[0][1] == (Shard(0),)
    assert manager.stats()["reload_bytes"] == local_bytes

    # MUST_SAVE keeps a DTensor on device; a DTensor parameter is never swapped.
    manager.reset()
    keep = swap(region, src, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    weight = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    assert isinstance(weight, DTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = swap(_SaveSquare.apply, weight)
    manager.synchronize()
    assert manager.stats()["offload_bytes"] == 0, manager.stats()
    assert _C.residency(weight) is None
    (keep.sum() + direct.sum()).backward()
    assert torch.equal(weight.grad._local_tensor, 2 * weight._local_tensor)

    # Any other tensor subclass still passes through untouched (SPEC 4.4).
    from torch.testing._internal.two_tensor import TwoTensor

    manager.reset()
    pair = TwoTensor(torch.randn(4), torch.randn(4)).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = swap(lambda t: (t * 3).square(), pair)
    manager.synchronize()
    assert manager.stats()["offload_bytes"] == 0
    y.sum().backward()
    for got, value in ((pair.grad.a, pair.a), (pair.grad.b, pair.b)):
        assert torch.equal(got, (value * 3) * 2 * 3)
    return local_bytes


def test_saved_dtensor_swaps_its_local_shard_and_keeps_placements():
    assert launch(_dtensor_roundtrip) == [4 * 6 * 4] * 2


# ------------------------------------------------------------ the user guide's TP example
class _Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):  # local heads under colwise TP
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.o((scores @ v).transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = _Attention(d)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class _GuideModel(nn.Module):
    def __init__(self, n_layers: int = 3, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(d) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _guide_tp_example(rank, world_size):
    from hyper_parallel import ColwiseParallel, RowwiseParallel

    tp_size = world_size
    model = _GuideModel()
    reference = twin(model)
    tp_plan = {f"layers.*.attn.{name}": ColwiseParallel() for name in "qkv"}
    tp_plan["layers.*.attn.o"] = RowwiseParallel()

    # --- the guide's code, with "npu" replaced by "cpu" (the chain registration is
    # written as the loop that the guide's `i`/`i + 1` stands for) ---
    from hyper_parallel import init_device_mesh, parallelize_module
    from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

    tp_mesh = init_device_mesh("cpu", (tp_size,), mesh_dim_names=("tp",))
    parallelize_module(model, tp_mesh, tp_plan)
    for i, layer in enumerate(model.layers):
        model.layers[i].attn = swap_wrapper(layer.attn)
    for i in range(len(model.layers) - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    # --- end of the guide's code ---

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 16, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
    out.square().mean().backward()
    expected = reference(x)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    SwapManager().synchronize()
    stats = SwapManager().stats()
    # The attention's activations joined their layer's invocation and followed the chain:
    # no "not part of a prefetch schedule" warning, everything prefetched in time.
    assert not [w for w in caught if "hyper_parallel" in str(w.message)], \
        [str(w.message) for w in caught]
    assert stats["offload_bytes"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0 and stats["live_records"] == 0, stats
    return stats["offload_bytes"]


def test_guide_tp_example_runs_on_cpu():
    offloaded = launch(_guide_tp_example)
    assert offloaded[0] == offloaded[1] > 0
