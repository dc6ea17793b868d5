"""The two kinds of ``policy_fn`` and their call shapes, checked when a policy is given.

``swap``/``swap_wrapper`` call ``policy_fn(tensor)`` once per saved tensor; ``checkpoint``
/``checkpoint_wrapper`` call ``policy_fn(ctx, op, *args, **kwargs)`` once per op. Handing
one kind to the other would otherwise fail deep inside a forward with a bare
``TypeError`` about positional arguments; these checks fail at the call that received
the policy and say which shape was expected.
"""

from __future__ import annotations

import inspect
import weakref

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _accepts(fn, n_args: int) -> bool | None:
    """Whether ``fn`` can be called with ``n_args`` positional arguments (``None`` when
    its signature cannot be read, e.g. some builtins: then it is not judged)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*([None] * n_args))
    except TypeError:
        return False
    return True


def _accepts_op_call(fn) -> bool | None:
    """Whether ``fn`` can take every call ``policy_fn(ctx, op, *args, **kwargs)`` an op
    makes: two leading positionals and any number of further positionals (the op's
    arguments; ``**kwargs`` for keyword-only ones such as ``alpha=`` is advised but, as in
    torch, not required). ``None``
    when its signature cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    # **kwargs is not required: torch accepts a (ctx, op, *args) policy, which breaks only
    # on an op called with keyword-only arguments.
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        return False
    try:
        sig.bind(None, None)
    except TypeError:
        return False
    return True


def _describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def _cached(fn, kind: str) -> bool:
    try:
        return _checked.get(fn) == kind
    except TypeError:  # not weakly referenceable (bound methods are, briefly): check again
        return False


def _remember(fn, kind: str) -> None:
    try:
        _checked[fn] = kind
    except TypeError:
        pass


def check_swap_policy(policy_fn):
    """Returns ``policy_fn`` when it can be called as ``policy_fn(tensor)``.

    Raises:
        TypeError: naming the expected shape; when it takes ``(ctx, op, ...)``, saying
            that it is a checkpoint policy.
    """
    if policy_fn is None or _cached(policy_fn, "swap"):
        return policy_fn
    if not callable(policy_fn):
        raise TypeError(
            "hyper_parallel: swap's policy_fn must be a callable policy_fn(tensor) -> "
            "CheckpointPolicy (MUST_SWAP offloads the saved tensor, MUST_SAVE keeps it on "
            f"device); got {type(policy_fn).__name__}. A list or dict of ops is a checkpoint "
            "policy: pass it to checkpoint()/checkpoint_wrapper().")
    if _accepts(policy_fn, 1) is False:
        hint = (" It takes (ctx, op, ...), the shape of a checkpoint policy (one call per op): "
                "pass it to checkpoint()/checkpoint_wrapper(), or give swap a per-tensor "
                "function." if _accepts(policy_fn, 2) else "")
        raise TypeError(
            "hyper_parallel: swap's policy_fn is called once per saved tensor as "
            "policy_fn(tensor) -> CheckpointPolicy.MUST_SWAP or MUST_SAVE, but "
            f"{_describe(policy_fn)} cannot be called with one argument.{hint}")
    _remember(policy_fn, "swap")
    return policy_fn


def check_checkpoint_policy(policy_fn):
    """Returns ``policy_fn`` (a callable) when it can be called as
    ``policy_fn(ctx, op, *args, **kwargs)`` (its signature has ``*args`` after at most two
    required positionals; an unreadable signature is not judged).

    Raises:
        TypeError: naming the expected shape; when it takes one argument, saying that
            it looks like a per-tensor swap policy; when it lacks ``*args`` (``(ctx, op)``),
            saying to declare ``*args, **kwargs``.
    """
    if _cached(policy_fn, "checkpoint"):
        return policy_fn
    if _accepts_op_call(policy_fn) is False:
        if _accepts(policy_fn, 2) is False and _accepts(policy_fn, 1):
            hint = (" It takes one argument, the shape of a swap policy (one call per saved "
                    "tensor): pass it to swap()/swap_wrapper(), or give checkpoint a per-op "
                    "function.")
        else:
            hint = (" Declare it as def policy_fn(ctx, op, *args, **kwargs): every op passes "
                    "its own arguments after (ctx, op).")
        raise TypeError(
            "hyper_parallel: checkpoint's policy_fn is called once per op as "
            "policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy or bool, but "
            f"{_describe(policy_fn)} cannot be called that way.{hint}")
    _remember(policy_fn, "checkpoint")
    return policy_fn


def is_per_tensor_policy(policy_fn) -> bool:
    """Whether a callable takes one argument but not ``(ctx, op)``: a swap policy."""
    return callable(policy_fn) and _accepts(policy_fn, 2) is False and \
        _accepts(policy_fn, 1) is True
