"""MLS-CQL abstract syntax: immutable, hashable dataclasses.

The same types describe a query straight from the parser (level literals as
written, columns possibly unqualified) and after analysis/rewriting (levels
canonical, every column qualified by its FROM item's alias, every window with a
level set).  Pipelines build new trees with ``dataclasses.replace``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

__all__ = [
    "Expr", "Column", "Literal", "LevelLiteral", "Unary", "Binary", "InList", "DominatedBy",
    "IsNull", "Aggregate", "LevelClause", "Window", "FromItem", "SelectItem", "Query", "Compound", "SET_OPS",
    "AGGREGATES", "UNIT_SECONDS", "COMPARISONS", "ARITHMETIC", "walk", "children", "map_children",
    "aggregates_in", "columns_in", "conjuncts",
]

AGGREGATES = ("COUNT", "SUM", "AVG", "MIN", "MAX")
#: seconds per RANGE unit (the parser's canonical unit names)
UNIT_SECONDS = {"milliseconds": 0.001, "seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}
COMPARISONS = ("=", "!=", "<", "<=", ">", ">=")
ARITHMETIC = ("+", "-", "*", "/", "%")


@dataclass(frozen=True)
class Column:
    qualifier: str | None
    name: str


@dataclass(frozen=True)
class Literal:
    value: object  # str | int | float | bool | None
    type: str  # string | long | double | boolean | null


@dataclass(frozen=True)
class LevelLiteral:
    """A level written in a query: ``TS``, ``"S"``, ``[1,B]``."""

    text: str


@dataclass(frozen=True)
class Unary:
    op: str  # "-" | "NOT"
    operand: "Expr"


@dataclass(frozen=True)
class Binary:
    op: str  # arithmetic, comparison, AND, OR
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class InList:
    operand: "Expr"
    items: tuple["Expr", ...]
    negated: bool = False
    braces: bool = False  # written as {a,b} (level sets) rather than (a,b)


@dataclass(frozen=True)
class DominatedBy:
    operand: "Expr"
    level: LevelLiteral


@dataclass(frozen=True)
class IsNull:
    operand: "Expr"
    negated: bool = False


@dataclass(frozen=True)
class Aggregate:
    func: str  # one of AGGREGATES
    arg: "Expr | None"  # None means COUNT(*)
    distinct: bool = False  # COUNT/SUM/AVG(DISTINCT x): over the distinct non-NULL values


Expr = Union[Column, Literal, LevelLiteral, Unary, Binary, InList, DominatedBy, IsNull, Aggregate]


@dataclass(frozen=True)
class LevelClause:
    """A window's level clause: ``level in {U,C}``, ``level = S``, ``level DOMINATED BY [1,B]``."""

    form: str  # "in" | "eq" | "dominated"
    levels: tuple[str, ...]


def _instants(amount: float, unit: str | None, instant_seconds: float) -> int:
    """``amount unit`` in instants, rounded up: ``ceil(amount * unit / instant_seconds)``."""
    secs = float(amount) * UNIT_SECONDS[(unit or "seconds").lower()]
    # round away float noise (0.1 s over 0.1 s instants must stay 1, not become 2)
    return max(0, math.ceil(round(secs / float(instant_seconds), 9)))


@dataclass(frozen=True)
class Window:
    kind: str  # rows | range | unbounded | now | partition | relation (a stored relation: a level clause only)
    rows: int | None = None
    range_amount: float | None = None
    range_unit: str | None = None  # canonical unit name: seconds, minutes, hours, days, milliseconds
    partition_by: tuple[str, ...] = ()
    clause: LevelClause | None = None
    #: levels whose arrivals are the query's instants when they are not ``clause``'s: the window's
    #: level set as Alg. 3 rewrote it, kept when Alg. 4 narrows ``clause`` with a WHERE level
    #: condition (SEMANTICS §5: optimization never changes the instants); None: ``clause``'s
    instants: tuple[str, ...] | None = None
    #: ``RANGE T SLIDE S``: the window at τ is the RANGE window at the last slide boundary
    #: ``⌊τ / S⌋·S`` (SEMANTICS: evaluated at slide boundaries); None: no SLIDE (S = 1 instant)
    slide_amount: float | None = None
    slide_unit: str | None = None
    #: ``[ROWS 10 WHERE bp > 100]``: a condition on the item's own attributes that filters the
    #: stream *before* the window, like the level clause; it does not change the instants (the
    #: tuples it drops are still arrivals of the visible substream).  A left-nested AND of the
    #: written conjuncts other than the level condition; None: no filter
    filter: "Expr | None" = None

    def slide_instants(self, instant_seconds: float) -> int | None:
        """``S`` of ``SLIDE amount unit`` in instants (rounded up like :meth:`range_instants`), or
        None without SLIDE; a slide of one instant is no slide at all."""
        if self.slide_amount is None:
            return None
        s = _instants(self.slide_amount, self.slide_unit, instant_seconds)
        return None if s == 1 else s

    def range_instants(self, instant_seconds: float) -> int:
        """``T`` of ``RANGE amount unit`` in instants: ``ceil(amount * unit / instant_seconds)``.

        The chunker (legacy) and the engine (window contents) must agree on it, so
        both call this.
        """
        return _instants(self.range_amount, self.range_unit, instant_seconds)

    @property
    def levels(self) -> frozenset[str] | None:
        """The window's level set once rewriting made it an explicit ``in`` set."""
        if self.clause is None:
            return None
        if self.clause.form not in ("in", "eq"):
            raise ValueError("level set of a DOMINATED BY clause needs the lattice; rewrite the query first")
        return frozenset(self.clause.levels)


@dataclass(frozen=True)
class FromItem:
    stream: str
    window: Window | None = None
    alias: str | None = None
    #: ``FROM (SELECT …) x``: a derived table, the relation of this query at each instant (then
    #: ``stream`` and ``alias`` are its name and there is no window)
    subquery: "Query | Compound | None" = None

    @property
    def name(self) -> str:
        """How columns of this item are qualified: the alias, else the stream name."""
        return self.alias or self.stream


@dataclass(frozen=True)
class SelectItem:
    expr: Expr
    alias: str | None = None


@dataclass(frozen=True)
class Query:
    select: tuple[SelectItem, ...] | None  # None means SELECT *
    from_: tuple[FromItem, ...]
    where: Expr | None = None
    group_by: tuple[Expr, ...] = ()
    having: Expr | None = None
    r2s: str | None = None  # ISTREAM | RSTREAM | DSTREAM, None = default
    wrapped: bool = False  # written as ISTREAM(SELECT ...)
    #: SELECT DISTINCT: one row per distinct value tuple, at the lub of the rows it stands for. After
    #: analysis ``group_by`` holds the select list's expressions (the engine groups by them)
    distinct: bool = False

    @property
    def distinct_rows(self) -> bool:
        """SELECT DISTINCT over grouped rows (GROUP BY other than the select list, aggregates or
        HAVING): the groups' rows are made distinct after the grouping.  Without those, the
        analyzer's grouping by the select list is the whole of DISTINCT."""
        if not self.distinct:
            return False
        plain = tuple(s.expr for s in self.select or ())
        return (self.having is not None or self.group_by != plain
                or any(aggregates_in(s.expr) for s in self.select or ()))


#: the set operators between the SELECTs of a compound query
SET_OPS = ("UNION ALL", "UNION", "EXCEPT", "INTERSECT")


@dataclass(frozen=True)
class Compound:
    """``q1 UNION [ALL] q2 EXCEPT q3 …``, left to right: ``ops[k]`` stands between ``branches[k]``
    and ``branches[k + 1]``.  A later branch may itself be a compound (written in parentheses, or
    an INTERSECT, which binds tighter); the first is a SELECT.  The branches carry no stream
    operator; ``r2s`` applies to the combined relation."""

    branches: tuple["Query | Compound", ...]
    ops: tuple[str, ...]
    r2s: str | None = None
    wrapped: bool = False


def children(e: Expr) -> list[Expr]:
    """The direct sub-expressions of ``e``, left to right."""
    if isinstance(e, Unary):
        return [e.operand]
    if isinstance(e, Binary):
        return [e.left, e.right]
    if isinstance(e, InList):
        return [e.operand, *e.items]
    if isinstance(e, (DominatedBy, IsNull)):
        return [e.operand]
    if isinstance(e, Aggregate) and e.arg is not None:
        return [e.arg]
    return []


def map_children(e: Expr, f) -> Expr:
    """``e`` with ``f`` applied to each direct sub-expression (leaves are returned as they are).

    Expression rewrites (dropping qualifiers, canonical forms) handle the nodes they care
    about and leave the rest of the tree's shape to this one function."""
    if isinstance(e, Unary):
        return Unary(e.op, f(e.operand))
    if isinstance(e, Binary):
        return Binary(e.op, f(e.left), f(e.right))
    if isinstance(e, InList):
        return InList(f(e.operand), tuple(f(i) for i in e.items), e.negated, e.braces)
    if isinstance(e, DominatedBy):
        return DominatedBy(f(e.operand), e.level)
    if isinstance(e, IsNull):
        return IsNull(f(e.operand), e.negated)
    if isinstance(e, Aggregate) and e.arg is not None:
        return Aggregate(e.func, f(e.arg), e.distinct)
    return e


def walk(e: Expr):
    """Pre-order traversal of an expression tree."""
    yield e
    for c in children(e):
        yield from walk(c)


def aggregates_in(e: Expr | None) -> list[Aggregate]:
    return [] if e is None else [x for x in walk(e) if isinstance(x, Aggregate)]


def columns_in(e: Expr | None) -> list[Column]:
    return [] if e is None else [x for x in walk(e) if isinstance(x, Column)]


def conjuncts(e: Expr | None) -> list[Expr]:
    """The operands of a tree of ANDs, left to right (none for no expression)."""
    if e is None:
        return []
    if isinstance(e, Binary) and e.op == "AND":
        return conjuncts(e.left) + conjuncts(e.right)
    return [e]
