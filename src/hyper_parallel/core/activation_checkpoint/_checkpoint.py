"""Functional checkpoint: ``checkpoint`` and ``checkpoint_wrapper`` (SPEC 2).

Built on torch.utils.checkpoint's non-reentrant frame, which already replays the RNG
state (dropout) and the autocast state in recompute and stops recomputing early. Our
parts:

* a checkpoint region is also a layer invocation for the swap engine (a ``Region``), so
  that ``swap_inputs`` (the inputs torch's frame saves for the recompute) and ``MUST_SWAP``
  op outputs join the layer's swap group and follow the prefetch schedule;
* per-op policies (``policy_fn``): two TorchDispatchModes over a C++ cache, handed to
  torch's frame through ``context_fn`` and composed with the user's own ``context_fn``
  (see ``_selective.py``).
"""

from __future__ import annotations

import collections
import collections.abc
import enum
import functools
import itertools
import sys
import types
import weakref

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves
from torch import nn

from hyper_parallel._extension import _C

from . import _compile, _diagnostics, _memory, _recompute_state
from ._backends import backend_for, wrapper_dispatch
from ._errors import check_callable
from ._external import _set_versions, modified_message, tensor_name
from ._host_pool import native_pool
from ._recompute_state import debug_call, reentrant_call
from ._region import REGISTERED_ONLY, SWAP_ALL, Region, in_func_transform
from ._selective import check_bool, compile_policy, region_context_fn, state_context_fn
from ._swap import LayerCall, in_backward, resolve_layer
from ._swap_manager import SwapManager
from ._wrappers import ActivationWrapper, _refuse_double_wrap


def _with_bound_kwargs(function, args: tuple, kwargs: dict):
    """(callable, positional args) equivalent to ``function(*args, **kwargs)``.

    The kwargs become trailing positional arguments, so that torch's frame keeps their
    tensors as region inputs (saved through the swap hooks with ``swap_inputs``, and
    used to find the devices whose RNG state is replayed), and so that no kwarg of
    ``function`` is taken by torch.utils.checkpoint as one of its own options.
    """
    if not kwargs:
        return function, args
    names = tuple(kwargs)
    n_pos = len(args)

    def call(*flat):
        return function(*flat[:n_pos], **dict(zip(names, flat[n_pos:])))

    return call, (*args, *kwargs.values())


def _meter_nested_inputs(call_args: tuple) -> None:
    """Names to the active saved-activation meter the tensors a region's arguments hold
    inside tuples, lists and dicts. torch's frame saves a top-level tensor argument through
    the saved-tensor hooks (so the meter sees it), but keeps any other argument as the
    object it is, until backward: the tensors inside are held for the recompute all the
    same (a tester, session 27: layers taking a dict read 0 B under "checkpoint" while
    their inputs stayed alive, and the planner took checkpoint for free there). They are
    not offloaded by ``swap_inputs`` (docs/design.md, "Known limits")."""
    meter = _memory.active_meter()
    if meter is None:
        return
    for arg in call_args:
        if not isinstance(arg, torch.Tensor):
            for t in tree_leaves(arg):
                if isinstance(t, torch.Tensor):
                    meter.observe(t)


def _state_module(function):
    """The module whose parameters and buffers a region's call reads: a wrapper's layer,
    the module called, the module of a bound method (HF's ``layer.__call__``), or the
    modules of a ``checkpoint_sequential`` segment (a list); None for other callables (a
    lambda's modules are not known)."""
    if isinstance(function, LayerCall):
        return function.state_module
    if isinstance(function, nn.Module):
        return function
    modules = getattr(function, "_hp_state_modules", None)  # checkpoint_sequential's segment
    if modules:
        return modules
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


class _ForwardModuleState:
    """A region's call whose recompute reads the parameters and buffers its forward read.

    The first call (the forward) notes which tensors the module's tree holds; a later call
    (the recompute in backward) puts those back for its duration wherever the module holds
    other tensors by then. ``torch.func.functional_call`` (and any stateless
    reparametrization) swaps tensors into the module for the forward only, so torch's
    checkpoint recomputes with the module's own parameters and gives the call's parameters
    silently wrong gradients. In every other case the module holds the same tensors and the
    check costs one walk in C++ per call (docs/design.md, "Recompute and state outside the
    region").

    A buffer the forward itself replaced by another tensor (``self.cache = ...``) is put
    back as it was before the forward only where the forward read that old tensor
    (``self.count = self.count + 1``: the recompute makes the new one again from it).
    Otherwise (a cache built or extended behind a Python flag, a lazily made buffer) the
    recompute, which finds the flag set and skips the assignment, must read the new one,
    as the forward did after the assignment: it keeps the slot's new tensor. What the
    forward read is known where the region modes watched it. Without them (torch's frame
    alone: a plain region, ``use_reentrant=True``, a debug region) a new tensor of the old
    one's shape is taken for an update made from it (the old one is put back), one of
    another shape for a cache rebuilt for a new size (the new one is kept); a plain region
    is then probed again at its next call."""

    __slots__ = ("fn", "module", "refs", "moved")

    def __init__(self, fn, module) -> None:
        self.fn = fn
        self.module = module
        self.refs = None
        self.moved = False  # the forward replaced a buffer

    def __call__(self, *args):
        if self.refs is None:
            self.refs = refs = _C.module_state_refs(self.module)
            out = self.fn(*args)
            moved = _C.reassigned_buffers(refs)
            if moved:
                self.moved = True
                self._settle(moved)
            return out
        # A forward that replaced buffers: the recompute replaces them again, and what it
        # leaves is undone whatever the slots held when it began (two forwards swapping
        # `self.a, self.b = self.b, self.a` before one backward left the first call's
        # recompute nothing to put back, and its swap stayed: tester, session 20).
        undo = _C.module_state_refs(self.module) if self.moved else None
        put = _C.put_module_state(self.refs)
        if undo is None:
            undo = put
        if not undo:
            return self.fn(*args)
        try:
            return self.fn(*args)
        finally:
            _C.put_module_state(undo, True)

    def _settle(self, moved) -> None:
        """After the forward: for each buffer slot (offset into ``refs``) that it
        reassigned, which tensor the recompute starts from (class docstring)."""
        state = _recompute_state.get_recompute_state()
        refs = list(self.refs)
        for i in moved:
            old, new = refs[i + 2], refs[i].get(refs[i + 1])
            read = None if state is None else _recompute_state.read_in_forward(state, old)
            if read is None:
                # Not watched: a tensor of the old one's shape is taken for an update of its
                # value made from it (a counter, an EMA switched on after the probe), one of
                # another shape for a cache rebuilt for a new size (docs/design.md).
                read = tuple(old.shape) == tuple(new.shape)
                if state is not None:
                    state.reassigned = True  # (a plain region is probed again)
            elif read and state is not None:
                state.reassigned = True
            if not read:
                refs[i + 2] = new  # the forward's new tensor
        self.refs = tuple(refs)


def _region_call(function, args: tuple, kwargs: dict):
    """(callable, positional args) that torch's frame runs for ``function(*args,
    **kwargs)``: kwargs bound (:func:`_with_bound_kwargs`) and, for a module, its forward's
    parameters and buffers put back in recompute (:class:`_ForwardModuleState`)."""
    call, call_args = _with_bound_kwargs(function, args, kwargs)
    module = _state_module(function)
    return (_ForwardModuleState(call, module) if module is not None else call), call_args


_DETERMINISM_CHECKS = tuple(getattr(torch_checkpoint, "_allowed_determinism_checks_to_fns",
                                     {"default": None, "none": None}))
_DEFAULT_DETERMINISM = getattr(torch_checkpoint, "_DEFAULT_DETERMINISM_MODE", "default")


def _torch_options(use_reentrant, preserve_rng_state, determinism_check, debug, early_stop,
                   has_context: bool, at_call: bool = True) -> dict:
    """Checks torch.utils.checkpoint's own options and returns those to pass to its frame
    (``at_call``: also heeds torch's global debug switch, which applies at call time)."""
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError("hyper_parallel: checkpoint option use_reentrant must be None, False "
                        f"or True; got {use_reentrant!r} ({type(use_reentrant).__name__}).")
    for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug),
                        ("early_stop", early_stop)):
        check_bool(name, value)
    if not isinstance(determinism_check, str) or determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"hyper_parallel: checkpoint determinism_check must be one of "
            f"{list(_DETERMINISM_CHECKS)}; got {determinism_check!r}.")
    if has_context:
        forced = getattr(torch_checkpoint, "_checkpoint_debug_enabled", None) if at_call else None
        if forced if forced is not None else debug:
            raise ValueError(
                "hyper_parallel: checkpoint debug mode (debug=True, or "
                "torch.utils.checkpoint.set_checkpoint_debug_enabled(True)) cannot be "
                "combined with policy_fn or context_fn (torch's debug mode records the ops "
                "through its own context_fn); drop one of them.")
    if use_reentrant:
        conflicts = [name for name, used in (
            ("policy_fn/context_fn", has_context), ("debug", debug),
            ("early_stop=False", not early_stop),
            ("determinism_check", determinism_check != _DEFAULT_DETERMINISM)) if used]
        _refuse_reentrant(conflicts)
        return {"use_reentrant": True, "preserve_rng_state": preserve_rng_state}
    options = {"use_reentrant": False}
    if not preserve_rng_state:
        options["preserve_rng_state"] = False
    if determinism_check != _DEFAULT_DETERMINISM:
        options["determinism_check"] = determinism_check
    if debug:
        options["debug"] = True
    if not early_stop:
        options["early_stop"] = False
    return options


def _refuse_reentrant(conflicts) -> None:
    if conflicts:
        raise ValueError(
            f"hyper_parallel: use_reentrant=True cannot be combined with {', '.join(conflicts)}: "
            "torch's reentrant checkpoint runs the region without saved-tensor hooks, so "
            "per-op policies, swap, recompute contexts and exclusion regions need the "
            "non-reentrant frame. Pass use_reentrant=False (or omit it), or drop those "
            "options.")


def _holds_exclusions(function) -> bool:
    """Whether the module a region runs holds ``checkpoint_exclude_wrapper`` modules (a
    walk of its module tree; plain functions are not looked into)."""
    target = function.fn if isinstance(function, LayerCall) else function
    if not isinstance(target, nn.Module):
        return False
    from ._exclude import CheckpointExcludeWrapper

    return any(isinstance(m, CheckpointExcludeWrapper) for m in target.modules())


def _warn_reentrant_fallback(function) -> None:
    target = function.fn if isinstance(function, LayerCall) else function
    name = type(target).__name__
    _diagnostics._warn_once(
        f"reentrant-exclusions:{name}",
        f"hyper_parallel: {name} holds checkpoint_exclude_wrapper regions, which torch's "
        "reentrant checkpoint would run twice (its backward replays the whole body); it is "
        "checkpointed with use_reentrant=False instead (same gradients, the exclusions run "
        "once). Pass use_reentrant=False to make this explicit and silence this warning.")


def _debug_forced() -> bool:
    forced = getattr(torch_checkpoint, "_checkpoint_debug_enabled", None)
    return bool(forced)


def _argument_ids(args, kwargs) -> frozenset:
    """The ids of the tensors among a call's arguments (top level, one level of lists,
    tuples and dicts): those differ per call and are not the region's outside state."""
    ids = set()
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, torch.Tensor):
            ids.add(id(v))
        elif isinstance(v, (list, tuple)):
            ids.update(id(u) for u in v if isinstance(u, torch.Tensor))
        elif isinstance(v, dict):
            ids.update(id(u) for u in v.values() if isinstance(u, torch.Tensor))
    return frozenset(ids)


def _describer(function, module=None):
    """``describe(tensor)`` for error messages: the name of a parameter or buffer of the
    region's module (looked up only when an error is raised): ``module``, or the function
    itself, a wrapper's ``fn``, a bound method's module (``m.forward``, Hugging Face's
    ``layer.__call__``)."""
    if not isinstance(module, nn.Module):
        module = function if isinstance(function, nn.Module) else getattr(function, "fn", None)
    if not isinstance(module, nn.Module):
        module = getattr(function, "__self__", None)
    if not isinstance(module, nn.Module):
        return None

    def describe(t):
        for kind, items in (("buffer", module.named_buffers()),
                            ("parameter", module.named_parameters())):
            for name, value in items:
                if value is t:
                    return f"{kind} '{name}' of {type(module).__name__}"
        return None

    return describe


class _WeakIdMap:
    """A map keyed by object identity, holding its keys weakly (a WeakKeyDictionary keys
    by ``==`` and ``hash``: a module defining ``__eq__`` is unhashable, and two that
    compare equal would share an entry). Keys must support weak references."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict = {}  # id -> (weakref to the key, value)

    def get(self, key, default=None):
        item = self._items.get(id(key))
        return item[1] if item is not None and item[0]() is key else default

    def __setitem__(self, key, value) -> None:
        items, k = self._items, id(key)

        def forget(_ref, k=k, items=items):
            item = items.get(k)
            if item is not None and item[0] is _ref:
                del items[k]

        item = items.get(k)
        ref = item[0] if item is not None and item[0]() is key else weakref.ref(key, forget)
        items[k] = (ref, value)


# Full-recompute regions whose forward needed no region modes (docs/design.md, "Region
# modes on full checkpoint"): target -> the module's training flag at that call (None for
# a plain callable); _NEEDS_MODES once a forward wrote outside state or ran a collective.
_PLAIN_TARGETS = _WeakIdMap()
# The same for a plain callable given one module among its arguments (a shared helper
# such as run_layer(layer, x)): module -> {callable -> training flag or _NEEDS_MODES}. What
# such a call writes is the module's state: the result is kept per module, not per callable.
_PLAIN_BY_MODULE = _WeakIdMap()
_NEEDS_MODES = object()
# How deep _argument_modules looks into containers and partials among the arguments.
_ARGUMENT_DEPTH = 3


# Argument values that hold no module (not looked into).
_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
           torch.device, slice, type(Ellipsis), type, types.FunctionType,
           types.BuiltinFunctionType, enum.Enum)


def _argument_modules(values, found: dict, depth: int = _ARGUMENT_DEPTH) -> bool:
    """Adds to ``found`` (id -> module) the modules among ``values``: modules, the modules
    of bound methods, and those inside lists, tuples, sets, dicts, partials and objects
    with attributes (dataclasses, namespaces), ``depth`` levels deep. False when something
    could not be looked through (too deep, an iterator): the result is then not kept."""
    for v in values:
        if isinstance(v, nn.Module):
            found[id(v)] = v
        elif isinstance(v, _LEAVES):
            continue
        elif isinstance(getattr(v, "__self__", None), nn.Module):  # m.forward, m.__call__
            found[id(v.__self__)] = v.__self__
        elif depth == 0:
            return False
        elif isinstance(v, dict):
            if not _argument_modules(v.values(), found, depth - 1):
                return False
        elif isinstance(v, (list, tuple, set, frozenset, collections.deque)):
            if not _argument_modules(v, found, depth - 1):
                return False
        elif isinstance(v, functools.partial):
            if not _argument_modules((v.func, *v.args, *v.keywords.values()), found, depth - 1):
                return False
        elif isinstance(v, collections.abc.Iterator):
            return False  # (a generator: looking would consume it)
        elif hasattr(v, "__dict__"):
            if not _argument_modules(list(vars(v).values()), found, depth - 1):
                return False
    return True


def _callable_modules(target, found: dict) -> bool:
    """Adds to ``found`` the modules a plain callable holds: those a partial binds, a
    closure captures, or a callable object (or a bound method's object) has as
    attributes. False when they could not be looked through."""
    if isinstance(target, functools.partial):
        return _argument_modules((target.func, *target.args, *target.keywords.values()), found)
    if isinstance(target, types.FunctionType):
        cells = []
        for cell in target.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        return _argument_modules(cells, found)
    owner = getattr(target, "__self__", None)
    holder = owner if owner is not None and not isinstance(owner, types.ModuleType) else target
    if hasattr(holder, "__dict__") and not isinstance(holder, type):
        return _argument_modules(list(vars(holder).values()), found)
    return True


def _training(module: nn.Module) -> tuple:
    """The training flags of ``module``'s whole tree (a submodule switched alone changes
    what its forward writes as much as the module itself). Walked by identity (torch's
    ``modules()`` hashes them: a module defining ``__eq__`` is unhashable)."""
    flags, stack, seen = [], [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        flags.append(m.training)
        stack.extend(c for c in m._modules.values() if c is not None)
    return tuple(flags)


def _probe_slot(function, args, kwargs):
    """Where a full-recompute region's probe result is kept: ``(table, key, training,
    module)``, or None (not kept: probed at every call). ``training``: the training flags
    of the module tree involved (None without one); a result is used only under the same
    flags. ``module``: that module (None without one).

    The key is the target module, or for a callable the module it involves: a module
    among its arguments (directly, in a container or object, as a bound method) or held
    by the callable itself (a closure's, a partial's, a callable object's, or the module
    of a bound method such as Hugging Face's ``layer.__call__``), kept per (module,
    callable); what the call writes is that module's state (tester, session 18: a helper
    probed with a ``Linear`` then called with a module that updates a buffer ran torch's
    frame alone, its recompute reading the updated buffer and updating it again). With
    several modules, or arguments it cannot look through, nothing is kept."""
    target = function.fn if isinstance(function, LayerCall) else function
    try:
        weakref.ref(target)
    except TypeError:
        return None
    found: dict = {}
    key = target
    if not isinstance(target, nn.Module):
        owner = getattr(target, "__self__", None)
        if isinstance(owner, nn.Module):
            # a new bound-method object at every access: kept per function
            found[id(owner)] = owner
            key = target.__func__
        elif not _callable_modules(target, found):
            return None
    if not _argument_modules(args, found) or (
            kwargs and not _argument_modules(kwargs.values(), found)):
        return None
    if isinstance(target, nn.Module):
        found.pop(id(target), None)
        return (_PLAIN_TARGETS, target, _training(target), target) if not found else None
    if not found:
        return _PLAIN_TARGETS, key, None, None
    if len(found) > 1:
        return None
    (module,) = found.values()
    table = _PLAIN_BY_MODULE.get(module)
    if table is None:
        table = _WeakIdMap()
        _PLAIN_BY_MODULE[module] = table
    return table, key, _training(module), module


class _Plain:
    """What the probe learned of a target that needed no region modes: the training flags
    it was probed under, getters of the tensors from outside the region that its forward
    read (the module's parameters and buffers by their slot, closures' tensors by a weak
    reference; not the call's arguments), and of its module's buffers (state a later call
    may start writing): each getter returns the tensor or None (see ``_learn``)."""

    __slots__ = ("training", "reads", "buffers")

    def __init__(self, training, reads, buffers) -> None:
        self.training = training
        self.reads = reads
        self.buffers = buffers


def _plain_learned(slot):
    """The :class:`_Plain` the probe learned for the target under these training flags, or
    None."""
    table, key, training, _ = slot
    learned = table.get(key)
    return learned if isinstance(learned, _Plain) and learned.training == training else None


def _learn(table, key, training, arg_ids, module, needed: bool, reads=()) -> None:
    """Records the probe's result (called after its forward): ``reads``, the outside
    tensors its forward read, and the buffers of ``module`` (the module the call involves,
    or None; state a later call may start writing) are what a plain call guards
    (_PlainGuard); ``arg_ids``: the call's argument tensors, left out. A parameter or buffer is kept as its slot in the module
    (the tensor the module holds at each later call is the one guarded: a buffer replaced
    between calls, ``m.scale = m.scale * 1.0``, is checked too; tester, session 19), any
    other tensor by a weak reference."""
    if needed:
        table[key] = _NEEDS_MODES
        return
    slots, buffers = _state_slots(module)
    read = [t for t in reads if id(t) not in arg_ids]
    seen = {id(t) for t in read}
    table[key] = _Plain(training,
                        tuple(slots.get(id(t)) or weakref.ref(t) for t in read),
                        tuple(slots[id(b)] for b in buffers
                              if id(b) not in seen and id(b) not in arg_ids))


def _state_slots(module) -> tuple:
    """``({id(tensor): getter}, buffers)`` for ``module`` (the module a region's call
    involves: _probe_slot): for each parameter and buffer of its tree a getter of what its
    slot holds (``dict.get`` on the module's own dict), and the buffers; empty for
    None."""
    if not isinstance(module, nn.Module):
        return {}, []
    slots, buffers = {}, []
    for m in module.modules():
        for entries in (m._parameters, m._buffers):
            for name, t in entries.items():
                if isinstance(t, torch.Tensor) and id(t) not in slots:
                    slots[id(t)] = functools.partial(entries.get, name)
        buffers.extend(t for t in m._buffers.values() if isinstance(t, torch.Tensor))
    return slots, buffers


class _PlainGuard:
    """The checks a region with no region modes keeps (torch's frame alone, docs/design.md
    "Region modes on full checkpoint"): the tensors its probe found it reads from outside
    must hold at the recompute the version they had when the forward ended, as in the
    region modes (otherwise the recompute reads another value: gradients silently wrong;
    tester, session 19); and a forward that writes one of them or one of its module's
    buffers (state the probe's call did not write: an update turned on later) makes the
    target probed again, while this call's recompute puts back what it writes again (the
    value and version the tensor had when the recompute started).
    ``contexts(forward_ctx, recompute_ctx)`` wraps the invocation's recompute-state pair
    (one object per call; no ExitStack: this runs at every call of a plain region)."""

    __slots__ = ("_plain", "_slot", "_function", "_tensors", "_reads", "_versions",
                 "_written", "_restore")

    def __init__(self, plain: _Plain, slot, function) -> None:
        self._plain, self._slot, self._function = plain, slot, function
        self._tensors: list = []   # reads (the first `_reads`), then buffers
        self._reads = 0
        self._versions: list = []
        self._written: list = []   # the tensors the forward wrote
        self._restore: list = []

    def contexts(self, forward, recompute):
        return (_Guarded(forward, self.begin_forward, self.end_forward),
                _Guarded(recompute, self.begin_recompute, self.end_recompute))

    def begin_forward(self) -> None:
        plain = self._plain
        reads = [t for t in (r() for r in plain.reads) if t is not None]
        self._reads = len(reads)
        self._tensors = reads + [t for t in (r() for r in plain.buffers) if t is not None]
        self._versions = [t._version for t in self._tensors]

    def end_forward(self, ok: bool) -> None:
        after = [t._version for t in self._tensors]
        state = _recompute_state.get_recompute_state()
        if ok and state is not None and state.reassigned:
            # a buffer replaced by this forward (_ForwardModuleState): probed again
            table, key, _, _ = self._slot
            table[key] = _NEEDS_MODES
        if ok and after != self._versions:
            table, key, _, _ = self._slot
            table[key] = _NEEDS_MODES  # (the next call runs the region modes)
            self._written = [t for t, v, w in zip(self._tensors, after, self._versions)
                             if v != w]
        self._versions = after

    def begin_recompute(self) -> None:
        # (only what the forward read: a buffer it never read may change meanwhile)
        for t, v in zip(self._tensors[:self._reads], self._versions):
            if t._version != v:
                name = tensor_name(t, _describer(self._function, self._slot[3]))
                raise RuntimeError(modified_message(name, t, "the recompute", v))
        self._restore = [(t, t.detach().clone(), t._version) for t in self._written]

    def end_recompute(self, ok: bool = True) -> None:
        restore, self._restore = self._restore, []
        if restore:
            with torch.no_grad():
                for t, value, _ in restore:
                    t.copy_(value)
            _set_versions([t for t, _, _ in restore], [v for _, _, v in restore])


class _Guarded:
    """``inner`` (a context manager) with ``begin()`` called after its entry and
    ``end(ok)`` before its exit (``ok``: no exception); re-enterable as ``inner`` is."""

    __slots__ = ("_inner", "_begin", "_end")

    def __init__(self, inner, begin, end) -> None:
        self._inner, self._begin, self._end = inner, begin, end

    def __enter__(self):
        self._inner.__enter__()
        try:
            self._begin()
        except BaseException:
            self._inner.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._end(exc_type is None)
        finally:
            return self._inner.__exit__(exc_type, exc, tb)


def checkpoint(function, *args, policy_fn=None, swap_inputs=False, context_fn=None,
               group_swap=False, use_reentrant=None, preserve_rng_state=True,
               determinism_check=_DEFAULT_DETERMINISM, debug=False, early_stop=True,
               allow_cache_entry_mutation=False, cpu_pool=None, **kwargs):
    """Runs ``function(*args, **kwargs)`` as a checkpoint region (non-reentrant).

    The tensors ``function`` saves for backward are not kept: backward runs it again
    (with the forward's RNG and autocast state) to rebuild them. With ``policy_fn``,
    chosen op outputs are kept (``MUST_SAVE``/``PREFER_SAVE``) or offloaded to host
    memory and reloaded for backward (``MUST_SWAP``) instead, and those ops are not run
    again. The region is also a swap layer: when ``function`` is a module registered with
    ``SwapManager().set_forward_prefetch_layer`` (or a :func:`checkpoint_wrapper` of one),
    its swapped tensors follow the prefetch schedule.

    Where torch.utils.checkpoint recomputes from changed state, this one does not
    (docs/design.md, "Recompute and state outside the region"):

    * tensors from outside the region that its forward writes (BatchNorm's running
      statistics, a quantization scale history) are read in recompute as forward read
      them, and recompute never writes them again;
    * a tensor from outside the region written after the forward read it (and not by the
      forward) makes the recompute raise instead of computing different gradients;
    * outputs of collective ops (functional collectives, ``torch.distributed``'s c10d ops)
      are kept from the forward, so recompute issues no collective (whose order across
      ranks would follow each rank's backward); a policy returning ``MUST_RECOMPUTE`` for
      a collective overrides this, and every rank must then recompute in the same order;
    * autocast's cast of a weight another region already cast is run again in recompute
      without disturbing a per-op policy.

    Args:
        function: an ``nn.Module`` or callable.
            A ``mindspore.nn.Cell``, or a function called with MindSpore tensors,
            runs on the MindSpore backend (PyNative mode; op names in policies are
            MindSpore's, e.g. ``"MatMul"``; docs/design.md, "Backends").
        *args, **kwargs: passed to ``function``; tensors may be given either way.
        policy_fn: what to do with each ATen op's output inside the region:

            * ``None``: recompute everything (full checkpoint);
            * a callable ``policy_fn(ctx, op, *args, **kwargs)`` returning a
              :class:`CheckpointPolicy`, a ``torch.utils.checkpoint.CheckpointPolicy``
              (its ``*_CPU_OFFLOAD`` values mean ``MUST_SWAP``) or a bool (``True`` =
              ``MUST_SAVE``, ``False`` = ``PREFER_RECOMPUTE``). ``ctx.is_recompute``
              tells forward from recompute (the forward decision is replayed), and
              ``ctx.op_output`` is the op's output in forward. ``op`` is torch's own
              ``OpOverload``, exactly as torch's selective checkpoint passes it:
              ``op is torch.ops.aten.mm.default``, ``op in {...}``,
              ``op.overloadpacket``; ``str(op)`` gives ``"aten.mm.default"`` and
              ``op.name()`` torch's schema name ``"aten::mm"``;
            * a list (tuple, set) of ops: ``MUST_SAVE`` for those, ``PREFER_RECOMPUTE``
              for the rest. An op is an ``OpOverload`` (``torch.ops.aten.mm.default``),
              an ``OpOverloadPacket`` (``torch.ops.aten.mm``: every overload) or a name
              (``"aten.mm.default"`` or ``"aten::mm.default"``, ``"aten.mm"`` or
              ``"aten::mm"``);
            * a dict op -> policy, ops as in a list; the key ``"*"`` sets the policy of
              ops not listed (default ``PREFER_RECOMPUTE``).

            Lists and dicts are evaluated in C++ with no Python call per op. Ops that
            write their arguments, return views, or draw random numbers are always
            replayed, whatever the policy (caching them would be wrong or useless).
        swap_inputs: also swap the inputs the region keeps for its recompute.
        context_fn: returns ``(forward_ctx, recompute_ctx)`` context managers entered
            around the region's forward and its recompute, as in torch; they compose
            with ours (the user's contexts outside). ``context_fn`` must return a tuple of
            two context managers (else ``TypeError``).
        group_swap: fuse the region's small swapped tensors into few large copies.
        use_reentrant: ``None`` or ``False`` (default): our non-reentrant region.
            ``True`` delegates to torch's reentrant checkpoint (lower host overhead per
            region: no saved-tensor hooks, no dispatch modes), which only works without
            the options that need the non-reentrant frame (``policy_fn``, ``context_fn``,
            ``swap_inputs``, ``group_swap``, ``allow_cache_entry_mutation``, ``debug``,
            ``early_stop=False``, ``determinism_check``; ``ValueError`` otherwise). A
            reentrant region is no swap layer, keeps no external state or collectives
            from its forward (torch's semantics), and is not seen by scheduled
            recompute. A module that holds ``checkpoint_exclude_wrapper`` regions runs
            the non-reentrant region instead (torch's reentrant backward would run them
            twice; a warning says so once); an exclusion reached inside a reentrant
            plain-function body raises ``CheckpointError`` before it runs. Prefer
            ``use_reentrant=False``: torch recommends it too.
        preserve_rng_state, determinism_check, debug, early_stop: torch.utils.checkpoint's
            own options, passed to its frame: ``preserve_rng_state=False`` does not replay
            the forward's RNG state in recompute; ``determinism_check`` is ``"default"``
            (recomputed tensors must match the saved ones in shape, dtype and device) or
            ``"none"``; ``debug=True`` adds traces of the forward and recomputed ops to
            recompute errors (not with ``policy_fn`` or ``context_fn``; a debug region
            runs torch's frame alone, without the corrections above); ``early_stop=False``
            recomputes the whole function instead of stopping once every saved tensor is
            rebuilt (torch's ``set_checkpoint_early_stop`` overrides it, as in torch).
        cpu_pool: a :class:`PinnedMemoryPool` whose capped host memory holds this
            region's swapped tensors (``swap_inputs``, ``MUST_SWAP`` outputs); ``None``
            uses the engine's pool.
        allow_cache_entry_mutation: torch's option of the same name: ``True`` hands back
            a cached op output that was modified in place after the region's forward
            instead of raising. Outputs modified later in the region's *own* forward are
            recomputed with the in-place ops either way (torch raises for them by default,
            and with ``True`` gives the modified value, which is wrong).

            As in torch, these option names are checkpoint's own: ``function`` cannot
            receive keyword arguments with these names, or with ``policy_fn``,
            ``swap_inputs``, ``context_fn``, ``group_swap``, ``cpu_pool`` (bind them with
            ``functools.partial`` instead). Flags must be bools (``1`` is refused).

    Returns:
        What ``function`` returns (tensors nested in tuples, lists, dicts or dataclasses
        keep their gradients).

    Raises:
        ValueError: for an invalid ``policy_fn`` entry, or (during forward) a policy
            result that is not a policy (the message names the op and the value); for
            ``use_reentrant=True`` with an option that needs the non-reentrant frame, an
            unknown ``determinism_check``, or ``debug=True`` with ``policy_fn`` or
            ``context_fn``.
        TypeError: when ``policy_fn`` or ``context_fn`` has the wrong type, a flag is not
            a bool, or ``context_fn`` returns something other than two context managers.
        RuntimeError: in backward, when a cached op output was modified in place after
            the region's forward, a tensor from outside the region was modified after
            the forward read it, or the recompute runs different ops than the forward.

    Notes:
        * A cached output modified in place later in the same region's forward is
          recomputed instead (with a warning for ``MUST_SAVE``/``MUST_SWAP``): replaying
          the op and the writes after it rebuilds the right value.
        * Cached outputs are released as backward consumes them; a backward with
          ``retain_graph=True`` keeps them for the next backward.
        * Regions nest (also inside ``torch.utils.checkpoint``): an inner region is a
          checkpoint again when the outer one is recomputed.
        * Without grad (``torch.no_grad``, inference) ``function`` simply runs.

    Example::

        >>> def policy(ctx, op, *args, **kwargs):
        ...     if op in {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}:
        ...         return CheckpointPolicy.MUST_SAVE
        ...     return CheckpointPolicy.PREFER_RECOMPUTE
        >>> y = checkpoint(block, x, policy_fn=policy)
        >>> y = checkpoint(block, x, policy_fn=[torch.ops.aten.mm, torch.ops.aten.addmm])
    """
    check_callable("checkpoint", function)
    if _compile.is_compiling():
        # Traced by dynamo: torch's compiled checkpoint, our policy as its contexts.
        if use_reentrant:
            raise ValueError(
                "hyper_parallel: a checkpoint region traced by torch.compile is always "
                "non-reentrant (torch's compiled checkpoint); use_reentrant=True is not "
                "supported there. Pass use_reentrant=False, or compile the block inside "
                "the checkpoint instead.")
        _torch_options(use_reentrant, preserve_rng_state, determinism_check, debug,
                       early_stop, policy_fn is not None or context_fn is not None)
        if _holds_exclusions(function):
            _compile.warn_exclusions_not_compiled()
        return _compile.checkpoint(
            function, args, kwargs, policy_fn, context_fn, swap_inputs, group_swap,
            preserve_rng_state, determinism_check)
    backend = backend_for(function, args=args, kwargs=kwargs)
    if backend is not None:  # a MindSpore Cell or tensors (docs/design.md, "Backends")
        return backend.checkpoint(function, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                                  context_fn=context_fn, group_swap=group_swap,
                                  use_reentrant=use_reentrant,
                                  preserve_rng_state=preserve_rng_state,
                                  determinism_check=determinism_check, debug=debug, **kwargs)
    SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP on first use
    policy = compile_policy(policy_fn)
    if context_fn is not None and not callable(context_fn):
        raise TypeError("hyper_parallel: context_fn must be a callable returning "
                        f"(forward_ctx, recompute_ctx); got {type(context_fn).__name__}")
    ckpt_kwargs = _torch_options(use_reentrant, preserve_rng_state, determinism_check, debug,
                                 early_stop, policy is not None or context_fn is not None)
    for name, value in (("swap_inputs", swap_inputs), ("group_swap", group_swap),
                        ("allow_cache_entry_mutation", allow_cache_entry_mutation)):
        check_bool(name, value)
    pool = native_pool(cpu_pool)
    if use_reentrant:
        _refuse_reentrant([name for name, used in (
            ("swap_inputs", swap_inputs), ("group_swap", group_swap), ("cpu_pool", pool),
            ("allow_cache_entry_mutation", allow_cache_entry_mutation)) if used])
    if use_reentrant and _holds_exclusions(function):
        # torch's reentrant frame would run the exclusions twice (its backward replays the
        # whole body); ours runs them once with the same gradients.
        _warn_reentrant_fallback(function)
        use_reentrant = False
        ckpt_kwargs = _torch_options(False, preserve_rng_state, determinism_check, debug,
                                     early_stop, policy is not None or context_fn is not None)
    if not torch.is_grad_enabled() or in_func_transform():
        # Inference: nothing is saved for backward (torch's frame does the same). Inside a
        # torch.func transform, which supports no saved-tensor hooks: plainly (warns once).
        return function(*args, **kwargs)
    if use_reentrant:
        # torch's reentrant frame alone: it saves nothing inside the region (the forward
        # runs without grad), so no swap group or region mode has anything to do.
        call, call_args = _region_call(function, args, kwargs)
        return torch_checkpoint.checkpoint(reentrant_call(call), *call_args, **ckpt_kwargs)
    slot = _probe_slot(function, args, kwargs) if policy is None else None
    report = None
    debug_region = debug or _debug_forced()
    if debug_region:
        pass  # torch's debug mode brings its own context_fn: a debug region runs without ours
    elif slot is not None and (plain := _plain_learned(slot)) is not None:
        # A full-recompute region whose forward wrote no outside state and ran no
        # collective when it was probed (in this training mode): torch's frame alone.
        # Only the invocation's recompute state (is_recomputing(), exclusion regions,
        # recompute handles) and the versions of what it reads from outside
        # (_PlainGuard): plain context managers, no dispatch mode.
        guard = _PlainGuard(plain, slot, function).contexts if plain.reads or plain.buffers \
            else None
        ckpt_kwargs["context_fn"] = state_context_fn(context_fn, guard)
    else:
        report = functools.partial(_learn, *slot[:3], _argument_ids(args, kwargs),
                                   slot[3]) if slot is not None else None
        ckpt_kwargs["context_fn"] = region_context_fn(policy, context_fn,
                                                      allow_cache_entry_mutation,
                                                      _describer(function, slot and slot[3]),
                                                      report)
    call, call_args = _region_call(function, args, kwargs)
    if debug_region:
        call = debug_call(call)  # exclusion regions inside warn that they run again
    if in_backward():
        # A region nested in an enclosing region that backward is recomputing: it must be
        # a checkpoint again, so that the enclosing frame sees the same saved tensors as
        # in its forward (torch's nesting rules), but it starts no swap group: the swap
        # schedule belongs to forward (MUST_SWAP outputs are kept on device here).
        return torch_checkpoint.checkpoint(call, *call_args, **ckpt_kwargs)
    _meter_nested_inputs(call_args)
    # Parameters are never packed (eligibility) and buffers are never region inputs or op
    # outputs, so a checkpoint region needs no exclusion list (a per-call module walk).
    node, name, _ = resolve_layer(function)
    if node is None and not swap_inputs and _C.current_group() is None:
        if policy is None or not policy.may_swap:
            # Nothing here can join a swap group or the schedule: torch's frame alone.
            return torch_checkpoint.checkpoint(call, *call_args, **ckpt_kwargs)
        if policy.fn is not None and not debug_region:
            # A callable policy may return MUST_SWAP, but most never do: the region mode
            # opens the swap region at the first MUST_SWAP (docs/design.md, "Selective
            # checkpoint"), so a policy that never swaps costs no group or hook.
            opened = []
            ckpt_kwargs["context_fn"] = region_context_fn(
                policy, context_fn, allow_cache_entry_mutation,
                _describer(function, slot and slot[3]), report,
                region_args=dict(name=name, group_swap=group_swap, cpu_pool=pool,
                                 quiet=getattr(function, "_hp_unschedulable", False)),
                on_region=opened.append)
            out = torch_checkpoint.checkpoint(call, *call_args, **ckpt_kwargs)
            for region in opened:
                region.attach_backward(out)
            return out
    # Inside the forward of an enclosing checkpoint, Region pushes no hooks of ours: this
    # region's inputs must reach the enclosing frame's saved-tensor hook (it recomputes them).
    pack_mode = SWAP_ALL if swap_inputs else REGISTERED_ONLY
    region = Region(node.layer_id if node is not None else -1, name, pack_mode, None,
                    group_swap, cpu_pool=pool,
                    quiet=getattr(function, "_hp_unschedulable", False))
    with region:
        out = torch_checkpoint.checkpoint(call, *call_args, **ckpt_kwargs)
    region.attach_backward(out)
    return out


def checkpoint_sequential(functions, segments, input, use_reentrant=None, **kwargs):
    """Runs ``functions`` one after another, all but the last segment as checkpoint regions
    (torch.utils.checkpoint.checkpoint_sequential's contract, on :func:`checkpoint`).

    Args:
        functions: an ``nn.Sequential`` or a list of modules / callables, run in order,
            each on the previous one's output.
        segments: how many segments to split them into (``len(functions) // segments``
            functions each; the last segment takes the rest and runs without checkpoint,
            as in torch, since its backward comes first).
        input: the first function's input.
        use_reentrant: as in :func:`checkpoint` (``True``: torch's reentrant frame).
        **kwargs: :func:`checkpoint`'s options (``preserve_rng_state``, ``policy_fn``,
            ``swap_inputs``, ...), applied to every segment. The segments are made on every
            call, so no prefetch chain can name them: what they swap (``swap_inputs``,
            ``MUST_SWAP``) is reloaded when each segment's backward starts, without overlap
            (wrap the layers and chain them, or use ``apply_activation_memory``, for that).

    Returns:
        The last function's output.

    Raises:
        TypeError: for an option :func:`checkpoint` does not have, ``functions`` that are
            not a sequence of callables, or a ``segments`` that is not a positive int;
            ValueError/TypeError for bad option values (as :func:`checkpoint`).
    """
    unknown = sorted(set(kwargs) - set(_CHECKPOINT_OPTIONS))
    if unknown:
        raise TypeError(f"hyper_parallel: checkpoint_sequential got unknown options {unknown}; "
                        f"it accepts {list(_CHECKPOINT_OPTIONS)} (those of checkpoint()).")
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise TypeError(f"hyper_parallel: checkpoint_sequential segments must be a positive "
                        f"int; got {segments!r}.")
    options = _prepare_kwargs({**kwargs, "use_reentrant": use_reentrant})
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    try:
        functions = list(functions)
    except TypeError:
        raise TypeError(f"hyper_parallel: checkpoint_sequential's functions must be an "
                        f"nn.Sequential or a list of modules / callables; got "
                        f"{type(functions).__name__}.") from None
    bad = [i for i, f in enumerate(functions) if not callable(f)]
    if bad:
        raise TypeError(f"hyper_parallel: checkpoint_sequential's functions must all be "
                        f"callable; item {bad[0]} is a {type(functions[bad[0]]).__name__}.")
    if segments > len(functions):
        raise ValueError(f"hyper_parallel: checkpoint_sequential got segments={segments} for "
                         f"{len(functions)} functions; each segment needs at least one, so "
                         f"give segments between 1 and {max(len(functions), 1)}.")
    size = len(functions) // segments

    def run(part):
        def forward(x):
            for fn in part:
                x = fn(x)
            return x
        # A segment is a new function on every call: no chain can name it, so its swapped
        # tensors (swap_inputs, MUST_SWAP) reload when its backward starts, and the region
        # does not ask for a chain it cannot get. Its modules' parameters and buffers are
        # put back for its recompute as a module's are (_ForwardModuleState).
        forward._hp_unschedulable = True
        forward._hp_state_modules = [fn for fn in part if isinstance(fn, nn.Module)]
        return forward

    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        input = checkpoint(run(functions[start:end]), input, **options)
    return run(functions[end:])(input)


class CheckpointWrapper(ActivationWrapper):
    """Every call of the wrapped module is a :func:`checkpoint` call (see
    :func:`checkpoint_wrapper`)."""

    _hp_kind = "checkpoint_wrapper"

    def __init__(self, module: nn.Module, **checkpoint_kwargs) -> None:
        super().__init__(module)
        self._hp_checkpoint_kwargs = _prepare_kwargs(checkpoint_kwargs)
        self._hp_compile_kwargs = _compile_kwargs(self._hp_checkpoint_kwargs)

    @property
    def checkpoint_kwargs(self) -> dict:
        """The options of every call (a copy; a list or dict ``policy_fn`` is given back
        compiled)."""
        return dict(self._hp_checkpoint_kwargs)

    def forward(self, *args, **kwargs):
        inner = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled() or in_func_transform():
            return inner(*args, **kwargs)
        if _compile.is_compiling():
            if _holds_exclusions(inner):
                _compile.warn_exclusions_not_compiled()
            return _compile.checkpoint(inner, args, kwargs, **self._hp_compile_kwargs)
        if in_backward():
            return checkpoint(LayerCall(self, inner, inner), *args,
                              **self._hp_checkpoint_kwargs, **kwargs)
        return self._hp_call(checkpoint, LayerCall(self, inner, inner), *args,
                             **self._hp_checkpoint_kwargs, **kwargs)


_CHECKPOINT_OPTIONS = ("policy_fn", "swap_inputs", "context_fn", "group_swap", "use_reentrant",
                       "preserve_rng_state", "determinism_check", "debug", "early_stop",
                       "allow_cache_entry_mutation", "cpu_pool")


def _prepare_kwargs(checkpoint_kwargs: dict) -> dict:
    unknown = sorted(set(checkpoint_kwargs) - set(_CHECKPOINT_OPTIONS))
    if unknown:
        raise TypeError(f"hyper_parallel: checkpoint_wrapper got unknown options {unknown}; "
                        f"it accepts {list(_CHECKPOINT_OPTIONS)} (those of checkpoint()).")
    out = dict(checkpoint_kwargs)
    _torch_options(out.get("use_reentrant"), out.get("preserve_rng_state", True),
                   out.get("determinism_check", _DEFAULT_DETERMINISM), out.get("debug", False),
                   out.get("early_stop", True),
                   out.get("policy_fn") is not None or out.get("context_fn") is not None,
                   at_call=False)
    for name in ("swap_inputs", "group_swap", "allow_cache_entry_mutation"):
        check_bool(name, out.get(name, False))
    native_pool(out.get("cpu_pool"))  # type-checked once
    if out.get("use_reentrant"):
        _refuse_reentrant([name for name in ("swap_inputs", "group_swap", "cpu_pool",
                                             "allow_cache_entry_mutation") if out.get(name)])
    if out.get("policy_fn") is not None:
        out["policy_fn"] = compile_policy(out["policy_fn"])  # validated once
    return out


def _compile_kwargs(kwargs: dict) -> dict:
    """The options of :func:`_compile.checkpoint` (a region traced by dynamo)."""
    out = {k: kwargs[k] for k in ("policy_fn", "context_fn", "swap_inputs", "group_swap",
                                  "preserve_rng_state", "determinism_check") if k in kwargs}
    if out.get("policy_fn") is not None:
        out["policy_fn"] = _compile.canonical_policy(out["policy_fn"])
    return out


def checkpoint_wrapper(module_or_fn, **checkpoint_kwargs):
    """Wraps a module or callable so that every call is ``checkpoint(..., **checkpoint_kwargs)``.

    Args:
        module_or_fn: an ``nn.Module`` (returns a transparent wrapper module: its
            ``state_dict()`` keys, ``named_parameters()``, attributes and indexing are the
            wrapped module's, and state dicts load across wrapped and unwrapped models) or
            a callable (returns a function called the same way). A ``mindspore.nn.Cell``
            gets a MindSpore wrapper Cell; in MindSpore graph mode, without options,
            ``cell.recompute()`` is called and the cell itself returned.
        **checkpoint_kwargs: ``policy_fn``, ``swap_inputs``, ``context_fn``,
            ``group_swap``, ``use_reentrant``, ``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``,
            ``allow_cache_entry_mutation``, ``cpu_pool``, as in :func:`checkpoint`. They are
            validated here, once (a list or dict ``policy_fn`` is also compiled here).

    Returns:
        The wrapper.

    Raises:
        ValueError: when ``module_or_fn`` is already wrapped by hyper_parallel (wrap each
            module once), for an invalid ``policy_fn`` entry, or for an invalid option
            value (as in :func:`checkpoint`).
        TypeError: when it is neither a module nor callable, or for an unknown option.
    """
    other = wrapper_dispatch(module_or_fn, "checkpoint_wrapper", checkpoint_kwargs,
                             checkpoint_wrapper)
    if other is not None:  # a MindSpore Cell, or a function (docs/design.md, "Backends")
        return other
    kwargs = _prepare_kwargs(checkpoint_kwargs)
    if isinstance(module_or_fn, nn.Module):
        return CheckpointWrapper(module_or_fn, **kwargs)
    if not callable(module_or_fn):
        raise TypeError(f"hyper_parallel: checkpoint_wrapper expects an nn.Module or a callable, "
                        f"got {type(module_or_fn).__name__}")
    _refuse_double_wrap(module_or_fn)

    @functools.wraps(module_or_fn)
    def wrapped(*args, **call_kwargs):
        return checkpoint(target, *args, **kwargs, **call_kwargs)

    target = LayerCall(wrapped, module_or_fn)
    wrapped._hp_wrapped_fn = module_or_fn
    wrapped.checkpoint_kwargs = dict(kwargs)
    wrapped.policy_fn = kwargs.get("policy_fn")
    wrapped.group_swap = kwargs.get("group_swap", False)
    return wrapped
