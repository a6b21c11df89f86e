"""What a worker can evaluate once for several queries of a chunk (pure logic, no Spark).

Two execution forms, both for queries of one level group (replicated mode; a
worker compiles every query at its own level):

* **complete** — queries whose rewritten queries are equal up to aliases and
  output names (Def. 4/5): one engine run, the result fanned out with each
  query's column names.  Any legacy mode, running states included, as long as
  the chunk carries identical inputs for them.
* **merged** — queries over the *same windows* (same streams, window specs and
  level sets; strict or loose partial sharing of the window/join/select nodes):

  - selections (no aggregate): the merged query selects the union of their
    select lists under the conjuncts *all* of them have (the shared select node
    ``N'`` of Def. 9); each query's remaining conjuncts become a boolean column
    (the residual select ``N''``), and its rows are the merged rows where that
    column is true, projected to its own list;
  - aggregates with the same WHERE conjuncts and GROUP BY: the merged query
    computes the union of the aggregates (one aggregate node); each query's
    HAVING becomes a boolean column.

  The merged query is evaluated as RSTREAM over the chunk's instants (plus the
  previous instant when a member is ISTREAM/DSTREAM); the worker derives each
  member's relation and applies its own R2S.  Output levels are unchanged:
  selecting and projecting a row keeps the lub of the tuples it derives from,
  and merged aggregates share groups, so each group's lub is the same.

:func:`plan_groups` decides the forms from the compiled queries only;
the worker still checks per chunk that the members' inputs are identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.mlscql.analyze import LegacyMode, legacy_mode
from strata.mlscql import ast as A
from strata.mlscql.analyze import CompiledQuery, OutputColumn

from .optree import canonical_expr, item_names, window_node

__all__ = ["MemberSpec", "MergedPlan", "plan_groups", "complete_key", "from_key"]


def from_key(cq: CompiledQuery, instant_seconds: float = 1.0) -> tuple:
    """The query's windows (canonical window nodes, in FROM order)."""
    return tuple(window_node(f, it.stream, instant_seconds, None) for f, it in zip(cq.query.from_, cq.items))


def complete_key(cq: CompiledQuery, instant_seconds: float = 1.0) -> tuple:
    """Equal keys ⇔ the queries compute the same rows (aliases and output names aside)."""
    if cq.subqueries:  # a query over subqueries: their keys and the outer query's
        return ("derived", tuple(None if s is None else complete_key(s, instant_seconds) for s in cq.subqueries),
                complete_key(cq.outer, instant_seconds))
    if cq.branches:  # a compound query: its SELECTs' keys and how they combine
        return ("compound", tuple(complete_key(b, instant_seconds) for b in cq.branches), cq.set_ops, cq.r2s,
                tuple(o.type for o in cq.outputs))
    names = item_names(cq)
    q = cq.query
    c = lambda e: canonical_expr(e, names)  # noqa: E731
    return (
        from_key(cq, instant_seconds),
        tuple((c(s.expr), o.type) for s, o in zip(q.select, cq.outputs)),
        frozenset(c(x) for x in A.conjuncts(q.where)),
        tuple(c(g) for g in q.group_by),
        frozenset(c(x) for x in A.conjuncts(q.having)),
        cq.r2s,
        cq.is_aggregate,
        legacy_mode(cq),
    )


def _requalify(e: A.Expr, mapping: dict[str, str]) -> A.Expr:
    if isinstance(e, A.Column):
        return A.Column(mapping.get(e.qualifier, e.qualifier) if e.qualifier else e.qualifier, e.name)
    if isinstance(e, A.Unary):
        return A.Unary(e.op, _requalify(e.operand, mapping))
    if isinstance(e, A.Binary):
        return A.Binary(e.op, _requalify(e.left, mapping), _requalify(e.right, mapping))
    if isinstance(e, A.InList):
        return A.InList(_requalify(e.operand, mapping), tuple(_requalify(i, mapping) for i in e.items),
                        e.negated, e.braces)
    if isinstance(e, A.DominatedBy):
        return A.DominatedBy(_requalify(e.operand, mapping), e.level)
    if isinstance(e, A.IsNull):
        return A.IsNull(_requalify(e.operand, mapping), e.negated)
    if isinstance(e, A.Aggregate):
        return A.Aggregate(e.func, None if e.arg is None else _requalify(e.arg, mapping), e.distinct)
    return e


def _and(es: list[A.Expr]) -> A.Expr | None:
    out = None
    for e in es:
        out = e if out is None else A.Binary("AND", out, e)
    return out


@dataclass
class MemberSpec:
    """How one query's rows come out of the merged result."""

    query_id: str
    cq: CompiledQuery
    columns: list[int]  # merged output index of each of the member's outputs
    flag: int | None  # merged output index of its residual condition (None: every row)


@dataclass
class MergedPlan:
    """A merged query evaluated once for ``members`` (form ``merged``) or a complete group."""

    form: str  # complete | merged
    members: list[str]
    cq: CompiledQuery | None = None  # the merged query (form merged); None for complete
    specs: list[MemberSpec] = field(default_factory=list)
    diff: bool = False  # some member needs R2S differences (evaluate prev_instant too)
    none_mode: bool = False  # unbounded ISTREAM selections: merged query is ISTREAM itself

    @property
    def kind_label(self) -> str:
        return "complete" if self.form == "complete" else "merged"


def _merge_class(cq: CompiledQuery) -> str | None:
    if cq.branches or cq.subqueries:
        return None  # a compound or derived query is evaluated on its own (or with its complete group)
    mode = legacy_mode(cq)
    if mode in (LegacyMode.WINDOW, LegacyMode.HISTORY):
        return "agg" if cq.is_aggregate else "sel"
    if mode is LegacyMode.NONE and cq.r2s == "ISTREAM":
        return "none"
    return None


def plan_groups(queries: dict[str, CompiledQuery], instant_seconds: float = 1.0) -> list[MergedPlan]:
    """Complete groups, then merged groups over complete-group representatives; singletons omitted.

    A query appears in at most one plan as a *representative* (its complete
    group's first member stands for the group inside a merged plan).
    """
    plans: list[MergedPlan] = []
    by_key: dict[tuple, list[str]] = {}
    for qid, cq in queries.items():
        by_key.setdefault(complete_key(cq, instant_seconds), []).append(qid)
    reps = []
    for key, ids in by_key.items():
        if len(ids) > 1:
            plans.append(MergedPlan("complete", ids))
        reps.append(ids[0])
    # merged groups: same windows and class (and for aggregates, same WHERE and GROUP BY)
    buckets: dict[tuple, list[str]] = {}
    for qid in reps:
        cq = queries[qid]
        cls = _merge_class(cq)
        if cls is None:
            continue
        key = (cls, from_key(cq, instant_seconds), tuple(f.window for f in cq.query.from_))
        if cls == "agg":
            names = item_names(cq)
            positional = {it.name: f"${i}" for i, it in enumerate(cq.items)}
            key += (frozenset(canonical_expr(x, names) for x in A.conjuncts(cq.query.where)),
                    tuple(_requalify(g, positional) for g in cq.query.group_by))
        buckets.setdefault(key, []).append(qid)
    for key, ids in buckets.items():
        if len(ids) < 2:
            continue
        plans.append(_merge(key[0], [(qid, queries[qid]) for qid in ids]))
    return plans


def _merge(cls: str, members: list[tuple[str, CompiledQuery]]) -> MergedPlan:
    base = members[0][1]
    base_names = [it.name for it in base.items]
    canon_conj: list[dict] = []  # per member: canonical conjunct → requalified original
    requal: list[dict[str, str]] = []
    for _, cq in members:
        mapping = {it.name: base_names[i] for i, it in enumerate(cq.items)}
        requal.append(mapping)
        names = item_names(cq)
        canon_conj.append({canonical_expr(x, names): _requalify(x, mapping) for x in A.conjuncts(cq.query.where)})
    common = set(canon_conj[0])
    for cc in canon_conj[1:]:
        common &= set(cc)
    where = _and([canon_conj[0][k] for k in canon_conj[0] if k in common])  # first member's order
    select: list[A.SelectItem] = []
    outputs: list[OutputColumn] = []
    index: dict[tuple, int] = {}

    def column(expr: A.Expr, typ: str, key) -> int:
        k = (key, typ)
        if k not in index:
            index[k] = len(select)
            select.append(A.SelectItem(expr))
            outputs.append(OutputColumn(f"c{len(outputs)}", typ))
        return index[k]

    specs = []
    for (qid, cq), mapping, cc in zip(members, requal, canon_conj):
        names = item_names(cq)
        cols = [column(_requalify(s.expr, mapping), o.type, canonical_expr(s.expr, names))
                for s, o in zip(cq.query.select, cq.outputs)]
        flag = None
        if cls == "agg":
            if cq.query.having is not None:
                h = _requalify(cq.query.having, mapping)
                flag = column(h, "boolean", ("having", canonical_expr(cq.query.having, names)))
        else:
            rest = [cc[k] for k in cc if k not in common]
            if rest:
                flag = column(_and(rest), "boolean", ("where", frozenset(k for k in cc if k not in common)))
        specs.append(MemberSpec(qid, cq, cols, flag))
    diff = any(cq.r2s in ("ISTREAM", "DSTREAM") for _, cq in members) and cls != "none"
    query = A.Query(tuple(select), base.query.from_, where, base.query.group_by if cls == "agg" else (),
                    None, "ISTREAM" if cls == "none" else "RSTREAM", False)
    merged = CompiledQuery(
        text="<shared: " + ", ".join(q for q, _ in members) + ">", level=base.level, query=query,
        items=base.items, outputs=tuple(outputs), r2s="ISTREAM" if cls == "none" else "RSTREAM",
        is_aggregate=(cls == "agg"),
    )
    return MergedPlan("merged", [q for q, _ in members], merged, specs, diff, cls == "none")
