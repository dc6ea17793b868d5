"""The demo's strategies: the names its command line accepts, applied with the library's
:func:`~hyper_parallel.core.activation_checkpoint.apply_activation_memory` (the
strategies themselves, and their descriptions, live there).

This module imports neither torch nor the extension, so that ``--help`` and argument
errors come back at once, on a fresh clone too.
"""

from __future__ import annotations

#: The strategy names, in the order the demo runs them (those of
#: ``hyper_parallel.core.activation_checkpoint.STRATEGIES``; a test checks they agree).
STRATEGIES = ("none", "checkpoint", "selective", "swap", "mixed", "selective_swap",
              "checkpoint_swap")

#: What the demo runs when ``--strategies`` is not given (the SPEC's five and
#: selective_swap). ``auto`` (the planner's plan under ``--budget``) is also accepted.
DEFAULT_STRATEGIES = ("none", "checkpoint", "selective", "swap", "mixed", "selective_swap")
AUTO = "auto"


def parse_strategies(text: str) -> list[str]:
    """Parses a comma-separated list of strategy names (order kept, duplicates dropped).

    Raises:
        ValueError: naming any unknown strategy and listing the known ones.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES and n != AUTO]
    if unknown or not names:
        given = ", ".join(unknown) or "(none given)"
        raise ValueError(f"hyper_parallel: unknown strategy {given}; "
                         f"choose from {', '.join(STRATEGIES)}, {AUTO}")
    return list(dict.fromkeys(names))


def apply_strategy(model, name: str, plan=None):
    """Applies strategy ``name`` to every decoder layer of ``model`` in one call
    (``apply_activation_memory(model, name)``; for ``auto``, the planner's ``plan``);
    returns the library's
    :class:`~hyper_parallel.core.activation_checkpoint._apply.Strategy` and the report."""
    from hyper_parallel.core.activation_checkpoint import STRATEGIES as LIBRARY
    from hyper_parallel.core.activation_checkpoint import apply_activation_memory
    from hyper_parallel.core.activation_checkpoint._apply import Strategy

    if name == AUTO:
        report = apply_activation_memory(model, plan)
        used = set(plan.strategies.values())
        return Strategy(AUTO, f"planner, budget {plan.budget_bytes / 2**20:.1f} MiB",
                        any(LIBRARY[s].recomputes for s in used),
                        any(LIBRARY[s].swaps for s in used)), report
    report = apply_activation_memory(model, name)
    return LIBRARY[name], report
