"""Sharing analysis: subsumption (Def. 3, 11), decomposition (Def. 9, 12), the
sharing classifier (Def. 5-8) and merged operator trees (Alg. 1) with reference
counts.

:class:`SharedPlan` is the plan analyzer's buffer (dissertation §6.1, §9.1.2):
the merged operator DAG of every running query.  Adding a query places its
operator tree bottom-up into the DAG:

1. a node equivalent to one in the DAG (Def. 2) is reused;
2. otherwise, if the query's node is *subsumed* by a DAG node (Def. 3/11),
   it is decomposed (Def. 9/12) into the subsuming node ``N'`` (reused) and a
   residual node ``N''`` over ``N'``'s output:

   * select: ``N''`` selects the conjuncts ``N_i`` has and ``N_j`` has not;
   * project: ``N''`` projects ``N_i``'s attributes from ``N_j``'s output;
   * window (Def. 11 case 3, ``sel_win``): a RANGE / UNBOUNDED / NOW window, or
     a PARTITION BY window partitioned by ``level``, over level set ``A`` is the
     same window over ``B ⊇ A`` with the level condition ``level ∈ A`` applied
     after it (filtering before and after such a window are the same,
     docs/semantics.md §4).  The condition joins the select above the window,
     where select subsumption can then share it (Fig. 5.2(c), Q6/Q7);
   * window (Def. 11 case 4, made exact): ``ROWS n`` over a single level
     ``{l}`` (or ``PARTITION BY a.. ROWS n`` over ``{l}``) is
     ``PARTITION BY level[, a..] ROWS n`` over ``B ∋ l`` restricted to ``l``.
     (As printed, case 4 accepts any level set; with two or more levels the last
     ``n`` tuples overall are not the last ``n`` per level, so Strata requires one.)
     A ``ROWS`` window is never subsumed by a ``ROWS`` window over more levels
     (Qe/Qf): tuples of the other levels push tuples out of the window;
3. otherwise the node is new.

Blocking operators (windows aside, as above; join, aggregate, R2S) are
shared only when equivalent.  Every DAG node counts the queries that use it;
removing a query drops the nodes no remaining query uses, so a shared plan
stays while any query uses it.

Modes: ``replicated`` shares only between queries of the same level (one
query processor per level, §5.2); ``trusted`` may share across levels (§6.3):
what is shared is always a node whose input is exactly the same tuples, so
the sharing query can never see a tuple its own rewritten windows exclude.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.mlscql import ast as A

from .optree import WINDOW_OPS, Node, OperatorTree, build_tree, describe, with_inputs

__all__ = ["SharedPlan", "Decision", "Placement", "classify", "subsumed_by", "KINDS", "STRENGTH"]

KINDS = ("complete", "loose_partial", "strict_partial", "none")
STRENGTH = {"complete": 3, "loose_partial": 2, "strict_partial": 1, "none": 0}


def _level_cond(item: int, levels: frozenset[str], lattice=None) -> A.Expr:
    col = A.Column(f"${item}", "level")
    order = list(lattice.sort(levels)) if lattice is not None else sorted(levels)
    if len(order) == 1:
        return A.Binary("=", col, A.LevelLiteral(order[0]))
    return A.InList(col, tuple(sorted((A.LevelLiteral(x) for x in order), key=repr)), False, False)


def subsumed_by(ni: Node, nj: Node) -> dict | None:
    """If ``ni ⊆ nj`` (Def. 3 / Def. 11), the decomposition residual, else None.

    Returns ``{"kind": ..., "residual": ...}``: for select, the conjuncts ``ni``
    adds; for project, ``ni``'s attributes; for windows, the level set of ``ni``.
    """
    if ni == nj:
        return None
    if ni.op == nj.op == "select" and ni.inputs == nj.inputs:
        ci, cj = ni.param("cond"), nj.param("cond")
        if cj < ci:
            return {"kind": "select", "residual": ci - cj}
        return None
    if ni.op == nj.op == "project" and ni.inputs == nj.inputs:
        ai, aj = ni.param("attr"), nj.param("attr")
        if ai < aj:
            return {"kind": "project", "residual": ai}
        return None
    if ni.op in WINDOW_OPS and nj.op in WINDOW_OPS:
        if ni.stream != nj.stream or ni.scope != nj.scope:
            return None
        li, lj = ni.levels, nj.levels
        if not li < lj:
            return None
        # ni is nj followed by a level selection only if both are evaluated at the same instants
        # (a window narrowed by Alg. 4 keeps its wider set's instants: SEMANTICS §5, issue 16)
        if (ni.param("instants") or li) != (nj.param("instants") or lj):
            return None
        pi = {k: v for k, v in ni.parm if k not in ("levels", "instants")}
        pj = {k: v for k, v in nj.parm if k not in ("levels", "instants")}
        if ni.op == nj.op == "time_win" and pi == pj:
            return {"kind": "sel_win", "residual": li}
        if ni.op == nj.op == "part_win" and pi == pj and "level" in pi["by"]:
            return {"kind": "sel_win", "residual": li}
        if nj.op == "part_win" and len(li) == 1 and ni.op in ("tuple_win", "part_win"):
            by_i = pi.get("by", frozenset())
            if pj["by"] == by_i | {"level"} and pj["rows"] == pi["rows"]:
                return {"kind": "part_win", "residual": li}
    return None


@dataclass
class Placement:
    """How one node of a query's tree was placed in the DAG."""

    node: Node  # the DAG node the query uses
    how: str  # equivalent | decomposed | new
    via: Node | None = None  # for decomposed: the subsuming node N' reused
    rule: str | None = None  # select | project | sel_win | part_win
    orig: Node | None = None  # for decomposed: the query's own (subsumed) node


@dataclass
class Decision:
    """The sharing decision between a query and one other query of the plan."""

    query: str
    other: str
    kind: str  # complete | loose_partial | strict_partial | none
    shared: list[Node] = field(default_factory=list)  # DAG nodes both use
    subsumed: list[tuple[Node, Node]] = field(default_factory=list)  # (subsumed node, subsuming node)
    reason: str = ""

    def to_json(self, lattice=None) -> dict:
        return {
            "query": self.query, "with": self.other, "kind": self.kind,
            "shared": [describe(n, lattice) for n in self.shared],
            "subsumed": [{"node": describe(a, lattice), "by": describe(b, lattice)} for a, b in self.subsumed],
            "reason": self.reason,
        }


@dataclass
class _Entry:
    query_id: str
    cq: object
    tree: OperatorTree
    root: Node
    nodes: list[Node]
    placements: list[Placement]


class SharedPlan:
    """The merged operator DAG of a set of queries (Alg. 1 with Def. 9/12 decomposition)."""

    def __init__(self, mode: str = "replicated", instant_seconds: float = 1.0, lattice=None):
        if mode not in ("replicated", "trusted"):
            raise ValueError("mode must be 'replicated' or 'trusted'")
        self.mode = mode
        self.instant_seconds = instant_seconds
        self.lattice = lattice
        self.users: dict[Node, set[str]] = {}  # DAG node → queries using it (reference counts)
        self.queries: dict[str, _Entry] = {}

    # -- Alg. 1 -------------------------------------------------------------------------
    def add(self, query_id: str, cq) -> list[Decision]:
        """Merge ``cq``'s tree into the DAG; returns its decisions against every other query."""
        if query_id in self.queries:
            raise ValueError(f"query {query_id!r} is already in the plan")
        tree = build_tree(cq, self.mode, self.instant_seconds)
        placements: list[Placement] = []
        root = self._place(tree.root, placements)
        nodes = root.walk()
        for n in nodes:
            self.users.setdefault(n, set()).add(query_id)
        entry = _Entry(query_id, cq, tree, root, nodes, placements)
        self.queries[query_id] = entry
        return [self._decide(entry, other) for other in self.queries.values() if other is not entry]

    def remove(self, query_id: str) -> list[Node]:
        """Drop a query; returns the DAG nodes no remaining query uses (now gone)."""
        entry = self.queries.pop(query_id, None)
        if entry is None:
            return []
        gone = []
        for n in entry.nodes:
            users = self.users.get(n)
            if users is None:
                continue
            users.discard(query_id)
            if not users:
                del self.users[n]
                gone.append(n)
        return gone

    def _place(self, n: Node, out: list[Placement], extra: frozenset = frozenset()) -> Node:
        """Place ``n`` (inputs first); ``extra``: level conjuncts lifted out of a subsumed window below."""
        if n.op in WINDOW_OPS:
            return self._place_window(n, out)
        inputs = []
        lifted: list[tuple[int, frozenset]] = []
        for k, c in enumerate(n.inputs):
            if c.op in WINDOW_OPS:
                w = self._place_window(c, out)
                if w != c:  # decomposed into the subsuming window: the level condition goes above it
                    pos = self._item_position(n, k)
                    lifted.append((k, frozenset({_level_cond(pos, c.levels, self.lattice)})))
                inputs.append(w)
            else:
                inputs.append(self._place(c, out))
        if lifted:
            if n.op == "select":
                n = Node("select", (("cond", n.param("cond") | lifted[0][1]),), tuple(inputs))
                return self._place_select(n, out)
            # a window with no select above it: insert one
            for k, cond in lifted:
                inputs[k] = self._place_select(Node("select", (("cond", cond),), (inputs[k],)), out)
        node = with_inputs(n, inputs)
        if node.op == "select":
            return self._place_select(node, out)
        if node.op == "project":
            return self._place_project(node, out)
        return self._reuse_or_new(node, out)

    @staticmethod
    def _item_position(parent: Node, k: int) -> int:
        # selects and single-input operators sit over item 0 unless under a join; joins list items in order
        return k if parent.op == "join" else _item_hint(parent)

    def _reuse_or_new(self, node: Node, out: list[Placement]) -> Node:
        out.append(Placement(node, "equivalent" if node in self.users else "new"))
        return node

    def _subsumer(self, n: Node, rank=None) -> tuple[Node, dict] | None:
        """The user node that subsumes ``n`` (:func:`subsumed_by`) with the smallest ``rank`` (the
        first of equals; without ``rank``, the first found) and how it does; None if none does."""
        best = None
        for cand in self.users:
            sub = subsumed_by(n, cand)
            if sub is None:
                continue
            if rank is None:
                return cand, sub
            if best is None or rank(cand) < rank(best[0]):
                best = (cand, sub)
        return best

    def _place_window(self, w: Node, out: list[Placement]) -> Node:
        if w in self.users:
            out.append(Placement(w, "equivalent"))
            return w
        best = self._subsumer(w, rank=lambda cand: len(cand.levels))  # the narrowest level set
        if best is None:
            out.append(Placement(w, "new"))
            return w
        out.append(Placement(best[0], "decomposed", via=best[0], rule=best[1]["kind"], orig=w))
        return best[0]

    def _place_select(self, s: Node, out: list[Placement]) -> Node:
        return self._place_residual(s, out, rank=lambda cand: -len(cand.param("cond")))  # the most conditions

    def _place_project(self, p: Node, out: list[Placement]) -> Node:
        return self._place_residual(p, out)

    def _place_residual(self, n: Node, out: list[Placement], rank=None) -> Node:
        """A select or project: itself if a user has it, else a user's node that subsumes it (the best
        by ``rank``) with the residual operator over it (the conditions or attributes left), else new."""
        if n in self.users:
            out.append(Placement(n, "equivalent"))
            return n
        best = self._subsumer(n, rank)
        if best is None:
            out.append(Placement(n, "new"))
            return n
        cand, sub = best
        out.append(Placement(cand, "decomposed", via=cand, rule=n.op, orig=n))
        rest = Node(n.op, (({"select": "cond", "project": "attr"}[n.op], sub["residual"]),), (cand,))
        out.append(Placement(rest, "equivalent" if rest in self.users else "new"))
        return rest

    # -- Def. 5-8 ---------------------------------------------------------------------------
    def _decide(self, x: _Entry, y: _Entry) -> Decision:
        d = Decision(x.query_id, y.query_id, "none")
        if self.mode == "replicated" and x.cq.level != y.cq.level:
            d.reason = (f"replicated mode shares only within a level: {x.query_id} runs at {x.cq.level}, "
                        f"{y.query_id} at {y.cq.level}")
            return d
        ynodes = set(y.nodes)
        if x.root == y.root:
            d.kind = "complete"
            d.shared = list(x.nodes)
            d.reason = "equivalent operator trees (Def. 4): evaluated once"
            return d
        d.shared = [n for n in x.nodes if n in ynodes]
        d.subsumed = [(p.orig, p.via) for p in x.placements if p.how == "decomposed" and p.via in ynodes]
        # the other direction: a node of y subsumed by a node of x (y arrived first and is narrower)
        for n in y.tree.nodes:
            for m in x.nodes:
                if subsumed_by(n, m) is not None and (n, m) not in d.subsumed:
                    d.subsumed.append((n, m))
        if d.subsumed:
            d.kind = "loose_partial"
            d.reason = "; ".join(self._why_subsumed(a, b) for a, b in d.subsumed)
            if d.shared:
                d.reason += "; shared: " + ", ".join(self._d(n) for n in d.shared)
        elif d.shared:
            d.kind = "strict_partial"
            d.reason = ("equivalent operators shared (Def. 7): " + ", ".join(self._d(n) for n in d.shared)
                        + "; the operators above them differ and none subsumes another")
        else:
            d.reason = self._why_not(x, y)
        return d

    def _d(self, n: Node) -> str:
        return describe(n, self.lattice)

    def _why_subsumed(self, a: Node, b: Node) -> str:
        sub = subsumed_by(a, b) or {"kind": "select"}
        if a.op in WINDOW_OPS:
            return f"{self._d(a)} is {self._d(b)} followed by a level selection (Def. 11, {sub['kind']})"
        if a.op == "select":
            return f"{self._d(a)} is subsumed by {self._d(b)}: decomposed into it and a residual selection (Def. 9)"
        return f"{self._d(a)} is subsumed by {self._d(b)} (Def. 3)"

    def _why_not(self, x: _Entry, y: _Entry) -> str:
        wx = [n for n in x.tree.nodes if n.op in WINDOW_OPS]
        wy = [n for n in y.tree.nodes if n.op in WINDOW_OPS]
        streams = {n.stream for n in wx} & {n.stream for n in wy}
        if not streams:
            return "no common input stream"
        parts = []
        for a in wx:
            for b in wy:
                if a.stream != b.stream:
                    continue
                if a.op == b.op == "tuple_win" and a.param("rows") == b.param("rows") and a.levels != b.levels:
                    parts.append(f"{self._d(a)} and {self._d(b)}: a tuple-based window over other levels "
                                 "holds other tuples (tuples of the extra levels push others out), "
                                 "neither equivalent nor subsumed")
                else:
                    parts.append(f"{self._d(a)} and {self._d(b)} are neither equivalent nor subsumed")
        return "windows differ: " + "; ".join(parts)

    # -- views ----------------------------------------------------------------------------------
    def decisions(self, query_id: str) -> list[Decision]:
        x = self.queries[query_id]
        return [self._decide(x, y) for y in self.queries.values() if y is not x]

    def groups(self) -> list[list[str]]:
        """Queries in classes of complete sharing (equal roots), in registration order."""
        by_root: dict[Node, list[str]] = {}
        for qid, e in self.queries.items():
            by_root.setdefault(e.root, []).append(qid)
        return list(by_root.values())

    def shared_nodes(self) -> list[tuple[Node, list[str]]]:
        return [(n, sorted(u)) for n, u in self.users.items() if len(u) > 1]

    @property
    def node_count(self) -> int:
        return len(self.users)

    def unshared_node_count(self) -> int:
        return sum(len(e.tree.nodes) for e in self.queries.values())

    def to_json(self) -> dict:
        pairs = []
        ids = list(self.queries)
        for i, a in enumerate(ids):
            for b in ids[:i]:
                pairs.append(self._decide(self.queries[a], self.queries[b]).to_json(self.lattice))
        return {
            "mode": self.mode,
            "queries": {qid: {"level": e.cq.level, "root": self._d(e.root),
                              "nodes": len(e.nodes)} for qid, e in self.queries.items()},
            "nodes": self.node_count,
            "nodes_without_sharing": self.unshared_node_count(),
            "shared_nodes": [{"node": self._d(n), "queries": q} for n, q in self.shared_nodes()],
            "complete_groups": [g for g in self.groups() if len(g) > 1],
            "decisions": pairs,
        }


def _item_hint(parent: Node) -> int:
    """FROM position of the item a single-item select reads (``$k`` of its conjuncts; 0 if none)."""
    if parent.op == "select":
        for c in parent.param("cond"):
            for col in A.columns_in(c):
                if col.qualifier and col.qualifier.startswith("$"):
                    return int(col.qualifier[1:])
    return 0


def classify(cq_x, cq_y, mode: str = "replicated", instant_seconds: float = 1.0, lattice=None,
             names: tuple[str, str] = ("Qx", "Qy")) -> Decision:
    """The sharing decision for a new query ``cq_x`` against an ongoing query ``cq_y``."""
    plan = SharedPlan(mode, instant_seconds, lattice)
    plan.add(names[1], cq_y)
    return plan.add(names[0], cq_x)[0]
