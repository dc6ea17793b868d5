"""apply_activation_memory / remove_activation_memory on plain models: plans, the chain,
replacing and removing, policies, and bad input (transformers models:
test_apply_transformers.py)."""

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import hyper_parallel
from hyper_parallel._extension import _C
from hyper_parallel.core.activation_checkpoint import (
    STRATEGIES,
    ActivationPlan,
    CheckpointPolicy,
    CheckpointWrapper,
    LayerPlan,
    SwapManager,
    SwapWrapper,
    apply_activation_memory,
    remove_activation_memory,
)
from hyper_parallel.core.activation_checkpoint._swap_manager import layer_node

from ._models import Block, Stack, assert_bitwise, grads, twin


def kinds(model):
    return [type(layer).__name__ for layer in model.layers]


def chain_of(model):
    """The prefetch chain as registered: (prev, next) names of each layer's node."""
    nodes = [layer_node(layer) for layer in model.layers]
    return [(n.prev is not None, n.next is not None) if n is not None else None for n in nodes]


def test_exported_from_both_packages():
    for name in ("find_layers", "apply_activation_memory", "remove_activation_memory"):
        assert getattr(hyper_parallel, name) is getattr(
            hyper_parallel.core.activation_checkpoint, name)


@pytest.mark.parametrize("plan, expected", [
    ("none", ["Block"] * 4),
    ("checkpoint", ["CheckpointWrapper"] * 4),
    ("selective", ["CheckpointWrapper"] * 4),
    ("swap", ["SwapWrapper"] * 4),
    ("mixed", ["CheckpointWrapper", "SwapWrapper"] * 2),
    ("selective_swap", ["CheckpointWrapper"] * 4),
    (["swap", "checkpoint", "none", "selective"],
     ["SwapWrapper", "CheckpointWrapper", "Block", "CheckpointWrapper"]),
    ({0: "swap", -1: "checkpoint"}, ["SwapWrapper", "Block", "Block", "CheckpointWrapper"]),
    ({"layers.1": "swap"}, ["Block", "SwapWrapper", "Block", "Block"]),
])
def test_plan_forms(plan, expected):
    model = Stack(layers=4)
    report = apply_activation_memory(model, plan)
    assert kinds(model) == expected
    assert [e.name for e in report] == [f"layers.{i}" for i in range(4)]
    assert [e.wrapper for e in report] == [k if k != "Block" else "-" for k in expected]
    swaps = any(STRATEGIES[e.strategy].swaps for e in report)
    assert report.chained is swaps
    if swaps:  # one chain over all layers, "none" layers included, in forward order
        assert chain_of(model) == [(False, True), (True, True), (True, True), (True, False)]
    else:
        assert chain_of(model) == [None] * 4


def test_plan_object_protocol():
    @dataclass
    class Plan:  # what a planner returns: a per-layer mapping under .strategies
        strategies: dict
        explanation: str = ""

    plan = Plan({"layers.0": "swap", "layers.2": "checkpoint"})
    assert isinstance(plan, LayerPlan)
    model = Stack(layers=3)
    report = apply_activation_memory(model, plan)
    assert report.strategies() == {"layers.0": "swap", "layers.1": "none",
                                   "layers.2": "checkpoint"}
    # The report's own mapping is a plan too.
    again = apply_activation_memory(model, report.strategies())
    assert again.strategies() == report.strategies()


def test_report_prints_a_table():
    report = apply_activation_memory(Stack(layers=3), ["swap", "checkpoint", "none"])
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "strategy", "wrapper"]
    assert lines[2].split() == ["layers.0", "swap", "SwapWrapper"]
    assert lines[4].split() == ["layers.2", "none", "-"]
    assert "1 swap, 1 checkpoint, 1 none; prefetch chain over all 3 layers" in text


def test_apply_again_replaces_and_remove_restores(cpu_swap, dev):
    model = Stack(layers=4).to(dev)
    originals = list(model.layers)
    keys = list(model.state_dict())
    apply_activation_memory(model, "swap")
    assert list(model.state_dict()) == keys
    apply_activation_memory(model, "checkpoint")  # replaces: no wrapper of a wrapper
    assert kinds(model) == ["CheckpointWrapper"] * 4
    assert [layer._checkpoint_wrapped_module for layer in model.layers] == originals
    assert chain_of(model) == [None] * 4  # the swap chain is gone
    assert remove_activation_memory(model) is True
    assert list(model.layers) == originals and all(layer_node(m) is None for m in originals)
    assert list(model.state_dict()) == keys
    assert remove_activation_memory(model) is False
    # The originals can be wrapped again, by hand too.
    model.layers[0] = SwapWrapper(originals[0])


def test_state_dict_round_trips_across_application():
    plain = Stack(layers=3)
    model = twin(plain)
    apply_activation_memory(model, "mixed")
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys()
    fresh = Stack(layers=3)
    fresh.load_state_dict(state)
    apply_activation_memory(fresh, "selective").__str__()
    fresh.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 plain.state_dict().values()))


@pytest.mark.parametrize("plan", ["checkpoint", "selective", "swap", "mixed", "selective_swap"])
def test_every_strategy_is_bitwise_equal_for_three_steps(plan, cpu_swap, dev):
    ref = Stack(layers=4, dropout=0.1).to(dev)
    model = twin(ref)
    apply_activation_memory(model, plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    before = SwapManager().stats()["offload_bytes"]
    for step in range(3):
        x = torch.randn(2, 8, 32, device=dev)
        losses = []
        for m in (ref, model):
            torch.manual_seed(step)
            loss = m(x)
            loss.backward()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
        assert_bitwise(grads(model), grads(ref))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if STRATEGIES[plan].swaps:
        assert SwapManager().stats()["offload_bytes"] > before


def test_32_layers_mixed_plan_in_one_call(cpu_swap, dev):
    """Swap all but the last layer and checkpoint every other one: even layers
    checkpoint, odd layers swap, the last layer plain, in one call."""
    ref = Stack(layers=32, d=8).to(dev)
    model = twin(ref)
    plan = {i: ("checkpoint" if i % 2 == 0 else "swap") for i in range(31)}
    report = apply_activation_memory(model, plan)
    assert len(report) == 32 and report.chained
    assert kinds(model) == ["CheckpointWrapper", "SwapWrapper"] * 15 + ["CheckpointWrapper",
                                                                         "Block"]
    x = torch.randn(2, 4, 8, device=dev)
    model(x).backward()
    ref(x).backward()
    assert_bitwise(grads(model), grads(ref))
    stats = SwapManager().stats()
    # The 15 swapped layers offload (their successors run after them) and all comes back.
    assert stats["offload_bytes"] > 0 and stats["reload_bytes"] == stats["offload_bytes"]
    assert stats["on_demand_reloads"] == 0


def test_policy_fn_goes_to_the_strategies_that_take_one(cpu_swap, dev, caches):
    # An op list replaces what "selective" keeps.
    model = Stack(layers=2)
    apply_activation_memory(model, "selective", policy_fn=[torch.ops.aten.addmm])
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.layers)
    loss = model(torch.randn(2, 4, 32))
    assert len(caches) == 2 and all(c.stats()["saved_tensors"] == 2 for c in caches)
    loss.backward()
    # A per-tensor callable is the swap layers' policy.
    seen = []

    def keep_all(t):
        seen.append(t.shape)
        return CheckpointPolicy.MUST_SAVE

    model = Stack(layers=3).to(dev)
    SwapManager().reset_stats()
    apply_activation_memory(model, "swap", policy_fn=keep_all)
    with pytest.warns(UserWarning, match="saved nothing that can be swapped"):
        model(torch.randn(2, 4, 32, device=dev)).backward()
    assert seen and SwapManager().stats()["offload_bytes"] == 0
    assert SwapManager().stats()["skipped"]["kept_by_policy"]["count"] > 0


class _AttentionBlock(nn.Module):
    """A layer whose attention is F.scaled_dot_product_attention (a fused kernel)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(torch.tanh(a.transpose(1, 2).reshape(b, s, h)))


def test_selective_keeps_fused_attention_outputs(caches):
    # "selective" keeps the fused attention kernel's outputs (a random op, at dropout 0
    # it draws nothing), so backward does not run attention again; gradients bitwise.
    torch.manual_seed(0)
    model = Stack(layers=2)  # its layers replaced by attention blocks (same width)
    model.layers = nn.ModuleList(_AttentionBlock() for _ in range(2))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6, 32)
    apply_activation_memory(model, "selective")
    loss = model(x)
    attention_shaped = [[tuple(t.shape) for t in c.cached_tensors(False) if t.dim() == 4]
                        for c in caches]
    assert attention_shaped == [[(2, 4, 6, 8)]] * 2  # one attention output per layer
    loss.backward()
    reference(x).backward()
    assert_bitwise(grads(model), grads(reference))


def test_policy_fn_without_a_taker_is_refused():
    with pytest.raises(ValueError, match="no layer of the plan is 'swap'"):
        apply_activation_memory(Stack(layers=2), "checkpoint", policy_fn=lambda t: None)
    with pytest.raises(ValueError, match="no layer of the plan is 'selective'"):
        apply_activation_memory(Stack(layers=2), "swap", policy_fn=[torch.ops.aten.mm])


@pytest.mark.parametrize("plan, error, match", [
    ("bogus", ValueError, "not a strategy"),
    (["swap"], ValueError, "lists 1 strategies for 3 layers"),
    ({5: "swap"}, ValueError, "index 5"),
    ({"layers.9": "swap"}, ValueError, "not one of the 3 layers"),
    ({0: "mixed"}, ValueError, "whole-model plan"),
    ({0.5: "swap"}, TypeError, "indices or names"),
    (3, TypeError, "plan must be"),
    ({-1: "swap", 2: "checkpoint"}, ValueError, "keys -1 and 2 both name layer 2"),
    ({"layers.0": "swap", 0: "checkpoint"}, ValueError,
     "keys 'layers.0' and 0 both name layer 0"),
    ({-3: "none", "layers.0": "swap"}, ValueError, "keys -3 and 'layers.0' both name layer 0"),
])
def test_bad_plans_leave_the_model_untouched(plan, error, match):
    model = Stack(layers=3)
    apply_activation_memory(model, "swap")
    before = list(model.layers)
    with pytest.raises(error, match="hyper_parallel: .*" + match):
        apply_activation_memory(model, plan)
    assert list(model.layers) == before  # the previous application is still in place
    assert chain_of(model)[0] == (False, True)


def test_layer_wrapped_by_hand_is_refused():
    model = Stack(layers=2)
    model.layers[0] = CheckpointWrapper(model.layers[0])
    with pytest.raises(ValueError, match="layers.0 is already wrapped by CheckpointWrapper"):
        apply_activation_memory(model, "swap")
    assert isinstance(model.layers[1], Block)


@pytest.mark.parametrize("plan,ok", [
    ("checkpoint", True), ("selective_swap", True), ("checkpoint_swap", True), ("mixed", True),
    (["checkpoint", "none", "checkpoint", "swap"], True), (["none", "none", "none", "none"], True),
    ("swap", False), (["swap", "checkpoint", "checkpoint", "swap"], False),
    (["none", "none", "none", "swap"], False), (["checkpoint", "swap", "none", "swap"], False)],
    ids=["checkpoint", "selective_swap", "checkpoint_swap", "mixed", "checkpoint_where_shared",
         "all_none", "swap", "swap_at_one_place", "none_where_shared", "checkpoint_and_none"])
def test_a_shared_layer_takes_a_wrapper_per_place_or_a_clear_error(plan, ok, cpu_swap):
    # (testers, session 20) A module at two places of the layer list (ALBERT-style sharing):
    # "swap" raised "already has a swap_wrapper ... drop the first wrapper", a wrapper the
    # user never made, and a plan swapping another layer raised the chain's own errors
    # ("needs two different layers", "would close a cycle"). Checkpoint wrappers are a
    # region per place and train bitwise; the module itself or its one swap_wrapper cannot
    # take two places in the schedule: refused, naming the places, before the model is
    # touched.
    torch.manual_seed(0)
    model = Stack(layers=4)
    model.layers[2] = model.layers[0]
    reference = twin(model)
    x = torch.randn(2, 4, 32)
    reference(x).backward()
    if ok:
        apply_activation_memory(model, plan)
        model(x).backward()
        SwapManager().synchronize()
        assert_bitwise(grads(model), grads(reference))
        remove_activation_memory(model)
        return
    layers = list(model.layers)
    with pytest.raises(ValueError, match=r"hyper_parallel: layers layers\.0 \(\w+\), "
                                         r"layers\.2 \(\w+\) are one module \(a shared layer\)"):
        apply_activation_memory(model, plan)
    assert list(model.layers) == layers


def test_failure_half_way_rolls_back(monkeypatch):
    from hyper_parallel.core.activation_checkpoint import _apply

    model = Stack(layers=3)
    originals = list(model.layers)
    calls = []
    real = _apply.swap_wrapper

    def flaky(layer, **kwargs):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(layer, **kwargs)

    monkeypatch.setattr(_apply, "swap_wrapper", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        apply_activation_memory(model, "swap")
    assert list(model.layers) == originals
    monkeypatch.undo()
    apply_activation_memory(model, "swap")  # nothing was left marked as wrapped
    assert kinds(model) == ["SwapWrapper"] * 3


def test_deepcopy_of_an_applied_model_is_independent(cpu_swap, dev):
    model = Stack(layers=3).to(dev)
    apply_activation_memory(model, "swap")
    copied = copy.deepcopy(model)
    assert kinds(copied) == ["SwapWrapper"] * 3
    assert remove_activation_memory(copied) is True
    assert kinds(copied) == ["Block"] * 3 and kinds(model) == ["SwapWrapper"] * 3
    x = torch.randn(2, 4, 32, device=dev)
    model(x).backward()
    assert SwapManager().stats()["offload_bytes"] > 0
    assert _C.layer_scheduled(layer_node(model.layers[0]).layer_id)


def test_single_block_type_list_under_sequential():
    model = nn.Sequential(*[Block(8) for _ in range(3)])
    report = apply_activation_memory(model, "checkpoint")
    assert [e.name for e in report] == ["0", "1", "2"]
    assert isinstance(model[1], CheckpointWrapper)


def test_remove_restores_the_engine_settings_the_plan_replaced(monkeypatch):
    @dataclass
    class Plan:  # an ActivationPlan's engine fields
        strategies: dict
        prefetch_depth: int
        offload_window: int

    manager = SwapManager()
    depth0, window0 = manager.get_prefetch_depth(), _C.offload_window()
    assert (depth0, window0) != (3, 0)  # else the test could not fail
    model = Stack(layers=3)
    try:
        apply_activation_memory(model, Plan({0: "swap"}, prefetch_depth=3, offload_window=0))
        assert (manager.get_prefetch_depth(), _C.offload_window()) == (3, 0)
        # Applying again replaces the plan: its settings go before the next are recorded.
        apply_activation_memory(model, Plan({1: "swap"}, prefetch_depth=2, offload_window=5))
        assert (manager.get_prefetch_depth(), _C.offload_window()) == (2, 5)
        assert remove_activation_memory(model)
        assert (manager.get_prefetch_depth(), _C.offload_window()) == (depth0, window0)
        apply_activation_memory(model, "swap")  # a plain apply runs with those
        assert (manager.get_prefetch_depth(), _C.offload_window()) == (depth0, window0)
        # A plain apply leaves settings made meanwhile alone, and so does its removal.
        manager.set_prefetch_depth(4)
        apply_activation_memory(model, "checkpoint")
        remove_activation_memory(model)
        assert manager.get_prefetch_depth() == 4
        manager.set_prefetch_depth(depth0)
        # A failure half way gives the settings back too.
        from hyper_parallel.core.activation_checkpoint import _apply

        def boom(layer, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(_apply, "swap_wrapper", boom)
        with pytest.raises(RuntimeError, match="boom"):
            apply_activation_memory(model, Plan({0: "swap"}, prefetch_depth=3, offload_window=0))
        assert (manager.get_prefetch_depth(), _C.offload_window()) == (depth0, window0)
    finally:
        remove_activation_memory(model)
        manager.set_prefetch_depth(depth0)
        _C.set_offload_window(window0)


# ---------------------------------------------------------------- tester faults: input
class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Stack(layers=3)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("field", ["prefetch_depth", "offload_window"])
def test_engine_settings_out_of_the_engines_range_leave_everything_as_it_was(field, cpu_swap):
    # (tester, session 26) A plan whose offload_window (or prefetch_depth) passed apply's
    # checks (>= 0) failed in the engine (at most 2**20) after the previous plan had been
    # removed and the depth changed: the model lost its plan and the engine kept the bad
    # plan's depth. Both are checked against the engine's range before anything changes,
    # and ActivationPlan.from_json refuses them.
    @dataclass
    class Plan:
        strategies: dict
        prefetch_depth: int = 2
        offload_window: int = 0

    manager = SwapManager()
    depth0, window0 = manager.get_prefetch_depth(), _C.offload_window()
    model = Stack(layers=3)
    apply_activation_memory(model, "swap")
    bad = Plan({"layers.0": "checkpoint"}, **{field: 2**20 + 1})
    with pytest.raises(ValueError, match=f"the plan's {field} must be an int in \\[0, 2\\*\\*20\\]"):
        apply_activation_memory(model, bad)
    assert [type(layer).__name__ for layer in model.layers] == ["SwapWrapper"] * 3
    assert (manager.get_prefetch_depth(), _C.offload_window()) == (depth0, window0)
    remove_activation_memory(model)
    assert (manager.get_prefetch_depth(), _C.offload_window()) == (depth0, window0)
    text = ActivationPlan(strategies={"layers.0": "none"}, budget_bytes=1,
                          predicted_peak_bytes=1, predicted_step_seconds=1.0, none_peak_bytes=1,
                          none_step_seconds=1.0).to_json()
    with pytest.raises(ValueError, match=f"field '{field}' must be at most 2\\*\\*20"):
        ActivationPlan.from_json(text.replace(f'"{field}": {1 if field == "prefetch_depth" else 0}',
                                              f'"{field}": {2**20 + 1}'))


def test_apply_over_a_plan_applied_to_a_submodule_says_remove_it_first():
    """Tester fault: 'already wrapped ... (not by apply_activation_memory)' for layers that
    apply_activation_memory had wrapped under another module."""
    outer = _Outer()
    apply_activation_memory(outer.body, "checkpoint")
    with pytest.raises(ValueError, match=r"^hyper_parallel: layer body\.layers\.0 was already put "
                                         r"under an activation-memory plan by "
                                         r"apply_activation_memory on Stack \(its submodule "
                                         r"'body'\).*Call remove_activation_memory\(\)"):
        apply_activation_memory(outer, "swap")
    assert remove_activation_memory(outer.body)
    apply_activation_memory(outer, "checkpoint")
    with pytest.raises(ValueError, match=r"^hyper_parallel: layer layers\.0 was already put .*"
                                         r"on _Outer \(a module that contains it\)"):
        apply_activation_memory(outer.body, "swap")
    assert remove_activation_memory(outer)
    assert all(type(b) is Block for b in outer.body.layers)


def test_remove_on_a_submodule_of_the_planned_model_says_where_the_plan_is():
    # (tester, session 26) remove_activation_memory(model.inner) returned False in silence
    # where the plan sat on the parent: the layers stayed wrapped.
    outer = nn.Module()
    outer.inner = Stack(layers=3)
    apply_activation_memory(outer, "checkpoint")
    with pytest.warns(UserWarning, match="Stack has no plan of its own; its layers are under a "
                                         "plan applied to a Module that contains it"):
        assert remove_activation_memory(outer.inner) is False
    assert remove_activation_memory(outer) is True
    assert remove_activation_memory(outer.inner) is False  # nothing applied anywhere: quiet


def test_apply_options_must_be_bool():
    for name in ("group_swap", "swap_inputs"):
        with pytest.raises(TypeError, match=rf"^hyper_parallel: apply_activation_memory's {name} "
                                            r"must be a bool \(True or False\); got 'yes'"):
            apply_activation_memory(Stack(layers=2), "swap", **{name: "yes"})


def test_user_hooks_on_wrappers_survive_reapply_and_remove(cpu_swap):
    """Tester fault: hooks registered on a wrapper were dropped on re-apply / remove."""
    model = Stack(layers=3)
    x = torch.randn(2, 4, 32)
    apply_activation_memory(model, "checkpoint")
    seen = []
    post = model.layers[1].register_forward_hook(lambda m, a, out: seen.append(("post",
                                                                                type(m).__name__)))
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(("pre", type(m).__name__)))
    model(x).backward()
    assert seen == [("pre", "CheckpointWrapper"), ("post", "CheckpointWrapper")]
    seen.clear()
    apply_activation_memory(model, "swap")  # re-apply: the hooks move to the new wrapper
    model(x).backward()
    assert seen == [("pre", "SwapWrapper"), ("post", "SwapWrapper")]
    seen.clear()
    remove_activation_memory(model)  # the layer itself takes them
    model(x).backward()
    assert seen == [("pre", "Block"), ("post", "Block")]
    post.remove()  # the handle still removes its hook
    seen.clear()
    model(x)
    assert seen == [("pre", "Block")]


def test_wrapper_hooks_merged_into_a_hooked_layer_keep_order_and_warn():
    model = Stack(layers=2)
    order = []
    model.layers[0].register_forward_hook(lambda m, a, out: order.append("layer post"))
    model.layers[0].register_forward_pre_hook(lambda m, a: order.append("layer pre"))
    apply_activation_memory(model, "checkpoint")
    model.layers[0].register_forward_hook(lambda m, a, out: order.append("wrapper post"))
    model.layers[0].register_forward_pre_hook(lambda m, a: order.append("wrapper pre"))
    with pytest.warns(UserWarning, match=r"^hyper_parallel: the hooks registered on the wrapper "
                                         r"of layer layers\.0 were moved"):
        remove_activation_memory(model)
    with torch.no_grad():
        model(torch.randn(2, 4, 32))
    assert order == ["wrapper pre", "layer pre", "layer post", "wrapper post"]


def test_the_report_of_an_apply_applies_again():
    # A tester, session 27: the report apply returns was refused as a plan ("an object with
    # a .strategies attribute ...; got method").
    from hyper_parallel.core.activation_checkpoint import (apply_activation_memory,
                                                           remove_activation_memory)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
                                  for _ in range(3)])
    report = apply_activation_memory(model, ["checkpoint", "none", "selective"])
    remove_activation_memory(model)
    again = apply_activation_memory(model, report)
    try:
        assert again.strategies() == report.strategies() == {
            "0": "checkpoint", "1": "none", "2": "selective"}
    finally:
        remove_activation_memory(model)
