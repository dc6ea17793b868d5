"""hpsim: a simulated PrivateUse1 accelerator for tests (test-only, never installed).

``load()`` loads ``libhpsim.so`` (built with the GoogleTests, ``HP_BUILD_TESTS=ON``, into
``<build>/tests/sim/``), renames PrivateUse1 to ``hpsim`` and registers ``torch.hpsim``, so
``torch.device("hpsim")``, ``tensor.to("hpsim")``, ``pin_memory()``, ``torch.Stream`` /
``torch.Event`` and the swap engine's accelerator path work on it. The device model (streams
as worker threads, events, caching allocator with ``recordDataPtrOnStream``, PROT_NONE device
memory, link delay) is described in tests/sim/Runtime.h and docs/design.md, "Simulated device".

Renaming PrivateUse1 is once per process: load it only in test processes.
"""

from __future__ import annotations

import glob
import os
import pathlib
import types

import torch

NAME = "hpsim"
_ROOT = pathlib.Path(__file__).resolve().parents[2]


def library_path() -> str:
    """Path of libhpsim.so: $HP_SIM_LIBRARY, else <repo>/$HP_BUILD_DIR (default build)/tests/sim."""
    explicit = os.environ.get("HP_SIM_LIBRARY")
    if explicit:
        return explicit
    build = _ROOT / os.environ.get("HP_BUILD_DIR", "build")
    found = glob.glob(str(build / "tests" / "sim" / "libhpsim*.so"))
    if not found:
        raise RuntimeError(
            f"hyper_parallel: the simulated device library libhpsim.so is not in {build}/tests/sim. "
            "Build it with `bash scripts/setup.sh` (HP_BUILD_TESTS=ON), or set HP_SIM_LIBRARY.")
    return found[0]


def _ops():
    return torch.ops.hpsim


def _index(device) -> int:
    if device is None:
        return _ops().current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else _ops().current_device()


class _DeviceContext:
    """``with torch.hpsim.device(d):`` makes ``d`` the current device (torch's storage
    copies and serialization use it)."""

    def __init__(self, device) -> None:
        self.index = _index(device)

    def __enter__(self):
        self.previous = _ops().current_device()
        _ops().set_device(self.index)

    def __exit__(self, *exc) -> None:
        _ops().set_device(self.previous)


def _module() -> types.ModuleType:
    m = types.ModuleType("torch.hpsim")
    m.device = _DeviceContext
    m.is_available = lambda: True
    m.device_count = lambda: _ops().device_count()
    m.current_device = lambda: _ops().current_device()
    m.set_device = lambda device: _ops().set_device(_index(device))
    m.synchronize = lambda device=None: _ops().synchronize(_index(device))
    m._is_in_bad_fork = lambda: False
    m.manual_seed = lambda seed: None  # random ops use the CPU generator (CPU fallback)
    m.manual_seed_all = lambda seed: None
    m.is_initialized = lambda: True
    m.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    m.memory_allocated = lambda device=None: memory_stats(device)["allocated_bytes"]
    m.max_memory_allocated = lambda device=None: memory_stats(device)["peak_allocated_bytes"]
    m.reset_peak_memory_stats = lambda device=None: _ops().reset_peak_memory_stats(_index(device))
    return m


def load() -> torch.device:
    """Loads and registers the simulated device once per process (whichever copy of this
    module asks first); returns hpsim:0."""
    if not is_loaded():
        torch.ops.load_library(library_path())
        torch.utils.rename_privateuse1_backend(NAME)
        torch._register_device_module(NAME, _module())
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    return torch.device(NAME, 0)


def is_loaded() -> bool:
    return torch._C._get_privateuse1_backend_name() == NAME and hasattr(torch, NAME)


def configure(*, link_ns_per_byte: float = 0.0, protect: bool = False, poison: bool = True,
              honor_record_stream: bool = True, honor_default_stream_waits: bool = True) -> None:
    """Sets the simulation switches (process-wide).

    link_ns_per_byte: sleep per byte of each copy between device and pinned host memory.
    protect: map new device blocks PROT_NONE outside stream tasks (host reads crash).
    poison: fill new device allocations with 0xFF (NaN) in stream order.
    honor_record_stream / honor_default_stream_waits: False breaks the protocol on purpose
    (the allocator ignores recordDataPtrOnStream / the default stream ignores event waits),
    for tests that show a race is caught.
    """
    _ops().configure(float(link_ns_per_byte), protect, poison, honor_record_stream,
                     honor_default_stream_waits)


def memory_stats(device=None) -> dict:
    """Device memory counters (bytes, size-class rounded) of the simulated caching allocator."""
    keys = ("allocated_bytes", "peak_allocated_bytes", "reserved_bytes", "allocations",
            "cache_hits", "deferred_reuses")
    return dict(zip(keys, _ops().memory_stats(_index(device))))


def copy_stats() -> dict:
    """Copies issued on the simulated device, and pinned host allocations."""
    keys = ("host_to_device", "device_to_host", "device_to_device", "asynchronous",
            "pinned_bytes", "storage_resizes", "pinned_allocations", "pinned_bytes_in_use")
    return dict(zip(keys, _ops().copy_stats()))


def stream_wait_seconds(device=None, stream_id: int = 0) -> float:
    """Seconds the worker of a stream spent waiting on events (default: the compute stream)."""
    return _ops().stream_wait_seconds(_index(device), stream_id)
