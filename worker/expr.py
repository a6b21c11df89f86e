"""MLS-CQL expressions (``strata.mlscql.ast``) → Spark SQL expression text.

The engine builds each chunk's whole plan as one Spark SQL statement: one
parse and one analysis on the JVM instead of hundreds of Py4J calls for the
equivalent DataFrame-API construction (which dominated small-chunk latency).

Semantics (SEMANTICS §5, §8): SQL three-valued logic (Spark's, unchanged); ``/``
always yields a double and ``x / 0`` is NULL (the session runs with ANSI mode
off); ``%`` is Java's remainder (sign of the dividend), which is Spark's ``%``;
integer literals are 64-bit, decimal literals doubles.  ``level`` is the
tuple's canonical level string: ``=``/``!=``/``IN`` against a level literal
compare strings and ``level DOMINATED BY X`` is membership in
``lattice.dominated(X)``.

Integer overflow (SEMANTICS §8 "Arithmetic") is never silent and never raised
inside Spark: :meth:`SqlCompiler.checked` compiles an expression to a *pair*
of SQL texts, its value and a boolean that is TRUE exactly when one of its
64-bit ``+``, ``-``, ``*`` or unary ``-`` has an exact result outside
``[-2**63, 2**63-1]`` (``try_add``/``try_subtract``/``try_multiply`` give NULL
there, which with non-NULL operands can only mean overflow).  Every function
stays total, so Catalyst may push, reorder or duplicate predicates freely and
the failure flag of a row is the same whatever plan Spark picks; the engine
decides from the flags which instant fails (see ``engine.py``).

Output levels travel as bitmasks (``Lattice.encode``; OR of masks decodes to
the lub); :func:`level_of_mask` is the SQL that turns such a mask back into the
canonical level string.
"""

from __future__ import annotations

import math
from typing import Callable

from strata.lattice import Categories, ChineseWall, Lattice, TotalOrder
from strata.mlscql import ast as A

__all__ = [
    "SqlCompiler", "SPARK_TYPES", "level_of_mask", "sql_string", "ident", "sql_literal", "expr_type",
    "sql_or", "LONG_MIN", "LONG_MAX", "INTEGRAL",
]

LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
#: MLS-CQL types held as 64-bit integers (their arithmetic is checked for overflow)
INTEGRAL = ("long", "timestamp")

#: MLS-CQL type → Spark SQL type (levels are strings; NULL-typed columns become strings)
SPARK_TYPES = {
    "string": "STRING",
    "double": "DOUBLE",
    "long": "BIGINT",
    "timestamp": "BIGINT",
    "boolean": "BOOLEAN",
    "level": "STRING",
    "null": "STRING",
}

_OPS = {"=": "=", "!=": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">=", "AND": "AND", "OR": "OR",
        "+": "+", "-": "-", "*": "*", "%": "%"}


def ident(name: str) -> str:
    """A back-quoted Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(value: str) -> str:
    """A Spark SQL string literal (backslash escapes are on by default in Spark's parser)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_literal(value, typ: str) -> str:
    if value is None or typ == "null":
        return "NULL"
    if typ == "boolean":
        return "TRUE" if value else "FALSE"
    if typ in ("long", "timestamp"):
        return f"CAST({int(value)} AS BIGINT)"
    if typ == "double":
        v = float(value)
        if math.isnan(v):
            return "CAST('NaN' AS DOUBLE)"
        if math.isinf(v):
            return "CAST('Infinity' AS DOUBLE)" if v > 0 else "CAST('-Infinity' AS DOUBLE)"
        return f"CAST({sql_string(repr(v))} AS DOUBLE)"
    return sql_string(str(value))


def expr_type(e: A.Expr, column_type: Callable[[A.Column], str | None]) -> str:
    """Static MLS-CQL type of an analyzed expression (the analyzer's typing rules, SEMANTICS §8).

    ``column_type(Column)`` gives a column's declared type.  Arithmetic is ``double`` when
    an operand is a double or the operator is ``/``, else ``long``; SUM of an integral
    argument is ``long``, AVG ``double``, COUNT ``long``, MIN/MAX the argument's type.
    """
    if isinstance(e, A.Column):
        return column_type(e) or "null"
    if isinstance(e, A.Literal):
        return e.type
    if isinstance(e, A.LevelLiteral):
        return "level"
    if isinstance(e, A.Aggregate):
        if e.arg is None or e.func == "COUNT":
            return "long"
        if e.func == "AVG":
            return "double"
        t = expr_type(e.arg, column_type)
        if e.func == "SUM":
            return "long" if t in INTEGRAL else t
        return t
    if isinstance(e, A.Unary):
        if e.op == "NOT":
            return "boolean"
        t = expr_type(e.operand, column_type)
        return "long" if t == "timestamp" else t
    if isinstance(e, A.Binary):
        if e.op in ("AND", "OR") or e.op in A.COMPARISONS:
            return "boolean"
        tl, tr = expr_type(e.left, column_type), expr_type(e.right, column_type)
        return "double" if e.op == "/" or "double" in (tl, tr) else "long"
    return "boolean"  # IN, DOMINATED BY, IS NULL


def sql_or(*flags: str | None) -> str | None:
    """OR of failure flags; ``None`` (cannot fail) is the neutral element."""
    fs = [f for f in flags if f is not None]
    if not fs:
        return None
    return fs[0] if len(fs) == 1 else "(" + " OR ".join(fs) + ")"


#: checked 64-bit operators: NULL exactly when the exact result is out of range (or an operand NULL)
_TRY = {"+": "try_add", "-": "try_subtract", "*": "try_multiply"}
_LONG_MIN_SQL = "CAST('-9223372036854775808' AS BIGINT)"


class SqlCompiler:
    """Compiles expression trees to Spark SQL text.

    ``resolve(Column)`` gives the SQL text of a qualified MLS-CQL column and
    ``column_type(Column)`` its MLS-CQL type (needed to know which arithmetic is
    64-bit and therefore checked; without it nothing is checked).
    ``subst(expr)``, checked at every node before anything else, may return
    ready SQL for a whole subtree: after GROUP BY, group expressions and
    aggregates are replaced by the columns the aggregation produced (such a
    column never fails: its failures are the aggregation's, see ``engine.py``).
    """

    def __init__(
        self,
        lattice: Lattice,
        resolve: Callable[[A.Column], str],
        subst: Callable[[A.Expr], str | None] | None = None,
        column_type: Callable[[A.Column], str | None] | None = None,
    ):
        self.lattice = lattice
        self.resolve = resolve
        self.subst = subst
        self.column_type = column_type

    def __call__(self, e: A.Expr) -> str:
        return self.compile(e)

    def compile(self, e: A.Expr) -> str:
        """The value of ``e`` (an overflowing 64-bit operation gives NULL; see :meth:`checked`)."""
        return self.checked(e)[0]

    def type_of(self, e: A.Expr) -> str:
        if self.column_type is None:
            return "null"
        return expr_type(e, self.column_type)

    def checked(self, e: A.Expr) -> tuple[str, str | None]:
        """``(value, failed)``: SQL for the value of ``e`` and for a never-NULL boolean that is
        TRUE when any 64-bit operation in ``e`` overflows on the row (``None``: ``e`` has no
        such operation).  All operands are evaluated: AND/OR do not short-circuit failures."""
        if self.subst is not None:
            hit = self.subst(e)
            if hit is not None:
                return hit, None
        c = self.checked
        if isinstance(e, A.Column):
            return self.resolve(e), None
        if isinstance(e, A.Literal):
            return sql_literal(e.value, e.type), None
        if isinstance(e, A.LevelLiteral):
            return sql_string(e.text), None
        if isinstance(e, A.Unary):
            x, fx = c(e.operand)
            if e.op == "NOT":
                return f"(NOT {x})", fx
            if self.type_of(e.operand) in INTEGRAL:
                # -(-2**63) is the only 64-bit negation that overflows
                return f"(- {x})", sql_or(fx, f"({x} <=> {_LONG_MIN_SQL})")
            return f"(- {x})", fx
        if isinstance(e, A.Binary):
            (l, fl), (r, fr) = c(e.left), c(e.right)
            if e.op == "/":
                return f"(CAST({l} AS DOUBLE) / CAST({r} AS DOUBLE))", sql_or(fl, fr)
            if e.op in _TRY and self.type_of(e) == "long" \
                    and self.type_of(e.left) in INTEGRAL and self.type_of(e.right) in INTEGRAL:
                v = f"{_TRY[e.op]}({l}, {r})"
                return v, sql_or(fl, fr, f"({v} IS NULL AND {l} IS NOT NULL AND {r} IS NOT NULL)")
            return f"({l} {_OPS[e.op]} {r})", sql_or(fl, fr)
        if isinstance(e, A.InList):
            x, fx = c(e.operand)
            if not e.items:
                return ("TRUE" if e.negated else "FALSE"), fx
            parts = [c(i) for i in e.items]
            items = ", ".join(v for v, _ in parts)
            return f"({x} {'NOT IN' if e.negated else 'IN'} ({items}))", sql_or(fx, *(f for _, f in parts))
        if isinstance(e, A.DominatedBy):
            x, fx = c(e.operand)
            levels = ", ".join(sql_string(lv) for lv in self.lattice.sort(self.lattice.dominated(e.level.text)))
            return f"({x} IN ({levels}))", fx
        if isinstance(e, A.IsNull):
            x, fx = c(e.operand)
            return f"({x} IS {'NOT ' if e.negated else ''}NULL)", fx
        if isinstance(e, A.Aggregate):
            raise ValueError(f"aggregate {e.func} outside an aggregation context")
        raise TypeError(f"cannot compile expression {e!r}")


# -- levels ---------------------------------------------------------------------


def level_of_mask(lattice: Lattice, mask: str) -> str:
    """SQL computing ``lattice.decode(mask)`` (the canonical level string) from a BIGINT mask."""
    if isinstance(lattice, TotalOrder):
        # decode = levels[bit_length(mask) - 1], bottom for 0
        levels = lattice.levels
        if len(levels) == 1:
            return sql_string(levels[0])
        whens = " ".join(f"WHEN {mask} >= {1 << k} THEN {sql_string(levels[k])}" for k in range(len(levels) - 1, 0, -1))
        return f"(CASE {whens} ELSE {sql_string(levels[0])} END)"
    if isinstance(lattice, ChineseWall):
        parts = []
        for cls, off in zip(lattice.coi, lattice.mask_offsets):
            n = len(cls)
            part = f"(shiftright({mask}, {off}) & {(1 << (n + 1)) - 1})"
            companies = f"({part} & {(1 << n) - 1})"
            whens = " ".join(f"WHEN {1 << j} THEN {sql_string(name)}" for j, name in enumerate(cls))
            parts.append(
                f"(CASE WHEN shiftright({part}, {n}) <> 0 OR bit_count({companies}) >= 2 THEN 'T' "
                f"ELSE (CASE {companies} {whens} ELSE '⊥' END) END)"
            )
        return "concat('[', " + ", ',', ".join(parts) + ", ']')"
    if isinstance(lattice, Categories):
        n = len(lattice.classes.levels)
        cls = level_of_mask(lattice.classes, f"({mask} & {(1 << n) - 1})")
        if not lattice.categories:
            return f"concat('(', {cls}, ',{{}})')"
        cats = ", ".join(f"CASE WHEN (shiftright({mask}, {n + j}) & 1) = 1 THEN {sql_string(c)} END"
                         for j, c in enumerate(lattice.categories))
        return f"concat('(', {cls}, ',{{', concat_ws(',', {cats}), '}})')"
    # any other lattice: a lookup over every mask an OR of level masks can give
    table = _reachable_masks(lattice)
    whens = " ".join(f"WHEN {m} THEN {sql_string(lv)}" for m, lv in sorted(table.items()))
    return f"(CASE {mask} {whens} END)"


def _reachable_masks(lattice: Lattice, limit: int = 1 << 12) -> dict[int, str]:
    base = set(lattice.mask_table.values())
    masks = {0} | base
    frontier = set(masks)
    while frontier:
        new = {a | b for a in frontier for b in base} - masks
        masks |= new
        frontier = new
        if len(masks) > limit:
            raise ValueError(f"{lattice.describe()}: too many level masks to decode in Spark")
    return {m: lattice.decode(m) for m in masks}
