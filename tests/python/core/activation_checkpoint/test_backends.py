"""The framework seam (_backends.py): a third framework is one more backend module (here a
fake one, registered for the test), and torch objects never leave the torch backend.
(That torch calls import no MindSpore is checked in tests/mindspore, where it is installed.)"""

import sys
import types

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import (
    checkpoint, checkpoint_wrapper, saved_activation_memory, swap, swap_tensor_wrapper,
    swap_wrapper)
from hyper_parallel.core.activation_checkpoint import _backends


@pytest.fixture
def fakefw(monkeypatch):
    """A framework 'fakefw' (a tensor type, a module type) and its backend, which records
    the calls that reach it."""
    fw = types.ModuleType("fakefw")

    class Tensor:
        __module__ = "fakefw"

    class Cell:
        __module__ = "fakefw.nn"

        def __call__(self, x):
            return x

    fw.Tensor, fw.Cell = Tensor, Cell
    backend = types.ModuleType("fakefw_backend")
    backend.calls = []

    def recorder(name):
        def call(*args, **kwargs):
            backend.calls.append((name, args, kwargs))
            if name.endswith("_wrapper") and not isinstance(args[0], fw.Tensor):
                return lambda *a, **k: f"{name} called"  # a wrapper is callable
            return name
        return call

    for name in ("checkpoint", "checkpoint_wrapper", "swap", "swap_wrapper",
                 "swap_tensor_wrapper"):
        setattr(backend, name, recorder(name))
    monkeypatch.setitem(sys.modules, "fakefw", fw)
    monkeypatch.setitem(sys.modules, "fakefw_backend", backend)
    monkeypatch.setitem(_backends._BACKENDS, "fakefw", "fakefw_backend")
    return fw, backend


def test_a_third_framework_is_a_third_backend(fakefw):
    fw, backend = fakefw
    cell, x = fw.Cell(), fw.Tensor()
    assert checkpoint(cell, x, policy_fn=["MatMul"]) == "checkpoint"
    assert swap(lambda t: t, x) == "swap"                      # found through the arguments
    assert swap_tensor_wrapper(x, tag="t") == "swap_tensor_wrapper"
    assert checkpoint_wrapper(cell)(x) == "checkpoint_wrapper called"
    assert swap_wrapper(cell, group_swap=True)(x) == "swap_wrapper called"
    names = [c[0] for c in backend.calls]
    assert names == ["checkpoint", "swap", "swap_tensor_wrapper", "checkpoint_wrapper",
                     "swap_wrapper"]
    assert backend.calls[0][2]["policy_fn"] == ["MatMul"]  # options reach it untouched


def test_function_wrapper_dispatches_per_call(fakefw):
    fw, backend = fakefw
    wrapped = checkpoint_wrapper(lambda t: t * 2)
    # A torch call builds (once) and runs the torch wrapper ...
    x = torch.ones(3, requires_grad=True)
    wrapped(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    # ... a fakefw call builds that backend's wrapper.
    assert wrapped(fw.Tensor()) == "checkpoint_wrapper called"
    assert wrapped(fw.Tensor()) == "checkpoint_wrapper called"
    assert [c[0] for c in backend.calls] == ["checkpoint_wrapper"]  # built once


def test_torch_objects_stay_on_the_torch_backend(fakefw):
    lin = torch.nn.Linear(2, 2)
    assert _backends.backend_for(lin, args=(torch.ones(1),)) is None
    assert isinstance(checkpoint_wrapper(lin), torch.nn.Module)


def test_unknown_framework_meter_is_refused():
    with pytest.raises(ValueError, match="hyper_parallel: no backend for framework 'jax'"):
        with saved_activation_memory(framework="jax"):
            pass
    with pytest.raises(ValueError, match="parameters=.*is for MindSpore"):
        with saved_activation_memory(parameters=[]):
            pass
