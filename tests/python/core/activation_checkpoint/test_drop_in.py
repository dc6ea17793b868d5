"""Drop-in for torch.utils.checkpoint: what code written for torch's checkpoint and
selective checkpoint does, it does unchanged with ours (issue 13).

Parity with PyTorch's own tests of non-reentrant checkpoint and selective checkpoint
(test/test_autograd.py, TestCheckpoint / TestSelectiveActivationCheckpoint, torch 2.13):
the cases below check the same behaviours, written from scratch for our API.
"""

from __future__ import annotations

import enum
import functools
import pickle
import warnings

import pytest

import torch
import torch.utils.checkpoint as tc
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    checkpoint,
    checkpoint_sequential,
    checkpoint_wrapper,
    create_selective_checkpoint_contexts,
    saved_activation_memory,
)

aten = torch.ops.aten
D = 8


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D), nn.Tanh())


def _grads(model, x, call):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    call(model, x).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _plain(model, x):
    return model(x)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


# ------------------------------------------------------------------ CheckpointPolicy

def test_checkpoint_policy_is_a_real_enum_converting_with_torchs():
    P, T = CheckpointPolicy, tc.CheckpointPolicy
    assert issubclass(P, enum.Enum)
    assert [p.name for p in P] == ["MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE",
                                   "PREFER_RECOMPUTE", "MUST_SWAP"]
    assert [p.value for p in P] == [0, 1, 2, 3, 4]
    for p in P:
        assert pickle.loads(pickle.dumps(p)) is p
        assert P(p.value) is p and P[p.name] is p
    assert [P(t) for t in T] == [P.MUST_SAVE, P.PREFER_SAVE, P.MUST_RECOMPUTE,
                                 P.PREFER_RECOMPUTE, P.MUST_SWAP, P.MUST_SWAP]
    assert [P.from_torch(t) for t in T] == [P(t) for t in T]
    assert [p.to_torch() for p in P] == [T.MUST_SAVE, T.PREFER_SAVE, T.MUST_RECOMPUTE,
                                         T.PREFER_RECOMPUTE, T.MUST_CPU_OFFLOAD]
    with pytest.raises(ValueError):
        P(7)
    with pytest.raises(ValueError, match="hyper_parallel: .* not a torch"):
        P.from_torch(3)


# ------------------------------------------------------------------ create_selective_checkpoint_contexts

def _count_policy(calls):
    def policy(ctx, op, *args, **kwargs):
        calls.append((ctx.is_recompute, op))
        return CheckpointPolicy.MUST_SAVE if op is aten.addmm.default else \
            CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@pytest.mark.parametrize("policy", [
    [aten.addmm.default],
    [aten.addmm, "aten::mm"],
    {aten.addmm.default: tc.CheckpointPolicy.MUST_SAVE},
    "callable",
], ids=["torch-list", "our-list", "dict", "callable"])
def test_contexts_under_torchs_checkpoint_match_no_checkpoint(policy, caches):
    model, x = _block(), torch.randn(4, D)
    calls = []
    if policy == "callable":
        policy = _count_policy(calls)
    ctx = functools.partial(create_selective_checkpoint_contexts, policy)
    got = _grads(model, x, lambda m, t: tc.checkpoint(m, t, use_reentrant=False, context_fn=ctx))
    assert _equal(got, _grads(model, x, _plain))
    assert len(caches) == 1
    stats = caches[0].stats()
    assert stats["replays"] == 2  # both addmm outputs came from the cache
    if calls:
        assert all(op is aten.addmm.default or isinstance(op, torch._ops.OpOverload)
                   for _, op in calls)
        assert {r for r, _ in calls} == {False, True}


def test_contexts_must_swap_under_torchs_checkpoint_offloads(host_swap):
    model, x = _block(), torch.randn(64, D)
    ctx = functools.partial(create_selective_checkpoint_contexts,
                            {aten.addmm: CheckpointPolicy.MUST_SWAP})
    before = SwapManager().stats()["offload_bytes"]
    with pytest.warns(UserWarning, match="not part of a prefetch schedule"):
        got = _grads(model, x,
                     lambda m, t: tc.checkpoint(m, t, use_reentrant=False, context_fn=ctx))
    assert SwapManager().stats()["offload_bytes"] - before == 2 * 64 * D * 4
    assert _equal(got, _grads(model, x, _plain))


def test_contexts_with_apply_activation_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    plain, x = _block(), torch.randn(4, D)
    model = _block()
    ctx = functools.partial(create_selective_checkpoint_contexts, [aten.addmm.default])
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(
            torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper,
            context_fn=ctx),
        check_fn=lambda m: isinstance(m, nn.Linear))
    assert _equal(_grads(model, x, _plain), _grads(plain, x, _plain))


def test_contexts_with_hugging_face_gradient_checkpointing(caches):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    model.train(), ref.train()
    ctx = functools.partial(create_selective_checkpoint_contexts,
                            [aten.mm.default, aten.bmm.default])
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": ctx})
    ids = torch.randint(0, 32, (2, 8))
    for m in (ref, model):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len(caches) == 2 and all(c.stats()["replays"] > 0 for c in caches)  # one per layer


def test_contexts_argument_checks():
    with pytest.raises(TypeError, match="allow_cache_entry_mutation must be bool"):
        create_selective_checkpoint_contexts([aten.mm.default], allow_cache_entry_mutation=1)
    with pytest.raises(TypeError, match="needs a policy"):
        create_selective_checkpoint_contexts(None)
    with pytest.raises(ValueError, match="is not an op"):
        create_selective_checkpoint_contexts([torch.nn.functional.linear])


# ------------------------------------------------------------------ checkpoint options

def test_early_stop_is_checkpoints_option_not_the_functions():
    runs = {"tail": 0}

    def f(x, scale=1.0):
        y = (x * scale).sin()
        z = y.cos()
        runs["tail"] += 1  # after the last saved tensor: early stop skips it in recompute
        return z

    for early_stop, expected in ((True, 1), (False, 2)):
        runs["tail"] = 0
        x = torch.randn(4, requires_grad=True)
        checkpoint(f, x, scale=2.0, early_stop=early_stop).sum().backward()
        assert runs["tail"] == expected, early_stop
        assert torch.equal(x.grad, (2 * (-(2 * x.detach()).sin().sin())
                                    * (2 * x.detach()).cos()))


def test_checkpoint_sequential_matches_torchs_and_no_checkpoint():
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4)])
    x = torch.randn(4, D)
    ref = _grads(seq, x, _plain)
    for segments in (1, 2, 3, 4):
        assert _equal(_grads(seq, x, lambda m, t: checkpoint_sequential(m, segments, t)), ref)
        assert _equal(_grads(seq, x, lambda m, t: checkpoint_sequential(
            list(m), segments, t, policy_fn=[aten.addmm])), ref)
        torch_run = _grads(seq, x, lambda m, t: tc.checkpoint_sequential(
            m, segments, t, use_reentrant=False))
        assert _equal(torch_run, ref)
    with pytest.raises(TypeError, match="unknown options"):
        checkpoint_sequential(seq, 2, x, bogus=1)
    with pytest.raises(TypeError, match="segments must be a positive int"):
        checkpoint_sequential(seq, 0, x)
    # tester: a bare "'int' object is not iterable" (torch's own gives the same)
    with pytest.raises(TypeError, match=r"^hyper_parallel: checkpoint_sequential's functions "
                                        r"must be an nn.Sequential or a list"):
        checkpoint_sequential(5, 1, x)
    with pytest.raises(TypeError, match=r"^hyper_parallel: checkpoint_sequential's functions "
                                        r"must all be callable; item 1 is a int"):
        checkpoint_sequential([seq[0], 3], 1, x)


@pytest.mark.parametrize("options", [{"swap_inputs": True},
                                     {"policy_fn": {aten.addmm: CheckpointPolicy.MUST_SWAP}}],
                         ids=["swap_inputs", "must_swap"])
def test_checkpoint_sequential_swaps_without_asking_for_a_chain(options, host_swap):
    """Its segments are new functions on every call: the unscheduled-region warning asked
    the user to chain them, which no one can (a tester). They swap and reload on demand."""
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4)])
    x = torch.randn(4, D)
    ref = _grads(seq, x, _plain)
    host_swap.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(seq, x, lambda m, t: checkpoint_sequential(m, 4, t, **options))
    assert _equal(got, ref)
    assert not [w for w in caught if "prefetch schedule" in str(w.message)]
    host_swap.synchronize()
    assert host_swap.stats()["offload_bytes"] > 0


def _mutated_output_region(allow):
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(4, D, requires_grad=True)

    def f(t):
        h = t @ w
        return h, h.sin()  # sin saves h: the recompute needs the cached mm output

    h, y = checkpoint(f, x, policy_fn=[aten.mm], allow_cache_entry_mutation=allow)
    with torch.no_grad():
        h.mul_(2)  # the cached mm output, written after the region's forward
    y.sum().backward()
    return w, x, h


def test_allow_cache_entry_mutation_has_torchs_meaning():
    with pytest.raises(RuntimeError, match="modified in place after it was cached"):
        _mutated_output_region(False)
    w, x, h = _mutated_output_region(True)  # the mutated value is handed back
    # d(sum(sin(h)))/dx = cos(h) @ w^T, with the doubled h that the cache now holds.
    assert torch.allclose(x.grad, h.detach().cos() @ w.detach().t())


def test_cache_entry_written_later_in_the_forward_is_recomputed_by_default():
    # torch raises here by default; ours recomputes the op with the in-place write.
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(4, D, requires_grad=True)

    def f(t):
        h = t @ w
        h.mul_(2)
        return h.tanh()

    with pytest.warns(UserWarning, match="modified in place later in the same checkpoint"):
        checkpoint(f, x, policy_fn=[aten.mm]).sum().backward()
    ref_w, ref_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    f(x).sum().backward()
    assert torch.equal(w.grad, ref_w) and torch.equal(x.grad, ref_x)


@pytest.mark.parametrize("options,error", [
    ({"preserve_rng_state": 1}, TypeError),
    ({"preserve_rng_state": None}, TypeError),
    ({"debug": "yes"}, TypeError),
    ({"early_stop": 0}, TypeError),
    ({"use_reentrant": 0}, TypeError),
    ({"use_reentrant": True, "policy_fn": [torch.ops.aten.mm]}, ValueError),
    ({"determinism_check": "bogus"}, ValueError),
    ({"determinism_check": 1}, ValueError),
    ({"swap_inputs": 1}, TypeError),
    ({"group_swap": "no"}, TypeError),
    ({"allow_cache_entry_mutation": None}, TypeError),
])
def test_option_values_are_checked_strictly(options, error):
    x = torch.randn(2, D, requires_grad=True)
    with pytest.raises(error, match="hyper_parallel: "):
        checkpoint(torch.sin, x, **options)
    with pytest.raises(error, match="hyper_parallel: "):
        checkpoint_wrapper(nn.Linear(D, D), **options)


# ------------------------------------------------------------------ saved-activation meter

def test_meter_counts_torchs_selective_cache_as_ours():
    model, x = _block(), torch.randn(32, D, requires_grad=True)
    peaks = {}
    ctx = functools.partial(tc.create_selective_checkpoint_contexts, [aten.addmm.default])
    runs = {
        "torch": lambda: tc.checkpoint(model, x, use_reentrant=False, context_fn=ctx),
        "ours": lambda: checkpoint(model, x, policy_fn=[aten.addmm.default]),
        "torch_full": lambda: tc.checkpoint(model, x, use_reentrant=False),
    }
    for name, run in runs.items():
        with saved_activation_memory() as meter:
            out = run()
        out.sum().backward()
        peaks[name] = meter.peak_bytes
    # Both keep the two addmm outputs (32 x 8 fp32 each) on top of the region's input.
    assert peaks["torch"] == peaks["ours"] == peaks["torch_full"] + 2 * 32 * D * 4
    assert tc._VersionWrapper.__name__ == "_VersionWrapper"  # restored after the meter
