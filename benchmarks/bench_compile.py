"""Graphs, graph breaks and peak saved bytes of a transformers LlamaForCausalLM compiled
per block, for each activation-memory strategy, eager and compiled (docs/benchmarks.md,
"torch.compile").

    PYTHONPATH=src python benchmarks/bench_compile.py                     # aot_eager
    PYTHONPATH=src python benchmarks/bench_compile.py --backend inductor  # slower to compile

Each strategy runs in this process, one after the other, on the same weights and tokens:
two training steps eagerly, then (after ``torch._dynamo.reset()``) two steps with every
decoder layer compiled (``nn.Module.compile``; the wrapper itself is compiled, or the
layer inside it, as the strategy's order says). ``graphs`` is dynamo's count of distinct
graphs, ``breaks`` the graph breaks it recorded, ``recompiles`` the new graphs of the
second step (must be 0). ``peak saved`` is ``saved_activation_memory().peak_bytes`` of the
second step; ``offload`` the bytes the swap engine moved to the host in it. ``loss ==``
says whether the compiled losses equal the eager ones bitwise (aot_eager runs the same
ATen ops; inductor fuses them and may differ in the last bits).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_facts, print_facts, table  # noqa: E402

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    SwapManager, checkpoint_wrapper, saved_activation_memory, swap_wrapper)
from hyper_parallel.demo.model import build_config, build_model  # noqa: E402

_ATEN = torch.ops.aten
MATMULS = [_ATEN.mm, _ATEN.addmm, _ATEN.bmm]


def _chain(layers) -> None:
    for i in range(len(layers) - 1):
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])


def _compile_layers(layers, backend) -> None:
    for layer in layers:
        layer.compile(backend=backend)


def _hf(model, layers, backend):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if backend:
        _compile_layers(layers, backend)


def _outer(make, chain=False):
    """The wrapper is compiled: torch.compile(wrapper(layer))."""
    def apply(model, layers, backend):
        for i, layer in enumerate(layers):
            layers[i] = make(layer)
        if chain:
            _chain(layers)
        if backend:
            _compile_layers(layers, backend)
    return apply


def _inner(make, chain=False):
    """The layer is compiled: wrapper(torch.compile(layer))."""
    def apply(model, layers, backend):
        if backend:
            _compile_layers(layers, backend)
        for i, layer in enumerate(layers):
            layers[i] = make(layer)
        if chain:
            _chain(layers)
    return apply


STRATEGIES = {
    "none": ("no checkpoint", lambda model, layers, backend: backend and _compile_layers(
        layers, backend)),
    "hf_gc": ("transformers gradient_checkpointing_enable", _hf),
    "checkpoint": ("compile(checkpoint_wrapper(layer))", _outer(checkpoint_wrapper)),
    "selective": ("compile(checkpoint_wrapper(layer, policy_fn=[mm, addmm, bmm]))",
                  _outer(lambda m: checkpoint_wrapper(m, policy_fn=MATMULS))),
    "swap": ("compile(swap_wrapper(layer)) + chain", _outer(swap_wrapper, chain=True)),
    "checkpoint_inner": ("checkpoint_wrapper(compile(layer))", _inner(checkpoint_wrapper)),
    "selective_inner": ("checkpoint_wrapper(compile(layer), policy_fn=[mm, addmm, bmm])",
                        _inner(lambda m: checkpoint_wrapper(m, policy_fn=MATMULS))),
    "swap_inner": ("swap_wrapper(compile(layer)) + chain", _inner(swap_wrapper, chain=True)),
}


def run(name: str, backend: str | None, args) -> dict:
    """Two steps of one strategy; ``backend`` None runs eagerly."""
    torch._dynamo.reset()
    counters.clear()
    SwapManager().reset()
    config = build_config(layers=args.layers, hidden=args.hidden, heads=args.heads,
                          seq_len=args.seq)
    model = build_model(config, seed=0)
    STRATEGIES[name][1](model, model.model.layers, backend)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    losses, graphs_after_first = [], 0
    for step in range(2):
        SwapManager().reset_stats()
        with saved_activation_memory() as meter:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        SwapManager().synchronize()
        losses.append(loss.detach())
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    return {"graphs": graphs, "breaks": sum(counters["graph_break"].values()),
            "recompiles": graphs - graphs_after_first, "peak": meter.peak_bytes,
            "offload": SwapManager().stats()["offload_bytes"], "losses": losses}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    SwapManager().set_cpu_swap(True)
    print_facts(machine_facts())
    print(f"LlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"batch {args.batch} x seq {args.seq}; compiled per decoder layer, backend "
          f"{args.backend}\n")
    rows = []
    for name in args.strategies.split(","):
        eager = run(name, None, args)
        compiled = run(name, args.backend, args)
        same = all(torch.equal(a, b) for a, b in zip(eager["losses"], compiled["losses"]))
        rows.append([name, STRATEGIES[name][0], compiled["graphs"], compiled["breaks"],
                     compiled["recompiles"], eager["peak"], compiled["peak"],
                     f"{compiled['peak'] / eager['peak']:.3f}" if eager["peak"] else "-",
                     eager["offload"], compiled["offload"], "yes" if same else "no"])
    print(table(["strategy", "order", "graphs", "breaks", "recompiles", "peak saved eager",
                 "peak saved compiled", "compiled/eager", "offload eager", "offload compiled",
                 "loss =="], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
