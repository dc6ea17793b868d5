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


def _containers(model: nn.Module) -> Iterator[tuple[str, list[LayerSlot]]]:
    """Each ``nn.ModuleList`` / ``nn.Sequential`` (the root included) with its children."""
    root = unwrapped(model)
    if isinstance(root, (nn.ModuleList, nn.Sequential)):
        yield "", [LayerSlot(k, root, k) for k, m in root._modules.items() if m is not None]
    for slot in walk(model):
        container = slot.layer
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            yield slot.name, [LayerSlot(f"{slot.name}.{k}", container, k)
                              for k, m in container._modules.items() if m is not None]


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
        if all(type(s.layer) is kind for s in slots):
            best = slots
    if not best:
        raise ValueError(
            f"hyper_parallel: find_layers found no repeated blocks in {type(model).__name__}: no "
            "nn.ModuleList or nn.Sequential holds two or more modules of one type (nor, for a "
            "transformers model, modules of its _no_split_modules classes). Name the layers "
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
      a tie.

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
    return chosen


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
