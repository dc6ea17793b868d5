"""hyper_parallel: an activation-memory engine for PyTorch training.

Recompute (checkpoint, selective per-op policies), swap (offload saved activations to
host memory with overlapped prefetch), or both, layer by layer. The public API lives in
:mod:`hyper_parallel.core.activation_checkpoint`.

The distributed entry points of PyTorch that the user guide composes with are
re-exported here (``fully_shard``, ``init_device_mesh``, ``parallelize_module``,
``ColwiseParallel``, ``RowwiseParallel``), with ``activation_trace`` (the swap timeline);
they are imported lazily.
"""

__version__ = "0.1.0"

_TORCH_REEXPORTS = {
    "fully_shard": "torch.distributed.fsdp",
    "init_device_mesh": "torch.distributed.device_mesh",
    "parallelize_module": "torch.distributed.tensor.parallel",
    "ColwiseParallel": "torch.distributed.tensor.parallel",
    "RowwiseParallel": "torch.distributed.tensor.parallel",
}

__all__ = ["__version__", "activation_trace", *_TORCH_REEXPORTS]


def __getattr__(name):
    if name == "activation_trace":  # the swap timeline (core.activation_checkpoint._trace)
        from .core.activation_checkpoint import activation_trace

        globals()[name] = activation_trace
        return activation_trace
    module = _TORCH_REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
