"""Nothing silent: each setting that saves nothing warns once (or is refused), and
SwapManager().stats()["skipped"] counts what was not offloaded, by reason."""

import gc
import warnings

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    apply_activation_memory,
    checkpoint_wrapper,
    swap_tensor_wrapper,
    swap_wrapper,
)

from ._models import Block, Stack, assert_bitwise, grads, twin

REASONS = {"parameter", "buffer", "host_tensor", "foreign_storage", "copy_on_write",
           "empty_storage", "no_storage", "meta_or_fake", "subclass_or_functional",
           "unsupported_device", "kept_by_policy", "in_use_elsewhere", "last_layer",
           "link_saturated", "saved_before_registration", "host_pool_full"}


def skipped(reason):
    entry = SwapManager().stats()["skipped"][reason]
    return entry["count"], entry["bytes"]


def step(model, dev, batch=2):
    x = torch.randn(batch, 4, 32, device=dev)
    model(x).backward()
    SwapManager().synchronize()


def test_stats_list_every_reason_and_reset_clears_them(cpu_swap, dev):
    stats = SwapManager().stats()
    assert set(stats["skipped"]) == REASONS
    assert all(v == {"count": 0, "bytes": 0} for v in stats["skipped"].values())
    model = Stack(layers=3).to(dev)
    apply_activation_memory(model, "swap")
    step(model, dev)
    block = model.layers[0]
    # Every layer saves its Linear weights (parameters) and the scale buffer.
    param_bytes = sum(p.untyped_storage().nbytes() for p in block.parameters() if p.dim() == 2)
    assert skipped("parameter")[1] >= 3 * param_bytes
    assert skipped("buffer") == (3, 3 * block.scale.untyped_storage().nbytes())
    assert skipped("last_layer")[0] > 0
    SwapManager().reset_stats()
    assert skipped("parameter") == (0, 0)


def test_host_tensors_with_cpu_swap_off_warn_once_and_count():
    model = Stack(layers=3)
    apply_activation_memory(model, "swap")
    with pytest.warns(UserWarning, match=r"already live in host memory.*"
                                         r"HYPER_PARALLEL_CPU_SWAP=1"):
        step(model, "cpu")
    count, nbytes = skipped("host_tensor")
    assert count > 0 and nbytes > 0
    assert SwapManager().stats()["offload_bytes"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per cause
        step(model, "cpu")
    assert skipped("host_tensor")[0] == 2 * count  # the counters keep counting


def test_chain_that_saves_nothing_swappable_warns(cpu_swap, dev):
    model = Stack(layers=3).to(dev)
    apply_activation_memory(model, "swap", policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    with pytest.warns(UserWarning, match=r"is in a prefetch chain but saved nothing that can be "
                                         r"swapped: .* kept on device \(MUST_SAVE\)"):
        step(model, dev)
    assert skipped("kept_by_policy")[0] > 0
    assert SwapManager().stats()["offload_bytes"] == 0


def test_storage_reading_policy_offloads_the_same_bytes(cpu_swap, dev):
    """A policy that reads t.untyped_storage() / t.storage() creates a Python storage
    object that torch keeps alive for the storage's whole life (it holds a reference
    of the StorageImpl). The engine must not mistake that for a user of the storage."""

    def must_swap(t):
        return CheckpointPolicy.MUST_SWAP

    def by_storage_size(t):
        return CheckpointPolicy.MUST_SWAP if t.untyped_storage().nbytes() > 0 \
            else CheckpointPolicy.MUST_SAVE

    def by_typed_storage(t):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage is deprecated
            return CheckpointPolicy.MUST_SWAP if t.storage().size() > 0 \
                else CheckpointPolicy.MUST_SAVE

    ref = Stack(layers=4).to(dev)
    offloaded, in_use = [], []
    for policy in (must_swap, by_storage_size, by_typed_storage):
        SwapManager().reset_stats()
        model = twin(ref)
        apply_activation_memory(model, "swap", policy_fn=policy)
        torch.manual_seed(0)
        step(model, dev)
        offloaded.append(SwapManager().stats()["offload_bytes"])
        in_use.append(skipped("in_use_elsewhere"))
    assert offloaded[0] > 0 and offloaded == [offloaded[0]] * 3
    assert in_use == [in_use[0]] * 3


def test_a_storage_held_in_python_stays_on_device(cpu_swap, dev):
    """The other side: a storage object that Python still holds may be read at any time,
    so its storage is not freed (counted as in use elsewhere)."""
    held = []

    def hold(t):
        if not held:
            held.append(t.untyped_storage())
        return CheckpointPolicy.MUST_SWAP

    model = Stack(layers=3).to(dev)
    apply_activation_memory(model, "swap", policy_fn=hold)
    step(model, dev)
    count, nbytes = skipped("in_use_elsewhere")
    assert count >= 1 and nbytes >= held[0].nbytes() > 0


class _Registers(nn.Module):
    """Registers `u` with swap_tensor_wrapper before or after `sin`, which saves it, after a
    dropped side branch; "logged": before, after a norm of it logged (a graph built and
    dropped that saved it)."""

    def __init__(self, when: str):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.late = when == "after"
        self.logged = [] if when == "logged" else None

    def forward(self, h):
        for i in range(8):  # a side branch whose graph, and the tensors it saved, are dropped
            junk = torch.sin(self.a(h) * i)
            del junk
        u = self.a(h)
        if self.logged is not None:
            self.logged.append(u.norm().item())
        if not self.late:
            swap_tensor_wrapper(u)
        v = torch.sin(u)
        if self.late:
            swap_tensor_wrapper(u)
        return h + v


@pytest.mark.parametrize("when", ["before", "after", "logged"],
                         ids=["before_the_save", "after_the_save", "after_a_logged_norm"])
def test_a_registration_after_the_save_is_counted_as_such(when, cpu_swap, dev):
    # (testers, session 20) Registered after the op that saves it, a tensor cannot be
    # offloaded (autograd keeps it as itself): it was counted as "in use elsewhere", with no
    # word of why; now as "saved_before_registration". Registered before, it is offloaded,
    # also after a dropped side branch (a first version refused a fresh tensor at the
    # address of a storage it had seen saved), and after a logged `u.norm().item()`, whose
    # dropped graph had kept it on the device (test_dropped_graphs.py).
    late = when == "after"
    torch.manual_seed(0)
    model = nn.Sequential(*[_Registers(when) for _ in range(3)]).to(dev)
    reference = twin(model)
    x = torch.randn(16, 64, device=dev)
    reference(x).sum().backward()
    for a, b in zip(model, model[1:]):
        SwapManager().set_forward_prefetch_layer(a, b)
    SwapManager().reset_stats()
    model(x).sum().backward()
    SwapManager().synchronize()
    assert_bitwise(grads(model), grads(reference))
    stats = SwapManager().stats()
    nbytes = 16 * 64 * 4
    if late:  # (the last layer keeps its own: last_layer)
        assert stats["offload_bytes"] == 0
        assert skipped("saved_before_registration") == (2, 2 * nbytes)
        assert skipped("in_use_elsewhere") == (0, 0)
    else:
        assert stats["offload_bytes"] == 2 * nbytes
        assert skipped("saved_before_registration") == (0, 0)
        assert skipped("in_use_elsewhere") == (0, 0)


def test_cycle_in_the_chain_is_refused():
    a, b, c = Block(8), Block(8), Block(8)
    manager = SwapManager()
    manager.set_forward_prefetch_layer(a, b)
    manager.set_forward_prefetch_layer(b, c)
    with pytest.raises(ValueError, match="hyper_parallel: .*would close a cycle"):
        manager.set_forward_prefetch_layer(c, a)
    with pytest.raises(ValueError, match="would close a cycle"):
        manager.set_forward_prefetch_layer(b, a)
    # Nothing changed: a -> b -> c still.
    from hyper_parallel.core.activation_checkpoint._swap_manager import layer_node

    na, nb, nc = (layer_node(m) for m in (a, b, c))
    assert na.prev is None and na.next is nb and nb.next is nc and nc.next is None


def test_forward_against_the_chain_warns(cpu_swap, dev):
    model = Stack(layers=3).to(dev)
    layers = model.layers
    for i in range(3):
        layers[i] = swap_wrapper(layers[i])
    manager = SwapManager()
    for i in range(2):  # declared 2 -> 1 -> 0, but the model runs 0, 1, 2
        manager.set_forward_prefetch_layer(layers[2 - i], layers[1 - i])
    with pytest.warns(UserWarning, match="the forward order is not the chain declared"):
        step(model, dev)


@pytest.mark.parametrize("order", [[3, 1, 2, 0], [2, 0, 1, 3], [1, 0, 2, 3]])
def test_layers_given_out_of_forward_order_warn(order, cpu_swap, dev):
    """apply_activation_memory chains layers= in the order given; an order that is not the
    forward's without one reversed link used to pass silently (a tester: 3 -> 1 -> 2 -> 0
    against 0, 1, 2, 3 left the first layer on the device and stalled backward twice)."""
    model = Stack(layers=4).to(dev)
    apply_activation_memory(model, "swap", layers=[f"layers.{i}" for i in order])
    # (named by its path: apply names the chain's layers, where the warning said
    # 'SwapWrapper#2', a tester)
    with pytest.warns(UserWarning, match=r"layer 'layers\.\d' ran forward before .*the "
                                         r"forward order is not the chain declared"):
        step(model, dev)


def test_a_layer_called_twice_per_forward_does_not_warn(cpu_swap, dev):
    """Weight sharing (layer 1 runs again after layer 2) finds no free predecessor
    invocation the second time, but is not a forward against the chain; nor is a second
    micro-batch's forward while the first one's graph is alive."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                        for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.layers[1](x).sum()

    model = Shared().to(dev)
    reference = twin(model)
    apply_activation_memory(model, "swap")
    xs = [torch.randn(2, 4, 32, device=dev) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [model(x) for x in xs]  # two micro-batches, then their backwards
        sum(losses).backward()
    assert not [w for w in caught if "forward order" in str(w.message)]
    sum(reference(x) for x in xs).backward()
    assert_bitwise(grads(model), grads(reference))


@pytest.mark.parametrize("case", ["frozen_prefix", "suffix"])
def test_micro_batches_starting_mid_chain_do_not_warn(case, cpu_swap, dev):
    """Micro-batches whose first layer with grad is in the middle of the chain (a frozen
    prefix run without grad; a pipeline stage's suffix), two forwards then one backward:
    each first layer finds no predecessor invocation, which is not a forward against the
    chain (a tester: the second micro-batch warned)."""
    model = Stack(layers=4).to(dev)
    apply_activation_memory(model, "swap")

    def forward(x):
        h = x
        for i, layer in enumerate(model.layers):
            if case == "suffix" and i < 2:
                continue
            if case == "frozen_prefix" and i < 2:
                with torch.no_grad():
                    h = layer(h)
            else:
                h = layer(h)
        return h.sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sum(forward(torch.randn(2, 4, 32, device=dev)) for _ in range(2)).backward()
    assert not [w for w in caught if "forward order" in str(w.message)]


def test_forward_in_chain_order_does_not_warn(cpu_swap, dev):
    model = Stack(layers=3).to(dev)
    apply_activation_memory(model, "swap")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            step(model, dev)


def test_two_swap_wrappers_around_one_module_are_refused():
    block = Block(8)
    first = swap_wrapper(block)
    with pytest.raises(ValueError, match=r"hyper_parallel: this Block already has a "
                                         r"swap_wrapper; wrap each module once"):
        swap_wrapper(block)
    # Checkpoint wrappers open no swap region of their own: several may share a module.
    assert checkpoint_wrapper(block)._checkpoint_wrapped_module is block
    del first
    gc.collect()
    second = swap_wrapper(block)  # the first one is gone: wrapping again is fine
    assert second._checkpoint_wrapped_module is block


def test_swap_policy_with_the_checkpoint_signature_is_explained():
    def op_policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    with pytest.raises(TypeError, match=r"swap's policy_fn is called once per saved tensor as "
                                        r"policy_fn\(tensor\).*op_policy\(ctx, op.*checkpoint "
                                        r"policy"):
        swap_wrapper(Block(8), policy_fn=op_policy)
    from hyper_parallel.core.activation_checkpoint import swap

    with pytest.raises(TypeError, match="swap's policy_fn"):
        swap(Block(8), torch.randn(2, 8, requires_grad=True), policy_fn=op_policy)
    with pytest.raises(TypeError, match="list or dict of ops is a checkpoint policy"):
        swap_wrapper(Block(8), policy_fn=[torch.ops.aten.mm])


def test_checkpoint_policy_with_the_swap_signature_is_explained():
    def tensor_policy(t):
        return CheckpointPolicy.MUST_SWAP

    with pytest.raises(TypeError, match=r"checkpoint's policy_fn is called once per op as "
                                        r"policy_fn\(ctx, op, \*args, \*\*kwargs\).*"
                                        r"tensor_policy\(t\).*swap policy"):
        checkpoint_wrapper(Block(8), policy_fn=tensor_policy)
    from hyper_parallel.core.activation_checkpoint import checkpoint

    with pytest.raises(TypeError, match="checkpoint's policy_fn"):
        checkpoint(Block(8), torch.randn(2, 8, requires_grad=True), policy_fn=tensor_policy)


def test_policies_with_flexible_signatures_pass(cpu_swap, dev):
    ref = Stack(layers=2).to(dev)
    model = twin(ref)
    model.layers[0] = swap_wrapper(model.layers[0], policy_fn=lambda *a: CheckpointPolicy.MUST_SWAP)
    model.layers[1] = checkpoint_wrapper(model.layers[1], policy_fn=lambda *a, **k: True)
    x = torch.randn(2, 4, 32, device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layer 0 is unscheduled here
        model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))


def test_checkpoint_layers_in_a_chain_say_nothing(cpu_swap, dev):
    """Checkpointed layers save nothing by design: no warning for them."""
    model = Stack(layers=4).to(dev)
    apply_activation_memory(model, ["checkpoint", "checkpoint", "none", "swap"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, dev)


def test_warning_names_the_reason_for_a_module_without_swappable_saves(cpu_swap, dev):
    class OnlyParams(nn.Module):
        """Saves its weight and the (leaf) input only."""

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8))

        def forward(self, x):
            return x * self.w

    a, b = OnlyParams().to(dev), OnlyParams().to(dev)
    wa, wb = swap_wrapper(a), swap_wrapper(b)
    SwapManager().set_forward_prefetch_layer(wa, wb)
    x = torch.randn(3, 8, device=dev, requires_grad=True)
    with pytest.warns(UserWarning, match="saved nothing that can be swapped: 2 storages of "
                                         "parameters"):
        wb(wa(x).detach().requires_grad_()).sum().backward()
