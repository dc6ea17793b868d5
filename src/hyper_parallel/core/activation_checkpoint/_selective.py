"""Region contexts: a forward and a recompute context per checkpoint region invocation
(docs/design.md, "Selective checkpoint", "Interception in C++").

Every checkpoint region runs its forward under :class:`_CachingMode` and its recompute
under :class:`_CachedMode` (TorchDispatchModes), both handed to torch's non-reentrant
checkpoint frame through ``context_fn`` (:func:`region_context_fn`;
:func:`create_selective_checkpoint_contexts` gives the same pair to torch's own
checkpoint); a region with a declarative policy (a list or dict of ops) runs under
:class:`_NativeForward` and :class:`_NativeRecompute` instead, whose ops are intercepted
in C++ (``_C.SacRegion``: no Python call per op) with the same rules. They share one
:class:`_RegionState`:

* with a per-op policy, the C++ ``_C.SacCache`` (entries keyed by op and call index,
  cached outputs with their versions, swap handles for ``MUST_SWAP``); a declarative
  policy is an ``_C.OpPolicyTable`` evaluated in C++. Ops reach C++ as small integer
  keys, mapped once per op object here. The policy receives torch's own ``OpOverload``;
* always, the tensors read from outside the region (``_external.py``: recompute sees the
  values forward saw and never writes them) and the kept collective results
  (``_collectives.py``: recompute issues no collective).

Ops that are never cached, whatever the policy says, because caching them would be wrong
or useless: ops that write their arguments (in-place and ``out=`` variants: skipping
them in recompute would skip the write), ops that return views of their inputs (free to
replay; caching one would pin its base) and torch's ``SAC_IGNORED_OPS`` (``detach`` and
metadata queries, whose number differs between forward and recompute). The policy is not
consulted for them; a list or dict naming one is warned about when it is prepared.

Random ops (tagged ``nondeterministic_seeded``: dropout, bernoulli, and every fused
attention kernel, even at ``dropout_p=0``) are asked about like any other op. One whose
outputs are cached carries a ``_C.RngStep`` (csrc/hyper_parallel/activation/RngStep.h): the
state of its device's default generator before and after it in forward. When recompute
hands the cached outputs back instead of running the op, the generator is moved to the
"after" state, so every random op recomputed after it draws what it drew in forward (only
when the generator is at the "before" state: with ``preserve_rng_state=False`` nothing is
touched). An op that did not move the generator records nothing.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel._extension import _C

from . import _memory
from ._collectives import FUNCTIONAL_NAMESPACES, Collectives, is_collective
from ._errors import ArgumentKindError
from ._external import (ExternalTensors, SavedValues, iter_tensors, tensor_name,
                        written_targets)
from ._ignored_ops import is_sac_ignored
from ._policy import CheckpointPolicy, to_policy
from . import _recompute_state
from ._region import Region, in_backward
from ._subclass_outputs import SubclassOutputs
from ._policy_signature import check_checkpoint_policy
from ._warnings import warn as warn_user

_RECOMPUTE = _C.SAC_RECOMPUTE
_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_MUST_SWAP = CheckpointPolicy.MUST_SWAP
_DEFAULT_KEY = "*"

_IGNORED_OPS = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
_IGNORED_OPS |= set(getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ()))


class SelectiveCheckpointContext(torch.utils.checkpoint.SelectiveCheckpointContext):
    """What a checkpoint ``policy_fn`` receives as ``ctx``: a subclass of torch's
    ``torch.utils.checkpoint.SelectiveCheckpointContext``, so a policy written for torch
    (``isinstance`` checks included) runs unchanged.

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
        # torch's __init__ takes keywords only (op_output since torch 2.10): set directly.
        self.is_recompute = is_recompute
        self.op_output = op_output


# _PASSTHROUGH: ops of ignore_sac_ops (FSDP2's and the profiler's): run in forward and
# recompute with nothing recorded (no cache entry, no external-tensor bookkeeping).
_PLAIN, _IGNORED, _COLLECTIVE, _PASSTHROUGH = 0, 1, 2, 3
_TO_COPY = torch.ops.aten._to_copy.default


class _OpInfo:
    __slots__ = ("key", "name", "kind", "writes", "seeded", "view", "declared",
                 "replay_writes", "nograd_name")

    def __init__(self, key: int, name: str, kind: int, writes: tuple,
                 seeded: bool = False, view: bool = False, declared: bool = True) -> None:
        self.key = key  # -1: never cached (see module docstring)
        self.name = name
        self.nograd_name = name + " (no grad)"  # (_access_name)
        self.kind = kind
        # what the op writes: schema positions of positional arguments, names of kwarg-only
        # ones (out=, or max.dim_max's max= and max_values=)
        self.writes = writes
        self.seeded = seeded  # a random op: cached with its RngStep (module docstring)
        self.view = view  # returns a view (or alias) of its first argument
        # its schema declares its writes (autograd bumps their versions): not the batch
        # norms' writes of their running statistics
        self.declared = declared
        # the writes a recompute bumps the private copies' versions for: declared ones of
        # an op that runs (a collective's result is handed back, it does not run)
        self.replay_writes = writes if declared and kind != _COLLECTIVE else ()


_OP_INFO: dict = {}


def _unannotated_writes() -> dict:
    """Ops whose schema does not say that they write some arguments, but which do: the
    batch norms write the running statistics (arguments 3 and 4) in training mode."""
    out = {}
    for name, positions in (("native_batch_norm", (3, 4)), ("cudnn_batch_norm", (3, 4)),
                            ("miopen_batch_norm", (3, 4)),
                            ("batch_norm_update_stats", (1, 2))):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and "default" in packet.overloads():
            out[packet.default] = positions
    return out


_UNANNOTATED_WRITES = _unannotated_writes()


def _written_args(func) -> tuple:
    if func in _UNANNOTATED_WRITES:
        return _UNANNOTATED_WRITES[func]
    if is_collective(func):
        return (0,) if func.namespace == "c10d" and func._schema.name.endswith("_") else ()
    if not isinstance(func, OpOverload) or not func._schema.is_mutable:
        return ()
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(arg.name if arg.kwarg_only else i)
    return tuple(out)


def _never_cached(func) -> str | None:
    """Why selective checkpoint never caches ``func`` (see the module docstring), or
    ``None`` when the policy decides."""
    if not isinstance(func, OpOverload):
        return "it is not an ATen operator overload"
    if func in _IGNORED_OPS or is_sac_ignored(func):
        return "torch's selective checkpoint ignores it (SAC_IGNORED_OPS or ignore_sac_ops)"
    if func in _UNANNOTATED_WRITES:
        return "it writes its arguments (the running statistics)"
    if func.namespace in FUNCTIONAL_NAMESPACES:
        return "it only waits for a collective (the collective's result is kept)"
    schema = func._schema
    if schema.is_mutable:
        return "it writes its arguments (in-place or out=), so recompute must run it"
    if any(r.alias_info is not None for r in schema.returns):
        return "it returns a view of its input, which recompute replays for free"
    return None


def _cacheable(func) -> bool:
    return _never_cached(func) is None


def _op_info(func) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        name = str(func)
        if is_sac_ignored(func):
            info = _OpInfo(-1, name, _PASSTHROUGH, ())
        elif isinstance(func, OpOverload) and is_collective(func):
            info = _OpInfo(int(_C.intern_op(name)), name, _COLLECTIVE, _written_args(func))
        elif _cacheable(func):
            info = _OpInfo(int(_C.intern_op(name)), name, _PLAIN, (),
                           torch.Tag.nondeterministic_seeded in func.tags)
        else:
            info = _OpInfo(-1, name, _IGNORED, _written_args(func),
                           view=isinstance(func, OpOverload) and func.is_view,
                           declared=func not in _UNANNOTATED_WRITES)
        _OP_INFO[func] = info
    return info


def forget_op(func) -> None:
    """Drops the cached decision about ``func`` (``ignore_sac_ops`` changed it)."""
    _OP_INFO.pop(func, None)
    _C.forget_intercepted_ops()


# ------------------------------------------------------------------ C++ interception
# A region with a declarative policy (an OpPolicyTable) runs its per-op work in C++
# (csrc/hyper_parallel/activation/OpInterceptor.h; docs/design.md, "Selective checkpoint"):
# no dispatch mode, no Python call per op. The op rules stay here: C++ asks
# _native_facts once per op.

#: Whether declarative regions are intercepted in C++ (False on a torch whose interception
#: key is taken; see _C.intercept_unavailable_reason()). Tests may turn it off.
NATIVE = bool(_C.intercept_install())


def _op_from_name(name: str):
    """``torch.ops`` overload of ``"ns::op.overload"``, or ``None``."""
    ns, rest = name.split("::", 1)
    op, overload = rest.rsplit(".", 1)
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return None


def _native_facts(name: str):
    """(op key, kind, schema positions it writes, is _to_copy, is random) of an op for
    C++, or None (schema rules) for an op torch.ops cannot name."""
    func = _op_from_name(name)
    if func is None:
        return None
    info = _op_info(func)
    named = {w for w in info.writes if isinstance(w, str)}  # kwarg-only: schema positions
    writes = {w for w in info.writes if not isinstance(w, str)}
    writes |= {i for i, a in enumerate(func._schema.arguments) if a.name in named}
    return info.key, info.kind, tuple(sorted(writes)), func is _TO_COPY, info.seeded


_C.set_op_classifier(_native_facts)


def _native_collective(state_ref, name, args, kwargs, recompute):
    """A collective of a C++-intercepted region: kept in forward, handed back in
    recompute (``_collectives.py``), as the region modes do."""
    st = state_ref()
    func = _op_from_name(name)
    info = _op_info(func)
    if recompute:
        return st.collectives.replay(func, args, kwargs, _C.backward_keeps_graph())
    out = func(*args, **kwargs)
    st.collectives.record(func, args, out, st.keep_collective(info, func, args, kwargs, out))
    return out


def _weight_cast(func, args) -> bool:
    """Whether ``func(*args)`` casts a leaf that requires grad (a weight): never cached nor
    counted.

    Autocast caches its casts of weights for the rest of the outermost autocast block, so a
    region that uses a weight cast earlier in the block runs no cast in forward, while its
    recompute (a new autocast block in backward) does; counted, that cast would take the
    call index of another cast the forward cached and be handed its output. Autocast's own
    state cannot tell its casts apart (its dispatch key is excluded inside its kernels, as
    when it is off), so every cast of a weight is recomputed, which is cheap, and the calls
    of every other op still line up."""
    if func is not _TO_COPY or not args:
        return False
    t = args[0]
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


_warned_uncacheable: set = set()


def _warn_uncacheable(name: str, out) -> None:
    if name in _warned_uncacheable:
        return
    _warned_uncacheable.add(name)
    warn_user(
        f"hyper_parallel: selective checkpoint cannot cache the output of {name} "
        f"({type(out).__name__}: tensor subclasses, SymInts and nested outputs are not "
        "cached), so this op is recomputed in backward whatever the policy says."
    )


_MUST_KEEP = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP)
_warned_demoted: set = set()


def _warn_demoted(name: str, call: int, policy) -> None:
    if name in _warned_demoted:
        return
    _warned_demoted.add(name)
    warn_user(
        f"hyper_parallel: the output of {name} (call #{call}) was modified in place later in "
        f"the same checkpoint region, after selective checkpoint cached it ({policy.name}); "
        "it is recomputed in backward instead, together with the in-place ops. To keep it, "
        "write to a clone of it instead."
    )


def _is_recompute(policy) -> bool:
    return policy in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


_NO_GENERATOR = object()  # _rng_before: the op's device has no default generator
_warned_no_generator: set = set()


def _rng_before(info: _OpInfo, args, kwargs):
    """A random op's ``_C.RngStep`` before it runs (module docstring): ``None`` when it is
    given an explicit generator (the default one is not used), :data:`_NO_GENERATOR` when
    its device has none (the op is then recomputed whatever the policy says)."""
    if isinstance(kwargs.get("generator"), torch.Generator) or any(
            isinstance(a, torch.Generator) for a in args):
        return None
    device = next(iter_tensors(args), None)
    if device is None:
        device = next(iter_tensors(kwargs.values()), None)
    if device is not None:
        device = device.device
    else:
        device = torch.device(kwargs.get("device") or "cpu")
    step = _C.RngStep.before(device)
    if step is not None:
        return step
    if info.name not in _warned_no_generator:
        _warned_no_generator.add(info.name)
        warn_user(
            f"hyper_parallel: selective checkpoint cannot cache the output of the random op "
            f"{info.name} on {device}: the device has no default generator whose state it "
            "could replay in recompute, so this op is recomputed in backward whatever the "
            "policy says.")
    return _NO_GENERATOR


def _check(res, info: _OpInfo):
    if type(res) is CheckpointPolicy:
        return res
    return to_policy(res, what=f"policy_fn for op {info.name}")


def _observe_kept(t) -> None:
    meter = _memory.active_meter()
    if meter is not None:
        meter.observe(t)


class _RegionState:
    """What the forward and the recompute of one region invocation share: the C++ cache of
    a per-op policy (``None`` for full recompute), the record of tensors from outside the
    region, and the kept collective results."""

    __slots__ = ("cache", "policy_fn", "table", "external", "collectives", "may_swap", "region",
                 "report", "rstate", "lazy_swap", "region_args", "on_region", "native",
                 "subclass", "__weakref__")

    def __init__(self, policy, allow_cache_entry_mutation: bool, describe) -> None:
        if policy is None:
            self.cache = self.policy_fn = self.table = None
            self.may_swap = False
        else:
            self.table, self.policy_fn = policy.table, policy.fn
            self.cache = _new_cache(policy.table, allow_cache_entry_mutation)
            self.may_swap = policy.may_swap
        # Outputs the C++ cache cannot hold (DTensors seen by the Python modes).
        self.subclass = SubclassOutputs(allow_cache_entry_mutation)
        # A callable policy may return MUST_SWAP but usually never does: its swap group is
        # opened at the first MUST_SWAP (open_swap_region), not at the region's entry.
        self.lazy_swap = self.may_swap and self.policy_fn is not None
        self.region_args = {}  # Region(**region_args) when one is opened
        self.on_region = None  # on_region(region): a swap region was opened
        self.external = ExternalTensors(describe)
        self.collectives = Collectives(_observe_kept)
        self.region = None
        self.report = None
        self.rstate = _recompute_state.RecomputeState()
        self.rstate.external = self.external
        self.native = None
        if self.table is not None and NATIVE:
            self.native = _C.SacRegion(self.cache, functools.partial(tensor_name,
                                                                     describe=describe))
            self.native.set_collective_handler(
                functools.partial(_native_collective, weakref.ref(self)))
            self.rstate.native = self.native

    def open_swap_region(self) -> None:
        """Opens the swap group that MUST_SWAP outputs go to, unless one is current (an
        enclosing region's) or backward is running (MUST_SWAP outputs of a region
        recomputed in backward stay on device). Called once, before the first MUST_SWAP
        output of a callable policy is recorded, or at entry for a table with MUST_SWAP
        entries; the group then holds the outputs of this forward from there on."""
        self.lazy_swap = False
        if _C.current_group() is not None or in_backward():
            return
        # Under torch's own checkpoint (no region of ours) nothing else would: without a
        # schedule the outputs are reloaded on demand in backward.
        self.region = Region(**self.region_args)
        self.region.__enter__()
        if self.on_region is not None:
            self.on_region(self.region)

    def keep_collective(self, info: _OpInfo, func, args, kwargs, out) -> bool:
        """Collectives are kept unless the policy says MUST_RECOMPUTE."""
        if self.policy_fn is not None:
            res = _check(self.policy_fn(SelectiveCheckpointContext(False, out), func, *args,
                                        **kwargs), info)
        elif self.table is not None:
            res = self.table.policy_for(info.key)
        else:
            return True
        return res is not CheckpointPolicy.MUST_RECOMPUTE


class _CachingMode(TorchDispatchMode):
    """Forward of a region: runs each op, records what recompute needs (the policy's
    decision and cached outputs, external tensors, collective results)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled block inside the region runs compiled (dynamo would otherwise fall
        # back to eager under a mode); the mode sees the ops its graph dispatches.
        return True

    def __init__(self, state: _RegionState) -> None:
        super().__init__()
        self._state = state

    def __enter__(self):
        st = self._state
        if st.may_swap and not st.lazy_swap:
            st.open_swap_region()
        _recompute_state.enter_forward(st.rstate)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = _OP_INFO.get(func) or _op_info(func)
        if kwargs is None:
            kwargs = {}
        st = self._state
        if info.kind == _PASSTHROUGH:  # ignore_sac_ops
            return func(*args, **kwargs)
        if info.writes and st.cache is not None:
            # a write to a cached output's storage through another version counter
            # (aten::_unsafe_view's output): the entry is demoted (SacCache.h)
            for target in written_targets(args, kwargs, info.writes):
                st.cache.before_write(target)
                if st.subclass.entries:
                    st.subclass.before_write(target)
        if st.rstate.excluding:  # inside a checkpoint_exclude_wrapper (not replayed)
            out = func(*args, **kwargs)
            if st.cache is not None:
                st.cache.watch(out)
            return out
        st.external.forward_inputs(_access_name(info), args, kwargs, info.writes,
                                   info.declared, info.view)
        rng = None
        if info.seeded and info.kind == _PLAIN and st.cache is not None and (
                st.policy_fn is not None or not _is_recompute(st.table.policy_for(info.key))):
            rng = _rng_before(info, args, kwargs)
        out = func(*args, **kwargs)
        if rng is not None and rng is not _NO_GENERATOR and not rng.after():
            rng = None  # the op left its generator where it was
        st.external.forward_outputs(out, args[0] if info.view and args else None)
        if st.cache is not None:
            st.cache.watch(out)
        kind = info.kind
        if kind == _COLLECTIVE:
            st.collectives.record(func, args, out,
                                  st.keep_collective(info, func, args, kwargs, out))
            return out
        if kind != _PLAIN or st.cache is None or _weight_cast(func, args):
            return out
        if st.policy_fn is None:
            res = None
        else:
            res = _check(st.policy_fn(SelectiveCheckpointContext(False, out), func, *args,
                                      **kwargs), info)
            if res is _MUST_SWAP and st.lazy_swap:
                st.open_swap_region()
        if rng is _NO_GENERATOR:
            res, rng = CheckpointPolicy.PREFER_RECOMPUTE, None
        index = st.subclass.count_forward(info.key)
        ok = st.cache.record(info.key, out, res, rng, args, kwargs)
        if not ok and not st.subclass.keep(info.key, index, out, args, kwargs):
            _warn_uncacheable(info.name, out)
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        st = self._state
        _recompute_state.exit_forward(st.rstate, exc_type is None)
        st.external.end_forward()
        if st.subclass.entries:
            st.subclass.end_forward()  # written later in the forward: recomputed instead
        _end_forward(st, exc_type, exc, tb, st.external.written)
        return result


class _CachedMode(TorchDispatchMode):
    """Recompute of a region: external tensors read as forward saw them, cached outputs and
    kept collective results handed back, the other ops run."""

    ignore_compile_internals = _CachingMode.ignore_compile_internals

    def __init__(self, state: _RegionState) -> None:
        super().__init__()
        self._state = state
        self._saves: list = []  # per pass: the SavedValues entered, or None

    def __enter__(self):
        st = self._state
        _refuse_recompute_inside(st)
        if st.cache is not None:
            st.cache.begin_recompute()
        st.subclass.begin_recompute()
        st.external.begin_recompute()
        st.collectives.begin_recompute()
        _recompute_state.enter_recompute(st.rstate)
        self._saves.append(_enter_saved_values(st.external.written, st.external.recompute_save,
                                               st.external.written_tensors))
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        _recompute_state.exit_recompute(self._state.rstate)
        saves = self._saves.pop() if self._saves else None
        if saves is not None:
            saves.__exit__(exc_type, exc, tb)  # may raise: a saved value written after
        return result

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = _OP_INFO.get(func) or _op_info(func)
        if kwargs is None:
            kwargs = {}
        st = self._state
        if info.kind == _PASSTHROUGH:
            return func(*args, **kwargs)
        args, kwargs = st.external.recompute_args(_access_name(info), args, kwargs,
                                                  info.replay_writes)
        kind = info.kind
        if kind == _COLLECTIVE:
            return st.collectives.replay(func, args, kwargs, _C.backward_keeps_graph())
        if kind != _PLAIN or st.cache is None or _weight_cast(func, args):
            return func(*args, **kwargs)
        if st.policy_fn is not None:
            _check(st.policy_fn(SelectiveCheckpointContext(True), func, *args, **kwargs), info)
        out = st.cache.replay(info.key, args, kwargs)
        if st.subclass.kept_any:  # counts every call (call indices line up), then looks
            kept = st.subclass.replay(info.key, args, kwargs)
            if out is _RECOMPUTE and kept is not None:
                return kept
        if out is _RECOMPUTE:
            return func(*args, **kwargs)
        return out


def _refuse_recompute_inside(st: _RegionState) -> None:
    """A recompute of a selective region while its own forward (or recompute) still runs on
    this thread: a backward inside the region (``torch.autograd.grad`` of the region's own
    tensors, a gradient penalty) needs values it saved. Its cache holds the forward's calls
    so far, and the recompute would count them from the start again (a callable policy hung
    on the cache's lock; a declarative one raised a misleading call-count error: tester,
    session 19). torch's selective checkpoint refuses it too.

    Raises:
        RuntimeError: always, when that is the case.
    """
    if st.cache is not None and _recompute_state.active(st.rstate):
        raise RuntimeError(
            "hyper_parallel: a backward inside a selective checkpoint region (e.g. "
            "torch.autograd.grad of a tensor the region computed, for a gradient penalty) "
            "needs the region recomputed before its forward ended, which selective checkpoint "
            "does not support (torch's refuses it too). Checkpoint that function without a "
            "policy_fn (full checkpoint supports it), or compute the inner gradient outside "
            "the checkpointed function.")


def _access_name(info: _OpInfo) -> str:
    """How ``ExternalTensors`` names an op's access of an outside tensor: the op, and
    whether grad mode was off (state a first call initializes runs under no_grad, and the
    recompute's reads with grad on are not mistaken for it)."""
    return info.name if torch.is_grad_enabled() else info.nograd_name


def _enter_saved_values(written: int, recompute_save, written_tensors):
    """In a recompute whose forward wrote external tensors: :class:`SavedValues` entered
    (the private copies saved instead of the tensors, writes after a save refused, the
    real tensors' versions put back); otherwise None (nothing to redirect, no hook)."""
    if written <= 0:
        return None
    saves = SavedValues(recompute_save, written_tensors)
    saves.__enter__()
    return saves


def _end_forward(st: _RegionState, exc_type, exc, tb, written: int) -> None:
    """What the forward of a region leaves behind, whichever path intercepted it: the
    report, the demotion of outputs written later in the forward, the swap region."""
    if exc_type is None and st.report is not None:
        st.report(written > 0 or bool(st.collectives) or st.rstate.reassigned,
                  st.external.read_tensors() if st.native is None else ())
    if exc_type is None and st.cache is not None:
        # Outputs written in place later in this forward are replayed instead.
        for name, call, policy in st.cache.end_forward():
            if policy in _MUST_KEEP:
                _warn_demoted(name, call, policy)
    if st.region is not None:
        region, st.region = st.region, None
        region.__exit__(exc_type, exc, tb)


class _NativeForward:
    """Forward of a region whose ops C++ intercepts (a declarative policy): the same
    bookkeeping as :class:`_CachingMode`, with no dispatch mode."""

    __slots__ = ("_state",)

    def __init__(self, state: _RegionState) -> None:
        self._state = state

    def __enter__(self):
        st = self._state
        if st.may_swap:
            st.open_swap_region()
        _recompute_state.enter_forward(st.rstate)
        st.native.enter_forward()
        return self

    def __exit__(self, exc_type, exc, tb):
        st = self._state
        st.native.exit()
        _recompute_state.exit_forward(st.rstate, exc_type is None)
        st.native.end_forward()
        _end_forward(st, exc_type, exc, tb, st.native.written)
        return False


class _NativeRecompute:
    """Recompute of a region whose ops C++ intercepts (see :class:`_CachedMode`)."""

    __slots__ = ("_state", "_shields", "_saves")

    def __init__(self, state: _RegionState) -> None:
        self._state = state
        self._shields: list = []
        self._saves: list = []  # per pass: the SavedValues entered, or None

    def __enter__(self):
        st = self._state
        _refuse_recompute_inside(st)
        st.native.enter_recompute()  # checks the external tensors; may raise
        st.collectives.begin_recompute()
        _recompute_state.enter_recompute(st.rstate)
        self._saves.append(_enter_saved_values(st.native.written, st.native.recompute_save,
                                               st.native.written_tensors))
        shield = None
        if torch._C._len_torch_dispatch_stack() > 0:
            shield = _ReplayShield(st.cache)
            shield.__enter__()
        self._shields.append(shield)
        return self

    def __exit__(self, exc_type, exc, tb):
        st = self._state
        shield = self._shields.pop() if self._shields else None
        if shield is not None:
            shield.__exit__(exc_type, exc, tb)
        st.native.exit()
        _recompute_state.exit_recompute(st.rstate)
        saves = self._saves.pop() if self._saves else None
        if saves is not None:
            saves.__exit__(exc_type, exc, tb)  # may raise: a saved value written after
        return False


def _plain_tensors(args, kwargs) -> bool:
    """No tensor subclass among the arguments (their ops are not the intercepted ones: a
    subclass hands the ops on its inner tensors down to the interception)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(type(t) in plain for t in iter_tensors(args)) and (
        not kwargs or all(type(t) in plain for t in iter_tensors(kwargs.values())))


class _ReplayShield(TorchDispatchMode):
    """The recompute of a C++-intercepted region while other dispatch modes are active
    (a FlopCounterMode around backward, say): those modes sit at the Python key, above
    the interception, so they would see every op, cached or not. This mode (the innermost)
    sends the ops whose outputs are cached straight to the interception, with Python
    dispatch off, as torch's own selective checkpoint mode hides them; others run as
    usual. Only pushed when another mode is active: a Python call per op is paid then
    anyway."""

    ignore_compile_internals = _CachingMode.ignore_compile_internals

    def __init__(self, cache) -> None:
        super().__init__()
        self._cache = cache

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        info = _OP_INFO.get(func) or _op_info(func)
        if (info.kind == _PLAIN and self._cache.next_is_cached(info.key)
                and not _weight_cast(func, args) and _plain_tensors(args, kwargs)):
            with torch._C._DisableTorchDispatch():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


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


def _new_cache(table, allow_cache_entry_mutation=False):
    """The C++ state of one region invocation (a seam for tests to observe caches)."""
    return _C.SacCache(table, allow_cache_entry_mutation)


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
        entries = [(name, policy.value) for name, policy in self.table.entries()]
        return (_policy_from_entries, (entries, self.table.default.value))



def region_context_fn(policy: SelectivePolicy | None = None, user_context_fn=None,
                      allow_cache_entry_mutation: bool = False, describe=None, report=None,
                      region_args=None, on_region=None):
    """A ``context_fn`` for torch's checkpoint frame: a fresh region state per invocation
    (the policy's cache, external tensors, kept collectives; see :class:`_RegionState`),
    composed with the user's ``(forward_ctx, recompute_ctx)`` (theirs outside ours).

    ``describe(tensor) -> str | None`` names a tensor in error messages; ``report(needed)``
    is called after each completed forward, ``needed`` telling whether the region wrote a
    tensor from outside it or ran a collective. When a forward opens a swap group for
    ``MUST_SWAP`` outputs (no enclosing one is current), it is ``Region(**region_args)``
    and ``on_region(region)`` is called with it."""

    def make_contexts():
        state = _RegionState(policy, allow_cache_entry_mutation, describe)
        state.report = report
        if region_args is not None:
            state.region_args = region_args
        state.on_region = on_region
        if state.native is not None:
            forward, recompute = _NativeForward(state), _NativeRecompute(state)
        else:
            forward, recompute = _CachingMode(state), _CachedMode(state)
        if user_context_fn is None:
            return forward, recompute
        user_forward, user_recompute = call_context_fn(user_context_fn)
        return _Nested(user_forward, forward), _Nested(user_recompute, recompute)

    return make_contexts


def state_context_fn(user_context_fn=None, guard=None):
    """A ``context_fn`` for a full-recompute region that needs no region modes: only the
    invocation's :class:`RecomputeState` (``_recompute_state.py``), composed with the
    user's ``(forward_ctx, recompute_ctx)`` (theirs outside). ``guard(forward_ctx,
    recompute_ctx)``: the pair with checks of its own around it (or None)."""

    def make_contexts():
        forward, recompute = _recompute_state.contexts()
        if guard is not None:
            forward, recompute = guard(forward, recompute)
        if user_context_fn is None:
            return forward, recompute
        user_forward, user_recompute = call_context_fn(user_context_fn)
        return _Nested(user_forward, forward), _Nested(user_recompute, recompute)

    return make_contexts


def create_selective_checkpoint_contexts(policy_fn_or_list, allow_cache_entry_mutation=False):
    """The ``(forward_ctx, recompute_ctx)`` pair of a selective checkpoint, for
    ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (and so of
    ``apply_activation_checkpointing`` and Hugging Face's gradient checkpointing), as
    torch's function of the same name; with ours, ``MUST_SWAP`` offloads op outputs.

    Use it as ``context_fn=functools.partial(create_selective_checkpoint_contexts, policy)``:
    each region invocation needs a fresh pair.

    Args:
        policy_fn_or_list: a policy as :func:`checkpoint`'s ``policy_fn`` accepts (a callable
            ``policy_fn(ctx, op, *args, **kwargs)`` receiving torch's ``OpOverload``, a list
            of ops to save, or a dict op -> policy), not ``None``.
        allow_cache_entry_mutation: as in torch: ``True`` hands back a cached output that was
            modified in place after the region's forward instead of raising. (Outputs
            modified later in the region's own forward are always recomputed, with the
            in-place ops, in both modes; torch raises for them by default.)

    Returns:
        A tuple of two context managers sharing one region state: TorchDispatchModes for
        a callable policy, C++-intercepted contexts for a list or dict (no Python call per
        op) where this torch allows it (``_selective.NATIVE``). Called while torch.compile
        traces (torch's checkpoint compiled with this ``context_fn``): torch's own
        selective-checkpoint modes deciding with this policy, the only ones torch compiles.

    Raises:
        ValueError, TypeError: as :func:`checkpoint` does for a bad ``policy_fn``, and
            ``TypeError`` for a non-bool ``allow_cache_entry_mutation``.
    """
    if policy_fn_or_list is None:
        raise TypeError("hyper_parallel: create_selective_checkpoint_contexts needs a policy "
                        "function or a list of ops; got None.")
    check_bool("allow_cache_entry_mutation", allow_cache_entry_mutation)
    policy = compile_policy(policy_fn_or_list)
    if torch.compiler.is_compiling():
        # Traced (torch.compile of torch's checkpoint with this context_fn): torch compiles
        # only its own selective-checkpoint modes, so hand it those, deciding with our
        # policy (docs/design.md, "torch.compile").
        from ._compile import _TorchPolicy

        return torch.utils.checkpoint.create_selective_checkpoint_contexts(
            _TorchPolicy(policy), allow_cache_entry_mutation)
    return region_context_fn(policy, None, allow_cache_entry_mutation)()


def check_bool(name: str, value) -> None:
    """Raises :class:`ArgumentKindError` (a TypeError and a ValueError) unless ``value``
    is a bool (``1`` and ``None`` are not)."""
    if value is not True and value is not False:
        raise ArgumentKindError(f"hyper_parallel: checkpoint option {name} must be bool "
                                f"(True or False); got {value!r} ({type(value).__name__}).")


def _policy_from_entries(entries, default) -> SelectivePolicy:
    table = _C.OpPolicyTable(_C.policy_from_int(default))
    for name, policy in entries:
        table.set(name, _C.policy_from_int(policy))
    return SelectivePolicy(table=table)


def _op_names(item, what: str) -> str:
    """Table name of an op given in a list or dict (``ns.op`` or ``ns.op.overload``)."""
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


def _warn_if_never_cached(name: str, policy, what: str) -> None:
    """Warns when a list or dict names an op (``ns.op`` or ``ns.op.overload``) that
    selective checkpoint never caches, so asking to save or swap it does nothing."""
    if _is_recompute(policy):
        return
    parts = name.split(".")
    packet = getattr(getattr(torch.ops, parts[0], None), parts[1], None)
    if not isinstance(packet, OpOverloadPacket):
        return
    names = [parts[2]] if len(parts) == 3 else packet.overloads()
    reasons = {_never_cached(getattr(packet, o)) for o in names}
    if None in reasons or not reasons:
        return
    warn_user(
        f"hyper_parallel: {what}: {name} is never cached by selective checkpoint "
        f"({'; '.join(sorted(reasons))}), so {policy.name} has no effect on it. Name the op "
        "that produces the tensor instead (for example the out-of-place variant).")


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
                name = _op_names(key, what)
                _warn_if_never_cached(name, policy, what)
                table.set(name, policy)
        return SelectivePolicy(table=table)
    if isinstance(policy_fn, (list, tuple, set, frozenset)):
        table = _C.OpPolicyTable()
        for item in policy_fn:
            name = _op_names(item, "policy_fn list")
            _warn_if_never_cached(name, _MUST_SAVE, "policy_fn list")
            table.set(name, _MUST_SAVE)
        return SelectivePolicy(table=table)
    if callable(policy_fn):
        return SelectivePolicy(fn=check_checkpoint_policy(policy_fn))
    raise TypeError(
        f"hyper_parallel: policy_fn must be a callable policy_fn(ctx, op, *args, **kwargs), a "
        f"list of ops to save, or a dict op -> CheckpointPolicy; got "
        f"{type(policy_fn).__name__}.")
