"""The main job: ``python -m hyper_parallel.demo``.

Trains transformers' LlamaForCausalLM (random init, small config) on byte tokens of the
Python standard library's sources once per activation strategy (none, checkpoint,
selective, swap, mixed, selective_swap) and reports saved-activation memory, bytes
offloaded, step time and the largest loss difference from "none"; optionally as JSON
(``--json``) and a PNG plot (``--plot``). See ``python -m hyper_parallel.demo --help``.
"""

from .cli import main
from .strategies import STRATEGIES

__all__ = ["STRATEGIES", "main"]
