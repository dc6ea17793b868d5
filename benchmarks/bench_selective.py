"""Selective checkpoint: hyper_parallel vs torch.utils.checkpoint with
create_selective_checkpoint_contexts, same policy, on blocks of many small ops.

Each block (``SmallOpsBlock``) is ``stages`` x (one small ``mm`` + ``pointwise``
elementwise ops) on a small tensor, so the per-op cost of the selective machinery (a
TorchDispatchMode call per op in forward and again in recompute, the policy decision,
the cache) dominates the step. Every block is one checkpoint region.

Part 1, "save mm" (the canonical policy of torch's documentation: keep ``aten.mm``
outputs, recompute the rest):

* ``torch SAC (policy_fn)``: ``context_fn=partial(create_selective_checkpoint_contexts,
  policy)`` with ``policy(ctx, op, ...)`` = ``MUST_SAVE if op in [aten.mm.default]``;
* ``torch SAC (op list)``: ``create_selective_checkpoint_contexts([aten.mm.default])``
  (torch turns the list into the same Python policy);
* ``ours policy_fn``: ``checkpoint_wrapper(block, policy_fn=policy)``, the same Python
  policy returning our ``CheckpointPolicy``: one Python call per op, as torch;
* ``ours declarative``: ``checkpoint_wrapper(block, policy_fn=[aten.mm.default])``, a
  C++ op table: no Python policy call per op;
* ``none`` and ``torch full checkpoint`` for scale.

Part 2, per-op overhead: a policy that recomputes everything
(``PREFER_RECOMPUTE`` for every op; ours declarative: ``{"*": PREFER_RECOMPUTE}``), so
the math is exactly full checkpoint's and
``overhead per op = (t_selective - t_full checkpoint, same library) / ops per region
forward``, in microseconds (it covers the op's visit in forward and in recompute).

Part 3, fits of the overhead per region, ``a + b*k`` for regions of ``k`` ops
(``PointwiseChain``: ``k`` elementwise ops on a small tensor, ``--fit-layers`` regions per
step, recompute-all policies, so every contender does full checkpoint's math):
overhead = step time of the contender - step time of torch's full checkpoint, per region;
``a`` (fixed, per region, in us) and ``b`` (per op, in us) by least squares over
``--fit-ops``. Contenders: torch SAC (``create_selective_checkpoint_contexts`` with a
Python policy), ours declarative (``{"*": PREFER_RECOMPUTE}``: C++ interception, no Python
call per op), ours callable (a Python policy: our region modes). All are timed in the same
interleaved rounds, 1 torch thread; every timed step of every contender is preceded by
the same ``gc.collect()`` (``_common._timed``), which makes each step equally cache-cold.

Usage: PYTHONPATH=src python benchmarks/bench_selective.py [--rounds 15] [--quick]
       [--fit-only]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint_wrapper

try:
    from _common import (bench_main, fmt_ratio, interleaved, machine_facts, median,
                         paired_ratio, print_facts, set_threads, table, verdict)
    from _models import SmallOpsBlock, count_ops
except ImportError:  # pragma: no cover
    from ._common import (bench_main, fmt_ratio, interleaved, machine_facts, median,
                          paired_ratio, print_facts, set_threads, table, verdict)
    from ._models import SmallOpsBlock, count_ops

MM = torch.ops.aten.mm.default
OPS_TO_SAVE = [MM]
TorchPolicy = tc.CheckpointPolicy


def torch_save_mm(ctx, op, *args, **kwargs):
    if op in OPS_TO_SAVE:
        return TorchPolicy.MUST_SAVE
    return TorchPolicy.PREFER_RECOMPUTE


def ours_save_mm(ctx, op, *args, **kwargs):
    if op in OPS_TO_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def torch_recompute_all(ctx, op, *args, **kwargs):
    return TorchPolicy.PREFER_RECOMPUTE


def ours_recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


class PassThrough(TorchDispatchMode):
    """A TorchDispatchMode that only runs each op: the floor cost of any selective
    checkpoint built on a Python dispatch mode (torch's and ours alike)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _pass_through_contexts():
    return PassThrough(), PassThrough()


def _torch_region(context_fn=None):
    def call(block, h):
        if context_fn is None:
            return tc.checkpoint(block, h, use_reentrant=False)
        return tc.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)

    return call


def _sac(policy):
    return _torch_region(functools.partial(tc.create_selective_checkpoint_contexts, policy))


def _ours(blocks, **kwargs):
    wrapped = [checkpoint_wrapper(b, **kwargs) for b in blocks]
    index = {id(b): i for i, b in enumerate(blocks)}
    return lambda block, h: wrapped[index[id(block)]](h)


def _train_step(blocks, x, call=None, return_grads=True):
    """One forward + backward of ``blocks`` on ``x`` (``call(block, h)`` runs a block;
    ``None``: plainly); with ``return_grads`` the step returns copies of the parameter and
    input gradients (else nothing, so a timed step pays no copies)."""
    params = list(blocks.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        h = x
        for block in blocks:
            h = block(h) if call is None else call(block, h)
        h.pow(2).mean().backward()
        if return_grads:
            return [p.grad.clone() for p in params] + [x.grad.clone()]
        return None

    return step


def _measure(blocks, x, callers: dict, rounds: int, warmup: int):
    def step_of(call):
        return _train_step(blocks, x, call, return_grads=False)

    def grads(call):
        return _train_step(blocks, x, call)()

    ref = grads(None)
    same = {name: all(torch.equal(a, b) for a, b in zip(ref, grads(c)))
            for name, c in callers.items()}
    times = interleaved({n: step_of(c) for n, c in callers.items()}, rounds=rounds,
                        warmup=warmup)
    return times, same


class PointwiseChain(nn.Module):
    """``ops`` cheap elementwise ATen ops on one small tensor (one scale parameter, so the
    region has something to differentiate): per-op overhead is all a step measures."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.ops = ops

    def forward(self, x):
        x = x * self.scale
        for j in range(self.ops - 1):
            x = torch.sin(x) if j % 2 == 0 else x + 0.1
        return x


def _fit(ks, ys):
    """Least-squares (a, b) of y = a + b * k."""
    n = len(ks)
    mk, my = sum(ks) / n, sum(ys) / n
    b = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    return my - b * mk, b


def run_fit(args) -> dict:
    """Part 3: a + b*k per region (see the module docstring)."""
    ks = args.fit_ops
    chains = {k: nn.ModuleList(PointwiseChain(k) for _ in range(args.fit_layers)) for k in ks}
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    recompute_all = {"*": CheckpointPolicy.PREFER_RECOMPUTE}
    makers = {
        "none": lambda blocks: (lambda block, h: block(h)),
        "torch full checkpoint": lambda blocks: _torch_region(),
        "ours full checkpoint": lambda blocks: _ours(blocks),
        "torch SAC": lambda blocks: _sac(torch_recompute_all),
        "ours declarative": lambda blocks: _ours(blocks, policy_fn=recompute_all),
        "ours callable": lambda blocks: _ours(blocks, policy_fn=ours_recompute_all),
    }
    own_base = {"torch SAC": "torch full checkpoint", "ours declarative": "ours full checkpoint",
                "ours callable": "ours full checkpoint"}
    steps, same = {}, {}
    for k, blocks in chains.items():
        def step_of(call, blocks=blocks):
            return _train_step(blocks, x, call)

        ref = None
        for n, make in makers.items():
            steps[f"{n}@{k}"] = step_of(make(blocks))
            got = steps[f"{n}@{k}"]()
            ref = got if ref is None else ref
            same[n] = same.get(n, True) and all(torch.equal(a, b) for a, b in zip(ref, got))
    times = interleaved(steps, rounds=args.rounds, warmup=args.warmup)

    def fit_of(n, base):
        ys = [(median(times[f"{n}@{k}"].cpu) - median(times[f"{base}@{k}"].cpu))
              / args.fit_layers * 1e6 for k in ks]
        return ys, _fit(ks, ys)

    fits, rows = {}, []
    for n in own_base:
        ys, (a0, b0) = fit_of(n, "none")
        _, (a1, b1) = fit_of(n, own_base[n])
        fits[n] = {"vs_none": (a0, b0), "vs_own_checkpoint": (a1, b1)}
        rows.append([n, *(f"{y:.0f}" for y in ys), f"{a0:.0f}", f"{b0:.2f}", f"{a1:.0f}",
                     f"{b1:.2f}", "yes" if same[n] else "NO"])
    t0, t1 = fits["torch SAC"]["vs_none"][1], fits["torch SAC"]["vs_own_checkpoint"][1]
    for row, n in zip(rows, own_base):
        row.insert(-1, f"{fits[n]['vs_none'][1] / t0:.3f}")
        row.insert(-1, f"{fits[n]['vs_own_checkpoint'][1] / t1:.3f}")
    print(table(["contender", *(f"k={k}: us/region vs none" for k in ks),
                 "a vs none (us)", "b vs none (us/op)", "a vs own full ckpt (us)",
                 "b vs own full ckpt (us/op)", "b/torch's (vs none)",
                 "b/torch's (vs own ckpt)", "grads == none"], rows,
                title=f"\n## Selective checkpoint overhead per region = a + b*k "
                      f"({args.fit_layers} regions of k ops, tensors {args.batch}x{args.dim}, "
                      f"cpu clock, {args.rounds} interleaved rounds, gc.collect() before "
                      "every step of every contender)"))
    for base in ("none", "torch full checkpoint", "ours full checkpoint"):
        ys = [median(times[f"{base}@{k}"].cpu) / args.fit_layers * 1e6 for k in ks]
        print(f"({base}: " + ", ".join(f"k={k} {y:.0f} us/region" for k, y in zip(ks, ys)) + ")")
    r_own = fits["ours declarative"]["vs_own_checkpoint"][1] / t1
    r_none = fits["ours declarative"]["vs_none"][1] / t0
    print(f"target: ours declarative per-op overhead <= 0.6x torch SAC's: {r_own:.3f}x "
          f"(selective machinery: minus each library's full checkpoint), {r_none:.3f}x "
          f"(all host overhead: minus no checkpoint) -> {verdict(max(r_own, r_none) <= 0.6)}")
    return {n: {base: {"a_us": a, "b_us": b} for base, (a, b) in f.items()}
            for n, f in fits.items()}


def run(args) -> dict:
    if args.fit_only:
        return {"fit": run_fit(args)}
    torch.manual_seed(0)
    blocks = nn.ModuleList(SmallOpsBlock(args.dim, args.stages, args.pointwise)
                           for _ in range(args.blocks))
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    ops = count_ops(blocks[0], x)
    total_ops = ops * args.blocks
    shape = (f"{args.blocks} regions x {ops} ATen ops ({args.stages} mm + "
             f"{args.stages * args.pointwise} pointwise), tensors {args.batch}x{args.dim}")

    # Part 1: save mm.
    callers = {
        "none": None,
        "torch full checkpoint": _torch_region(),
        "torch SAC (policy_fn)": _sac(torch_save_mm),
        "torch SAC (op list)": _sac(list(OPS_TO_SAVE)),
        "ours policy_fn": _ours(blocks, policy_fn=ours_save_mm),
        "ours declarative": _ours(blocks, policy_fn=list(OPS_TO_SAVE)),
    }
    times, same = _measure(blocks, x, callers, args.rounds, args.warmup)
    ref = times["torch SAC (policy_fn)"]
    rows = []
    for name, t in times.items():
        extra_us = (median(t.cpu) - median(ref.cpu)) / total_ops * 1e6
        rows.append([name, f"{median(t.cpu) / median(times['none'].cpu):.3f}",
                     fmt_ratio(t.cpu, ref.cpu), fmt_ratio(t.wall, ref.wall),
                     f"{extra_us:+.2f}", "yes" if same[name] else "NO"])
    print(table(["contender", "time/none (cpu)", "time/torch SAC (cpu) [IQR]",
                 "time/torch SAC (wall) [IQR]", "us/op vs torch SAC (cpu)", "grads == none"],
                rows, title=f"\n## Selective checkpoint, policy 'save mm': {shape}"))
    part1 = {}
    for name in ("ours policy_fn", "ours declarative"):
        r, lo, hi = paired_ratio(times[name].cpu, ref.cpu)
        part1[name] = r
        print(f"{name} / torch SAC (policy_fn) step time: cpu {r:.3f} (IQR {lo:.3f}-{hi:.3f})")

    # Part 2: per-op overhead, recompute-everything policies against full checkpoint.
    callers2 = {
        "torch full checkpoint": _torch_region(),
        "torch SAC (recompute all)": _sac(torch_recompute_all),
        "pass-through mode (floor)": _torch_region(_pass_through_contexts),
        "ours full checkpoint": _ours(blocks),
        "ours policy_fn (recompute all)": _ours(blocks, policy_fn=ours_recompute_all),
        "ours declarative (recompute all)": _ours(
            blocks, policy_fn={"*": CheckpointPolicy.PREFER_RECOMPUTE}),
    }
    times2, same2 = _measure(blocks, x, callers2, args.rounds, args.warmup)
    base_of = {"torch SAC (recompute all)": "torch full checkpoint",
               "pass-through mode (floor)": "torch full checkpoint",
               "ours policy_fn (recompute all)": "ours full checkpoint",
               "ours declarative (recompute all)": "ours full checkpoint"}
    per_op = {}
    rows = []
    for name, base in base_of.items():
        cpu = (median(times2[name].cpu) - median(times2[base].cpu)) / total_ops * 1e6
        wall = (median(times2[name].wall) - median(times2[base].wall)) / total_ops * 1e6
        per_op[name] = cpu
        rows.append([name, base, f"{cpu:.2f}", f"{wall:.2f}",
                     "yes" if same2[name] else "NO"])
    torch_op = per_op["torch SAC (recompute all)"]
    floor = per_op["pass-through mode (floor)"]
    for row, name in zip(rows, base_of):
        row.insert(4, f"{per_op[name] / torch_op:.3f}")
        above = (per_op[name] - floor) / (torch_op - floor) if torch_op > floor else float("nan")
        row.insert(5, f"{above:.3f}")
    print(table(["contender", "minus", "overhead us/op (cpu)", "overhead us/op (wall)",
                 "overhead/torch's", "(x-floor)/(torch-floor)", "grads == none"], rows,
                title=f"\n## Selective checkpoint per-op overhead (recompute-all policy): {shape}"))
    ours_fn = per_op["ours policy_fn (recompute all)"] / torch_op
    ours_decl = per_op["ours declarative (recompute all)"] / torch_op
    print(f"target: ours policy_fn per-op overhead <= torch's: {ours_fn:.3f}x "
          f"-> {verdict(ours_fn <= 1.0)}")
    print(f"target: ours declarative per-op overhead <= 0.6x torch's: "
          f"{ours_decl:.3f}x -> {verdict(ours_decl <= 0.6)}")
    print(f"(the pass-through mode's {floor:.2f} us/op is torch's Python-mode dispatch itself, "
          f"{floor / torch_op:.0%} of torch SAC's overhead: no policy or cache design below a "
          "Python TorchDispatchMode goes under it)")
    print(f"(torch SAC policy_fn step: {median(ref.cpu) * 1e3:.1f} ms cpu, for scale only; "
          f"{args.rounds} interleaved rounds)")
    return {"step_ratio": part1, "per_op_us": per_op, "floor_us": floor,
            "per_op_ratio": {"ours policy_fn": ours_fn, "ours declarative": ours_decl},
            "fit": run_fit(args)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--pointwise", type=int, default=12)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fit-ops", type=int, nargs="+", default=[2, 8, 32, 64],
                   help="ops per region of the a + b*k fit (part 3)")
    p.add_argument("--fit-layers", type=int, default=8, help="regions per step (part 3)")
    p.add_argument("--fit-only", action="store_true", help="run part 3 only")


def main(argv=None) -> None:
    bench_main(__doc__, add_args, run, argv)


if __name__ == "__main__":
    main()
