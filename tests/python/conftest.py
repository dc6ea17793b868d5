"""Shared fixtures: every test starts from a clean swap engine."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _clean_swap_engine():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    manager = SwapManager()
    manager.reset()
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    manager.set_prefetch_depth(1)
    torch.manual_seed(0)
    yield
    gc.collect()
    manager.synchronize()
    manager.reset()
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)


@pytest.fixture
def cpu_swap():
    """The CPU swap backend on, with a small per-byte delay that widens race windows."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    SwapManager().set_cpu_swap(True, delay_ns_per_byte=0.05)
    return SwapManager()
