"""Selective checkpoint: per-op policies as two TorchDispatchModes over a C++ cache.

A checkpoint region with a ``policy_fn`` runs its forward under :class:`_CachingMode`
and its recompute under :class:`_CachedMode`, both handed to torch's non-reentrant
checkpoint frame through ``context_fn``. They are thin: the state of one region
invocation (entries keyed by op and call index, cached outputs with their versions,
swap handles for ``MUST_SWAP``) lives in ``_C.SacCache``, and a declarative policy (a
list or dict of ops) is an ``_C.OpPolicyTable`` evaluated in C++, so a region that uses
one makes no Python call per op to decide. Ops reach C++ as small integer keys, mapped
once per op object here.

Ops that are never cached, whatever the policy says, because caching them would be wrong
or useless: ops that write their arguments (in-place and ``out=`` variants: skipping
them in recompute would skip the write), ops that return views of their inputs (free to
replay; caching one would pin its base), random ops (tagged ``nondeterministic_seeded``:
they must be replayed so that the replayed RNG stream stays aligned for every random op
after them) and torch's ``SAC_IGNORED_OPS`` (``detach`` and metadata queries, whose
number differs between forward and recompute). The policy is not consulted for them.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel._extension import _C

from ._policy import CheckpointPolicy, to_policy
from ._policy_signature import check_checkpoint_policy

_RECOMPUTE = _C.SAC_RECOMPUTE
_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_DEFAULT_KEY = "*"

_IGNORED_OPS = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
_IGNORED_OPS |= set(getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ()))


class SelectiveCheckpointContext:
    """What a checkpoint ``policy_fn`` receives as ``ctx`` (as in torch.utils.checkpoint).

    Attributes:
        is_recompute (bool): ``False`` in the region's forward, ``True`` while backward
            recomputes it. In recompute the decision recorded in forward is replayed
            whatever the policy returns then (it is still checked for validity), so a
            stateful policy may simply count forward calls only.
        op_output: the op's output in forward (the policy runs after the op); ``None``
            in recompute.
    """

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, is_recompute: bool, op_output=None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


class PolicyOp:
    """The ``op`` a checkpoint ``policy_fn`` receives: the ATen op overload that ran.

    Named as the user guide expects: ``op.name()`` and ``str(op)`` give
    ``"aten.addmm.default"`` (torch's own ``OpOverload.name()`` would say
    ``"aten::addmm"``); other attributes (``_schema``, ``tags``, ``overloadpacket``) are
    the overload's, and calling it calls the overload.

    Comparisons: ``op == x`` is true when ``x`` is its ``OpOverload``
    (``torch.ops.aten.addmm.default``), its packet (``torch.ops.aten.addmm``), or the
    name of either as a string (``"aten.addmm.default"``, ``"aten.addmm"``,
    ``"aten::addmm"``). Its hash is the overload's, so:

    * ``op in [...]`` / ``op in (...)`` (lists and tuples compare with ``==``) works for
      every one of these forms, mixed freely;
    * ``op in {...}`` and ``d[op]`` / ``d.get(op)`` (sets and dict keys compare by hash
      first) work for sets and dicts of **overloads**, the torch idiom
      ``op in {aten.mm.default, aten.addmm.default}``;
    * sets and dict keys of **packets or names** cannot match ``op`` (no single hash can
      equal that of the overload, the packet and both names). Look up the matching
      form instead: ``op.overloadpacket in {aten.mm, aten.addmm}``,
      ``op.name() in {"aten.mm.default"}``, ``str(op.overloadpacket) in {"aten.mm"}``,
      ``d.get(op.overloadpacket)`` -- or use a list.
    """

    __slots__ = ("overload", "_name", "_packet_name")

    def __init__(self, overload: OpOverload) -> None:
        self.overload = overload
        self._name = str(overload)
        self._packet_name = str(overload.overloadpacket)

    def name(self) -> str:
        return self._name

    def __str__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return self._name

    def __eq__(self, other):
        if isinstance(other, PolicyOp):
            return other.overload is self.overload
        if isinstance(other, OpOverload):
            return other is self.overload
        if isinstance(other, OpOverloadPacket):
            return other is self.overload.overloadpacket
        if isinstance(other, str):
            name = other.replace("::", ".", 1)
            return name == self._name or name == self._packet_name
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.overload)

    def __call__(self, *args, **kwargs):
        return self.overload(*args, **kwargs)

    def __getattr__(self, name):
        if name in PolicyOp.__slots__:  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.overload, name)


class _OpInfo:
    __slots__ = ("key", "op", "name")

    def __init__(self, key: int, op, name: str) -> None:
        self.key = key  # -1: never cached (see module docstring)
        self.op = op
        self.name = name


_OP_INFO: dict = {}


def _cacheable(func) -> bool:
    if func in _IGNORED_OPS or not isinstance(func, OpOverload):
        return False
    schema = func._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False
    return torch.Tag.nondeterministic_seeded not in func.tags


def _op_info(func) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        if _cacheable(func):
            name = str(func)
            info = _OpInfo(int(_C.intern_op(name)), PolicyOp(func), name)
        else:
            info = _OpInfo(-1, None, str(func))
        _OP_INFO[func] = info
    return info


_warned_uncacheable: set = set()


def _warn_uncacheable(name: str, out) -> None:
    if name in _warned_uncacheable:
        return
    _warned_uncacheable.add(name)
    warnings.warn(
        f"hyper_parallel: selective checkpoint cannot cache the output of {name} "
        f"({type(out).__name__}: tensor subclasses, SymInts and nested outputs are not "
        "cached), so this op is recomputed in backward whatever the policy says.",
        stacklevel=3,
    )


_MUST_KEEP = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP)
_warned_demoted: set = set()


def _warn_demoted(name: str, call: int, policy) -> None:
    if name in _warned_demoted:
        return
    _warned_demoted.add(name)
    warnings.warn(
        f"hyper_parallel: the output of {name} (call #{call}) was modified in place later in "
        f"the same checkpoint region, after selective checkpoint cached it ({policy.name}); "
        "it is recomputed in backward instead, together with the in-place ops. To keep it, "
        "write to a clone of it instead.",
        stacklevel=4,
    )


def _check(res, info: _OpInfo):
    if type(res) is CheckpointPolicy:
        return res
    return to_policy(res, what=f"policy_fn for op {info.name}")


class _CachingMode(TorchDispatchMode):
    """Forward of a selective region: runs each op, asks the policy, records the call."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled block inside the region runs compiled (dynamo would otherwise fall
        # back to eager under a mode); the mode sees the ops its graph dispatches.
        return True

    def __init__(self, cache, policy_fn) -> None:
        super().__init__()
        self._cache = cache
        self._policy_fn = policy_fn  # None: the cache's C++ table decides

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = _OP_INFO.get(func) or _op_info(func)
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        if info.key < 0:
            return out
        if self._policy_fn is None:
            ok = self._cache.record(info.key, out)
        else:
            res = self._policy_fn(SelectiveCheckpointContext(False, out), info.op, *args,
                                  **kwargs)
            ok = self._cache.record(info.key, out, _check(res, info))
        if not ok:
            _warn_uncacheable(info.name, out)
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            # Outputs written in place later in this forward are replayed instead.
            for name, call, policy in self._cache.end_forward():
                if policy in _MUST_KEEP:
                    _warn_demoted(name, call, policy)
        return result


class _CachedMode(TorchDispatchMode):
    """Recompute of a selective region: returns cached outputs, runs the other ops."""

    ignore_compile_internals = _CachingMode.ignore_compile_internals

    def __init__(self, cache, policy_fn) -> None:
        super().__init__()
        self._cache = cache
        self._policy_fn = policy_fn

    def __enter__(self):
        self._cache.begin_recompute()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = _OP_INFO.get(func) or _op_info(func)
        if kwargs is None:
            kwargs = {}
        if info.key < 0:
            return func(*args, **kwargs)
        if self._policy_fn is not None:
            _check(self._policy_fn(SelectiveCheckpointContext(True), info.op, *args, **kwargs),
                   info)
        out = self._cache.replay(info.key)
        if out is _RECOMPUTE:
            return func(*args, **kwargs)
        return out


class _Nested:
    """Enters ``outer`` then ``inner`` and exits them in reverse; re-enterable (a
    retain_graph backward enters the recompute context again)."""

    __slots__ = ("_outer", "_inner", "_exits")

    def __init__(self, outer, inner) -> None:
        self._outer = outer
        self._inner = inner
        self._exits: list = []

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._outer)
            stack.enter_context(self._inner)
            self._exits.append(stack.pop_all())
        return self

    def __exit__(self, exc_type, exc, tb):
        return self._exits.pop().__exit__(exc_type, exc, tb)


def _is_context_manager(obj) -> bool:
    cls = type(obj)
    return hasattr(cls, "__enter__") and hasattr(cls, "__exit__")


def call_context_fn(context_fn):
    """``context_fn()``, checked to be a pair of context managers (as torch's checkpoint
    expects), so that a wrong result fails with a message that says what is wrong."""
    res = context_fn()
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise TypeError(
            "hyper_parallel: checkpoint context_fn must return a tuple of two context "
            "managers (forward_ctx, recompute_ctx), entered around the region's forward and "
            f"its recompute; it returned {type(res).__name__}"
            + (f" of length {len(res)}" if isinstance(res, (tuple, list)) else f" {res!r}")
            + ".")
    for which, ctx in zip(("forward_ctx", "recompute_ctx"), res):
        if not _is_context_manager(ctx):
            raise TypeError(
                f"hyper_parallel: checkpoint context_fn returned a {which} that is not a "
                f"context manager ({type(ctx).__name__}: {ctx!r}); return "
                "(forward_ctx, recompute_ctx), e.g. (contextlib.nullcontext(), "
                "contextlib.nullcontext()).")
    return tuple(res)


def checked_context_fn(context_fn):
    """A ``context_fn`` for torch's frame that checks what the user's one returns."""
    return functools.partial(call_context_fn, context_fn)


def _new_cache(table):
    """The C++ state of one region invocation (a seam for tests to observe caches)."""
    return _C.SacCache(table)


class SelectivePolicy:
    """A checkpoint ``policy_fn`` prepared once: a C++ op table or a callable.

    ``checkpoint_wrapper`` prepares its policy at construction, so a list or dict is
    validated once, not at every call.
    """

    __slots__ = ("table", "fn", "may_swap")

    def __init__(self, table=None, fn=None) -> None:
        self.table = table
        self.fn = fn
        #: Whether some op output may be MUST_SWAP (a callable may return anything).
        self.may_swap = table is None or table.default == CheckpointPolicy.MUST_SWAP or any(
            p == CheckpointPolicy.MUST_SWAP for _, p in table.entries())

    def __deepcopy__(self, memo):
        return self  # immutable once prepared: a deep-copied wrapper shares it

    def __reduce__(self):
        # The C++ table is rebuilt from its entries (torch.save of a wrapped model).
        if self.table is None:
            return (SelectivePolicy, (None, self.fn))
        entries = [(name, int(policy)) for name, policy in self.table.entries()]
        return (_policy_from_entries, (entries, int(self.table.default)))

    def context_fn(self, user_context_fn=None):
        """A ``context_fn`` for torch's checkpoint: a fresh cache per region invocation,
        composed with the user's ``(forward_ctx, recompute_ctx)`` (theirs outside)."""
        table, fn = self.table, self.fn

        def make_contexts():
            cache = _new_cache(table)
            forward, recompute = _CachingMode(cache, fn), _CachedMode(cache, fn)
            if user_context_fn is None:
                return forward, recompute
            user_forward, user_recompute = call_context_fn(user_context_fn)
            return _Nested(user_forward, forward), _Nested(user_recompute, recompute)

        return make_contexts


def _policy_from_entries(entries, default) -> SelectivePolicy:
    table = _C.OpPolicyTable(_C.policy_from_int(default))
    for name, policy in entries:
        table.set(name, _C.policy_from_int(policy))
    return SelectivePolicy(table=table)


def _op_names(item, what: str) -> str:
    """Table name of an op given in a list or dict (``ns.op`` or ``ns.op.overload``)."""
    if isinstance(item, PolicyOp):
        return item.name()
    if isinstance(item, OpOverload):
        return str(item)
    if isinstance(item, OpOverloadPacket):
        if not item.overloads():
            raise ValueError(f"hyper_parallel: {what}: the op packet {item} has no overloads, "
                             "so it would match nothing; list an existing op.")
        return str(item)
    if isinstance(item, str):
        return _validated_name(item, what)
    raise ValueError(
        f"hyper_parallel: {what}: {item!r} is not an op. Give ATen ops as "
        "torch.ops.aten.mm (every overload), torch.ops.aten.mm.default (one overload), or "
        "their names 'aten.mm' / 'aten.mm.default'. Python functions such as "
        "torch.nn.functional.linear cannot be matched: a policy sees the ATen ops they run "
        "(aten.addmm, aten.mm, ...).")


def _validated_name(name: str, what: str) -> str:
    norm = name.replace("::", ".", 1)
    parts = norm.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"hyper_parallel: {what}: '{name}' is not an op name. Use 'namespace.op' for "
            "every overload (e.g. 'aten.mm') or 'namespace.op.overload' for one "
            "(e.g. 'aten.mm.default'), as str(torch.ops.aten.mm.default) prints.")
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, OpOverloadPacket):
        raise ValueError(
            f"hyper_parallel: {what}: no op named '{parts[0]}.{parts[1]}' is registered with "
            "torch.ops, so this entry would match nothing. Check the spelling (for example "
            "'aten.addmm'), or import the library that registers the op first.")
    if len(parts) == 3 and parts[2] not in packet.overloads():
        raise ValueError(
            f"hyper_parallel: {what}: '{parts[0]}.{parts[1]}' has no overload '{parts[2]}' "
            f"(it has {sorted(packet.overloads())}); name one of those, or "
            f"'{parts[0]}.{parts[1]}' for all of them.")
    return norm


def compile_policy(policy_fn) -> SelectivePolicy | None:
    """Prepares a checkpoint ``policy_fn`` (SPEC 2).

    Args:
        policy_fn: ``None`` (full recompute); a callable
            ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``; a list,
            tuple or set of ops (``MUST_SAVE`` for those, ``PREFER_RECOMPUTE`` for the
            rest); a dict op -> policy (ops not in it: ``PREFER_RECOMPUTE``, or the value
            of the key ``"*"``). Ops are ``OpOverload`` s, ``OpOverloadPacket`` s (every
            overload) or names (``"aten.mm"``, ``"aten.mm.default"``). Lists and dicts are
            evaluated in C++ without a Python call per op.

    Returns:
        A :class:`SelectivePolicy`, or ``None`` for ``None``.

    Raises:
        ValueError: for an entry that is not an op, names no registered op or overload,
            or maps to something that is not a policy.
        TypeError: for any other ``policy_fn``, or a callable that cannot be called as
            ``policy_fn(ctx, op, ...)`` (a per-tensor swap policy, say).
    """
    if policy_fn is None or isinstance(policy_fn, SelectivePolicy):
        return policy_fn
    if isinstance(policy_fn, _C.OpPolicyTable):
        return SelectivePolicy(table=policy_fn)
    if isinstance(policy_fn, dict):
        table = _C.OpPolicyTable()
        for key, value in policy_fn.items():
            what = f"policy_fn entry {key!r}"
            policy = to_policy(value, what=what)
            if isinstance(key, str) and key == _DEFAULT_KEY:
                table.default = policy
            else:
                table.set(_op_names(key, what), policy)
        return SelectivePolicy(table=table)
    if isinstance(policy_fn, (list, tuple, set, frozenset)):
        table = _C.OpPolicyTable()
        for item in policy_fn:
            table.set(_op_names(item, "policy_fn list"), _MUST_SAVE)
        return SelectivePolicy(table=table)
    if callable(policy_fn):
        return SelectivePolicy(fn=check_checkpoint_policy(policy_fn))
    raise TypeError(
        f"hyper_parallel: policy_fn must be a callable policy_fn(ctx, op, *args, **kwargs), a "
        f"list of ops to save, or a dict op -> CheckpointPolicy; got "
        f"{type(policy_fn).__name__}.")
