"""Loads the compiled core, ``hyper_parallel._C``, once.

There is no pure-Python fallback: the engine is C++. If the import fails, the error says
how to build it.
"""

from __future__ import annotations

import importlib

_BUILD_HINT = (
    "hyper_parallel: the C++ extension hyper_parallel._C could not be imported ({err}). "
    "Build it against the installed torch with `bash scripts/setup.sh` (from the repository "
    "root) or `pip install --no-build-isolation -e .`; rebuild after upgrading torch."
)


def load_extension():
    import torch  # noqa: F401  (loads libtorch before our extension links against it)

    try:
        return importlib.import_module("hyper_parallel._C")
    except ImportError as err:
        raise ImportError(_BUILD_HINT.format(err=err)) from err


_C = load_extension()
