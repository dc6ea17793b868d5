"""The activation-memory strategies of the demo, applied the way a user would.

Each strategy rewrites ``model.model.layers`` (the decoder layers of a LlamaForCausalLM)
in place with the public API of ``hyper_parallel.core.activation_checkpoint``. The
layers receive shared inputs (rotary ``position_embeddings``, the attention mask,
position ids) as keyword arguments; the wrappers pass them through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy,
    SwapManager,
    checkpoint_wrapper,
    swap_wrapper,
)

#: Matrix-multiply ops whose outputs the selective strategies keep (or swap). A Linear
#: without bias reaches the dispatcher as ``aten.mm``, with bias as ``aten.addmm``; eager
#: attention's two products are ``aten.bmm``.
MATMUL_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
              torch.ops.aten.baddbmm)
_MATMUL_NAMES = frozenset(f"{packet}.default" for packet in MATMUL_OPS)


def swap_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective checkpoint with swap: offload matmul outputs to the host, recompute the
    rest. ``str(op)`` is the overload's name, e.g. ``"aten.mm.default"``."""
    if str(op) in _MATMUL_NAMES:
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


def _chain(layers: nn.ModuleList) -> None:
    """Registers the forward order of all layers: layer i's activations are offloaded
    while layer i+1 runs forward and prefetched while layer i+1 runs backward."""
    manager = SwapManager()
    for i in range(len(layers) - 1):
        manager.set_forward_prefetch_layer(layers[i], layers[i + 1])


def _apply_none(layers: nn.ModuleList) -> None:
    return None


def _apply_checkpoint(layers: nn.ModuleList) -> None:
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


def _apply_selective(layers: nn.ModuleList) -> None:
    # A list of ops: save their outputs, recompute the rest (decided in C++, per op).
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, policy_fn=list(MATMUL_OPS))


def _apply_swap(layers: nn.ModuleList) -> None:
    for i, layer in enumerate(layers):
        layers[i] = swap_wrapper(layer)
    _chain(layers)


def _apply_mixed(layers: nn.ModuleList) -> None:
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer) if i % 2 == 0 else swap_wrapper(layer)
    _chain(layers)


def _apply_selective_swap(layers: nn.ModuleList) -> None:
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, policy_fn=swap_matmuls_policy)
    _chain(layers)


@dataclass(frozen=True)
class Strategy:
    """One way to treat the decoder layers' activations."""

    name: str
    description: str
    apply: Callable[[nn.ModuleList], None]
    uses_swap: bool


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", "every activation saved on the device", _apply_none, False),
        Strategy("checkpoint", "checkpoint_wrapper on every layer (full recompute)",
                 _apply_checkpoint, False),
        Strategy("selective", "checkpoint_wrapper, policy_fn=[mm, addmm, bmm, baddbmm] saved",
                 _apply_selective, False),
        Strategy("swap", "swap_wrapper on every layer + prefetch chain", _apply_swap, True),
        Strategy("mixed", "even layers checkpoint, odd layers swap + chain", _apply_mixed,
                 True),
        Strategy("selective_swap", "checkpoint_wrapper, MUST_SWAP for matmul outputs + chain",
                 _apply_selective_swap, True),
    )
}


def parse_strategies(text: str) -> list[str]:
    """Parses a comma-separated list of strategy names (order kept, duplicates dropped).

    Raises:
        ValueError: naming any unknown strategy and listing the known ones.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        given = ", ".join(unknown) or "(none given)"
        raise ValueError(f"hyper_parallel: unknown strategy {given}; "
                         f"choose from {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(names))


def apply_strategy(model: nn.Module, name: str) -> Strategy:
    """Applies strategy ``name`` to ``model.model.layers`` in place; returns it."""
    strategy = STRATEGIES[name]
    strategy.apply(model.model.layers)
    return strategy
