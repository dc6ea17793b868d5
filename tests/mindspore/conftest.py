"""MindSpore suite: runs in its own virtual environment (scripts/setup_mindspore.sh), never
in the torch suite's. Every test starts in PyNative mode from a clean swap engine."""

import gc

import pytest

import torch  # noqa: F401  (loads libtorch first: hyper_parallel._C links against it)
import mindspore as ms


@pytest.fixture(autouse=True)
def _clean_engine():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    ms.set_context(mode=ms.PYNATIVE_MODE)
    SwapManager().reset()
    yield
    gc.collect()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    SwapManager().reset()
