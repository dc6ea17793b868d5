"""Helpers of the torch.compile tests: a backend that counts the runs of its graphs, and
dynamo's own counters (an eager fallback runs no counted graph and fails the test)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch import nn


class CountingBackend:
    """A dynamo backend (``"aot_eager"`` or ``"inductor"`` inside) that counts how many
    graphs it compiled and how often their compiled forward ran (a forward run of a
    traced region, or of a compiled block in forward and in recompute)."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


class TinyBlock(nn.Module):
    """Pre-norm MLP block: layer_norm, addmm, gelu, mul, add (a few ops to choose from)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(self.norm(x)))
        return x + self.fc2(h).sin() * 0.5


def fresh() -> None:
    """Forgets every compiled graph and counter (each test counts from zero)."""
    torch._dynamo.reset()
    counters.clear()


def graph_breaks() -> dict:
    return dict(counters["graph_break"])


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def train_steps(module, x0: torch.Tensor, steps: int = 2, params=None):
    """Runs ``steps`` forward + backward steps of ``module`` (or a function of the
    ``params``); returns (output, input grad, parameter grads, peak saved bytes of the
    last step)."""
    from hyper_parallel.core.activation_checkpoint import saved_activation_memory

    params = list(module.parameters() if params is None else params)
    for p in params:
        p.grad = None
    peak = None
    for _ in range(steps):
        x = x0.clone().requires_grad_()
        with saved_activation_memory() as meter:
            y = module(x)
        y.sum().backward()
        peak = meter.peak_bytes
    return y.detach(), x.grad, [p.grad.clone() for p in params], peak


def twin_block(seed: int = 0, d: int = 8) -> tuple[TinyBlock, TinyBlock]:
    torch.manual_seed(seed)
    a = TinyBlock(d)
    b = TinyBlock(d)
    b.load_state_dict(a.state_dict())
    return a, b


def assert_same(a, b, exact: bool = True) -> None:
    ya, gxa, gpa, _ = a
    yb, gxb, gpb, _ = b
    for s, t in zip([ya, gxa, *gpa], [yb, gxb, *gpb]):
        if exact:
            assert torch.equal(s, t), (s - t).abs().max()
        else:
            torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-6)
