"""Swapped MindSpore tensors: one record per saved tensor, and the backend's store.

The MindSpore counterparts of ``StorageRecord`` / ``AliasRegistry`` / the copy engine
(docs/design.md, "Backends"). The C++ engine cannot free MindSpore storage in place (a
DLPack view of it is a foreign storage to ATen), so swap works one level up: the
saved-tensor pack hook returns a handle to a :class:`SavedRecord`, and offloading a record
copies its tensor into a host block of the :class:`~._pool.HostPool` and drops the
record's reference to the tensor. Once autograd's saved slot (our handle) is the only
owner, MindSpore frees the device memory. Reloading creates a new tensor of the same
shape and dtype from the block; the unpack hook returns it.

Records are shared: a tensor saved by two layers (a layer's input is the previous
layer's output) is one record held by both groups, copied once, and it leaves the device
only when every live holder group released it (SPEC 3, "When a storage may leave the
device", rule 1). A resident record is found again by (data pointer, shape, strides,
dtype); an offloaded one is not (its device memory may already be reused).

Thread-safety: the store's lock guards the registry, the records' states and the
counters; copies run under it (CPU copies are synchronous and short).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

from . import _meter
from ._copy import host_view, make_copier, numpy_dtype
from ._pool import HostPool

DEVICE = "device"
HOST = "host"


class SavedRecord:
    """One swapped tensor: on the device (``tensor``) or in a host block (``block``)."""

    __slots__ = ("tensor", "block", "nbytes", "shape", "np_dtype", "state", "holders",
                 "event", "pending_src", "key", "token", "__weakref__")

    def __init__(self, tensor, key, np_dtype) -> None:
        self.tensor = tensor
        self.block = None
        self.nbytes = int(tensor.nbytes)
        self.shape = tuple(tensor.shape)
        self.np_dtype = np_dtype
        self.state = DEVICE
        self.holders: list = []  # weakrefs to the groups holding this record
        self.event = None        # the last copy's event (asynchronous copier)
        self.pending_src = None  # a device tensor kept alive until its D2H completed
        self.key = key
        self.token = _meter.hold_tensor(tensor)

    def released_by_all_holders(self) -> bool:
        return all(g is None or g.released for g in (ref() for ref in self.holders))

    def __del__(self) -> None:
        STORE.on_death(self)


class SwapStore:
    """Process-wide state of the MindSpore swap backend: records, pool, copier, counters."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pool = HostPool()
        self._copier = None
        self._resident: dict[tuple, weakref.ref] = {}
        self._dead: collections.deque = collections.deque()  # see on_death
        self.reset_stats()

    @property
    def copier(self):
        if self._copier is None:
            self._copier = make_copier()
        return self._copier

    def reset_stats(self) -> None:
        self.counters = dict(offload_bytes=0, offload_count=0, reload_bytes=0, reload_count=0,
                             resident_bytes=0, peak_resident_bytes=0, on_demand_reloads=0,
                             stall_seconds=0.0)

    # ------------------------------------------------------------------ records
    @staticmethod
    def key_of(tensor) -> tuple:
        return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype))

    def record_for(self, tensor, group) -> SavedRecord | None:
        """The record of ``tensor`` held by ``group`` (created if needed), or ``None`` when
        the tensor cannot be swapped (no numpy dtype, e.g. bfloat16, or empty)."""
        np_dtype = numpy_dtype(tensor.dtype)
        if np_dtype is None or int(tensor.nbytes) == 0:
            return None
        key = self.key_of(tensor)
        with self.lock:
            self._drain_locked()
            ref = self._resident.get(key)
            record = ref() if ref is not None else None
            if record is None:
                record = SavedRecord(tensor, key, np_dtype)
                self._resident[key] = weakref.ref(record)
                self._count_resident(record.nbytes)
            if not any(r() is group for r in record.holders):
                record.holders.append(weakref.ref(group))
        return record

    def _count_resident(self, delta: int) -> None:
        c = self.counters
        c["resident_bytes"] += delta
        c["peak_resident_bytes"] = max(c["peak_resident_bytes"], c["resident_bytes"])

    def on_death(self, record: SavedRecord) -> None:
        """The last handle of ``record`` died (its graph was freed). Runs wherever the
        last reference went, MindSpore's own threads included, so it takes no lock: it
        queues what must be undone, and the next store operation drains it."""
        _meter.drop(record.token)
        self._dead.append((record.state, record.block, record.event, record.key,
                           record.nbytes))

    def _drain_locked(self) -> None:
        """Host blocks of dead records go back to the pool; their device bytes stop
        counting (SPEC 4.6, 4.8)."""
        while self._dead:
            state, block, event, key, nbytes = self._dead.popleft()
            if state == HOST:
                self.pool.release(block, event)
            else:
                self._count_resident(-nbytes)
                ref = self._resident.get(key)
                if ref is not None and ref() is None:
                    del self._resident[key]

    # ------------------------------------------------------------------ moves
    def offload(self, record: SavedRecord) -> None:
        """Device -> host, if every holder released it (SPEC 3). Caller holds no lock."""
        with self.lock:
            self._drain_locked()
            if record.state != DEVICE or not record.released_by_all_holders():
                return
            block = self.pool.acquire(record.nbytes)
            view = host_view(block, record.nbytes, record.np_dtype, record.shape)
            event = self.copier.offload(record.tensor, view)
            if self._resident.get(record.key) is not None:
                del self._resident[record.key]
            if event is not None:
                record.pending_src = record.tensor  # alive until the D2H completed
            record.tensor = None
            record.block, record.event, record.state = block, event, HOST
            _meter.drop(record.token)
            record.token = None
            self._count_resident(-record.nbytes)
            self.counters["offload_bytes"] += record.nbytes
            self.counters["offload_count"] += 1

    def reload(self, record: SavedRecord, on_demand: bool = False) -> None:
        """Host -> device (the prefetch, or an on-demand reload in unpack)."""
        with self.lock:
            if record.state != HOST:
                return
            view = host_view(record.block, record.nbytes, record.np_dtype, record.shape)
            tensor, event = self.copier.reload(view)
            self.pool.release(record.block, event)
            record.block, record.pending_src = None, None
            record.tensor, record.event, record.state = tensor, event, DEVICE
            record.token = _meter.hold_tensor(tensor)
            self._count_resident(record.nbytes)
            self.counters["reload_bytes"] += record.nbytes
            self.counters["reload_count"] += 1
            if on_demand:
                self.counters["on_demand_reloads"] += 1

    def get(self, record: SavedRecord):
        """The record's tensor, on the device, ready for the compute stream (unpack)."""
        if record.state == HOST:
            start = time.perf_counter()
            self.reload(record, on_demand=True)
            self.counters["stall_seconds"] += time.perf_counter() - start
        self.copier.wait(record.event)
        return record.tensor

    def stats(self) -> dict:
        with self.lock:
            self._drain_locked()
            out = dict(self.counters)
            out["pinned_bytes_in_use"] = self.pool.in_use
            out["pinned_bytes_cached"] = self.pool.cached
            return out

    def reset(self) -> None:
        with self.lock:
            self._drain_locked()
            self.reset_stats()
            self.pool.clear()


STORE = SwapStore()
