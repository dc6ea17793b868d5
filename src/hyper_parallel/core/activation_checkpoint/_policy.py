"""CheckpointPolicy and the conversions every policy function result goes through."""

from __future__ import annotations

from hyper_parallel._extension import _C

#: Enum ``MUST_SAVE=0, PREFER_SAVE=1, MUST_RECOMPUTE=2, PREFER_RECOMPUTE=3, MUST_SWAP=4``,
#: defined once in C++ (``csrc/hyper_parallel/activation/CheckpointPolicy.h``).
CheckpointPolicy = _C.CheckpointPolicy


def to_policy(value, *, what: str) -> CheckpointPolicy:
    """Normalises a policy function result to :class:`CheckpointPolicy`.

    Accepts our members, ``torch.utils.checkpoint.CheckpointPolicy`` members (its
    ``*_CPU_OFFLOAD`` values mean ``MUST_SWAP``) and bools (``True`` = ``MUST_SAVE``,
    ``False`` = ``PREFER_RECOMPUTE``, as in torch).

    Raises:
        ValueError: for anything else; the message names ``what`` produced the value.
    """
    if isinstance(value, CheckpointPolicy):
        return value
    if isinstance(value, bool):
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    name = getattr(value, "name", None)
    if isinstance(name, str) and type(value).__name__ == "CheckpointPolicy":
        converted = _C.policy_from_string(name)
        if converted is not None:
            return converted
    raise ValueError(
        f"hyper_parallel: {what} returned {value!r}, which is not a CheckpointPolicy. "
        "Return a member of hyper_parallel.core.activation_checkpoint.CheckpointPolicy "
        "(MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE, MUST_SWAP), a member of "
        "torch.utils.checkpoint.CheckpointPolicy, or a bool."
    )
