"""The profiler's clock: wall time the calling thread was not kept off the CPU.

On a CPU device every layer's compute runs on the thread that calls it, so when another
process takes that thread's core the layer's wall time grows by however long the thread
waited, runnable, for a CPU. Measured on a shared 2-core machine (load average about 2,
8-layer Llama step, 24 steps per strategy): the wall time of one step varied with a
coefficient of variation of 25-32 %; less the thread's run-queue wait, 7-10 %
(docs/benchmarks.md, "Planner"). The planner picks per layer whatever was measured
fastest, so such noise becomes plan error.

``unpreempted_clock()`` is ``time.perf_counter()`` less the calling thread's total
run-queue wait, read from Linux's per-thread scheduler statistics
(``/proc/thread-self/schedstat``: time on a CPU, time waiting on a run queue, timeslices,
in nanoseconds; see the kernel's Documentation/scheduler/sched-stats.rst). Differences of
two readings on the same thread are seconds the thread ran or waited for something
other than a CPU (a lock, a copy, the device). Where the file is missing (not Linux, a
kernel without scheduler statistics) it is ``time.perf_counter()``.

On an accelerator the device runs on while the host thread waits for a CPU, so
``step_clock`` gives the plain wall clock there: subtracting the wait would under-count
a step that the device, not the host, paces.

Thread-safety: each thread reads its own statistics through a file it opens once (kept in
a ``threading.local``, closed when the thread ends; a forked child opens its own). A
reading costs about 5 us (two reads of the file).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch

_SCHEDSTAT = "/proc/thread-self/schedstat"
_local = threading.local()
_available: bool | None = None


def _after_fork_in_child() -> None:
    # The open files name the parent's threads (/proc/thread-self resolves when opened): a
    # forked child reads its own from a fresh local.
    global _local
    _local = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _run_queue_wait_s() -> float | None:
    """Seconds the calling thread has waited, runnable, for a CPU since it started; None
    where the kernel does not say."""
    f = getattr(_local, "schedstat", None)
    if f is None:
        try:
            f = open(_SCHEDSTAT, "rb", buffering=0)
        except OSError:
            return None
        _local.schedstat = f
    try:
        fields = os.pread(f.fileno(), 96, 0).split()
        return int(fields[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


def unpreempted_available() -> bool:
    """Whether this kernel gives the run-queue wait (else the clock is the wall clock)."""
    global _available
    if _available is None:
        _available = _run_queue_wait_s() is not None
    return _available


def unpreempted_clock() -> float:
    """Seconds, monotonic per thread: ``time.perf_counter()`` less the calling thread's
    run-queue wait. Only differences of readings on the same thread mean anything.

    The wall clock and the wait are two reads; a preemption between them (the kernel adds
    the wait when the thread runs again) would pair a wall time with a wait that ends
    later and step the clock back by the wait (a fuzzer, session 26: steps back of
    milliseconds on a loaded 2-core machine, and a correct model refused as running its
    layers out of order). So the wait is read before and after the wall clock and the
    three reads are taken again until both waits agree (no preemption ended between them),
    and a reading below the thread's last one returns the last one."""
    if not unpreempted_available():
        return time.perf_counter()
    now, wait = 0.0, None
    for _ in range(8):
        before = _run_queue_wait_s()
        now = time.perf_counter()
        wait = _run_queue_wait_s()
        if before is None or wait is None or before == wait:
            break
    if wait is None:  # the file failed this once: the last wait read stands
        wait = getattr(_local, "wait", 0.0)
    _local.wait = wait
    value = now - wait
    last = getattr(_local, "last", None)
    if last is not None and value < last:
        value = last
    _local.last = value
    return value


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock to time a step's host-paced parts on ``device`` with: the unpreempted
    clock on the CPU (where it is available), ``time.perf_counter`` elsewhere."""
    if torch.device(device).type == "cpu" and unpreempted_available():
        return unpreempted_clock
    return time.perf_counter
