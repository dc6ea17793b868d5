"""The main job (python -m hyper_parallel.demo), run in-process on tiny configurations.

Checks real values, not just that it runs: swap's loss curve is bitwise that of "none",
recompute stays within 1e-5, swap actually lowers the saved-activation peak, the JSON
has the SPEC 7 keys, and the plot is a PNG.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hyper_parallel.core.activation_checkpoint import STRATEGIES as LIBRARY_STRATEGIES
from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.demo import STRATEGIES, main
from hyper_parallel.demo.data import load_corpus, make_batches

NAMES = list(STRATEGIES)
ALL = ",".join(NAMES)
SWAP_LIKE = ("swap", "mixed", "selective_swap")
RECOMPUTE = ("checkpoint", "selective", "mixed", "selective_swap")
SPEC_KEYS = {"strategy", "peak_saved_bytes", "offload_bytes", "step_seconds", "losses",
             "max_abs_loss_diff"}


def _run(args: list[str]) -> tuple[list[dict], str]:
    out = io.StringIO()
    records = main(args, console=Console(file=out, width=140))
    return records, out.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two decoder layers, four steps, every strategy; JSON and plot written."""
    d = tmp_path_factory.mktemp("demo")
    args = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32",
            "--batch", "2", "--steps", "4", "--device", "cpu", "--strategies", ALL,
            "--json", str(d / "r.json"), "--plot", str(d / "r.png")]
    records, text = _run(args)
    return {"records": {r["strategy"]: r for r in records}, "text": text,
            "json": d / "r.json", "plot": d / "r.png"}


def test_every_strategy_trains(tiny):
    recs = tiny["records"]
    assert list(recs) == NAMES
    for r in recs.values():
        assert len(r["losses"]) == 4
        assert all(0 < x < 10 for x in r["losses"]), r
        assert r["step_seconds"] > 0


def test_swap_losses_bitwise_equal_none(tiny):
    recs = tiny["records"]
    assert recs["swap"]["losses"] == recs["none"]["losses"]
    assert recs["swap"]["max_abs_loss_diff"] == 0.0
    assert recs["swap"]["losses_bitwise_equal_none"] is True
    assert recs["swap"]["max_abs_param_diff"] == 0.0


def test_recompute_strategies_within_1e5(tiny):
    for name in RECOMPUTE:
        assert tiny["records"][name]["max_abs_loss_diff"] <= 1e-5, name


def test_swap_lowers_peak_and_offloads(tiny):
    recs = tiny["records"]
    none = recs["none"]
    assert none["offload_bytes"] == 0 and recs["checkpoint"]["offload_bytes"] == 0
    for name in ("swap", "mixed"):
        assert recs[name]["peak_saved_bytes"] < none["peak_saved_bytes"], name
        # With two layers, swap's decoder-layer peak is reached at the start of layer 1's
        # backward, with layer 0 prefetched: both layers, as without swap. mixed's layer 0
        # is checkpointed, so it saves less.
        assert recs[name]["layers_peak_saved_bytes"] <= none["layers_peak_saved_bytes"], name
    assert recs["mixed"]["layers_peak_saved_bytes"] < none["layers_peak_saved_bytes"]
    # The last layer's activations stay on device (they are needed first in backward), so
    # with two layers "mixed" (layer 0 checkpointed, layer 1 swapped) offloads nothing.
    assert recs["mixed"]["offload_bytes"] == 0
    for name in SWAP_LIKE:
        stats = recs[name]["swap_stats"]
        assert name == "mixed" or recs[name]["offload_bytes"] > 0, name
        # Everything offloaded came back, and nothing is left held after the run.
        assert stats["reload_bytes"] == stats["offload_bytes"], stats
        assert stats["pinned_bytes_in_use_at_end"] == 0, stats
        assert stats["live_records_at_end"] == 0, stats
    assert recs["checkpoint"]["layers_peak_saved_bytes"] < none["layers_peak_saved_bytes"]


def test_json_has_spec_keys(tiny):
    data = json.loads(Path(tiny["json"]).read_text())
    assert isinstance(data, list) and [r["strategy"] for r in data] == NAMES
    for rec in data:
        assert SPEC_KEYS <= rec.keys()
        assert isinstance(rec["peak_saved_bytes"], int)
        assert isinstance(rec["losses"], list) and len(rec["losses"]) == 4
        assert rec["final_loss"] == rec["losses"][-1]
    assert data[0]["max_abs_loss_diff"] == 0.0


def test_plot_is_png(tiny):
    head = Path(tiny["plot"]).read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    assert Path(tiny["plot"]).stat().st_size > 10_000


def test_output_says_cpu_swap_and_restores_it(tiny):
    text = tiny["text"]
    assert "set_cpu_swap(True)" in text
    for name in NAMES:
        assert name in text
    assert "0 (bitwise)" in text
    # The demo turns the CPU backend on only for its own run.
    assert SwapManager().cpu_swap_enabled() is False


def test_checkpoint_swap_mixed_keep_at_most_half():
    """The acceptance criterion in miniature: full checkpoint, swap and mixed keep at most
    half of the decoder layers' saved-activation peak of "none" (swap holds two layers
    at the start of a layer's backward: the layer and the one prefetched, so it needs
    more than four layers to get there; six here)."""
    records, _ = _run(["--layers", "6", "--hidden", "32", "--heads", "2", "--seq-len", "32",
                       "--batch", "2", "--steps", "2", "--device", "cpu",
                       "--strategies", "none,checkpoint,swap,mixed"])
    recs = {r["strategy"]: r for r in records}
    for name in ("checkpoint", "swap", "mixed"):
        ratio = recs[name]["layers_peak_ratio_vs_none"]
        assert ratio is not None and ratio <= 0.5, (name, ratio)
        assert recs[name]["peak_saved_bytes"] < recs["none"]["peak_saved_bytes"]
    assert recs["swap"]["offload_bytes"] > recs["mixed"]["offload_bytes"] > 0
    assert recs["swap"]["losses"] == recs["none"]["losses"]
    assert recs["mixed"]["max_abs_loss_diff"] <= 1e-5


def test_batches_are_stdlib_bytes_and_deterministic():
    tokens = load_corpus(max_bytes=64 * 1024)
    assert tokens.min() >= 0 and tokens.max() < 256
    text = bytes(tokens[:4096].tolist()).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text
    a = make_batches(tokens, batch=2, seq_len=16, steps=3, seed=1)
    b = make_batches(tokens, batch=2, seq_len=16, steps=3, seed=1)
    assert all((x == y).all() for x, y in zip(a, b)) and a[0].shape == (2, 16)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="hyper_parallel: unknown strategy"):
        main(["--strategies", "none,bogus"], console=Console(file=io.StringIO()))
    with pytest.raises(SystemExit, match="hyper_parallel: --steps"):
        main(["--steps", "1"], console=Console(file=io.StringIO()))
    out = io.StringIO()
    with pytest.raises(SystemExit, match="hyper_parallel: budget 'lots'.*--budget"):
        main(["--strategies", "auto", "--budget", "lots"], console=Console(file=out))
    assert "profil" not in out.getvalue()  # refused before anything ran
    # --budget without auto would be ignored: refused, before anything ran.
    out = io.StringIO()
    with pytest.raises(SystemExit, match="hyper_parallel: --budget 0.3 only applies to the "
                                         "'auto' strategy.*add auto to --strategies"):
        main(["--strategies", "none,swap", "--budget", "0.3"], console=Console(file=out))
    assert out.getvalue() == ""
    # A string budget with a fraction of a byte is refused like the number (not 1 byte).
    with pytest.raises(SystemExit, match="hyper_parallel: budget '1.5'.*whole number of "
                                         "bytes.*--budget"):
        main(["--strategies", "auto", "--budget", "1.5"], console=Console(file=out))


def test_module_entry_point_help():
    root = Path(__file__).resolve().parents[3]
    res = subprocess.run([sys.executable, "-m", "hyper_parallel.demo", "--help"],
                         capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root / "src")},
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for flag in ("--layers", "--hidden", "--heads", "--seq-len", "--batch", "--steps",
                 "--device", "--strategies", "--seed", "--json", "--plot"):
        assert flag in res.stdout


def test_demo_strategies_are_the_library_ones():
    assert tuple(STRATEGIES) == tuple(LIBRARY_STRATEGIES)


def test_plot_panels_label_ratios_traffic_and_dloss(tiny):
    import matplotlib.pyplot as plt

    from hyper_parallel.demo.report import build_figure

    records = list(tiny["records"].values())
    fig = build_figure(records, "t")
    try:
        memory, traffic, _, loss = fig.axes
        ratios = [t.get_text() for t in memory.texts]
        assert "1.00x" in ratios and any(r != "1.00x" for r in ratios)  # none, and others
        assert "offloaded" in traffic.get_title() and memory.get_legend() is not None
        assert all("offload" not in t.get_text() for t in memory.get_legend().get_texts())
        legend = [t.get_text() for t in loss.get_legend().get_texts()]
        assert legend[0] == "none" and all("max |dloss|" in t for t in legend[1:])
    finally:
        plt.close(fig)


def test_help_imports_nothing_heavy_and_needs_no_build(tmp_path):
    """--help answers before torch, transformers or the extension are imported, and
    scripts/demo.sh --help does not run the setup (no build before argument parsing)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    probe = ("import sys\nfrom hyper_parallel.demo.cli import main\ntry:\n    main(['--help'])\n"
             "except SystemExit:\n    pass\nheavy = [m for m in ('torch', 'transformers', 'rich', "
             "'hyper_parallel._C') if m in sys.modules]\nprint('HEAVY', heavy)\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=root, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout and "--strategies" in res.stdout
    # demo.sh must not reach setup.sh: point the build at a directory that cannot exist.
    res = subprocess.run(["bash", str(root / "scripts" / "demo.sh"), "--help"],
                         capture_output=True, text=True, timeout=60,
                         env={**env, "HP_BUILD_DIR": str(tmp_path / "no" / "build"),
                              "PYTHON": sys.executable})
    assert res.returncode == 0, res.stderr
    assert "--layers" in res.stdout and "[setup]" not in res.stderr
    assert not (tmp_path / "no").exists()


def test_auto_strategy_prints_plan_and_meets_budget():
    args = ["--layers", "3", "--hidden", "32", "--heads", "2", "--seq-len", "32",
            "--batch", "2", "--steps", "2", "--device", "cpu", "--strategies", "none,auto",
            "--budget", "0.5"]
    records, text = _run(args)
    recs = {r["strategy"]: r for r in records}
    assert "predicted peak" in text and "model.layers.2" in text
    # The profiling line says what profiling does (three interleaved steps per candidate).
    assert "three steps per candidate strategy in interleaved rounds" in text
    assert "one step per candidate" not in text
    assert recs["auto"]["peak_saved_bytes"] <= 0.5 * recs["none"]["peak_saved_bytes"]
    with pytest.raises(SystemExit, match="hyper_parallel: no plan"):
        _run(args[:-1] + ["1KiB"])
