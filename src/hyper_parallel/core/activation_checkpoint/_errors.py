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
