"""MLS-CQL expressions (``strata.mlscql.ast``) → Spark SQL expression text.

The engine builds each chunk's whole plan as one Spark SQL statement: one
parse and one analysis on the JVM instead of hundreds of Py4J calls for the
equivalent DataFrame-API construction (which dominated small-chunk latency).

Semantics (SEMANTICS §5): SQL three-valued logic (Spark's, unchanged); ``/``
always yields a double and ``x / 0`` is NULL (the session runs with ANSI mode
off); ``%`` is Java's remainder (sign of the dividend), which is Spark's ``%``;
integer literals are 64-bit, decimal literals doubles.  ``level`` is the
tuple's canonical level string: ``=``/``!=``/``IN`` against a level literal
compare strings and ``level DOMINATED BY X`` is membership in
``lattice.dominated(X)``.

Output levels travel as bitmasks (``Lattice.encode``; OR of masks decodes to
the lub); :func:`level_of_mask` is the SQL that turns such a mask back into the
canonical level string.
"""

from __future__ import annotations

import math
from typing import Callable

from strata.lattice import ChineseWall, Lattice, TotalOrder
from strata.mlscql import ast as A

__all__ = ["SqlCompiler", "SPARK_TYPES", "level_of_mask", "sql_string", "ident", "sql_literal"]

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


class SqlCompiler:
    """Compiles expression trees to Spark SQL text.

    ``resolve(Column)`` gives the SQL text of a qualified MLS-CQL column.
    ``subst(expr)``, checked at every node before anything else, may return
    ready SQL for a whole subtree: after GROUP BY, group expressions and
    aggregates are replaced by the columns the aggregation produced.
    """

    def __init__(
        self,
        lattice: Lattice,
        resolve: Callable[[A.Column], str],
        subst: Callable[[A.Expr], str | None] | None = None,
    ):
        self.lattice = lattice
        self.resolve = resolve
        self.subst = subst

    def __call__(self, e: A.Expr) -> str:
        return self.compile(e)

    def compile(self, e: A.Expr) -> str:
        if self.subst is not None:
            hit = self.subst(e)
            if hit is not None:
                return hit
        c = self.compile
        if isinstance(e, A.Column):
            return self.resolve(e)
        if isinstance(e, A.Literal):
            return sql_literal(e.value, e.type)
        if isinstance(e, A.LevelLiteral):
            return sql_string(e.text)
        if isinstance(e, A.Unary):
            return f"(NOT {c(e.operand)})" if e.op == "NOT" else f"(- {c(e.operand)})"
        if isinstance(e, A.Binary):
            l, r = c(e.left), c(e.right)
            if e.op == "/":
                return f"(CAST({l} AS DOUBLE) / CAST({r} AS DOUBLE))"
            return f"({l} {_OPS[e.op]} {r})"
        if isinstance(e, A.InList):
            if not e.items:
                return "TRUE" if e.negated else "FALSE"
            items = ", ".join(c(i) for i in e.items)
            return f"({c(e.operand)} {'NOT IN' if e.negated else 'IN'} ({items}))"
        if isinstance(e, A.DominatedBy):
            levels = ", ".join(sql_string(lv) for lv in self.lattice.sort(self.lattice.dominated(e.level.text)))
            return f"({c(e.operand)} IN ({levels}))"
        if isinstance(e, A.IsNull):
            return f"({c(e.operand)} IS {'NOT ' if e.negated else ''}NULL)"
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
