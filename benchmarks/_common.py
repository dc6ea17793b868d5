"""Shared pieces of the benchmarks: robust interleaved timing, ratios, machine facts, tables.

Timing protocol (every benchmark): each contender is a zero-argument callable that runs
one complete step (forward + backward). All contenders are warmed up, then timed in
rounds; in each round every contender runs once, in an order rotated by one position per
round (A B C, B C A, C A B, ...), so slow drift of the machine (other jobs, frequency)
hits all contenders alike. A contender's time is the median over rounds. A ratio X/Y is
reported both as the ratio of medians and as the median of the per-round ratios with its
interquartile range (the paired view cancels drift that is slower than one round).
The garbage collector is collected before and disabled during each timed call.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (a second benchmark in the same process)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_facts(device: str = "cpu") -> dict:
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "load average (1/5/15 min)": load_average(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["device"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        facts["cuda"] = str(torch.version.cuda)
    return facts


def print_facts(facts: dict) -> None:
    for k, v in facts.items():
        print(f"  {k}: {v}")


def _timed(fn: Callable[[], object], sync: Callable[[], None] | None) -> tuple[float, float]:
    gc.collect()
    gc.disable()
    try:
        if sync is not None:
            sync()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        gc.enable()


class Times:
    """Per-round times of one contender: ``wall`` (perf_counter) and ``cpu`` (CPU time of
    the whole process, all threads: immune to time stolen by other processes on a shared
    machine, but it also counts work that background threads overlap with the step)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def get(self, clock: str) -> list[float]:
        return self.cpu if clock == "cpu" else self.wall


def interleaved(contenders: dict[str, Callable[[], object]], *, rounds: int, warmup: int = 2,
                sync: Callable[[], None] | None = None) -> dict[str, Times]:
    """Times each contender ``rounds`` times, interleaved and rotated (see module doc)."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    if sync is not None:
        sync()
    out = {name: Times() for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, cpu = _timed(contenders[name], sync)
            out[name].wall.append(wall)
            out[name].cpu.append(cpu)
    return out


def median(xs) -> float:
    return statistics.median(xs)


def quartiles(xs) -> tuple[float, float]:
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median, p25, p75) of the per-round ratios a[i] / b[i]."""
    rs = [x / y for x, y in zip(a, b)]
    lo, hi = quartiles(rs)
    return median(rs), lo, hi


def fmt_ratio(a: list[float], b: list[float]) -> str:
    m, lo, hi = paired_ratio(a, b)
    return f"{m:.3f} [{lo:.3f}-{hi:.3f}]"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A GitHub-markdown table (readable in a terminal, pasteable into docs)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def bench_main(doc: str, add_args: Callable, run: Callable, argv=None) -> None:
    """The command line every benchmark shares: its own arguments plus --threads and
    --quick (7 rounds), the machine facts, then ``run(args)``."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_args(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 7
    set_threads(args.threads)
    print_facts(machine_facts())
    run(args)


def add_llama_args(p, layers_flag: str = "--layers", rounds: int = 15) -> None:
    """Shape of the Llama-style stack shared by the checkpoint and swap benchmarks."""
    p.add_argument(layers_flag, type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=3)
