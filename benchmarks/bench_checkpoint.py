"""Full activation checkpoint: hyper_parallel vs torch.utils.checkpoint (non-reentrant).

Same Llama-style stack, same weights and input for every contender; each layer is a
checkpoint region. Contenders:

* ``none``: no checkpoint (the baseline every ratio is also given against);
* ``torch``: ``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)``;
* ``ours checkpoint()``: ``hyper_parallel...checkpoint(layer, ...)``;
* ``ours checkpoint_wrapper``: the layers wrapped with ``checkpoint_wrapper``.

Prints step time as ratios (target: ours within 2% of torch) and peak saved-activation
bytes (``saved_activation_memory``) as ratios, and checks that the gradients are
bitwise identical to torch's.

Usage: PYTHONPATH=src python benchmarks/bench_checkpoint.py [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.utils.checkpoint as tc

from hyper_parallel.core.activation_checkpoint import (
    checkpoint,
    checkpoint_wrapper,
    saved_activation_memory,
)

try:  # run as a script (benchmarks/ on sys.path) or as a module of a package
    from _common import (add_llama_args, bench_main, fmt_ratio, interleaved, machine_facts,
                         median, mib, paired_ratio, print_facts, set_threads, table, verdict)
    from _models import LlamaStack
except ImportError:  # pragma: no cover
    from ._common import (add_llama_args, bench_main, fmt_ratio, interleaved, machine_facts,
                          median, mib, paired_ratio, print_facts, set_threads, table, verdict)
    from ._models import LlamaStack

TARGET = 1.02  # ours / torch step time


def build(args):
    torch.manual_seed(0)
    model = LlamaStack(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.seq)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    wrapped = [checkpoint_wrapper(layer) for layer in model.layers]
    callers = {
        "none": None,
        "torch": lambda i, layer, h, c, s: tc.checkpoint(layer, h, c, s, use_reentrant=False),
        "ours checkpoint()": lambda i, layer, h, c, s: checkpoint(layer, h, c, s),
        "ours checkpoint_wrapper": lambda i, layer, h, c, s: wrapped[i](h, c, s),
    }
    return model, x, callers


def make_step(model, x, call_layer):
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        out = model(x, call_layer)
        out.float().pow(2).mean().backward()

    return step


def peak_saved(model, x, call_layer) -> int:
    with saved_activation_memory() as meter:
        out = model(x, call_layer)
    out.float().pow(2).mean().backward()
    return meter.peak_bytes


def grads(model, x, call_layer):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x, call_layer).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def run(args) -> dict:
    out = {}
    for label, cfg in configs(args):
        out[label] = run_config(label, cfg, args)
    return out


def configs(args):
    """The Llama-style stack as given on the command line, then a tiny one of the same
    shape where the per-region fixed cost (not the math) dominates the step."""
    main = argparse.Namespace(**vars(args))
    tiny = argparse.Namespace(**vars(args))
    tiny.layers, tiny.hidden, tiny.heads, tiny.kv_heads, tiny.ffn, tiny.seq, tiny.batch = \
        8, 32, 4, 2, 88, 16, 1
    return [("llama", main), ("tiny (per-region overhead)", tiny)]


def run_config(label, args, opts) -> dict:
    model, x, callers = build(args)
    steps = {name: make_step(model, x, fn) for name, fn in callers.items()}
    ref = grads(model, x, callers["torch"])
    same = {name: all(torch.equal(a, b) for a, b in zip(ref, grads(model, x, fn)))
            for name, fn in callers.items()}
    peaks = {name: peak_saved(model, x, fn) for name, fn in callers.items()}
    times = interleaved(steps, rounds=opts.rounds, warmup=opts.warmup)

    rows = []
    for name in callers:
        t, n, tt = times[name], times["none"], times["torch"]
        rows.append([
            name,
            f"{median(t.cpu) / median(n.cpu):.3f}",
            fmt_ratio(t.cpu, tt.cpu),
            fmt_ratio(t.wall, tt.wall),
            mib(peaks[name]),
            f"{peaks[name] / peaks['none']:.3f}",
            f"{peaks[name] / peaks['torch']:.3f}",
            "yes" if same[name] else "NO",
        ])
    print(table(["contender", "time/none (cpu)", "time/torch (cpu) [IQR]",
                 "time/torch (wall) [IQR]", "peak saved MiB", "saved/none", "saved/torch",
                 "grads == torch"], rows,
                title=f"\n## Full checkpoint vs torch.utils.checkpoint (use_reentrant=False): "
                      f"{label}, {args.layers} layers, d={args.hidden}, ffn={args.ffn}, "
                      f"batch {args.batch} x seq {args.seq}"))
    results = {}
    for name in ("ours checkpoint()", "ours checkpoint_wrapper"):
        r, lo, hi = paired_ratio(times[name].cpu, times["torch"].cpu)
        rw = paired_ratio(times[name].wall, times["torch"].wall)[0]
        results[name] = r
        # From the paired ratio (steadier than a difference of medians).
        extra_us = (r - 1.0) * median(times["torch"].cpu) / args.layers * 1e6
        print(f"target: {name} step time <= {TARGET:.2f} x torch: cpu {r:.3f} "
              f"(IQR {lo:.3f}-{hi:.3f}) -> {verdict(r <= TARGET)}; wall {rw:.3f}; "
              f"{extra_us:+.0f} us cpu per region vs torch; saved bytes ratio "
              f"{peaks[name] / peaks['torch']:.3f}")
    print(f"(none step: {median(times['none'].cpu) * 1e3:.1f} ms cpu, "
          f"{median(times['none'].wall) * 1e3:.1f} ms wall, for scale only; "
          f"{opts.rounds} interleaved rounds)")
    return {"time_ratio": results, "saved_ratio": {k: peaks[k] / peaks["torch"] for k in peaks}}


def add_args(p: argparse.ArgumentParser) -> None:
    add_llama_args(p, "--layers", rounds=21)


def main(argv=None) -> None:
    bench_main(__doc__, add_args, run, argv)


if __name__ == "__main__":
    main()
