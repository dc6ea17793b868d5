"""python -m hyper_parallel.demo --device hpsim: a transformers Llama trained on the
simulated accelerator (tests/sim), device peak memory per strategy from its allocator."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from hyper_parallel.demo import main

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not os.environ.get("HP_TEST_DEVICE", "").startswith("hpsim"),
                       reason="needs the simulated device: HP_TEST_DEVICE=hpsim"),
]


def test_demo_reports_device_peak_per_strategy_on_hpsim():
    out = io.StringIO()
    records = main(["--layers", "4", "--hidden", "64", "--heads", "2", "--seq-len", "128",
                    "--batch", "4", "--steps", "2", "--device", "hpsim",
                    "--strategies", "none,checkpoint,swap"],
                   console=Console(file=out, width=160))
    recs = {r["strategy"]: r for r in records}
    assert "device peak" in out.getvalue()
    none, ckpt, swapped = recs["none"], recs["checkpoint"], recs["swap"]
    for r in recs.values():
        assert r["device_step_peak_bytes"] > 0, r["strategy"]
    # Released activations leave the simulated device's allocator: both strategies lower
    # the device peak, and swap's losses are bitwise those of "none".
    assert swapped["device_step_peak_bytes"] < none["device_step_peak_bytes"]
    assert ckpt["device_step_peak_bytes"] < none["device_step_peak_bytes"]
    assert swapped["losses"] == none["losses"]
    assert swapped["swap_stats"]["on_demand_reloads"] == 0
