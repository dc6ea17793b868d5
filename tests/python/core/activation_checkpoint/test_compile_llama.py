"""A transformers LlamaForCausalLM compiled per decoder layer with our wrappers: no more
graphs than with Hugging Face's own gradient checkpointing on the same model, no break
inside a checkpoint wrapper, the same loss and gradients as eager (issue 12, item 5)."""

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import (
    SwapManager, checkpoint_wrapper, swap_wrapper)
from hyper_parallel.demo.model import build_config, build_model

from ._compile_support import CountingBackend, fresh, graph_breaks, unique_graphs

aten = torch.ops.aten


def _run(strategy: str):
    """(graphs, graph breaks, compiled graph runs, loss, grads) of two steps."""
    fresh()
    SwapManager().reset()
    config = build_config(layers=2, hidden=32, heads=2, seq_len=8)
    model = build_model(config, seed=0)
    layers = model.model.layers
    counting = CountingBackend()
    if strategy == "hf":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers):
        if strategy == "checkpoint":
            layers[i] = checkpoint_wrapper(layer)
        elif strategy == "selective":
            layers[i] = checkpoint_wrapper(layer, policy_fn=[aten.mm, aten.addmm, aten.bmm])
        elif strategy == "swap":
            layers[i] = swap_wrapper(layer)
        if strategy != "eager":
            layers[i].compile(backend=counting)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    for _ in range(2):
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return unique_graphs(), graph_breaks(), counting.runs, loss.detach(), grads


@pytest.fixture(scope="module")
def reference():
    return {name: _run(name) for name in ("eager", "hf")}


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region")
@pytest.mark.parametrize("strategy", ["checkpoint", "selective", "swap"])
def test_graphs_no_more_than_hf_gradient_checkpointing(strategy, reference):
    graphs, breaks, runs, loss, grads = _run(strategy)
    hf_graphs, hf_breaks, _, _, _ = reference["hf"]
    assert hf_breaks == {}
    assert graphs <= hf_graphs, (graphs, hf_graphs)
    if strategy == "swap":  # the region's entry and exit only (test_compile_swap_wrapper)
        assert all("swap_region_" in reason for reason in breaks), list(breaks)
    else:
        assert breaks == {}
    assert runs == 2 * 2  # two layers, two steps: every forward ran a compiled graph
    _, _, _, eager_loss, eager_grads = reference["eager"]
    assert torch.equal(loss, eager_loss)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b), (a - b).abs().max()
