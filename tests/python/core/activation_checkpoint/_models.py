"""Small models shared by the activation_checkpoint tests."""

import copy

import torch
from torch import nn


class Block(nn.Module):
    """A transformer-like block: pre-norm MLP with a residual connection and a buffer."""

    def __init__(self, d: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + self.drop(h) * self.scale


class OpsNet(nn.Module):
    """One op of each policy-relevant kind: addmm (Linear with bias), relu, mm (Linear
    without bias), tanh; input (n, D) float32."""

    D = 8

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1 = nn.Linear(self.D, 2 * self.D)
        self.fc2 = nn.Linear(2 * self.D, self.D, bias=False)

    def forward(self, x):
        return torch.tanh(self.fc2(torch.relu(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = 4, d: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, dropout) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def grads(model: nn.Module):
    return [p.grad.clone() for p in model.parameters()]


def assert_bitwise(a_list, b_list):
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        assert torch.equal(a, b), (a - b).abs().max()


def run_reversed_accumulation(model: nn.Module, ref: nn.Module, x1, x2) -> None:
    """Two forwards, then their backwards in reverse order, on ``model`` and on ``ref``."""
    for m in (model, ref):
        l1, l2 = m(x1), m(x2)
        l2.backward()
        l1.backward()


def applied_peak(model: nn.Module, step, plan, **apply_kwargs) -> int:
    """The saved-activation meter's peak (bytes) of the second of two steps with ``plan``
    applied (the first teaches the engine the chain's last layer); gradients are reset
    after each step and the plan is removed afterwards."""
    from hyper_parallel.core.activation_checkpoint import (SwapManager,
                                                           apply_activation_memory,
                                                           remove_activation_memory,
                                                           saved_activation_memory)

    apply_activation_memory(model, plan, **apply_kwargs)
    try:
        for _ in range(2):
            with saved_activation_memory() as meter:
                step()
            SwapManager().synchronize()
            for p in model.parameters():
                p.grad = None
    finally:
        remove_activation_memory(model)
    return meter.peak_bytes
