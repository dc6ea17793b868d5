"""The public import path and what it exposes are stable (SPEC 2)."""

import importlib
import subprocess
import sys

import pytest

import hyper_parallel.core.activation_checkpoint as ac


def test_public_names():
    expected = {"CheckpointPolicy", "SwapManager", "checkpoint", "checkpoint_wrapper", "swap",
                "swap_wrapper", "swap_tensor_wrapper", "saved_activation_memory"}
    assert expected <= set(ac.__all__)
    for name in ac.__all__:
        assert getattr(ac, name) is not None


def test_checkpoint_policy_values():
    P = ac.CheckpointPolicy
    assert [P.MUST_SAVE.value, P.PREFER_SAVE.value, P.MUST_RECOMPUTE.value,
            P.PREFER_RECOMPUTE.value, P.MUST_SWAP.value] == [0, 1, 2, 3, 4]


def test_issue_acceptance_one_liner():
    out = subprocess.run(
        [sys.executable, "-c", "from hyper_parallel.core.activation_checkpoint import "
         "CheckpointPolicy as P; print(P.MUST_SWAP.value)"],
        capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"


def test_missing_extension_names_the_build_command(monkeypatch):
    import hyper_parallel._extension as ext

    real = importlib.import_module

    def fail(name, *args, **kwargs):
        if name == "hyper_parallel._C":
            raise ImportError("undefined symbol: _ZN3c10simulated")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match=r"hyper_parallel: .*bash scripts/setup\.sh.*"
                                          r"pip install --no-build-isolation"):
        ext.load_extension()


def test_a_name_of_the_api_missing_at_the_top_level_says_where_it_lives():
    import hyper_parallel

    with pytest.raises(AttributeError, match="import it from hyper_parallel.core."
                                             "activation_checkpoint"):
        hyper_parallel.SwapManager  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'$"):
        hyper_parallel.no_such_name  # noqa: B018


def _bad_input_cases():
    import torch
    from torch import nn

    import hyper_parallel

    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(2, 4, requires_grad=True)
    return {
        "swap(3, x)": (lambda: ac.swap(3, x), TypeError),
        "checkpoint(3, x)": (lambda: ac.checkpoint(3, x), TypeError),
        "remove_activation_memory(5)": (lambda: hyper_parallel.remove_activation_memory(5),
                                        TypeError),
        "checkpoint_sequential(4 modules, 100)": (
            lambda: ac.checkpoint_sequential(seq, 100, x), ValueError),
        "checkpoint_sequential([], 1)": (lambda: ac.checkpoint_sequential([], 1, x), ValueError),
    }


@pytest.mark.parametrize("case", sorted(_bad_input_cases()))
def test_bad_input_to_entry_points_gives_a_prefixed_error_and_the_next_step_is_right(case):
    import torch

    call, kind = _bad_input_cases()[case]
    with pytest.raises(kind, match=r"^hyper_parallel: "):
        call()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.randn(3, requires_grad=True)
    ac.checkpoint(lambda t: (t * 2.0).sin(), x).sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach() * 2.0) * 2.0)
