"""Models the benchmarks run: a Llama-style decoder stack and a many-small-ops block.

The Llama-style layer is the usual pre-norm decoder layer: RMSNorm, grouped-query
attention with rotary embeddings (scaled_dot_product_attention, causal), RMSNorm, SwiGLU
MLP, residuals; linears without bias (they reach the dispatcher as ``aten.mm``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(seq: int, head_dim: int, device=None, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq, device=device).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


class LlamaLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.attn_norm = RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaStack(nn.Module):
    """``layers`` decoder layers on a (batch, seq, d) input; rotary tables are buffers
    shared by all layers (as in real models: a storage every layer saves)."""

    def __init__(self, layers: int, d: int, heads: int, kv_heads: int, ffn: int, seq: int):
        super().__init__()
        self.layers = nn.ModuleList(LlamaLayer(d, heads, kv_heads, ffn) for _ in range(layers))
        cos, sin = rope_tables(seq, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, call_layer=None):
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin) if call_layer is None else call_layer(i, layer, x, cos, sin)
        return x


class SmallOpsBlock(nn.Module):
    """A block of many cheap ops on small tensors, where per-op overhead dominates.

    Each of ``stages`` stages is a small matmul followed by ``pointwise`` elementwise ops
    (the sort of chain norms, activations, rotary embeddings and residual updates make).
    """

    def __init__(self, d: int = 32, stages: int = 8, pointwise: int = 12) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(d, d) / d ** 0.5)
                                        for _ in range(stages))
        self.pointwise = pointwise

    def forward(self, x):
        for w in self.weights:
            x = torch.mm(x, w)
            for j in range(self.pointwise):
                r = j % 4
                if r == 0:
                    x = torch.sin(x)
                elif r == 1:
                    x = x * 1.01
                elif r == 2:
                    x = torch.tanh(x)
                else:
                    x = x + 0.1
        return x


def count_ops(fn, *args) -> int:
    """Number of ATen ops ``fn(*args)`` dispatches (under grad, as in a forward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn(*args)
    return Counter.n
