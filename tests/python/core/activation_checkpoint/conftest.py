"""Fixtures shared by the activation_checkpoint tests."""

import pytest

from hyper_parallel.core.activation_checkpoint import _selective


@pytest.fixture
def caches(monkeypatch):
    made = []
    original = _selective._new_cache

    def spy(table):
        made.append(original(table))
        return made[-1]

    monkeypatch.setattr(_selective, "_new_cache", spy)
    return made
