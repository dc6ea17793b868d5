"""Selective checkpoint on MindSpore: two ``MsDispatchMode`` s over a per-invocation cache.

The MindSpore counterpart of ``../_selective.py`` (docs/design.md, "Backends"). A
checkpoint region with a ``policy_fn`` runs its forward under :class:`_CachingMode` and
its recompute under :class:`_CachedMode`, handed to ``mindspore.recompute`` through its
``context_fn``. ``MsDispatchMode`` intercepts every op below autograd with
``func.name`` a string (``"MatMul"``, ``"LayerNorm"``); returning a cached output without
running the kernel keeps gradients correct.

Policies use the same C++ objects as torch: a list or dict of op names compiles to an
``_C.OpPolicyTable`` whose entries are ``"mindspore.<OpName>"`` (the table's
``namespace.op`` form), evaluated in C++ and memoised per interned op key, with no Python
call per op to decide; a callable ``policy_fn(ctx, op, *args, **kwargs)`` gets an
:class:`MsPolicyOp` whose ``op.name`` is MindSpore's name (``"MatMul"``), as the user guide's
example reads it.

Values: ``MUST_SAVE`` / ``PREFER_SAVE`` keep the output (the op does not run again in
recompute); ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE`` run it again; ``MUST_SWAP`` keeps it
as a swap record of the region's group, offloaded and prefetched on the region's
schedule. Never cached, whatever the policy: in-place ops (``Inplace*``: skipping them in
recompute would skip the write), random ops (they must run again so the replayed RNG
stream stays aligned) and view ops (free to replay; caching one pins its base).
"""

from __future__ import annotations

import contextlib

import mindspore as ms
from mindspore import Tensor

from hyper_parallel._extension import _C

from .._policy import CheckpointPolicy, to_policy
from .._selective import _Nested, call_context_fn  # framework-neutral helpers
from . import _meter
from ._records import STORE
from ._region import current_group

NAMESPACE = "mindspore"
_DEFAULT_KEY = "*"
_RANDOM_PARTS = ("Dropout", "Rand", "Uniform", "Normal", "Bernoulli", "Multinomial", "Gamma",
                 "Poisson")
_VIEW_OPS = frozenset({"Reshape", "View", "ViewAs", "Transpose", "TransposeView", "ExpandDims",
                       "Squeeze", "Unsqueeze", "Slice", "StridedSlice", "BroadcastTo",
                       "Narrow", "Split", "SplitTensor", "SplitWithSize", "Chunk", "Flatten",
                       "Contiguous", "SelectView", "Diagonal", "Unfold", "AsStrided"})

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def cacheable(name: str) -> bool:
    if name.startswith("Inplace") or name in _VIEW_OPS:
        return False
    return not any(part in name for part in _RANDOM_PARTS)


class MsPolicyOp:
    """The ``op`` a MindSpore checkpoint ``policy_fn`` receives.

    ``op.name`` is the op's MindSpore name (``"MatMul"``), a string attribute as on
    MindSpore's own ``OpFunc``; ``str(op)`` is the same, ``op == "MatMul"`` is true and
    ``hash(op) == hash("MatMul")``, so ``op in {"MatMul", "BiasAdd"}`` works. The guide's
    ``getattr(op, "name", None)`` idiom therefore reads the name directly.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__

    def __eq__(self, other):
        if isinstance(other, MsPolicyOp):
            return other.name == self.name
        if isinstance(other, str):
            return other == self.name or other == f"{NAMESPACE}.{self.name}"
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


class SelectiveCheckpointContext:
    """``ctx`` of a MindSpore ``policy_fn``: ``is_recompute`` and (in forward) ``op_output``."""

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, is_recompute: bool, op_output=None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


class _OpInfo:
    __slots__ = ("op", "key", "cacheable")

    def __init__(self, name: str) -> None:
        self.op = MsPolicyOp(name)
        self.key = int(_C.intern_op(f"{NAMESPACE}.{name}"))
        self.cacheable = cacheable(name)


_OPS: dict[str, _OpInfo] = {}


def _info(name: str) -> _OpInfo:
    info = _OPS.get(name)
    if info is None:
        info = _OPS[name] = _OpInfo(name)
    return info


class MsSelectivePolicy:
    """A ``policy_fn`` prepared once: an ``_C.OpPolicyTable`` or a callable."""

    __slots__ = ("table", "fn", "may_swap")

    def __init__(self, table=None, fn=None) -> None:
        self.table = table
        self.fn = fn
        self.may_swap = table is None or table.default == CheckpointPolicy.MUST_SWAP or any(
            p == CheckpointPolicy.MUST_SWAP for _, p in table.entries())

    def decide(self, info: _OpInfo, ctx, args, kwargs) -> CheckpointPolicy:
        if self.fn is None:
            return self.table.policy_for(info.key)
        res = self.fn(ctx, info.op, *args, **(kwargs or {}))
        if type(res) is CheckpointPolicy:
            return res
        return to_policy(res, what=f"policy_fn for op {info.op.name}")


def _table_name(item, what: str) -> str:
    name = item.name if isinstance(item, MsPolicyOp) else item
    if not isinstance(name, str) or not name or "." in name.removeprefix(NAMESPACE + "."):
        raise ValueError(
            f"hyper_parallel: {what}: {item!r} is not a MindSpore op name. Give ops by the name "
            "MindSpore dispatches them under (func.name in an MsDispatchMode), e.g. 'MatMul', "
            "'BiasAdd', 'LayerNorm'.")
    return name if name.startswith(NAMESPACE + ".") else f"{NAMESPACE}.{name}"


def compile_policy(policy_fn) -> MsSelectivePolicy | None:
    """Prepares a MindSpore checkpoint ``policy_fn``: ``None``, a callable, a list of op
    names (``MUST_SAVE`` for those, ``PREFER_RECOMPUTE`` for the rest) or a dict name ->
    policy (key ``"*"``: the default).

    Raises:
        ValueError: for an entry that is not an op name or a value that is not a policy.
        TypeError: for any other ``policy_fn``.
    """
    if policy_fn is None or isinstance(policy_fn, MsSelectivePolicy):
        return policy_fn
    if isinstance(policy_fn, dict):
        table = _C.OpPolicyTable()
        for key, value in policy_fn.items():
            what = f"policy_fn entry {key!r}"
            policy = to_policy(value, what=what)
            if key == _DEFAULT_KEY:
                table.default = policy
            else:
                table.set(_table_name(key, what), policy)
        return MsSelectivePolicy(table=table)
    if isinstance(policy_fn, (list, tuple, set, frozenset)):
        table = _C.OpPolicyTable()
        for item in policy_fn:
            table.set(_table_name(item, "policy_fn list"), CheckpointPolicy.MUST_SAVE)
        return MsSelectivePolicy(table=table)
    if callable(policy_fn):
        return MsSelectivePolicy(fn=policy_fn)
    raise TypeError(
        "hyper_parallel: policy_fn must be a callable policy_fn(ctx, op, *args, **kwargs), a "
        f"list of op names to save, or a dict op name -> CheckpointPolicy; got "
        f"{type(policy_fn).__name__}.")


class OpCache:
    """The state of one region invocation: per (op name, call index), the kept output
    (``MUST_SAVE``/``PREFER_SAVE``) or its swap record (``MUST_SWAP``).

    Counters for tests and diagnostics: ``saved`` / ``swapped`` (outputs kept in forward),
    ``replayed`` (outputs returned in recompute without running the kernel) and
    ``recomputed`` (ops run again in recompute).
    """

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], tuple] = {}
        self.calls: dict[str, int] = {}
        self.saved = self.swapped = self.replayed = self.recomputed = 0

    def next_index(self, name: str) -> int:
        i = self.calls.get(name, 0)
        self.calls[name] = i + 1
        return i

    def keep(self, name: str, index: int, out, policy) -> None:
        if policy == CheckpointPolicy.MUST_SWAP and isinstance(out, Tensor):
            group = current_group()
            record = STORE.record_for(out, group) if group is not None else None
            if record is not None:
                group.add(record)
                self.entries[(name, index)] = ("swap", record, group)
                self.swapped += 1
                return
        token = _meter.hold_tensor(out) if isinstance(out, Tensor) else None
        self.entries[(name, index)] = ("save", out, token)
        self.saved += 1

    def take(self, name: str, index: int):
        """The kept output, or ``None`` (run the op). An entry is used once: a second
        recompute (rare in MindSpore) runs the op again, which gives the same values."""
        entry = self.entries.pop((name, index), None)
        if entry is None:
            return None
        kind, value, extra = entry
        if kind == "swap":
            return STORE.get(value)
        _meter.drop(extra)
        return value

    def clear(self) -> None:
        for kind, _, extra in self.entries.values():
            if kind == "save":
                _meter.drop(extra)
        self.entries.clear()


class _Dispatch(ms.MsDispatchMode):
    """Runs ops through ``inner`` (a user's ``MsDispatchMode`` from ``context_fn``) when
    given: MindSpore hands each op to the innermost mode only, so composing means
    calling the user's mode explicitly."""

    def __init__(self, cache: OpCache, policy: MsSelectivePolicy, inner=None) -> None:
        super().__init__()
        self.cache = cache
        self.policy = policy
        self.inner = inner

    def run(self, func, args, kwargs):
        if self.inner is not None:
            return self.inner.__ms_dispatch__(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class _CachingMode(_Dispatch):
    def __ms_dispatch__(self, func, args, kwargs=None):
        out = self.run(func, args, kwargs)
        info = _info(func.name)
        if info.cacheable:
            index = self.cache.next_index(info.op.name)
            policy = self.policy.decide(info, SelectiveCheckpointContext(False, out), args,
                                        kwargs)
            if policy in _SAVE or policy == CheckpointPolicy.MUST_SWAP:
                self.cache.keep(info.op.name, index, out, policy)
        return out


class _CachedMode(_Dispatch):
    def __enter__(self):
        self.cache.calls.clear()
        return super().__enter__()

    def __ms_dispatch__(self, func, args, kwargs=None):
        info = _info(func.name)
        if info.cacheable:
            index = self.cache.next_index(info.op.name)
            if self.policy.fn is not None:
                self.policy.decide(info, SelectiveCheckpointContext(True), args, kwargs)
            out = self.cache.take(info.op.name, index)
            if out is not None:
                self.cache.replayed += 1
                return out
            self.cache.recomputed += 1
        return self.run(func, args, kwargs)

    def __exit__(self, exc_type, exc, tb):
        self.cache.clear()
        return super().__exit__(exc_type, exc, tb)


#: Called with each region invocation's cache (tests observe replays through it).
cache_observers: list = []


def context_fn(policy: MsSelectivePolicy | None, user_context_fn=None):
    """A ``context_fn`` for ``mindspore.recompute``: a fresh cache per invocation and the
    user's ``(forward_ctx, recompute_ctx)`` composed with it (theirs outside; a user
    ``MsDispatchMode`` still sees every op)."""

    def make():
        user = call_context_fn(user_context_fn) if user_context_fn is not None else (None, None)
        if policy is None:
            return tuple(c if c is not None else contextlib.nullcontext() for c in user)
        cache = OpCache()
        for observe in cache_observers:
            observe(cache)
        modes = []
        for cls, ctx in zip((_CachingMode, _CachedMode), user):
            inner = ctx if isinstance(ctx, ms.MsDispatchMode) else None
            mode = cls(cache, policy, inner)
            if ctx is None:
                modes.append(mode)
            else:
                modes.append(_Nested(ctx, mode))
        return tuple(modes)

    return make
