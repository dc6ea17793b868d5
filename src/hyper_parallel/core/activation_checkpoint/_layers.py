"""Finding a model's repeated blocks (the layers a plan applies to): ``find_layers``.

Our module wrappers are seen through: a wrapped layer keeps the name of its position
(``model.layers.0``, not ``model.layers.0._checkpoint_wrapped_module``) and is judged by
the type of the module it wraps, so the same names come back before and after
:func:`~hyper_parallel.core.activation_checkpoint.apply_activation_memory`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from torch import nn

_WRAPPED = "_checkpoint_wrapped_module"


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a hyper_parallel wrapper wraps (through nested wrappers), else itself."""
    while getattr(module, "_hp_is_wrapper", False):
        module = module._modules[_WRAPPED]
    return module


@dataclass(frozen=True)
class LayerSlot:
    """Where a layer sits: ``parent._modules[key]`` holds it (possibly wrapped).

    Attributes:
        name: fully qualified name, e.g. ``"model.layers.3"``.
        parent: the (unwrapped) module that owns the layer.
        key: the layer's attribute name in ``parent`` (``"3"`` in a ``ModuleList``).
    """

    name: str
    parent: nn.Module
    key: str

    @property
    def current(self) -> nn.Module:
        """What the parent holds now (the layer, or a wrapper of it)."""
        return self.parent._modules[self.key]

    @property
    def layer(self) -> nn.Module:
        """The layer itself (unwrapped)."""
        return unwrapped(self.current)


def walk(model: nn.Module) -> Iterator[LayerSlot]:
    """Every submodule of ``model`` as a slot, depth first in registration order (the
    forward order of the models this library targets), seeing through our wrappers."""
    stack: list[tuple[str, nn.Module]] = [("", unwrapped(model))]
    while stack:
        prefix, parent = stack.pop()
        children = [(k, m) for k, m in parent._modules.items() if m is not None]
        pending = []
        for key, child in children:
            slot = LayerSlot(f"{prefix}{key}", parent, key)
            yield slot
            pending.append((f"{slot.name}.", unwrapped(child)))
        stack.extend(reversed(pending))


#: Containers without a forward of their own: never called, so never a layer (a tester,
#: session 26: blocks in nested ModuleLists, stages of layers, were found as the inner
#: lists, and a plan applied to them reported every layer wrapped and saved nothing).
UNCALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _children(prefix: str, container: nn.Module) -> list[LayerSlot]:
    return [LayerSlot(f"{prefix}{k}", container, k)
            for k, m in container._modules.items() if m is not None]


def _flattened(slots: list[LayerSlot]) -> list[LayerSlot] | None:
    """The blocks of a list of ``nn.ModuleList``s (stages of layers), in order, through
    any depth of such nesting; None when some child is not a ``ModuleList``."""
    if not slots or not all(isinstance(s.layer, nn.ModuleList) for s in slots):
        return None
    out: list[LayerSlot] = []
    for s in slots:
        inner = _children(f"{s.name}.", s.layer)
        out.extend(_flattened(inner) or inner)
    return out


def _containers(model: nn.Module) -> Iterator[tuple[str, list[LayerSlot]]]:
    """Each ``nn.ModuleList`` / ``nn.Sequential`` (the root included) with its children,
    and, for one whose children are all ``ModuleList``s, with their blocks flattened."""
    root = unwrapped(model)
    named = [("", root)] if isinstance(root, (nn.ModuleList, nn.Sequential)) else []
    named += [(slot.name, slot.layer) for slot in walk(model)
              if isinstance(slot.layer, (nn.ModuleList, nn.Sequential))]
    for name, container in named:
        slots = _children(f"{name}." if name else "", container)
        yield name, slots
        flat = _flattened(slots)
        if flat:
            yield name, flat


def _hf_block_classes(model: nn.Module) -> set[str]:
    """The class names ``transformers`` never splits across devices: its repeated blocks."""
    names: set[str] = set()
    for module in (model, unwrapped(model)):
        for name in getattr(module, "_no_split_modules", None) or ():
            if isinstance(name, str):
                names.add(name)
    return names


def _class_names(module: nn.Module) -> set[str]:
    # FSDP2 and similar make subclasses on the fly (FSDPLlamaDecoderLayer): match the MRO.
    return {cls.__name__ for cls in type(module).__mro__}


def find_layer_slots(model: nn.Module) -> list[LayerSlot]:
    """:func:`find_layers`, returning the slots (parent and key) instead of the names."""
    hf_classes = _hf_block_classes(model)
    if hf_classes:
        found = [slots for _, slots in _containers(model)
                 if slots and all(_class_names(s.layer) & hf_classes for s in slots)]
        if found:
            return [s for slots in found for s in slots]
    best: list[LayerSlot] = []
    for _, slots in _containers(model):
        if len(slots) < 2 or len(slots) <= len(best):
            continue
        kind = type(slots[0].layer)
        if not issubclass(kind, UNCALLED) and all(type(s.layer) is kind for s in slots):
            best = slots
    if not best:
        raise ValueError(
            f"hyper_parallel: find_layers found no repeated blocks in {type(model).__name__}: no "
            "nn.ModuleList or nn.Sequential has children all of one type, two or more (nor, for "
            "a transformers model, all of its _no_split_modules classes); a flat Sequential of "
            "mixed modules (Linear, ReLU, Linear, ...) has no blocks (a tester, session 27, "
            "was told its 8 Linears were not two of one type). Group each block into a module "
            "of its own (nn.Sequential(nn.Linear(...), nn.ReLU())), or name the layers "
            "yourself: apply_activation_memory(model, plan, layers=[...]) takes their names, "
            "the modules, or a predicate predicate(name, module) -> bool.")
    return best


def find_layers(model: nn.Module) -> list[str]:
    """The fully qualified names of ``model``'s repeated blocks, in forward order.

    * A ``transformers`` model: every child of the ``nn.ModuleList`` / ``nn.Sequential``
      containers whose children are all of its ``_no_split_modules`` classes, whatever the
      attribute is called (``model.layers``, ``transformer.h``, ``model.decoder.layers``);
      an encoder-decoder model gives the encoder's blocks, then the decoder's.
    * Any other model: the children of the longest ``nn.ModuleList`` / ``nn.Sequential``
      (the model itself included) of two or more modules of one type; the first one wins
      a tie. A list of ``nn.ModuleList``s (stages of blocks) counts as the list of their
      blocks, in order; containers without a forward (``ModuleList``, ``ModuleDict``) are
      never layers themselves.

    Containers are listed in registration order, which is the forward order of such
    models; when a model registers its blocks in another order, pass ``layers=`` to
    :func:`apply_activation_memory` in forward order. hyper_parallel wrappers are seen
    through (a wrapped layer keeps the name of its position).

    Args:
        model: the model.

    Returns:
        Names such as ``["model.layers.0", "model.layers.1", ...]``
        (``model.get_submodule(name)`` returns the layer, or its wrapper).

    Raises:
        ValueError: when no repeated blocks are found (the message says to pass
            ``layers=``).
        TypeError: when ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hyper_parallel: find_layers expects an nn.Module (the model whose "
                        f"repeated blocks to list); got {type(model).__name__}.")
    return [slot.name for slot in find_layer_slots(model)]


def resolve_layer_slots(model: nn.Module, layers) -> list[LayerSlot]:
    """The slots named by ``layers`` (see ``apply_activation_memory``): ``None`` (found by
    :func:`find_layers`), a predicate ``predicate(name, module) -> bool`` (every matching
    module not inside another match, in registration order), or an iterable of names
    and/or modules (wrapped or not), in the order given.

    Raises:
        ValueError: for an unknown name, a module not in ``model``, a layer listed twice,
            one layer inside another, or an empty selection.
        TypeError: for anything else.
    """
    if layers is None:
        return find_layer_slots(model)
    slots = list(walk(model))
    if callable(layers) and not isinstance(layers, nn.Module):
        chosen: list[LayerSlot] = []
        for slot in slots:
            if any(slot.name.startswith(c.name + ".") for c in chosen):
                continue
            if layers(slot.name, slot.layer):
                chosen.append(slot)
        if not chosen:
            raise ValueError("hyper_parallel: the layers= predicate matched no module of the "
                             "model; it is called as predicate(name, module) -> bool for every "
                             "submodule (names as in model.named_modules()).")
        _check_called(chosen)
        return chosen
    if isinstance(layers, (str, nn.Module)) or not isinstance(layers, Iterable):
        raise TypeError("hyper_parallel: layers= takes a list of layer names or modules, or a "
                        "predicate(name, module) -> bool; got "
                        f"{type(layers).__name__}")
    by_name = {s.name: s for s in slots}
    by_id = {}
    for s in slots:
        by_id.setdefault(id(s.current), s)
        by_id.setdefault(id(s.layer), s)
    chosen = []
    for item in layers:
        if isinstance(item, str):
            slot = by_name.get(item)
            if slot is None:
                raise ValueError(f"hyper_parallel: layers= names {item!r}, which is not a submodule "
                                 f"of {type(model).__name__} (find_layers(model) lists its blocks)")
        elif isinstance(item, nn.Module):
            slot = by_id.get(id(item))
            if slot is None:
                raise ValueError(f"hyper_parallel: layers= lists a {type(item).__name__} that is not "
                                 f"a submodule of {type(model).__name__}")
        else:
            raise TypeError("hyper_parallel: layers= entries must be names or modules; got "
                            f"{type(item).__name__}")
        chosen.append(slot)
    _check_disjoint(chosen)
    _check_called(chosen)
    return chosen


def _check_called(slots: list[LayerSlot]) -> None:
    for s in slots:
        if isinstance(s.layer, UNCALLED):
            raise ValueError(
                f"hyper_parallel: layers= names {s.name!r}, a {type(s.layer).__name__}: it has "
                "no forward and is never called, so a strategy on it would save nothing. Name "
                f"the blocks inside it ({s.name!r}.0, ...), or leave layers= out (find_layers "
                "flattens lists of ModuleLists).")


def _check_disjoint(slots: list[LayerSlot]) -> None:
    if not slots:
        raise ValueError("hyper_parallel: layers= is empty; list at least one layer")
    names = [s.name for s in slots]
    for i, a in enumerate(names):
        for b in names[:i]:
            if a == b:
                raise ValueError(f"hyper_parallel: layers= lists {a!r} twice")
            if a.startswith(b + ".") or b.startswith(a + "."):
                inner, outer = (a, b) if a.startswith(b + ".") else (b, a)
                raise ValueError(f"hyper_parallel: layers= lists {inner!r} inside {outer!r}; a "
                                 "layer is wrapped whole, so list either one, not both")


#: ``predicate(name, module) -> bool`` accepted by ``layers=``.
LayerPredicate = Callable[[str, nn.Module], bool]
