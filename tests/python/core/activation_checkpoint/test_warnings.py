"""Warnings name the user's line (_warnings.warn), whatever path reached them: the swap
wrappers' C++ call, nn.Module.__call__ with hooks, swap()'s Python path, wrapping time."""

import inspect
import warnings

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap, swap_wrapper


def _caught(call):
    """Runs call(); returns the hyper_parallel warnings it raised and the line it ran on."""
    line = inspect.currentframe().f_back.f_lineno
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    ours = [w for w in caught if str(w.message).startswith("hyper_parallel:")]
    return ours, line


def _assert_here(ours, line):
    assert ours, "expected a hyper_parallel warning"
    for w in ours:
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno, str(w.message))


class _Sin(nn.Module):
    def forward(self, x):
        return torch.sin(x * 2.0)


def test_unscheduled_swap_wrapper_of_a_function_warns_at_the_call(host_swap):
    def unscheduled_fn_layer(x):
        return torch.sin(x * 2.0)

    layer = swap_wrapper(unscheduled_fn_layer)
    x = torch.randn(4, requires_grad=True)
    ours, line = _caught(lambda: layer(x).sum().backward())
    _assert_here(ours, line)


def test_unscheduled_module_wrapper_warns_at_the_call_with_and_without_hooks(host_swap):
    class UnscheduledA(_Sin):
        pass

    class UnscheduledB(_Sin):
        pass

    x = torch.randn(4, requires_grad=True)
    fast = swap_wrapper(UnscheduledA())  # the wrapper's own __call__, then C++
    ours, line = _caught(lambda: fast(x).sum().backward())
    _assert_here(ours, line)
    hooked = swap_wrapper(UnscheduledB())  # nn.Module.__call__'s frames (a forward hook)
    hooked.register_forward_hook(lambda module, args, out: None)
    ours, line = _caught(lambda: hooked(x).sum().backward())
    _assert_here(ours, line)


def test_unscheduled_swap_call_warns_at_the_call(host_swap):
    def unscheduled_swap_call(x):
        return torch.sin(x * 2.0)

    x = torch.randn(4, requires_grad=True)
    ours, line = _caught(lambda: swap(unscheduled_swap_call, x).sum().backward())
    _assert_here(ours, line)


def test_nesting_warns_where_the_outer_wrapper_is_built():
    inner = swap_wrapper(_Sin())
    ours, line = _caught(lambda: checkpoint_wrapper(nn.Sequential(inner)))
    _assert_here(ours, line)
