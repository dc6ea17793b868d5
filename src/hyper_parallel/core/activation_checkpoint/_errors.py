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
