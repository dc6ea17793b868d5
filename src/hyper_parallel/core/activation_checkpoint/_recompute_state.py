"""Which checkpoint region invocation is running on this thread, and whether it is being
recomputed (``get_recompute_state()``, ``is_recomputing()``).

Every checkpoint region (ours, and torch's own checkpoint given our
``create_selective_checkpoint_contexts``) runs its forward and its recompute under the
region modes of ``_selective.py``; they push the invocation's :class:`RecomputeState` on
a per-thread stack while they are active. Model code that must behave differently in
recompute (skip a log line, not count a router's tokens twice) asks
:func:`is_recomputing`; ``checkpoint_exclude_wrapper`` keeps its outputs in the state
(docs/design.md, "Exclusion regions and scheduled recompute").

Thread-safety: the stack is per thread; a state is used by one thread at a time (the
forward's, then the one that runs the recompute).
"""

from __future__ import annotations

import threading

import torch

_tls = threading.local()


class RecomputeState:
    """One checkpoint region invocation, as model code inside it sees it.

    Attributes:
        is_recomputing (bool): ``True`` while backward (or :func:`recompute_handle`)
            recomputes the region, ``False`` in its forward.
        frame: torch.utils.checkpoint's frame of the invocation (``None`` when it could
            not be found); used by scheduled recompute.
    """

    __slots__ = ("is_recomputing", "frame", "excluding", "native", "external", "reassigned",
                 "_exclusions", "_cursor", "__weakref__")

    def __init__(self) -> None:
        self.is_recomputing = False
        self.frame = None
        self.excluding = 0  # > 0 inside a checkpoint_exclude_wrapper's forward
        self.native = None  # the invocation's _C.SacRegion (C++ interception), if any
        self.external = None  # its ExternalTensors (the Python region modes), if any
        # Its forward replaced a module buffer by another tensor after reading the old one,
        # or without the region modes to tell (_checkpoint._ForwardModuleState): the
        # target is probed again (it is not a plain region).
        self.reassigned = False
        self._exclusions: dict = {}  # exclusion key -> [kept entries, in call order]
        self._cursor: dict = {}  # exclusion key -> entries handed back in this recompute

    def keep_exclusion(self, key, entry) -> None:
        """Stores what an exclusion region returned in forward (call order is kept)."""
        self._exclusions.setdefault(key, []).append(entry)

    def next_exclusion(self, key, what: str):
        """The entry of the next call of exclusion ``key`` in this recompute.

        Raises:
            torch.utils.checkpoint.CheckpointError: when the recompute calls the region
                more often than the forward did (control flow that differs between them).
        """
        entries = self._exclusions.get(key, ())
        i = self._cursor.get(key, 0)
        if i >= len(entries):
            raise torch.utils.checkpoint.CheckpointError(
                f"hyper_parallel: checkpoint_exclude_wrapper({what}) ran {i + 1} times in "
                f"recompute but {len(entries)} times in the checkpoint region's forward; "
                "the recompute must follow the forward's control flow (branch on "
                "is_recomputing() only outside exclusion regions).")
        self._cursor[key] = i + 1
        return entries[i]

    def begin_recompute(self) -> None:
        self.is_recomputing = True
        self._cursor.clear()  # every recompute (retain_graph) replays from the start

    def end_recompute(self) -> None:
        self.is_recomputing = False


def _stack() -> list:
    stack = _tls.__dict__.get("stack")
    if stack is None:
        stack = _tls.__dict__["stack"] = []
    return stack


def read_in_forward(state: RecomputeState, tensor) -> bool | None:
    """Whether ``state``'s forward read ``tensor``'s value, as its region modes saw it;
    None when no region mode watched that forward (torch's frame alone)."""
    if state.native is not None:
        return state.native.read_in_forward(tensor)
    if state.external is not None:
        return state.external.read_in_forward(tensor)
    return None


def active(state: RecomputeState) -> bool:
    """Whether ``state``'s forward or recompute is running on this thread (on its stack)."""
    return any(s is state for s in _stack())


def push(state: RecomputeState) -> None:
    _stack().append(state)


def pop(state: RecomputeState) -> None:
    stack = _stack()
    # The innermost entry is normally ``state``; a mode exited out of order (an
    # interrupted forward) is removed wherever it sits.
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is state:
            del stack[i]
            return


def enter_forward(state: RecomputeState) -> None:
    """The region's forward begins (right inside torch's checkpoint hooks)."""
    from . import _scheduled

    state.frame = _scheduled.current_frame()
    push(state)


def exit_forward(state: RecomputeState, ok: bool) -> None:
    """The region's forward ends; a successful one hands its handle to the collector."""
    pop(state)
    if ok:
        from . import _scheduled

        _scheduled.collect(state)


def enter_recompute(state: RecomputeState) -> None:
    state.begin_recompute()
    push(state)


def exit_recompute(state: RecomputeState) -> None:
    pop(state)
    state.end_recompute()


class _Forward:
    __slots__ = ("_state",)

    def __init__(self, state: RecomputeState) -> None:
        self._state = state

    def __enter__(self):
        enter_forward(self._state)
        return self

    def __exit__(self, exc_type, exc, tb):
        exit_forward(self._state, exc_type is None)
        return False


class _Recompute:
    __slots__ = ("_state",)

    def __init__(self, state: RecomputeState) -> None:
        self._state = state

    def __enter__(self):
        enter_recompute(self._state)
        return self

    def __exit__(self, exc_type, exc, tb):
        exit_recompute(self._state)
        return False


def contexts():
    """``(forward_ctx, recompute_ctx)`` of a fresh invocation state, for a region that
    runs without the region modes (re-enterable: a retain_graph backward recomputes
    again)."""
    state = RecomputeState()
    return _Forward(state), _Recompute(state)


def _marked(function, mark: str):
    """``function`` with the per-thread counter ``mark`` raised while it runs."""

    def run(*args):
        _tls.__dict__[mark] = _tls.__dict__.get(mark, 0) + 1
        try:
            return function(*args)
        finally:
            _tls.__dict__[mark] -= 1

    return run


def reentrant_call(function):
    """``function`` marked, while it runs, as the body of a ``use_reentrant=True``
    checkpoint (torch's reentrant frame: no recompute state, the whole body replayed in
    backward), so that an exclusion region inside can refuse to run."""
    return _marked(function, "reentrant")


def debug_call(function):
    """``function`` marked, while it runs, as the body of a checkpoint in torch's debug
    mode (torch's frame with its own contexts: no recompute state of ours), so that an
    exclusion region inside can say that it will run again in recompute."""
    return _marked(function, "debug")


def in_debug_region() -> bool:
    """Whether this thread runs the forward or recompute of a debug-mode checkpoint."""
    return _tls.__dict__.get("debug", 0) > 0


def in_reentrant_region() -> bool:
    """Whether this thread runs the body of a ``use_reentrant=True`` checkpoint (at any
    depth: regions of ours nested in it run once without grad in its forward and again
    in its replay, so whatever they hold runs twice as well)."""
    return _tls.__dict__.get("reentrant", 0) > 0


def get_recompute_state() -> RecomputeState | None:
    """The innermost checkpoint region invocation running on this thread, or ``None``
    outside every checkpoint region (and inside torch's own checkpoint without our
    contexts)."""
    stack = _tls.__dict__.get("stack")
    return stack[-1] if stack else None


def enclosing_states() -> list:
    """The checkpoint region invocations running on this thread, innermost first."""
    stack = _tls.__dict__.get("stack")
    return stack[::-1] if stack else []


def is_recomputing() -> bool:
    """``True`` while a checkpoint region is being recomputed on this thread (in backward
    or by :func:`recompute_handle`), ``False`` in its forward and outside any region."""
    stack = _tls.__dict__.get("stack")
    return bool(stack) and any(s.is_recomputing for s in stack)
