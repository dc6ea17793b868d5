"""Fixtures shared by the activation_checkpoint tests."""

import pytest

from hyper_parallel.core.activation_checkpoint import _selective


@pytest.fixture
def caches(monkeypatch):
    made = []
    original = _selective._new_cache

    def spy(*args):
        """Every SacCache created by a selective region, in creation order (one per call)."""
        made.append(original(*args))
        return made[-1]

    monkeypatch.setattr(_selective, "_new_cache", spy)
    return made
