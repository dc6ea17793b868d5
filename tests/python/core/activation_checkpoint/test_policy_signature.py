"""Policy call shapes are checked when the policy is given (_policy_signature.py)."""

import functools

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    apply_activation_memory,
    checkpoint,
    checkpoint_wrapper,
    create_selective_checkpoint_contexts,
)

from ._models import Stack, assert_bitwise, grads, twin

_MSG = (r"^hyper_parallel: checkpoint's policy_fn is called once per op as "
        r"policy_fn\(ctx, op, \*args, \*\*kwargs\) -> CheckpointPolicy or bool, but ")


def two_args(ctx, op):
    return CheckpointPolicy.MUST_SAVE


def no_kwargs(ctx, op, *args):
    return CheckpointPolicy.MUST_SAVE


def torch_shape(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("bad", [two_args, lambda ctx, op, x: True])
def test_op_policy_without_star_args_is_refused_when_wrapping(bad):
    """Tester fault: a (ctx, op) policy was accepted and failed at the first forward."""
    with pytest.raises(TypeError, match=_MSG + r".*Declare it as def policy_fn\(ctx, op, "
                                              r"\*args, \*\*kwargs\)"):
        checkpoint_wrapper(nn.Linear(4, 4), policy_fn=bad)
    with pytest.raises(TypeError, match=_MSG):
        create_selective_checkpoint_contexts(bad)
    with pytest.raises(TypeError, match=_MSG):
        checkpoint(nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True), policy_fn=bad)
    with pytest.raises(TypeError, match=_MSG):
        apply_activation_memory(Stack(layers=2), "selective", policy_fn=bad)


def test_per_tensor_policy_given_to_checkpoint_still_says_swap():
    with pytest.raises(TypeError, match=_MSG + r".*the shape of a swap policy"):
        checkpoint_wrapper(nn.Linear(4, 4), policy_fn=functools.partial(lambda a, t: True, 1))


# (ctx, op, *args) without **kwargs is accepted, as torch accepts it.
@pytest.mark.parametrize("good", [torch_shape, no_kwargs, lambda *a, **k: False,
                                  functools.partial(lambda flag, ctx, op, *a, **k: flag, True)])
def test_torch_shaped_op_policies_pass_and_train_like_no_checkpoint(good):
    model = Stack(layers=2)
    ref = twin(model)
    x = torch.randn(2, 4, 32)
    ref(x).backward()
    checkpoint_wrapper(model.layers[0], policy_fn=good)  # accepted at wrap time
    apply_activation_memory(model, "selective", policy_fn=good)
    model(x).backward()
    assert_bitwise(grads(model), grads(ref))
