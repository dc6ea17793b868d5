"""One training run per strategy, and what is measured during it.

Every run starts from the same initial weights, sees the same batches in the same order,
uses AdamW with the same hyperparameters and the same seed, so the loss curves of
strategies that do not change the arithmetic (swap) must be bitwise equal to "none".

Saved-activation memory is measured with the library's
:func:`~hyper_parallel.core.activation_checkpoint.saved_activation_memory`, which observes
every tensor autograd saves (in any device's memory; on CPU too) and reports the peak of
the bytes their storages hold (an offloaded storage holds 0 while it is on the host; a
reloaded one counts again). Only one such meter can be active at a time, so the steps
alternate between two scopes; every step has the same shapes, so each scope's peak is
the same on every step it is measured:

* even steps, ``peak_saved_bytes``: forward and backward of the whole model (embedding,
  decoder layers, final norm, LM head, loss);
* odd steps, ``layers_peak_saved_bytes``: the tensors saved by the decoder layers only,
  from the first layer's forward to the end of backward (the part the strategies act on).

Recomputation in a checkpointed layer's backward re-creates that layer's activations
transiently; they are not saved tensors of the step and the meter does not count them
(the SPEC's definition); on an accelerator, the allocator's peak shows them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import SwapManager, saved_activation_memory

from .model import fresh_model
from .strategies import apply_strategy

#: Counters of ``SwapManager().stats()`` that grow during a run; the run reports their
#: increase (per run, not per step).
_CUMULATIVE_STATS = ("offload_bytes", "offload_count", "reload_bytes", "reload_count",
                     "fused_copies", "stall_seconds", "on_demand_reloads")


@dataclass
class StrategyResult:
    """What one strategy's run measured. Bytes are bytes, times are seconds."""

    strategy: str
    description: str
    losses: list[float]
    step_seconds_all: list[float]
    peak_saved_bytes: int | None
    layers_peak_saved_bytes: int | None
    offload_bytes_per_step: list[int]
    swap_stats: dict
    device_peak_bytes: int | None = None
    device_step_peak_bytes: int | None = None
    final_state: dict | None = field(default=None, repr=False)

    @property
    def step_seconds(self) -> float:
        """Median wall time of one training step (forward, backward, optimizer)."""
        return float(statistics.median(self.step_seconds_all))

    @property
    def offload_bytes(self) -> int:
        """Bytes offloaded to the host per training step (median over steps)."""
        return int(statistics.median(self.offload_bytes_per_step))


class _StackMeter:
    """Runs :func:`saved_activation_memory` over the decoder stack only, for a whole step.

    The meter opens in a forward pre-hook of the first decoder layer (so the embedding's
    saves are not observed). A forward hook of the last layer then pushes pass-through
    ``saved_tensors_hooks`` until the model's forward returns: tensors the tail (final
    norm, LM head, loss) saves go through those innermost hooks, not the meter's. The
    meter stays open through backward, where the engine samples it at every layer's
    backward start (after that layer's prefetch was launched), and closes after it.

    Hooks on the (possibly wrapped) layers fire once per forward call; a checkpointed
    layer's recompute in backward calls the inner module and does not fire them.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.enabled = False
        self.peak_bytes: int | None = None
        self._meter_ctx = None
        self._meter = None
        self._tail_ctx = None
        self._handles = [
            layers[0].register_forward_pre_hook(self._open),
            layers[-1].register_forward_hook(self._hide_tail),
        ]

    def _open(self, module, args):
        if self.enabled and self._meter_ctx is None:
            self._meter_ctx = saved_activation_memory()
            self._meter = self._meter_ctx.__enter__()

    def _hide_tail(self, module, args, output):
        if self._meter_ctx is not None and self._tail_ctx is None:
            self._tail_ctx = torch.autograd.graph.saved_tensors_hooks(_detached, _same)
            self._tail_ctx.__enter__()

    def after_forward(self) -> None:
        """Call when the model's forward has returned."""
        if self._tail_ctx is not None:
            ctx, self._tail_ctx = self._tail_ctx, None
            ctx.__exit__(None, None, None)

    def after_backward(self) -> None:
        """Call when backward has finished: closes the meter and keeps its peak."""
        self.after_forward()
        if self._meter_ctx is not None:
            ctx, self._meter_ctx = self._meter_ctx, None
            ctx.__exit__(None, None, None)
            peak = self._meter.peak_bytes
            self.peak_bytes = peak if self.peak_bytes is None else max(self.peak_bytes, peak)

    def remove(self) -> None:
        """Closes anything left open (after an exception) and removes the hooks."""
        if self._tail_ctx is not None:
            ctx, self._tail_ctx = self._tail_ctx, None
            ctx.__exit__(None, None, None)
        if self._meter_ctx is not None:
            ctx, self._meter_ctx = self._meter_ctx, None
            ctx.__exit__(None, None, None)
        for h in self._handles:
            h.remove()


def _same(x):
    return x


def _detached(x):
    # (a saved output that kept its grad_fn would close a cycle no collector breaks)
    return x.detach()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def train_strategy(
    name: str,
    *,
    config,
    state: dict[str, torch.Tensor],
    batches: list[torch.Tensor],
    device: torch.device,
    seed: int,
    lr: float = 1e-3,
    on_step: Callable[[int, float], None] | None = None,
    keep_final_state: bool = False,
    plan=None,
) -> StrategyResult:
    """Trains a fresh model under strategy ``name`` for ``len(batches)`` steps.

    Args:
        name: one of :data:`~hyper_parallel.demo.strategies.STRATEGIES`.
        config: the LlamaConfig.
        state: the initial state dict (the same for every strategy).
        batches: token batches, each ``(batch, seq_len)``; labels are the inputs (the
            model shifts them by one position).
        device: where to train.
        seed: torch's seed before the first step.
        lr: AdamW learning rate.
        on_step: called after each step with (step index, loss).
        keep_final_state: return the trained weights (on CPU) for comparisons.
        plan: the planner's plan, for ``name == "auto"``.

    Returns:
        The measurements.
    """
    manager = SwapManager()
    manager.reset()
    model = fresh_model(config, state, device)
    strategy, report = apply_strategy(model, name, plan)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stack_meter = _StackMeter([model.get_submodule(e.name) for e in report.layers])

    losses: list[float] = []
    times: list[float] = []
    offloads: list[int] = []
    peak_total: int | None = None
    dev_peak: int | None = None
    dev_step_peak: int | None = None
    stats_before = manager.stats()
    try:
        for step, tokens in enumerate(batches):
            tokens = tokens.to(device)
            measure_total = step % 2 == 0
            stack_meter.enabled = not measure_total
            offload_before = manager.stats()["offload_bytes"]
            if device.type != "cpu":
                torch.accelerator.reset_peak_memory_stats(device)
                base = torch.accelerator.memory_allocated(device)
            _synchronize(device)
            start = time.perf_counter()
            if measure_total:
                with saved_activation_memory() as meter:
                    out = model(input_ids=tokens, labels=tokens)
                    out.loss.backward()
                peak_total = max(peak_total or 0, meter.peak_bytes)
            else:
                out = model(input_ids=tokens, labels=tokens)
                stack_meter.after_forward()
                out.loss.backward()
                stack_meter.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _synchronize(device)
            times.append(time.perf_counter() - start)
            loss = out.loss.item()
            del out
            losses.append(loss)
            offloads.append(int(manager.stats()["offload_bytes"] - offload_before))
            if device.type != "cpu":
                peak = int(torch.accelerator.max_memory_allocated(device))
                dev_peak = max(dev_peak or 0, peak)
                dev_step_peak = max(dev_step_peak or 0, peak - int(base))
            if on_step is not None:
                on_step(step, loss)
    finally:
        stack_meter.remove()
        stats_after = manager.stats()
        manager.unregister(model)
        manager.reset()

    swap_stats = {k: stats_after[k] - stats_before[k] for k in _CUMULATIVE_STATS
                  if k in stats_after}
    # Left at the end of the run (should be 0 once every backward has run).
    for k in ("resident_bytes", "pinned_bytes_in_use", "live_records"):
        if k in stats_after:
            swap_stats[f"{k}_at_end"] = stats_after[k]
    for k in ("peak_resident_bytes", "pinned_bytes_cached"):
        if k in stats_after:
            swap_stats[k] = stats_after[k]
    final_state = None
    if keep_final_state:
        final_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return StrategyResult(
        strategy=name,
        description=strategy.description,
        losses=losses,
        step_seconds_all=times,
        peak_saved_bytes=peak_total,
        layers_peak_saved_bytes=stack_meter.peak_bytes,
        offload_bytes_per_step=offloads,
        swap_stats=swap_stats,
        device_peak_bytes=dev_peak,
        device_step_peak_bytes=dev_step_peak,
        final_state=final_state,
    )
