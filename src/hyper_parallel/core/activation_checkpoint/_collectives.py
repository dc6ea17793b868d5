"""Collectives inside checkpoint regions: their outputs are kept, never re-issued.

Recomputing a collective in backward is unsafe: every rank recomputes its regions in its
own backward order, so the re-issued collectives of two regions can pair up wrongly
across ranks (silently wrong values when the sizes agree, an abort or a hang when they do
not). So by default the outputs of collective ops that run inside a checkpoint region are
kept from the forward and handed back in recompute, which then issues no collective
(docs/design.md, "Collectives in checkpoint regions"). A policy that returns
``MUST_RECOMPUTE`` for a collective overrides this; the user then guarantees that every
rank recomputes in the same order.

Collective ops are those of the namespaces ``_c10d_functional`` and
``_c10d_functional_autograd`` (functional collectives, DTensor's redistributions: they
return new tensors) and ``c10d`` (``torch.distributed``'s ops: they write their first
argument and return a ``Work``). ``wait_tensor`` is not one: it only waits, and on a kept
output it has nothing left to wait for.

Thread-safety: none; one region invocation is used by one thread at a time.
"""

from __future__ import annotations

from ._external import iter_tensors

FUNCTIONAL_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})
C10D_NAMESPACE = "c10d"
_NOT_COLLECTIVE = frozenset({"wait_tensor"})

_RECOMPUTE = object()
_CONSUMED = object()


def is_collective(func) -> bool:
    ns = getattr(func, "namespace", None)
    if ns != C10D_NAMESPACE and ns not in FUNCTIONAL_NAMESPACES:
        return False
    return func._schema.name.split("::", 1)[-1] not in _NOT_COLLECTIVE


def _detach(x):
    return x.detach() if hasattr(x, "detach") and hasattr(x, "_version") else x


def _detached(out):
    if isinstance(out, (list, tuple)):
        return type(out)(_detached(v) for v in out)
    return _detach(out)


def _wait(out) -> None:
    values = out if isinstance(out, (list, tuple)) else (out,)
    for v in values:
        wait = getattr(v, "wait", None)
        if wait is not None and not hasattr(v, "_version"):
            wait()


class Collectives:
    """The collective calls of one checkpoint region invocation, in call order.

    Args:
        observe: ``observe(tensor)``, told of each kept tensor (the saved-activation
            meter), or ``None``.
    """

    __slots__ = ("_calls", "_cursor", "_observe")

    def __init__(self, observe=None) -> None:
        self._calls: list = []
        self._cursor = 0
        self._observe = observe

    def __bool__(self) -> bool:
        return bool(self._calls)

    def record(self, func, args, out, keep: bool) -> None:
        """Forward: ``func(*args)`` returned ``out``; keep its result unless ``keep`` is
        false (the policy asked for MUST_RECOMPUTE)."""
        if not keep:
            self._calls.append(_RECOMPUTE)
            return
        if func.namespace == C10D_NAMESPACE:
            # The op writes its first argument asynchronously: wait for it (on a device this
            # orders the current stream after the collective, it does not block the host),
            # then copy what it wrote, since the caller may reuse that buffer.
            _wait(out)
            written = []
            if func._schema.name.endswith("_") and args:
                written = [t.detach().clone() for t in iter_tensors((args[0],))]
            self._keep(written)
            self._calls.append(("c10d", out, written))
        else:
            kept = _detached(out)
            self._keep(iter_tensors((kept,)))
            self._calls.append(("functional", kept, None))

    def _keep(self, tensors) -> None:
        if self._observe is not None:
            for t in tensors:
                self._observe(t)

    def begin_recompute(self) -> None:
        self._cursor = 0

    def replay(self, func, args, kwargs, retain: bool):
        """Recompute: the kept result of the next collective call, or the op's own result
        when forward's policy said MUST_RECOMPUTE.

        Raises:
            RuntimeError: when the recompute runs more collectives than the forward, or a
                kept result was released by an earlier backward.
        """
        i = self._cursor
        self._cursor += 1
        if i >= len(self._calls):
            raise RuntimeError(
                f"hyper_parallel: the recompute of a checkpoint region ran the collective "
                f"{func} (collective #{i}), but its forward ran only {len(self._calls)}. A "
                "checkpointed function must run the same collectives when it is recomputed.")
        entry = self._calls[i]
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        if entry is _CONSUMED:
            raise RuntimeError(
                "hyper_parallel: the kept output of a collective in a checkpoint region was "
                "already used and released by an earlier backward. To run backward twice, "
                "pass retain_graph=True to the first backward.")
        kind, out, written = entry
        if not retain:
            self._calls[i] = _CONSUMED
        if kind == "functional":
            return _detached(out)
        # c10d: write forward's values into this call's buffers, return forward's result
        # (its Work is complete) with this call's buffers in place of forward's.
        if written:
            for dst, src in zip(iter_tensors((args[0],)), written):
                dst.copy_(src)
        if isinstance(out, (list, tuple)):
            return type(out)(args[0] if not hasattr(v, "wait") or hasattr(v, "_version")
                             else v for v in out)
        return out
