"""Profiling a training step for the planner (docs/design.md, "Planner").

``repeats`` (default 3) measured steps per candidate strategy, applied to every layer at
once (plus one warm-up step), in interleaved rounds (one step of every candidate per
round), on the device the model is on; times are the median over the repeats (a timed
run reports typical steps, and the least of a few would predict every plan faster than
it runs). Per layer and strategy it records what the
cost model of ``csrc/hyper_parallel/planner/CostModel.h`` needs:

* ``kept_bytes``: how much the library's meter (:func:`saved_activation_memory`) grew
  over the layer's forward, release point included (bytes that stay on the device until
  the layer's backward);
* ``offload_bytes``: bytes the engine queued for the host at the layer's release point
  (``SwapManager().stats()["offload_bytes"]`` over the forward);
* ``deferred_bytes``: bytes of the layer's saved tensors that its release point could not
  offload because the caller still held them (a decoder loop holds the layer's input
  until the layer returns) and that a later release point offloaded; they are reloaded
  with this layer. The engine's timeline (``activation_trace``) attributes each offload
  to its layer: a copy of layer k queued after layer k+1's forward began is deferred.
  ``kept_bytes`` and ``offload_bytes`` are then this layer's own (the counters over the
  layer's forward would count the previous layer's deferred input here). When the
  timeline cannot say (another ``activation_trace`` is recording, or the swap regions do
  not map one to one onto the layers) the counters' figures stand and the cost model
  sees each deferred input one layer late, holding it one backward too long;
* ``shared_bytes``: bytes the layer saved that an earlier layer had saved first (the
  meter counts a storage once: the causal mask and rotary tables a decoder's layers all
  save are paid by layer 0 in a uniform step); a mixed plan's first layer of a strategy
  pays them when no earlier layer ran that strategy (the cost model's shared charge);
* ``held_bytes``: bytes of the layer's saves that the caller still holds when the backward
  ends (a loop variable holding the last layer's input, a list of hidden states, a
  module's buffer): the layer's backward does not free them, and a swapping release point
  cannot offload them (the engine defers a storage in use elsewhere at every release
  point), so they are part of ``kept_bytes`` and stay counted until the step ends. Read
  from the meter when the backward has run (an autograd callback, before ``backward()``
  returns): the live bytes of the storages the layer saved first (its epoch tag). The
  cost model counts them at the backward sample points of the layers before it; before
  they were read it freed them at the layer's backward and predicted swapping plans low
  (a 4-layer stack whose caller held the last input: ``checkpoint_swap`` 2048 B
  predicted, 4096 B measured);
* ``input_bytes`` / ``output_bytes``: the storage a layer hands the next (its output, the
  next layer's input) is one storage, counted once whichever of the two saves it (a tanh
  or ReLU at the end of a block saves it, and so does the next block's first Linear; a
  checkpointed block saves only its input). ``output_bytes``: the bytes of the layer's
  output storage it saves (part of ``kept_bytes``); ``input_bytes``: those of its input's
  storage it saves, *not* part of ``kept_bytes``: the cost model charges the layer
  ``input_bytes`` less what the previous layer's strategy saves of it (its
  ``output_bytes``). Read from the meter's epoch tags at the end of each layer's forward
  (``SavedBytesMeter::first_epoch`` / ``saved_in``); 0 for the swapping strategies, whose
  figures stay as measured (docs/design.md, "Boundary storages"). Uniform profiles had
  charged that storage to whichever layer saved it first, so "none" after "checkpoint"
  was predicted without it (a fuzzer's tanh stack: every plan measured 39 488 B, mixed
  ones predicted down to 21 056 B);
* ``forward_seconds`` / ``backward_seconds``: wall time between hooks (the backward from
  the gradient of the layer's output to that of its input), minus the time the engine
  reports it stalled on reloads there; on an accelerator each hook synchronizes. On the
  CPU the clock leaves out the time the thread waited, runnable, for a CPU that another
  process held (``_clock.unpreempted_clock``; the step times too). A swapping strategy's
  times measured below its resident twin's (``swap`` / ``none``, ``selective_swap`` /
  ``selective``, ``checkpoint_swap`` / ``checkpoint``) are raised to them: the same compute
  plus the copies' work is never faster, and noise that says so makes plans swap for
  nothing; so are a recomputing strategy's below ``none``'s (``_floor_by_twin``).

and, outside the layers: the bytes saved before the first layer (held all step), those
saved after the last one (the head and loss, freed before the layers' backward, except
what the caller still holds when the backward ends: ``tail_held_bytes``, the head's input
kept in a variable, counted through the backward), the
time between the last layer's forward and its backward, the rest of the step time, and
the copy link: seconds per byte and latency of the engine's own D2H and H2D copies, fitted
to the service times of the copies on the engine's timeline (``activation_trace``): those
of the profiled swapping steps plus a probe of two sizes. Only the copies are timed (a
wall-clock probe would count the probe's own compute as link time: it had measured the
CPU backend's link 1.4-3x slower than it is, and the model then saw stalls that do not
happen). On the CPU backend this includes its artificial per-byte delay.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._apply import (STRATEGIES, apply_activation_memory, check_plannable, plan_layer_names,
                     remove_activation_memory, suspended_application)
from ._clock import step_clock
from ._layers import find_layers, resolve_layer_slots
from ._memory import saved_activation_memory
from ._swap_manager import SwapManager
from ._trace import activation_trace
from ._warnings import warn as warn_user
from ..._extension import _C

#: The planner's default candidates, in the order they are profiled.
DEFAULT_CANDIDATES = ("none", "checkpoint", "selective", "swap", "selective_swap",
                      "checkpoint_swap")


@dataclass
class LayerCost:
    """One strategy's measured cost for one layer (bytes, seconds)."""

    kept_bytes: int
    offload_bytes: int
    forward_seconds: float
    backward_seconds: float
    deferred_bytes: int = 0
    shared_bytes: int = 0
    held_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """Everything the layer saved for backward (kept + offloaded + deferred)."""
        return self.kept_bytes + self.offload_bytes + self.deferred_bytes

    @property
    def group_bytes(self) -> int:
        """Bytes that leave the device and are reloaded before the layer's backward."""
        return self.offload_bytes + self.deferred_bytes


@dataclass
class CopyLink:
    """One copy direction: ``latency_seconds + bytes * seconds_per_byte``."""

    latency_seconds: float
    seconds_per_byte: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_seconds + self.seconds_per_byte * nbytes if nbytes > 0 else 0.0


@dataclass
class ActivationProfile:
    """What :func:`profile_activation_memory` measured; :meth:`plan` turns it into plans
    for any budget without running the model again.

    Attributes:
        layer_names: fully qualified layer names, forward order.
        strategies: the profiled candidates (``"none"`` first).
        costs: strategy -> one :class:`LayerCost` per layer.
        base_bytes: saved before the first layer, held all step.
        tail_bytes: saved after the last layer (head, loss).
        tail_held_bytes: of ``tail_bytes``, what the caller still holds when the backward
            ends (the head's input kept in a variable): on the device through the backward.
        tail_seconds: end of the last layer's forward to the start of its backward.
        outside_seconds: the rest of the step outside the layers.
        d2h, h2d: the copy links.
        measured: strategy -> {"peak_bytes", "step_seconds"} of its profiled step.
        output_bytes: bytes of each layer's output.
        device: the model's device.
        world_size: ranks whose worst figures this holds (1 outside torch.distributed).
        timing_scales: strategy -> its uninstrumented step over its profiled step (the
            median of the rounds' ratios, <= 1). The profiled steps run the library's
            meter and per-layer hooks, which the user's steps do not (on the CPU, an
            8-layer Llama with 4 ms layers: a plain step 32 ms, metered 35 ms, metered
            and hooked 37.7 ms; 2026-12-07), and the meter's cost grows with the tensors
            a strategy saves; each strategy's times (its ``costs``; the tail and outside
            times, from "none") are scaled by its factor, so that plans are predicted as
            they run. ``measured`` keeps the profiled steps' own times.
    """

    layer_names: list[str]
    strategies: list[str]
    costs: dict[str, list[LayerCost]]
    base_bytes: int
    tail_bytes: int
    tail_seconds: float
    outside_seconds: float
    d2h: CopyLink
    h2d: CopyLink
    measured: dict[str, dict] = field(default_factory=dict)
    output_bytes: list[int] = field(default_factory=list)
    device: str = "cpu"
    world_size: int = 1
    tail_held_bytes: int = 0
    timing_scales: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived figures
    @property
    def saved_bytes(self) -> list[int]:
        """Bytes each layer saves for backward with nothing applied (each storage counted
        once, by the first layer that saves it: the boundary charge of "none" after
        "none" included)."""
        return [self.kept_in_plan(k, "none", "none" if k else None)
                for k in range(len(self.layer_names))]

    def kept_in_plan(self, k: int, strategy: str, previous: str | None) -> int:
        """What layer k keeps under ``strategy`` after ``previous`` at layer k - 1 (None:
        k is the first), bytes: its kept bytes and the boundary charge (CostModel.h,
        ``boundary_charge``: the part of its input's storage that it saves and the layer
        before does not)."""
        c = self.costs[strategy][k]
        before = self.costs[previous][k - 1].output_bytes if previous is not None else 0
        return c.kept_bytes + max(0, c.input_bytes - before)

    @property
    def matmul_bytes(self) -> list[int] | None:
        """Per layer, the bytes "selective" keeps beyond "checkpoint" (matmul and fused
        attention outputs)."""
        if not {"selective", "checkpoint"} <= set(self.costs):
            return None
        return [max(0, s.kept_bytes - c.kept_bytes)
                for s, c in zip(self.costs["selective"], self.costs["checkpoint"])]

    @property
    def recompute_seconds(self) -> list[float] | None:
        """Per layer, the backward time "checkpoint" adds to "none" (its recompute)."""
        if "checkpoint" not in self.costs:
            return None
        return [max(0.0, c.backward_seconds - n.backward_seconds)
                for c, n in zip(self.costs["checkpoint"], self.costs["none"])]

    @property
    def none_peak_bytes(self) -> int:
        """Measured peak of the "none" step."""
        return int(self.measured["none"]["peak_bytes"])

    # ------------------------------------------------------------------ planning
    def plan(self, budget_bytes: int, *, candidates: Sequence[str] | None = None,
             prefetch_depth: int | None = None, host_budget_bytes: int | None = None):
        """The fastest plan within ``budget_bytes`` (see :func:`plan_activation_memory`
        and :func:`plan_from_profile`)."""
        from ._planner import plan_from_profile

        return plan_from_profile(self, budget_bytes, candidates=candidates,
                                 prefetch_depth=prefetch_depth,
                                 host_budget_bytes=host_budget_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ActivationProfile:
        """The profile :meth:`to_dict` wrote.

        Raises:
            ValueError: naming the field, for a structure that is not such a profile (a
                missing or unknown field, per-layer lists of another length than
                ``layer_names``, strategies without costs or measurements, a byte count
                that is not an int >= 0, a time that is not a finite number >= 0).
        """
        _check_profile_dict(d)
        d = dict(d)
        d["costs"] = {k: [LayerCost(**c) for c in v] for k, v in d["costs"].items()}
        d["d2h"] = CopyLink(**d["d2h"])
        d["h2d"] = CopyLink(**d["h2d"])
        # A profile saved between 92d37c2 and d53c85d (2026-12-07) had one factor for all
        # strategies, already applied to its times: kept, per strategy.
        old = d.pop("timing_scale", None)
        if old is not None and "timing_scales" not in d:
            d["timing_scales"] = {name: float(old) for name in d.get("strategies", [])}
        return cls(**d)


def _check_profile_dict(d) -> None:
    """ActivationProfile.from_dict's checks (a tester, session 26: an edited profile failed
    with a bare IndexError, KeyError or a pybind11 signature dump)."""
    import dataclasses
    import math

    def bad(what: str):
        raise ValueError(f"hyper_parallel: not an ActivationProfile dict: {what}")

    def check_int(v, where: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            bad(f"{where} must be an int >= 0, got {v!r}")

    def check_seconds(v, where: str) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            bad(f"{where} must be a finite number >= 0, got {v!r}")

    def check_fields(obj, kind, where: str) -> None:
        if not isinstance(obj, Mapping):
            bad(f"{where} must be a dict, got {type(obj).__name__}")
        fields = {f.name: f for f in dataclasses.fields(kind)}
        unknown = sorted(set(obj) - set(fields))
        if unknown:
            bad(f"{where} has unknown fields {unknown}")
        for name, f in fields.items():
            if name not in obj:
                if f.default is dataclasses.MISSING:
                    bad(f"{where} lacks field {name!r}")
                continue
            (check_int if f.type in ("int", int) else check_seconds)(obj[name],
                                                                     f"{where}.{name}")

    if not isinstance(d, Mapping):
        bad(f"expected a dict, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(ActivationProfile)} | {"timing_scale"}
    unknown = sorted(set(d) - known)
    if unknown:
        bad(f"unknown fields {unknown}")
    for name in ("layer_names", "strategies", "costs", "base_bytes", "tail_bytes",
                 "tail_seconds", "outside_seconds", "d2h", "h2d"):
        if name not in d:
            bad(f"missing field {name!r}")
    names = d["layer_names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != len(names):
        bad("'layer_names' must be a non-empty list of distinct layer names")
    strategies = d["strategies"]
    if not isinstance(strategies, list) or "none" not in strategies or any(
            s not in STRATEGIES or s == "mixed" for s in strategies):
        bad(f"'strategies' must be a list of per-layer strategy names holding 'none', got "
            f"{strategies!r}")
    costs = d["costs"]
    if not isinstance(costs, Mapping) or set(costs) != set(strategies):
        bad(f"'costs' must hold one entry per strategy of 'strategies' ({strategies}), got "
            f"{sorted(costs) if isinstance(costs, Mapping) else type(costs).__name__}")
    for s, rows in costs.items():
        if not isinstance(rows, list) or len(rows) != len(names):
            bad(f"costs[{s!r}] must be a list of one entry per layer ({len(names)})")
        for k, row in enumerate(rows):
            check_fields(row, LayerCost, f"costs[{s!r}][{k}]")
    for link in ("d2h", "h2d"):
        check_fields(d[link], CopyLink, link)
    for name in ("base_bytes", "tail_bytes", "tail_held_bytes", "world_size"):
        if name in d:
            check_int(d[name], name)
    for name in ("tail_seconds", "outside_seconds"):
        check_seconds(d[name], name)
    measured = d.get("measured", {})
    if not isinstance(measured, Mapping) or not set(strategies) <= set(measured):
        bad("'measured' must hold {'peak_bytes', 'step_seconds'} for every strategy")
    for s in strategies:
        m = measured[s]
        if not isinstance(m, Mapping) or set(m) != {"peak_bytes", "step_seconds"}:
            bad(f"measured[{s!r}] must be {{'peak_bytes': int, 'step_seconds': float}}")
        check_int(m["peak_bytes"], f"measured[{s!r}].peak_bytes")
        check_seconds(m["step_seconds"], f"measured[{s!r}].step_seconds")
    out = d.get("output_bytes", [])
    if not isinstance(out, list) or (out and len(out) != len(names)):
        bad("'output_bytes' must be a list of one int per layer")
    for k, v in enumerate(out):
        check_int(v, f"output_bytes[{k}]")
    scales = d.get("timing_scales", {})
    if not isinstance(scales, Mapping):
        bad("'timing_scales' must be a dict strategy -> factor")
    for s, v in scales.items():
        check_seconds(v, f"timing_scales[{s!r}]")
    if "device" in d and not isinstance(d["device"], str):
        bad(f"'device' must be a str, got {d['device']!r}")


def check_candidates(candidates) -> list[str]:
    """Validated candidate list, ``"none"`` first (it is always profiled: the baseline)."""
    if candidates is None:
        return list(DEFAULT_CANDIDATES)
    if isinstance(candidates, str):
        candidates = [candidates]
    names = list(dict.fromkeys(candidates))
    for name in names:
        if name == "mixed" or name not in STRATEGIES:
            per_layer = ", ".join(n for n in STRATEGIES if n != "mixed")
            raise ValueError(f"hyper_parallel: candidate {name!r} is not a per-layer strategy; "
                             f"choose from {per_layer}")
    return ["none"] + [n for n in names if n != "none"]


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (the host for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# Whether the backward running now keeps its graph (retain_graph=True); torch's own
# AOTAutograd reads it. Private: absent from a torch that lacks it (then not checked).
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    x = kwargs.get("hidden_states")
    if isinstance(x, torch.Tensor):
        return x
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (its StorageImpl), or None when it has none."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None  # sparse, nested, a subclass without storage


def _out_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class _StepProbe:
    """Hooks on the (possibly wrapped) layers that time each layer's forward and backward
    and read the meter and the engine's counters at its boundaries."""

    def __init__(self, modules: list[nn.Module], device: torch.device) -> None:
        n = len(modules)
        self.n = n
        self.device = device
        # wall time less run-queue waits on the CPU (_clock.py): preemption by other
        # processes is not the layer's cost
        self.clock = step_clock(device)
        self.meter = None
        self.fwd_start = [0.0] * n
        self.fwd_end = [0.0] * n
        # the order of the layers' first forwards (0, 1, ...; -1: not run): a count, not the
        # clock, which a preemption between its two reads could step back (fuzzer, session
        # 26: a correct Bert refused as "not in forward order" on a loaded machine)
        self.fwd_order = [-1] * n
        self._forwards = 0
        self.bwd_start = [None] * n
        self.bwd_end = [None] * n
        self.mem_before = [0] * n
        self.mem_after = [0] * n
        self.off_before = [0] * n
        self.off_after = [0] * n
        self.stall_start = [0.0] * n
        self.stall_end = [0.0] * n
        self.out_bytes = [0] * n
        # forwards whose output's gradient has not arrived yet, and the most at once
        self.live = [0] * n
        self.most_live = [0] * n
        # gradients of the first pass's output: more than one is a second backward through
        # the same forward (retain_graph=True), which the planner does not model
        self.first_grads = [0] * n
        # whether the first backward keeps the graph (backward(retain_graph=True)): every
        # saved tensor, reloaded ones included, then stays until the graph is freed, which
        # the cost model does not see; None where this torch cannot tell
        self.kept_graph = None
        # forwards run so far: only a layer's first forward and its backward are read (a
        # step that accumulates gradients over passes is profiled by its first pass)
        self.passes = [0] * n
        # a forward under no_grad / inference mode (an evaluation pass) saves nothing for
        # backward and is not a pass: its hooks read nothing
        self.graded = [True] * n
        # the meter's peak and the engine's reload bytes when the last layer's forward ends
        # and when its backward begins
        self.peak_at_forward_end = self.peak_at_backward = None
        self.reloads_at_forward_end = self.reloads_at_backward = 0
        # per layer, the bytes of its saves still counted when the backward ends (the
        # caller holds them), and the same of the head's saves; None: not read
        self.held_at_end = None
        self.tail_held_at_end = 0
        # per layer, bytes of its input's storage that it saved, and (of layer k - 1)
        # those of its output's storage it saved (the boundary storages)
        self.input_saved = [0] * len(modules)
        self.output_saved = [0] * len(modules)
        # per layer, weak references to the tensors of its output (first pass): the next
        # layer's arguments on one of their storages are the boundary
        self.out_refs: list[list] = [[] for _ in modules]
        self._handles = []
        for k, m in enumerate(modules):
            self._handles.append(m.register_forward_pre_hook(self._pre(k), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(k), with_kwargs=True))

    def _stats(self) -> dict:
        return SwapManager().stats()

    def _pre(self, k):
        def hook(module, args, kwargs):
            self.graded[k] = torch.is_grad_enabled()
            if not self.graded[k]:
                return
            self.passes[k] += 1
            if self.passes[k] > 1:
                return
            _sync(self.device)
            stats = self._stats()
            self.off_before[k] = stats["offload_bytes"]
            self.mem_before[k] = self.meter.sample() if self.meter is not None else 0
            if self.meter is not None:
                self.meter._meter.begin_epoch(k + 1)  # what layer k saves first is tagged k + 1
            x = _first_tensor(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(self._grad_in(k))
            self.fwd_order[k] = self._forwards
            self._forwards += 1
            self.fwd_start[k] = self.clock()
        return hook

    def _post(self, k):
        def hook(module, args, kwargs, output):
            if not self.graded[k]:
                return None
            if self.passes[k] > 1:
                y = _out_tensor(output)
                if y is not None and y.requires_grad:
                    y.register_hook(self._grad_out_again(k))
                    self._went_live(k)
                return None
            _sync(self.device)
            self.fwd_end[k] = self.clock()
            stats = self._stats()
            self.off_after[k] = stats["offload_bytes"]
            self.mem_after[k] = self.meter.sample() if self.meter is not None else 0
            if self.meter is not None and k > 0:
                self._read_boundary(k, args, kwargs)
            if self.meter is not None and k + 1 < self.n:
                self.out_refs[k] = [weakref.ref(t) for t in tree_leaves(output)
                                   if isinstance(t, torch.Tensor)]
            if self.meter is not None and k == self.n - 1:
                self.meter._meter.begin_epoch(-1)  # the head and the backward: not layers
                self.peak_at_forward_end = self.meter.peak_bytes
                self.reloads_at_forward_end = stats["reload_bytes"]
            y = _out_tensor(output)
            if y is not None:
                self.out_bytes[k] = y.untyped_storage().nbytes()
                if y.requires_grad:
                    y.register_hook(self._grad_out(k))
                    self._went_live(k)
            return None
        return hook

    def _read_boundary(self, k, args, kwargs):
        """The storage layer k - 1 handed layer k (the storage of a tensor of k - 1's
        output that one of k's arguments, positional or keyword, views), at the end of k's
        forward: whether layer k - 1 saved it first (epoch k) and whether layer k saved it
        (epoch k + 1). Read only where exactly one such storage exists: with several, the
        two sides' bytes could belong to different storages, and the charge would be low
        (a tester, session 27: reading the first tensor argument only, a layer called as
        block(x=h) or block(mask, h) had its mixed plans predicted 25 % low)."""
        handed = {_storage_key(t) for t in (ref() for ref in self.out_refs[k - 1])
                  if t is not None and not t.is_meta} - {None}
        if not handed:
            return
        matched = {}
        for t in tree_leaves((args, kwargs)):
            key = _storage_key(t) if isinstance(t, torch.Tensor) else None
            if key in handed:
                matched[key] = t
        if len(matched) != 1:
            return
        (x,) = matched.values()
        meter = self.meter._meter
        first = meter.first_epoch(x)
        if first is None:
            return  # nobody saved it (or it is gone)
        nbytes = int(x.untyped_storage().nbytes())
        if first == k:
            self.output_saved[k - 1] = nbytes
        if first in (k, k + 1) and meter.saved_in(x, k + 1):
            self.input_saved[k] = nbytes

    def _went_live(self, k):
        self.live[k] += 1
        self.most_live[k] = max(self.most_live[k], self.live[k])

    def _grad_out_again(self, k):
        def hook(grad):
            self.live[k] = max(0, self.live[k] - 1)
            self._read_keep_graph()  # a later pass's backward may keep its graph too
        return hook

    def _read_keep_graph(self):
        """Inside a backward: notes whether it keeps its graph (retain_graph=True)."""
        if not self.kept_graph and _keep_graph is not None:
            self.kept_graph = bool(_keep_graph())

    def _grad_out(self, k):
        def hook(grad):
            self.first_grads[k] += 1
            if self.first_grads[k] > 1:
                return  # a second backward through the first pass: refused (_check_warmup)
            _sync(self.device)
            self._read_keep_graph()
            self.live[k] = max(0, self.live[k] - 1)
            self.bwd_start[k] = self.clock()
            self.stall_start[k] = self._stats()["stall_seconds"]
            if k == self.n - 1 and self.meter is not None:
                self.meter.sample()
                self.peak_at_backward = self.meter.peak_bytes
                self.reloads_at_backward = self._stats()["reload_bytes"]
                # Read once every node of this backward has run (and released what it
                # saved), before backward() returns to the caller.
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        return hook

    def _backward_ended(self):
        meter = self.meter
        if meter is None:
            return
        _sync(self.device)
        # What layer k saved first is tagged k + 1, the head's and the backward's -1.
        self.held_at_end = [int(meter._meter.live_bytes(k + 1)) for k in range(self.n)]
        self.tail_held_at_end = int(meter._meter.live_bytes(-1))

    def _grad_in(self, k):
        def hook(grad):
            _sync(self.device)
            self.bwd_end[k] = self.clock()
            self.stall_end[k] = self._stats()["stall_seconds"]
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _run_step(step_fn: Callable[[], object], model: nn.Module, names: list[str],
              device: torch.device, params: list[nn.Parameter]) -> dict:
    """One measured step of the plan currently applied to ``model``."""
    modules = [model.get_submodule(n) for n in names]
    probe = _StepProbe(modules, device)
    try:
        _sync(device)
        start = probe.clock()
        with saved_activation_memory() as meter:
            meter._owner = "the planner (plan_activation_memory / profile_activation_memory)"
            probe.meter = meter
            step_fn()
            _sync(device)
        end = probe.clock()
        peak = meter.peak_bytes
        # The head's own peak: the meter's when the layers' backward begins less what the
        # engine reloaded since the forward ended (the prefetch that the backward's start
        # issued, before this hook ran), where that is above the peak of the forward (an
        # earlier, higher peak inside a layer's forward is the cost model's to predict); a
        # step the hooks did not see falls back to the step's peak.
        if probe.peak_at_backward is None or probe.peak_at_forward_end is None:
            head_peak = peak
        else:
            head_peak = probe.peak_at_backward - (probe.reloads_at_backward
                                                  - probe.reloads_at_forward_end)
            if head_peak <= probe.peak_at_forward_end:
                head_peak = probe.mem_after[-1]
        shared = [int(meter._meter.resaved_bytes(k + 1)) for k in range(len(names))]
        got_grads = any(p.grad is not None for p in params)
    finally:
        probe.meter = None
        probe.remove()
        for p in params:
            p.grad = None
    n = len(names)
    costs = []
    for k in range(n):
        # What the caller saves between layer k and k + 1 (an auxiliary loss term of the
        # layer's output) is layer k's: held until about its backward, and it depends on
        # its strategy (a tensor the layer saves under "none" is saved by the caller
        # instead once the layer recomputes it).
        gap = max(0, int(probe.mem_before[k + 1] - probe.mem_after[k])) if k + 1 < n else 0
        b_end = probe.bwd_end[k] if probe.bwd_end[k] is not None else end
        b_start = probe.bwd_start[k] if probe.bwd_start[k] is not None else b_end
        stall = max(0.0, probe.stall_end[k] - probe.stall_start[k]) \
            if probe.bwd_end[k] is not None and probe.bwd_start[k] is not None else 0.0
        costs.append(LayerCost(
            # as counted, possibly negative: the previous layer's deferred input leaves
            # inside this layer's window (attribute_offloads gives it back; _settle_kept)
            kept_bytes=int(probe.mem_after[k] - probe.mem_before[k]) + gap,
            offload_bytes=max(0, int(probe.off_after[k] - probe.off_before[k])),
            forward_seconds=max(0.0, probe.fwd_end[k] - probe.fwd_start[k]),
            backward_seconds=max(0.0, b_end - b_start - stall),
            shared_bytes=shared[k],
            # at most what stays on the device: _settle_kept clips it to kept_bytes
            held_bytes=probe.held_at_end[k] if probe.held_at_end is not None else 0,
            # as measured here (its storage counted once, by its first saver);
            # _charge_boundaries takes input_bytes out of kept_bytes
            input_bytes=probe.input_saved[k], output_bytes=probe.output_saved[k]))
    last_bwd = probe.bwd_start[n - 1]
    tail_seconds = max(0.0, (last_bwd if last_bwd is not None else end) - probe.fwd_end[n - 1])
    busy = sum(c.forward_seconds + c.backward_seconds for c in costs)
    return {
        "costs": costs,
        "ran_forward": [i >= 0 for i in probe.fwd_order],
        "forward_order": list(probe.fwd_order),
        "ran_backward": got_grads or any(t is not None for t in probe.bwd_end),
        "peak_bytes": int(peak),
        "step_seconds": end - start,
        "base_bytes": int(probe.mem_before[0]),
        # the head and loss over what the layers hold (not the backward's own peaks)
        "tail_bytes": max(0, int(head_peak) - int(probe.mem_after[n - 1])),
        "tail_held_bytes": int(probe.tail_held_at_end),
        "tail_seconds": tail_seconds,
        "outside_seconds": max(0.0, end - start - busy - tail_seconds),
        "output_bytes": list(probe.out_bytes),
        "most_live_forwards": list(probe.most_live),
        "most_backwards": list(probe.first_grads),
        "kept_graph": bool(probe.kept_graph),
    }


# Integer dtypes of each element size: a parameter's bits summed exactly (_bits_sum).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _plain_local(p):
    """The plain tensor holding ``p``'s values on this rank (a DTensor's local shard), or
    None for other tensor subclasses and meta tensors (not checked)."""
    t = p.detach()
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2, tensor parallel)
    if local is not None:
        t = local
    if type(t) is not torch.Tensor or t.is_meta:
        return None
    return t


def _bits_sum(t):
    """The sum, as int64 (wrapping), of ``t``'s elements read as integers of their size: a
    0-d tensor on ``t``'s device, or None (no such view). Any change of one element changes
    it; exact, no rounding, and no copy of the tensor (an integer sum of a view)."""
    if t is None or t.numel() == 0:
        return None
    dtype = _INT_OF_SIZE.get(t.element_size())
    if dtype is None:
        return None
    try:
        return t.view(dtype).sum(dtype=torch.int64)
    except Exception:  # noqa: BLE001 (a backend or dtype without it: not checked)
        return None


def _fingerprint(tensors) -> list:
    """``_bits_sum`` of each of ``tensors`` (None where unavailable), read with one
    device synchronization per device."""
    sums = [_bits_sum(t) for t in tensors]
    by_device: dict = {}
    for i, v in enumerate(sums):
        if v is not None:
            by_device.setdefault(v.device, []).append(i)
    out: list = [None] * len(sums)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            out[i] = value
    return out


def _layout(t):
    return None if t is None or t.numel() == 0 else (
        t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class _ModelState:
    """What profiling must leave as it found it (issue 11 tester R1, R2, R7): every
    module's training flag, every
    buffer's object and values (BatchNorm statistics move at every training step), the
    random number generators of the host and the model's device (dropout draws), and the
    parameters, which a step must not change at all. Parameters are not copied (planning
    costs no second copy of the weights); after each step they are checked:

    * their version counters (an in-place update; a ``torch.optim`` optimizer's
      ``step()`` is stopped before it runs, :func:`_optimizer_steps_refused`);
    * the objects in the modules' parameter slots and the memory each holds (a new
      ``nn.Parameter``, ``p.data = ...``): the originals are put back;
    * the exact integer sum of each one's bits (``p.data.add_(...)``, which no version
      counter sees: ``.data`` has a counter of its own).

    Leaves outside the model that ``step_fn`` backpropagates into (an input with
    ``requires_grad``, a loss head's weight held elsewhere) are found by the backward
    calls' graphs (:class:`_OutsideLeaves`) and their ``.grad`` is left as found too.
    Plain tensors and DTensors' local shards are checked; other tensor subclasses only by
    their version counters."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter],
                 device: torch.device) -> None:
        self.params = params
        self.versions = [p._version for p in params]
        self.slots = [(f"{prefix}.{name}" if prefix else name, m, name, p)
                      for prefix, m in model.named_modules()
                      for name, p in m._parameters.items() if p is not None]
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
        # aliases of each parameter's memory (no copy): `p.data = ...` is undone with them
        self.aliases = [_plain_local(p) for p in params]
        self.layouts = [_layout(t) for t in self.aliases]
        self.sums = _fingerprint(self.aliases)
        self.outside = _OutsideLeaves({id(p) for p in params})
        self.buffers = [(m, name, b, b.detach().clone())
                        for m in model.modules()
                        for name, b in m._buffers.items() if b is not None]
        # each module's training flag (a step calling model.train() had left an eval-mode
        # model in training mode after planning: a tester, session 26)
        self.modes = [(m, m.training) for m in model.modules()]
        self.cpu_rng = torch.get_rng_state()
        self.device = device
        self.device_rng = None
        backend = getattr(torch, device.type, None) if device.type != "cpu" else None
        if backend is not None and hasattr(backend, "get_rng_state"):
            try:
                self.device_rng = backend.get_rng_state(device)
            except (RuntimeError, TypeError):  # a backend without per-device RNG state
                self.device_rng = None

    def check_parameters(self) -> None:
        """After a step: refuses a step that changed the parameters, and clears the
        gradients it left on leaves outside the model.

        Raises:
            RuntimeError: ``step_fn`` changed a parameter (in place, through ``.data``, or
                by replacing it); replaced ones are put back by :meth:`restore`.
        """
        self.outside.clear_grads()
        for p, v in zip(self.params, self.versions):
            if p._version != v:
                raise RuntimeError(
                    "hyper_parallel: step_fn changed the model's parameters in place (an "
                    "optimizer.step() or a weight update in the step?); that update is not "
                    "undone (no copy of the weights is kept). plan_activation_memory runs "
                    "step_fn several times to profile it and must leave the weights as they "
                    "are: pass a step that only runs the forward and backward, e.g. lambda: "
                    "model(**batch).loss.backward(), and step the optimizer outside.")
        replaced = [path for path, m, name, p in self.slots
                    if m._parameters.get(name) is not p]
        now = [_plain_local(p) for p in self.params]
        for name, t, alias, layout in zip(self.names, now, self.aliases, self.layouts):
            if alias is not None and layout is not None and _layout(t) not in (layout, None):
                replaced.append(f"{name}.data")
        if replaced:
            raise RuntimeError(
                "hyper_parallel: step_fn replaced parameters of the model (a new "
                "nn.Parameter in a module, or p.data = ...: "
                f"{', '.join(replaced[:4])}{', ...' if len(replaced) > 4 else ''}); the "
                "original ones are put back. plan_activation_memory runs step_fn several "
                "times and must leave the weights as they are: pass a step that only runs "
                "the forward and backward, e.g. lambda: model(**batch).loss.backward(), and "
                "update the weights outside.")
        sums = _fingerprint(now)
        if any(a is not None and b is not None and a != b for a, b in zip(self.sums, sums)):
            raise RuntimeError(
                "hyper_parallel: step_fn changed the values of the model's parameters "
                "(through p.data, which no version counter sees: a manual SGD step such as "
                "p.data.add_(-lr * p.grad)?); that update is not undone (no copy of the "
                "weights is kept). plan_activation_memory runs step_fn several times and "
                "must leave the weights as they are: pass a step that only runs the forward "
                "and backward, e.g. lambda: model(**batch).loss.backward(), and update the "
                "weights outside.")

    def restore(self) -> None:
        for module, training in self.modes:
            module.training = training
        with torch.no_grad():
            for module, name, original, saved in self.buffers:
                original.copy_(saved)  # values changed in place (running statistics)
                module._buffers[name] = original  # or the buffer was reassigned
            for _, module, name, p in self.slots:
                if module._parameters.get(name) is not p:
                    module._parameters[name] = p
            for p, alias, layout in zip(self.params, self.aliases, self.layouts):
                if alias is not None and layout is not None and type(p.detach()) is \
                        torch.Tensor and _layout(_plain_local(p)) != layout:
                    p.data = alias
        self.outside.restore()
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            getattr(torch, self.device.type).set_rng_state(self.device_rng, self.device)


class _OutsideLeaves:
    """Leaves outside the model that the profiled steps' backward calls accumulate
    gradients into (tester, session 18: an input with ``requires_grad`` or a weight held
    outside the model was left with the sum of every profiling step's gradient, which the
    first training step would then add to): found by walking each ``backward()``'s graph
    from its roots to the ``AccumulateGrad`` nodes (``torch.autograd.backward`` wrapped
    while :meth:`watching`, for this thread only), and the parameters of an optimizer whose
    ``zero_grad()`` the step calls (before it clears them); each one's ``.grad`` is set
    aside before its first profiled backward or ``zero_grad()`` and put back by
    :meth:`restore`. A leaf outside the model whose gradient the step changes in place
    before any backward reaches it (``x.grad.zero_()``) is not seen."""

    __slots__ = ("_own", "_saved")

    def __init__(self, own_ids: set) -> None:
        self._own = own_ids
        self._saved: dict = {}  # id -> (leaf, its .grad before profiling)

    @contextlib.contextmanager
    def watching(self):
        """Wraps, for this thread, the function every backward call of ``torch.autograd``
        goes through: ``_engine_run_backward`` where torch has it (``Tensor.backward``,
        ``torch.autograd.backward`` however imported, ``torch.autograd.grad``), else
        ``torch.autograd.backward``. A step calling the engine directly
        (``Variable._execution_engine.run_backward``) is not seen."""
        import threading

        module = torch.autograd
        name = "_engine_run_backward" if hasattr(module, "_engine_run_backward") else "backward"
        original = getattr(module, name)
        thread = threading.get_ident()

        def run_backward(tensors, *args, **kwargs):
            if threading.get_ident() == thread:
                self._note(tensors)
            return original(tensors, *args, **kwargs)

        # An optimizer's zero_grad() in the step (allowed: it only clears gradients) would
        # clear the .grad of leaves outside the model before the backward shows them (a
        # tester, session 26: a weight of the optimizer outside the model lost the gradient
        # the user had accumulated): their gradients are set aside first.
        optimizer = torch.optim.Optimizer
        zero_grad = optimizer.zero_grad

        def guarded_zero_grad(opt, *args, **kwargs):
            if threading.get_ident() == thread:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if isinstance(p, torch.Tensor):
                            self._add(p)
            return zero_grad(opt, *args, **kwargs)

        setattr(module, name, run_backward)
        optimizer.zero_grad = guarded_zero_grad
        try:
            yield
        finally:
            setattr(module, name, original)
            optimizer.zero_grad = zero_grad

    def _note(self, tensors) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        stack, seen = [], set()
        for t in roots:
            if not isinstance(t, torch.Tensor):
                continue
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif t.requires_grad:
                self._add(t)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)

    def _add(self, leaf) -> None:
        key = id(leaf)
        if key in self._own or key in self._saved:
            return
        self._saved[key] = (leaf, leaf.grad)
        leaf.grad = None

    def clear_grads(self) -> None:
        for leaf, _ in self._saved.values():
            leaf.grad = None

    def restore(self) -> None:
        for leaf, grad in self._saved.values():
            leaf.grad = grad
        self._saved.clear()


def _check_initialized(model: nn.Module, params: list) -> None:
    """Refuses a model whose lazy modules (``nn.LazyLinear``, ...) have not run yet: their
    parameters have no shape, so nothing about them can be measured or checked.

    Raises:
        ValueError: naming the first uninitialized parameter or buffer.
    """
    lazy = nn.parameter.is_lazy
    names = [n for n, p in model.named_parameters() if lazy(p)]
    names += [n for n, b in model.named_buffers() if lazy(b)]
    if names:
        raise ValueError(
            f"hyper_parallel: the model has uninitialized lazy parameters or buffers "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: nn.Lazy* modules "
            "that have not run yet); run one forward of the model first (e.g. under "
            "torch.no_grad()) so that they get their shapes, then plan.")


def _check_warmup(run: dict, layer_names: list[str]) -> None:
    """The first profiled step ran every layer, in the given order, and a backward."""
    missing = [n for n, ran in zip(layer_names, run["ran_forward"]) if not ran]
    if len(missing) == len(layer_names):
        raise ValueError(
            "hyper_parallel: step_fn ran none of the layers' forwards; it must run one "
            "training step of this model (forward and backward), e.g. lambda: "
            "model(**batch).loss.backward().")
    if missing:
        raise ValueError(
            f"hyper_parallel: step_fn did not run the forward of layer(s) {missing}; plan "
            "only the layers the step runs (layers=...), or give a step that runs them all.")
    if not run["ran_backward"]:
        raise ValueError(
            "hyper_parallel: step_fn ran the forward but no backward (no parameter got a "
            "gradient); it must run one full training step without the optimizer, e.g. "
            "lambda: model(**batch).loss.backward().")
    lives = run["most_live_forwards"]
    shared = [name for name, most in zip(layer_names, lives) if most > 1]
    if shared and len(shared) < len(layer_names) and min(lives) == 1:
        # Some layers run twice per pass, the others once: a module called at several
        # places of the forward (shared weights; a tester, session 26, was told to give
        # one micro-batch per backward)
        raise ValueError(
            f"hyper_parallel: layer(s) {shared} run their forward several times in one pass "
            "while the other layers run once: a module used at several places of the model "
            "(shared weights). The planner models one forward and one backward per layer; "
            "plan the other layers (layers=[...] without it), and apply a strategy to the "
            "shared module yourself if it needs one.")
    for name, most in zip(layer_names, lives):
        if most > 1:
            raise ValueError(
                f"hyper_parallel: step_fn runs the forward of layer {name!r} {most} times "
                "before its backward (several passes through the layers, one backward); "
                "the planner models one forward and one backward per layer and step. Give "
                "a step_fn with one pass per backward (one micro-batch, one view), and "
                "apply the plan to the real step.")
    for name, most in zip(layer_names, run.get("most_backwards", [])):
        if most > 1:
            raise ValueError(
                f"hyper_parallel: step_fn runs the backward of layer {name!r} {most} times "
                "through one forward (backward(retain_graph=True), then another backward); "
                "the planner models one forward and one backward per layer and step (a "
                "retained graph also keeps every saved tensor until the last backward). "
                "Give a step_fn with one backward per forward, and apply the plan to the "
                "real step.")
    if run.get("kept_graph"):
        raise ValueError(
            "hyper_parallel: step_fn's backward keeps the graph (backward(retain_graph=True) "
            "or autograd.grad(..., retain_graph=True)): every tensor saved for backward, "
            "reloaded ones included, then stays on the device until the graph is freed, "
            "and the planner models a backward that frees each layer's saves as it goes. "
            "Give a step_fn whose backward frees the graph (the default), and apply the plan "
            "to the real step.")
    order = run["forward_order"]
    for a, b, sa, sb in zip(layer_names, layer_names[1:], order, order[1:]):
        if sb < sa:
            raise ValueError(
                f"hyper_parallel: the layers are not in forward order: {b!r} runs before "
                f"{a!r}. Give layers= in the order the model's forward calls them.")


def _can_swap(device: torch.device) -> bool:
    return device.type != "cpu" or SwapManager().cpu_swap_enabled()


def _sin_of_copy(a: torch.Tensor) -> torch.Tensor:
    # mul by a Python number saves nothing; sin saves its input, created here: swappable.
    return (a * 1.0).sin()


def _copy_points(items) -> dict[str, list[tuple[int, float]]]:
    """Per copy direction, (bytes, service seconds) of every copy in a trace: from the
    later of its enqueue and the end of the copy before it on the same stream and device
    (a FIFO stream serves one copy at a time) to its end. Compute is not in it."""
    out: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
    last: dict = {}
    copies = sorted((i for i in items if i["kind"] == "copy" and i["stream"] in out),
                    key=lambda i: i["start_ns"])
    for it in copies:
        key = (it["stream"], it["device"])
        begin = max(it["enqueue_ns"], last.get(key, it["enqueue_ns"]))
        last[key] = max(it["end_ns"], last.get(key, 0))
        if it["bytes"] > 0:
            out[it["stream"]].append((int(it["bytes"]), max(0, it["end_ns"] - begin) * 1e-9))
    return out


def fit_copy_link(points: Sequence[tuple[int, float]]) -> CopyLink:
    """Latency + seconds per byte fitted to (bytes, seconds) copy samples: the median time
    of each distinct size, then least squares over the sizes (each size weighs the same,
    so many copies of one size do not drown the others). Negative latency: a line through
    the origin; one size: all of its time per byte. Raises ValueError without samples."""
    if not points:
        raise ValueError("hyper_parallel: no copy samples to fit a copy link to")
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in points:
        by_size.setdefault(int(nbytes), []).append(float(seconds))
    xs = sorted(by_size)
    ys = [statistics.median(by_size[x]) for x in xs]
    if len(xs) == 1:
        return CopyLink(0.0, ys[0] / xs[0])
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    vx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx
    latency = my - slope * mx
    if slope < 0.0:
        return CopyLink(max(0.0, my), 0.0)
    if latency < 0.0:
        return CopyLink(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return CopyLink(latency, slope)


@contextlib.contextmanager
def _copy_trace(into: dict[str, list[tuple[int, float]]] | None):
    """Records the engine's copies of the enclosed code into ``into`` (per direction,
    :func:`_copy_points`) and yields a list that holds the timeline's items once the block
    is left; does nothing (yields None) when ``into`` is None."""
    if into is None:
        yield None
        return
    items: list[dict] = []
    with activation_trace() as trace:
        yield items
    items += trace.items
    for direction, pts in _copy_points(trace.items).items():
        into[direction] += pts


def attribute_offloads(costs: list[LayerCost], items: list[dict]) -> bool:
    """Moves each offload to the layer whose saved tensors it copied, from the timeline
    ``items`` of one step (:class:`ActivationTrace` items): an offload labelled with
    layer k's group and queued after layer k+1's forward began is layer k's deferred
    bytes; the rest of k's offloads are its own. ``kept_bytes`` becomes what the layer
    saved (kept + offloaded over its forward, as counted) less both. Layers map to groups
    by the order of the groups' forwards on the timeline.

    Returns False and changes nothing when the timeline does not map one group to each
    layer, names a group that is not a layer, or disagrees with the counted bytes."""
    n = len(costs)
    forwards = sorted((i for i in items if i["kind"] == "forward"), key=lambda i: i["start_ns"])
    labels = [i["label"] for i in forwards]
    if len(labels) != n or len(set(labels)) != n:
        return False
    index = {label: k for k, label in enumerate(labels)}
    starts = [i["start_ns"] for i in forwards]
    own, deferred = [0] * n, [0] * n
    for it in items:
        if it["kind"] != "copy" or it["stream"] != "d2h":
            continue
        k = index.get(it["label"])
        if k is None:
            return False
        if k + 1 < n and it["enqueue_ns"] >= starts[k + 1]:
            deferred[k] += int(it["bytes"])
        else:
            own[k] += int(it["bytes"])
    if sum(own) + sum(deferred) != sum(c.offload_bytes for c in costs):
        return False
    kept = [c.kept_bytes + c.offload_bytes - own[k] - deferred[k] for k, c in enumerate(costs)]
    if min(kept) < 0:
        return False
    for k, c in enumerate(costs):
        c.kept_bytes, c.offload_bytes, c.deferred_bytes = kept[k], own[k], deferred[k]
    return True


def _settle_kept(costs: list[LayerCost]) -> None:
    """A layer's window can count less than nothing (the deferred input of the layer before
    it leaves the device inside it); once the offloads are attributed what is left below
    zero is noise of the counters: kept at 0. Clipped before the attribution, the deferred
    bytes were added on top of the clipped figure (a 4-layer stack of alternating widths:
    checkpoint_swap predicted 196 608 B against 135 168 B measured).

    Held bytes (the caller's references at the end of the backward) never left the device,
    so they are part of what the layer kept (for the last layer, of all it saved: it keeps
    everything); a figure above that is clipped to it."""
    for k, c in enumerate(costs):
        c.kept_bytes = max(0, c.kept_bytes)
        stays = c.saved_bytes if k + 1 == len(costs) else c.kept_bytes
        c.held_bytes = max(0, min(c.held_bytes, stays))


def _charge_boundaries(costs: list[LayerCost], swaps: bool) -> None:
    """Makes each layer's figures independent of the strategy of the layer before it, for
    the storage between them (``input_bytes`` / ``output_bytes``, CostModel.h's boundary
    charge): in this uniform step the meter counted it once, in the kept bytes of the first
    layer that saved it, and as a later layer's shared bytes. ``kept_bytes`` then leaves
    out what the layer saves of its input storage where the layer before had not (the cost
    model charges it back against the previous strategy's ``output_bytes``), and
    ``shared_bytes`` what it saved again of it (the boundary charge answers for that
    storage, not the shared one). A swapping strategy's figures stay as measured (its
    release points move that storage between the two layers' groups): both 0."""
    if swaps:
        for c in costs:
            c.input_bytes = c.output_bytes = 0
        return
    # (the probe reads no boundary before layer 0 nor after the last: those fields are 0)
    for k in range(1, len(costs)):
        c, before = costs[k], costs[k - 1].output_bytes
        c.kept_bytes = max(0, c.kept_bytes - max(0, c.input_bytes - before))
        c.shared_bytes = max(0, c.shared_bytes - min(c.input_bytes, before))


def _trace_free() -> bool:
    """True when no activation_trace is recording (the profile may record its own)."""
    try:
        _C.trace_start()
    except RuntimeError:
        return False
    _C.trace_stop()
    return True


def measure_copy_links(device: torch.device, nbytes: int, repeats: int = 5,
                       samples: dict[str, list[tuple[int, float]]] | None = None) \
        -> tuple[CopyLink, CopyLink]:
    """Fits latency + seconds per byte of the engine's own D2H and H2D copies.

    Offloads and reloads one saved tensor of ``nbytes`` and of ``nbytes // 4`` bytes
    (a ``swap`` region outside any chain: released at its end, reloaded when its backward
    starts), ``repeats`` times each. The copy times come from the engine's timeline
    (:func:`activation_trace`: each copy's service time on its stream, no compute in it),
    pooled with ``samples`` (more (bytes, seconds) per direction, e.g. the copies of the
    profiled steps) and fitted by :func:`fit_copy_link`. On the CPU backend the engine's
    per-byte delay is part of what is measured. If another ``activation_trace`` is
    recording, the wall times around the offload (to ``synchronize()``) and around the
    backward are fitted instead (they include the small ``sin`` forward and backward).
    """
    from ._swap import swap

    manager = SwapManager()
    sizes = (max(1 << 14, nbytes // 4) // 4 * 4, max(1 << 16, nbytes) // 4 * 4)
    traced = _trace_free()
    points: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
    wall: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
    for size in sizes:
        for _ in range(repeats):
            x = torch.zeros(size // 4, dtype=torch.float32, device=device, requires_grad=True)
            _sync(device)
            with warnings.catch_warnings(), _copy_trace(points if traced else None):
                warnings.simplefilter("ignore")  # "unscheduled region": intended here
                t0 = time.perf_counter()
                y = swap(_sin_of_copy, x)
                manager.synchronize()
                _sync(device)
                t1 = time.perf_counter()
                y.sum().backward()
                _sync(device)
                t2 = time.perf_counter()
            wall["d2h"].append((size, t1 - t0))
            wall["h2d"].append((size, t2 - t1))
            del x, y
    if not traced or not points["d2h"] or not points["h2d"]:
        # The fastest of the repeats per size (the wall times carry the compute's noise).
        return tuple(fit_copy_link([(b, min(t for bb, t in wall[d] if bb == b))
                                    for b in sizes]) for d in ("d2h", "h2d"))
    for direction in points:
        points[direction] += (samples or {}).get(direction, [])
    return fit_copy_link(points["d2h"]), fit_copy_link(points["h2d"])


# A strategy that recomputes runs "none"'s compute plus the recompute, and a swapping one
# its resident twin's compute plus the copies' host work and contention: neither is ever
# faster than the other of its pair. (strategy, its twin), recomputing pairs first so that
# the swapping ones are floored by floored twins.
_RESIDENT_TWIN = (("checkpoint", "none"), ("selective", "none"), ("swap", "none"),
                  ("selective_swap", "selective"), ("checkpoint_swap", "checkpoint"))


def _plain_step(step_fn: Callable[[], object], device: torch.device,
                params: list[nn.Parameter]) -> float:
    """Seconds of one step of the strategy applied now (if any), with no meter and no
    probe (the user's step, as the step clock times it)."""
    clock = step_clock(device)
    try:
        _sync(device)
        start = clock()
        step_fn()
        _sync(device)
        return clock() - start
    finally:
        for p in params:
            p.grad = None


def _remove_instrumentation(run: dict, plain: list[float], probed: list[float]) -> float:
    """Scales every time of one strategy's ``run`` (in place) by the median over the
    rounds of its uninstrumented step over its profiled step of the same round (paired: a
    slow spell of a shared machine moves both), at most 1 (a plain step that noise made
    slower corrects nothing); returns the factor (``ActivationProfile.timing_scales``)."""
    ratios = [a / b for a, b in zip(plain, probed) if a > 0.0 and b > 0.0]
    if not ratios:
        return 1.0
    scale = min(1.0, statistics.median(ratios))
    for c in run["costs"]:
        c.forward_seconds *= scale
        c.backward_seconds *= scale
    run["tail_seconds"] *= scale
    run["outside_seconds"] *= scale
    return scale


def _floor_by_twin(runs: dict) -> None:
    """Per layer, the forward and backward times of a recomputing or swapping strategy
    measured below its twin's are set to the twin's (in place). The planner picks per
    layer whatever was measured fastest, so a swap step that noise made look faster than
    "none" (on a shared 2-core machine the same plan's step moved 6-26 % between two
    measurements) became plans that swap for nothing: at a budget "none" met, 7 of 8
    layers swapped (bench_planner, 2026-12-06); the same for recompute: an unlimited
    budget answered with checkpointed layers and ``explain()`` showing "recompute -23.84
    ms" (tester, session 20). At equal times the planner prefers the strategy that
    recomputes less (``_planner._cpp_profile``). Backward times are net of the engine's
    stalls, which the cost model adds from the link."""
    for swapping, twin in _RESIDENT_TWIN:
        if swapping not in runs or twin not in runs:
            continue
        for c, t in zip(runs[swapping]["costs"], runs[twin]["costs"]):
            c.forward_seconds = max(c.forward_seconds, t.forward_seconds)
            c.backward_seconds = max(c.backward_seconds, t.backward_seconds)


def _typical(runs: list[dict]) -> dict:
    """Several steps of one strategy: bytes of the last one (they are deterministic), each
    time the median over the steps (what a timed run of many steps reports; the least
    would predict every plan faster than it typically runs)."""
    out = dict(runs[-1])
    out["costs"] = [LayerCost(c.kept_bytes, c.offload_bytes,
                              statistics.median(r["costs"][k].forward_seconds for r in runs),
                              statistics.median(r["costs"][k].backward_seconds for r in runs),
                              c.deferred_bytes, c.shared_bytes, c.held_bytes,
                              c.input_bytes, c.output_bytes)
                    for k, c in enumerate(runs[-1]["costs"])]
    for key in ("step_seconds", "tail_seconds", "outside_seconds"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def profile_activation_memory(model: nn.Module, step_fn: Callable[[], object], *,
                              layers=None, candidates=None,
                              repeats: int = 3) -> ActivationProfile:
    """Profiles ``step_fn`` under each candidate strategy (``repeats`` steps each, after
    one warm-up step of ``"none"``; times: the median) and measures the copy link (the
    engine's own copies during the swapping steps and a two-size probe, timed on the
    engine's timeline). Each profiled step is followed by the same strategy's step with no
    instrumentation; each strategy's times are scaled by what the meter and the per-layer
    hooks cost it (``ActivationProfile.timing_scales``). ``step_fn`` runs ``1 + 2 x repeats
    x candidates`` times.

    Args:
        model: the model whose layers will be planned (``nn.Module``).
        step_fn: runs one forward and backward of the real training step, no optimizer
            step. Gradients it accumulates are discarded: every parameter's ``.grad`` is
            as it was before the call when this returns, and so are the buffers (values
            and objects: BatchNorm statistics) and the host's and the device's random
            number generators.
        layers: which modules are the layers (as for :func:`apply_activation_memory`).
        candidates: strategy names to profile (default :data:`DEFAULT_CANDIDATES`);
            ``"none"`` is always profiled. Swapping strategies are dropped when the model
            is on the host and CPU swap is off (nothing could be swapped).
        repeats: measured steps per strategy (times: the median; default 3).

    Returns:
        An :class:`ActivationProfile`. Under ``torch.distributed`` every rank profiles and
        all ranks get the worst figures of all ranks (largest bytes and times, slowest link).

    Raises:
        ValueError: for an unknown candidate or ``layers`` that match nothing; when the
            first step runs none or only some of the layers, runs no backward, runs the
            layers in another order than ``layers`` gives, or runs a layer's forward again
            before its backward (two passes, one backward: gradient accumulation with a
            backward per pass is fine), runs a second backward through one forward
            (``backward(retain_graph=True)`` then another backward), or runs a backward
            that keeps its graph (``retain_graph=True``: every saved tensor would stay
            until the graph is freed; not checked on a torch without
            ``torch._C._autograd._get_current_graph_task_keep_graph``).
        RuntimeError: when ``step_fn`` calls a ``torch.optim`` optimizer's ``step()``
            (stopped before it changes anything), or changes a parameter otherwise (in
            place, through ``.data``, or by replacing it); the model's plan, hooks and
            ``.grad`` are restored before it is raised, as for any error of ``step_fn``, and
            replaced parameters put back, but an update in place outside an optimizer is
            not undone (no copy of the weights is kept).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hyper_parallel: profile_activation_memory expects an nn.Module, got "
                        f"{type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and isinstance(
            model.__dict__.get("_modules", {}).get("_orig_mod"), nn.Module):
        # (a tester: dynamo traced the profiling hooks, breaking the graph at every layer,
        # and the plan's layer names began with "_orig_mod.")
        raise ValueError(
            "hyper_parallel: profile_activation_memory / plan_activation_memory got a "
            "torch.compile'd model: dynamo would trace the profiling hooks and break the "
            "graph at every layer (the timings would not be the compiled step's), and the "
            "plan's layer names would start with '_orig_mod.'. Plan the model before "
            "compiling it (a step_fn that calls the uncompiled model), apply the plan, then "
            "torch.compile the model.")
    if not callable(step_fn):
        raise TypeError("hyper_parallel: step_fn must be a callable running one forward and "
                        "backward, e.g. lambda: model(x).loss.backward()")
    names = check_candidates(candidates)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"hyper_parallel: repeats must be an int >= 1, got {repeats!r}")
    params = list(model.parameters())
    _check_initialized(model, params)
    device = model_device(model)
    if not _can_swap(device):
        dropped = [n for n in names if STRATEGIES[n].swaps]
        names = [n for n in names if not STRATEGIES[n].swaps]
        if dropped and candidates is not None:  # asked for by name: say why they are gone
            warnings.warn(
                f"hyper_parallel: the swapping candidates {dropped} are not planned: the model "
                "is on the host and CPU swap is off, so nothing could be swapped. Turn it on "
                "(SwapManager().set_cpu_swap(True), or HYPER_PARALLEL_CPU_SWAP=1) to plan "
                "them.", UserWarning, stacklevel=2)
    slots = resolve_layer_slots(model, layers)
    check_plannable(model, slots)
    layer_names = [s.name for s in slots]
    runs: dict[str, dict] = {}
    with _left_as_found(model, params, device) as state:
        link_d2h = link_h2d = CopyLink(0.0, 0.0)
        warmup = _run_step(step_fn, model, layer_names, device, params)
        state.check_parameters()
        _check_warmup(warmup, layer_names)
        # The copies of the swapping steps themselves are samples of the link (sizes and
        # contention of the real step), recorded from the engine's timeline.
        samples = {"d2h": [], "h2d": []} if _trace_free() else None
        # Interleaved rounds (one step of every candidate per round): a slow spell of a
        # shared machine then slows every candidate alike instead of all the steps of
        # one, which the planner would then avoid or, worse, prefer (it picks per layer
        # whatever was measured fastest, so noise that favours one strategy biases its
        # plans' predictions low).
        steps: dict[str, list[dict]] = {name: [] for name in names}
        plain: dict[str, list[float]] = {name: [] for name in names}
        failed: dict[str, BaseException] = {}
        for _ in range(repeats):
            for name in [n for n in names if n not in failed]:
                if name != "none":
                    apply_activation_memory(model, name, layers=layer_names)
                try:
                    try:
                        with _copy_trace(samples if STRATEGIES[name].swaps else None) as items:
                            run = _run_step(step_fn, model, layer_names, device, params)
                    except RuntimeError as err:
                        # A strategy this model cannot run (a layer writing its input in
                        # place cannot be recomputed: a tester, session 26, had the whole
                        # plan refused with autograd's error); "none" ran, so the step
                        # itself is sound. The library's refusals of the step stand.
                        if name == "none" or str(err).startswith("hyper_parallel: step_fn"):
                            raise
                        failed[name] = err
                        continue
                    if items is not None:
                        attribute_offloads(run["costs"], items)
                    _settle_kept(run["costs"])
                    _charge_boundaries(run["costs"], STRATEGIES[name].swaps)
                    steps[name].append(run)
                    state.check_parameters()
                    # The same step again with no meter and no probe: what the
                    # instrumentation costs this strategy (ActivationProfile.timing_scales).
                    plain[name].append(_plain_step(step_fn, device, params))
                finally:
                    remove_activation_memory(model)
                state.check_parameters()
        if failed:
            for name, err in failed.items():
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                warnings.warn(
                    f"hyper_parallel: the candidate {name!r} cannot run this step ("
                    f"{type(err).__name__}: {first[:300]}); it is planned without it.",
                    UserWarning, stacklevel=3)
            names = [n for n in names if n not in failed]
        runs = {name: _typical(steps[name]) for name in names}
        timing_scales = {name: _remove_instrumentation(
            runs[name], plain[name], [r["step_seconds"] for r in steps[name]])
            for name in names}
        _floor_by_twin(runs)
        if any(STRATEGIES[n].swaps for n in names):
            typical = max(c.kept_bytes + c.input_bytes for c in runs["none"]["costs"])
            link_d2h, link_h2d = measure_copy_links(device, max(1 << 16, typical),
                                                    samples=samples)
    none = runs["none"]
    # The cost model has one tail (the head's bytes, measured under "none"); what a
    # strategy's tail holds beyond it is saved after the last layer because of that
    # layer's strategy (the caller's auxiliary term of its output): the last layer's.
    # The same for what the caller holds of the head's saves until the backward ends.
    for name in names:
        last = runs[name]["costs"][-1]
        extra = runs[name]["tail_bytes"] - none["tail_bytes"]
        if extra > 0:
            last.kept_bytes += extra
        held = runs[name]["tail_held_bytes"] - none["tail_held_bytes"]
        if held > 0:
            last.held_bytes = min(last.saved_bytes, last.held_bytes + held)
    profile = ActivationProfile(
        layer_names=layer_names,
        strategies=names,
        costs={n: runs[n]["costs"] for n in names},
        base_bytes=none["base_bytes"],
        tail_bytes=none["tail_bytes"],
        tail_held_bytes=none["tail_held_bytes"],
        tail_seconds=none["tail_seconds"],
        outside_seconds=none["outside_seconds"],
        d2h=link_d2h,
        h2d=link_h2d,
        measured={n: {"peak_bytes": runs[n]["peak_bytes"],
                      "step_seconds": runs[n]["step_seconds"]} for n in names},
        output_bytes=none["output_bytes"],
        device=str(device),
        timing_scales=timing_scales,
    )
    _warn_unlike_passes(profile)
    return _worst_over_ranks(profile, device)


#: How far above the cost model's "none" peak the measured one may lie before profiling
#: warns that the step's passes differ (the figures read the first pass).
_UNLIKE_PASSES_RATIO = 1.25


def _warn_unlike_passes(profile: ActivationProfile) -> None:
    """Warns when the measured "none" peak is well above what the per-layer figures (read
    at each layer's first forward and backward) predict: a step whose later passes are
    larger than its first (gradient-accumulation micro-batches of unequal sizes; a
    tester, session 26: a 1 x 8 micro-batch then a 4 x 64 one, every layer planned
    checkpoint_swap where plain checkpointing of three layers met the budget, and the
    plan's explain() 30x below its measured peak, without a word)."""
    from ._planner import predict  # noqa: PLC0415 (the planner imports this module)

    n = len(profile.layer_names)
    predicted = predict(profile, ["none"] * n, offload_window=0)["peak_bytes"]
    measured = profile.none_peak_bytes
    if predicted > 0 and measured > _UNLIKE_PASSES_RATIO * predicted:
        warn_user(
            f"hyper_parallel: the step's peak under 'none' measured {measured} bytes, "
            f"{measured / predicted:.1f}x the {predicted} bytes its layers' first forward and "
            "backward account for: its later passes are larger than its first (micro-batches "
            "of unequal sizes?). The planner reads the first; its plans are measured on the "
            "model before they are returned, but may be slower than needed. Give step_fn its "
            "largest micro-batch first, or one micro-batch of the largest size.")


@contextlib.contextmanager
def _optimizer_steps_refused():
    """Stops any ``torch.optim`` optimizer's ``step()`` called on this thread while
    profiling, before it changes anything (weights or the optimizer's state: momentum
    buffers, Adam's moments and step counts). Before, an ``optimizer.step()`` inside
    ``step_fn`` was seen only after it ran, by the parameters' version counters
    (:meth:`_ModelState.check_parameters`), and its update stayed in the weights. Uses
    torch's global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``),
    which every ``torch.optim.Optimizer`` subclass runs before its ``step``; an optimizer
    outside ``torch.optim``'s base class is still caught after the fact by the checks.
    Other threads' optimizers are not touched."""
    import threading

    from torch.optim import optimizer as optim_module

    register = getattr(optim_module, "register_optimizer_step_pre_hook", None)
    if register is None:  # a torch without global optimizer hooks: the checks remain
        yield
        return
    thread = threading.get_ident()

    def refuse(opt, args, kwargs):
        if threading.get_ident() != thread:
            return None
        raise RuntimeError(
            f"hyper_parallel: step_fn called {type(opt).__name__}.step(); it was stopped "
            "before it changed anything (the weights and the optimizer's state are as they "
            "were). plan_activation_memory runs step_fn several times to profile it and "
            "must leave the weights as they are: pass a step that only runs the forward "
            "and backward, e.g. lambda: model(**batch).loss.backward(), and step the "
            "optimizer outside.")

    handle = register(refuse)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _left_as_found(model: nn.Module, params: list[nn.Parameter], device: torch.device):
    """Runs the enclosed profiling steps on ``model`` with no strategy applied and the
    engine's offload window off, then leaves everything as it was: gradients, buffers,
    random number generators, the window, and the user's own application (with its
    options). Yields the :class:`_ModelState` (``check_parameters()`` after each step)."""
    with suspended_application(model):  # the user's own, put back as it was
        state = _ModelState(model, params, device)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        # The cost model's schedule submits every offload at its release point: profile
        # with the engine's offload window off, or a slow link would keep released layers
        # on the device and move their offload bytes to later layers' counters.
        window = _C.offload_window()
        _C.set_offload_window(0)
        try:
            with state.outside.watching(), _optimizer_steps_refused():
                yield state
        finally:
            remove_activation_memory(model)  # first: it restores what its apply replaced
            _C.set_offload_window(window)
            state.restore()
            for p, g in zip(params, grads):
                p.grad = g


def measure_plan(model: nn.Module, step_fn: Callable[[], object], plan, *,
                 steps: int = 2) -> dict:
    """Runs ``step_fn`` ``steps`` times (default 2: the first teaches the engine which
    layer ends the prefetch chain) with ``plan`` applied and measures the last step:
    ``{"peak_bytes": int, "step_seconds": float}``, the peak of saved activations as
    :func:`saved_activation_memory` counts it and the step's wall time (on the CPU less
    the time the thread waited for a CPU another process held: ``_clock``). The model is left
    as :func:`profile_activation_memory` leaves it (gradients, buffers, random number
    generators, the user's own application).

    ``plan``: what :func:`apply_activation_memory` takes (a strategy name, a list, a dict
    by layer index or name, an :class:`ActivationPlan`), applied to the layers
    :func:`find_layers` gives, or to the layers a plan's names give where they are others.

    Raises:
        ValueError: for ``steps`` < 1 or a plan :func:`apply_activation_memory` refuses.
        RuntimeError: when ``step_fn`` changes a parameter in place.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"hyper_parallel: steps must be an int >= 1, got {steps!r}")
    params = list(model.parameters())
    _check_initialized(model, params)
    device = model_device(model)
    # (the layers apply gives the plan, named for the probe: a tester, session 26,
    # had "checkpoint" read as the layers 'c', 'h', ...)
    layer_names = plan_layer_names(model, plan, plain_dicts=True) or find_layers(model)
    with _left_as_found(model, params, device) as state:
        apply_activation_memory(model, plan, layers=layer_names)
        for _ in range(steps):
            run = _run_step(step_fn, model, layer_names, device, params)
            state.check_parameters()
    return {"peak_bytes": run["peak_bytes"], "step_seconds": run["step_seconds"]}


def _worst_over_ranks(profile: ActivationProfile, device: torch.device) -> ActivationProfile:
    """Under torch.distributed: every figure becomes its maximum over the ranks (the
    slowest link, the largest bytes and times), so that every rank plans from the same
    numbers."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return profile
    values: list[float] = [profile.base_bytes, profile.tail_bytes, profile.tail_held_bytes,
                           profile.tail_seconds,
                           profile.outside_seconds, profile.d2h.latency_seconds,
                           profile.d2h.seconds_per_byte, profile.h2d.latency_seconds,
                           profile.h2d.seconds_per_byte]
    for name in profile.strategies:
        for c in profile.costs[name]:
            values += [c.kept_bytes, c.offload_bytes, c.deferred_bytes, c.shared_bytes,
                       c.held_bytes, c.input_bytes, c.output_bytes, c.forward_seconds,
                       c.backward_seconds]
        values += [profile.measured[name]["peak_bytes"], profile.measured[name]["step_seconds"]]
    values += profile.output_bytes
    on = device if dist.get_backend() != "gloo" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = iter(t.cpu().tolist())
    profile.base_bytes, profile.tail_bytes = int(next(v)), int(next(v))
    profile.tail_held_bytes = int(next(v))
    profile.tail_seconds, profile.outside_seconds = next(v), next(v)
    profile.d2h = CopyLink(next(v), next(v))
    profile.h2d = CopyLink(next(v), next(v))
    for name in profile.strategies:
        for c in profile.costs[name]:
            (c.kept_bytes, c.offload_bytes, c.deferred_bytes, c.shared_bytes, c.held_bytes,
             c.input_bytes, c.output_bytes) = (int(next(v)) for _ in range(7))
            c.forward_seconds, c.backward_seconds = next(v), next(v)
        profile.measured[name] = {"peak_bytes": int(next(v)), "step_seconds": next(v)}
    profile.output_bytes = [int(next(v)) for _ in profile.output_bytes]
    profile.world_size = dist.get_world_size()
    return profile
