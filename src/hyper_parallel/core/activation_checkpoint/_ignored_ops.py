"""Ops that selective checkpoint passes through untouched (``ignore_sac_ops``).

Inside a checkpoint region every ATen op is seen by the region modes (``_selective.py``):
counted and maybe cached, its tensor inputs and outputs recorded. Some ops must be
invisible to that bookkeeping because they are not part of the region's computation
and may run a different number of times in forward and in recompute:

* FSDP2's ops (namespace ``fsdp``: ``all_gather_copy_in``, ``split_with_sizes_copy``,
  ``chunk_cat``, ``copy_``): a region around a ``fully_shard`` module runs FSDP2's
  unshard inside it; its writes go to FSDP2's own all-gather buffers, which must not be
  treated as state of the region (copied on write, checked in recompute);
* the profiler's range ops (namespace ``profiler``: ``_record_function_enter_new``,
  ``_record_function_exit``), which ``torch.profiler.record_function`` issues and FSDP2
  issues around its hooks.

They run in forward and in recompute as if no checkpoint were there. Whole namespaces
are matched, so ops registered after import (FSDP2 registers its library on first use)
are covered too.
"""

from __future__ import annotations

import threading

from torch._ops import OpOverload, OpOverloadPacket

#: Namespaces whose every op is ignored by default.
DEFAULT_IGNORED_NAMESPACES = frozenset({"fsdp", "profiler"})

_lock = threading.Lock()
_ignored: set = set()  # OpOverloads added with ignore_sac_ops
_ignored_packets: set = set()  # OpOverloadPackets added with ignore_sac_ops


def is_sac_ignored(func) -> bool:
    """Whether ``func`` (an ``OpOverload``) passes through selective checkpoint."""
    if func in _ignored:
        return True
    if isinstance(func, OpOverload):
        return (func.namespace in DEFAULT_IGNORED_NAMESPACES
                or func.overloadpacket in _ignored_packets)
    return False


def ignore_sac_ops(ops) -> None:
    """Adds ``ops`` to the ops that checkpoint regions pass through untouched: they run in
    forward and in recompute, are never cached whatever the policy says, are not counted
    in the op order that recompute replays, and their tensors are not recorded as state
    of the region. For ops that run a different number of times in forward and in
    recompute and carry no activations (communication bookkeeping, profiling markers).

    The default set is every op of the ``fsdp`` namespace (FSDP2) and of the
    ``profiler`` namespace (``record_function``); torch's own ``SAC_IGNORED_OPS``
    (``detach``, metadata queries) are never cached either.

    Args:
        ops: an iterable of ``OpOverload`` (``torch.ops.aten.mm.default``) or
            ``OpOverloadPacket`` (``torch.ops.aten.mm``: every overload). ``None`` entries
            are skipped, so an op that only some torch versions have can be listed as
            ``getattr(torch.ops.fsdp, "chunk_cat", None)``.

    Raises:
        TypeError: for an entry that is neither an op nor ``None`` (nothing is added
            then), or when ``ops`` is not iterable.

    Thread-safety: safe to call from several threads; call it before the step that
    needs it (a region already running keeps the decisions it made).
    """
    try:
        items = list(ops)
    except TypeError:
        raise TypeError("hyper_parallel: ignore_sac_ops expects an iterable of ops (e.g. "
                        f"[torch.ops.aten.mm.default]); got {type(ops).__name__}") from None
    for op in items:
        if op is not None and not isinstance(op, (OpOverload, OpOverloadPacket)):
            raise TypeError(
                f"hyper_parallel: ignore_sac_ops got {op!r} ({type(op).__name__}); give "
                "torch ops such as torch.ops.aten.mm.default or torch.ops.aten.mm (None "
                "entries are skipped).")
    from . import _selective  # the per-op decisions cached there are redone

    with _lock:
        for op in items:
            if isinstance(op, OpOverload):
                _ignored.add(op)
                _selective.forget_op(op)
            elif isinstance(op, OpOverloadPacket):
                _ignored_packets.add(op)
                for name in op.overloads():
                    _selective.forget_op(getattr(op, name))
