"""Our wrappers under ``torch.compile`` (docs/design.md, "torch.compile").

Two orders exist and both keep the memory saving:

* ``torch.compile(checkpoint_wrapper(block))`` (dynamo traces the wrapper). Nothing of
  the swap engine can live in a graph (its state is C++ behind a lock, its hooks act
  on real storages at run time), so under tracing a checkpoint region is routed to
  what torch compiles: ``torch.utils.checkpoint.checkpoint``, which dynamo turns into its
  ``tag_activation_checkpoint`` higher-order op, with torch's own selective-checkpoint
  contexts built from our policy (:func:`_compiled_contexts`). The partitioner then saves
  the outputs the policy keeps and recomputes the rest, as our eager modes do. What has
  no compiled meaning in torch (``MUST_SWAP``, ``swap_inputs``, ``group_swap``) is
  reported once with a warning that says what happens instead; nothing is dropped
  silently. A swap region under tracing (``torch.compile(swap_wrapper(block))``) enters
  and leaves the engine in two small eager calls around the traced body: dynamo breaks
  the graph there and compiles the body in between (:func:`swap_region_enter`).
* ``checkpoint_wrapper(torch.compile(block))`` (the region is eager, the block compiled).
  torch.utils.checkpoint's entry point and its recompute run the function with dynamo
  disabled (pytorch/pytorch#161889), but a function that is already compiled re-enables
  its own frames, and our selective modes declare ``ignore_compile_internals``, so the
  compiled graph runs in forward and in recompute; swap hooks see the compiled
  function's saved tensors like any others. A policy then sees the ATen ops the graph
  dispatches: all of them with aot_eager, only extern kernels (``out=`` variants, never
  cached) with inductor, where a policy therefore acts as full checkpoint.

Everything reached from a traced frame is constant for dynamo (prepared objects read
through attributes, ``torch.compiler.is_compiling()``), so nothing per call (the manager
singleton, group lookups, thread-local stacks, stats) is traced, and a second step
neither breaks nor recompiles.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ._policy import CheckpointPolicy, to_policy
from ._selective import (
    _COLLECTIVE,
    SelectiveCheckpointContext,
    _op_info,
    call_context_fn,
    compile_policy,
)
from ._warnings import warn as warn_user

_TORCH_POLICY = torch_checkpoint.CheckpointPolicy
_TO_TORCH = {
    CheckpointPolicy.MUST_SAVE: _TORCH_POLICY.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE: _TORCH_POLICY.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: _TORCH_POLICY.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: _TORCH_POLICY.PREFER_RECOMPUTE,
    # torch 2.13 has no compiled CPU offload for SAC (its *_CPU_OFFLOAD tags are saved
    # on device by the partitioner), so MUST_SWAP is kept on device, with a warning.
    CheckpointPolicy.MUST_SWAP: _TORCH_POLICY.MUST_SAVE,
}


def is_compiling() -> bool:
    """True while dynamo traces (a constant for it); False in eager code."""
    return torch.compiler.is_compiling()


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    """One warning per ``key`` and process (called at trace time only, never per step)."""
    if key not in _warned:
        _warned.add(key)
        warn_user("hyper_parallel: " + message)


def _warn_swap_under_compile(what: str) -> None:
    warn_once(what, (
        f"{what} has no compiled counterpart in torch {torch.__version__} "
        "(torch.compile cannot run the swap engine inside a graph), so under "
        "torch.compile(checkpoint_wrapper(block)) the tensors it would swap stay on device "
        "(MUST_SWAP outputs are saved, region inputs are kept for the recompute). To swap "
        "a compiled block, wrap the compiled block instead: "
        "checkpoint_wrapper(torch.compile(block), ...) or swap_wrapper(torch.compile(block))."))


class _TorchPolicy:
    """Our prepared policy, called the way torch's selective checkpoint calls a
    ``policy_fn``: ``(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``.

    It is consulted at trace time only (the partitioner keeps its decision in the graph),
    so per-op Python here costs nothing per step. The rules of the eager modes hold: ops
    that write their arguments or return views are recomputed whatever the policy says,
    random ops are asked like any other (the partitioner keeps the RNG of the compiled
    graph aligned), and the policy sees the same ``ctx`` and ``op`` objects.
    """

    def __init__(self, policy) -> None:
        self._table = policy.table if policy is not None else None
        self._fn = policy.fn if policy is not None else None

    def __call__(self, ctx, func, *args, **kwargs):
        info = _op_info(func)
        collective = info.kind == _COLLECTIVE
        if not collective and (info.key < 0 or (self._table is None and self._fn is None)):
            return _TORCH_POLICY.PREFER_RECOMPUTE
        if self._fn is None and self._table is None:
            ours = CheckpointPolicy.MUST_SAVE  # a collective in a full-recompute region
        elif self._fn is None:
            ours = self._table.lookup(info.name)
        else:
            ours = to_policy(
                self._fn(SelectiveCheckpointContext(False, ctx.op_output), func, *args,
                         **kwargs),
                what=f"policy_fn for op {info.name}")
        if collective and ours is not CheckpointPolicy.MUST_RECOMPUTE:
            ours = CheckpointPolicy.MUST_SAVE  # kept, as in eager (_collectives.py)
        if ours == CheckpointPolicy.MUST_SWAP:
            _warn_swap_under_compile("CheckpointPolicy.MUST_SWAP")
        return _TO_TORCH[ours]


def _compiled_contexts(policy_fn, user_context_fn, swap_inputs, group_swap):
    """The ``context_fn`` torch's compiled checkpoint calls while it traces the region
    (once per compilation, never per step): torch's selective-checkpoint contexts built
    from our ``policy_fn`` (raw or prepared; ``None``: recompute everything), or the
    user's own ``context_fn``, checked."""
    if swap_inputs:
        _warn_swap_under_compile("swap_inputs=True")
    if group_swap:
        _warn_swap_under_compile("group_swap=True")
    if user_context_fn is None:
        policy = _TorchPolicy(compile_policy(policy_fn))
        return torch_checkpoint.create_selective_checkpoint_contexts(policy)
    contexts = call_context_fn(user_context_fn)
    if not all(isinstance(c, TorchDispatchMode) for c in contexts):
        raise TypeError(
            "hyper_parallel: under torch.compile, checkpoint context_fn must return two "
            "TorchDispatchModes (torch compiles only those, e.g. "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)); it "
            f"returned ({type(contexts[0]).__name__}, {type(contexts[1]).__name__}). Pass "
            "policy_fn instead, or keep this region eager "
            "(checkpoint_wrapper(torch.compile(block), context_fn=...)).")
    return contexts


def checkpoint(function, args: tuple, kwargs: dict, policy_fn=None, context_fn=None,
               swap_inputs=False, group_swap=False, preserve_rng_state=True,
               determinism_check=None):
    """A checkpoint region traced by dynamo: torch's checkpoint (its higher-order op) with
    a ``context_fn`` that dynamo keeps as a constant (a ``functools.partial`` of a
    module-level function over the options, which it guards by identity).

    Raises:
        ValueError: when both ``policy_fn`` and ``context_fn`` are given (torch's compiled
            checkpoint takes one pair of selective-checkpoint modes per region).
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if policy_fn is not None and context_fn is not None:
        raise ValueError(
            "hyper_parallel: under torch.compile a checkpoint region takes policy_fn or "
            "context_fn, not both (torch compiles one pair of selective-checkpoint "
            "contexts per region); fold the policy into one of them, or keep this region "
            "eager with checkpoint_wrapper(torch.compile(block), ...).")
    options = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if policy_fn is not None or context_fn is not None or swap_inputs or group_swap:
        options["context_fn"] = functools.partial(_compiled_contexts, policy_fn, context_fn,
                                                  swap_inputs, group_swap)
    # else full recompute: torch's own compiled checkpoint, which recomputes every op,
    # collectives included (eager regions keep collective results; docs/design.md, "Known
    # limits"), and says nothing (a context_fn makes torch warn about in-place ops once
    # per process, advice for selective regions).
    if determinism_check is not None:
        options["determinism_check"] = determinism_check
    return torch_checkpoint.checkpoint(function, *args, **options, **kwargs)


_canonical: dict = {}


def canonical_policy(policy):
    """One shared object per distinct prepared policy (equal tables, or the same
    callable). Dynamo guards the ``context_fn`` partial's arguments by identity, so
    wrappers built with equal policies (every layer of a model) share one compiled graph
    instead of recompiling per layer."""
    if policy is None:
        return None
    if policy.table is None:
        key = ("fn", policy.fn)
    else:
        key = ("table", tuple((name, p.value) for name, p in policy.table.entries()),
               policy.table.default.value)
    try:
        return _canonical.setdefault(key, policy)
    except TypeError:  # an unhashable callable
        return policy


def warn_registration_not_compiled() -> None:
    """Reports (once) that ``swap_tensor_wrapper`` inside a traced graph registers
    nothing. Listed in dynamo's ``reorderable_logging_functions``: dynamo runs the call
    after the graph instead of breaking it."""
    warn_once("swap_tensor_wrapper", (
        "swap_tensor_wrapper was traced by torch.compile, where it registers nothing (a "
        "tensor inside a graph has no storage until the graph runs). Inside a swap "
        "region every saved tensor of the compiled body is swapped anyway; to swap chosen "
        "tensors only, keep that module eager or wrap the compiled block with "
        "swap_wrapper(torch.compile(block))."))


torch._dynamo.config.reorderable_logging_functions.add(warn_registration_not_compiled)


def warn_exclusions_not_compiled() -> None:
    """Reports (once) that a checkpoint region traced by dynamo holds
    ``checkpoint_exclude_wrapper`` modules, which torch's compiled checkpoint recomputes.
    Reorderable like :func:`warn_registration_not_compiled` (no graph break)."""
    warn_once("checkpoint_exclude_wrapper", (
        "a checkpoint region traced by torch.compile (torch.compile(checkpoint_wrapper("
        "block))) holds checkpoint_exclude_wrapper regions: torch's compiled checkpoint "
        "has no exclusion regions, so their part runs again in recompute. Compile the "
        "block inside the wrapper instead (checkpoint_wrapper(torch.compile(block))) to "
        "run it once."))


torch._dynamo.config.reorderable_logging_functions.add(warn_exclusions_not_compiled)


# --------------------------------------------------------------------------- swap regions
_SWAP_BREAK_REASON = (
    "hyper_parallel: a swap region opens and closes outside the compiled graph (the "
    "engine's saved-tensor hooks and swap group: two graph breaks per swap layer), so "
    "torch.compile(fullgraph=True) cannot trace it. Drop fullgraph=True, or compile the "
    "block inside the wrapper instead: swap_wrapper(torch.compile(block)).")


def _graph_break(fn):
    """``torch.compiler.disable`` with the reason dynamo prints where a graph break is an
    error (fullgraph=True); without one it says "reason: None" and hints at removing the
    disable, which a user cannot do. (torch before 2.8 has no ``reason``.)"""
    try:
        return torch.compiler.disable(fn, reason=_SWAP_BREAK_REASON)
    except TypeError:
        return torch.compiler.disable(fn)


@_graph_break
def swap_region_enter(wrapper, inner, policy_fn, group_swap, cpu_pool=None,
                      state_module=True):
    """Opens the swap region of ``wrapper`` (a ``SwapWrapper``, a function wrapper or a
    ``swap`` call traced by dynamo) eagerly: the engine's group and its saved-tensor hooks
    are live while the compiled body that follows runs, so the compiled function's saved
    tensors are swapped like eager ones. One graph break (dynamo does not trace a disabled
    function); returns the region, or ``None`` where the body runs plainly (recompute, no
    grad). ``state_module``: True for ``inner`` itself (a module wrapper), else the module
    whose parameters and buffers are never swapped, or None."""
    from ._swap import LayerCall, swap_region

    state = inner if state_module is True else state_module
    region = swap_region(LayerCall(wrapper, inner, state), policy_fn, group_swap, cpu_pool)
    return None if region is None else region.__enter__()


def swap_traced(wrapper, inner, args, kwargs, policy_fn, group_swap, cpu_pool=None,
                state_module=True):
    """``inner(*args, **kwargs)`` in the swap region of ``wrapper`` while dynamo traces it:
    the region opens and closes eagerly around the compiled body (two graph breaks)."""
    region = swap_region_enter(wrapper, inner, policy_fn, group_swap, cpu_pool, state_module)
    try:
        out = inner(*args, **kwargs)
    except BaseException:
        swap_region_exit(region, None, True)
        raise
    swap_region_exit(region, out)
    return out


@_graph_break
def swap_region_exit(region, out, failed: bool = False):
    """Closes what :func:`swap_region_enter` opened (the second graph break): hands the
    group to the schedule and hooks its prefetch to the outputs' backward, or aborts
    the group when the body raised (``failed``)."""
    if region is None:
        return
    if failed:
        region.__exit__(RuntimeError, None, None)
        return
    region.__exit__(None, None, None)
    region.attach_backward(out)
