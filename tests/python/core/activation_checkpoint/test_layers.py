"""find_layers and the layers= selection of apply_activation_memory (plain models; the
transformers architectures are in test_apply_transformers.py)."""

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    apply_activation_memory,
    checkpoint_wrapper,
    find_layers,
    remove_activation_memory,
)
from hyper_parallel.core.activation_checkpoint._layers import resolve_layer_slots

from ._models import Block, Stack


class TwoStacks(nn.Module):
    """A short ModuleList of blocks and a longer Sequential of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(Block(8) for _ in range(2))
        self.body = nn.Module()
        self.body.blocks = nn.Sequential(*[Block(8) for _ in range(3)])
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()])


def test_plain_model_longest_list_of_one_type():
    assert find_layers(Stack(layers=3)) == ["layers.0", "layers.1", "layers.2"]
    # A ModuleList of mixed types is no stack of blocks; the longest same-type one wins.
    assert find_layers(TwoStacks()) == ["body.blocks.0", "body.blocks.1", "body.blocks.2"]
    # The model itself may be the container.
    seq = nn.Sequential(Block(8), Block(8))
    assert find_layers(seq) == ["0", "1"]


def test_names_survive_wrapping():
    model = Stack(layers=3)
    names = find_layers(model)
    apply_activation_memory(model, "checkpoint")
    assert find_layers(model) == names
    assert all(type(model.get_submodule(n)).__name__ == "CheckpointWrapper" for n in names)
    remove_activation_memory(model)
    assert find_layers(model) == names


def test_none_found_says_pass_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"hyper_parallel: find_layers found no repeated blocks"
                                         r".*layers="):
        find_layers(model)


def test_a_flat_mlp_is_told_the_rule_and_how_to_group_it():
    # A tester, session 27: 8 Linears and 8 ReLUs in one Sequential were told "no
    # nn.ModuleList or nn.Sequential holds two or more modules of one type".
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(4, 4), nn.ReLU())])
    with pytest.raises(ValueError, match=r"children all of one type.*flat Sequential of mixed "
                                         r"modules.*Group each block"):
        find_layers(model)
    grouped = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(8)])
    assert find_layers(grouped) == [str(i) for i in range(8)]


def test_layers_by_names_modules_and_predicate():
    model = TwoStacks()
    by_name = resolve_layer_slots(model, ["encoder.1", "encoder.0"])
    assert [s.name for s in by_name] == ["encoder.1", "encoder.0"]  # the order given
    by_module = resolve_layer_slots(model, [model.encoder[0], model.body.blocks[2]])
    assert [s.name for s in by_module] == ["encoder.0", "body.blocks.2"]
    by_pred = resolve_layer_slots(model, lambda name, m: isinstance(m, Block))
    assert [s.name for s in by_pred] == ["encoder.0", "encoder.1", "body.blocks.0",
                                         "body.blocks.1", "body.blocks.2"]
    # A wrapper given by the user resolves to its position.
    model.encoder[0] = checkpoint_wrapper(model.encoder[0])
    assert [s.name for s in resolve_layer_slots(model, [model.encoder[0]])] == ["encoder.0"]


@pytest.mark.parametrize("layers, match", [
    (["nope"], "not a submodule"),
    (["encoder.0", "encoder.0"], "twice"),
    (["encoder.0", "encoder.0.fc1"], "inside"),
    ([], "empty"),
    ([nn.Linear(2, 2)], "not a submodule"),
    (lambda name, m: False, "matched no module"),
])
def test_bad_layers_are_refused(layers, match):
    with pytest.raises(ValueError, match="hyper_parallel: .*" + match):
        resolve_layer_slots(TwoStacks(), layers)


def test_layers_of_the_wrong_kind():
    with pytest.raises(TypeError, match="hyper_parallel: layers= takes"):
        resolve_layer_slots(TwoStacks(), "encoder.0")
    with pytest.raises(TypeError, match="entries must be names or modules"):
        resolve_layer_slots(TwoStacks(), [3])


def test_selected_layers_are_used_by_apply():
    torch.manual_seed(0)
    model = TwoStacks()
    report = apply_activation_memory(model, "checkpoint", layers=["encoder.0", "encoder.1"])
    assert [e.name for e in report] == ["encoder.0", "encoder.1"]
    assert type(model.encoder[0]).__name__ == "CheckpointWrapper"
    assert isinstance(model.body.blocks[0], Block)


@pytest.mark.parametrize("bad", [3, None, "model"])
def test_find_layers_of_a_non_module_is_a_clear_type_error(bad):
    """Tester fault: find_layers(3) raised AttributeError '_modules'."""
    from hyper_parallel.core.activation_checkpoint import find_layers

    with pytest.raises(TypeError, match=r"^hyper_parallel: find_layers expects an nn.Module "):
        find_layers(bad)


class _Stages(nn.Module):
    """Blocks in stages: a ModuleList of ModuleLists (neither has a forward)."""

    def __init__(self, stages=2, per_stage=2, d=16) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(Block(d) for _ in range(per_stage))
                                    for _ in range(stages))

    def forward(self, x):
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x.pow(2).sum()


def test_blocks_in_nested_module_lists_are_the_layers_and_the_lists_never_are():
    # (tester, session 26) find_layers gave the inner ModuleLists ("stages.0", "stages.1"),
    # which are never called: apply reported every layer checkpointed, and the peak was
    # "none"'s. The blocks of a list of ModuleLists are the layers; a container without a
    # forward named as a layer is refused.
    from hyper_parallel.core.activation_checkpoint import saved_activation_memory

    model, x = _Stages(stages=2, per_stage=3), torch.randn(4, 8, 16)
    assert find_layers(model) == [f"stages.{s}.{b}" for s in range(2) for b in range(3)]

    def peak():
        with saved_activation_memory() as meter:
            model(x).backward()
        return meter.peak_bytes

    none = peak()
    apply_activation_memory(model, "checkpoint")
    assert peak() < none / 2
    remove_activation_memory(model)
    for layers in (["stages.0", "stages.1"], lambda name, m: name.count(".") == 1):
        with pytest.raises(ValueError, match="'stages.0', a ModuleList: it has no forward"):
            apply_activation_memory(model, "checkpoint", layers=layers)
        assert [type(m).__name__ for m in model.stages] == ["ModuleList"] * 2
