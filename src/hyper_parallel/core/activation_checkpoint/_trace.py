"""The swap timeline: ``with hyper_parallel.activation_trace("trace.json"):``.

The C++ engine records every offload and reload (group, bytes, storages, stream, host
enqueue time, start and end of the copy), every wait of the compute stream for a reload
(its stall), every in-place free and refill, every on-demand reload, and each layer's
forward and backward on the host thread (csrc/hyper_parallel/activation/Trace.h;
docs/design.md, "Timeline"). On leaving the block the trace is written as Chrome trace
JSON, which Perfetto (https://ui.perfetto.dev) and chrome://tracing open: one process per
device, one track per stream (D2H, H2D, compute-stream waits) plus the host thread's layer
ranges and instants. The engine's host calls also appear as ``hyper_parallel::offload`` /
``::reload`` / ``::wait_reload`` ranges in a ``torch.profiler`` trace.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter

from ..._extension import _C

__all__ = ["ActivationTrace", "activation_trace"]

_TRACKS = {"host": (1, "host thread: layers, frees, refills"), "compute": (2, "compute stream: waits"),
           "d2h": (3, "D2H stream: offloads"), "h2d": (4, "H2D stream: reloads")}


class ActivationTrace:
    """What one ``activation_trace`` block recorded.

    Attributes:
        items: list of dicts, sorted by ``start_ns``: ``kind`` (``copy``, ``wait``, ``free``,
            ``refill``, ``on_demand``, ``forward``, ``backward``), ``label`` (the group,
            i.e. layer invocation), ``stream`` (``d2h``, ``h2d``, ``compute``, ``host``),
            ``device`` (index; -1 for host tensors), ``bytes``, ``count`` (storages),
            ``enqueue_ns`` / ``start_ns`` / ``end_ns`` (nanoseconds of the host's steady
            clock; an instant has start == end), ``thread``.
    """

    def __init__(self) -> None:
        self.items: list[dict] = []

    def counts(self) -> dict:
        """Totals comparable with ``SwapManager().stats()`` deltas over the block:
        offload_count / offload_bytes, reload_count / reload_bytes, on_demand_reloads,
        waits and stall_seconds (the compute stream's waits for reloads)."""
        c: Counter = Counter()
        for it in self.items:
            if it["kind"] == "copy":
                key = "offload" if it["stream"] == "d2h" else "reload"
                c[f"{key}_count"] += it["count"]
                c[f"{key}_bytes"] += it["bytes"]
            elif it["kind"] == "on_demand":
                c["on_demand_reloads"] += 1
            elif it["kind"] == "wait":
                c["waits"] += 1
                c["stall_seconds"] += (it["end_ns"] - it["start_ns"]) * 1e-9
        return dict(c)

    def chrome_trace(self) -> dict:
        """The trace as a Chrome trace JSON object (``traceEvents``, times in microseconds
        from the first item)."""
        t0 = min((it["enqueue_ns"] for it in self.items), default=0)
        us = lambda ns: (ns - t0) / 1e3  # noqa: E731
        events = []
        pids = set()
        for it in self.items:
            pid = it["device"] + 1  # 0: host tensors (CPU swap backend)
            pids.add(pid)
            tid, _ = _TRACKS[it["stream"]]
            args = {"bytes": it["bytes"], "storages": it["count"]}
            kind = it["kind"]
            if kind == "copy":
                name = ("offload " if it["stream"] == "d2h" else "reload ") + it["label"]
                args["queued_us"] = round(us(it["start_ns"]) - us(it["enqueue_ns"]), 3)
            elif kind == "wait":
                name = "wait " + it["label"]
                args = {"stall_s": (it["end_ns"] - it["start_ns"]) * 1e-9}
            else:
                name = f"{kind} {it['label']}"
            if it["end_ns"] > it["start_ns"] or kind in ("copy", "wait", "forward", "backward"):
                events.append({"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": tid,
                               "ts": us(it["start_ns"]),
                               "dur": max(0.0, us(it["end_ns"]) - us(it["start_ns"])),
                               "args": args})
            else:
                events.append({"name": name, "cat": kind, "ph": "i", "s": "t", "pid": pid,
                               "tid": tid, "ts": us(it["start_ns"]), "args": args})
        for pid in sorted(pids):
            label = "host tensors" if pid == 0 else f"device {pid - 1}"
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"hyper_parallel swap, {label}"}})
            for tid, title in _TRACKS.values():
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"name": title}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        """Writes ``chrome_trace()`` to ``path`` (parent folders are created)."""
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def _check_trace_path(path) -> str:
    """``path`` as a str when the trace can be written there on exit; checked without
    creating anything (the folders ``write`` would create must have a writable folder
    above them)."""
    from ._errors import ArgumentKindError  # noqa: PLC0415

    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentKindError(
            "hyper_parallel: activation_trace's path must be a str or os.PathLike (the Chrome "
            f"trace JSON file written on exit) or None; got {path!r} ({type(path).__name__}).")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if os.path.isdir(path):
        raise ValueError(f"hyper_parallel: activation_trace path {path!r} is a folder; give a "
                         "file name inside it, e.g. os.path.join(path, 'trace.json').")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"hyper_parallel: activation_trace cannot write {path!r} (no "
                             "write permission); give a path you can write.")
        return path
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"hyper_parallel: activation_trace cannot write {path!r}: {folder!r} "
                         "is a file, not a folder; give a path in a folder you can write.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"hyper_parallel: activation_trace cannot write {path!r}: folder "
                         f"{folder!r} is not writable; give a path in a folder you can write.")
    return path


def activation_trace(path: str | os.PathLike | None = None):
    """Records the swap timeline of the enclosed code; yields an :class:`ActivationTrace`.

    On exit the engine waits for the copies it recorded to finish (their end times are
    read then), and, when ``path`` is given, writes Chrome trace JSON there (missing
    parent folders are created): open it in https://ui.perfetto.dev or chrome://tracing.
    One trace at a time per process (RuntimeError otherwise). Thread-safe: swaps on any
    thread are recorded.

    Raises:
        ArgumentKindError: (a TypeError and a ValueError) at this call, when ``path`` is
            not a str, os.PathLike or None.
        ValueError: at this call, when ``path`` is a folder, or cannot be written (its
            nearest existing ancestor is a file or not writable, or the file exists and is
            read-only). Nothing is created by the check.
    """
    if path is not None:
        path = _check_trace_path(path)
    return _trace_block(path)


@contextlib.contextmanager
def _trace_block(path: str | None):
    _C.trace_start()
    trace = ActivationTrace()
    try:
        yield trace
    finally:
        trace.items = list(_C.trace_stop())
        if path is not None:
            trace.write(path)
