"""Faults of the process around the engine (issue 18): fork, interrupts at any line of the
region code, dead deep copies, race tests that can fail, and knobs validated at the
boundary."""

import copy
import gc
import io
import os
import signal
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import SwapManager, swap, swap_wrapper
from hyper_parallel.core.activation_checkpoint import _region, _swap_manager

pytestmark = pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def _chain(n=4, d=32, wrap=swap_wrapper):
    torch.manual_seed(0)
    plain = nn.ModuleList(MLP(d) for _ in range(n))
    layers = nn.ModuleList(wrap(copy.deepcopy(m)) if wrap else copy.deepcopy(m) for m in plain)
    for i in range(n - 1):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    return plain, layers


def _step(layers, x):
    h = x
    for m in layers:
        h = m(h)
    params = [p for m in layers for p in m.parameters()]
    return torch.autograd.grad(h.pow(2).mean(), params)


# -- 1. fork ----------------------------------------------------------------------------

def _wait_child(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_trains_and_finishes_the_parents_step(cpu_swap, dev):
    # The parent forwards (copies in flight on a slow link), then forks: the child runs
    # that step's backward and a new step; both must finish with the right gradients.
    if dev.type != "cpu":
        pytest.skip("CUDA cannot be used in a forked child")
    SwapManager().set_cpu_swap(True, delay_ns_per_byte=2.0)
    plain, layers = _chain()
    x = torch.randn(8, 16, 32)
    ref = _step(plain, x)
    _step(layers, x)  # warm-up in the parent: the copy workers exist now
    h = x
    for m in layers:
        h = m(h)
    params = [p for m in layers for p in m.parameters()]
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            # libgomp's thread team does not survive fork (torch's own matmuls would hang,
            # with or without us); torch's DataLoader workers make the same call.
            torch.set_num_threads(1)
            got = torch.autograd.grad(h.pow(2).mean(), params)
            again = _step(layers, x)
            ok = all(torch.equal(a, b) for a, b in zip(got, ref))
            ok = ok and all(torch.equal(a, b) for a, b in zip(again, ref))
            code = 0 if ok else 3
        finally:
            os._exit(code)
    assert _wait_child(pid, 60) == 0, "the forked child hung or computed wrong gradients"
    got = torch.autograd.grad(h.pow(2).mean(), params)  # the parent is unaffected
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


# -- 2. interrupts at every line of the region code --------------------------------------

def _lines(fn):
    code = fn.__code__
    return sorted({line for _, _, line in code.co_lines() if line and line > code.co_firstlineno})


_TARGETS = [_region.Region.__enter__, _region.Region.__exit__,
            _swap_manager._LayerNode.pre_hook, _swap_manager._LayerNode.post_hook,
            _swap_manager._LayerNode.post_hook_always]
_CASES = [(fn, line) for fn in _TARGETS for line in _lines(fn)]


class _Interrupt:
    """A tracer that raises KeyboardInterrupt the first time `line` of `code` starts."""

    def __init__(self, code, line):
        self.code, self.line, self.fired = code, line, False

    def __call__(self, frame, event, arg):
        if frame.f_code is not self.code:
            return None
        return self._local

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line and not self.fired:
            self.fired = True
            raise KeyboardInterrupt(f"injected at line {self.line}")
        return self._local


@pytest.mark.parametrize("fn,line", _CASES,
                         ids=[f"{fn.__qualname__}:{line}" for fn, line in _CASES])
def test_interrupt_at_any_line_leaves_no_stale_state(cpu_swap, dev, fn, line):
    # A chain of plain modules (module hooks open the regions) and swap wrappers, plus an
    # unscheduled swap() call after it; one step is interrupted at the given line.
    torch.manual_seed(0)
    plain = nn.ModuleList(MLP() for _ in range(4)).to(dev)
    layers = copy.deepcopy(plain)
    layers[1] = swap_wrapper(layers[1])
    layers[3] = swap_wrapper(layers[3])
    for i in range(3):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    tail = MLP().to(dev)
    x = torch.randn(4, 8, 32, device=dev)

    def run(mods, use_swap):
        h = x
        for m in mods:
            h = m(h)
        h = swap(tail, h) if use_swap else tail(h)
        params = [p for m in mods for p in m.parameters()] + list(tail.parameters())
        return torch.autograd.grad(h.pow(2).mean(), params)

    ref = run(plain, False)
    tracer = _Interrupt(fn.__code__, line)
    sys.settrace(tracer)
    try:
        run(layers, True)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    gc.collect()
    # The next step behaves as in a fresh process (SPEC 4.6), without any reset.
    SwapManager().reset_stats()
    got = run(layers, True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert _C.current_group() is None
    assert _C.thread_region_count() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    before = SwapManager().stats()["offload_bytes"]
    with torch.enable_grad():
        out = swap(tail, x.clone().requires_grad_())  # unscheduled: joins no stale group
    assert SwapManager().stats()["offload_bytes"] > before
    out.sum().backward()


def test_reset_clears_regions_left_open_on_this_and_other_threads(cpu_swap, dev):
    region = _region.Region(-1, "left-open", _region.SWAP_ALL)
    region.__enter__()  # never exited, as if interrupted
    assert _C.current_group() is not None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    SwapManager().reset()
    assert _C.current_group() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    region.__exit__(None, None, None)  # a late exit is harmless
    assert _C.current_group() is None


# -- 3. the schedule does not grow with dead deep copies ---------------------------------

def test_dead_copies_leave_the_schedule(cpu_swap, dev):
    _, base = _chain(6, 16)
    base = base.to(dev)
    gc.collect()
    start = _C.scheduled_layer_count()
    def one_copy_step():
        c = copy.deepcopy(base)
        h = torch.randn(2, 16, device=dev)
        for m in c:
            h = m(h)
        h.sum().backward()

    for _ in range(30):
        one_copy_step()
    gc.collect()
    assert _C.scheduled_layer_count() == start
    del base
    gc.collect()
    assert _C.scheduled_layer_count() == start - 6


# -- 5. the race tests can fail ----------------------------------------------------------

def test_race_test_fails_without_the_reload_wait(cpu_swap, dev):
    # With a slow link and the H2D wait removed (fault injection), backward reads storages
    # whose bytes have not arrived: the gradients must come out wrong. With the wait, the
    # same run is bitwise right. This is what makes the CPU race tests able to fail.
    if dev.type != "cpu":
        pytest.skip("fault injection is exercised on the CPU backend")
    SwapManager().set_cpu_swap(True, delay_ns_per_byte=20.0)
    SwapManager().set_prefetch_depth(0)  # reload when each layer's own backward starts
    plain, layers = _chain(4, 64)
    x = torch.randn(8, 16, 64)
    ref = _step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(_step(layers, x), ref))
    # A link slow enough (65 us per KiB) that no read can come after its copy by luck.
    SwapManager().set_cpu_swap(True, delay_ns_per_byte=1000.0)
    _C._set_skip_reload_wait(True)
    try:
        broken = _step(layers, x)
    finally:
        _C._set_skip_reload_wait(False)
        SwapManager().synchronize()
        SwapManager().set_cpu_swap(True, delay_ns_per_byte=20.0)
    assert not all(torch.equal(a, b) for a, b in zip(broken, ref))
    assert all(torch.equal(a, b) for a, b in zip(_step(layers, x), ref))


# -- 6. knobs are validated at the boundary -----------------------------------------------

@pytest.mark.parametrize("depth", [2**31, -1, 1.5, True, "2"])
def test_prefetch_depth_is_validated(depth):
    with pytest.raises(ValueError, match="hyper_parallel: prefetch depth"):
        SwapManager().set_prefetch_depth(depth)
    assert SwapManager().get_prefetch_depth() == 1


@pytest.mark.parametrize("delay", [float("inf"), float("nan"), -1.0, "abc", 1e12])
def test_cpu_swap_delay_is_validated(delay):
    with pytest.raises(ValueError, match="hyper_parallel: delay_ns_per_byte"):
        SwapManager().set_cpu_swap(True, delay)
    assert not SwapManager().cpu_swap_enabled()  # nothing changed


def test_cpu_swap_flag_must_be_bool():
    with pytest.raises(ValueError, match="hyper_parallel: set_cpu_swap"):
        SwapManager().set_cpu_swap("yes")


def test_delay_environment_variable_is_validated(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_CPU_SWAP_DELAY_NS_PER_BYTE", "abc")
    monkeypatch.setattr(_swap_manager.SwapManager, "_instance", None)
    try:
        with pytest.raises(ValueError, match="HYPER_PARALLEL_CPU_SWAP_DELAY_NS_PER_BYTE='abc'"):
            SwapManager()
    finally:
        monkeypatch.undo()
    SwapManager()


def test_engine_rejects_bad_delay_directly():
    with pytest.raises(ValueError, match="hyper_parallel: the CPU swap delay"):
        _C.set_cpu_delay_ns_per_byte(float("inf"))


@pytest.mark.parametrize("nbytes", [0, -5, 2.5, 2**63])
def test_group_swap_threshold_is_validated(nbytes):
    with pytest.raises(ValueError, match="hyper_parallel: the group_swap threshold"):
        SwapManager().set_group_swap_threshold(nbytes)


def test_loaded_model_gets_fresh_layer_ids(cpu_swap, dev):
    plain, layers = _chain(3, 16)
    layers = layers.to(dev)
    buf = io.BytesIO()
    torch.save(layers, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = {_swap_manager.layer_node(m).layer_id for m in layers}
    new_ids = {_swap_manager.layer_node(m).layer_id for m in loaded}
    assert len(new_ids) == 3 and not ids & new_ids
    for i in range(2):  # the loaded chain is linked among itself
        assert _swap_manager.layer_node(loaded[i]).next is _swap_manager.layer_node(loaded[i + 1])
    x = torch.randn(4, 16, device=dev)
    SwapManager().reset_stats()
    assert all(torch.equal(a, b) for a, b in zip(_step(loaded, x), _step(plain.to(dev), x)))
    assert SwapManager().stats()["offload_bytes"] > 0


# -- 5. storages changed outside the engine ----------------------------------------------

class _ExpBlock(nn.Module):
    """exp saves its output: the block's output is a saved tensor of its own layer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.exp(self.lin(x) * 0.1)


def _exp_chain(dev, d=16):
    """Four _ExpBlocks on `dev`, plain and as a chain of swap wrappers, and an input."""
    torch.manual_seed(0)
    plain = nn.ModuleList(_ExpBlock(d) for _ in range(4)).to(dev)
    layers = nn.ModuleList(swap_wrapper(copy.deepcopy(m)) for m in plain)
    for a, b in zip(layers, list(layers)[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    return plain, layers, torch.randn(8, d, device=dev)


@pytest.mark.parametrize("which", ["held_by_caller", "last_layer"])
def test_a_saved_storage_freed_outside_the_engine_is_a_clear_error(cpu_swap, dev, which):
    # (tester, session 18) The caller freed a saved tensor's storage after the forward
    # (untyped_storage().resize_(0), as FSDP does with its own buffers): the backward
    # failed on an internal assertion asking for a bug report to PyTorch. It is the
    # caller's error (plain torch fails there too); it now says so, and the next step
    # trains as before.
    plain, layers, x = _exp_chain(dev)
    h, outs = x, []
    for m in layers:
        h = m(h)
        outs.append(h)
    loss = h.sum()  # (saves nothing: only the layers' saves read the freed storage)
    victim = outs[0] if which == "held_by_caller" else outs[-1]
    victim.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"hyper_parallel: a tensor saved for backward .* "
                                           r"has a storage of 0 bytes, but it held 512"):
        loss.backward()
    del h, outs, victim, loss
    for m in layers:
        m.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(_step(layers, x), _step(plain, x)))


def test_a_saved_storage_grown_outside_the_engine_is_read_as_plain_torch_reads_it(cpu_swap, dev):
    # (tester 3, session 18) resize_ to a larger size keeps the values: plain torch's
    # backward reads them, and the check above refused it as "resized or freed".
    plain, layers, x = _exp_chain(dev)

    def grads(stack):
        h, outs = x, []
        for m in stack:
            h = m(h)
            outs.append(h)
        storage = outs[0].untyped_storage()
        storage.resize_(2 * storage.nbytes())
        params = [p for m in stack for p in m.parameters()]
        return torch.autograd.grad(h.sum(), params)

    assert all(torch.equal(a, b) for a, b in zip(grads(layers), grads(plain)))
