"""The planner: per-layer strategies under a byte budget (docs/design.md, "Planner").

:func:`plan_activation_memory` profiles a few steps (:mod:`._profile`), hands the figures
to the C++ optimizer (``csrc/hyper_parallel/planner``: cost model of the SPEC 3 schedule,
exact dynamic program) and returns an :class:`ActivationPlan`, which
:func:`apply_activation_memory` applies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from hyper_parallel._extension import _C

from ._apply import STRATEGIES
from ._profile import (ActivationProfile, check_candidates, measure_plan, model_device,
                       profile_activation_memory)
from ._swap_manager import MAX_ENGINE_SETTING, SwapManager

_MiB = 1 << 20


def _fmt_bytes(n: float) -> str:
    return f"{n / _MiB:.2f} MiB"


@dataclass(frozen=True)
class PlanRow:
    """One layer of an :class:`ActivationPlan` (bytes, seconds)."""

    name: str
    strategy: str
    saved_bytes: int          # kept on the device from forward to backward
    offloaded_bytes: int      # copied to the host and back
    recomputed_bytes: int     # saved by "none" but neither kept nor offloaded
    added_seconds: float      # forward + backward time over "none" (copy stalls excluded)
    why: str


@dataclass
class ActivationPlan:
    """A per-layer activation-memory plan and what the cost model predicts for it.

    Attributes:
        strategies: fully qualified layer name -> strategy (what
            :func:`apply_activation_memory` reads).
        budget_bytes: the budget it was planned for.
        predicted_peak_bytes / predicted_step_seconds: the plan's predictions.
        none_peak_bytes / none_step_seconds: the predictions for "none".
        predicted_offload_bytes: bytes copied to the host (and back) per step; also
            the predicted host peak (all of them are on the host when the forward ends).
        predicted_stall_seconds: time the step waits for copies.
        rows: one :class:`PlanRow` per layer, forward order.
        prefetch_depth: the engine's prefetch depth the plan was solved for;
            :func:`apply_activation_memory` sets ``SwapManager().set_prefetch_depth`` to it.
        offload_window: the engine's offload window the cost model describes (0: every
            release point submits its offload at once, SPEC 3's schedule);
            :func:`apply_activation_memory` sets the engine to it. (With the default
            window of 2 and a link slower than the forwards, released layers wait on the
            device and those still waiting at the turn are never offloaded: more peak
            bytes than planned, measured 7.0 MiB for a 5.4 MiB budget at offload = 2x
            forward in bench_planner.py.)
        host_budget_bytes: the host budget it was planned for (``None``: unbounded).
        exact: whether the optimizer proved it the fastest plan of the cost model within
            the budgets (``False``: its exact search grew too large, copies saturating the
            link over many heterogeneous layers, and the heuristic of ``Planner.h``
            answered; or the prefetch depth is >= 2; or the solver's plan measured over
            the budget on the model and :func:`plan_activation_memory`'s closed loop chose
            another, solved for a lowered budget or uniform; the plan still meets the
            budgets).
        lower_bound_seconds: a proven lower bound of the fastest predicted step within the
            budgets (seconds; for an exact plan its own time, after the fallback the
            optimum of the relaxation of ``Planner.h``), so the plan is at most
            ``predicted_step_seconds / lower_bound_seconds - 1`` slower than the optimum
            of the cost model; ``None`` where none is known (prefetch depth >= 2).
        measured_peak_bytes / measured_step_seconds: what the plan measured when
            :func:`plan_activation_memory` ran it on the model (bytes, seconds; the
            largest over ranks); ``None`` for a plan solved from a profile alone.
    """

    strategies: dict[str, str]
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_seconds: float
    none_peak_bytes: int
    none_step_seconds: float
    predicted_offload_bytes: int = 0
    predicted_stall_seconds: float = 0.0
    rows: list[PlanRow] = field(default_factory=list)
    prefetch_depth: int = 1
    offload_window: int = 0
    host_budget_bytes: int | None = None
    exact: bool = True
    lower_bound_seconds: float | None = None
    measured_peak_bytes: int | None = None
    measured_step_seconds: float | None = None

    def explain(self) -> str:
        """A table: per layer, the choice, saved / offloaded / recomputed bytes, the time
        it adds and why; then the totals against "none"."""
        head = ("layer", "strategy", "saved", "offloaded", "recomputed", "+time", "why")
        rows = [head] + [(r.name, r.strategy, _fmt_bytes(r.saved_bytes),
                          _fmt_bytes(r.offloaded_bytes), _fmt_bytes(r.recomputed_bytes),
                          f"{r.added_seconds * 1e3:+.2f} ms", r.why) for r in self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        bound = ""
        if not self.exact and self.lower_bound_seconds:
            gap = self.predicted_step_seconds / self.lower_bound_seconds - 1
            bound = f"; proven within {gap:.2%} of the optimum"
        ratio = self.predicted_step_seconds / self.none_step_seconds \
            if self.none_step_seconds > 0 else float("nan")
        lines.append(
            f"predicted peak {_fmt_bytes(self.predicted_peak_bytes)} (budget "
            f"{_fmt_bytes(self.budget_bytes)}, none {_fmt_bytes(self.none_peak_bytes)}); "
            f"step {self.predicted_step_seconds * 1e3:.1f} ms ({ratio:.3f}x none's "
            f"{self.none_step_seconds * 1e3:.1f} ms), of which copy stalls "
            f"{self.predicted_stall_seconds * 1e3:.1f} ms; "
            f"{_fmt_bytes(self.predicted_offload_bytes)} to the host per step"
            + (f" (host budget {_fmt_bytes(self.host_budget_bytes)})"
               if self.host_budget_bytes is not None else "")
            + f"; solved for prefetch depth {self.prefetch_depth}"
            + ("" if self.exact else f" (not proven optimal{bound})"))
        if self.measured_peak_bytes is not None:
            lines.append(f"measured on the model: peak {_fmt_bytes(self.measured_peak_bytes)}"
                         + (f", step {self.measured_step_seconds * 1e3:.1f} ms"
                            if self.measured_step_seconds is not None else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ActivationPlan:
        """The plan :meth:`to_json` wrote.

        Every field is checked at load: strategies a dict of layer name -> per-layer
        strategy name; byte counts, ``prefetch_depth`` and ``offload_window`` ints >= 0;
        seconds finite and >= 0 (a row's ``added_seconds`` finite, of either sign); the
        rows, when given, one per layer of ``strategies`` in its order, with its strategy.

        Raises:
            ValueError: when ``text`` is not such a plan (the message names the bad
                field), or names an unknown strategy.
        """
        try:
            d = json.loads(text)
        except (TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"hyper_parallel: not an ActivationPlan JSON ({err}); pass the "
                             "text ActivationPlan.to_json() wrote") from None
        if not isinstance(d, dict):
            _bad_json(f"the top level is {type(d).__name__}, not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and n not in d]
        unknown = sorted(set(d) - set(fields))
        if missing or unknown:
            _bad_json(", ".join(([f"missing fields {missing}"] if missing else [])
                                + ([f"unknown fields {unknown}"] if unknown else [])))
        strategies = d["strategies"]
        if not isinstance(strategies, dict):
            _bad_json(f"field 'strategies' is {type(strategies).__name__}, not an object "
                      "{layer name: strategy}")
        bad = sorted({repr(v) for v in strategies.values()
                      if not isinstance(v, str) or v not in STRATEGIES or v == "mixed"})
        if bad:
            raise ValueError(f"hyper_parallel: not an ActivationPlan JSON: field 'strategies' "
                             f"names unknown strategies [{', '.join(bad)}]; choose from "
                             f"{', '.join(n for n in STRATEGIES if n != 'mixed')}")
        for name in ("budget_bytes", "predicted_peak_bytes", "none_peak_bytes",
                     "predicted_offload_bytes", "prefetch_depth", "offload_window"):
            if name in d:
                _check_int(d[name], name)
        for name in ("prefetch_depth", "offload_window"):  # what the engine takes
            if name in d and d[name] > MAX_ENGINE_SETTING:
                raise ValueError(f"hyper_parallel: not an ActivationPlan JSON: field {name!r} "
                                 f"must be at most 2**20, got {d[name]}")
        for name in ("host_budget_bytes", "measured_peak_bytes"):
            if d.get(name) is not None:
                _check_int(d[name], name)
        for name in ("predicted_step_seconds", "none_step_seconds", "predicted_stall_seconds"):
            if name in d:
                _check_float(d[name], name)
        for name in ("lower_bound_seconds", "measured_step_seconds"):
            if d.get(name) is not None:
                _check_float(d[name], name)
        if "exact" in d and not isinstance(d["exact"], bool):
            _bad_json(f"field 'exact' is {d['exact']!r}, not true or false")
        rows = d.get("rows", [])
        if not isinstance(rows, list):
            _bad_json(f"field 'rows' is {type(rows).__name__}, not a list")
        d = dict(d, rows=[_row(r, i) for i, r in enumerate(rows)])
        # The rows are the table explain() prints: one per layer of the plan, in its order,
        # each with the layer's strategy (tester, session 20: rows contradicting the
        # strategies loaded, and explain() described another plan than the one applied).
        if d["rows"] and [(r.name, r.strategy) for r in d["rows"]] != list(strategies.items()):
            _bad_json("field 'rows' does not match field 'strategies' (one row per layer, in "
                      "the same order, with the same strategy; a plan edited by hand: set "
                      "'rows' to [] so that explain() does not describe another plan)")
        return cls(**d)


def _bad_json(what: str):
    raise ValueError(f"hyper_parallel: not an ActivationPlan JSON: {what}; pass the text "
                     "ActivationPlan.to_json() wrote")


def _check_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_BYTES:
        _bad_json(f"field {name!r} is {value!r}, not an int >= 0")


def _check_float(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        _bad_json(f"field {name!r} is {value!r}, not a finite number of seconds >= 0")


def _row(r, i: int) -> PlanRow:
    what = f"rows[{i}]"
    if not isinstance(r, dict):
        _bad_json(f"field {what!r} is {type(r).__name__}, not an object")
    names = [f.name for f in dataclasses.fields(PlanRow)]
    if sorted(r) != sorted(names):
        _bad_json(f"field {what!r} has fields {sorted(r)}, expected {sorted(names)}")
    for name in ("name", "strategy", "why"):
        if not isinstance(r[name], str):
            _bad_json(f"field '{what}.{name}' is {r[name]!r}, not a string")
    if r["strategy"] not in STRATEGIES or r["strategy"] == "mixed":
        _bad_json(f"field '{what}.strategy' is {r['strategy']!r}, not a per-layer strategy")
    for name in ("saved_bytes", "offloaded_bytes", "recomputed_bytes"):
        _check_int(r[name], f"{what}.{name}")
    # added_seconds is a difference over "none": it may be negative, but finite.
    a = r["added_seconds"]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        _bad_json(f"field '{what}.added_seconds' is {a!r}, not a finite number of seconds")
    return PlanRow(**r)


class InfeasibleBudgetError(ValueError):
    """No plan of the candidates meets the budget.

    Attributes:
        budget_bytes: the budget asked for.
        min_peak_bytes: the smallest predicted peak some plan reaches (within the host
            budget, if one was given); ``None`` when no plan meets the host budget. From
            :func:`plan_activation_memory` (which runs plans on the model), the smallest
            peak measured on the model: over the plans it ran, the cost model's least-peak
            plan and the uniform plans the profile measured, so that planning again at it
            is answered.
        plan: the fastest plan at that peak (an :class:`ActivationPlan`; from
            :func:`plan_activation_memory` with ``measured_peak_bytes`` set), or ``None``.
        host_budget_bytes: the host budget asked for (``None``: unbounded).
        min_peak_bound_bytes: a lower bound of the smallest peak the cost model proves: no
            plan is predicted below it. Equal to ``min_peak_bytes`` where that is proven the
            least (always without a host budget); under a host budget the least peak is a
            knapsack problem, whose exact search stops at a label limit (Planner.h,
            ``min_peak``), and the two may differ by a fraction of a percent. From
            :func:`plan_activation_memory`, at most the smallest peak measured (the model
            can differ from its prediction; see ``min_peak_bytes``).
    """

    def __init__(self, message: str, budget_bytes: int, min_peak_bytes: int | None,
                 plan: ActivationPlan | None, host_budget_bytes: int | None = None,
                 min_peak_bound_bytes: int | None = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.plan = plan
        self.host_budget_bytes = host_budget_bytes
        self.min_peak_bound_bytes = min_peak_bytes if min_peak_bound_bytes is None \
            else min_peak_bound_bytes


# ------------------------------------------------------------------------ cost model
def _depth(prefetch_depth: int | None) -> int:
    if prefetch_depth is None:
        return SwapManager().get_prefetch_depth()
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) \
            or not 0 <= prefetch_depth <= MAX_ENGINE_SETTING:
        raise ValueError(f"hyper_parallel: prefetch_depth must be an int in [0, 2**20] (layers "
                         f"reloaded ahead), got {prefetch_depth!r}")
    return prefetch_depth


def _window(offload_window: int | None) -> int:
    if offload_window is None:
        return int(_C.offload_window())
    if isinstance(offload_window, bool) or not isinstance(offload_window, int) \
            or not 0 <= offload_window <= MAX_ENGINE_SETTING:
        raise ValueError(f"hyper_parallel: offload_window must be an int in [0, 2**20] "
                         f"(invocations with D2H copies in flight; 0: no limit), got "
                         f"{offload_window!r}")
    return offload_window


# Ties between a strategy that recomputes and one that does not (equal measured times: the
# profile floors a recomputing strategy's times at "none"'s, _profile._floor_by_twin) go to
# the one that recomputes less: its backward is charged this many seconds per byte it
# recomputes (1 us per GB, far below any measured difference; as the planner's
# kTrafficSecondsPerByte for host traffic). Without it the one that keeps fewer bytes
# dominates at equal time, and an unlimited budget was answered with checkpointed layers.
_RECOMPUTE_TIE_SECONDS_PER_BYTE = 1e-15


def _recompute_tie(profile: ActivationProfile, s: str, k: int) -> float:
    if not STRATEGIES[s].recomputes or "none" not in profile.costs:
        return 0.0
    # (each with the storage of its input, as if the layer before saved none of it)
    recomputed = profile.kept_in_plan(k, "none", None) - profile.kept_in_plan(k, s, None) \
        - profile.costs[s][k].offload_bytes
    return _RECOMPUTE_TIE_SECONDS_PER_BYTE * max(0, recomputed)


def _cpp_profile(profile: ActivationProfile, prefetch_depth: int = 1, offload_window: int = 0):
    p = _C.PlannerProfile()
    p.prefetch_depth = int(prefetch_depth)
    p.offload_window = int(offload_window)
    p.options = list(profile.strategies)
    p.layers = [[_C.PlannerOptionCost(c.kept_bytes, c.offload_bytes, c.forward_seconds,
                                      c.backward_seconds + _recompute_tie(profile, s, k),
                                      deferred_bytes=c.deferred_bytes,
                                      shared_bytes=c.shared_bytes, held_bytes=c.held_bytes,
                                      input_bytes=c.input_bytes, output_bytes=c.output_bytes)
                 for s, c in ((s, profile.costs[s][k]) for s in profile.strategies)]
                for k in range(len(profile.layer_names))]
    p.base_bytes = int(profile.base_bytes)
    p.tail_bytes = int(profile.tail_bytes)
    p.tail_held_bytes = int(profile.tail_held_bytes)
    p.outside_seconds = float(profile.outside_seconds)
    p.tail_seconds = float(profile.tail_seconds)
    p.set_links(profile.d2h.latency_seconds, profile.d2h.seconds_per_byte,
                profile.h2d.latency_seconds, profile.h2d.seconds_per_byte)
    return p


def predict(profile: ActivationProfile, strategies: Sequence[str] | dict, *,
            prefetch_depth: int | None = None, offload_window: int | None = None) -> dict:
    """The cost model's prediction for a plan (one strategy per layer, or a dict from layer
    name to strategy; unlisted layers "none") at ``prefetch_depth`` and ``offload_window``
    (defaults: the engine's current settings; an :class:`ActivationPlan` runs at window
    0, and so do the profile's measured steps): ``peak_bytes``, ``step_seconds``,
    ``stall_seconds``, ``offload_bytes`` (bytes copied each way per step),
    ``host_peak_bytes``.

    Raises:
        ValueError: a strategy that was not profiled, or a negative or non-int depth or
            window.
    """
    if isinstance(strategies, dict):
        strategies = [strategies.get(n, "none") for n in profile.layer_names]
    index = {s: i for i, s in enumerate(profile.strategies)}
    missing = sorted({s for s in strategies if s not in index})
    if missing:
        raise ValueError(f"hyper_parallel: strategies {missing} were not profiled (profiled: "
                         f"{', '.join(profile.strategies)})")
    return dict(_C.planner_evaluate(
        _cpp_profile(profile, _depth(prefetch_depth), _window(offload_window)),
        [index[s] for s in strategies]))


def _plan(profile: ActivationProfile, assignment: list[int], prediction: dict,
          budget: int, depth: int, host_budget: int | None, stats: dict | None = None) \
        -> ActivationPlan:
    names = [profile.strategies[i] for i in assignment]
    none = predict(profile, ["none"] * len(names), prefetch_depth=depth, offload_window=0)
    n = len(names)
    rows = []
    for k, (layer, s) in enumerate(zip(profile.layer_names, names)):
        c, base = profile.costs[s][k], profile.costs["none"][k]
        prev = names[k - 1] if k > 0 else None
        kept, off = profile.kept_in_plan(k, s, prev), c.group_bytes
        base_kept = profile.kept_in_plan(k, "none", prev)
        if k == n - 1:
            kept, off = kept + off, 0
        recomputed = max(0, base_kept - kept - off) if STRATEGIES[s].recomputes else 0
        added = (c.forward_seconds + c.backward_seconds) - (base.forward_seconds
                                                             + base.backward_seconds)
        rows.append(PlanRow(layer, s, int(kept), int(off), int(recomputed), float(added),
                            _why(profile, k, s, kept, off, added, n, base_kept)))
    return ActivationPlan(
        strategies=dict(zip(profile.layer_names, names)),
        budget_bytes=int(budget),
        predicted_peak_bytes=int(prediction["peak_bytes"]),
        predicted_step_seconds=float(prediction["step_seconds"]),
        none_peak_bytes=int(none["peak_bytes"]),
        none_step_seconds=float(none["step_seconds"]),
        predicted_offload_bytes=int(prediction["offload_bytes"]),
        predicted_stall_seconds=float(prediction["stall_seconds"]),
        rows=rows,
        prefetch_depth=int(depth),
        host_budget_bytes=None if host_budget is None else int(host_budget),
        exact=bool((stats or {}).get("exact", False)),  # no solver stats: not proven
        lower_bound_seconds=_finite((stats or {}).get("lower_bound_seconds")),
    )


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _why(profile: ActivationProfile, k: int, s: str, kept: int, off: int, added: float,
         n: int, base_kept: int) -> str:
    freed = base_kept - kept  # base_kept: what "none" keeps there, after the same layer
    if s == "none":
        return "fits: everything stays on the device"
    if k == n - 1 and STRATEGIES[s].swaps and not STRATEGIES[s].recomputes:
        return "last layer: its bytes stay on the device (its backward runs first)"
    parts = [f"frees {_fmt_bytes(freed)}"]
    if off:
        copy = profile.d2h.seconds(off)
        window = profile.costs["none"][k + 1].forward_seconds if k + 1 < n else 0.0
        parts.append(f"offload {copy * 1e3:.2f} ms vs next forward {window * 1e3:.2f} ms")
    if STRATEGIES[s].recomputes:
        parts.append(f"recompute {added * 1e3:+.2f} ms")
    return ", ".join(parts)


def plan_from_profile(profile: ActivationProfile, budget_bytes: int, *,
                      candidates: Sequence[str] | None = None,
                      prefetch_depth: int | None = None,
                      host_budget_bytes: int | None = None,
                      model: nn.Module | None = None,
                      step_fn: Callable[[], object] | None = None) -> ActivationPlan:
    """The fastest plan within ``budget_bytes`` from a profile (no model run, unless
    ``model`` and ``step_fn`` are given).

    Args:
        profile: what :func:`profile_activation_memory` measured.
        budget_bytes: the largest peak of saved-activation bytes on the device (int).
        candidates: the strategies to choose from (profiled ones; default: all of them);
            an empty list is refused.
        prefetch_depth: the engine's prefetch depth to plan for (default: the current
            ``SwapManager().get_prefetch_depth()``); the plan records it.
        host_budget_bytes: the most bytes the plan's offloads may hold on the host (int;
            ``None``: unbounded). Predicted host bytes are payload bytes: a
            :class:`PinnedMemoryPool` rounds blocks up to size classes (at most 25 %
            more), so leave that headroom below its ``max_host_bytes``.
        model, step_fn: the profiled model and step (both or neither): the plan is then
            run on the model and solved again while it measures over the budget, as
            :func:`plan_activation_memory` does (one process; its ``measured_*`` fields
            set).

    Raises:
        InfeasibleBudgetError: when no plan of the candidates meets the budgets.
        ValueError: for a bad budget, candidate or depth.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"hyper_parallel: budget_bytes must be a positive int number of bytes, "
                         f"got {budget_bytes!r} (parse_budget turns '300MiB' or a fraction of "
                         "none's peak into bytes)")
    if host_budget_bytes is not None and (isinstance(host_budget_bytes, bool) or not isinstance(
            host_budget_bytes, int) or host_budget_bytes < 0):
        raise ValueError(f"hyper_parallel: host_budget_bytes must be None or an int number of "
                         f"bytes >= 0, got {host_budget_bytes!r}")
    if (model is None) != (step_fn is None):
        raise ValueError("hyper_parallel: plan_from_profile needs model and step_fn together "
                         "(to run its plan on the model) or neither")
    if model is not None:
        # The loop's first solve checks the remaining arguments before any step runs.
        return _closed_loop(
            budget_bytes,
            lambda target: plan_from_profile(profile, target, candidates=candidates,
                                             prefetch_depth=prefetch_depth,
                                             host_budget_bytes=host_budget_bytes),
            lambda plan: _measured(plan, model, step_fn, budget_bytes),
            profile.strategies,
            lambda: _uniform_measured(profile, budget_bytes, candidates,
                                      _depth(prefetch_depth), host_budget_bytes))
    depth = _depth(prefetch_depth)
    candidates = _nonempty(candidates)
    names = check_candidates(candidates) if candidates is not None else profile.strategies
    unprofiled = [c for c in names if c not in profile.strategies]
    if unprofiled:
        raise ValueError(f"hyper_parallel: candidates {unprofiled} were not profiled; profile "
                         "them first (candidates= of profile_activation_memory)")
    mask = sum(1 << i for i, s in enumerate(profile.strategies) if s in names)
    allowed = [mask] * len(profile.layer_names)
    host = -1 if host_budget_bytes is None else int(host_budget_bytes)
    planner = _C.Planner(_cpp_profile(profile, depth))
    found = planner.solve(int(budget_bytes), allowed, host)
    if found is not None:
        return _plan(profile, found[0], found[1], budget_bytes, depth, host_budget_bytes,
                     found[2])
    host_text = "" if host_budget_bytes is None else \
        f" and its host bytes within {_fmt_bytes(host_budget_bytes)} ({host_budget_bytes} bytes)"
    low = planner.min_peak(allowed, host)
    if low is None:  # only a host budget can make every device budget infeasible
        raise InfeasibleBudgetError(
            f"hyper_parallel: no plan of the candidates ({', '.join(names)}) keeps its host "
            f"bytes within {_fmt_bytes(host_budget_bytes)} ({host_budget_bytes} bytes) "
            "whatever the device budget. Raise host_budget_bytes.",
            int(budget_bytes), None, None, host_budget_bytes)
    plan = _plan(profile, low[0], low[1], budget_bytes, depth, host_budget_bytes, low[2])
    choice = ", ".join(f"{k}: {n}" for k, n in _counts(plan).items())
    # Under a host budget the least peak is a knapsack problem; where its exact search was
    # cut off, the least found stands with the proven bound below it (Planner.h, min_peak).
    bound = int(low[2].get("least_peak_bound_bytes", plan.predicted_peak_bytes))
    least = "the smallest reachable is" if bound >= plan.predicted_peak_bytes else (
        f"no plan peaks below {_fmt_bytes(bound)} ({bound} bytes) and the smallest found is")
    raise InfeasibleBudgetError(
        f"hyper_parallel: no plan of the candidates ({', '.join(names)}) keeps the peak of "
        f"saved activations within {_fmt_bytes(budget_bytes)} ({budget_bytes} bytes)"
        f"{host_text} at prefetch depth {depth}; {least} "
        f"{_fmt_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes} bytes) with "
        f"{choice} (error.plan). Raise the budget"
        + (", raise host_budget_bytes" if host_budget_bytes is not None else "")
        + _more_candidates(names, profile) + ", or shrink the batch.",
        int(budget_bytes), plan.predicted_peak_bytes, plan, host_budget_bytes,
        min(bound, plan.predicted_peak_bytes))


#: Per-layer strategies from the least device memory to the most (what to suggest).
_SUGGEST = ("checkpoint_swap", "checkpoint", "selective_swap", "swap", "selective")


def _more_candidates(names: Sequence[str], profile: ActivationProfile | None = None) -> str:
    """The infeasible error's advice on candidates: only ones not already given and able
    to run. A profile of the host made with CPU swap off has none of the swapping ones
    (profiling drops them): the advice is to turn it on (a tester, session 27, was told to
    add checkpoint_swap, then, having done so, the same error again)."""
    swap_off = profile is not None and torch.device(profile.device).type == "cpu" \
        and not SwapManager().cpu_swap_enabled() \
        and not any(STRATEGIES[s].swaps for s in profile.strategies if s in STRATEGIES)
    more = [c for c in _SUGGEST if c not in names and not (swap_off and STRATEGIES[c].swaps)]
    out = f", allow more candidates (e.g. {', '.join(more[:2])})" if more else ""
    if swap_off:
        out += (", turn CPU swap on to plan the swapping strategies (SwapManager()."
                "set_cpu_swap(True) or HYPER_PARALLEL_CPU_SWAP=1: with it off, tensors in host "
                "memory are never offloaded)")
    elif any(STRATEGIES[n].swaps for n in names if n in STRATEGIES):
        out += ", lower the prefetch depth"
    return out


def _nonempty(candidates):
    """``candidates`` as a list (``None`` stays ``None``); refuses an empty one."""
    if candidates is None or isinstance(candidates, str):
        return candidates
    try:
        candidates = list(candidates)
    except TypeError:
        raise TypeError(f"hyper_parallel: candidates must be a list of strategy names, got "
                        f"{type(candidates).__name__}") from None
    if not candidates:
        raise ValueError("hyper_parallel: candidates is empty, so there is nothing to choose "
                         "from but 'none'; pass strategies such as ['checkpoint', 'swap'], or "
                         "None for all of them")
    return candidates


def _counts(plan: ActivationPlan) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in plan.strategies.values():
        out[s] = out.get(s, 0) + 1
    return out


# ------------------------------------------------------------------------ budgets
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_budget(text: str | int | float, none_peak_bytes: int | None = None, *,
                 name: str = "budget", fractions: bool = True, zero: bool = False) -> int:
    """Bytes from ``"300MiB"``, ``"2GB"``, ``"123456"``, ``"1.5e9"`` or a fraction of
    "none"'s peak (``"0.4"`` or ``0.4``: a number in (0, 1] written with a point or an
    exponent, which needs ``none_peak_bytes``). Any other number without a unit (or with
    ``B``), string or float alike, is bytes and must be a whole number (``"1.5"`` and
    ``1.5`` are both refused; ``"1.5MiB"`` is 1572864 bytes).

    ``name``: what the messages call the value (``"host_budget_bytes"``). ``fractions=False``:
    sizes only (a host budget: "0.4" is refused, and the messages offer no fraction).
    ``zero=True``: 0 bytes is a size (in any unit, ``0`` and ``"0B"`` alike).

    Raises:
        ValueError: for anything else: not a number or size, NaN or infinite, zero or
            negative, a fraction of bytes, more than 2**63 - 1 bytes; a fraction without
            ``none_peak_bytes``.
    """
    # numbers.Integral / Real: NumPy's scalars too (np.int64 from a computed budget)
    offer = " or a fraction of none's peak (0.4)" if fractions else ""
    if isinstance(text, bool) or not isinstance(text, (numbers.Real, str)):
        raise ValueError(f"hyper_parallel: {name} {text!r} is not a size; pass bytes (an "
                         f"int), a size string (300MiB, 2GB){offer}")
    if isinstance(text, numbers.Integral):
        # exact: through a float, ints near 2**63 rounded past the limit and were refused
        # with a message naming that very limit (a tester, session 27)
        nbytes = int(text)
        if zero and nbytes == 0:
            return 0
        if nbytes <= 0:
            raise ValueError(f"hyper_parallel: {name} {text!r} must be a "
                             f"{'non-negative' if zero else 'positive'}, finite size")
        if nbytes > _MAX_BYTES:
            raise ValueError(f"hyper_parallel: {name} {text!r} must be between 1 byte and "
                             f"{_MAX_BYTES} bytes")
        return nbytes
    if isinstance(text, numbers.Real):
        value = float(text)
        unit, fraction = "", 0 < value <= 1
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"hyper_parallel: {name} {text!r} is neither a fraction of none's peak (e.g. "
                "0.4) nor a size (e.g. 300MiB, 2GB, 123456)" if fractions else
                f"hyper_parallel: {name} {text!r} is not a size (e.g. 300MiB, 2GB, 123456)")
        value, unit = float(m.group(1)), m.group(2).lower()
        fraction = unit == "" and 0 < value <= 1 and any(c in m.group(1) for c in ".eE")
    if zero and value == 0:
        return 0
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"hyper_parallel: {name} {text!r} must be a "
                         f"{'non-negative' if zero else 'positive'}, finite size")
    if fraction:
        if not fractions:
            raise ValueError(f"hyper_parallel: {name} {text!r} reads as a fraction, and "
                             f"{name} is a size; pass bytes (an int) or a size string (8GiB)")
        if none_peak_bytes is None:
            raise ValueError(f"hyper_parallel: {name} {text!r} reads as a fraction, and a "
                             "fraction needs none's measured peak, not known here; pass "
                             "bytes (an int) or a size string (8GiB)")
        return max(1, int(value * none_peak_bytes))
    nbytes = value * _UNITS[unit]
    if unit in ("", "b") and not value.is_integer():  # the same rule for str and float
        raise ValueError(f"hyper_parallel: {name} {text!r} is neither a fraction of none's "
                         "peak (a number in (0, 1]) nor a whole number of bytes" if fractions
                         else f"hyper_parallel: {name} {text!r} is not a whole number of bytes")
    if nbytes < 1 or nbytes > _MAX_BYTES:
        raise ValueError(f"hyper_parallel: {name} {text!r} must be between 1 byte and "
                         f"{_MAX_BYTES} bytes")
    return int(text) if isinstance(text, int) else int(nbytes)


_MAX_BYTES = 2**63 - 1


# ------------------------------------------------------------------------ public entry
def plan_activation_memory(model: nn.Module, step_fn: Callable[[], object], budget_bytes, *,
                           layers=None, candidates=None, host_budget_bytes=None,
                           prefetch_depth: int | None = None) -> ActivationPlan:
    """Chooses a strategy per layer so that the step's peak of saved activations stays
    within ``budget_bytes`` at the least predicted step time.

    Profiles ``step_fn`` a few times on the model's device (one warm-up step of "none"
    and three steps per candidate strategy, in interleaved rounds, each followed by the
    same step without instrumentation; see :func:`profile_activation_memory`), then
    solves exactly, in C++, over all per-layer assignments with the cost model of SPEC 3's
    swap schedule (offload of layer k overlaps the following forwards on a FIFO D2H
    stream; its reload is issued when layer k+d's backward begins, d the prefetch depth,
    and overlaps the backwards after it; copies longer than their windows stall; the last
    layer keeps its bytes). Ties go to less host traffic. Then it runs the chosen plan on
    the model (two steps; :func:`measure_plan`) and records its measured peak and step
    time on the plan; when the peak is over the budget (a model whose layers share saved
    tensors in a way the per-strategy profiles do not show), it solves again for the
    budget less the excess, up to three plans in all.

    Args:
        model: the model (``nn.Module``), e.g. a ``transformers`` model.
        step_fn: runs one forward and backward of the real step, e.g.
            ``lambda: model(input_ids=x, labels=x).loss.backward()``; no optimizer step.
            The gradients it leaves are cleared and the ``.grad`` found before
            planning is put back, on the parameters and on leaves outside the model
            that its backward reaches (an input with ``requires_grad``). A step that
            changes the weights (an optimizer step, ``p.data.add_``, a new parameter)
            is refused after its first call.
        budget_bytes: the largest peak of saved-activation bytes on the device (as
            :func:`saved_activation_memory` counts them over the whole step); an int
            number of bytes, or a size string / fraction of "none"'s measured peak as
            :func:`parse_budget` reads them (``"300MiB"``, ``0.4``).
        layers: which modules are the layers (as for :func:`apply_activation_memory`).
        candidates: strategies to choose from (default: none, checkpoint, selective,
            swap, selective_swap, checkpoint_swap); "none" is always among them (it is
            the baseline every figure is measured against); an empty list is refused
            before profiling.
        host_budget_bytes: the most bytes the plan's offloads may hold on the host at
            once (an int, a size string as :func:`parse_budget` reads it, or a
            :class:`PinnedMemoryPool`, whose ``max_host_bytes`` less 20 % for its block
            size classes is taken); ``None`` (default): unbounded.
        prefetch_depth: the depth to plan for (default: ``SwapManager()``'s current one);
            the plan records it and applying the plan sets it.

    Returns:
        An :class:`ActivationPlan`; ``apply_activation_memory(model, plan)`` applies it,
        ``print(plan.explain())`` shows it.

    Raises:
        InfeasibleBudgetError (a ValueError): when no plan meets the budgets, measured on
            the model; ``min_peak_bytes`` is the smallest peak measured (over the plans run,
            the cost model's least-peak plan and the uniform plans the profile measured),
            ``plan`` that plan; the message names the host budget.
        ValueError / TypeError: for a bad budget, candidate or model.
        RuntimeError: when ``step_fn`` steps a ``torch.optim`` optimizer (stopped before
            it changes anything) or changes a parameter otherwise (an update in place
            outside an optimizer is not undone: :func:`profile_activation_memory`).

    Distributed: under ``torch.distributed`` every rank profiles, the figures become the
    worst over all ranks, rank 0 solves and broadcasts the plan (or the error), so every
    rank applies the same plan (a plan that differed per rank would deadlock the
    collectives inside recomputed layers). Call it on every rank.
    """
    # Arguments are checked before profiling (which runs the real step several times).
    parse_budget(budget_bytes, none_peak_bytes=1)
    host = _host_budget(host_budget_bytes)
    depth = _depth(prefetch_depth)
    candidates = _nonempty(candidates)
    profile = profile_activation_memory(model, step_fn, layers=layers, candidates=candidates)
    budget = parse_budget(budget_bytes, profile.none_peak_bytes)
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def decide(target: int) -> ActivationPlan:
        """The plan for ``target`` bytes, solved once (by rank 0, broadcast)."""
        if not distributed:
            return plan_from_profile(profile, target, prefetch_depth=depth,
                                     host_budget_bytes=host)
        box: list = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = ("plan", plan_from_profile(profile, target, prefetch_depth=depth,
                                                    host_budget_bytes=host).to_json())
            except InfeasibleBudgetError as err:
                box[0] = ("infeasible", (str(err), err.budget_bytes, err.min_peak_bytes,
                                         err.plan.to_json() if err.plan else None, host,
                                         err.min_peak_bound_bytes))
        dist.broadcast_object_list(box, src=0)
        kind, payload = box[0]
        if kind == "plan":
            return ActivationPlan.from_json(payload)
        message, asked, low, plan, host_bytes, bound = payload
        raise InfeasibleBudgetError(message, asked, low,
                                    ActivationPlan.from_json(plan) if plan else None, host_bytes,
                                    bound)

    return _closed_loop(budget, decide,
                        lambda plan: _measured(plan, model, step_fn, budget, distributed),
                        profile.strategies,
                        lambda: _uniform_measured(profile, budget, candidates, depth, host))


def _measured(plan: ActivationPlan, model: nn.Module, step_fn: Callable[[], object],
              budget: int, over_ranks: bool = False) -> ActivationPlan:
    """``plan`` (for ``budget``) with what it measured on the model (:func:`measure_plan`);
    ``over_ranks``: the largest over the ranks of torch.distributed (every rank runs it)."""
    got = measure_plan(model, step_fn, plan)
    peak, seconds = got["peak_bytes"], got["step_seconds"]
    if over_ranks:
        import torch.distributed as dist

        on = model_device(model) if dist.get_backend() != "gloo" else torch.device("cpu")
        t = torch.tensor([peak, seconds], dtype=torch.float64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak, seconds = int(t[0].item()), float(t[1].item())
    return dataclasses.replace(plan, budget_bytes=int(budget), measured_peak_bytes=int(peak),
                               measured_step_seconds=float(seconds))


def _uniform_measured(profile: ActivationProfile, budget: int, candidates, depth: int,
                      host: int | None) -> list[ActivationPlan]:
    """The uniform plans of the candidates, each with the peak and step time its profiled
    steps measured (``measured_peak_bytes``, ``measured_step_seconds``; those predicted
    over a host budget left out), fastest measured first: what the closed loop falls back
    to when the cost model misses, and what its errors count among the plans measured
    (docs/design.md, "Closed loop")."""
    names = check_candidates(candidates) if candidates is not None else profile.strategies
    n = len(profile.layer_names)
    out = []
    for s in sorted((s for s in names if s in profile.measured),
                    key=lambda s: profile.measured[s]["step_seconds"]):
        index = profile.strategies.index(s)
        prediction = predict(profile, [s] * n, prefetch_depth=depth, offload_window=0)
        if host is not None and prediction["offload_bytes"] > host:
            continue
        plan = _plan(profile, [index] * n, prediction, budget, depth, host)
        out.append(dataclasses.replace(
            plan, measured_peak_bytes=int(profile.measured[s]["peak_bytes"]),
            measured_step_seconds=float(profile.measured[s]["step_seconds"])))
    return out


def _closed_loop(budget: int, decide: Callable[[int], ActivationPlan],
                 measure: Callable[[ActivationPlan], ActivationPlan],
                 strategies: Sequence[str],
                 uniform: Callable[[], list[ActivationPlan]]) -> ActivationPlan:
    """The plan ``decide(target)`` gives for the budget, run on the model by ``measure``
    (which returns it with ``measured_peak_bytes`` set) (docs/design.md, "Closed loop").

    The cost model composes per-strategy profiles, and a model can share storages between
    layers in ways no uniform profile shows (a layer whose output the next one saves as its
    input: who pays for it depends on both strategies). While the plan measures over the
    budget the solver runs again for the budget less the excess (when nothing is predicted
    to fit that, the plan of the smallest predicted peak is the last one tried), at most
    _MEASURE_ROUNDS plans; then, or when the solver finds nothing, the uniform plans
    ``uniform()`` gives whose profiled steps measured within the budget, at most
    _UNIFORM_ROUNDS.

    Where none fits, the error names the smallest peak measured on the model, over the
    plans tried, the least-peak plan of the cost model (measured when the cost model itself
    found nothing: its prediction may be off) and the uniform plans the profile measured;
    so planning again at the error's ``min_peak_bytes`` is answered (a fuzzer, session 26:
    the cost model's least, 76 800 B predicted, measured 307 200 B on a stack whose layers
    share storages, and the uniform ``checkpoint_swap`` the profile measured at 284 160 B
    was not named).
    """

    def unproven(plan: ActivationPlan) -> ActivationPlan:
        # Not the solver's optimum for the budget asked (solved for a lowered one, or the
        # smallest predicted): neither optimal nor bounded for it.
        return dataclasses.replace(plan, exact=False, lower_bound_seconds=None)

    uniform_plans: list[ActivationPlan] = []  # uniform(), built once when first needed

    def uniform_once() -> list[ActivationPlan]:
        if not uniform_plans:
            uniform_plans.extend(uniform())
        return uniform_plans

    def fallback() -> ActivationPlan | None:
        for plan in [p for p in uniform_once()
                     if p.measured_peak_bytes <= budget][:_UNIFORM_ROUNDS]:
            if any(p.strategies == plan.strategies for p in tried):
                continue
            plan = measure(plan)  # (built without solver stats: not exact, no bound)
            if plan.measured_peak_bytes <= budget:
                return plan
            tried.append(plan)
        return None

    def smallest() -> ActivationPlan:
        # The least measured peak over the plans run and the uniform ones the profile
        # measured (those measured again here count with their new figures).
        seen = {tuple(p.strategies.items()) for p in tried}
        pool = tried + [p for p in uniform_once() if tuple(p.strategies.items()) not in seen]
        return min(pool, key=lambda p: (p.measured_peak_bytes, p.measured_step_seconds))

    target = budget
    tried: list[ActivationPlan] = []
    for _ in range(_SOLVE_ROUNDS):
        last_resort = False
        try:
            candidate = decide(max(1, target))
        except InfeasibleBudgetError as err:
            if not tried:
                # the cost model finds nothing; a uniform plan the profile measured within
                # the budget says otherwise (a model it mispredicts)
                found = fallback()
                if found is not None:
                    return found
                if err.plan is None:
                    raise
                least = measure(err.plan)
                tried.append(least)
                best = smallest()
                if best is least and least.measured_peak_bytes == err.min_peak_bytes:
                    raise  # the cost model's least, as predicted
                # (plan_from_profile's message: "<what is infeasible>; the smallest
                # reachable is ... (error.plan). Raise the budget, ...")
                text = str(err)
                head = text.split("; ", 1)[0]
                advice = text[text.find("Raise the budget"):] if "Raise the budget" in text \
                    else "Raise the budget."
                raise InfeasibleBudgetError(
                    f"{head}; the cost model's least-peak plan ({_choice(least)}, predicted "
                    f"{_fmt_bytes(err.min_peak_bytes)}, {err.min_peak_bytes} bytes) measured "
                    f"{_fmt_bytes(least.measured_peak_bytes)} ({least.measured_peak_bytes} "
                    f"bytes) on the model, and the smallest peak measured is "
                    f"{_fmt_bytes(best.measured_peak_bytes)} ({best.measured_peak_bytes} "
                    f"bytes) with {_choice(best)} (error.plan). {advice}",
                    err.budget_bytes, best.measured_peak_bytes, best, err.host_budget_bytes,
                    min(err.min_peak_bound_bytes, best.measured_peak_bytes)) from None
            if err.plan is None:
                break
            candidate, last_resort = err.plan, True
        if any(p.strategies == candidate.strategies for p in tried):
            if last_resort:
                break
            target -= max(1, tried[-1].measured_peak_bytes - budget)  # same plan: lower more
            continue
        plan = measure(candidate)
        if plan.measured_peak_bytes <= budget:
            return plan if target == budget and not last_resort else unproven(plan)
        tried.append(plan)
        if last_resort or len(tried) == _MEASURE_ROUNDS:
            break
        target -= plan.measured_peak_bytes - budget
    found = fallback()
    if found is not None:
        return found
    best = smallest()
    raise InfeasibleBudgetError(
        f"hyper_parallel: the plans the cost model found for a peak of saved activations "
        f"within {_fmt_bytes(budget)} ({budget} bytes) measured over it on the model "
        + ("(1 plan tried: no smaller one is predicted)" if len(tried) == 1 else
           f"({len(tried)} plans tried, each solved for the budget less the previous "
           "plan's excess)")
        + f"; the smallest peak measured {_fmt_bytes(best.measured_peak_bytes)} "
        f"({best.measured_peak_bytes} bytes) with {_choice(best)} (error.plan, predicted "
        f"{best.predicted_peak_bytes} bytes). Raise the budget"
        + _more_candidates(strategies)
        + ", or shrink the batch; a profile whose layers share saved tensors in unusual "
        "ways is worth reporting.",
        int(budget), best.measured_peak_bytes, best, best.host_budget_bytes)


def _choice(plan: ActivationPlan) -> str:
    return ", ".join(f"{k}: {n}" for k, n in _counts(plan).items())


#: How many plans plan_activation_memory runs on the model before it gives up (each costs
#: two steps: docs/design.md, "Planner"), and how many times it may solve (solving is
#: milliseconds; a lowered budget can give a plan already measured).
_MEASURE_ROUNDS = 3
_SOLVE_ROUNDS = 8
_UNIFORM_ROUNDS = 2  # uniform plans measured after those (the profile measured them fit)


def _host_budget(value) -> int | None:
    """host_budget_bytes= of plan_activation_memory in bytes (None: unbounded)."""
    from ._host_pool import PinnedMemoryPool

    if value is None:
        return None
    if isinstance(value, PinnedMemoryPool):
        # Blocks are rounded up to size classes (four per power of two: at most 25 %).
        return int(value.max_host_bytes * 0.8)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= _MAX_BYTES:
            raise ValueError(f"hyper_parallel: host_budget_bytes must be between 0 and "
                             f"{_MAX_BYTES} bytes, got {value}")
        return value
    return parse_budget(value, name="host_budget_bytes", fractions=False, zero=True)
