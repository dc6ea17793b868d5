"""``checkpoint_wrapper`` and ``swap_wrapper`` for MindSpore Cells and functions.

A Cell wrapper is a Cell holding the wrapped Cell as ``_checkpoint_wrapped_module`` with
``auto_prefix=False``, so parameter names are those of the unwrapped model (a MindSpore
checkpoint saved with or without wrappers loads into the other); attributes, indexing and
``len`` reach the wrapped Cell. In graph mode ``checkpoint_wrapper(cell)`` without
options calls ``cell.recompute()`` and returns the cell itself (graph mode has no hooks
for anything else).
"""

from __future__ import annotations

import functools

from mindspore import nn

from ._api import LayerTarget, checkpoint, pynative, require_pynative, swap

_PREFIX = "_checkpoint_wrapped_module"
_PREFIX_DOT = _PREFIX + "."
_DEFAULTS = dict(policy_fn=None, swap_inputs=False, context_fn=None, group_swap=False,
                 use_reentrant=None, preserve_rng_state=True, determinism_check="default",
                 debug=False)
_OPTIONS = tuple(_DEFAULTS)


class MsActivationWrapper(nn.Cell):
    """Base of the MindSpore wrappers (subclasses implement ``construct``)."""

    _hp_is_wrapper = True

    def __init__(self, cell: nn.Cell) -> None:
        if getattr(cell, "_hp_is_wrapper", False):
            raise ValueError(
                f"hyper_parallel: {type(cell).__name__} is already wrapped by a hyper_parallel "
                "wrapper; wrap each Cell once (choose checkpoint_wrapper or swap_wrapper, and "
                "pass all options to that one call).")
        super().__init__(auto_prefix=False)
        setattr(self, _PREFIX, cell)

    @property
    def _hp_wrapped(self) -> nn.Cell:
        return self._cells[_PREFIX]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            cells = self.__dict__.get("_cells")
            if cells is None or _PREFIX not in cells or name == _PREFIX:
                raise
            return getattr(cells[_PREFIX], name)

    def parameters_and_names(self, name_prefix="", expand=True):
        # Without the wrapper's own segment: a parent that renames its parameters
        # (CellList.__setitem__ -> update_parameters_name) keeps the unwrapped names.
        for name, param in super().parameters_and_names(name_prefix, expand):
            yield name.replace(_PREFIX_DOT, ""), param

    def __getitem__(self, index):
        return self._hp_wrapped[index]

    def __len__(self):
        return len(self._hp_wrapped)


class MsCheckpointWrapper(MsActivationWrapper):
    """Every call of the wrapped Cell is a :func:`checkpoint` call."""

    def __init__(self, cell: nn.Cell, **checkpoint_kwargs) -> None:
        super().__init__(cell)
        self._hp_kwargs = checkpoint_kwargs

    def construct(self, *args, **kwargs):
        return checkpoint(LayerTarget(self, self._hp_wrapped), *args, **self._hp_kwargs,
                          **kwargs)


class MsSwapWrapper(MsActivationWrapper):
    """Every call of the wrapped Cell is a :func:`swap` call."""

    def __init__(self, cell: nn.Cell, policy_fn=None, group_swap=False) -> None:
        super().__init__(cell)
        self._hp_policy_fn = policy_fn
        self._hp_group_swap = group_swap

    def construct(self, *args, **kwargs):
        return swap(LayerTarget(self, self._hp_wrapped), *args, policy_fn=self._hp_policy_fn,
                    group_swap=self._hp_group_swap, **kwargs)


def _check_options(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"hyper_parallel: checkpoint_wrapper got unknown options {unknown}; "
                        f"it accepts {list(_OPTIONS)} (those of checkpoint()).")
    out = dict(kwargs)
    if out.get("policy_fn") is not None:
        from ._selective import compile_policy

        out["policy_fn"] = compile_policy(out["policy_fn"])  # validated once
    return out


def checkpoint_wrapper(module_or_fn, **checkpoint_kwargs):
    """``checkpoint_wrapper`` for a Cell (or, from the function wrapper, a function
    called with MindSpore tensors); see the public function.

    Raises:
        RuntimeError: in graph mode with options, or for a function in graph mode.
        ValueError: for a Cell already wrapped.
        TypeError: for an unknown option.
    """
    kwargs = _check_options(checkpoint_kwargs)
    if not pynative():
        given = sorted(k for k, v in kwargs.items()
                       if v is not _DEFAULTS[k] and v != _DEFAULTS[k]
                       and not (k == "use_reentrant" and v is False))
        if isinstance(module_or_fn, nn.Cell) and not given:
            module_or_fn.recompute()
            return module_or_fn
        require_pynative("checkpoint_wrapper" + (f" with {given}" if given else
                                                 " of a function"))
    if isinstance(module_or_fn, nn.Cell):
        return MsCheckpointWrapper(module_or_fn, **kwargs)
    return _function_wrapper(module_or_fn, checkpoint, kwargs)


def swap_wrapper(module_or_fn, policy_fn=None, group_swap=False):
    """``swap_wrapper`` for a Cell or function (see the public function)."""
    require_pynative("swap_wrapper")
    if isinstance(module_or_fn, nn.Cell):
        return MsSwapWrapper(module_or_fn, policy_fn=policy_fn, group_swap=group_swap)
    return _function_wrapper(module_or_fn, swap, dict(policy_fn=policy_fn, group_swap=group_swap))


def _function_wrapper(fn, run, kwargs: dict):
    @functools.wraps(fn)
    def wrapped(*args, **call_kwargs):
        return run(target, *args, **kwargs, **call_kwargs)

    target = LayerTarget(wrapped, fn)
    wrapped._hp_wrapped_fn = fn
    return wrapped


def wraps_each_other(first, second) -> bool:
    """True when one of the two is a wrapper of the other."""
    return any(isinstance(a, MsActivationWrapper) and a._cells.get(_PREFIX) is b
               for a, b in ((first, second), (second, first)))
