"""The framework seam: one public API, one backend per framework (docs/design.md, "Backends").

The public functions (``checkpoint``, ``checkpoint_wrapper``, ``swap``, ``swap_wrapper``,
``swap_tensor_wrapper``, ``SwapManager().set_forward_prefetch_layer``) are the torch
backend. Before doing anything torch-specific each asks :func:`backend_for` whether the
objects it was given (the module or function, the call's arguments) belong to another
framework; if so it hands the whole call to that framework's backend.

A backend is a module that defines the functions of :class:`Backend` (its own
``checkpoint``, ``swap``, ...). It is found by the top-level package name of the objects'
types (``mindspore.nn.Cell`` -> ``"mindspore"``), and imported only when such an object
shows up, so the package never imports a framework the user did not import first: in a
torch-only process the check is one dictionary lookup in ``sys.modules`` per call.

Adding a third framework is one entry in :data:`_BACKENDS` and one backend package; the
framework-neutral parts of the C++ core (the layer schedule, op-policy tables) are shared
through ``hyper_parallel._C``.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from typing import Protocol

#: Framework (top-level package of its tensor and module types) -> backend module.
_BACKENDS = {
    "mindspore": "hyper_parallel.core.activation_checkpoint._mindspore",
}


class Backend(Protocol):
    """What a framework backend module provides (the same call shapes as the public API)."""

    def owns(self, obj) -> bool: ...
    def checkpoint(self, function, *args, **kwargs): ...
    def checkpoint_wrapper(self, module_or_fn, **checkpoint_kwargs): ...
    def swap(self, function, *args, **kwargs): ...
    def swap_wrapper(self, module_or_fn, policy_fn=None, group_swap=False): ...
    def swap_tensor_wrapper(self, target, tag=None, group_swap=False): ...
    def install_layer_hooks(self, obj, node) -> None: ...


def _framework_of(obj) -> str | None:
    root = type(obj).__module__.partition(".")[0]
    return root if root in _BACKENDS else None


def _load(framework: str):
    return importlib.import_module(_BACKENDS[framework])


def backend_named(framework: str):
    """The backend of ``framework`` (``"mindspore"``), imported on demand.

    Raises:
        ValueError: for a framework without a backend.
    """
    if framework not in _BACKENDS:
        raise ValueError(f"hyper_parallel: no backend for framework {framework!r}; known: "
                         f"{['torch', *_BACKENDS]}.")
    return _load(framework)


def loaded_backends() -> list:
    """The backend modules already imported (those a call has used)."""
    return [sys.modules[m] for m in _BACKENDS.values() if m in sys.modules]


def loaded_frameworks() -> bool:
    """True when some framework with a backend is imported in this process."""
    for name in _BACKENDS:  # (a plain loop: this runs on every region call)
        if name in sys.modules:
            return True
    return False


def backend_for(*objs, args=(), kwargs=None):
    """The backend of the first of ``objs`` or of the call arguments (searched one level
    into tuples, lists and dicts) that belongs to a non-torch framework; ``None`` for
    torch (the default backend).

    Objects are classified by their type's top-level package, so a user subclass of
    ``mindspore.nn.Cell`` defined in ``mymodel.py`` is found through its base classes.
    """
    if not loaded_frameworks():
        return None
    for obj in objs:
        fw = _framework_of_any(obj)
        if fw is not None:
            return _load(fw)
    for value in (*args, *(kwargs or {}).values()):
        items = value.values() if isinstance(value, dict) else (
            value if isinstance(value, (tuple, list)) else (value,))
        for item in items:
            fw = _framework_of(item)
            if fw is not None and sys.modules.get(fw) is not None:
                return _load(fw)
    return None


def _framework_of_any(obj) -> str | None:
    """Framework of ``obj`` (a module/cell or tensor), looking through its base classes."""
    if obj is None or callable(obj) and type(obj).__module__ in ("builtins", "functools"):
        return None
    for cls in type(obj).__mro__:
        root = cls.__module__.partition(".")[0]
        if root in _BACKENDS and root in sys.modules:
            return root
    return None


class _TorchOnly(threading.local):
    active = False


_torch_only = _TorchOnly()


def wrapper_dispatch(obj, name: str, kwargs: dict, public):
    """For ``checkpoint_wrapper`` / ``swap_wrapper`` (``name``): the wrapper of another
    framework's module, a function wrapper that picks the backend per call, or ``None``
    (the caller builds the torch wrapper).

    A plain function cannot be classified when it is wrapped, only when it is called: once
    a framework with a backend is imported, the wrapper of a plain function builds, at its
    first call with that framework's tensors, that backend's wrapper (and at its first call
    with torch tensors, ``public``'s torch wrapper), so options are validated then. In a
    torch-only process nothing changes: options are validated when wrapping.
    """
    if _torch_only.active:
        return None
    backend = backend_for(obj)
    if backend is not None:
        return getattr(backend, name)(obj, **kwargs)
    if not callable(obj) or isinstance(obj, type) or not loaded_frameworks() or any(
            cls.__module__.partition(".")[0] == "torch" for cls in type(obj).__mro__):
        return None
    return _DispatchingFunction(obj, name, kwargs, public)


class _DispatchingFunction:
    """A wrapped plain function that dispatches on its call arguments (see
    :func:`wrapper_dispatch`); called exactly like the function it wraps."""

    def __init__(self, fn, name: str, kwargs: dict, public) -> None:
        functools.update_wrapper(self, fn)
        self._hp_wrapped_fn = fn
        self._hp_build = (name, kwargs, public)
        self._hp_by_backend: dict = {}

    def __call__(self, *args, **kwargs):
        backend = backend_for(args=args, kwargs=kwargs)
        wrapped = self._hp_by_backend.get(backend)
        if wrapped is None:
            name, options, public = self._hp_build
            if backend is not None:
                wrapped = getattr(backend, name)(self._hp_wrapped_fn, **options)
            else:
                _torch_only.active = True
                try:
                    wrapped = public(self._hp_wrapped_fn, **options)
                finally:
                    _torch_only.active = False
            self._hp_by_backend[backend] = wrapped
        node = self.__dict__.get(_LAYER_ATTR)
        if node is not None:
            wrapped._hyper_parallel_layer = node  # the chain registered on this wrapper
        return wrapped(*args, **kwargs)


_LAYER_ATTR = "_hyper_parallel_layer"
