"""Independent single-process reference evaluator of MLS-CQL (SEMANTICS.md §1-§5, §8).

Tests check the distributed engine against :func:`evaluate` (the output rows; raises
:class:`QueryFailed` for a query that fails) or :func:`evaluate_outcome` (the rows
before the failing instant, that instant and the reason); it shares nothing with
the engine under test beyond the parser, the lattice and the config.
"""

from .evaluator import Outcome, QueryFailed, compare_results, evaluate, evaluate_outcome

__all__ = ["evaluate", "evaluate_outcome", "Outcome", "QueryFailed", "compare_results"]
