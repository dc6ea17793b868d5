"""Command line of ``python -m hyper_parallel.demo``.

Parsing the arguments imports nothing heavy: torch, transformers, rich and the compiled
extension are imported once the arguments are known good, so ``--help`` and argument
errors come back at once (and work before anything is built).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

from .strategies import AUTO, DEFAULT_STRATEGIES, STRATEGIES, parse_strategies

DEFAULTS = dict(layers=8, hidden=128, heads=4, seq_len=128, batch=4, steps=12, seed=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyper_parallel.demo",
        description=(
            "Trains a small, randomly initialised Llama (transformers' LlamaForCausalLM) on "
            "byte tokens of the Python standard library's sources, once per activation "
            "strategy, from the same weights on the same batches, and reports saved-activation "
            "memory, bytes offloaded, step time and loss differences from 'none'."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="decoder layers")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="hidden size")
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="attention heads")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per step")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help="training steps per strategy (>= 2: even steps measure the whole "
                        "model, odd steps the decoder layers)")
    p.add_argument("--device", default="auto",
                   help="'auto' (the accelerator if there is one, else cpu), 'cpu', 'cuda', "
                        "'cuda:1', 'npu', ...; 'hpsim': the simulated accelerator of the "
                        "test suite (a source checkout built with scripts/setup.sh)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated list of: " + ", ".join(STRATEGIES) + ", " + AUTO +
                        " (the planner's per-layer plan under --budget)")
    p.add_argument("--budget", default=None,
                   help="only with 'auto' in --strategies: the peak of saved activations "
                        "allowed, a fraction of none's measured peak (default 0.4) or bytes "
                        "with a unit (300MiB)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                   help="seed of the initial weights, the batches and training")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="eager",
                   help="attention implementation of transformers")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads; default on cpu: the available cores minus "
                        "one (kept free for the swap engine's copy thread), at most 8; "
                        "on an accelerator: torch's choice")
    p.add_argument("--json", metavar="PATH", help="write one JSON record per strategy here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot here")
    p.add_argument("--trace", metavar="PATH",
                   help="write the swap timeline of the strategies that swap here (Chrome "
                        "trace JSON: open it in https://ui.perfetto.dev)")
    return p


def resolve_device(text: str):
    """``auto`` means the current accelerator when torch sees one, else the CPU."""
    import torch

    if text == "auto":
        if torch.accelerator.is_available():
            return torch.accelerator.current_accelerator()
        return torch.device("cpu")
    if text.split(":")[0] == "hpsim":
        return _load_simulated_device(text)
    return torch.device(text)


def _load_simulated_device(text: str):
    """The test-only simulated accelerator (tests/sim/hpsim.py), loaded from the source
    checkout this package runs from; it is not part of an installed package."""
    import importlib.util
    import pathlib

    import torch

    loader = pathlib.Path(__file__).resolve().parents[3] / "tests" / "sim" / "hpsim.py"
    if not loader.is_file():
        raise SystemExit(
            "hyper_parallel: --device hpsim needs a source checkout (tests/sim/hpsim.py) "
            "built with `bash scripts/setup.sh`; it is not part of an installed package.")
    spec = importlib.util.spec_from_file_location("hyper_parallel_hpsim", loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load()
    return torch.device(text)


def default_cpu_threads() -> int:
    """Intra-op threads for a CPU run: the cores this process may use minus one, which
    stays free for the swap engine's copy thread, at most 8 (the demo's matrices are
    small). With OpenMP's busy-waiting, more compute threads than free cores make every
    op wait for a descheduled thread: steps then take 10x longer and vary wildly."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores - 1))


def _validate(args: argparse.Namespace) -> None:
    for name in ("layers", "hidden", "heads", "seq_len", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"hyper_parallel: --{name.replace('_', '-')} must be >= 1")
    if args.steps < 2:
        raise SystemExit("hyper_parallel: --steps must be >= 2 (even steps measure the whole "
                         "model, odd steps the decoder layers)")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("hyper_parallel: --threads must be >= 1")


def main(argv: list[str] | None = None, console=None) -> list[dict]:
    """Runs the demo; returns the JSON records (also written with ``--json``).
    ``console``: a ``rich.console.Console`` to print to (default: stdout)."""
    args = build_parser().parse_args(argv)
    _validate(args)
    try:
        names = parse_strategies(args.strategies)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.budget is not None and AUTO not in names:
        raise SystemExit(f"hyper_parallel: --budget {args.budget} only applies to the "
                         f"'{AUTO}' strategy, which --strategies does not list; add {AUTO} to "
                         "--strategies or drop --budget")
    if args.budget is None:
        args.budget = DEFAULT_BUDGET
    if AUTO in names:  # checked before anything is built or profiled
        from hyper_parallel.core.activation_checkpoint import parse_budget

        try:
            parse_budget(args.budget, none_peak_bytes=1)
        except ValueError as err:
            raise SystemExit(f"{err} (--budget)") from None
    # torch and transformers take seconds to import: only once the arguments are good.
    import torch
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from hyper_parallel.core.activation_checkpoint import (ActivationTrace, SwapManager,
                                                           activation_trace)

    from .data import load_corpus, make_batches, stdlib_dir
    from .model import build_config, initial_state
    from .report import build_records, render_table, write_json, write_plot
    from .train import train_strategy

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: rich would assume 80 columns
            console = Console(width=140)
    device = resolve_device(args.device)
    wall_start = time.perf_counter()

    # Process-wide settings, changed for this run only (main() may run inside a test).
    manager = SwapManager()
    cpu_swap_before = manager.cpu_swap_enabled()
    threads_before = torch.get_num_threads()
    try:
        threads = args.threads
        if threads is None and device.type == "cpu":
            threads = default_cpu_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        if device.type == "cpu":
            manager.set_cpu_swap(True)
            console.print(
                "[bold]CPU run:[/bold] turned on the CPU swap backend "
                "(SwapManager().set_cpu_swap(True)). Activations live in host memory here, "
                "so 'swap' copies them into the engine's host buffers on a worker thread and "
                "frees the originals: the schedule, the frees and the reloads run for real, "
                "and the memory numbers below show what an accelerator would keep on device.")
        config = build_config(layers=args.layers, hidden=args.hidden, heads=args.heads,
                              seq_len=args.seq_len, attn=args.attn)
        state = initial_state(config, seed=args.seed)
        tokens = load_corpus()
        batches = make_batches(tokens, batch=args.batch, seq_len=args.seq_len,
                               steps=args.steps, seed=args.seed)
        run_info = {
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "intermediate": config.intermediate_size, "seq_len": args.seq_len,
            "batch": args.batch, "steps": args.steps, "seed": args.seed, "lr": args.lr,
            "attn": args.attn, "device": str(device), "cpu_swap": device.type == "cpu",
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "parameters": parameter_count_from_state(state),
            "corpus": str(stdlib_dir()), "corpus_tokens": int(tokens.numel()),
            "python": platform.python_version(),
        }
        console.print(
            f"LlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
            f"MLP {config.intermediate_size}, {run_info['parameters'] / 1e6:.2f} M parameters; "
            f"{args.batch} x {args.seq_len} byte tokens per step from "
            f"{tokens.numel() / 1e6:.2f} MB of {stdlib_dir()}/*.py; {args.steps} steps per "
            f"strategy on {device} ({_plural(torch.get_num_threads(), 'torch thread')}).")

        plan = None
        if AUTO in names:
            plan = _plan_auto(args.budget, config, state, batches[0], device, console)
        results = []
        timeline = ActivationTrace()
        with Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            for name in names:
                task = progress.add_task(name, total=args.steps, info="")

                def on_step(step, loss, task=task):
                    progress.update(task, advance=1, info=f"loss {loss:.4f}")

                with (activation_trace() if args.trace else contextlib.nullcontext()) as trace:
                    results.append(train_strategy(
                        name, config=config, state=state, batches=batches, device=device,
                        seed=args.seed, lr=args.lr, on_step=on_step, keep_final_state=True,
                        plan=plan))
                for item in trace.items if args.trace else ():
                    item["label"] = f"{name}: {item['label']}"
                    timeline.items.append(item)
    finally:
        manager.set_cpu_swap(cpu_swap_before)
        torch.set_num_threads(threads_before)

    run_info["wall_seconds"] = time.perf_counter() - wall_start
    records = build_records(results, run_info)
    title = (f"hyper_parallel demo: Llama {args.layers}x{args.hidden}, batch {args.batch} x "
             f"{args.seq_len}, {args.steps} steps, {device}")
    render_table(records, console, title)
    if args.json:
        write_json(records, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        write_plot(records, args.plot, title)
        console.print(f"wrote {args.plot}")
    if args.trace:
        timeline.write(args.trace)
        console.print(f"wrote {args.trace} (swap timeline: open it in https://ui.perfetto.dev)")
    console.print(f"total wall time {run_info['wall_seconds']:.1f} s (after imports)")
    return records


#: --budget when 'auto' runs without one: 40 % of none's measured peak.
DEFAULT_BUDGET = "0.4"


def _plan_auto(budget: str, config, state, tokens, device, console):
    """Runs the planner on a fresh model over the first batch; prints its plan."""
    from hyper_parallel.core.activation_checkpoint import (InfeasibleBudgetError,
                                                           plan_activation_memory)

    from .model import fresh_model

    model = fresh_model(config, state, device)
    tokens = tokens.to(device)
    console.print(f"[bold]auto:[/bold] profiling for the planner (budget {budget}): one "
                  "warm-up step of none, then three steps per candidate strategy in "
                  "interleaved rounds, each also run once without instrumentation")
    try:
        plan = plan_activation_memory(
            model, lambda: model(input_ids=tokens, labels=tokens).loss.backward(), budget)
    except InfeasibleBudgetError as err:
        raise SystemExit(str(err)) from None
    except ValueError as err:
        raise SystemExit(str(err)) from None
    console.print(plan.explain(), markup=False, highlight=False)
    return plan


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def parameter_count_from_state(state: dict) -> int:
    """Number of parameters in a state dict (all floating tensors)."""
    return sum(v.numel() for v in state.values() if v.is_floating_point())
