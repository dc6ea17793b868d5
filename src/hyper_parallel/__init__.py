"""hyper_parallel: an activation-memory engine for PyTorch training.

Recompute (checkpoint, selective per-op policies), swap (offload saved activations to
host memory with overlapped prefetch), or both, layer by layer. The public API lives in
:mod:`hyper_parallel.core.activation_checkpoint`.

Its whole-model entry points (``find_layers``, ``apply_activation_memory``,
``remove_activation_memory``, ``plan_activation_memory``, ``ActivationPlan``),
``activation_trace`` (the swap timeline) and the distributed entry points of PyTorch that
the user guide composes with (``fully_shard``, ``init_device_mesh``, ``parallelize_module``,
``ColwiseParallel``, ``RowwiseParallel``) are re-exported here; all are imported lazily.
"""

__version__ = "0.1.0"

_TORCH_REEXPORTS = {
    "fully_shard": "torch.distributed.fsdp",
    "init_device_mesh": "torch.distributed.device_mesh",
    "parallelize_module": "torch.distributed.tensor.parallel",
    "ColwiseParallel": "torch.distributed.tensor.parallel",
    "RowwiseParallel": "torch.distributed.tensor.parallel",
}

_OWN_REEXPORTS = {
    name: "hyper_parallel.core.activation_checkpoint"
    for name in ("find_layers", "apply_activation_memory", "remove_activation_memory",
                 "activation_trace", "plan_activation_memory", "ActivationPlan")
}

__all__ = ["__version__", *_OWN_REEXPORTS, *_TORCH_REEXPORTS]


def __getattr__(name):
    module = _OWN_REEXPORTS.get(name) or _TORCH_REEXPORTS.get(name)
    if module is None:
        hint = ""
        if not name.startswith("_"):
            import importlib

            api = importlib.import_module("hyper_parallel.core.activation_checkpoint")
            if name in getattr(api, "__all__", ()):
                hint = (f"; import it from hyper_parallel.core.activation_checkpoint (from "
                        f"hyper_parallel.core.activation_checkpoint import {name})")
        raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}{hint}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
