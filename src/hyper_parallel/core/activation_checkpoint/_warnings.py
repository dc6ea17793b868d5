"""Warnings attributed to the user's line.

A fixed ``stacklevel`` cannot name the user's frame here: the same warning is reached
through the swap wrappers' C++ call (``_C.swap_forward``, no Python frames of ours
between), their Python fallback, ``nn.Module.__call__``, torch's dispatch modes or
autograd's engine in backward, each with a different depth. :func:`warn` walks up from its
caller past every frame of this package, of torch and of the stdlib modules that run our
context managers and decorators, and attributes the warning to the first other frame (the
user's ``model(x)``, ``loss.backward()`` or the op inside their layer). Warning filters and
``-W error`` see it there, as for any warning.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_FILES = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools))


def _framework_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("torch", "mindspore"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: not a user frame we can name
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    return path.startswith(prefixes) or path in _STDLIB_FILES


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame above the caller that is
    not this package's, torch's or MindSpore's (the outermost frame when all are)."""
    prefixes = (_PACKAGE_DIR,) + _framework_dirs()
    frame = sys._getframe(1)
    level = 2  # stacklevel 2: warn's caller
    while frame.f_back is not None and _internal(frame.f_code.co_filename, prefixes):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
