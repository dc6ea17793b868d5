"""Several training threads driving one swap engine (SPEC 4.2, 4.10; issue 19).

Autograd is never handed a released storage, whatever another thread's forward does: a
storage leaves the device only at its own forward thread's release points, and never once
a backward holds it (docs/design.md, "Who may release a storage"). Every scenario runs with
the engine's debug checks on, so a release that breaks the rule fails at its source, and
compares each thread's gradients bitwise with a single-threaded run of the same inputs.
"""

import copy
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper

pytestmark = pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, n, d, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.plain = nn.ModuleList(Block(d) for _ in range(n))
        self.layers = nn.ModuleList(swap_wrapper(copy.deepcopy(b)) for b in self.plain)
        for i in range(n - 1):
            SwapManager().set_forward_prefetch_layer(self.layers[i], self.layers[i + 1])

    def forward(self, x, plain=False):
        for layer in (self.plain if plain else self.layers):
            x = layer(x)
        return x

    def swapped_params(self):
        return [p for layer in self.layers for p in layer.parameters()]

    def plain_params(self):
        return [p for layer in self.plain for p in layer.parameters()]


@pytest.fixture
def debug_checks():
    _C.set_debug_checks(True)
    yield
    _C.set_debug_checks(False)


def _grads(stack, x, plain):
    params = stack.plain_params() if plain else stack.swapped_params()
    loss = stack(x, plain=plain).pow(2).mean()
    return torch.autograd.grad(loss, params)


def _run_threads(targets, seconds):
    errors, stop = [], threading.Event()

    def guarded(fn):
        try:
            while not stop.is_set():
                fn()
        except BaseException as e:  # surfaced below
            errors.append(f"{type(e).__name__}: {e}")
            stop.set()

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    return errors


def test_issue_19_two_threads_with_dead_copies(cpu_swap, dev, debug_checks):
    # The reported scenario: deep copies run and dropped, then two threads train two models
    # of different shapes; thread A checks its gradients every step.
    base = Stack(4, 64).to(dev)
    for _ in range(50):
        c = copy.deepcopy(base)
        c(torch.randn(2, 16, 64, device=dev)).pow(2).mean().backward()
        del c
    a, b = Stack(3, 64, seed=1).to(dev), Stack(8, 16, seed=2).to(dev)
    x = torch.randn(8, 64, 64, device=dev)
    ref = _grads(a, x, plain=True)
    checked = []

    def thread_a():
        got = _grads(a, x, plain=False)
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), "thread A: gradients differ"
        checked.append(1)

    def thread_b():
        b(torch.randn(1, 2, 16, device=dev)).pow(2).mean().backward()

    SwapManager().reset_stats()
    errors = _run_threads([thread_a, thread_b], seconds=4.0)
    assert not errors, errors
    assert checked, "thread A never finished a step"
    assert SwapManager().stats()["on_demand_reloads"] == 0


@pytest.mark.parametrize("threads", [2, 4, 8])
def test_many_threads_one_shared_model(cpu_swap, dev, debug_checks, threads):
    # All threads run the SAME wrapped model (autograd.grad: no shared .grad writes).
    stack = Stack(4, 32).to(dev)
    inputs = [torch.randn(4, 8, 32, device=dev, generator=torch.Generator().manual_seed(i))
              for i in range(threads)]
    refs = [_grads(stack, x, plain=True) for x in inputs]
    done = [0] * threads

    def worker(i):
        def step():
            got = _grads(stack, inputs[i], plain=False)
            assert all(torch.equal(g, r) for g, r in zip(got, refs[i])), f"thread {i}"
            done[i] += 1
        return step

    errors = _run_threads([worker(i) for i in range(threads)], seconds=2.0 + 0.25 * threads)
    assert not errors, errors
    assert all(done), done
    assert _C.current_group() is None


def test_micro_batches_per_thread_with_link_delay(cpu_swap, dev, debug_checks):
    # Each thread runs two micro-batches' forwards before their backwards (gradient
    # accumulation), with a slow copy link so copies are in flight across thread switches.
    if dev.type == "cpu":
        SwapManager().set_cpu_swap(True, delay_ns_per_byte=0.5)
    stacks = [Stack(4, 32, seed=s).to(dev) for s in range(3)]
    xs = [[torch.randn(4, 8, 32, device=dev) for _ in range(2)] for _ in stacks]
    refs = []
    for stack, (x0, x1) in zip(stacks, xs):
        params = stack.plain_params()
        loss = stack(x0, plain=True).pow(2).mean() + stack(x1, plain=True).pow(2).mean()
        refs.append(torch.autograd.grad(loss, params))

    def worker(i):
        stack, (x0, x1) = stacks[i], xs[i]

        def step():
            l0 = stack(x0).pow(2).mean()
            l1 = stack(x1).pow(2).mean()
            got = torch.autograd.grad(l0 + l1, stack.swapped_params())
            assert all(torch.equal(g, r) for g, r in zip(got, refs[i])), f"thread {i}"
        return step

    SwapManager().reset_stats()
    errors = _run_threads([worker(i) for i in range(len(stacks))], seconds=3.0)
    assert not errors, errors
    assert SwapManager().stats()["offload_bytes"] > 0


def test_deferred_release_is_retried_only_by_its_own_thread(cpu_swap, dev, debug_checks):
    # Thread A keeps a layer's output alive (a skip connection), so that storage's release
    # is deferred; thread B's forwards must not release it while A is in backward.
    stack = Stack(3, 32).to(dev)
    other = Stack(3, 32, seed=3).to(dev)
    x = torch.randn(4, 8, 32, device=dev)
    h0 = stack.plain[0](x)
    ref = torch.autograd.grad(
        (stack.plain[2](stack.plain[1](h0)) + h0).pow(2).mean(), stack.plain_params())
    if dev.type != "cpu":
        pytest.skip("on an accelerator both backwards run on autograd's one worker thread "
                    "per device, so A's paused backward would block B's (as on CUDA)")
    in_backward, release = threading.Event(), threading.Event()

    class Gate(torch.autograd.Function):
        # Pauses thread A's backward right after the last layer's gradient, while thread B
        # runs forwards (release points) of its own model.
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            in_backward.set()
            assert release.wait(60)
            return g

    def thread_a():
        h0 = stack.layers[0](x)  # a long skip connection: its release is deferred
        h = stack.layers[2](stack.layers[1](h0))
        out = Gate.apply(h) + h0
        del h0
        got = torch.autograd.grad(out.pow(2).mean(), stack.swapped_params())
        assert all(torch.equal(g, r) for g, r in zip(got, ref))

    def b_steps():
        before = SwapManager().stats()["offload_bytes"]
        for _ in range(5):
            other(torch.randn(4, 8, 32, device=dev)).pow(2).mean().backward()
        return SwapManager().stats()["offload_bytes"] - before

    b_alone = b_steps()
    b_during = []

    def thread_b():
        assert in_backward.wait(60)
        try:
            b_during.append(b_steps())  # only B's own activations move
        finally:
            release.set()

    SwapManager().reset_stats()
    errors = []
    ts = [threading.Thread(target=lambda f=f: _catch(f, errors)) for f in (thread_a, thread_b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors, errors
    assert b_during == [b_alone] and b_alone > 0
    assert SwapManager().stats()["on_demand_reloads"] == 0


def _catch(fn, errors):
    try:
        fn()
    except BaseException as e:
        errors.append(f"{type(e).__name__}: {e}")


def test_unpacked_storage_is_never_released_again(cpu_swap, dev, debug_checks):
    # A storage handed to autograd (backward started) stays resident even when a later
    # release point of the same thread runs before that backward finishes.
    stack = Stack(3, 32).to(dev)
    x = torch.randn(4, 8, 32, device=dev)
    out = stack(x)
    grads = torch.autograd.grad(out.pow(2).mean(), stack.swapped_params(), retain_graph=True)
    # New forwards (release points) between the two backwards of a retained graph.
    for _ in range(3):
        stack(torch.randn(4, 8, 32, device=dev)).sum().backward()
    again = torch.autograd.grad(out.pow(2).mean(), stack.swapped_params())
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
