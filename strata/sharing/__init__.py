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
    """``[sharing] enabled`` of the configuration (default true)."""
    sec = (getattr(config, "sections", None) or {}).get("sharing") or {}
    v = sec.get("enabled", True)
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "no", "off")
    return bool(v)


def sharing_mode(config) -> str:
    """``[sharing] mode``: ``replicated`` (default; a cluster runs one level per master) or ``trusted``."""
    sec = (getattr(config, "sections", None) or {}).get("sharing") or {}
    mode = str(sec.get("mode", "replicated")).lower()
    if mode not in ("replicated", "trusted"):
        raise ValueError(f"[sharing] mode must be 'replicated' or 'trusted', not {mode!r}")
    return mode
