"""Scheduled recompute: run a checkpoint region's recompute before its backward, and
share one recompute between several backward calls (docs/design.md, "Exclusion regions
and scheduled recompute").

Pipeline schedules split a micro-batch's backward into pieces (input gradients first,
weight gradients later: "dx/dw split", zero-bubble schedules) and have idle time while
waiting on a send. torch's non-reentrant frame recomputes a region once per backward
call (its recompute results are keyed by the graph task), so a split backward
recomputes it twice, and always at the moment the gradient arrives. Here:

* :func:`recompute_handle_collector_ctx` collects one handle per checkpoint region
  invocation whose forward ran inside it;
* a *session* (any hashable id) is a ``torch.utils.checkpoint.GraphExecGroup``: backward
  calls inside :func:`recompute_session_ctx` share one recompute per region, keyed by the
  session instead of the graph task (torch propagates the group to its autograd threads);
* :func:`recompute_handle` runs a region's recompute now, into the session, so the
  backward that follows only reads the results;
* ``retain_on_unpack=True`` keeps each recomputed tensor after backward reads it, for a
  later backward call of the same session (the weight-gradient pass reads what the
  input-gradient pass read); :func:`clear_recompute_session` drops what a session holds.

Built on torch's frame internals (``_CheckpointFrame``, ``_recomputation_hook``, a holder's
``handles``), which this module reaches in one place each.

Thread-safety: sessions are process-wide behind one lock; a session's backward calls
and recomputes run one at a time.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.utils.checkpoint as torch_checkpoint

from ._errors import ArgumentKindError

_GraphExecGroup = getattr(torch_checkpoint, "GraphExecGroup", None)
_Frame = getattr(torch_checkpoint, "_CheckpointFrame", None)

_tls = threading.local()
_lock = threading.Lock()
_sessions: dict = {}
_collected_frames: weakref.WeakSet = weakref.WeakSet()  # frames that hold session entries


def _require_torch_support() -> None:
    if _GraphExecGroup is None or _Frame is None:
        raise RuntimeError(
            "hyper_parallel: scheduled recompute needs torch.utils.checkpoint.GraphExecGroup "
            f"(torch >= 2.9); this torch is {torch.__version__}. Upgrade torch, or let "
            "backward recompute each region when it reaches it.")


class RecomputeHandle:
    """One checkpoint region invocation, as :func:`recompute_handle_collector_ctx`
    collects it. Holds the region weakly: a handle kept after the graph is gone does
    nothing."""

    __slots__ = ("_frame",)

    def __init__(self, frame_ref) -> None:
        self._frame = frame_ref

    @property
    def alive(self) -> bool:
        """Whether the region's graph (and so something to recompute) still exists."""
        return self._frame() is not None

    def recompute(self, session_id) -> bool:
        """``recompute_handle(self, session_id)`` (the reference's method form)."""
        return recompute_handle(self, session_id)

    def __repr__(self) -> str:
        return f"RecomputeHandle(alive={self.alive})"


def current_frame():
    """A weak reference to the torch.utils.checkpoint frame whose saved-tensor hooks are
    innermost on this thread (the region modes are entered right inside them), or None."""
    if _Frame is None:
        return None
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], "__module__", None) != "torch.utils.checkpoint":
        return None
    for cell in getattr(top[0], "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, _Frame):
            return weakref.ref(value)
    return None


class _SessionHandles(dict):
    """A holder's recompute handles that a retaining session does not let go of."""

    __slots__ = ()

    def __setitem__(self, key, value):
        if value is None and isinstance(key, _Session) and key.retain:
            return  # torch clears the handle after an unpack; the session keeps it
        dict.__setitem__(self, key, value)


def _make_retainable(frame) -> None:
    for ref in frame.weak_holders:
        holder = ref()
        if holder is not None and type(holder.handles) is dict:
            holder.handles = _SessionHandles(holder.handles)
    _collected_frames.add(frame)


if _GraphExecGroup is not None:
    class _Session(_GraphExecGroup):
        """The key of one session's recompute results in torch's frames."""

        def __init__(self, session_id) -> None:
            self.session_id = session_id
            self.retain = False

        def __repr__(self) -> str:
            return f"recompute session {self.session_id!r}"
else:  # pragma: no cover - old torch
    class _Session:  # type: ignore[no-redef]
        pass


def _session(session_id, create: bool = True):
    if session_id is None:
        # Almost always an id lost on the way (``getattr(batch, "id", None)``): two
        # schedules would silently share one session.
        raise ValueError("hyper_parallel: a recompute session_id must not be None; pass the "
                         "same explicit id (e.g. (\"micro-batch\", k)) to recompute_handle, "
                         "recompute_session_ctx and clear_recompute_session.")
    try:
        hash(session_id)
    except TypeError:
        raise ArgumentKindError(f"hyper_parallel: a recompute session_id must be hashable (a "
                                f"str, int or tuple); got {type(session_id).__name__}") from None
    with _lock:
        session = _sessions.get(session_id)
        if session is None and create:
            session = _sessions[session_id] = _Session(session_id)
        return session


def _in_session() -> bool:
    """Whether a recompute_session_ctx is active on this thread."""
    return _GraphExecGroup is not None and isinstance(torch._C._get_graph_exec_group(), _Session)


def collect(rstate) -> None:
    """Called by the region modes when a region's forward ends: hands its handle to the
    innermost collector of this thread, and makes the region retainable by sessions when
    a collector or a session is active (not during a recompute)."""
    stack = _tls.__dict__.get("collectors")
    if (not stack and not _in_session()) or rstate.is_recomputing or rstate.frame is None:
        return
    from ._region import in_backward

    if in_backward():
        return
    frame = rstate.frame()
    if frame is None:
        return
    _make_retainable(frame)
    if stack:
        stack[-1].append(RecomputeHandle(rstate.frame))


@contextlib.contextmanager
def recompute_handle_collector_ctx():
    """Collects the checkpoint regions whose forward runs inside the block.

    Yields:
        A list that receives one :class:`RecomputeHandle` per checkpoint region
        invocation (``checkpoint``, ``checkpoint_wrapper``, torch's checkpoint with our
        ``create_selective_checkpoint_contexts``), in forward order, when its forward
        ends. A forward that raises, and a call without grad (nothing to recompute), add
        none. Nested collectors: the innermost one receives the handles.
    """
    stack = _tls.__dict__.setdefault("collectors", [])
    handles: list = []
    stack.append(handles)
    try:
        yield handles
    finally:
        stack.remove(handles)


def recompute_handle(handle: RecomputeHandle, session_id) -> bool:
    """Runs the recompute of ``handle``'s region now, into session ``session_id``.

    The next backward inside ``recompute_session_ctx(session_id)`` reads the results
    instead of recomputing (e.g. recompute micro-batch k's layers while waiting for the
    gradient from the next pipeline stage). The recompute replays the forward's RNG and
    autocast state and the region's policy, as in backward; ``is_recomputing()`` is
    ``True`` during it. Nothing is done when the session already holds this region's
    recompute or the region's graph is gone.

    Args:
        handle: from :func:`recompute_handle_collector_ctx`.
        session_id: any hashable id (e.g. ``("micro-batch", 3)``); created on first use.

    Returns:
        ``True`` when a recompute ran.

    Raises:
        ArgumentKindError: (a TypeError and a ValueError) for a handle of another kind or
            an unhashable session id.
        ValueError: for ``session_id=None``.
        torch.utils.checkpoint.CheckpointError: when the recompute saves different
            tensors than the forward did (as in backward).

    Memory: the recomputed tensors live until a backward of the session reads them (or
    the session is cleared): run it shortly before that backward.
    """
    _require_torch_support()
    if not isinstance(handle, RecomputeHandle):
        raise ArgumentKindError("hyper_parallel: recompute_handle's handle must be produced by "
                                "recompute_handle_collector_ctx() (a RecomputeHandle); got "
                                f"{type(handle).__name__}")
    frame = handle._frame()
    if frame is None:
        _session(session_id, create=False)  # the id is still checked
        return False  # the region's graph is gone: no session is created for nothing
    session = _session(session_id)
    if frame.is_recomputed.get(session, False):
        return False
    _make_retainable(frame)
    args = frame.get_inputs()
    try:
        with torch_checkpoint._recomputation_hook(weakref.ref(frame), session), \
                torch.enable_grad():
            frame.recompute_fn(*args)
    except torch_checkpoint._StopRecomputationError:
        pass
    except BaseException:
        _drop(frame, session)  # a half-done recompute must not be read
        raise
    frame.is_recomputed[session] = True
    frame.check_recomputed_tensors_match(session)
    return True


@contextlib.contextmanager
def recompute_session_ctx(session_id, retain_on_unpack: bool = False):
    """Backward calls inside share the recompute of every checkpoint region with the
    other backward calls of session ``session_id`` (and with :func:`recompute_handle`).

    Args:
        session_id: any hashable id; created on first use.
        retain_on_unpack: keep each recomputed tensor after a backward read it, so a later
            backward of the same session (the weight-gradient pass after the
            input-gradient pass, with ``retain_graph=True`` in between) reads it again.
            Applies to regions collected by :func:`recompute_handle_collector_ctx` and
            to regions whose forward ran inside a ``recompute_session_ctx`` (of any id).
            With ``False`` (default) a tensor is freed once read, and two backward calls
            of one session must not read the same saved tensor (torch raises).

    Raises:
        RuntimeError: when a session context is already active on this thread (sessions
            do not nest: torch's GraphExecGroup).
        ArgumentKindError: (a TypeError and a ValueError) for an unhashable id or a
            non-bool ``retain_on_unpack``.
        ValueError: for ``session_id=None``.

    Call :func:`clear_recompute_session` when the session's backward is done.
    """
    _require_torch_support()
    if not isinstance(retain_on_unpack, bool):
        raise ArgumentKindError("hyper_parallel: retain_on_unpack must be bool (True or "
                                f"False); got {retain_on_unpack!r}")
    session = _session(session_id)
    active = torch._C._get_graph_exec_group()
    if active is not None:
        raise RuntimeError(f"hyper_parallel: recompute_session_ctx({session_id!r}) inside "
                           f"{active!r}: sessions do not nest; leave the other one first.")
    before = session.retain
    session.retain = retain_on_unpack
    try:
        with session:
            yield session
    finally:
        session.retain = before


def _drop(frame, session) -> None:
    frame.recomputed.pop(session, None)
    frame.is_recomputed.pop(session, None)
    frame.recomp_counter.pop(session, None)
    for ref in frame.weak_holders:
        holder = ref()
        if holder is not None:
            holder.handles.pop(session, None)


def clear_recompute_session(session_id) -> None:
    """Frees what session ``session_id`` holds (recomputed tensors not yet read, retained
    ones) and forgets it. Unknown ids are ignored (clearing twice is fine)."""
    with _lock:
        session = _sessions.pop(session_id, None) if _is_hashable(session_id) else None
    if session is None:
        return
    for frame in list(_collected_frames):
        _drop(frame, session)


def _is_hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def session_count() -> int:
    """How many sessions exist (created and not cleared); for tests and leak checks."""
    with _lock:
        return len(_sessions)
