"""The accelerator copy path (AcceleratorCopyEngine, pinned pool, in-place free and refill)
on the simulated device of tests/sim (HP_TEST_DEVICE=hpsim; scripts/test.sh runs it).

The race tests switch one step of the protocol off in the simulation and show the failure
is caught, then show the real protocol passes: a test here can fail.
"""

import os

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import SwapManager, swap, swap_wrapper

from ._models import Stack, grads, twin

pytestmark = [
    pytest.mark.skipif(not os.environ.get("HP_TEST_DEVICE", "").startswith("hpsim"),
                       reason="needs the simulated device: HP_TEST_DEVICE=hpsim"),
    pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning"),
]

DEV = torch.device("hpsim", 0) if os.environ.get("HP_TEST_DEVICE", "").startswith("hpsim") else None


@pytest.fixture
def sim():
    from tests.sim import hpsim

    hpsim.configure()
    yield hpsim
    torch.hpsim.synchronize(0)
    hpsim.configure()


def chain(layers=4, d=32):
    ref = Stack(layers=layers, d=d).to(DEV)
    model = twin(ref)
    for i in range(layers):
        model.layers[i] = swap_wrapper(model.layers[i])
    for i in range(layers - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    return ref, model


def same(a_list, b_list):
    return all(torch.equal(a, b) for a, b in zip(a_list, b_list))


def test_chain_runs_on_the_accelerator_engine(sim):
    ref, model = chain()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pinned_after_warmup = host_allocs_after_warmup = None
    for step in range(4):
        x = torch.randn(4, 8, 32).to(DEV)
        copies0, base = sim.copy_stats(), sim.memory_stats()["allocated_bytes"]
        stats0 = SwapManager().stats()
        loss_ref = ref(x)
        held_ref = sim.memory_stats()["allocated_bytes"] - base
        loss_ref.backward()
        base = sim.memory_stats()["allocated_bytes"]
        loss = model(x)
        held_swap = sim.memory_stats()["allocated_bytes"] - base
        stats1 = SwapManager().stats()
        # End of forward: the swapped layers' saved storages left device memory.
        offloaded = stats1["offload_bytes"] - stats0["offload_bytes"]
        assert offloaded > 0
        assert held_ref - held_swap >= offloaded
        loss.backward()
        assert torch.equal(loss, loss_ref)
        assert same(grads(model), grads(ref))
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        stats2, copies = SwapManager().stats(), sim.copy_stats()
        moved = (stats2["offload_bytes"] + stats2["reload_bytes"]
                 - stats0["offload_bytes"] - stats0["reload_bytes"])
        # Every swap byte crossed the simulated link between device and pinned memory,
        # and every reload refilled its storage through the PrivateUse1 resize hook.
        assert copies["pinned_bytes"] - copies0["pinned_bytes"] == moved
        assert (copies["storage_resizes"] - copies0["storage_resizes"]
                == stats2["reload_count"] - stats0["reload_count"])
        if step == 0:
            pinned_after_warmup = copies["pinned_allocations"]
            host_allocs_after_warmup = stats2["host_allocations"]
    assert same(list(model.parameters()), list(ref.parameters()))
    stats = SwapManager().stats()
    assert stats["on_demand_reloads"] == 0
    assert stats["reload_bytes"] == stats["offload_bytes"]
    # Steady state: no new pinned host memory after the first step.
    assert sim.copy_stats()["pinned_allocations"] == pinned_after_warmup
    assert stats["host_allocations"] == host_allocs_after_warmup
    assert stats["host_reuses"] > 0


# ------------------------------------------------------------------------------ races

def unscheduled_round_trip(d=64):
    """One swap region, offloaded at its end and reloaded on demand at its first unpack:
    the H2D is queued right before compute reads it (the tightest window)."""
    torch.manual_seed(0)
    ref = Stack(layers=1, d=d).to(DEV)
    model = twin(ref)
    x = torch.randn(4, 16, d).to(DEV)
    swap(model, x).backward()
    ref(x).backward()
    return same(grads(model), grads(ref))


def test_race_compute_reads_reload_before_its_h2d_event(sim):
    sim.configure(link_ns_per_byte=500.0, honor_default_stream_waits=False)
    assert not unscheduled_round_trip(), "a read before the H2D event went unnoticed"
    torch.hpsim.synchronize(0)
    sim.configure(link_ns_per_byte=500.0)
    assert unscheduled_round_trip()
    assert sim.stream_wait_seconds(0, 0) > 0  # the compute stream did wait for the H2D


def chain_with_reuse():
    """A 4-layer chain: the next layers' forwards allocate blocks of the sizes the released
    layers freed, while their D2H copies are still on the slow link."""
    torch.manual_seed(0)
    ref, model = chain(layers=4, d=32)
    x = torch.randn(4, 8, 32).to(DEV)
    model(x).backward()
    ref(x).backward()
    return same(grads(model), grads(ref))


def test_race_storage_reused_by_compute_while_its_d2h_is_in_flight(sim):
    sim.configure(link_ns_per_byte=500.0, honor_record_stream=False)
    assert not chain_with_reuse(), "a block reused during its D2H went unnoticed"
    torch.hpsim.synchronize(0)
    sim.configure(link_ns_per_byte=500.0)
    held = sim.memory_stats()["deferred_reuses"]
    assert chain_with_reuse()
    assert sim.memory_stats()["deferred_reuses"] > held  # recordDataPtrOnStream held blocks


def test_host_read_of_device_memory_crashes_under_protection(tmp_path):
    """PROT_NONE device memory: stream tasks may touch it, the host may not."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(
        "import torch\n"
        "from tests.sim import hpsim\n"
        "dev = hpsim.load()\n"
        "hpsim.configure(protect=True)\n"
        "x = torch.arange(4096.0).to(dev)\n"
        "assert torch.equal((x * 2).cpu(), torch.arange(4096.0) * 2)\n"
        "print('ok', flush=True)\n"
        "torch.ops.hpsim.unsafe_host_read(x)\n"
        "print('not reached', flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=root)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert proc.returncode < 0  # killed by SIGSEGV


def test_pinned_block_not_reused_while_its_h2d_reads_it(sim):
    """The host pool is shared by every device. Device 0 reloads from block X on a slow link
    (the compute stream only waits on the device, the host runs on); device 1 then offloads
    a tensor of X's size class. Its D2H is short, so had it been given X it would overwrite
    X before device 0's H2D read it. The pool hands out a fresh block instead, and X again
    once its H2D has finished. (The same race with the wait removed is caught in
    tests/sim/SimDeviceTest.cpp, HostBlockIsNotReusedBeforeItsCopyFinished.)"""
    from hyper_parallel.core.activation_checkpoint import swap_tensor_wrapper

    sim.configure(link_ns_per_byte=20000.0)  # 4 KiB: 82 ms on the link; 64 B: 1.3 ms
    manager = SwapManager()
    dev0, dev1 = torch.device("hpsim", 0), torch.device("hpsim", 1)
    a_host, b_host = torch.randn(1024), torch.randn(16)  # 4096 B and 64 B: one size class

    def saved_square(name, host, device):
        leaf = host.to(device).requires_grad_()
        with manager.group_context(name):
            y = swap_tensor_wrapper(leaf * 1.0)
            out = (y * y).sum()
        return leaf, out

    leaf_a, out_a = saved_square("a", a_host, dev0)
    manager.launch_offload("a")
    manager.wait_offload("a")
    manager.launch_load("a")
    manager.wait_load("a")  # a stream wait: the H2D from X is still on the link
    assert manager.stats()["host_bytes_pending"] >= 4096  # X waits for its H2D
    before = manager.stats()
    leaf_b, out_b = saved_square("b", b_host, dev1)
    manager.launch_offload("b")
    assert manager.stats()["offload_count"] == before["offload_count"] + 1
    manager.wait_offload("b")
    manager.launch_load("b")
    manager.wait_load("b")
    out_a.backward()
    out_b.backward()
    # Both saved tensors came back intact: d(sum y^2)/dx = 2y.
    assert torch.equal(leaf_a.grad.cpu(), 2 * a_host)
    assert torch.equal(leaf_b.grad.cpu(), 2 * b_host)
    # Once X's H2D is done, the next offload of its class reuses it.
    torch.hpsim.synchronize(0)
    reuses = manager.stats()["host_reuses"]
    leaf_c, out_c = saved_square("c", b_host, dev1)
    manager.launch_offload("c")
    assert manager.stats()["host_reuses"] == reuses + 1


def test_torch_stream_and_event_work_on_the_simulated_device(sim):
    """The DeviceGuardImpl behind torch.Stream / torch.Event: record, wait, query, timing."""
    sim.configure(link_ns_per_byte=20000.0)  # a 4 KiB pinned copy takes ~82 ms
    side = torch.Stream(device=DEV)
    start, end = torch.Event(device=DEV, enable_timing=True), torch.Event(
        device=DEV, enable_timing=True)
    host = torch.arange(1024.0).pin_memory()
    assert host.is_pinned()
    out = torch.empty(1024, device=DEV)
    with torch.accelerator.stream(side) if hasattr(torch.accelerator, "stream") else side:
        start.record(side)
        out.copy_(host, non_blocking=True)  # asynchronous: pinned source
        end.record(side)
    assert not end.query()
    torch.accelerator.current_stream(DEV).wait_event(end)
    assert torch.equal(out.cpu(), torch.arange(1024.0))  # compute stream ordered after it
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 80.0  # milliseconds


def test_conjugate_and_negative_views_copy_and_swap(sim):
    """Copies of lazily conjugated or negated tensors (x.conj(), _neg_view) to, from and on
    the simulated device: the math-bit fallbacks used to materialize the source through
    clone -> copy_ -> _copy_from and back (a stack overflow: segfault on x.conj().exp())."""
    from hyper_parallel.core.activation_checkpoint import SwapManager, swap

    c = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    r = torch.randn(6, generator=torch.Generator().manual_seed(1))
    x = c.to(DEV)
    assert torch.equal(x.conj().exp().cpu(), c.conj().exp())
    assert torch.equal(x.conj().cpu(), c.conj())
    assert torch.equal(c.conj().to(DEV).cpu(), c.conj())
    assert torch.equal(r.to(DEV)._neg_view().cpu(), -r)
    assert torch.equal(r._neg_view().to(DEV).cpu(), -r)
    into = torch.empty(6, dtype=torch.complex64, device=DEV)
    into.copy_(x.conj())
    assert torch.equal(into.cpu(), c.conj())
    # A saved conjugate view offloaded and reloaded by a swap region.
    manager = SwapManager()
    leaf = x.clone().requires_grad_()
    out = swap(lambda t: t.conj().exp().abs().sum(), leaf)
    manager.synchronize()
    out.backward()
    want = c.clone().requires_grad_()
    want.conj().exp().abs().sum().backward()
    assert torch.equal(leaf.grad.cpu(), want.grad)
