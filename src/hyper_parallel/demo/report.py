"""Results of the demo: records, a rich table, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .train import StrategyResult

MIB = 1024 * 1024

#: What each number of the table means (printed under it).
LEGEND = """\
peak saved (step)  : peak bytes held by tensors autograd saved for backward, during forward
                     and backward of the whole model (embedding, decoder layers, final norm,
                     LM head, loss); library meter saved_activation_memory(). An offloaded
                     storage counts 0 while on the host and again once reloaded.
peak saved (layers): the same meter counting only what the decoder layers save (first
                     layer's forward to the end of backward): the part the strategies act on.
layers vs none     : peak saved (layers) / that of "none".
offloaded/step     : bytes copied to the host per training step (SwapManager().stats()).
step               : median wall time of one step (forward + backward + AdamW); x = vs none.
max |dloss|        : largest |loss - loss of "none"| over all steps (0 = bitwise equal).
device peak        : accelerator allocator peak during a step minus what was allocated
                     before it (weights, gradients, optimizer state); accelerators only."""


def build_records(results: list[StrategyResult], run_info: dict) -> list[dict]:
    """One JSON-ready record per strategy. Differences are against the "none" run (``None``
    when it was not run).

    Keys (bytes in bytes, times in seconds):

    * ``strategy``; ``description``.
    * ``peak_saved_bytes``: saved-activation peak of the whole model over forward and
      backward; ``layers_peak_saved_bytes``: the decoder layers' part alone;
      ``layers_peak_ratio_vs_none``: the latter over that of "none".
    * ``offload_bytes``: bytes offloaded per step (median); ``offload_bytes_per_step``.
    * ``step_seconds``: median step time; ``step_seconds_all``: every step;
      ``step_seconds_min``: the fastest (least disturbed by other processes).
    * ``losses``: the loss of every step; ``final_loss``; ``max_abs_loss_diff``: largest
      absolute difference from "none"'s loss at the same step; ``losses_bitwise_equal_none``;
      ``max_abs_param_diff``: largest absolute difference of the trained weights.
    * ``device_peak_bytes`` / ``device_step_peak_bytes``: the accelerator allocator's peak
      in a step, absolute / above what was allocated before it (``None`` on CPU).
    * ``swap_stats``: ``SwapManager().stats()`` counters accumulated over the run
      (``*_at_end``: left at the end, expected 0).
    * ``run``: the configuration and environment (same in every record).
    """
    base = next((r for r in results if r.strategy == "none"), None)
    records = []
    for r in results:
        rec = {
            "strategy": r.strategy,
            "peak_saved_bytes": r.peak_saved_bytes,
            "offload_bytes": r.offload_bytes,
            "step_seconds": r.step_seconds,
            "losses": r.losses,
            "max_abs_loss_diff": None,
            "final_loss": r.losses[-1] if r.losses else None,
            "description": r.description,
            "layers_peak_saved_bytes": r.layers_peak_saved_bytes,
            "layers_peak_ratio_vs_none": None,
            "losses_bitwise_equal_none": None,
            "max_abs_param_diff": None,
            "offload_bytes_per_step": r.offload_bytes_per_step,
            "step_seconds_all": r.step_seconds_all,
            "step_seconds_min": min(r.step_seconds_all) if r.step_seconds_all else None,
            "device_peak_bytes": r.device_peak_bytes,
            "device_step_peak_bytes": r.device_step_peak_bytes,
            "swap_stats": r.swap_stats,
            "run": run_info,
        }
        if base is not None:
            diffs = [abs(a - b) for a, b in zip(r.losses, base.losses)]
            rec["max_abs_loss_diff"] = max(diffs) if diffs else None
            rec["losses_bitwise_equal_none"] = r.losses == base.losses
            if r.layers_peak_saved_bytes is not None and base.layers_peak_saved_bytes:
                rec["layers_peak_ratio_vs_none"] = (r.layers_peak_saved_bytes
                                                    / base.layers_peak_saved_bytes)
            if r.final_state is not None and base.final_state is not None:
                rec["max_abs_param_diff"] = max(
                    (float((r.final_state[k].double() - v.double()).abs().max())
                     for k, v in base.final_state.items() if v.is_floating_point()),
                    default=0.0)
        records.append(rec)
    return records


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.2f} MiB"


def _diff(x) -> str:
    if x is None:
        return "-"
    return "0 (bitwise)" if x == 0 else f"{x:.2e}"


def render_table(records: list[dict], console: Console, title: str) -> None:
    """Prints the results table and its legend."""
    show_device = any(r["device_step_peak_bytes"] is not None for r in records)
    base_time = next((r["step_seconds"] for r in records if r["strategy"] == "none"), None)
    table = Table(title=title, header_style="bold")
    table.add_column("strategy", style="cyan", no_wrap=True)
    table.add_column("peak saved (step)", justify="right")
    table.add_column("peak saved (layers)", justify="right")
    table.add_column("layers vs none", justify="right")
    table.add_column("offloaded/step", justify="right")
    table.add_column("step", justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("max |dloss|", justify="right")
    if show_device:
        table.add_column("device peak", justify="right")
    for r in records:
        ratio = r["layers_peak_ratio_vs_none"]
        step = f"{r['step_seconds'] * 1e3:.0f} ms"
        if base_time and r["strategy"] != "none":
            step += f" (x{r['step_seconds'] / base_time:.2f})"
        row = [
            r["strategy"],
            _mib(r["peak_saved_bytes"]),
            _mib(r["layers_peak_saved_bytes"]),
            "-" if ratio is None else f"{ratio:.2f}",
            _mib(r["offload_bytes"]),
            step,
            "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}",
            _diff(r["max_abs_loss_diff"]),
        ]
        if show_device:
            row.append(_mib(r["device_step_peak_bytes"]))
        table.add_row(*row)
    console.print(table)
    console.print(LEGEND, style="dim", highlight=False, soft_wrap=True)


def write_json(records: list[dict], path: str | Path) -> None:
    """Writes the records as a JSON list (one object per strategy)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=2)
        f.write("\n")


def write_plot(records: list[dict], path: str | Path, title: str) -> None:
    """Writes :func:`build_figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = build_figure(records, title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_figure(records: list[dict], title: str):
    """A matplotlib figure with four panels: the saved-activation peaks per strategy (each
    bar labelled with its ratio to "none"), the bytes offloaded per step (traffic, on its
    own axis), the median step time, and the loss curves (each legend entry with its
    largest |loss - loss of none|)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in records]
    x = list(range(len(names)))
    base = next((r for r in records if r["strategy"] == "none"), None)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(title)

    ax = axes[0][0]
    width = 0.4
    for i, (label, key) in enumerate((("peak saved (step)", "peak_saved_bytes"),
                                      ("peak saved (layers)", "layers_peak_saved_bytes"))):
        vals = [(r[key] or 0) / MIB for r in records]
        bars = ax.bar([p + (i - 0.5) * width for p in x], vals, width, label=label)
        ref = (base[key] or 0) / MIB if base is not None else 0
        if ref:
            ax.bar_label(bars, labels=[f"{v / ref:.2f}x" for v in vals], fontsize=7,
                         padding=1)
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("MiB")
    ax.set_title("saved-activation memory (labels: ratio to none)")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    bars = ax.bar(x, [(r["offload_bytes"] or 0) / MIB for r in records], color="tab:purple")
    ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("MiB per step")
    ax.set_title("offloaded to host per step (D2H traffic)")

    ax = axes[1][0]
    ax.bar(x, [r["step_seconds"] * 1e3 for r in records], color="tab:gray")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("ms")
    ax.set_title("median step time")

    ax = axes[1][1]
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(records):
        label = r["strategy"]
        if base is not None and r is not base:
            diff = r.get("max_abs_loss_diff")
            if diff is None:
                diffs = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
                diff = max(diffs) if diffs else None
            if diff is not None:
                label += f"  (max |dloss| {_diff(diff)})"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], styles[i % len(styles)],
                marker="o", markersize=3, label=label, alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss (same weights, same batches; |dloss| vs none)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
