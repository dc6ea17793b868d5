"""ActivationWrapper: the public base class, its attributes, prefix-free names in the
parent's named_parameters()/named_modules(), and the nesting warning (issue 16)."""

import copy
import warnings

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    ActivationWrapper, CheckpointExcludeWrapper, CheckpointPolicy, checkpoint_exclude_wrapper,
    SwapManager, checkpoint_wrapper, swap_wrapper)


class Layer(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU())

    def forward(self, x):
        return self.mlp(self.q_proj(x))


class Model(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_parent_names_are_those_of_the_unwrapped_model():
    plain = Model()
    wrapped = Model()
    wrapped.load_state_dict(plain.state_dict())
    for i in range(2):
        wrapped.layers[i] = checkpoint_wrapper(wrapped.layers[i])
    params = [n for n, _ in wrapped.named_parameters()]
    assert params == [n for n, _ in plain.named_parameters()]
    assert not any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_modules())
    names = {n for n, _ in wrapped.named_modules()}
    assert names == {n for n, _ in plain.named_modules()}
    # The wrapper and the module it wraps share one name, wrapper first.
    pairs = [(n, type(m).__name__) for n, m in wrapped.named_modules() if n == "layers.0"]
    assert pairs == [("layers.0", "CheckpointWrapper"), ("layers.0", "Layer")]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert len(list(wrapped.parameters())) == len(list(plain.parameters()))


def test_optimizer_groups_and_lora_style_targets_from_names():
    torch.manual_seed(0)
    plain, wrapped = Model(), Model()
    wrapped.load_state_dict(plain.state_dict())
    wrapped.layers[0] = checkpoint_wrapper(wrapped.layers[0])
    wrapped.layers[1] = swap_wrapper(wrapped.layers[1])

    def groups(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.SGD([{"params": decay, "weight_decay": 0.1},
                                {"params": rest, "weight_decay": 0.0}], lr=0.1)

    x = torch.randn(3, 4)
    for model in (plain, wrapped):
        opt = groups(model)
        model(x).square().sum().backward()
        opt.step()
    for (n, a), (m, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert n == m and torch.equal(a, b)
    # A LoRA-style injection by name reaches the module the forward uses.
    targets = [n for n, m in wrapped.named_modules() if n.endswith("q_proj")]
    assert targets == ["layers.0.q_proj", "layers.1.q_proj"]
    new = nn.Linear(4, 4)
    parent = wrapped.get_submodule("layers.0")
    setattr(parent, "q_proj", new)
    assert wrapped.layers[0]._checkpoint_wrapped_module.q_proj is new
    assert wrapped.get_submodule("layers.0.q_proj") is new


def test_isinstance_and_attributes():
    policy = {torch.ops.aten.mm.default: CheckpointPolicy.MUST_SAVE}
    ck = checkpoint_wrapper(Layer(), policy_fn=policy, group_swap=True)
    sw = swap_wrapper(Layer(), group_swap=True)
    ex = checkpoint_exclude_wrapper(Layer())
    for w in (ck, sw, ex):
        assert isinstance(w, ActivationWrapper)
    assert isinstance(ex, CheckpointExcludeWrapper)
    assert ck.group_swap is True and ck.checkpoint_kwargs["group_swap"] is True
    assert [(n, p.name) for n, p in ck.policy_fn.table.entries()] == [
        ("aten.mm.default", "MUST_SAVE")]  # the compiled policy
    assert sw.policy_fn is None and sw.group_swap is True
    assert sw.checkpoint_kwargs == {"policy_fn": None, "group_swap": True, "cpu_pool": None}
    fn = checkpoint_wrapper(lambda t: t.sin(), group_swap=True)
    assert fn.checkpoint_kwargs == {"group_swap": True} and fn.group_swap is True
    assert fn.policy_fn is None
    sfn = swap_wrapper(lambda t: t.sin())
    assert sfn.group_swap is False and sfn.policy_fn is None


def test_nested_wrappers_warn_naming_both_and_stay_correct():
    torch.manual_seed(0)
    layer = Layer()
    ref = Layer()
    ref.load_state_dict(layer.state_dict())
    outer = checkpoint_wrapper(layer)
    with pytest.warns(UserWarning, match=r"swap_wrapper\(Sequential\) is nested inside "
                                         r"checkpoint_wrapper\(Layer\)"):
        layer.mlp = swap_wrapper(layer.mlp)  # wrapped inside an already wrapped layer
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pair was named once, at wrapping time
        outer(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(ref.parameters(), layer.parameters()):
        assert torch.equal(a.grad, b.grad)
    # The reverse order warns at wrapping time.
    inner = Layer()
    inner.mlp = swap_wrapper(inner.mlp)
    with pytest.warns(UserWarning, match=r"swap_wrapper\(Sequential\) is nested inside "
                                         r"checkpoint_wrapper\(Layer\)"):
        checkpoint_wrapper(inner)


def test_exclusion_inside_a_checkpoint_does_not_warn():
    layer = Layer()
    layer.mlp = checkpoint_exclude_wrapper(layer.mlp)
    wrapped = checkpoint_wrapper(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(torch.randn(2, 4)).sum().backward()


def _blocks(n=3):
    return Model(n)


@pytest.mark.parametrize("order", ["leaf_then_parent", "parent_then_leaf", "block_then_parent",
                                   "parent_then_block", "leaf_then_block", "block_then_leaf"])
def test_nesting_warns_at_wrapping_time_in_either_order(order):
    # Each way of putting one wrapper's region inside another's is named when the second
    # wrapper is made, before any forward (the reference's six overlap cases).
    model = _blocks()
    block, leaf = model.layers[1], model.layers[1].mlp
    with pytest.warns(UserWarning, match=r"is nested inside"):
        if order == "leaf_then_parent":
            block.mlp = checkpoint_wrapper(leaf)
            checkpoint_wrapper(model)
        elif order == "parent_then_leaf":
            outer = checkpoint_wrapper(model)
            checkpoint_wrapper(outer.layers[1].mlp)
        elif order == "block_then_parent":
            model.layers[1] = checkpoint_wrapper(block)
            checkpoint_wrapper(model)
        elif order == "parent_then_block":
            outer = checkpoint_wrapper(model)
            checkpoint_wrapper(outer.layers[1])
        elif order == "leaf_then_block":
            block.mlp = checkpoint_wrapper(leaf)
            checkpoint_wrapper(block)
        else:
            outer = checkpoint_wrapper(block)
            swap_wrapper(outer.mlp)


def test_disjoint_wrappers_and_rewrapping_one_module_do_not_warn():
    model = _blocks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.layers[0] = checkpoint_wrapper(model.layers[0])
        model.layers[1] = swap_wrapper(model.layers[1])
        model.layers[2].mlp = checkpoint_wrapper(model.layers[2].mlp)
        model.layers[2].q_proj = swap_wrapper(model.layers[2].q_proj)
        # Two checkpoint wrappers of one module are two independent regions, not nesting
        # (benchmarks compare policies on shared weights this way).
        leaf = nn.Linear(4, 4)
        first, second = checkpoint_wrapper(leaf), checkpoint_wrapper(leaf)
        x = torch.randn(2, 4, requires_grad=True)
        assert torch.equal(first(x), second(x))
        checkpoint_wrapper(torch.mul)
        swap_wrapper(torch.mul)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_swap_wrapper_group_swap_must_be_bool(bad):
    """Tester fault: group_swap="yes" reached pybind as a raw argument-type error."""
    from hyper_parallel.core.activation_checkpoint import swap_wrapper

    for target in (torch.nn.Linear(4, 4), lambda x: x * 2):
        with pytest.raises(TypeError, match=r"^hyper_parallel: swap_wrapper's group_swap must be "
                                            r"a bool \(True or False\); got"):
            swap_wrapper(target, group_swap=bad)


def test_swap_wrapper_call_keeps_every_nn_module_call_feature():
    # SwapWrapper.__call__ skips nn.Module.__call__ only when that would just call forward
    # (issue 17): hooks on the wrapper, global module hooks and a forward replaced on the
    # instance all still run, and each call swaps as before.
    torch.manual_seed(0)
    layer = Layer()
    wrapper = swap_wrapper(layer)
    x = torch.randn(2, 4)
    expected = layer(x)
    seen = []
    h1 = wrapper.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    h2 = wrapper.register_forward_hook(lambda m, args, out: seen.append("post") or out + 1)
    assert torch.equal(wrapper(x), layer(x * 2) + 1) and seen == ["post"]
    h1.remove()
    h2.remove()
    h3 = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        wrapper(x)
    finally:
        h3.remove()
    assert "SwapWrapper" in seen
    wrapper.forward = lambda *a, **k: "replaced"
    assert wrapper(x) == "replaced"
    del wrapper.forward
    assert torch.equal(wrapper(x), expected)


def _python_frames(fn):
    """Names of the Python functions fn() enters (sys.setprofile)."""
    import sys

    names = []
    sys.setprofile(lambda frame, event, arg: event == "call" and names.append(
        frame.f_code.co_qualname))
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def test_swap_wrapper_call_slot_takes_the_no_hook_case_in_cpp(host_swap):
    # A module wrapper's call (the type's tp_call, issue 17) decides nn.Module.__call__'s
    # no-hook case in C++: no Python frame of SwapWrapper.__call__ or nn.Module.__call__ runs,
    # the layer swaps as before and the gradients are bitwise those of the plain layer.
    torch.manual_seed(0)
    layer = Layer()
    reference = copy.deepcopy(layer)
    wrapper = swap_wrapper(layer)
    x = torch.randn(2, 4, requires_grad=True)
    frames = _python_frames(lambda: wrapper(x))
    assert not any("Wrapper" in f for f in frames), frames
    # nn.Module's call frames: the wrapped layer's and its submodules' only
    assert frames.count("Module._call_impl") == \
        _python_frames(lambda: layer(x)).count("Module._call_impl")
    SwapManager().synchronize()
    before = SwapManager().stats()["offload_bytes"]
    y = wrapper(x)
    SwapManager().synchronize()
    assert SwapManager().stats()["offload_bytes"] > before
    y.sum().backward()
    reference(x.detach().requires_grad_()).sum().backward()
    for a, b in zip(layer.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    # Every other case runs the Python __call__: a backward hook on the wrapper, compile()
    # (an instance _compiled_call_impl), and a subclass (the generic slot).
    hook = wrapper.register_full_backward_hook(lambda m, gi, go: None)
    assert any(f.endswith("SwapWrapper.__call__") for f in _python_frames(lambda: wrapper(x)))
    hook.remove()
    wrapper._compiled_call_impl = lambda *a, **k: "compiled"
    assert wrapper(x) == "compiled"
    del wrapper._compiled_call_impl
    assert torch.equal(wrapper(x), layer(x))

    class Sub(type(wrapper)):
        pass

    sub = Sub(Layer())
    assert any(f.endswith("SwapWrapper.__call__") for f in _python_frames(lambda: sub(x)))

    # A forward overridden by a subclass, or patched on the class, is what runs (the fast
    # case had skipped it: found by the fresh-user tester).
    class Doubling(type(wrapper)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * 2

    doubled = Doubling(Layer())
    inner = doubled._checkpoint_wrapped_module
    assert torch.equal(doubled(x), inner(x) * 2)
    cls, original = type(wrapper), type(wrapper).forward
    cls.forward = lambda self, *args, **kwargs: original(self, *args, **kwargs) + 1
    try:
        assert torch.equal(wrapper(x), layer(x) + 1)
    finally:
        cls.forward = original
    assert torch.equal(wrapper(x), layer(x))


class _FailingLayerAttr:
    """A callable whose schedule-node attribute is a property that fails (not an
    AttributeError): Python's getattr(obj, name, None) propagates that error, and so must
    the wrapper's C++ path (pybind11's getattr with a default would swallow it)."""

    @property
    def _hyper_parallel_layer(self):
        raise RuntimeError("node property failed")

    def __call__(self, x):
        return torch.sin(x)


@pytest.mark.parametrize("path", ["swap", "swap_wrapper"])
def test_a_failing_attribute_lookup_propagates_on_both_paths(path, host_swap):
    from hyper_parallel.core.activation_checkpoint import swap

    layer = _FailingLayerAttr()
    x = torch.randn(8, requires_grad=True)
    call = (lambda: swap(layer, x)) if path == "swap" else (lambda: swap_wrapper(layer)(x))
    with pytest.raises(RuntimeError, match="node property failed"):
        call()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    y = swap_wrapper(torch.sin)(x)  # the engine is still usable
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


@pytest.mark.parametrize("wrap", [checkpoint_wrapper, swap_wrapper])
def test_a_plain_tensor_assigned_to_a_parameter_by_hand_is_refused_as_unwrapped(wrap):
    # (tester 3, session 18) Letting torch.func.functional_call put plain tensors into a
    # wrapped block's own parameter slots must not let them in by hand: the unwrapped
    # module refuses (TypeError), and an optimizer built before would train a parameter
    # the forward no longer reads.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    plain, block = Block(), Block()
    wrapped = wrap(block)
    for target in (plain, wrapped):
        with pytest.raises(TypeError, match="cannot assign"):
            target.scale = torch.zeros(4)
    assert type(block.scale) is nn.Parameter and torch.equal(block.scale, torch.ones(4))
    wrapped.scale = nn.Parameter(torch.full((4,), 2.0))  # a Parameter goes in, as unwrapped
    assert torch.equal(block.scale, torch.full((4,), 2.0))
