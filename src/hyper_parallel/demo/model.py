"""The demo's model: ``transformers``' LlamaForCausalLM, randomly initialised, small."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .data import VOCAB_SIZE


def build_config(*, layers: int, hidden: int, heads: int, seq_len: int,
                 attn: str = "eager") -> LlamaConfig:
    """A small Llama configuration over byte tokens.

    Args:
        layers: number of decoder layers.
        hidden: hidden size (must be divisible by ``heads``).
        heads: attention heads (key/value heads equal, no grouped-query attention).
        seq_len: longest sequence, in tokens.
        attn: ``"eager"`` (attention as matmul + softmax; the matmuls are visible to a
            selective policy) or ``"sdpa"`` (one fused kernel, which "selective" keeps).

    Returns:
        The config. ``use_cache`` is off: training needs no key/value cache, and a cache
        would be appended to again when a checkpointed layer is recomputed (that is also
        why ``transformers`` turns it off with its own gradient checkpointing).

    Raises:
        ValueError: when ``hidden`` is not a multiple of ``heads``.
    """
    if hidden % heads:
        raise ValueError(f"hyper_parallel: --hidden {hidden} must be a multiple of --heads {heads}")
    # Llama's MLP width is about 8/3 of the hidden size; round up to a multiple of 32.
    intermediate = -(-(hidden * 8 // 3) // 32) * 32
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )


def build_model(config: LlamaConfig, *, seed: int) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM (float32, on CPU, in training mode)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def initial_state(config: LlamaConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights every strategy starts from (a deep copy, on CPU)."""
    return copy.deepcopy(build_model(config, seed=seed).state_dict())


def fresh_model(config: LlamaConfig, state: dict[str, torch.Tensor],
                device: torch.device) -> LlamaForCausalLM:
    """A new model holding exactly ``state``, moved to ``device``."""
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.train()
    return model.to(device)


def parameter_count(model: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
