"""``strata explain`` with several queries: the sharing decisions, as JSON and as text."""

from __future__ import annotations

from .execution import plan_groups
from .plan import SharedPlan
from .switches import plan_switches

__all__ = ["explain_sharing", "render_sharing"]

_LABEL = {"complete": "complete sharing", "loose_partial": "loose partial sharing",
          "strict_partial": "strict partial sharing", "none": "not shared"}


def explain_sharing(compiled: list, config, mode: str = "replicated") -> dict:
    """Sharing analysis of ``compiled`` queries (ids Q1, Q2, … in order)."""
    ids = [f"Q{i + 1}" for i in range(len(compiled))]
    plan = SharedPlan(mode, config.instant_seconds, config.lattice)
    decisions = []
    for qid, cq in zip(ids, compiled):
        for d in plan.add(qid, cq):
            decisions.append(d.to_json(config.lattice))
    # what a worker evaluates once per chunk: queries of one level group (all compiled at its level)
    execution = []
    by_level: dict[str, dict] = {}
    for qid, cq in zip(ids, compiled):
        by_level.setdefault(cq.level, {})[qid] = cq
    for level, qs in by_level.items():
        grouped: set[str] = set()
        for g in plan_groups(qs, config.instant_seconds):
            members = list(g.members)
            if g.form == "complete":
                desc = "evaluated once, the result copied to each query"
            else:
                desc = ("evaluated once as one merged query over the shared windows"
                        + (" and selection" if g.cq.query.where is not None else "")
                        + "; each query keeps its own residual condition, projection and R2S")
            execution.append({"level": level, "queries": members, "form": g.form, "how": desc})
            grouped.update(members)
        for g in plan_groups(qs, config.instant_seconds):  # members of complete groups inside merged ones
            if g.form == "complete":
                grouped.update(g.members)
        for qid in qs:
            if qid not in grouped:
                execution.append({"level": level, "queries": [qid], "form": "alone",
                                  "how": "evaluated on its own"})
    queries = []
    for qid, cq in zip(ids, compiled):
        j = cq.to_json()
        j["id"] = qid
        queries.append(j)
    sj = plan.to_json()
    return {
        "mode": mode,
        "queries": queries,
        "decisions": decisions,
        "shared_nodes": sj["shared_nodes"],
        "nodes": sj["nodes"],
        "nodes_without_sharing": sj["nodes_without_sharing"],
        "execution": execution,
        "switches": plan_switches(plan),
    }


def render_sharing(report: dict) -> str:
    lines = []
    for q in report["queries"]:
        lines.append(f"{q['id']} ({q['level']}): {q['rewritten']}")
        for n in q["notes"]:
            lines.append(f"    -- {n}")
    lines.append("")
    lines.append(f"sharing ({report['mode']} mode):")
    if not report["decisions"]:
        lines.append("  (one query: nothing to share with)")
    for d in report["decisions"]:
        lines.append(f"  {d['query']} with {d['with']}: {_LABEL[d['kind']]}")
        lines.append(f"      {d['reason']}")
    if report["shared_nodes"]:
        lines.append("shared operators:")
        for s in report["shared_nodes"]:
            lines.append(f"  {s['node']}  <- {', '.join(s['queries'])}")
    lines.append(f"merged plan: {report['nodes']} operator nodes "
                 f"({report['nodes_without_sharing']} without sharing)")
    lines.append("execution on the workers (per chunk, within a level group):")
    for e in report["execution"]:
        lines.append(f"  {', '.join(e['queries'])} ({e['level']}): {e['form']} - {e['how']}")
    if report.get("switches"):
        lines.append("privacy switches (paper 004, Algorithm 2; docs/semantics.md §12):")
        for w in report["switches"]:
            lines.append(f"  {w['query']}: {w['kind']} at {w['at']}")
    return "\n".join(lines)
