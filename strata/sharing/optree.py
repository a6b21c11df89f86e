"""Operator trees of rewritten MLS-CQL queries (dissertation Def. 1, Table 6.1).

An operator tree is built from a :class:`~strata.mlscql.CompiledQuery` *after*
authorization, rewriting and optimization (Alg. 2-4), so every window carries
its final level set.  Nodes are immutable and compare structurally:

* ``op``     one of ``tuple_win``, ``time_win``, ``part_win`` (windows, with the
  stream as input queue), ``select``, ``join``, ``aggregate``, ``project``, ``r2s``;
* ``parm``   the operator's parameters (Table 6.1): window spec and level set,
  the *set* of conjuncts of a select or join, the group keys and aggregate
  calls of an aggregate, the set of projected expressions, the R2S operator;
* ``inputs`` the nodes whose output it consumes (its input queues).

So ``N_i == N_j`` is exactly Def. 2 (equivalence of nodes: same op, same
parameters, equivalent inputs), and two trees are equivalent (Def. 4) iff their
roots are equal.

Expressions are canonical: column qualifiers are replaced by the FROM item's
position (``$0``, ``$1``), so aliases do not matter, and symmetric
comparisons are ordered (``a = b`` and ``b = a``; ``x > 1`` and ``1 < x``).

Replicated mode (§5.3) never shares across levels: window nodes then carry the
query level as ``scope``, which makes every node above them level-specific too.
Trusted mode (§6.3) leaves ``scope`` empty.

Window canonicalization (Strata's reading of Def. 11 case 4, made exact): a
``PARTITION BY level, a.. ROWS n`` window whose level set is a single level
``{l}`` holds the last ``n`` tuples per ``a..`` among the ``l`` tuples, i.e. it
*is* ``PARTITION BY a.. ROWS n`` (``ROWS n`` without other attributes) over
``{l}``; the tree uses the simpler form, so Qc/Qd (§6.3) are equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from strata.mlscql import ast as A
from strata.mlscql.printer import expr_text

__all__ = [
    "Node", "OperatorTree", "build_tree", "canonical_expr", "canonical_conjuncts",
    "item_of", "WINDOW_OPS", "BLOCKING_OPS", "describe",
]

WINDOW_OPS = ("tuple_win", "time_win", "part_win")
#: blocking operators (synopses): shared only when equivalent (Def. 3 cond. 2)
BLOCKING_OPS = ("tuple_win", "time_win", "part_win", "join", "aggregate", "r2s")


@dataclass(frozen=True)
class Node:
    op: str
    parm: tuple
    inputs: tuple["Node", ...] = ()
    stream: str | None = None  # input queue of a window node
    scope: str | None = None  # the query level in replicated mode (windows only)

    # -- window parameters -------------------------------------------------------------
    @property
    def levels(self) -> frozenset[str]:
        return dict(self.parm)["levels"] if self.op in WINDOW_OPS else frozenset()

    def param(self, name: str, default=None):
        return dict(self.parm).get(name, default)

    def walk(self):
        """Post-order, each distinct node once."""
        seen: set = set()
        out: list[Node] = []

        def visit(n: Node):
            if n in seen:
                return
            for c in n.inputs:
                visit(c)
            seen.add(n)
            out.append(n)

        visit(self)
        return out


def describe(n: Node, lattice=None) -> str:
    """One-line text of a node, e.g. ``tuple_win(Vitals, ROWS 100, {U, C})``."""
    def lv(levels):
        order = list(lattice.sort(levels)) if lattice is not None else sorted(levels)
        return "{" + ", ".join(order) + "}"

    p = dict(n.parm)
    inst = f", instants of {lv(p['instants'])}" if "instants" in p else ""
    if "filter" in p:
        inst += f", WHERE {' AND '.join(sorted(expr_text(c) for c in p['filter']))}"
    if n.op == "tuple_win":
        return f"tuple_win({n.stream}, ROWS {p['rows']}, level in {lv(p['levels'])}{inst})"
    if n.op == "part_win":
        return (f"part_win({n.stream}, PARTITION BY {', '.join(sorted(p['by']))} ROWS {p['rows']}, "
                f"level in {lv(p['levels'])}{inst})")
    if n.op == "time_win":
        spec = {"range": lambda: f"RANGE {p['range']} instants", "unbounded": lambda: "RANGE UNBOUNDED",
                "now": lambda: "NOW", "relation": lambda: "RELATION"}[p["kind"]]()
        return f"time_win({n.stream}, {spec}, level in {lv(p['levels'])}{inst})"
    if n.op in ("select", "join"):
        conds = sorted(expr_text(c) for c in p["cond"])
        return f"{n.op}({' AND '.join(conds) if conds else 'TRUE'})"
    if n.op == "aggregate":
        keys = ", ".join(expr_text(g) for g in p["group_by"])
        aggs = ", ".join(sorted(expr_text(a) for a in p["aggs"]))
        return f"aggregate({aggs}{' GROUP BY ' + keys if keys else ''})"
    if n.op == "project":
        return f"project({', '.join(sorted(expr_text(e) for e in p['attr']))})"
    if n.op == "r2s":
        return p["r2s"]
    if n.op == "derived":
        return "derived(outer query over the subqueries' relations)"
    if n.op == "set_op":
        return f"set_op({', '.join(p['ops'])})"
    return n.op


# ---------------------------------------------------------------------------
# canonical expressions

_FLIP = {">": "<", ">=": "<=", "<": ">", "<=": ">="}


def _is_const(e) -> bool:
    return isinstance(e, (A.Literal, A.LevelLiteral))


def _key(e) -> str:
    return repr(e)


def canonical_expr(e: A.Expr, names: dict[str, int]) -> A.Expr:
    """``e`` with qualifiers replaced by FROM positions and symmetric operators ordered."""
    c = lambda x: canonical_expr(x, names)  # noqa: E731
    if isinstance(e, A.Column):
        q = e.qualifier
        if q is not None:
            idx = names.get(q, names.get(q.lower()))
            if idx is None:
                raise ValueError(f"column qualifier {q!r} is not a FROM item")
            q = f"${idx}"
        elif len(set(names.values())) == 1:
            q = "$0"
        return A.Column(q, e.name)
    if isinstance(e, A.Binary):
        l, r = c(e.left), c(e.right)
        op = e.op
        if op in _FLIP:
            lit_l, lit_r = _is_const(l), _is_const(r)
            if (lit_l and not lit_r) or (lit_l == lit_r and _key(r) < _key(l)):
                op, l, r = _FLIP[op], r, l  # constants on the right, else a fixed order
        elif op in ("=", "!=", "AND", "OR", "+", "*"):
            if (_is_const(l) and not _is_const(r)) or (_is_const(l) == _is_const(r) and _key(r) < _key(l)):
                l, r = r, l
        return A.Binary(op, l, r)
    if isinstance(e, A.InList):
        items = tuple(c(i) for i in e.items)
        if all(isinstance(i, (A.LevelLiteral, A.Literal)) for i in items):
            items = tuple(sorted(set(items), key=_key))
        return A.InList(c(e.operand), items, e.negated, False)
    return A.map_children(e, c)


def canonical_conjuncts(e: A.Expr | None, names: dict[str, int]) -> frozenset[A.Expr]:
    return frozenset(canonical_expr(x, names) for x in A.conjuncts(e))


def item_of(e: A.Expr) -> set[int]:
    """FROM positions a canonical expression reads."""
    return {int(c.qualifier[1:]) for c in A.columns_in(e) if c.qualifier and c.qualifier.startswith("$")}


def item_names(cq) -> dict[str, int]:
    names: dict[str, int] = {}
    for i, it in enumerate(cq.items):
        names[it.name] = i
        names.setdefault(it.name.lower(), i)
    return names


# ---------------------------------------------------------------------------
# trees


@dataclass(frozen=True)
class OperatorTree:
    """``OPT(Q)``: the root plus the query it came from."""

    root: Node
    level: str
    text: str = field(default="", compare=False)

    @property
    def nodes(self) -> list[Node]:
        return self.root.walk()

    @property
    def edges(self) -> list[tuple[Node, Node]]:
        return [(c, n) for n in self.nodes for c in n.inputs]

    def __eq__(self, other) -> bool:  # Def. 4
        return isinstance(other, OperatorTree) and self.root == other.root

    def __hash__(self) -> int:
        return hash(self.root)


def window_node(f: A.FromItem, stream: str, instant_seconds: float, scope: str | None) -> Node:
    w = f.window
    levels = frozenset(w.levels)
    if w.instants is not None:  # Alg. 4 narrowed it but kept the instants (SEMANTICS §5): another window
        node = window_node(replace(f, window=replace(w, instants=None)), stream, instant_seconds, scope)
        return replace(node, parm=node.parm + (("instants", frozenset(w.instants)),))
    if w.filter is not None:  # filtered before the window: another window (its conjuncts, canonical)
        node = window_node(replace(f, window=replace(w, filter=None)), stream, instant_seconds, scope)
        return replace(node, parm=node.parm + (("filter", canonical_conjuncts(w.filter, {f.name: 0})),))
    if w.kind == "rows":
        return Node("tuple_win", (("levels", levels), ("rows", int(w.rows))), (), stream, scope)
    if w.kind == "partition":
        by = frozenset(a.lower() for a in w.partition_by)
        if "level" in by and len(levels) == 1:
            by = by - {"level"}  # one level: partitioning by level changes nothing
        if not by:
            return Node("tuple_win", (("levels", levels), ("rows", int(w.rows))), (), stream, scope)
        return Node("part_win", (("by", by), ("levels", levels), ("rows", int(w.rows))), (), stream, scope)
    if w.kind == "range":
        parm = (("kind", "range"), ("levels", levels), ("range", w.range_instants(instant_seconds)))
        slide = w.slide_instants(instant_seconds)
        return Node("time_win", parm + ((("slide", slide),) if slide is not None else ()), (), stream, scope)
    return Node("time_win", (("kind", w.kind), ("levels", levels)), (), stream, scope)


def build_tree(cq, mode: str = "trusted", instant_seconds: float = 1.0) -> OperatorTree:
    """``OPT(Q)`` of a compiled (rewritten, optimized) query.

    Shape: one window per FROM item → a select of the conjuncts reading only
    that item → (joins) a join of the conjuncts reading several items (and
    constant ones) → aggregate → select of the HAVING conjuncts → project → R2S.
    """
    if mode not in ("trusted", "replicated"):
        raise ValueError("mode must be 'replicated' or 'trusted'")
    if cq.subqueries:  # a query over subqueries: their trees below the outer query's
        subs = tuple(build_tree(s, mode, instant_seconds).root.inputs[0] for s in cq.subqueries if s is not None)
        outer = build_tree(cq.outer, mode, instant_seconds).root
        top = Node("derived", (("outer", outer),), subs)
        return OperatorTree(Node("r2s", (("r2s", cq.r2s),), (top,)), cq.level, cq.text)
    if cq.branches:  # a compound query: its SELECTs' trees below one set operator node, then its R2S
        subs = tuple(build_tree(b, mode, instant_seconds).root.inputs[0] for b in cq.branches)
        top = Node("set_op", (("ops", tuple(cq.set_ops)),), subs)
        return OperatorTree(Node("r2s", (("r2s", cq.r2s),), (top,)), cq.level, cq.text)
    scope = cq.level if mode == "replicated" else None
    names = item_names(cq)
    q = cq.query
    wins = [window_node(f, it.stream, instant_seconds, scope) for f, it in zip(q.from_, cq.items)]
    conj = canonical_conjuncts(q.where, names)
    per_item: list[set] = [set() for _ in wins]
    multi: set = set()
    for c in conj:
        used = item_of(c)
        if len(used) == 1 and len(wins) > 1:
            per_item[next(iter(used))].add(c)
        elif len(wins) == 1:
            per_item[0].add(c)
        else:
            multi.add(c)
    inputs = []
    for w, cs in zip(wins, per_item):
        inputs.append(Node("select", (("cond", frozenset(cs)),), (w,)) if cs else w)
    top = inputs[0] if len(inputs) == 1 else Node("join", (("cond", frozenset(multi)),), tuple(inputs))
    sel = [canonical_expr(s.expr, names) for s in q.select]
    if cq.is_aggregate:
        group_by = tuple(canonical_expr(g, names) for g in q.group_by)
        having = canonical_conjuncts(q.having, names)
        aggs = frozenset(a for e in sel + list(having) for a in A.aggregates_in(e))
        top = Node("aggregate", (("aggs", aggs), ("group_by", group_by)), (top,))
        if having:
            top = Node("select", (("cond", having),), (top,))
    top = Node("project", (("attr", frozenset(sel)),), (top,))
    top = Node("r2s", (("r2s", cq.r2s),), (top,))
    return OperatorTree(top, cq.level, cq.text)


def with_inputs(n: Node, inputs) -> Node:
    return replace(n, inputs=tuple(inputs))
