"""PinnedMemoryPool: a capped host pool for swapped activations (issue 16)."""

import copy
import warnings

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, PinnedMemoryPool, SwapManager, async_save_on_cpu, checkpoint,
    checkpoint_wrapper, swap, swap_tensor_wrapper, swap_wrapper)

D = 32


def _mlp(dev):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)).to(dev)


def test_swapped_activations_use_the_given_pool(cpu_swap, dev):
    model = _mlp(dev)
    ref = copy.deepcopy(model)
    pool = PinnedMemoryPool(1 << 20)
    x = torch.randn(8, D, device=dev)
    engine_before = SwapManager().stats()["pinned_bytes_in_use"]
    xs = x.clone().requires_grad_()
    out = swap(model, xs, cpu_pool=pool)
    SwapManager().synchronize()
    held = pool.stats()["bytes_in_use"]
    assert held >= 8 * 4 * D * 4  # at least the GELU input, offloaded into this pool
    assert SwapManager().stats()["pinned_bytes_in_use"] == engine_before  # not the engine's
    out.square().sum().backward()
    SwapManager().synchronize()
    st = pool.stats()
    assert st["bytes_in_use"] == 0
    assert st["bytes_in_use"] + st["bytes_pending"] + st["bytes_cached"] <= pool.max_host_bytes
    ref_x = x.clone().requires_grad_()
    ref(ref_x).square().sum().backward()
    assert torch.equal(xs.grad, ref_x.grad)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_steady_loop_reuses_the_pools_blocks(cpu_swap, dev):
    model = _mlp(dev)
    pool = PinnedMemoryPool(1 << 20)
    wrapped = swap_wrapper(model, cpu_pool=pool)
    allocations = []
    for _ in range(4):
        wrapped(torch.randn(8, D, device=dev)).sum().backward()
        SwapManager().synchronize()
        allocations.append(pool.stats()["allocations"])
    assert allocations[0] > 0 and allocations[-1] == allocations[1]  # no growth after warm-up
    assert pool.stats()["reuses"] > 0


def test_a_full_pool_raises_naming_its_cap_and_loses_nothing(cpu_swap, dev):
    model = _mlp(dev)
    pool = PinnedMemoryPool(4096)  # one page: the 4 KiB GELU input of 8x128 floats fits...
    x = torch.randn(8, D, device=dev, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"hyper_parallel: host pool full.*cap of 4096 bytes"):
        swap(model, x, cpu_pool=pool)  # ...the next tensor does not
    # The tensors that stayed on device were not touched, and the engine works on.
    out = swap(model, x, cpu_pool=PinnedMemoryPool(1 << 20))
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    g = x.grad.clone()
    model.zero_grad()
    model(xr).sum().backward()
    assert torch.equal(g, xr.grad)


def test_checkpoint_must_swap_and_registered_tensors_use_the_pool(cpu_swap, dev):
    model = _mlp(dev)
    ref = copy.deepcopy(model)
    pool = PinnedMemoryPool(1 << 20)
    x = torch.randn(8, D, device=dev)
    policy = {torch.ops.aten.addmm.default: CheckpointPolicy.MUST_SWAP}
    xs = x.clone().requires_grad_()
    out = checkpoint(model, xs, policy_fn=policy, cpu_pool=pool)
    SwapManager().synchronize()
    assert pool.stats()["bytes_in_use"] >= 8 * 4 * D * 4
    out.sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr).sum().backward()
    assert torch.equal(xs.grad, xr.grad)

    pool2 = PinnedMemoryPool(1 << 20)

    def body(t):
        h = swap_tensor_wrapper(t * 3, cpu_pool=pool2)
        return (h * h).exp()  # saves h after its registration

    t = torch.randn(64, D, device=dev, requires_grad=True)
    with SwapManager().group_context("pooled"):
        y = body(t)
    SwapManager().launch_offload("pooled")
    SwapManager().wait_offload("pooled")
    assert pool2.stats()["bytes_in_use"] == 64 * D * 4  # 8 KiB: exactly one size class
    y.sum().backward()
    tr = t.detach().clone().requires_grad_()
    ((tr * 3) * (tr * 3)).exp().sum().backward()
    assert torch.equal(t.grad, tr.grad)


def test_bad_pools_are_refused():
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="hyper_parallel: PinnedMemoryPool"):
            PinnedMemoryPool(bad)
    with pytest.raises(TypeError, match="cpu_pool must be a PinnedMemoryPool"):
        swap(lambda t: t, torch.ones(1), cpu_pool=1 << 20)
    with pytest.raises(TypeError, match="cpu_pool must be a PinnedMemoryPool"):
        swap_wrapper(nn.Linear(2, 2), cpu_pool="pool")
    with pytest.raises(TypeError, match="cpu_pool must be a PinnedMemoryPool"):
        async_save_on_cpu(cpu_pool=object())
    assert "max_host_bytes=4096" in repr(PinnedMemoryPool(4096))


def test_a_deep_copy_shares_the_pool_and_pickling_keeps_the_cap(tmp_path):
    # A pool is a shared resource: deep copies of models that use it use the same pool;
    # torch.save / torch.load of such a model gives a new pool with the same cap.
    pool = PinnedMemoryPool(1 << 20)
    assert copy.deepcopy(pool) is pool and copy.copy(pool) is pool
    model = nn.Sequential(swap_wrapper(nn.Linear(4, 4), cpu_pool=pool),
                          checkpoint_wrapper(nn.Linear(4, 4), cpu_pool=pool))
    twin = copy.deepcopy(model)
    assert twin[0].checkpoint_kwargs["cpu_pool"] is pool
    assert twin[1].checkpoint_kwargs["cpu_pool"] is pool
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    restored = loaded[0].checkpoint_kwargs["cpu_pool"]
    assert isinstance(restored, PinnedMemoryPool) and restored is not pool
    assert restored.max_host_bytes == pool.max_host_bytes
    assert restored.stats()["bytes_in_use"] == 0
    assert loaded[1].checkpoint_kwargs["cpu_pool"] is restored  # one pool, as saved
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), model(x))


# --- when_full="keep": what does not fit stays on the device (tester B, session 20) -------

def _skipped_pool_full():
    entry = SwapManager().stats()["skipped"]["host_pool_full"]
    return entry["count"], entry["bytes"]


class _Reference:
    """The gradients of a plain copy of ``model`` for ``x`` (loss: sum of squares);
    ``check`` asserts a run's are bitwise equal."""

    def __init__(self, model, x):
        ref = copy.deepcopy(model)
        xr = x.detach().clone().requires_grad_()
        ref(xr).square().sum().backward()
        self.x_grad, self.grads = xr.grad, [p.grad for p in ref.parameters()]

    def check(self, model, xs):
        assert torch.equal(xs.grad, self.x_grad)
        for p, g in zip(model.parameters(), self.grads):
            assert torch.equal(p.grad, g)


def test_a_keep_pool_keeps_what_does_not_fit_on_the_device_and_trains_bitwise(cpu_swap, dev):
    model = _mlp(dev)
    x = torch.randn(8, D, device=dev)
    reference = _Reference(model, x)
    # One page: the first 4 KiB storage of the region fits, the others do not.
    pool = PinnedMemoryPool(4096, when_full="keep")
    assert pool.when_full == "keep" and "when_full='keep'" in repr(pool)
    SwapManager().reset_stats()
    xs = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match=r"hyper_parallel: a PinnedMemoryPool\(max_host_bytes="
                                         r"4096, when_full='keep'\) had no room"):
        out = swap(model, xs, cpu_pool=pool)
    SwapManager().synchronize()
    st = pool.stats()
    assert st["bytes_in_use"] == 4096  # what fitted was offloaded...
    assert st["refusals"] >= 1          # ...the rest was refused
    out.square().sum().backward()
    SwapManager().synchronize()
    count, nbytes = _skipped_pool_full()
    # Every refused storage is counted once, at its backward, with its bytes.
    assert count == pool.stats()["refusals"] and nbytes > 0
    assert SwapManager().stats()["offload_bytes"] == 4096
    reference.check(model, xs)
    assert pool.stats()["bytes_in_use"] == 0


def test_a_keep_pool_warns_once_and_every_step_stays_right(cpu_swap, dev):
    import warnings

    model = _mlp(dev)
    pool = PinnedMemoryPool(4096, when_full="keep")
    wrapped = swap_wrapper(model, cpu_pool=pool)
    x = torch.randn(8, D, device=dev)
    reference = _Reference(model, x)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            xs = x.clone().requires_grad_()
            wrapped(xs).square().sum().backward()
            SwapManager().synchronize()
            reference.check(model, xs)
    said = [w for w in seen if "had no room" in str(w.message)]
    assert len(said) == 1  # once per pool, not once per step
    assert pool.stats()["refusals"] >= 3
    # A second pool says it again (its own cap).
    other = swap_wrapper(_mlp(dev), cpu_pool=PinnedMemoryPool(4096, when_full="keep"))
    with pytest.warns(UserWarning, match="had no room"):
        other(x.clone().requires_grad_()).sum().backward()


def test_a_keep_pool_tries_a_fused_bucket_it_has_no_room_for_storage_by_storage(cpu_swap,
                                                                                dev):
    # group_swap fuses the region's small storages into one bucket, one host block: a
    # bucket that does not fit is tried storage by storage, and what fits is offloaded.
    model = _mlp(dev)
    x = torch.randn(8, D, device=dev)
    reference = _Reference(model, x)
    pool = PinnedMemoryPool(4096, when_full="keep")
    SwapManager().reset_stats()
    xs = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match="had no room"):
        out = swap(model, xs, cpu_pool=pool, group_swap=True)
    SwapManager().synchronize()
    st = pool.stats()
    assert st["bytes_in_use"] == 4096  # the GELU input, on its own
    assert st["refusals"] >= 1         # the storages that did not fit (not the bucket)
    out.square().sum().backward()
    assert SwapManager().stats()["offload_bytes"] == 4096
    assert SwapManager().stats()["fused_copies"] == 0
    assert _skipped_pool_full()[0] == st["refusals"]  # every storage kept, once
    reference.check(model, xs)


def test_a_keep_pool_whose_warning_is_an_error_leaves_the_next_step_right(cpu_swap, dev):
    import warnings

    model = _mlp(dev)
    x = torch.randn(8, D, device=dev)
    reference = _Reference(model, x)
    pool = PinnedMemoryPool(4096, when_full="keep")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="had no room"):
            swap(model, x.clone().requires_grad_(), cpu_pool=pool)
    SwapManager().synchronize()
    assert pool.stats()["bytes_in_use"] == 0  # the dropped step gave its block back
    model.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    swap(model, xs, cpu_pool=pool).square().sum().backward()
    reference.check(model, xs)


def test_when_full_is_checked_and_survives_pickling(tmp_path):
    for bad in ("drop", "", None, True, "Keep"):
        with pytest.raises(ValueError, match=r"PinnedMemoryPool\(when_full=\) must be 'raise'"):
            PinnedMemoryPool(4096, when_full=bad)
    with pytest.raises(TypeError):
        PinnedMemoryPool(4096, "keep")  # keyword only
    assert PinnedMemoryPool(4096).when_full == "raise"
    path = tmp_path / "pool.pt"
    torch.save(PinnedMemoryPool(8192, when_full="keep"), path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.when_full == "keep" and loaded.max_host_bytes == 8192


def test_a_keep_pool_under_manual_launch_offload(cpu_swap, dev):
    # group_context + launch_offload (the user drives the release): the storages that do
    # not fit stay, launch_load / wait_load skip them, the gradients are right.
    pool = PinnedMemoryPool(8192, when_full="keep")

    def body(t):
        a = swap_tensor_wrapper(t * 3, cpu_pool=pool)  # 8 KiB: fits
        b = swap_tensor_wrapper(t + 1, cpu_pool=pool)  # 8 KiB: no room left
        return (a * b).exp()

    t = torch.randn(64, D, device=dev, requires_grad=True)
    with SwapManager().group_context("kept"):
        y = body(t)
    with pytest.warns(UserWarning, match="had no room"):
        SwapManager().launch_offload("kept")
    SwapManager().wait_offload("kept")
    assert pool.stats()["bytes_in_use"] == 64 * D * 4 and pool.stats()["refusals"] == 1
    SwapManager().launch_load("kept")
    SwapManager().wait_load("kept")
    y.sum().backward()
    tr = t.detach().clone().requires_grad_()
    ((tr * 3) * (tr + 1)).exp().sum().backward()
    assert torch.equal(t.grad, tr.grad)


# --- tester, session 21: the cache, the counters and the warnings of a keep pool ----------

def test_a_block_that_cannot_fit_drops_no_cache_and_waits_for_nothing(cpu_swap, dev):
    # A storage bigger than the room the blocks in use leave was refused only after the
    # pool had dropped its cache and waited for the copies in flight: a steady loop then
    # allocated afresh every step and never reused a block.
    def f(x):
        big = x.repeat(32, 4)            # 128 KiB: never fits in the pool
        y = big.sin().sum()              # saved first
        small = x * 2                    # 1 KiB -> one 4 KiB block: fits
        return y + small.cos().sum()

    pool = PinnedMemoryPool(8192, when_full="keep")
    allocations = []
    for _ in range(4):
        x = torch.randn(8, 32, device=dev, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            swap(f, x, cpu_pool=pool).backward()
        SwapManager().synchronize()
        allocations.append(pool.stats()["allocations"])
    st = pool.stats()
    assert allocations == [1, 1, 1, 1] and st["reuses"] == 3
    assert st["cap_waits"] == 0 and st["refusals"] == 4


def test_a_block_larger_than_the_cap_is_refused_without_waiting(cpu_swap, dev):
    if dev.type == "cpu":
        SwapManager().set_cpu_swap(True, delay_ns_per_byte=500.0)  # the first copy is slow
    pool = PinnedMemoryPool(1 << 20, when_full="keep")
    x = torch.randn(16384, device=dev, requires_grad=True)
    out = swap(lambda t: (t * 2).sin().sum(), x, cpu_pool=pool)  # 64 KiB, its copy slow
    del out  # its block goes pending on its copy
    with pytest.warns(UserWarning, match="had no room"):
        out = swap(lambda t: t.repeat(64, 1).sin().sum(), x, cpu_pool=pool)  # 4 MiB > cap
    assert pool.stats()["cap_waits"] == 0
    out.backward()
    with pytest.raises(RuntimeError, match=r"a block of 4194304 bytes \(the size class of "
                                           r"4194304 bytes\) is larger than the pool's cap"):
        swap(lambda t: t.repeat(64, 1).sin().sum(), x, cpu_pool=PinnedMemoryPool(1 << 20))


def test_every_keep_pool_that_refuses_at_one_release_warns(cpu_swap, dev):
    pa = PinnedMemoryPool(4096, when_full="keep")
    pb = PinnedMemoryPool(8192, when_full="keep")
    said = []
    for _ in range(3):
        t = torch.randn(128, 32, device=dev, requires_grad=True)  # 16 KiB: no room in either
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with SwapManager().group_context("two_pools"):
                a = swap_tensor_wrapper(t * 3, cpu_pool=pa)
                b = swap_tensor_wrapper(t + 1, cpu_pool=pb)
                y = (a * b).exp()
                del a, b
            SwapManager().launch_offload("two_pools")
            SwapManager().wait_offload("two_pools")
            y.sum().backward()
        said += [str(w.message) for w in seen if "had no room" in str(w.message)]
    assert sorted(m.split(",")[0] for m in said) == [
        "hyper_parallel: a PinnedMemoryPool(max_host_bytes=4096",
        "hyper_parallel: a PinnedMemoryPool(max_host_bytes=8192"]
    assert pa.stats()["refusals"] == pb.stats()["refusals"] == 3


@pytest.mark.parametrize("how", ["async_save_on_cpu", "manual_group"])
def test_storages_kept_are_counted_without_a_scheduled_backward(how, cpu_swap, dev):
    model = _mlp(dev)
    x = torch.randn(16, D, device=dev)
    reference = _Reference(model, x)
    pool = PinnedMemoryPool(4096, when_full="keep")
    SwapManager().reset_stats()
    xs = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "async_save_on_cpu":
            with async_save_on_cpu(cpu_pool=pool):
                out = model(xs)
        else:
            with SwapManager().group_context("kept_manual"):
                h = swap_tensor_wrapper(model[0](xs), cpu_pool=pool)  # 8 KiB: no room
                out = model[2](model[1](h))
                del h
            SwapManager().launch_offload("kept_manual")
    out.square().sum().backward()
    SwapManager().synchronize()
    count, nbytes = _skipped_pool_full()
    assert count == pool.stats()["refusals"] >= 1 and nbytes >= 8192
    reference.check(model, xs)


@pytest.mark.parametrize("when_full", ["keep", "raise"])
def test_a_bucket_too_big_for_the_cap_whose_storages_fit_is_offloaded_whole(when_full,
                                                                            cpu_swap, dev):
    # Six 768 KiB storages: one bucket rounds up to 5 MiB, over a 4.75 MiB cap, while the
    # six blocks (4.5 MiB) fit. Nothing is kept, nothing refused, nothing raised.
    n = 768 * 1024 // 4

    def f(x):
        return sum((x * (i + 1)).sin().sum() for i in range(6))

    pool = PinnedMemoryPool(4864 * 1024, when_full=when_full)
    x = torch.randn(n, device=dev, requires_grad=True)
    SwapManager().reset_stats()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = swap(f, x, cpu_pool=pool, group_swap=True)
        SwapManager().synchronize()
        assert pool.stats()["bytes_in_use"] == 6 * 768 * 1024
        out.backward()
    assert not [w for w in seen if "had no room" in str(w.message)]
    assert pool.stats()["refusals"] == 0 and _skipped_pool_full() == (0, 0)
    assert SwapManager().stats()["offload_bytes"] == 6 * 768 * 1024
    xr = x.detach().clone().requires_grad_()
    f(xr).backward()
    assert torch.equal(x.grad, xr.grad)
