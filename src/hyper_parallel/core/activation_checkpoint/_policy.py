"""CheckpointPolicy and the conversions every policy function result goes through."""

from __future__ import annotations

import torch.utils.checkpoint as torch_checkpoint

from hyper_parallel._extension import _C

#: ``enum.Enum`` with ``MUST_SAVE=0, PREFER_SAVE=1, MUST_RECOMPUTE=2, PREFER_RECOMPUTE=3,
#: MUST_SWAP=4``: a real Python enum (``list()``, ``.name``, ``.value``, pickling), built by
#: pybind11 from the one definition in C++ (``csrc/hyper_parallel/activation/CheckpointPolicy.h``).
#: The values of 0..3 are torch's; ``MUST_SWAP`` has the value of torch's ``MUST_CPU_OFFLOAD``.
#: Conversions with ``torch.utils.checkpoint.CheckpointPolicy``: ``CheckpointPolicy(p)`` and
#: ``CheckpointPolicy.from_torch(p)`` (torch's two ``*_CPU_OFFLOAD`` values give
#: ``MUST_SWAP``), ``policy.to_torch()`` (``MUST_SWAP`` gives ``MUST_CPU_OFFLOAD``).
CheckpointPolicy = _C.CheckpointPolicy
CheckpointPolicy.__module__ = "hyper_parallel.core.activation_checkpoint"  # pickled by this name

_TorchPolicy = getattr(torch_checkpoint, "CheckpointPolicy", None)


def _from_torch(cls, policy):
    """Our member for a member of ``torch.utils.checkpoint.CheckpointPolicy``.

    Raises:
        ValueError: when ``policy`` is not a member of torch's enum.
    """
    if _TorchPolicy is None or not isinstance(policy, _TorchPolicy):
        raise ValueError(f"hyper_parallel: {policy!r} is not a torch.utils.checkpoint."
                         "CheckpointPolicy member")
    return _C.policy_from_string(policy.name)


def _to_torch(self):
    """The member of ``torch.utils.checkpoint.CheckpointPolicy`` with this meaning
    (``MUST_SWAP`` -> ``MUST_CPU_OFFLOAD``)."""
    if _TorchPolicy is None:
        raise RuntimeError("hyper_parallel: this torch has no torch.utils.checkpoint.CheckpointPolicy")
    return _TorchPolicy(self.value)


def _missing(cls, value):
    # CheckpointPolicy(torch_member) converts; other unknown values fail as enums do.
    if _TorchPolicy is not None and isinstance(value, _TorchPolicy):
        return _from_torch(cls, value)
    return None


CheckpointPolicy.from_torch = classmethod(_from_torch)
CheckpointPolicy.to_torch = _to_torch
CheckpointPolicy._missing_ = classmethod(_missing)

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def to_policy(value, *, what: str) -> CheckpointPolicy:
    """Normalises a policy function result to :class:`CheckpointPolicy`.

    Accepts our members, ``torch.utils.checkpoint.CheckpointPolicy`` members (its
    ``*_CPU_OFFLOAD`` values mean ``MUST_SWAP``) and bools (``True`` = ``MUST_SAVE``,
    ``False`` = ``PREFER_RECOMPUTE``, as in torch).

    Raises:
        ValueError: for anything else; the message names ``what`` produced the value.
    """
    if type(value) is CheckpointPolicy:
        return value
    if value is True or value is False:
        return _SAVE if value else _RECOMPUTE
    if _TorchPolicy is not None and type(value) is _TorchPolicy:
        return _C.policy_from_string(value.name)
    raise ValueError(
        f"hyper_parallel: {what} returned {value!r}, which is not a CheckpointPolicy. "
        "Return a member of hyper_parallel.core.activation_checkpoint.CheckpointPolicy "
        "(MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE, MUST_SWAP), a member of "
        "torch.utils.checkpoint.CheckpointPolicy, or a bool."
    )
