"""Shared fixtures: every test starts from a clean swap engine."""

import gc
import os

import pytest
import torch


_DEFAULT_OFFLOAD_WINDOW = 2  # SwapEngineOptions::offload_window


@pytest.fixture(autouse=True)
def _clean_swap_engine():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    from hyper_parallel._extension import _C

    manager = SwapManager()
    manager.reset()
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    manager.set_prefetch_depth(1)
    # Every release submits its offload at once, so copy counts do not depend on how fast
    # the copy workers run on a loaded machine; test_offload_window.py sets the window.
    _C.set_offload_window(0)
    torch.manual_seed(0)
    yield
    gc.collect()
    manager.synchronize()
    manager.reset()
    manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    _C.set_offload_window(_DEFAULT_OFFLOAD_WINDOW)


_DEVICE = os.environ.get("HP_TEST_DEVICE", "cpu")
if _DEVICE.split(":")[0] == "hpsim":
    # The simulated accelerator (tests/sim) must be registered before the first backward:
    # the autograd engine sizes its per-device worker threads once, at its first run.
    from tests.sim import hpsim

    hpsim.load()


@pytest.fixture(autouse=True)
def _fresh_once_warnings(monkeypatch):
    """Warnings the library gives once per process per cause are given again in each test."""
    import sys

    import hyper_parallel.core.activation_checkpoint  # noqa: F401 (loads its modules)

    # Every module-level "_warned..." set (and flag) of the package: a test's expected
    # warning must not depend on which tests ran before it in the process.
    prefix = "hyper_parallel.core.activation_checkpoint."
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("_warned"):
                if isinstance(value, set):
                    monkeypatch.setattr(module, attr, set())
                elif isinstance(value, bool):
                    monkeypatch.setattr(module, attr, False)


def test_device() -> torch.device:
    """The device the swap tests run on: HP_TEST_DEVICE (default "cpu"; "hpsim" is the
    simulated accelerator of tests/sim)."""
    return torch.device(_DEVICE)


@pytest.fixture
def dev():
    """Device for swap tests. On "cpu" the CPU swap backend is turned on with a small
    per-byte delay that widens race windows; on an accelerator ("cuda") the real stream
    backend runs. Set HP_TEST_DEVICE=cuda on a GPU machine to run the same suite there."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    device = test_device()
    if device.type == "cpu":
        SwapManager().set_cpu_swap(True, delay_ns_per_byte=0.05)
    elif not getattr(torch, device.type).is_available():
        pytest.skip(f"HP_TEST_DEVICE={device} but no such device is available")
    return device


@pytest.fixture
def cpu_swap(dev):
    """SwapManager with swapping enabled on the test device (see ``dev``)."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    return SwapManager()


@pytest.fixture
def host_swap():
    """The CPU swap backend on, for tests whose tensors live on the host whatever
    HP_TEST_DEVICE says (they do not take part in the device pass)."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    SwapManager().set_cpu_swap(True, delay_ns_per_byte=0.05)
    return SwapManager()


def pytest_collection_modifyitems(config, items):
    # Marker `device` (pyproject.toml): tests that run on HP_TEST_DEVICE.
    for item in items:
        if "dev" in getattr(item, "fixturenames", ()) or item.module.__name__.endswith(
                "test_accelerator_path"):
            item.add_marker(pytest.mark.device)
