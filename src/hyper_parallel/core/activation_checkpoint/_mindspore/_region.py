"""Regions on MindSpore: one layer invocation, its saved-tensor hooks and its schedule.

The MindSpore counterpart of ``../_region.py`` (docs/design.md, "Backends"). A region
starts a swap group in the C++ engine (``_C.begin_forward``): the same ``SwapGroup`` and
``Schedule`` objects as torch regions, so layer ids, chain links, invocation links
(micro-batches, repeated calls) and the thread-local current group are shared. The
group holds no C++ records; this region's MindSpore records live in an :class:`MsGroup`
beside it. The schedule decides, the region moves the data:

* end of forward: ``_C.end_forward`` marks the group released (a layer with a successor,
  or an unscheduled one) or not (the last layer of a chain); a released group offloads
  its records whose every holder is released. Records of tensors that are the region's
  outputs are deferred to the next release point (the next layer reads them);
* start of backward: a hook on the outputs (``Tensor.register_hook``: it fires when the
  gradient of an output is computed, before the layer's own backward) asks
  ``_C.prefetch_targets`` which invocations to reload: this one (if a hole left it on the
  host) and ``prefetch_depth`` predecessors;
* unpack: a record still on the host is reloaded on demand (``on_demand_reloads``).

If the forward raises, the group is aborted and the hooks are popped (SPEC 4.6).
"""

from __future__ import annotations

import threading
import weakref

import mindspore as ms
from mindspore import Tensor
from mindspore.common.api import _pynative_executor

from hyper_parallel._extension import _C

from .._policy import CheckpointPolicy, to_policy
from . import _meter
from ._records import STORE
from .._warnings import warn as warn_user

SWAP_ALL = "swap_all"                # every eligible saved tensor (swap, swap_inputs)
REGISTERED_ONLY = "registered_only"  # registered tensors only (chains, checkpoint regions)

_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # C++ group id -> MsGroup
_deferred: list = []  # weakrefs to records kept on device because a region returned them
_deferred_lock = threading.Lock()
_warned_unscheduled: set[str] = set()


def in_backward() -> bool:
    """True while MindSpore runs a backward on this thread (e.g. a recompute)."""
    return _pynative_executor.get_current_autodiff_engine_id() != -1


def grad_enabled() -> bool:
    return bool(_pynative_executor.enable_grad())


class MsGroup:
    """The MindSpore records of one invocation, beside its C++ ``SwapGroup``."""

    __slots__ = ("cgroup", "records", "excluded", "registered", "__weakref__")

    def __init__(self, cgroup) -> None:
        self.cgroup = cgroup
        self.records: list = []
        self.excluded: set[int] = set()   # data pointers never swapped (cell parameters)
        self.registered: set[tuple] = set()
        _groups[cgroup.id] = self

    @property
    def released(self) -> bool:
        return self.cgroup.released

    def add(self, record) -> None:
        if all(r is not record for r in self.records):
            self.records.append(record)

    def release(self, keep: set) -> None:
        for record in self.records:
            if record.key in keep:
                with _deferred_lock:
                    _deferred.append(weakref.ref(record))
            else:
                STORE.offload(record)

    def prefetch(self) -> None:
        for record in self.records:
            STORE.reload(record)


def group_of(cgroup) -> MsGroup | None:
    return None if cgroup is None else _groups.get(cgroup.id)


def current_group() -> MsGroup | None:
    return group_of(_C.current_group())


def retry_deferred() -> None:
    """Offloads deferred records whose holders are all released (a release point)."""
    with _deferred_lock:
        pending, _deferred[:] = list(_deferred), []
    for ref in pending:
        record = ref()
        if record is not None:
            STORE.offload(record)


class Swapped:
    """What the pack hook returns for a swapped tensor: the record and its group (the
    group lives as long as some saved tensor needs it)."""

    __slots__ = ("record", "group")

    def __init__(self, record, group) -> None:
        self.record = record
        self.group = group


def unpack(packed):
    if isinstance(packed, Swapped):
        return STORE.get(packed.record)
    if isinstance(packed, _meter.Kept):
        return packed.tensor
    return packed


def keep(tensor):
    """A saved tensor passed through (counted by an active meter)."""
    token = _meter.hold_tensor(tensor)
    return tensor if token is None else _meter.Kept(tensor, token)


def _swap_policy(policy_fn, tensor) -> bool:
    result = policy_fn(tensor)
    policy = to_policy(result, what="the swap policy_fn") if not isinstance(
        result, CheckpointPolicy) else result
    if policy not in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP):
        raise ValueError(
            f"hyper_parallel: the swap policy_fn returned {result!r} for a saved tensor of "
            f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}; a swap policy must return "
            "CheckpointPolicy.MUST_SAVE (keep on device) or CheckpointPolicy.MUST_SWAP "
            "(offload).")
    return policy == CheckpointPolicy.MUST_SWAP


def make_pack(group: MsGroup, mode: str, policy_fn=None):
    def pack(tensor):
        if isinstance(tensor, ms.Parameter) or tensor.data_ptr() in group.excluded:
            return keep(tensor)
        if mode == REGISTERED_ONLY and STORE.key_of(tensor) not in group.registered:
            return keep(tensor)
        if mode == SWAP_ALL and policy_fn is not None and not _swap_policy(policy_fn, tensor):
            return keep(tensor)
        record = STORE.record_for(tensor, group)
        if record is None:
            return keep(tensor)
        group.add(record)
        return Swapped(record, group)

    return pack


def register(group: MsGroup, tensor) -> None:
    """swap_tensor_wrapper: ``tensor`` is offloaded and prefetched with ``group``."""
    record = STORE.record_for(tensor, group)
    if record is not None:
        group.registered.add(record.key)
        group.add(record)


class MsRegion:
    """Context manager for one layer invocation on MindSpore (see module doc).

    Args:
        layer_id: the engine's layer id (``-1``: in no schedule).
        name: the group name.
        mode: ``SWAP_ALL``, ``REGISTERED_ONLY`` or ``None`` (push no hooks).
        policy_fn: per-tensor swap policy (``SWAP_ALL``), or ``None``.
        group_swap: accepted for API parity; MindSpore copies are per tensor.
        exclude: tensors never swapped (the cell's parameters).
    """

    __slots__ = ("_layer_id", "_name", "_mode", "_policy_fn", "_group_swap", "_exclude",
                 "group", "_hooks", "_joined")

    def __init__(self, layer_id=-1, name="", mode=None, policy_fn=None, group_swap=False,
                 exclude=()):
        self._layer_id = layer_id
        self._name = name
        self._mode = mode
        self._policy_fn = policy_fn
        self._group_swap = group_swap
        self._exclude = exclude
        self.group = None
        self._hooks = None
        self._joined = False

    def __enter__(self):
        outer = current_group() if self._layer_id < 0 else None
        if outer is not None and outer.cgroup.layer >= 0:
            self.group, self._joined = outer, True  # the enclosing layer's invocation
        else:
            self.group = MsGroup(_C.begin_forward(self._layer_id, self._name, False,
                                                  self._group_swap))
        try:
            self.group.excluded.update(int(t.data_ptr()) for t in self._exclude)
            if self._mode is not None and grad_enabled():
                self._hooks = ms.saved_tensors_hooks(
                    make_pack(self.group, self._mode, self._policy_fn), unpack)
                self._hooks.__enter__()
        except BaseException:
            if not self._joined:
                _C.abort_forward(self.group.cgroup)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(exc_type, exc, tb)
        if self._joined:
            return False
        cgroup = self.group.cgroup
        if exc_type is not None:
            _C.abort_forward(cgroup)
            # An exception out of a forward under autodiff leaves PyNative's graph stack
            # half built (the next backward fails inside MindSpore); MindSpore's own
            # recompute clears it the same way on error.
            _pynative_executor.clear_res()
            return False
        _C.end_forward(cgroup)
        return False

    def finish(self, outputs) -> None:
        """After a successful forward: offloads per the schedule and arms the prefetch.
        ``outputs`` stay on device until the next release point."""
        group = self.group
        if group is None or self._joined:
            return
        leaves = _tensor_leaves(outputs)
        if group.released:
            group.release({STORE.key_of(t) for t in leaves})
            self._warn_unscheduled()
        retry_deferred()
        _meter_sample()
        if group.records or group.cgroup.layer >= 0:
            hook = _BackwardStart(group)
            for t in leaves:
                try:
                    t.register_hook(hook)
                except (RuntimeError, TypeError, ValueError):
                    continue  # an output without gradient

    def _warn_unscheduled(self) -> None:
        if self.group.records and not _C.layer_scheduled(self._layer_id) \
                and self._name not in _warned_unscheduled:
            _warned_unscheduled.add(self._name)
            warn_user(
                f"hyper_parallel: swap region '{self._name}' is not part of a prefetch "
                "schedule, so its activations are offloaded at the end of its forward and "
                "reloaded only when its own backward starts, without overlap. Register the "
                "layer order with SwapManager().set_forward_prefetch_layer(prev_cell, "
                "next_cell).")


def _meter_sample() -> None:
    meter = _meter.active()
    if meter is not None:
        meter.sample()


def _tensor_leaves(outputs) -> list:
    if isinstance(outputs, Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in _tensor_leaves(item)]
    if isinstance(outputs, dict):
        return [t for item in outputs.values() for t in _tensor_leaves(item)]
    return []


class _BackwardStart:
    """Gradient hook on a region's outputs: starts the prefetch once, then lets go of the
    group (so it dies with its last saved tensor)."""

    __slots__ = ("group",)

    def __init__(self, group: MsGroup) -> None:
        self.group = group

    def __call__(self, grad):
        group, self.group = self.group, None
        if group is not None:
            for cgroup in _C.prefetch_targets(group.cgroup):
                target = group_of(cgroup)
                if target is not None:
                    target.prefetch()
        return None
