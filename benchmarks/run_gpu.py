"""GPU benchmark, one command: step time and device peak memory of every strategy on a
Llama-style stack, the achieved D2H/H2D bandwidth and the fraction of copy time hidden
behind compute, against PyTorch's own tools (and torchtune's offloading when installed).

    PYTHONPATH=src python benchmarks/run_gpu.py                # CUDA, Llama-8B-like layers
    PYTHONPATH=src python benchmarks/run_gpu.py --device cpu   # smoke test of the script

Contenders, all on the same layer modules (shared weights), the same input, one process:

* ``none``; ours: ``checkpoint`` (checkpoint_wrapper), ``selective`` (checkpoint_wrapper
  with a declarative op list: matmuls and attention kept), ``selective_swap`` (the same
  ops ``MUST_SWAP``), ``swap`` (swap_wrapper + prefetch chain), ``mixed`` (even layers
  checkpoint, odd layers swap, one chain);
* torch: ``torch checkpoint`` (use_reentrant=False), ``torch SAC`` (same op list),
  ``save_on_cpu`` (pin_memory=True, around the whole forward);
* ``torchtune offload`` (``torchtune.training.OffloadActivations``, streams on) if torchtune
  imports.

Step times are medians over interleaved rounds (every contender once per round, order
rotated); peak memory is ``torch.cuda.max_memory_allocated`` during one step minus what
was allocated before it (weights, input). One step per contender is then run under
``torch.profiler``: the device memcpy events give the copy time and bytes per direction
(bandwidth = bytes / busy time of that direction), and the hidden fraction is the part of
the copy time during which a compute kernel ran on the device at the same time. Results
print as a table of ratios to ``none`` (and ours vs torch's tools), plus a JSON file with
``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile

import torch
import torch.utils.checkpoint as tc
from torch.autograd.graph import save_on_cpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import interleaved, machine_facts, median, print_facts, table  # noqa: E402
from _models import LlamaStack  # noqa: E402

from hyper_parallel.core.activation_checkpoint import (  # noqa: E402
    CheckpointPolicy,
    SwapManager,
    checkpoint_wrapper,
    saved_activation_memory,
    swap_wrapper,
)

# Ops whose outputs the selective strategies keep (or swap): the matmuls, and the fused
# attention ops (their output and logsumexp are what attention's backward needs).
_KEEP_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_flash_attention_for_cpu")


def keep_ops():
    """(packets, default overloads) of _KEEP_OP_NAMES registered in this torch."""
    packets, overloads = [], []
    for name in _KEEP_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        try:
            overloads.append(packet.default)
        except AttributeError:
            continue
        packets.append(packet)
    return packets, overloads


# ---------------------------------------------------------------- device helpers
class Device:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.cuda = kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        else:
            SwapManager().synchronize()

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- contenders
_OURS = ("checkpoint", "selective", "selective_swap", "swap", "mixed")


def build_contenders(model: LlamaStack, want: list[str], owned_params: list | None = None):
    """name -> (call_layer or None, outer context factory or None). Each of our strategies
    wraps its own copy of ``model``'s layers (same initial weights; a module has one
    hyper_parallel wrapper at a time) with its own chain; their parameters are appended
    to ``owned_params`` (the step clears their gradients as it does the model's)."""
    packets, overloads = keep_ops()
    manager = SwapManager()

    def own_layers():
        copies = [copy.deepcopy(m) for m in model.layers]
        if owned_params is not None:
            owned_params.extend(p for m in copies for p in m.parameters())
        return copies

    def chain(wrapped):
        for a, b in zip(wrapped, wrapped[1:]):
            manager.set_forward_prefetch_layer(a, b)
        return wrapped

    def calls(wrapped):
        return lambda i, layer, h, c, s: wrapped[i](h, c, s)

    def make(name):
        if name == "none":
            return None, None
        layers = own_layers() if name in _OURS else None
        if name == "checkpoint":
            return calls([checkpoint_wrapper(m) for m in layers]), None
        if name == "selective":
            return calls([checkpoint_wrapper(m, policy_fn=list(packets)) for m in layers]), None
        if name == "selective_swap":
            policy = {p: CheckpointPolicy.MUST_SWAP for p in packets}
            return calls(chain([checkpoint_wrapper(m, policy_fn=policy) for m in layers])), None
        if name == "swap":
            return calls(chain([swap_wrapper(m) for m in layers])), None
        if name == "mixed":
            wrapped = [checkpoint_wrapper(m) if i % 2 == 0 else swap_wrapper(m)
                       for i, m in enumerate(layers)]
            return calls(chain(wrapped)), None
        if name == "torch checkpoint":
            return (lambda i, layer, h, c, s: tc.checkpoint(layer, h, c, s,
                                                            use_reentrant=False)), None
        if name == "torch SAC":
            import functools
            ctx = functools.partial(tc.create_selective_checkpoint_contexts, list(overloads))
            return (lambda i, layer, h, c, s: tc.checkpoint(
                layer, h, c, s, use_reentrant=False, context_fn=ctx)), None
        if name == "save_on_cpu":
            return None, lambda: save_on_cpu(pin_memory=True)
        if name == "torchtune offload":
            try:
                from torchtune.training import OffloadActivations
            except Exception as err:  # noqa: BLE001 - any import failure means "absent"
                print(f"  (torchtune offload skipped: {type(err).__name__}: {err})")
                return None
            return None, lambda: OffloadActivations()
        raise ValueError(f"unknown contender {name}")

    out = {}
    for name in want:
        made = make(name)
        if made is not None:
            out[name] = made
    return out


ALL = ["none", "checkpoint", "selective", "selective_swap", "swap", "mixed",
       "torch checkpoint", "torch SAC", "save_on_cpu", "torchtune offload"]
_METER_BLIND = {"torch SAC", "save_on_cpu", "torchtune offload"}
OURS_VS_TORCH = {"checkpoint": "torch checkpoint", "selective": "torch SAC",
                 "swap": "save_on_cpu", "mixed": "save_on_cpu"}


# ---------------------------------------------------------------- trace analysis
def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(a, b) -> float:
    """Total length of the intersection of two interval unions."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyse_trace(events: list[dict]) -> dict:
    """Copy time, bytes, bandwidth and hidden fraction from chrome-trace events
    (``ts``/``dur`` in microseconds; ``cat`` ``gpu_memcpy`` and ``kernel``)."""
    kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("cat") == "kernel" and e.get("dur", 0) > 0])
    out = {}
    all_copies = []
    for direction, keys in (("d2h", ("DtoH", "Device -> Pinned", "Device -> Pageable")),
                            ("h2d", ("HtoD", "Pinned -> Device", "Pageable -> Device"))):
        evs = [e for e in events if e.get("cat") == "gpu_memcpy"
               and any(k in e.get("name", "") for k in keys) and e.get("dur", 0) > 0]
        spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        busy_us = sum(e - s for s, e in spans)
        nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in evs)
        hidden_us = _overlap(spans, kernels)
        all_copies += spans
        out[direction] = {
            "copies": len(evs), "bytes": nbytes, "busy_ms": busy_us / 1e3,
            "GBps": (nbytes / (busy_us * 1e-6) / 1e9) if busy_us > 0 else None,
            "hidden": (hidden_us / busy_us) if busy_us > 0 else None,
        }
    spans = _union(all_copies)
    busy = sum(e - s for s, e in spans)
    out["all"] = {"busy_ms": busy / 1e3,
                  "hidden": (_overlap(spans, kernels) / busy) if busy > 0 else None}
    return out


def profile_step(step) -> dict | None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return analyse_trace(events)


# ---------------------------------------------------------------- main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--contenders", default=",".join(ALL),
                   help=f"comma-separated subset of: {', '.join(ALL)}")
    p.add_argument("--no-profile", action="store_true", help="skip the bandwidth/overlap pass")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)

    dev = Device(args.device)
    if dev.cuda and not torch.cuda.is_available():
        raise SystemExit("hyper_parallel: run_gpu.py needs a CUDA device "
                         "(use --device cpu for a smoke test of the script)")
    if not dev.cuda:
        SwapManager().set_cpu_swap(True)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        if args.hidden == 4096:  # defaults are GPU-sized; shrink for the smoke test
            args.layers, args.hidden, args.heads, args.kv_heads = 4, 128, 4, 2
            args.ffn, args.seq, args.dtype = 352, 128, "float32"
    dtype = getattr(torch, args.dtype)
    print("# hyper_parallel GPU benchmark")
    print_facts(machine_facts(args.device))
    print(f"  model: {args.layers} Llama-style layers, d={args.hidden}, heads {args.heads}/"
          f"{args.kv_heads} kv, ffn {args.ffn}, batch {args.batch} x seq {args.seq}, {args.dtype}")

    torch.manual_seed(0)
    with torch.device(args.device):  # initialise on the device: GPU-sized layers are slow on CPU
        model = LlamaStack(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn,
                           args.seq).to(dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype,
                    requires_grad=True)
    params = list(model.parameters())
    contenders = build_contenders(model, [c.strip() for c in args.contenders.split(",")],
                                  owned_params=params)

    def step_of(call_layer, ctx):
        def step():
            for q in params:
                q.grad = None
            x.grad = None
            with (ctx() if ctx is not None else contextlib.nullcontext()):
                out = model(x, call_layer)
            out.float().pow(2).mean().backward()
            for q in params:  # grads are not part of the activation memory compared
                q.grad = None
            x.grad = None

        return step

    steps = {name: step_of(*c) for name, c in contenders.items()}

    # Memory and offload volume, one step each (after a warm-up step).
    mem, offload = {}, {}
    for name, step in steps.items():
        step()
        dev.sync()
        dev.empty_cache()
        s0 = SwapManager().stats()
        if dev.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            dev.sync()
            mem[name] = torch.cuda.max_memory_allocated() - base
        else:
            with saved_activation_memory() as meter:
                step()
            dev.sync()
            # The meter sees tensors saved through autograd's hooks; torch SAC's cache and
            # the hooks of save_on_cpu / torchtune hide theirs from it (CPU smoke test only).
            mem[name] = None if name in _METER_BLIND else meter.peak_bytes
        s1 = SwapManager().stats()
        offload[name] = (s1["offload_bytes"] - s0["offload_bytes"],
                         s1["reload_bytes"] - s0["reload_bytes"],
                         s1["on_demand_reloads"] - s0["on_demand_reloads"])
        print(f"  measured memory: {name}", flush=True)

    times = interleaved(steps, rounds=args.rounds, warmup=args.warmup, sync=dev.sync)
    t = {name: median(v.wall) for name, v in times.items()}

    copies = {}
    if dev.cuda and not args.no_profile:
        for name, step in steps.items():
            c = copies[name] = profile_step(step)
            # Should a trace carry no byte counts, ours' engine counters stand in.
            for key, nbytes in (("d2h", offload[name][0]), ("h2d", offload[name][1])):
                if c[key]["bytes"] == 0 and nbytes and c[key]["busy_ms"] > 0:
                    c[key]["bytes"] = nbytes
                    c[key]["GBps"] = nbytes / (c[key]["busy_ms"] * 1e-3) / 1e9
            print(f"  profiled: {name}", flush=True)

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    def ratio(a, b):
        return "n/a" if a is None or b is None or b == 0 else f"{a / b:.3f}"

    mem_label = "peak MiB" if dev.cuda else "peak saved MiB (meter)"
    rows = []
    for name in steps:
        c = copies.get(name)
        d2h, h2d = (c["d2h"], c["h2d"]) if c else ({}, {})
        rows.append([
            name, f"{t[name] / t['none']:.3f}" if "none" in t else "n/a",
            fmt(None if mem[name] is None else mem[name] / 2**20, ".0f"),
            ratio(mem[name], mem.get("none")),
            f"{offload[name][0] / 2**20:.0f}",
            fmt(d2h.get("GBps"), ".1f"), fmt(h2d.get("GBps"), ".1f"),
            fmt(d2h.get("busy_ms"), ".1f"), fmt(h2d.get("busy_ms"), ".1f"),
            fmt(c["all"]["hidden"] if c else None, ".2f"),
            f"{offload[name][2]}",
        ])
    print(table(["contender", "time/none", mem_label, "mem/none", "offload MiB (ours)",
                 "D2H GB/s", "H2D GB/s", "D2H ms", "H2D ms", "copy hidden",
                 "on-demand reloads"], rows,
                title=f"\n## Strategies on {args.device} ({args.rounds} interleaved rounds; "
                      f"none step = {t.get('none', float('nan')) * 1e3:.1f} ms)"))
    pairs = [(o, r) for o, r in OURS_VS_TORCH.items() if o in t and r in t]
    if "torchtune offload" in t:
        pairs += [(o, "torchtune offload") for o in ("swap", "mixed") if o in t]
    if pairs:
        rows = [[f"{o} vs {r}", f"{t[o] / t[r]:.3f}", ratio(mem[o], mem[r])]
                for o, r in pairs]
        print(table(["ours vs torch", "time ratio", "memory ratio"], rows,
                    title="\n## Ours vs PyTorch's tools (same run)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": machine_facts(args.device), "args": vars(args),
                       "step_seconds": t, "peak_bytes": mem,
                       "offload": offload, "copies": copies}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
