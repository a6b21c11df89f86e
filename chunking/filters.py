"""Window conditions (``[ROWS 10 WHERE bp > 100]``) evaluated on Arrow tables, as Spark evaluates them.

A window condition filters its stream *before* the window, so the chunker must evaluate it to
cut a ROWS window's legacy (the last N tuples that pass).  The analyzer admits only what
evaluates here exactly as in the engine's Spark SQL (``worker/expr.py``, SEMANTICS §8):

* comparisons, with a long next to a double compared as doubles and Spark's NaN rules
  (``NaN = NaN``; NaN is greater than every other double);
* AND / OR / NOT in three-valued logic, ``IN`` / ``NOT IN`` (SQL's: NULL when no item matches
  and the operand or an item is NULL), ``IS [NOT] NULL``;
* ``+ - *`` and unary minus on doubles (IEEE, as Java), ``/`` always a double with ``x / 0``
  NULL.  64-bit integer arithmetic and ``%`` are refused by the analyzer: their overflow
  checks belong to the engine.

A tuple passes when its condition is TRUE (NULL and FALSE drop it).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from strata.mlscql import ast as A

__all__ = ["passes"]

_ARROW = {"long": pa.int64(), "double": pa.float64(), "string": pa.string(), "boolean": pa.bool_()}


def passes(e: A.Expr, table: pa.Table) -> pa.Array:
    """A boolean array, TRUE exactly for the rows of ``table`` on which ``e`` is TRUE (no NULLs)."""
    n = table.num_rows
    v = _eval(e, table, {c.lower(): c for c in table.column_names})
    if isinstance(v, pa.Scalar):
        return pa.array([v.as_py() is True] * n, pa.bool_())
    if isinstance(v, pa.ChunkedArray):
        v = v.combine_chunks()
    if v.type != pa.bool_():
        raise ValueError(f"a window condition evaluated to {v.type}, not a boolean")
    return pc.fill_null(v, False)


def _eval(e: A.Expr, t: pa.Table, names: dict[str, str]):
    if isinstance(e, A.Column):
        name = names.get(e.name.lower())
        if name is None:
            raise ValueError(f"the stream has no attribute {e.name!r}")
        return t.column(name)
    if isinstance(e, A.Literal):
        if e.type == "null" or e.value is None:
            return pa.scalar(None, pa.null())
        return pa.scalar(e.value, _ARROW[e.type])
    if isinstance(e, A.Unary):
        x = _eval(e.operand, t, names)
        if e.op == "NOT":
            return pc.invert(_bool(x))
        return pc.negate(_double(x))
    if isinstance(e, A.IsNull):
        x = _eval(e.operand, t, names)
        if _is_null(x):
            return pa.scalar(not e.negated)
        return pc.is_valid(x) if e.negated else pc.is_null(x)
    if isinstance(e, A.InList):
        x = _eval(e.operand, t, names)
        out = pa.scalar(False)
        for item in e.items:
            out = pc.or_kleene(out, _compare("=", x, _eval(item, t, names)))
        return pc.invert(out) if e.negated else out
    if isinstance(e, A.Binary):
        if e.op in ("AND", "OR"):
            a, b = _bool(_eval(e.left, t, names)), _bool(_eval(e.right, t, names))
            return pc.and_kleene(a, b) if e.op == "AND" else pc.or_kleene(a, b)
        a, b = _eval(e.left, t, names), _eval(e.right, t, names)
        if e.op in A.COMPARISONS:
            return _compare(e.op, a, b)
        return _arith(e.op, a, b)
    raise ValueError(f"{type(e).__name__} is not supported in a window condition")


def _is_null(x) -> bool:
    return x.type == pa.null()


def _bool(x):
    return pa.scalar(None, pa.bool_()) if _is_null(x) else x


def _double(x):
    if _is_null(x):
        return pa.scalar(None, pa.float64())
    # a long becomes the nearest double, as Java's (double) cast (beyond 2**53 that rounds)
    return x if x.type == pa.float64() else pc.cast(x, pa.float64(), safe=False)


def _compare(op: str, a, b):
    if _is_null(a) or _is_null(b):
        return pa.scalar(None, pa.bool_())
    if pa.types.is_floating(a.type) or pa.types.is_floating(b.type):
        a, b = _double(a), _double(b)
        return _compare_doubles(op, a, b)
    fn = {"=": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal,
          ">": pc.greater, ">=": pc.greater_equal}[op]
    return fn(a, b)


def _compare_doubles(op: str, a, b):
    """Spark's double comparisons: NaN equals NaN and is greater than every other value."""
    if op in ("=", "!="):
        eq = pc.or_kleene(pc.equal(a, b), pc.and_kleene(pc.is_nan(a), pc.is_nan(b)))
        return eq if op == "=" else pc.invert(eq)
    if op in (">", ">="):
        return _compare_doubles("<" if op == ">" else "<=", b, a)
    lt = pc.or_kleene(pc.less(a, b), pc.and_kleene(pc.invert(pc.is_nan(a)), pc.is_nan(b)))
    return lt if op == "<" else pc.or_kleene(lt, _compare_doubles("=", a, b))


def _arith(op: str, a, b):
    a, b = _double(a), _double(b)
    if op == "+":
        return pc.add(a, b)
    if op == "-":
        return pc.subtract(a, b)
    if op == "*":
        return pc.multiply(a, b)
    if op == "/":  # always a double; x / 0 (also -0.0) is NULL, as Spark's Divide with ANSI off
        zero = pc.equal(b, pa.scalar(0.0))
        return pc.if_else(zero, pa.scalar(None, pa.float64()), pc.divide(a, b))
    raise ValueError(f"{op} is not supported in a window condition")
