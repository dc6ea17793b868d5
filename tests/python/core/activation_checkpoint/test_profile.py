"""The profiler's copy-link fit (_profile.py): it times the engine's copies, not compute.

The planner's cost model sees a copy of n bytes as latency + n * seconds_per_byte. These
tests check the fit on exact synthetic samples, the service times read off a timeline, and
that the link measured on the CPU backend carries its per-byte delay and not the probe's
compute (the wall-clock probe it replaces counted a sin forward and backward as link time).
"""

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.core.activation_checkpoint._profile import (
    _copy_points,
    fit_copy_link,
    measure_copy_links,
)


def test_fit_recovers_an_exact_line_whatever_the_sample_counts():
    lat, spb = 40e-6, 1.5e-9
    pts = [(b, lat + spb * b) for b in (1 << 16, 1 << 20) for _ in range(7)]
    pts += [(1 << 22, lat + spb * (1 << 22))]
    link = fit_copy_link(pts)
    assert link.latency_seconds == pytest.approx(lat, rel=1e-9)
    assert link.seconds_per_byte == pytest.approx(spb, rel=1e-9)


def test_fit_takes_the_median_per_size():
    # One outlier per size does not move the fit (the median of three).
    pts = [(1000, 1.0), (1000, 1.0), (1000, 50.0), (3000, 2.0), (3000, 2.0), (3000, 90.0)]
    link = fit_copy_link(pts)
    assert link.seconds_per_byte == pytest.approx(0.0005)
    assert link.latency_seconds == pytest.approx(0.5)


def test_fit_degenerate_cases():
    assert fit_copy_link([(100, 2e-6)]).seconds_per_byte == pytest.approx(2e-8)
    through_origin = fit_copy_link([(100, 0.0), (200, 3.0)])  # latency would be < 0
    assert through_origin.latency_seconds == 0.0
    assert through_origin.seconds_per_byte == pytest.approx(3.0 * 200 / (100 ** 2 + 200 ** 2))
    assert fit_copy_link([(100, 5.0), (200, 1.0)]).seconds_per_byte == 0.0
    with pytest.raises(ValueError, match="hyper_parallel: no copy samples"):
        fit_copy_link([])


def _copy(stream, nbytes, enqueue, start, end, device=0):
    return {"kind": "copy", "stream": stream, "bytes": nbytes, "enqueue_ns": enqueue,
            "start_ns": start, "end_ns": end, "device": device}


def test_copy_points_are_service_times_on_a_fifo_stream():
    items = [
        _copy("d2h", 10, 0, 5, 100),        # idle stream: from its enqueue
        _copy("d2h", 20, 50, 100, 300),     # queued behind the first: from its end
        _copy("h2d", 30, 400, 410, 500),
        _copy("d2h", 40, 1000, 1001, 1101),
        {"kind": "wait", "stream": "compute", "bytes": 0, "enqueue_ns": 0, "start_ns": 0,
         "end_ns": 9, "device": 0},
    ]
    pts = _copy_points(items)
    assert [b for b, _ in pts["d2h"]] == [10, 20, 40]
    assert [t * 1e9 for _, t in pts["d2h"]] == pytest.approx([100, 200, 101])
    assert [(b, round(t * 1e9)) for b, t in pts["h2d"]] == [(30, 100)]


@pytest.mark.parametrize("delay_ns", [0.5, 2.0])
def test_cpu_link_carries_the_delay_and_not_the_probes_compute(delay_ns):
    manager = SwapManager()
    manager.set_cpu_swap(True, delay_ns_per_byte=delay_ns)
    try:
        d2h, h2d = measure_copy_links(torch.device("cpu"), 1 << 21)
    finally:
        manager.set_cpu_swap(False, delay_ns_per_byte=0.0)
    for link in (d2h, h2d):
        # The worker sleeps delay x bytes before each copy: at least that per byte. (No
        # upper bound: a loaded machine lengthens copies; the benchmark shows the fit.)
        assert link.seconds_per_byte >= 0.9 * delay_ns * 1e-9
        assert link.seconds(1 << 21) >= delay_ns * 1e-9 * (1 << 21)
