"""The error class for arguments of the wrong kind (docs/design.md, "Errors").

Python's convention for an argument of the wrong type is ``TypeError``; the reference
system (HyperParallel) raises ``ValueError`` for the same mistakes (``early_stop=1``, a
handle that is not a handle, an unhashable session id). :class:`ArgumentKindError` is
both, so ``except TypeError`` and ``except ValueError`` written against either system
catch it.
"""

from __future__ import annotations


class ArgumentKindError(TypeError, ValueError):
    """An argument of the wrong type or kind (a ``TypeError`` and a ``ValueError``)."""


def check_flag(api: str, name: str, value) -> bool:
    """Returns ``value`` when it is a bool; else raises :class:`ArgumentKindError` naming
    ``api`` and the option (``1``, ``None`` and ``"yes"`` are not bools)."""
    if value is True or value is False:
        return value
    raise ArgumentKindError(f"hyper_parallel: {api}'s {name} must be a bool (True or False); "
                            f"got {value!r} ({type(value).__name__}).")


def check_module(api: str, model) -> None:
    """Raises :class:`ArgumentKindError` naming ``api`` unless ``model`` is an
    ``nn.Module``."""
    from torch import nn  # (this module stays importable without torch: MindSpore's venv)

    if not isinstance(model, nn.Module):
        raise ArgumentKindError(f"hyper_parallel: {api} expects an nn.Module (the model); got "
                                f"{type(model).__name__}.")


def check_callable(api: str, function) -> None:
    """Raises :class:`ArgumentKindError` naming ``api`` unless ``function`` is callable (an
    ``nn.Module``, a function, any object with ``__call__``)."""
    if not callable(function):
        raise ArgumentKindError(f"hyper_parallel: {api} runs function(*args, **kwargs), so its "
                                "first argument must be an nn.Module or a callable; got "
                                f"{type(function).__name__}.")
