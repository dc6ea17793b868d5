"""hyper_parallel.activation_trace: the swap timeline (Trace.h, _trace.py)."""

import json

import pytest
import torch

import hyper_parallel
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

from ._models import Stack, grads, twin


def chain(dev, layers=4):
    ref = Stack(layers=layers).to(dev)
    model = twin(ref)
    for i in range(layers):
        model.layers[i] = swap_wrapper(model.layers[i])
    for i in range(layers - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    return ref, model


def test_trace_counts_equal_stats_and_copies_are_ordered(cpu_swap, dev, tmp_path):
    ref, model = chain(dev)
    x = torch.randn(4, 8, 32, device=dev)
    before = SwapManager().stats()
    path = tmp_path / "out" / "trace.json"
    with hyper_parallel.activation_trace(path) as trace:
        model(x).backward()
    after = SwapManager().stats()
    ref(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(ref)))

    counts = trace.counts()
    for key in ("offload_count", "offload_bytes", "reload_count", "reload_bytes",
                "on_demand_reloads"):
        assert counts.get(key, 0) == after[key] - before[key], key
    assert counts["offload_count"] > 0

    items = trace.items
    copies = [it for it in items if it["kind"] == "copy"]
    for it in copies:
        assert it["enqueue_ns"] <= it["start_ns"] <= it["end_ns"], it
    # No reload starts before its offload ended; every wait ends after its reload ended.
    d2h_end = {}
    for it in copies:
        if it["stream"] == "d2h":
            d2h_end[it["label"]] = max(d2h_end.get(it["label"], 0), it["end_ns"])
    h2d_end = {}
    for it in copies:
        if it["stream"] == "h2d":
            assert it["start_ns"] >= d2h_end[it["label"]], it
            h2d_end[it["label"]] = max(h2d_end.get(it["label"], 0), it["end_ns"])
    waits = [it for it in items if it["kind"] == "wait"]
    for it in waits:
        assert it["end_ns"] >= h2d_end[it["label"]], it
    # Frees and refills match the copies; one forward range per layer, backward ranges.
    assert sum(it["count"] for it in items if it["kind"] == "free") == counts["offload_count"]
    assert sum(it["count"] for it in items if it["kind"] == "refill") == counts["reload_count"]
    assert len([it for it in items if it["kind"] == "forward"]) == 4
    assert len([it for it in items if it["kind"] == "backward"]) >= 3

    data = json.loads(path.read_text())
    names = {e["name"] for e in data["traceEvents"]}
    assert any(n.startswith("offload SwapWrapper#") for n in names)
    assert any(n.startswith("reload SwapWrapper#") for n in names)
    tracks = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert "D2H stream: offloads" in tracks and "H2D stream: reloads" in tracks


def test_on_demand_reload_is_in_the_trace(cpu_swap, dev):
    """A manual group offloaded and never loaded: backward reloads it on demand."""
    from hyper_parallel.core.activation_checkpoint import swap_tensor_wrapper

    w = torch.randn(8, 8, device=dev, requires_grad=True)
    x = torch.randn(4, 8, device=dev)
    with hyper_parallel.activation_trace() as trace:
        with SwapManager().group_context("manual"):
            y = swap_tensor_wrapper(torch.sin(x @ w))
            out = (y * y).sum()
        del y
        SwapManager().launch_offload("manual")
        out.backward()
    counts = trace.counts()
    assert counts["on_demand_reloads"] == SwapManager().stats()["on_demand_reloads"] == 1
    assert [it["label"] for it in trace.items if it["kind"] == "on_demand"] == ["manual"]


def test_one_trace_at_a_time_and_off_afterwards():
    with hyper_parallel.activation_trace():
        with pytest.raises(RuntimeError, match="hyper_parallel: .*already recording"):
            with hyper_parallel.activation_trace():
                pass
    with hyper_parallel.activation_trace() as trace:
        pass
    assert trace.items == []


def test_engine_calls_show_in_torch_profiler(cpu_swap, dev):
    if dev.type == "cpu":
        pytest.skip("the profiler ranges are emitted by the accelerator copy engine")
    ref, model = chain(dev)
    x = torch.randn(4, 8, 32, device=dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).backward()
    names = {e.name for e in prof.events()}
    assert {"hyper_parallel::offload", "hyper_parallel::reload"} <= names


def test_unwritable_trace_path_fails_at_entry_without_creating_it(tmp_path):
    """Tester fault: activation_trace('/nonexistent/dir/x.json') failed only at exit."""
    from hyper_parallel.core.activation_checkpoint import activation_trace

    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"^hyper_parallel: activation_trace cannot write .*"
                                         r"is a file, not a folder"):
        activation_trace(blocker / "dir" / "x.json")
    with pytest.raises(ValueError, match=r"^hyper_parallel: activation_trace path .* is a "
                                         r"folder"):
        activation_trace(tmp_path)
    with pytest.raises(TypeError, match=r"^hyper_parallel: activation_trace's path must be "):
        activation_trace(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    target = tmp_path / "new" / "t.json"
    with activation_trace(target):  # a missing folder under a writable one is fine
        pass
    assert target.exists()
