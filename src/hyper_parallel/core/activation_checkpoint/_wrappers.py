"""Module and callable wrappers: ``swap_wrapper`` and ``checkpoint_wrapper`` (SPEC 2).

A module wrapper keeps the wrapped module as its child ``_checkpoint_wrapped_module``
(the attribute name torch's own checkpoint wrapper uses, which torch.distributed's
state-dict helpers already strip from fully qualified names) and is transparent:
``state_dict()`` keys, ``named_parameters()``/``named_buffers()``, attribute access,
indexing, ``len`` and iteration are those of the wrapped module, and a state dict saved
with or without wrappers loads into the other. Setting (or deleting) through the wrapper
an attribute, submodule, parameter or buffer that the wrapped module has acts on the
wrapped module (``wrapper.fc = LoRALinear(...)`` replaces the ``fc`` its forward uses);
names starting with ``_`` and names the wrapped module lacks stay on the wrapper.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from hyper_parallel._extension import _C

from . import _compile, _memory, _recompute_state
from ._backends import _BACKENDS, wrapper_dispatch
from ._host_pool import native_pool
from ._errors import check_flag
from ._policy_signature import check_swap_policy
from ._swap import LayerCall, swap_call, swap_module_call
from ._region import after_run_region, runs_plainly
from ._swap_manager import _LAYER_ATTR, SwapManager
from ._warnings import warn as warn_user

_PREFIX = "_checkpoint_wrapped_module"
_PREFIX_DOT = _PREFIX + "."

# Module -> its live swap wrapper. One swap_wrapper per module at a time: two would each
# open a swap region for the same layer, at most one of them in the chain, each with its
# own options. (Several checkpoint wrappers of one module are harmless: benchmarks compare
# policies on shared weights that way.)
_swap_wrapper_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _strip(name: str) -> str:
    return name.replace(_PREFIX_DOT, "")


_tls = threading.local()
_warned_nesting: set = set()
# Live module wrappers (exclusion regions aside): wrapping a module that sits inside one
# of them warns at wrap time, as wrapping a module that holds wrappers does.
_live_wrappers: weakref.WeakSet = weakref.WeakSet()


def _describe(wrapper) -> str:
    return f"{wrapper._hp_kind}({type(wrapper._checkpoint_wrapped_module).__name__})"


def _warn_nested(outer, inner) -> None:
    key = (id(outer), id(inner))
    if key in _warned_nesting:
        return
    _warned_nesting.add(key)
    warn_user(
        f"hyper_parallel: {_describe(inner)} is nested inside {_describe(outer)}. Results "
        "stay correct, but the inner wrapper's work is partly wasted (a swap inside a "
        "checkpoint region swaps tensors that recompute rebuilds anyway; a checkpoint "
        "inside a checkpoint recomputes twice). Wrap each layer once, at one level "
        "(checkpoint_exclude_wrapper is the exception: it is meant to sit inside).")


class ActivationWrapper(nn.Module):
    """Base class of hyper_parallel's module wrappers (``checkpoint_wrapper``,
    ``swap_wrapper``, ``checkpoint_exclude_wrapper``): ``isinstance(m, ActivationWrapper)``
    finds them in a model; subclasses implement :meth:`forward`.

    The wrapped module is the child ``_checkpoint_wrapped_module`` (torch's name), and the
    wrapper is transparent: ``state_dict()`` keys, ``named_parameters()``,
    ``named_buffers()`` and ``named_modules()`` (of the wrapper and of every parent)
    carry no ``_checkpoint_wrapped_module`` part, so optimizer parameter groups and
    LoRA target names built from them are those of the unwrapped model.
    ``named_modules()`` lists the wrapper and the module it wraps under the same name
    (wrapper first).

    Attributes:
        policy_fn: the policy given to the wrapper (``None`` when none).
        group_swap (bool): whether small swapped tensors are fused into few copies.
        checkpoint_kwargs (dict): the options every call passes on (for
            ``checkpoint_wrapper`` those of :func:`checkpoint`).
    """

    _hp_is_wrapper = True
    _hp_kind = "wrapper"
    _hp_nests = False  # a wrapper meant to sit inside another (no nesting warning)

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if getattr(module, "_hp_is_wrapper", False):
            raise ValueError(
                f"hyper_parallel: {type(module).__name__} is already wrapped by a "
                "hyper_parallel wrapper; wrap each module once (choose checkpoint_wrapper "
                "or swap_wrapper, and pass all options to that one call).")
        self._checkpoint_wrapped_module = module
        self._register_state_dict_hook(_strip_prefix_hook)
        self._register_load_state_dict_pre_hook(_add_prefix_hook, with_module=False)
        if not self._hp_nests:
            for sub in module.modules():
                if isinstance(sub, ActivationWrapper) and not sub._hp_nests:
                    _warn_nested(self, sub)  # wrapping a module that holds wrappers
            for outer in list(_live_wrappers):
                root = outer.__dict__["_modules"].get(_PREFIX)
                # Strictly inside: a second wrapper of the same module is not nesting.
                if root is not None and root is not module and any(
                        m is module for m in root.modules()):
                    _warn_nested(outer, self)  # wrapping a module inside a wrapper
            _live_wrappers.add(self)

    @property
    def policy_fn(self):
        return self.checkpoint_kwargs.get("policy_fn")

    @property
    def group_swap(self) -> bool:
        return bool(self.checkpoint_kwargs.get("group_swap", False))

    @property
    def checkpoint_kwargs(self) -> dict:
        return {}

    def _hp_call(self, run, *args, **kwargs):
        """``run(*args, **kwargs)`` with this wrapper on the thread's stack of running
        wrappers (a wrapper that runs inside another one's forward is warned about)."""
        stack = _tls.__dict__.setdefault("running", [])
        if stack and not self._hp_nests and stack[-1] is not self:
            _warn_nested(stack[-1], self)
        if self._hp_nests:
            return run(*args, **kwargs)
        stack.append(self)
        try:
            return run(*args, **kwargs)
        finally:
            stack.pop()

    @property
    def _hp_wrapped(self) -> nn.Module:
        return self._checkpoint_wrapped_module

    def _hp_release(self) -> None:
        """Lets the wrapped module be wrapped again (this wrapper is being discarded)."""
        _live_wrappers.discard(self)
        module = self._checkpoint_wrapped_module
        ref = _swap_wrapper_of.get(module)
        if ref is not None and ref() is self:
            del _swap_wrapper_of[module]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[_PREFIX], name)

    def _hp_forwards(self, name: str):
        """The wrapped module when ``name`` is its attribute (submodule, parameter, buffer
        or plain attribute) and not the wrapper's own: setting or deleting it through the
        wrapper then acts on the wrapped module, which is what its forward uses."""
        if name.startswith("_"):
            return None  # the wrapper's own private state (and nn.Module internals)
        d = self.__dict__
        inner = d.get("_modules", {}).get(_PREFIX)
        if (inner is None or name in d or name in d["_modules"]
                or name in d.get("_parameters", ()) or name in d.get("_buffers", ())
                or hasattr(type(self), name)):
            return None
        return inner if hasattr(inner, name) else None

    def __setattr__(self, name, value):
        # `wrapper.fc = nn.Linear(...)` (LoRA / TP injection), `wrapper.weight = Parameter`,
        # `wrapper.flag = v` behave as on the unwrapped module: its forward sees them and
        # state_dict keys stay unique. New names are set on the wrapper.
        inner = self._hp_forwards(name)
        if inner is None:
            super().__setattr__(name, value)
        elif (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
              and name in inner._parameters and _from_stateless_swap()):
            # A plain tensor into the wrapped module's parameter slot by torch's stateless
            # swap (torch.func.functional_call): what it does to the module that owns the
            # slot; it reaches the wrapper because the wrapper hides its child's name
            # (tester, session 18: nn.Module.__setattr__ refused it, TypeError). Assigned
            # by hand it is refused, as on the unwrapped module.
            inner._parameters[name] = value
        else:
            setattr(inner, name, value)

    def __delattr__(self, name):
        inner = self._hp_forwards(name)
        if inner is not None:
            delattr(inner, name)
        else:
            super().__delattr__(name)

    def __getitem__(self, idx):
        return self._checkpoint_wrapped_module[idx]

    def __len__(self):
        return len(self._checkpoint_wrapped_module)

    def __iter__(self):
        return iter(self._checkpoint_wrapped_module)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield _strip(name), p

    def named_buffers(self, *args, **kwargs):
        for name, b in super().named_buffers(*args, **kwargs):
            yield _strip(name), b

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        # Parents reach their children through this method, so every parent's
        # named_modules()/named_parameters() gets the stripped names too.
        for name, m in super().named_modules(memo, prefix, remove_duplicate):
            yield _strip_module_name(name), m

    def extra_repr(self) -> str:
        return ""


# The module of torch's stateless parameter swap (torch.func.functional_call,
# torch.nn.utils.stateless), whose swap_tensor() sets a name on the module that owns it.
_STATELESS_SWAP = "torch.nn.utils._named_member_accessor"


def _from_stateless_swap() -> bool:
    """Whether the caller of the wrapper's ``__setattr__`` is torch's stateless swap."""
    frame = sys._getframe(2)  # (0: this function, 1: __setattr__, 2: its caller)
    return frame.f_globals.get("__name__") == _STATELESS_SWAP


def _strip_module_name(name: str) -> str:
    name = _strip(name)
    if name == _PREFIX:
        return ""
    if name.endswith("." + _PREFIX):
        return name[: -len(_PREFIX) - 1]
    return name


def _strip_prefix_hook(module, state_dict, prefix, local_metadata):
    for key in list(state_dict.keys()):
        if _PREFIX_DOT in key:
            state_dict[_strip(key)] = state_dict.pop(key)
    return state_dict


def _add_prefix_hook(state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs):
    for key in list(state_dict.keys()):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX_DOT):
            state_dict[prefix + _PREFIX_DOT + key[len(prefix):]] = state_dict.pop(key)


class SwapWrapper(ActivationWrapper):
    """Every call of the wrapped module is a :func:`swap` call (see :func:`swap_wrapper`)."""

    _hp_kind = "swap_wrapper"

    def __init__(self, module: nn.Module, policy_fn=None, group_swap: bool = False,
                 cpu_pool=None) -> None:
        check_flag("swap_wrapper", "group_swap", group_swap)
        check_swap_policy(policy_fn)
        native_pool(cpu_pool)
        existing = _swap_wrapper_of.get(module) if isinstance(module, nn.Module) else None
        existing = existing() if existing is not None else None
        if existing is not None:
            raise ValueError(
                f"hyper_parallel: this {type(module).__name__} already has a swap_wrapper; wrap "
                "each module once and use that wrapper (a second one would swap the same layer "
                "again, outside the first one's chain and with its own options). Drop the "
                "first wrapper, or undo apply_activation_memory with "
                "remove_activation_memory(model), before wrapping it again.")
        super().__init__(module)
        _swap_wrapper_of[module] = weakref.ref(self)
        self._hp_policy_fn = policy_fn
        self._hp_group_swap = group_swap
        self._hp_cpu_pool = cpu_pool
        SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP before the first call

    @property
    def checkpoint_kwargs(self) -> dict:
        return {"policy_fn": self._hp_policy_fn, "group_swap": self._hp_group_swap,
                "cpu_pool": self._hp_cpu_pool}

    def __call__(self, *args, **kwargs):
        # nn.Module.__call__'s own fast case (no module hook, not compiled, not traced, and
        # forward not replaced on the instance, overridden by a subclass or patched on the
        # class) without its two Python frames (issue 17);
        # every other case is nn.Module.__call__'s, which calls forward below.
        d = self.__dict__
        if (self._compiled_call_impl is None and "forward" not in d
                and type(self).forward is _swap_wrapper_forward  # not overridden or patched
                and not (d["_forward_pre_hooks"] or d["_forward_hooks"]
                         or d["_backward_pre_hooks"] or d["_backward_hooks"]
                         or _nn_module._global_forward_pre_hooks
                         or _nn_module._global_forward_hooks
                         or _nn_module._global_backward_pre_hooks
                         or _nn_module._global_backward_hooks)
                and not torch._C._get_tracing_state() and not torch.compiler.is_compiling()):
            inner = d["_modules"][_PREFIX]
            pool = d["_hp_cpu_pool"]
            return _swap_forward(self, inner, args, kwargs, d["_hp_policy_fn"],
                                 d["_hp_group_swap"], None if pool is None else pool._pool,
                                 inner, not self._hp_nests)
        return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs):
        inner = self.__dict__["_modules"][_PREFIX]  # (no nn.Module.__getattr__ per call)
        if _compile.is_compiling():
            # Traced by dynamo: the region opens and closes eagerly around the compiled
            # body (two graph breaks, docs/design.md "torch.compile").
            return _compile.swap_traced(self, inner, args, kwargs, self._hp_policy_fn,
                                        self._hp_group_swap, self._hp_cpu_pool)
        # The per-layer hot path in one C++ call (issue 17): _swap_forward_python below is
        # what it does, and what it falls back to.
        pool = self._hp_cpu_pool
        return _C.swap_forward(self, inner, args, kwargs, self._hp_policy_fn,
                               self._hp_group_swap, None if pool is None else pool._pool, inner,
                               not self._hp_nests)


def _swap_forward_python(owner, fn, args, kwargs, policy_fn, group_swap, pool, state_module,
                         nest_check):
    """One call of a swap wrapper in Python: what ``_C.swap_forward`` does in C++, and what
    it hands over to when another framework's backend is imported or a checkpoint region
    runs on this thread. ``state_module`` is None for a wrapped function (``owner`` is then
    the wrapping function), the wrapped module for a module wrapper (``owner``);
    ``nest_check`` keeps the thread's stack of running wrappers (``_hp_call``)."""
    if state_module is None:
        return swap_call(LayerCall(owner, fn), args, kwargs, policy_fn, group_swap, pool)
    if runs_plainly():
        return fn(*args, **kwargs)
    if not nest_check:
        return swap_module_call(owner, fn, args, kwargs, policy_fn, group_swap, pool)
    stack = _tls.__dict__.setdefault("running", [])
    if stack and stack[-1] is not owner:
        _warn_nested(stack[-1], owner)
    stack.append(owner)
    try:
        return swap_module_call(owner, fn, args, kwargs, policy_fn, group_swap, pool)
    finally:
        stack.pop()


def swap_wrapper(module_or_fn, policy_fn=None, group_swap=False, cpu_pool=None):
    """Wraps a module or callable so that every call runs under :func:`swap`.

    Args:
        module_or_fn: ``nn.Module`` (returns a transparent wrapper module) or a callable
            (returns a function with the same signature). A ``mindspore.nn.Cell`` gets a
            MindSpore wrapper Cell (PyNative mode; docs/design.md, "Backends").
        policy_fn: per-tensor policy, as in :func:`swap`.
        group_swap: fuse small tensors into few copies, as in :func:`swap`.
        cpu_pool: a :class:`PinnedMemoryPool` for the swapped tensors, as in :func:`swap`.

    Returns:
        The wrapper.

    Raises:
        ValueError: when ``module_or_fn`` is already wrapped by hyper_parallel, or is a
            module that already has a live ``swap_wrapper``.
        TypeError: when it is neither a module nor callable, or when ``policy_fn`` cannot
            be called as ``policy_fn(tensor)``.
    """
    options = dict(policy_fn=policy_fn, group_swap=group_swap)
    if cpu_pool is not None:
        options["cpu_pool"] = cpu_pool
    other = wrapper_dispatch(module_or_fn, "swap_wrapper", options, swap_wrapper)
    if other is not None:  # a MindSpore Cell, or a function (docs/design.md, "Backends")
        return other
    if isinstance(module_or_fn, nn.Module):
        return SwapWrapper(module_or_fn, policy_fn=policy_fn, group_swap=group_swap,
                           cpu_pool=cpu_pool)
    if not callable(module_or_fn):
        raise TypeError(f"hyper_parallel: swap_wrapper expects an nn.Module or a callable, "
                        f"got {type(module_or_fn).__name__}")
    _refuse_double_wrap(module_or_fn)
    check_flag("swap_wrapper", "group_swap", group_swap)
    check_swap_policy(policy_fn)

    pool = native_pool(cpu_pool)
    SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP before the first call

    @functools.wraps(module_or_fn)
    def wrapped(*args, **kwargs):  # (one C++ call: _swap_forward_python says what it does)
        if _compile.is_compiling():  # as SwapWrapper.forward (a builtin dynamo cannot trace)
            return _compile.swap_traced(wrapped, module_or_fn, args, kwargs, policy_fn,
                                        group_swap, cpu_pool, state_module=None)
        return _swap_forward(wrapped, module_or_fn, args, kwargs, policy_fn, group_swap, pool,
                             None, False)

    wrapped._hp_wrapped_fn = module_or_fn
    wrapped.checkpoint_kwargs = {"policy_fn": policy_fn, "group_swap": group_swap,
                                 "cpu_pool": cpu_pool}
    wrapped.policy_fn = policy_fn
    wrapped.group_swap = group_swap
    return wrapped


def _refuse_double_wrap(fn) -> None:
    if getattr(fn, "_hp_wrapped_fn", None) is not None:
        raise ValueError("hyper_parallel: this function is already wrapped by "
                         "checkpoint_wrapper or swap_wrapper; wrap the original function once.")


# What _C.swap_forward reads (the same state the Python path reads) and falls back to.
_C.configure_swap_forward(_swap_forward_python, after_run_region, _warn_nested,
                          tuple(_BACKENDS), _recompute_state._tls, _tls, vars(_memory),
                          _LAYER_ATTR)
_swap_forward = _C.swap_forward
_swap_wrapper_forward = SwapWrapper.forward
# `wrapper(x)` makes SwapWrapper.__call__'s fast-case decision in C++ (the type's call slot,
# issue 17); the Python __call__ above stays for every other case and for dynamo.
_C.install_swap_wrapper_call(SwapWrapper)
