"""Query sharing (dissertation ch. 5.3, 6.3): operator trees of rewritten queries,
equivalence and subsumption of nodes, the sharing classifier, merged plans, and
the execution grouping the workers use to evaluate shared plans once per chunk.
"""

from .optree import Node, OperatorTree, build_tree, describe
from .plan import KINDS, Decision, SharedPlan, classify, subsumed_by

__all__ = [
    "Node", "OperatorTree", "build_tree", "describe", "KINDS", "Decision", "SharedPlan", "classify",
    "subsumed_by", "sharing_enabled", "sharing_mode",
]


def sharing_enabled(config) -> bool:
    """``[sharing] enabled`` of the configuration (declared in strata/config.py: default true)."""
    return config.sharing.enabled


def sharing_mode(config) -> str:
    """``[sharing] mode``: ``replicated`` (default; a cluster runs one level per master) or ``trusted``."""
    return config.sharing.mode

