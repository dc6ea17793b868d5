"""Tensors from outside a checkpoint region: recompute sees the values forward saw.

A checkpoint region's recompute runs its function again in backward. Tensors the region
creates are rebuilt by that run, but tensors it reads from outside (module buffers,
parameters, tensors captured by a closure) are read again as they are *then*. Two faults
follow in torch.utils.checkpoint (docs/design.md, "Recompute and state outside the
region"):

* state the region writes (BatchNorm's running statistics and ``num_batches_tracked``,
  the amax history of delayed-scaling quantization) is written a second time by the
  recompute, and the recompute reads the value forward left, not the one forward read;
* a tensor written outside the region after its forward read it gives the recompute a
  different value, so backward silently computes different gradients.

:class:`ExternalTensors` is the per-invocation record that fixes the first and detects
the second. The region's forward dispatch mode reports every op's inputs and outputs;
a tensor input that no earlier op of the region produced is *external*: its version
counter is noted at the first read (a weak reference, no copy). Right before an op of
the forward writes an external tensor (or a view of one), a copy of its value is kept:
copy on write, so only written state costs memory (BatchNorm: its running statistics).
In recompute, every read of an external tensor that forward wrote is redirected to a
private copy of that value (the recompute's writes go there and are dropped), and every
read of another external tensor checks that its version is still the one forward saw;
otherwise the recompute raises instead of computing from a different value.

Thread-safety: none; one region invocation is used by one thread at a time (forward, then
the autograd engine's recompute).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_Tensor = torch.Tensor
_LOST = object()  # written in forward after another write changed it: value unknown
_UNDECLARED = object()  # written in forward by an op whose schema does not say so
_OVERLAPPED = object()  # changed in forward by a write through another tensor of its storage
_MAX_STEPS = 8  # values kept per external tensor before its writes (_Read.steps)
_MAX_STEP_BYTES = 1 << 20  # and past the first, only for tensors up to this size


class _Read:
    __slots__ = ("ref", "version", "snapshot", "op", "storage", "by_other", "declared", "ops",
                 "settled", "end_version", "writes", "first_read", "last_read",
                 "steps", "ptr")

    def __init__(self, tensor, op: str) -> None:
        self.ref = weakref.ref(tensor)
        self.version = tensor._version
        self.storage = _storage_key(tensor)
        self.ptr = tensor.data_ptr()  # (a cheap test of a storage replaced: _moved)
        # kept for a write through another tensor of its storage (its base, a sibling view)
        self.by_other = False
        self.snapshot = None  # the value forward read, kept before forward's first write
        self.op = op  # the op that read it first
        # written by an op that declares the write (autograd bumps the version), not only by
        # the batch norms' writes of their running statistics, which autograd does not see
        self.declared = False
        # The ops that took it as an argument, in forward order (its accesses), so that the
        # recompute can tell where it follows another path (_follow): accesses from index
        # `settled` on saw the value the forward left (no write of any kind after them).
        self.ops = [op]
        self.settled = 0
        self.writes = 0
        # the index of its first access that read its value (not a view op, not a write of
        # it; through a view the region made of it too), or None
        self.first_read = None
        self.last_read = None  # (and of its last one)
        # per write of the forward, (b, value before it): accesses before index b saw that
        # value (the first always; then at most _MAX_STEPS, for tensors up to
        # _MAX_STEP_BYTES; otherwise _LOST), for _value_at
        self.steps = []
        self.end_version = None  # its version when the forward ended


def _storage_key(t):
    """An identity of ``t``'s storage while it lives (None for a tensor without one)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _same_bits(a, b) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes (NaNs included)."""
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def written_targets(args, kwargs, writes):
    """The arguments an op is about to write: ``writes`` holds schema positions of
    positional arguments and names of kwarg-only ones (``out=``, ``max.dim_max``'s
    ``max=``); those not passed are left out."""
    for i in writes:
        target = kwargs.get(i) if isinstance(i, str) else (args[i] if i < len(args) else None)
        if target is not None:
            yield target


def _is_tensor(x) -> bool:
    return isinstance(x, _Tensor)


def iter_tensors(values):
    """The tensors among ``values`` and one level of lists/tuples inside them (op
    arguments: ``Tensor``, ``Tensor[]``, ``Tensor?[]``)."""
    for v in values:
        if isinstance(v, _Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for u in v:
                if isinstance(u, _Tensor):
                    yield u
                elif isinstance(u, (list, tuple)):  # c10d's Tensor[][]
                    yield from (w for w in u if isinstance(w, _Tensor))


def tensor_name(t, describe=None) -> str:
    """How error messages name a tensor from outside a region: ``describe(t)`` (e.g.
    ``"buffer 'scale' of _Scaled"``) or a generic phrase, with its shape and dtype."""
    name = describe(t) if describe is not None else None
    shape = list(t.shape)
    return (f"{name} (shape {shape}, {t.dtype})" if name
            else f"a tensor from outside the region (shape {shape}, {t.dtype})")


class ExternalTensors:
    """Reads and writes of tensors from outside one checkpoint region invocation.

    Args:
        describe: ``describe(tensor) -> str | None``, a name for a tensor in error
            messages (e.g. ``"buffer 'bn.running_mean'"``), or ``None``.
    """

    __slots__ = ("_reads", "_produced", "_shadows", "_describe", "_by_storage", "_alias_of",
                 "_cursor", "_busy")

    def __init__(self, describe=None) -> None:
        self._reads: dict = {}
        # the reads of each storage: a write looks its storage up instead of scanning
        # every read (reads x writes in a region reading thousands of outside tensors)
        self._by_storage: dict = {}
        # The region's own tensors: id -> weak reference (forward only). Python reuses a
        # dead object's id; an outside tensor made in the forward without an op (a buffer's
        # `.data`) must not be taken for a dead one of the region's (tester, session 20).
        self._produced: dict | None = {}
        # views (and aliases: detach) the region made of an external tensor, directly or
        # through other such views: id -> the external tensor's id
        self._alias_of: dict = {}
        self._shadows: dict = {}
        # recompute, per pass: for each external tensor the forward changed, the index of
        # its next access in the forward's list (`_Read.ops`; see `_follow`)
        self._cursor: dict = {}
        # True while this object copies a tensor itself: the recompute's dispatch mode sees
        # those ops too, and they must read the tensor as it is
        self._busy = False
        self._describe = describe

    # ------------------------------------------------------------------ forward
    def forward_inputs(self, op: str, args, kwargs, writes, declared: bool = True,
                       view: bool = False) -> None:
        """Before an op of the forward runs: notes external inputs, and keeps the value of
        each external tensor that argument positions ``writes`` are about to write.
        ``declared``: the op's schema declares those writes (False for the batch norms'
        running statistics); ``view``: the op returns a view of its first argument (it
        reads no value)."""
        reads, produced = self._reads, self._produced
        if produced is None:
            return
        # Its value is read unless the op is a view op or declares it writes the argument
        # (the batch norms' undeclared writes of their running statistics read them too,
        # and write nothing in eval mode).
        written = () if view or not writes or not declared else {
            id(w) for w in iter_tensors(tuple(written_targets(args, kwargs, writes)))}
        alias_of = self._alias_of
        for t in (itertools.chain(iter_tensors(args), iter_tensors(kwargs.values())) if kwargs
                  else iter_tensors(args)):
            key = id(t)
            read = not view and key not in written
            rec = reads.get(key)
            if rec is not None:
                held = rec.ref()
                if held is None:
                    rec = None  # (a dead record's id, reused: its storage index keeps it)
                elif held is not t:
                    continue
            if rec is not None:
                if t.data_ptr() != rec.ptr:
                    self._moved(rec, t)
                ops = rec.ops
                ops.append(op)
                if read:
                    rec.last_read = len(ops) - 1
                    if rec.first_read is None:
                        rec.first_read = rec.last_read
            elif not self._is_produced(t):
                rec = self._note(key, t, op)
                if read:
                    rec.first_read = rec.last_read = 0
            elif read and alias_of:
                root = alias_of.get(key)
                rec = reads.get(root) if root is not None else None
                if rec is not None:  # (through a view the region made: the next index)
                    rec.last_read = len(rec.ops)
                    if rec.first_read is None:
                        rec.first_read = rec.last_read
        if writes:
            for t in iter_tensors(tuple(written_targets(args, kwargs, writes))):
                self._before_write(t, declared)

    def _is_produced(self, t) -> bool:
        ref = self._produced.get(id(t))
        return ref is not None and ref() is t

    def _note(self, key, t, op: str):
        rec = self._reads[key] = _Read(t, op)
        if rec.storage is not None:
            self._by_storage.setdefault(rec.storage, []).append(rec)
        return rec

    def _moved(self, rec, t) -> None:
        """``t``'s data moved since its last access: its storage was replaced in the
        forward (`p.data = ...`, a lazy module's materialization) or resized in place."""
        rec.ptr = t.data_ptr()
        storage = _storage_key(t)
        if storage == rec.storage:
            return  # (resized in place)
        # No op replaced it: the reads index moves with it (a write, with no value kept from
        # before it; accesses from before it read the tensor as it is in recompute).
        group = self._by_storage.get(rec.storage)
        if group is not None and rec in group:
            group.remove(rec)
        rec.storage = storage
        if storage is not None:
            self._by_storage.setdefault(storage, []).append(rec)
        rec.settled = len(rec.ops)
        rec.writes += 1

    def _before_write(self, t, declared: bool = True) -> None:
        # Every external tensor in the written storage: the one written, its base, other
        # views of that base read elsewhere (`v = buf[:4]` read, `buf[4:]` written; FSDP2's
        # all-gather input, a view of the buffer the collective writes): the value forward
        # read is kept, whatever part the write touches.
        storage = _storage_key(t)
        if storage is None:
            return
        for rec in self._by_storage.get(storage, ()):
            if declared:
                rec.declared = True
            # (accesses from the next one on see the value after this write; the current
            # op's access, when it is one of the tensor's, was noted before)
            rec.settled = len(rec.ops)
            rec.writes += 1
            u = rec.ref()
            if u is not None and _storage_key(u) == storage:
                self._step(rec, u)
            snap = rec.snapshot
            if snap is not None and not isinstance(snap, _Tensor):
                continue
            if u is None or _storage_key(u) != storage:
                continue
            # Through itself, or a view or alias of it the region made (the recompute makes
            # it again from u's copy), the recompute replays the write on u's copy; through
            # another tensor (its base, a view made outside) it does not: end_forward
            # checks the value. Every write counts, not only the first (tester, session
            # 18: a second write through an outside view was lost from the copy).
            other = u is not t and not (
                self._is_produced(t)
                and (t._base is u or self._alias_of.get(id(t)) == id(u)))
            if snap is not None:
                rec.by_other = rec.by_other or other
                continue
            rec.snapshot = rec.steps[0][1] if rec.steps and rec.steps[0][0] == rec.settled \
                and isinstance(rec.steps[0][1], _Tensor) and u._version == rec.version else (
                u.detach().clone() if u._version == rec.version else _LOST)
            rec.by_other = other

    @staticmethod
    def _step(rec, u) -> None:
        """Keeps the value ``u`` holds before a write of the forward (see ``_Read.steps``):
        what the recompute's access of it reads where it went another way (_follow)."""
        steps = rec.steps
        if steps and steps[-1][0] == rec.settled:
            return  # (two writes at one access: the value before the first)
        if steps and not isinstance(steps[-1][1], _Tensor):
            return  # (lost already: later values are of no use either)
        # (the first is the copy the replay needs anyway; later ones cost memory held until
        # backward whether or not the recompute goes another way: small state only)
        keep = not steps or (len(steps) < _MAX_STEPS
                             and u.numel() * u.element_size() <= _MAX_STEP_BYTES)
        steps.append((rec.settled, u.detach().clone() if keep else _LOST))

    def forward_outputs(self, out, source=None) -> None:
        """After an op of the forward ran: its outputs are the region's own tensors.
        ``source``: the argument they are views (or aliases) of, for a view op: a view
        of an external tensor (``weight.detach()``, then written in place by
        ``nn.Embedding(max_norm=...)``'s renorm) is that tensor for a write, which the
        recompute replays on its copy (tester, session 18: such a write counted as one
        through another tensor, and a valid region raised)."""
        produced = self._produced
        if produced is None:
            return
        outs = [out] if isinstance(out, _Tensor) else (
            list(iter_tensors(out)) if isinstance(out, (list, tuple)) else [])
        alias_of = self._alias_of
        for t in outs:
            produced[id(t)] = weakref.ref(t)
            if alias_of:
                alias_of.pop(id(t), None)  # (a dead view's id, reused)
        if source is not None and isinstance(source, _Tensor):
            key = id(source)
            rec = self._reads.get(key)
            root = key if rec is not None and rec.ref() is source else self._alias_of.get(key)
            if root is not None:
                for t in outs:
                    self._alias_of[id(t)] = root

    def end_forward(self) -> None:
        """The forward is over. An external tensor whose version moved although no op of
        the forward declared a write to it was written by an op that does not say so in
        its schema (a custom kernel): the value forward read is unknown."""
        self._produced = None  # the ids were only needed to tell external tensors apart
        self._alias_of = {}
        for rec in self._reads.values():
            t = rec.ref()
            if t is not None:
                rec.end_version = t._version
            if rec.by_other and isinstance(rec.snapshot, _Tensor):
                t = rec.ref()
                if t is not None and not _same_bits(t, rec.snapshot):
                    # an overlapping write through another tensor: reads after it saw the
                    # new value, which the copy does not hold
                    rec.snapshot = _OVERLAPPED
                continue
            if rec.snapshot is None:
                t = rec.ref()
                if t is not None and t._version != rec.version:
                    rec.snapshot = _UNDECLARED

    def read_tensors(self) -> list:
        """The tensors from outside the region that the forward read and that are alive."""
        out = []
        for rec in self._reads.values():
            t = rec.ref()
            if t is not None:
                out.append(t)
        return out

    def read_in_forward(self, t) -> bool:
        """Whether the forward read ``t``'s value (an op took it, one through a view the
        region made of it, or another tensor of its storage such as ``t.data``, as an
        argument it reads: not only view ops or declared writes). For a tensor that lived
        through the whole forward (no other storage had its address meanwhile)."""
        rec = self._reads.get(id(t))
        if rec is not None and rec.ref() is t and rec.first_read is not None:
            return True
        return any(r.first_read is not None
                   for r in self._by_storage.get(_storage_key(t), ()))

    @property
    def written(self) -> int:
        """External tensors the forward wrote (a copy of each is kept)."""
        return sum(1 for r in self._reads.values() if r.snapshot is not None)

    # ------------------------------------------------------------------ recompute
    def begin_recompute(self) -> None:
        """Starts a recompute pass. Every external tensor forward read and did not write
        must still hold the value forward read (checked here, not only when the recompute
        reads it: torch's frame stops recomputing as soon as the saved tensors are rebuilt,
        before the op that saves one runs).

        Raises:
            RuntimeError: naming the first such tensor that was modified since.
        """
        self._shadows = {}
        self._cursor = {}
        for rec in self._reads.values():
            snap = rec.snapshot
            if snap is None:
                t = rec.ref()
                if t is not None and t._version != rec.version:
                    raise RuntimeError(self._modified_message(t, rec.op, rec.version))
            elif snap is _OVERLAPPED:
                t = rec.ref()
                if t is not None:
                    raise RuntimeError(self._overlapped_message(t))
            elif snap is _UNDECLARED:
                t = rec.ref()
                if t is not None:
                    raise RuntimeError(
                        f"hyper_parallel: the recompute of a checkpoint region needs the value "
                        f"that {self._name(t)} had when {rec.op} read it in the region's "
                        "forward, but an op of that forward modified it without declaring the "
                        "write in its schema (e.g. a custom kernel), so the value was not kept "
                        f"(version {rec.version} -> {t._version}). Declare the write in the "
                        "op's schema (Tensor(a!)), or move that update out of the "
                        "checkpointed function.")

    def recompute_args(self, op_name: str, args, kwargs, writes=()):
        """The arguments the recompute's op must see: external tensors that forward wrote
        become this pass's private copy of the value forward read. A private copy at a
        position of ``writes`` (the op writes it) has its version bumped, as autograd bumps
        the tensor it sees (the real one, above this redirection): a value saved from the
        copy before the write then shows it (``recompute_save``'s ``watch``).

        Raises:
            RuntimeError: when an external tensor was modified after forward read it.
        """
        if not self._reads:
            return args, kwargs
        args, kwargs = self._resolve_args(op_name, args, kwargs)
        if writes and self._shadows:
            shadows = self._shadows.values()
            for t in iter_tensors(tuple(written_targets(args, kwargs, writes))):
                if any(t is s for s in shadows):
                    torch.autograd.graph.increment_version(t)
        return args, kwargs

    def _resolve_args(self, op_name: str, args, kwargs):
        new_args = None
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                b = self._resolve(a, op_name)
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], _Tensor):
                b = type(a)(self._resolve(u, op_name) if isinstance(u, _Tensor) else u
                            for u in a)
                if all(x is y for x, y in zip(a, b)):
                    b = a
            else:
                continue
            if b is not a:
                if new_args is None:
                    new_args = list(args)
                new_args[i] = b
        if kwargs:
            new_kwargs = None
            for k, v in kwargs.items():
                if isinstance(v, _Tensor):
                    w = self._resolve(v, op_name)
                    if w is not v:
                        new_kwargs = dict(kwargs) if new_kwargs is None else new_kwargs
                        new_kwargs[k] = w
            if new_kwargs is not None:
                kwargs = new_kwargs
        return (args if new_args is None else tuple(new_args)), kwargs

    def _resolve(self, t, op_name: str):
        rec = self._reads.get(id(t))
        if rec is None or rec.ref() is not t or self._busy:
            return t
        if rec.writes and self._follow(rec, t, op_name):
            return self._shadows[id(t)]
        snap = rec.snapshot
        if snap is None:
            if t._version != rec.version:
                raise RuntimeError(self._modified_message(t, op_name, rec.version))
            return t
        if snap is _OVERLAPPED:
            raise RuntimeError(self._overlapped_message(t))
        if snap is _LOST or snap is _UNDECLARED:
            raise RuntimeError(
                f"hyper_parallel: the recompute of a checkpoint region needs the value that "
                f"{self._name(t)} had when the region's forward first read it, but the forward "
                "modified it through another tensor before writing it, so that value was not "
                "kept. Write it through one tensor (not a view and its base), or move the "
                "write out of the checkpointed function.")
        shadow = self._shadows.get(id(t))
        if shadow is None:
            shadow = self._shadows[id(t)] = snap.clone()
        return shadow

    def _follow(self, rec, t, op_name: str) -> bool:
        """Recompute: ``op_name`` accesses ``t``, which the forward changed. True when the
        access must read the private copy, which now holds the value the forward's matching
        access saw.

        The recompute's accesses of ``t`` are matched against the forward's, in order. As
        long as they are the same ops, the recompute replays the forward's writes on the
        copy of the value forward first read. Where the recompute goes another way (its
        control flow depends on state outside tensors: a Python flag set by a first call
        that initialized the tensor, a lazy module materialized in its first forward), the
        access is matched to the forward's later ones by the same op; when they all saw one
        value (no write of the forward between them), the copy takes it (``_value_at``:
        kept before each write, or the value the forward left), in place: views the
        recompute made of the copy see it, as the forward's views of the tensor did. (It
        used to keep the first value: a buffer filled in a region's first call only was
        read as before the fill, gradients off by 4.4; ``nn.LazyLinear`` raised. Tester,
        session 19.) Ops run with grad mode off are other accesses (``_access_name``).

        Raises:
            RuntimeError: where the matching accesses saw different values (which one this
                is cannot be told), that value was not kept, or the tensor changed since
                the forward.
        """
        key = id(t)
        ops, pos = rec.ops, self._cursor.get(key, 0)
        if pos < len(ops) and ops[pos] == op_name:
            # (accesses from before a storage replacement, `.data = ...`, read the tensor as
            # it is: a recompute that makes the replacement again reads what torch's does)
            self._cursor[key] = pos + 1
            return False
        same = [i for i in range(pos, len(ops)) if ops[i] == op_name]
        if not same:  # an access the forward never made: the copy's value, as before
            self._cursor[key] = len(ops)
            return False
        if self._value_at(rec, same[0]) is not self._value_at(rec, same[-1]):
            raise RuntimeError(self._ambiguous_message(t, op_name))
        self._cursor[key] = same[0] + 1
        return self._take(rec, t, op_name, same[0], pos)

    def _ambiguous_message(self, t, op_name: str) -> str:
        return (f"hyper_parallel: the recompute of a checkpoint region took another path than "
                f"its forward and reads {self._name(t)} (in {op_name}) where the forward read "
                "it at several points with different values in between (it modified it), so "
                "which value this read needs cannot be told. The region's control flow "
                "depends on state outside its tensors (a Python flag changed by its first "
                "call?): keep that state the same for the recompute, run the first call "
                "outside checkpoint, or move the writes out of the checkpointed function.")

    def _value_at(self, rec, j):
        """The value the forward's access ``j`` of ``rec`` saw: a kept one, ``None`` for
        the value the forward left, or _LOST."""
        if j >= rec.settled:
            return None  # (after the forward's last write)
        for b, value in rec.steps:
            if j < b:
                return value
        return _LOST  # (a write after the last value kept)

    def _take(self, rec, t, op_name: str, j: int, pos: int | None) -> bool:
        """Puts the value the forward's access ``j`` saw in ``t``'s private copy (see
        ``_follow``); ``pos``: the access the recompute was at (no copy when no write of
        the forward lies between, or None)."""
        key = id(t)
        value = self._value_at(rec, j)
        if pos is not None and key in self._shadows and value is self._value_at(rec, pos):
            return True  # (the skipped accesses wrote nothing: the copy holds it already)
        if value is _LOST or (value is not None and not isinstance(value, _Tensor)):
            raise RuntimeError(
                f"hyper_parallel: the recompute of a checkpoint region took another path than "
                f"its forward and reads {self._name(t)} (in {op_name}) where the forward had "
                f"modified it more times than values are kept for ({_MAX_STEPS}; 1 for tensors "
                f"over {_MAX_STEP_BYTES >> 20} MiB), so the value that read saw was not "
                "kept. The region's control flow depends on state outside its tensors (a "
                "Python flag changed by its first call?): keep that state the same for the "
                "recompute, run the first call outside checkpoint, or move the writes out of "
                "the checkpointed function.")
        if value is None and (t._version != rec.end_version or _storage_key(t) != rec.storage):
            raise RuntimeError(self._modified_message(t, op_name, rec.end_version))
        self._busy = True  # (these ops read t itself)
        try:
            if value is None:
                value = t.detach()
            shadow = self._shadows.get(key)
            if shadow is None:
                self._shadows[key] = value.clone()
            else:
                shadow.copy_(value)
        finally:
            self._busy = False
        return True

    def _skipped_to_save(self, rec, t) -> bool:
        """Recompute, from the pack hook: whether ``t``, which the forward changed and this
        pass has not accessed yet, is saved by an op (before the op reaches ``_follow``,
        and maybe the last one the recompute runs: early stop) where the forward's first
        access did not read its value: that op reads it, so the recompute skipped the
        forward's accesses before its first read (its control flow went another way, as in
        ``_follow``), and the copy takes the value that first read saw."""
        key = id(t)
        if self._cursor.get(key, 0) != 0 or not rec.first_read:
            return False  # (accessed already, or the forward read it first too, or never)
        if self._value_at(rec, rec.first_read) is not self._value_at(rec, rec.last_read):
            # (the forward read it, wrote it, read it again: which read this is cannot be
            # told)
            raise RuntimeError(self._ambiguous_message(t, "an op saving it"))
        self._cursor[key] = rec.first_read
        return self._take(rec, t, "an op saving it", rec.first_read, None)

    def written_tensors(self) -> list:
        """The external tensors the forward wrote whose value was kept (those with a
        private copy in recompute)."""
        out = []
        for rec in self._reads.values():
            if isinstance(rec.snapshot, _Tensor):
                t = rec.ref()
                if t is not None:
                    out.append(t)
        return out

    def recompute_save(self, t):
        """Recompute: ``(tensor, watch)``, what autograd must save in place of ``t``, which
        an op of the recompute is about to save for backward (from a saved-tensor pack
        hook, before the op runs), and whether that tensor shares memory with a private
        copy. Autograd saves an op's arguments above the dispatch mode that redirects its
        reads, so a written external tensor would be saved as itself, holding the value
        the whole forward left, and the gradient would read that instead of the value the
        op read: its private copy is saved instead. ``watch``: the tensor saved is, or
        views, a private copy, which a later write of the recompute would change (plain
        autograd's version error; :class:`SavedValues` checks it)."""
        rec = self._reads.get(id(t))
        if rec is not None and rec.ref() is t and rec.writes and self._skipped_to_save(rec, t):
            return self._shadows[id(t)], True
        if rec is not None and rec.ref() is t and isinstance(rec.snapshot, _Tensor) \
                and rec.declared:
            # (written only by the batch norms' undeclared writes: saved as itself, as
            # plain autograd saves it; their running statistics are read in backward only
            # in eval mode, and a later write that autograd does not see either would
            # change a private copy saved instead: tester 3, session 18)
            shadow = self._shadows.get(id(t))
            if shadow is None:
                shadow = self._shadows[id(t)] = rec.snapshot.clone()
            return shadow, True
        if self._shadows:
            key = _storage_key(t)
            if key is not None and any(_storage_key(s) == key for s in self._shadows.values()):
                return t, True
        return t, False

    def _overlapped_message(self, t) -> str:
        return (f"hyper_parallel: the recompute of a checkpoint region reads {self._name(t)}, "
                "whose value the region's forward changed after reading it by writing another "
                "tensor of the same memory (its base or another view of it): the recompute "
                "cannot replay that. Write through the tensor the region reads (or a view of "
                "it), clone it before the region reads it, or move the write out of the "
                "checkpointed function.")

    def _name(self, t) -> str:
        return tensor_name(t, self._describe)

    def _modified_message(self, t, op_name: str, version: int) -> str:
        return modified_message(self._name(t), t, op_name, version)


def modified_message(name: str, t, op_name: str, version: int) -> str:
    """The error for an outside tensor modified in place between a region's forward and
    its recompute (``name``: as :func:`tensor_name` gives it)."""
    return (
        f"hyper_parallel: the recompute of a checkpoint region reads {name} "
        f"(in {op_name}), which was modified in place after the region's forward read it "
        f"(version {version} -> {t._version}). Backward would compute its gradients from "
        "a different value than forward used. Modify it after backward (or before the "
        "forward), or clone it and let the region read the clone.")


class SavedValues:
    """The recompute of a region whose forward wrote tensors from outside it: a
    saved-tensor pack hook on top of torch's recompute hook (entered inside it, by the
    region's recompute context) that has autograd save each written external tensor's
    private copy instead of the tensor itself (``recompute_save``: the value the op read,
    not the one the forward left), and at exit raises when a saved value was written
    after it was saved, where plain autograd raises its version error (torch's checkpoint
    checks no version there and computes a wrong gradient).

    ``recompute_save(t) -> (tensor, watch)``: ``ExternalTensors.recompute_save`` or the
    C++ region's; ``written()``: the external tensors with a private copy, whose version
    counters are put back at exit (the recompute writes only their copies, but a write
    through a view the recompute made bumps the real tensor's counter: autograd's view
    tracking sits above the redirection; tester, session 18: a retain_graph second
    backward then refused a tied weight as modified). Re-enterable (a retain_graph
    backward recomputes again).

    Raises (at exit):
        RuntimeError: a value saved in this recompute was modified in place afterwards.
    """

    __slots__ = ("_save", "_written", "_passes")

    def __init__(self, recompute_save, written=None) -> None:
        self._save = recompute_save
        self._written = written
        self._passes: list = []

    def __enter__(self):
        real = list(self._written()) if self._written is not None else []
        versions = [t._version for t in real]
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:  # (not under torch's frame: nothing saves through a hook here)
            self._passes.append((None, real, versions))
            return self
        pack, unpack = top
        save, watched = self._save, []

        def pack_hook(t):
            u, watch = save(t)
            if watch:
                watched.append((u, u._version))
            return pack(u)

        torch._C._autograd._push_saved_tensors_default_hooks(pack_hook, unpack)
        self._passes.append((watched, real, versions))
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._passes:
            return False
        watched, real, versions = self._passes.pop()
        try:
            if watched is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self._check(watched)  # (first: a view's counter may be the real tensor's)
        finally:
            moved = [(t, v) for t, v in zip(real, versions) if t._version != v]
            if moved:
                _set_versions([t for t, _ in moved], [v for _, v in moved])
        return False

    @staticmethod
    def _check(watched) -> None:
        for u, version in watched:
            if u._version != version:
                raise RuntimeError(
                    "hyper_parallel: a tensor the recompute of a checkpoint region saved for "
                    f"backward (shape {list(u.shape)}, {u.dtype}), a tensor from outside the "
                    "region or a view of it, was modified by an in-place operation of the "
                    f"region after it was saved (version {version} -> {u._version}); plain "
                    "autograd raises here too (one of the variables needed for gradient "
                    "computation has been modified by an inplace operation). Clone it before "
                    "the region writes it, or move the write out of the checkpointed "
                    "function.")


def _set_versions(tensors: list, versions: list) -> None:
    """Puts version counters back (torch's ``_unsafe_set_version_counter``: sequences
    since torch 2.5, one tensor and version before)."""
    setter = torch._C._autograd._unsafe_set_version_counter
    try:
        setter(tuple(tensors), tuple(versions))
    except TypeError:
        for t, v in zip(tensors, versions):
            setter(t, v)
