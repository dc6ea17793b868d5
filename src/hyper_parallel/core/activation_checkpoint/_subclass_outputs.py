"""Cached outputs that are tensor subclasses (DTensor), on the Python-mode path.

A region with a callable policy intercepts ops with a ``TorchDispatchMode``, which sees a
tensor subclass's op (DTensor's ``aten.mm`` on DTensors) before the subclass unwraps it.
The C++ cache keeps plain tensors only (their storage, version counter and swap handle),
so it records such a call as "run again"; without more, selective checkpoint under tensor
parallel with a callable policy recomputed every op, caching nothing. This table keeps
those outputs instead, as torch's SAC does: a detached alias of each output (no autograd
history; it shares the inner tensors' storages and version counters), matched by (op key,
call index) as the C++ cache matches its own (every ``SacCache.record`` and ``replay`` of
the op counts one call, here too), with the same checks:

* an output written in place later in the same forward is dropped (it is recomputed,
  together with the write): the mode's written arguments are looked up by the storages
  under them (the output itself may be dead by the end of the forward), and the outputs
  still alive then are checked by version;
* one written after the forward (seen by its version while it is alive: a subclass's
  in-place op bumps the wrapper's counter, not its inner tensors') raises at replay,
  unless ``allow_cache_entry_mutation`` (the written value is then handed back, torch's
  meaning);
* the recompute's call must have its forward call's input dtypes and shapes;
* an entry is released after its replay unless the backward keeps its graph.

``MUST_SWAP`` outputs kept here stay on the device (the swap engine moves plain storages).
The declarative (C++) path sees the subclass's inner ops on plain tensors and needs none
of this. Not thread-safe: one region invocation's forward, then its recompute(s).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel._extension import _C

from ._memory import active_meter


def is_subclass(t) -> bool:
    """A tensor whose type is a subclass with its own dispatch (DTensor, not Parameter)."""
    return isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter)


def _storages(t) -> set:
    """Data pointers of the storages under ``t`` (a traceable wrapper subclass's inner
    tensors, through nested subclasses; a plain tensor's own)."""
    if is_subclass(t) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        out: set = set()
        for name in names:
            inner = getattr(t, name, None)
            if isinstance(inner, torch.Tensor):
                out |= _storages(inner)
        return out
    try:
        return {t.untyped_storage().data_ptr()}
    except (RuntimeError, NotImplementedError):  # no storage (a subclass without flatten)
        return set()


class SubclassOutputs:
    """The subclass outputs one region invocation cached (module docstring)."""

    __slots__ = ("allow_mutation", "entries", "forward_calls", "replay_calls", "by_storage",
                 "kept_any")

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        # (op key, call index) -> (tree spec, detached leaves, weak references to the tensor
        # leaves, their versions, input signature)
        self.entries: dict = {}
        self.forward_calls: dict = {}
        self.replay_calls: dict = {}
        self.by_storage: dict = {}  # storage data pointer -> keys of the entries under it
        # Whether the forward kept anything: then every recompute call of a plain op must
        # be counted (replay), those the C++ cache hands back included, so the indices of
        # the calls kept here line up.
        self.kept_any = False

    def count_forward(self, key: int) -> int:
        """The call index of this forward call of op ``key`` (call once per record)."""
        index = self.forward_calls.get(key, 0)
        self.forward_calls[key] = index + 1
        return index

    def keep(self, key: int, index: int, out, args, kwargs) -> bool:
        """Keeps ``out`` as call ``index`` of op ``key``; False when it holds anything but
        tensors (plain or subclass), None, bools, ints and floats."""
        leaves, spec = tree_flatten(out)
        if not any(is_subclass(v) for v in leaves) or not all(
                v is None or isinstance(v, (torch.Tensor, bool, int, float)) for v in leaves):
            return False
        kept = [v.detach() if isinstance(v, torch.Tensor) else v for v in leaves]
        # Writes are seen through the outputs' own version counters: a subclass's in-place
        # op bumps the wrapper's (autograd's in-place layer runs above the subclass), not
        # its inner tensors', and a detach inside the mode (below autograd) makes aliases
        # with counters of their own. Weak references: the outputs have autograd history,
        # which would close a cycle through the graph; one that died cannot be written.
        refs = [weakref.ref(v) for v in leaves if isinstance(v, torch.Tensor)]
        versions = [v._version for v in leaves if isinstance(v, torch.Tensor)]
        self.entries[(key, index)] = (spec, kept, refs, versions,
                                      _C.input_signature(args, kwargs))
        self.kept_any = True
        for v in kept:
            if isinstance(v, torch.Tensor):
                for ptr in _storages(v):
                    self.by_storage.setdefault(ptr, set()).add((key, index))
        meter = active_meter()
        if meter is not None:
            for v in kept:
                if isinstance(v, torch.Tensor):
                    meter.observe(v)
        return True

    @staticmethod
    def _written(refs, versions) -> bool:
        for ref, seen in zip(refs, versions):
            t = ref()
            if t is not None and t._version != seen:
                return True
        return False

    def before_write(self, target) -> None:
        """An op of the forward is about to write ``target`` (a tensor or a sequence of
        them): entries whose outputs share its storage are dropped (recomputed with the
        write). The output written may not be alive at the end of the forward, when
        end_forward() looks at versions, so writes are caught here too."""
        targets = target if isinstance(target, (tuple, list)) else (target,)
        for t in targets:
            if isinstance(t, torch.Tensor):
                for ptr in _storages(t):
                    for k in self.by_storage.pop(ptr, ()):
                        self.entries.pop(k, None)

    def end_forward(self) -> list:
        """Drops the entries written in place since they were kept (later in the forward:
        recomputed with the write instead); returns their (op key, call index)."""
        dropped = [k for k, (_, _, refs, versions, _) in self.entries.items()
                   if self._written(refs, versions)]
        for k in dropped:
            del self.entries[k]
        self.by_storage.clear()  # (only the forward's writes are looked up by storage)
        return dropped

    def begin_recompute(self) -> None:
        self.replay_calls.clear()

    def replay(self, key: int, args, kwargs):
        """The kept outputs of this recompute call of op ``key`` (fresh detached aliases),
        or None when the op must run (nothing kept for this call)."""
        index = self.replay_calls.get(key, 0)
        self.replay_calls[key] = index + 1
        entry = self.entries.get((key, index))
        if entry is None:
            return None
        spec, kept, refs, versions, signature = entry
        name = _C.op_name(key)
        if _C.input_signature(args, kwargs) != signature:
            raise RuntimeError(
                f"hyper_parallel: the recompute of a selective checkpoint region ran {name} "
                f"(call #{index}) on inputs whose dtypes or shapes differ from those of the "
                f"forward's call #{index}, whose outputs the policy cached: the recompute ran "
                "another sequence of ops than the forward. A checkpointed function must run "
                "the same ops in the same order when it is recomputed: avoid control flow "
                "that depends on data or on state that changes between forward and "
                "backward, or let the policy recompute this op (PREFER_RECOMPUTE).")
        if not self.allow_mutation and self._written(refs, versions):
            raise RuntimeError(
                f"hyper_parallel: the output of {name} (call #{index}) that selective "
                "checkpoint cached was modified in place after it was cached, so backward "
                "would read a stale value. Clone it before the in-place op, or let the "
                "policy recompute this op (PREFER_RECOMPUTE), or pass "
                "allow_cache_entry_mutation=True to use the modified value.")
        if not _C.backward_keeps_graph():
            del self.entries[(key, index)]
        return tree_unflatten([v.detach() if isinstance(v, torch.Tensor) else v
                               for v in kept], spec)

    def __len__(self) -> int:
        return len(self.entries)
