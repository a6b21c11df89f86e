"""Independent single-process reference evaluator of MLS-CQL (SEMANTICS.md §1-§5).

Tests check the distributed engine against :func:`evaluate`; it shares nothing
with the engine under test beyond the parser, the lattice and the config.
"""

from .evaluator import compare_results, evaluate

__all__ = ["evaluate", "compare_results"]
