"""checkpoint_wrapper: modules and callables, transparency, double wrapping (SPEC 2, 4.9)."""

import copy

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    CheckpointWrapper,
    checkpoint_wrapper,
    swap_wrapper,
)
from hyper_parallel.core.activation_checkpoint import _selective

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.register_buffer("scale", torch.full((D,), 0.5))
        self.gain = 2.0

    def forward(self, x, *, bias=None):
        h = torch.tanh(self.fc2(torch.relu(self.fc1(self.norm(x)))) * self.scale * self.gain)
        return h if bias is None else h + bias


class Model(nn.Module):
    def __init__(self, layers=3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).sum()


def wrapped_copy(model, **kwargs):
    out = copy.deepcopy(model)
    for i in range(len(out.layers)):
        out.layers[i] = checkpoint_wrapper(out.layers[i], **kwargs)
    return out


def assert_equal_tensors(a_list, b_list):
    a_list, b_list = list(a_list), list(b_list)
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        assert torch.equal(a, b)


def save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_SAVE


@pytest.mark.parametrize("kwargs", [{}, {"policy_fn": [torch.ops.aten.addmm]},
                                    {"policy_fn": save_all}], ids=["full", "list", "save_all"])
def test_wrapped_model_trains_like_the_original(kwargs):
    torch.manual_seed(0)
    ref = Model()
    model = wrapped_copy(ref, **kwargs)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, D)
        loss_ref, loss = ref(x), model(x)
        loss_ref.backward()
        loss.backward()
        assert torch.equal(loss, loss_ref)
        assert_equal_tensors((p.grad for p in model.parameters()),
                             (p.grad for p in ref.parameters()))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    assert_equal_tensors(model.parameters(), ref.parameters())


def test_state_dict_is_transparent_both_ways():
    torch.manual_seed(0)
    plain = Model()
    wrapped = wrapped_copy(plain)
    assert list(wrapped.state_dict().keys()) == list(plain.state_dict().keys())
    assert "layers.0.fc1.weight" in wrapped.state_dict()
    # A wrapper's own names are the wrapped module's.
    layer, inner = wrapped.layers[0], plain.layers[0]
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert [n for n, _ in layer.named_buffers()] == [n for n, _ in inner.named_buffers()]
    assert list(layer.state_dict().keys()) == list(inner.state_dict().keys())

    # wrapped -> plain
    torch.manual_seed(1)
    other_plain = Model()
    other_plain.load_state_dict(wrapped.state_dict())
    assert_equal_tensors(other_plain.state_dict().values(), plain.state_dict().values())
    # plain -> wrapped
    torch.manual_seed(2)
    other_wrapped = wrapped_copy(Model())
    other_wrapped.load_state_dict(plain.state_dict())
    assert_equal_tensors(other_wrapped.state_dict().values(), plain.state_dict().values())
    # a single wrapped layer, both ways, strict
    layer = checkpoint_wrapper(Block())
    layer.load_state_dict(plain.layers[1].state_dict())
    assert_equal_tensors(layer.state_dict().values(), plain.layers[1].state_dict().values())
    x = torch.randn(2, D)
    assert torch.equal(layer(x), plain.layers[1](x))


def test_attribute_access_and_indexing_are_forwarded():
    block = Block()
    w = checkpoint_wrapper(block)
    assert isinstance(w, CheckpointWrapper)
    assert w.fc1 is block.fc1 and w.scale is block.scale and w.gain == 2.0
    w.gain = 3.0
    assert block.gain == 3.0
    seq = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    ws = checkpoint_wrapper(seq)
    assert ws[0] is seq[0] and ws[2] is seq[2] and len(ws) == 3
    assert list(ws) == list(seq)
    x = torch.randn(2, D, requires_grad=True)
    assert torch.equal(ws(x), seq(x))


def test_tensor_kwargs_through_a_module_wrapper():
    torch.manual_seed(0)
    block = Block()
    w = checkpoint_wrapper(copy.deepcopy(block), policy_fn=[torch.ops.aten.addmm])
    x = torch.randn(3, D, requires_grad=True)
    bias = torch.randn(D, requires_grad=True)
    g_ref = torch.autograd.grad(block(x, bias=bias).sum(), [x, bias])
    g = torch.autograd.grad(w(x, bias=bias).sum(), [x, bias])
    assert_equal_tensors(g, g_ref)


def test_double_wrapping_is_refused():
    block = Block()
    once = checkpoint_wrapper(block)
    with pytest.raises(ValueError, match="hyper_parallel: .* is already wrapped by a "
                                         "hyper_parallel wrapper; wrap each module once"):
        checkpoint_wrapper(once)
    with pytest.raises(ValueError, match="already wrapped"):
        swap_wrapper(once)
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_wrapper(swap_wrapper(Block()))

    def fn(x):
        return x * 2

    wrapped_fn = checkpoint_wrapper(fn)
    with pytest.raises(ValueError, match="hyper_parallel: this function is already wrapped"):
        checkpoint_wrapper(wrapped_fn)
    with pytest.raises(ValueError, match="hyper_parallel: this function is already wrapped"):
        swap_wrapper(wrapped_fn)


def test_wrapping_a_plain_callable():
    torch.manual_seed(0)
    block = Block()

    def block_func(x, *, bias=None):
        return block(x, bias=bias)

    ckpt_block_func = checkpoint_wrapper(block_func, policy_fn={"aten.addmm": True})
    assert ckpt_block_func.__name__ == "block_func" and callable(ckpt_block_func)
    x = torch.randn(3, D, requires_grad=True)
    bias = torch.randn(D)
    g_ref = torch.autograd.grad(block_func(x, bias=bias).sum(), [x, *block.parameters()])
    out = ckpt_block_func(x, bias=bias)
    assert torch.equal(out, block_func(x, bias=bias))
    g = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    assert_equal_tensors(g, g_ref)


def test_policy_is_validated_once_at_wrap_time(monkeypatch):
    with pytest.raises(ValueError, match="hyper_parallel: policy_fn list: no op named 'aten.nope'"):
        checkpoint_wrapper(Block(), policy_fn=["aten.nope"])
    with pytest.raises(ValueError, match="hyper_parallel: policy_fn list"):
        checkpoint_wrapper(lambda x: x, policy_fn=[print])
    w = checkpoint_wrapper(Block(), policy_fn=[torch.ops.aten.addmm])
    calls = []
    original = _selective.compile_policy

    def counting(policy_fn):
        calls.append(policy_fn)
        return original(policy_fn)

    monkeypatch.setattr("hyper_parallel.core.activation_checkpoint._checkpoint.compile_policy",
                        counting)
    for _ in range(3):
        w(torch.randn(2, D, requires_grad=True)).sum().backward()
    assert all(isinstance(c, _selective.SelectivePolicy) for c in calls)  # never re-validated


def test_unknown_and_wrong_arguments():
    with pytest.raises(TypeError, match=r"hyper_parallel: checkpoint_wrapper got unknown options "
                                        r"\['checkpoint_impl'\]"):
        checkpoint_wrapper(Block(), checkpoint_impl="reentrant")
    with pytest.raises(TypeError, match="hyper_parallel: checkpoint_wrapper expects an nn.Module "
                                        "or a callable, got int"):
        checkpoint_wrapper(3)


def test_inference_runs_plainly_and_gives_the_same_values():
    torch.manual_seed(0)
    block = Block()
    w = checkpoint_wrapper(copy.deepcopy(block), policy_fn=[torch.ops.aten.addmm])
    x = torch.randn(2, D)
    with torch.no_grad():
        assert torch.equal(w(x), block(x))
    with torch.inference_mode():
        assert torch.equal(w(x), block(x))


@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_copied_wrapped_model_behaves_the_same(clone, tmp_path):
    torch.manual_seed(0)
    model = wrapped_copy(Model(), policy_fn={"aten.addmm": CheckpointPolicy.MUST_SAVE,
                                             "*": CheckpointPolicy.PREFER_RECOMPUTE})
    if clone == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        twin = torch.load(tmp_path / "model.pt", weights_only=False)
    table = twin.layers[0]._hp_checkpoint_kwargs["policy_fn"].table
    assert table.lookup("aten.addmm.default") == CheckpointPolicy.MUST_SAVE
    assert isinstance(twin.layers[0], CheckpointWrapper)
    x = torch.randn(2, D)
    loss, loss_twin = model(x), twin(x)
    loss.backward()
    loss_twin.backward()
    assert torch.equal(loss, loss_twin)
    assert_equal_tensors((p.grad for p in model.parameters()), (p.grad for p in twin.parameters()))
