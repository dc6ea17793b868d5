"""checkpoint_wrapper / swap_wrapper inside FSDP2 (torch.distributed.fsdp.fully_shard).

Two gloo ranks on CPU with the CPU swap backend; the wrappers are applied first, then
fully_shard (per layer and at the root), as the user guide shows. Every run is compared
bitwise with the same FSDP model without wrappers, and within a tight tolerance with a
single-process model trained on the whole batch (data parallel averages the two halves'
gradients, which reorders float sums).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ._launch import (
    MLPBlock,
    Stack,
    assert_close_runs,
    assert_equal_runs,
    batch,
    launch,
    mesh_1d,
    local,
    loss_of,
    train,
    twin,
)

pytestmark = pytest.mark.distributed

STEPS = 3


def _mesh(world_size):
    return mesh_1d(world_size, "dp")


def _shard(model, mesh, **fsdp_kwargs):
    from hyper_parallel import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _rank_inputs(rank, world_size):
    return [batch(s).chunk(world_size)[rank] for s in range(STEPS)]


def _global_loss(loss):
    loss = loss.clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss


# ------------------------------------------------------------------------ FSDP + checkpoint
def _fsdp_checkpoint(rank, world_size):
    from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper

    mesh = _mesh(world_size)
    base = Stack()
    reference = train(twin(base), [batch(s) for s in range(STEPS)])

    plain = _shard(twin(base), mesh)
    wrapped = twin(base)
    for i, layer in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(layer)
    # The inner module runs twice per step: forward, then recompute in backward (a pre-hook:
    # torch's recompute stops as soon as it has what backward needs).
    calls = []
    for layer in wrapped.layers:
        layer._checkpoint_wrapped_module.register_forward_pre_hook(
            lambda m, a: calls.append(torch._C._current_graph_task_id() != -1))
    _shard(wrapped, mesh)

    inputs = _rank_inputs(rank, world_size)
    run = train(wrapped, inputs)
    assert calls == ([False] * 3 + [True] * 3) * STEPS, calls
    assert_equal_runs(run, train(plain, inputs), "FSDP+checkpoint vs FSDP")
    assert_close_runs(run, reference, "FSDP+checkpoint vs single process",
                      loss_scale=_global_loss)
    assert SwapManager().stats()["offload_bytes"] == 0  # recompute only, nothing swapped
    return [type(m).__name__ for m in wrapped.layers]


def test_fsdp2_checkpoint_matches_reference():
    names = launch(_fsdp_checkpoint)
    # fully_shard subclasses the wrapper in place: FSDP is outside, our wrapper inside.
    assert names[0] == ["FSDPCheckpointWrapper"] * 3


# ------------------------------------------------- sharded first, then a selective plan
def _fsdp_sharded_then_selective(rank, world_size):
    """fully_shard first, then apply_activation_memory (the planner's order: it profiles and
    applies on the model as the user built it). FSDP2's all-gather input is a view of the
    buffer the collective writes; under a declarative selective policy (C++ interception)
    that write made the input look modified by an undeclared write and backward raised
    (tester). Bitwise with the same sharded model without a plan."""
    from hyper_parallel.core.activation_checkpoint import apply_activation_memory

    mesh = _mesh(world_size)
    base = Stack()
    inputs = _rank_inputs(rank, world_size)
    reference = train(_shard(twin(base), mesh), inputs)
    for plan in ("selective", "checkpoint"):
        model = _shard(twin(base), mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_activation_memory(model, plan, layers=[f"layers.{i}" for i in range(3)])
        assert_equal_runs(train(model, inputs), reference, f"sharded, then {plan} vs FSDP")
    return True


def test_fsdp2_sharded_first_then_a_selective_plan_matches():
    assert launch(_fsdp_sharded_then_selective) == [True, True]


# ------------------------------------------------------------------------ FSDP + swap chain
def _swap_stack(base):
    from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

    model = twin(base)
    for i, layer in enumerate(model.layers):
        model.layers[i] = swap_wrapper(layer)
    for i in range(len(model.layers) - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    return model


def _fsdp_swap_chain(rank, world_size):
    from hyper_parallel._extension import _C
    from hyper_parallel.core.activation_checkpoint import SwapManager

    manager = SwapManager()
    mesh = _mesh(world_size)
    base = Stack()
    inputs = _rank_inputs(rank, world_size)
    reference = train(twin(base), [batch(s) for s in range(STEPS)])

    # What swap moves for this rank's batch without FSDP: activations only.
    manager.reset()
    train(_swap_stack(base), inputs)
    manager.synchronize()
    expected = manager.stats()
    assert expected["offload_bytes"] > 0
    manager.reset()

    plain = _shard(twin(base), mesh)
    wrapped = _swap_stack(base)
    # Inside each layer's forward, FSDP's all-gathered (unsharded) parameters are the
    # module's parameters: leaves that require grad, which the engine never manages.
    seen = []

    def inspect_params(module, args, output):
        for p in module.parameters():
            seen.append((type(p).__name__, _C.ineligible_reason(p), _C.residency(p),
                         p.untyped_storage().nbytes() > 0))

    for layer in wrapped.layers:
        layer._checkpoint_wrapped_module.register_forward_hook(inspect_params)
    _shard(wrapped, mesh)

    run = train(wrapped, inputs)
    manager.synchronize()
    stats = manager.stats()

    assert_equal_runs(run, train(plain, inputs), "FSDP+swap vs FSDP")
    assert_close_runs(run, reference, "FSDP+swap vs single process", loss_scale=_global_loss)

    assert len(seen) == 6 * 3 * STEPS  # 6 parameters per layer, 3 layers
    for kind, reason, residency, allocated in seen:
        assert kind == "Parameter" and reason == "parameter or view of a parameter", seen
        assert residency is None and allocated, seen
    for name, p in wrapped.named_parameters():  # the sharded parameters (DTensors)
        assert _C.residency(p) is None, name
    # Exactly the activations that swap moves without FSDP: no parameter bytes.
    for key in ("offload_bytes", "offload_count", "reload_bytes", "reload_count"):
        assert stats[key] == expected[key], (key, stats, expected)
    assert stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0  # the chain prefetched every layer in time
    assert stats["live_records"] == 0
    return stats["offload_bytes"]


def test_fsdp2_swap_chain_matches_reference():
    offloaded = launch(_fsdp_swap_chain)
    assert offloaded[0] == offloaded[1] > 0


# --------------------------------------------------------- FSDP mixed precision + recompute
class _DtypeProbe(MLPBlock):
    """Records, per call, whether it is a recompute and the dtypes it computes in."""

    def forward(self, x):
        self.calls.append((torch._C._current_graph_task_id() != -1, x.dtype,
                           self.up.weight.dtype, self.down.weight.dtype))
        return super().forward(x)


def _probe_stack(base):
    model = twin(base)
    for i, layer in enumerate(model.layers):
        probe = _DtypeProbe()
        probe.load_state_dict(layer.state_dict())
        probe.calls = []
        model.layers[i] = probe
    return model


def _fsdp_mixed_precision(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper

    mesh = _mesh(world_size)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = _probe_stack(Stack())
    plain = _shard(twin(base), mesh, mp_policy=policy)
    wrapped = twin(base)
    for i, layer in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(layer)
    _shard(wrapped, mesh, mp_policy=policy)

    inputs = _rank_inputs(rank, world_size)
    run = train(wrapped, inputs)
    assert_equal_runs(run, train(plain, inputs), "FSDP(bf16)+checkpoint vs FSDP(bf16)")
    for layer in wrapped.layers:
        calls = layer.calls
        assert len(calls) == 2 * STEPS, calls
        forward = [c[1:] for c in calls if not c[0]]
        recompute = [c[1:] for c in calls if c[0]]
        assert forward == recompute == [(torch.bfloat16,) * 3] * STEPS, calls
    return [str(local(p).dtype) for p in wrapped.parameters()][:1]


def test_fsdp2_mixed_precision_recompute_sees_forward_dtypes():
    dtypes = launch(_fsdp_mixed_precision)
    assert dtypes == [["torch.float32"]] * 2  # sharded parameters stay in float32


# -------------------------------------------------------------------------- state dicts
def _copied(state_dict):
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                    state_dict)


def _fsdp_state_dict(rank, world_size):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap_wrapper

    mesh = _mesh(world_size)
    base = Stack()
    keys = list(base.state_dict().keys())
    inputs = _rank_inputs(rank, world_size)

    def make(wrap):
        model = twin(base)
        if wrap:
            model.layers[0] = checkpoint_wrapper(model.layers[0])
            model.layers[1] = swap_wrapper(model.layers[1])
            model.layers[2] = checkpoint_wrapper(model.layers[2])
        _shard(model, mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt

    def step(model, opt, x):
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad()

    wrapped, wrapped_opt = make(True)
    plain, plain_opt = make(False)
    assert wrapped.layers[0]._checkpoint_wrapped_module is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layer 1 swaps without a schedule here
        step(wrapped, wrapped_opt, inputs[0])
    step(plain, plain_opt, inputs[0])

    # Same keys as the unwrapped model, sharded and full.
    for options in (None, StateDictOptions(full_state_dict=True, cpu_offload=False)):
        msd_w = get_model_state_dict(wrapped, options=options)
        msd_p = get_model_state_dict(plain, options=options)
        assert list(msd_w.keys()) == list(msd_p.keys()) == keys, (list(msd_w), keys)
        osd_w = get_optimizer_state_dict(wrapped, wrapped_opt, options=options)
        osd_p = get_optimizer_state_dict(plain, plain_opt, options=options)
        assert sorted(osd_w["state"].keys()) == sorted(osd_p["state"].keys()) == sorted(keys)
        assert osd_w["param_groups"][0]["params"] == osd_p["param_groups"][0]["params"]
        for k in keys:
            assert torch.equal(local(msd_w[k]), local(msd_p[k])), k
            for s in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(local(osd_w["state"][k][s]), local(osd_p["state"][k][s])), k
    full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    assert full.keys() == base.state_dict().keys()

    # Load both ways: wrapped -> a fresh unwrapped model, unwrapped -> a fresh wrapped one;
    # the next step then gives the same parameters everywhere.
    results = {}
    for src, src_opt, wrap, name in ((wrapped, wrapped_opt, False, "wrapped->plain"),
                                     (plain, plain_opt, True, "plain->wrapped")):
        dst, dst_opt = make(wrap)
        # Copies, as after a save and a load (the getters return the live tensors).
        set_model_state_dict(dst, _copied(get_model_state_dict(src)))
        set_optimizer_state_dict(dst, dst_opt, _copied(get_optimizer_state_dict(src, src_opt)))
        results[name] = (dst, dst_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model, opt in [(wrapped, wrapped_opt), (plain, plain_opt), *results.values()]:
            step(model, opt, inputs[1])
    expected = get_model_state_dict(plain)
    for name, (model, _) in results.items():
        got = get_model_state_dict(model)
        for k in keys:
            assert torch.equal(local(got[k]), local(expected[k])), (name, k)
    got = get_model_state_dict(wrapped)
    for k in keys:
        assert torch.equal(local(got[k]), local(expected[k])), ("wrapped", k)

    # A plain (non-distributed) state dict of the unwrapped model loads into the wrapped
    # and sharded one through the full-state-dict path.
    fresh, _ = make(True)
    set_model_state_dict(fresh, base.state_dict(),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    restored = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    for k in keys:
        assert torch.equal(restored[k], base.state_dict()[k]), k
    return keys


def test_fsdp2_state_dict_keys_and_load_both_ways():
    keys = launch(_fsdp_state_dict)
    assert keys[0] == keys[1]
    assert "layers.0.up.weight" in keys[0]
    assert not any("_checkpoint_wrapped_module" in k for k in keys[0])


# ----------------------------------------------------------- the user guide's FSDP example
class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = MLPBlock()


class _GuideModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Transformer()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.transformer.layer(x))


def _guide_fsdp_example(rank, world_size):
    dp_size = world_size
    torch.manual_seed(0)
    model = _GuideModel()
    reference = twin(model)

    # --- the guide's code, with "npu" replaced by "cpu" ---
    from hyper_parallel import fully_shard, init_device_mesh
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper

    mesh = init_device_mesh("cpu", (dp_size,), mesh_dim_names=("dp",))
    model.transformer.layer = checkpoint_wrapper(model.transformer.layer)
    model = fully_shard(model, mesh=mesh)
    # --- end of the guide's code ---

    inputs = _rank_inputs(rank, world_size)
    run = train(model, inputs)
    assert_close_runs(run, train(reference, [batch(s) for s in range(STEPS)]),
                      "guide FSDP example vs single process", loss_scale=_global_loss)
    return type(model.transformer.layer).__name__


def test_guide_fsdp_example_runs_on_cpu():
    assert launch(_guide_fsdp_example) == ["CheckpointWrapper"] * 2


def test_top_level_reexports_are_torchs_own():
    import hyper_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    assert hyper_parallel.fully_shard is fully_shard
    assert hyper_parallel.init_device_mesh is init_device_mesh
    assert hyper_parallel.parallelize_module is parallelize_module
    assert hyper_parallel.ColwiseParallel is ColwiseParallel
    assert hyper_parallel.RowwiseParallel is RowwiseParallel
    assert {"fully_shard", "init_device_mesh", "parallelize_module", "ColwiseParallel",
            "RowwiseParallel"} <= set(hyper_parallel.__all__)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hyper_parallel.not_a_name  # noqa: B018
