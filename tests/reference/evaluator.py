"""Brute-force reference evaluation of MLS-CQL (SEMANTICS.md §1-§5).

Obviously-correct over fast: at every instant the windows are recomputed from
the whole visible substream, the FROM items are cross-multiplied, and R(τ) is
built from scratch.  The *original* parsed query is evaluated with the raw
semantics (window level clause filters before the window, WHERE level
conditions after it); the front end's rewritten/optimized query is never used,
so comparing the engine against this also checks the rewriting.

``compile_query`` is used only to decide whether the query is accepted (a
rejected query raises the same ``QueryError`` here) and to cross-check the
number of output columns.

Facts copied from SEMANTICS.md (nothing here reads ../shared at run time):

* visible substream of a FROM item = tuples whose level is in the window level
  clause's set (all levels without one; ``DOMINATED BY X`` = dominated(X))
  ∩ dominated(L), in arrival order; no window = ``[RANGE UNBOUNDED]``;
* instants = distinct ``ts`` over the visible substreams of all FROM items;
* a window condition (``[ROWS 10 WHERE bp > 100]``) keeps the visible tuples on which it is
  TRUE before the window; the tuples it drops are still instants;
* ``[ROWS N]`` last N with ts ≤ τ; ``[RANGE T unit]`` τ-T < ts ≤ τ with T in
  instants = ceil(T·unit / instant_seconds); ``[NOW]`` ts = τ;
  ``[PARTITION BY a.. ROWS N]`` union of the last N per partition;
* output level = lub of contributing tuples (bottom if none); SELECT DISTINCT: one row per
  distinct value tuple, at the lub of the levels of the rows it stands for;
* ``q1 UNION [ALL] q2 EXCEPT q3``: instants of every SELECT's items; R(τ) combined left to right
  (UNION: lub of the rows of either side a value tuple stands for; EXCEPT: of the left rows);
* ISTREAM = R(τ) − R(τ'), DSTREAM = R(τ') − R(τ), RSTREAM = R(τ) (bags of
  (level, cols...)); default RSTREAM iff the select list has an aggregate.
* stored relation (``[relations.Units]``; FROM item ``Units u`` or ``Units [level in {U, C}] u``,
  no window): its input is a list of updates in arrival order, each with ``op`` = insert | delete
  (any case).  Live rows at τ: replay every update with ts ≤ τ (all levels) in arrival order; an
  insert adds a row (``ts`` = the insert's, its level and attributes), a delete removes the oldest
  live row with the same level and equal attributes (NULL = NULL, NaN = NaN, -0.0 = 0.0), and one
  matching no live row is invalid input (ValueError).  The item holds at τ the live rows whose level
  is in its visible set (level clause ∩ dominated(L)), whatever their ts; its visible substream (for
  the instants) is its visible updates, deletes included.

Failures (SEMANTICS §8 "Arithmetic", "Failing queries"), with Python's unbounded
ints: a ``+ - *`` or unary ``-`` of two 64-bit integers whose exact result is
outside [-2**63, 2**63-1] gives the value FAILED, and every operator with a
FAILED operand gives FAILED (AND and OR too: both operands are always
evaluated).  At instant τ the query fails when

* a row of the product of the windows has a FAILED top-level WHERE conjunct
  and no other conjunct that is FALSE or NULL;
* a row that passed WHERE has a FAILED select item (no aggregate), GROUP BY
  key or aggregate argument;
* a group's SUM of integers is outside the 64-bit range (every group);
* a group has a FAILED HAVING conjunct and none FALSE or NULL, or a group
  HAVING keeps has a FAILED select item.

The query's output is then the rows before τ and the failure at τ: nothing at
or after τ.  SUM of integers is exact; AVG of integers is the exact sum over
the count; a long compared with a double is compared as a double (as in SQL).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Iterable

from strata.config import Config, StreamSchema
from strata.lattice import Lattice
from strata.mlscql import ast as A
from strata.mlscql import compile_query, parse
from strata.mlscql.printer import to_text

__all__ = ["evaluate", "evaluate_outcome", "Outcome", "QueryFailed", "compare_results", "range_instants",
           "LONG_MIN", "LONG_MAX"]

LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1

#: seconds per RANGE unit (canonical unit names of the parser)
UNIT_SECONDS = {
    "milliseconds": Fraction(1, 1000),
    "seconds": Fraction(1),
    "minutes": Fraction(60),
    "hours": Fraction(3600),
    "days": Fraction(86400),
}

ISTREAM, RSTREAM, DSTREAM = "ISTREAM", "RSTREAM", "DSTREAM"


# ---------------------------------------------------------------------------
# public API


@dataclass(frozen=True)
class Outcome:
    """What a query outputs: ``rows`` (``(ts, level, col1, ...)``), and if it fails, the
    instant ``error_ts`` at which it fails (no row at or after it) and a one-line reason."""

    rows: list[tuple]
    error_ts: int | None = None
    error: str | None = None


class QueryFailed(Exception):
    """Raised by :func:`evaluate` for a query that fails; ``outcome`` has the rows before it."""

    def __init__(self, outcome: Outcome):
        super().__init__(f"the query fails at instant {outcome.error_ts}: {outcome.error}")
        self.outcome = outcome


def evaluate(query_text: str, config: Config, level: str, streams: dict[str, list[dict]]) -> list[tuple]:
    """All output rows ``(ts, level, col1, ...)`` of ``query_text`` run at ``level``.

    ``streams[name]`` holds the stream's tuples in arrival order, each a dict
    with ``ts``, ``level`` and the user attributes (None = NULL).  Raises the
    front end's ``QueryError`` for a query it rejects and :class:`QueryFailed`
    for one that fails at some instant (see :func:`evaluate_outcome`).
    """
    out = evaluate_outcome(query_text, config, level, streams)
    if out.error is not None:
        raise QueryFailed(out)
    return out.rows


def evaluate_outcome(query_text: str, config: Config, level: str, streams: dict[str, list[dict]]) -> Outcome:
    """Like :func:`evaluate`, but a failing query gives its rows before the failing instant
    and that instant with the reason instead of an exception."""
    compiled = compile_query(query_text, config, level)  # acceptance only
    ev = _evaluator_of(parse(query_text), config, config.lattice.parse(level), streams)
    rows, error_ts, error = ev.run()
    width = len(compiled.outputs) + 2
    for r in rows:
        if len(r) != width:  # pragma: no cover - a reference bug or a front-end disagreement
            raise AssertionError(
                f"reference produced {len(r) - 2} columns but the front end declares "
                f"{len(compiled.outputs)} ({[c.name for c in compiled.outputs]})"
            )
    return Outcome(rows, error_ts, error)


def range_instants(amount: float, unit: str | None, instant_seconds: float) -> int:
    """Length in instants of ``RANGE amount unit``: ceil(amount·unit / instant)."""
    secs = _exact(amount) * UNIT_SECONDS[unit or "seconds"]
    return max(1, math.ceil(secs / _exact(instant_seconds)))


def compare_results(actual: Iterable[tuple], expected: Iterable[tuple], rel: float = 1e-9) -> None:
    """Assert two output row lists are equal as bags per instant.

    Floats compare within relative ``rel`` (or absolute 1e-9); None equals
    None only.  Raises AssertionError describing the first differing instant.
    """
    act = _by_instant(actual)
    exp = _by_instant(expected)
    for ts in sorted(set(act) | set(exp)):
        a, e = act.get(ts, []), exp.get(ts, [])
        missing, extra = _bag_diff(e, a, rel)
        if missing or extra:
            lines = [f"results differ at instant ts={ts}: expected {len(e)} row(s), got {len(a)}"]
            if missing:
                lines.append(f"  missing (expected, not in actual): {len(missing)}")
                lines += [f"    - {_fmt(r)}" for r in _head(missing)]
            if extra:
                lines.append(f"  unexpected (in actual, not expected): {len(extra)}")
                lines += [f"    + {_fmt(r)}" for r in _head(extra)]
            lines.append("  expected rows at this instant:")
            lines += [f"      {_fmt(r)}" for r in _head(sorted(e, key=_sort_key))]
            lines.append("  actual rows at this instant:")
            lines += [f"      {_fmt(r)}" for r in _head(sorted(a, key=_sort_key))]
            other = sorted(t for t in set(act) | set(exp) if t > ts and _bag_diff(exp.get(t, []), act.get(t, []), rel) != ([], []))
            if other:
                lines.append(f"  later differing instants: {other[:20]}{' …' if len(other) > 20 else ''}")
            raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------------------
# comparison helpers


def _plain(v: Any) -> Any:
    """numpy / pyarrow scalars as plain Python values."""
    if type(v).__module__.split(".")[0] in ("numpy", "pyarrow") and hasattr(v, "item"):
        return v.item()
    if type(v).__module__.split(".")[0] == "pyarrow" and hasattr(v, "as_py"):
        return v.as_py()
    return v


def _by_instant(rows: Iterable[tuple]) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = defaultdict(list)
    for r in rows:
        r = tuple(_plain(v) for v in r)
        out[int(r[0])].append(r)
    return out


def _is_num(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _val_eq(x: Any, y: Any, rel: float) -> bool:
    if x is None or y is None:
        return x is None and y is None
    if _is_num(x) and _is_num(y):
        if isinstance(x, numbers.Integral) and isinstance(y, numbers.Integral):
            return int(x) == int(y)
        fx, fy = float(x), float(y)
        if math.isnan(fx) or math.isnan(fy):
            return math.isnan(fx) and math.isnan(fy)
        return math.isclose(fx, fy, rel_tol=rel, abs_tol=1e-9)
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    return x == y


def _row_eq(a: tuple, b: tuple, rel: float) -> bool:
    return len(a) == len(b) and all(_val_eq(x, y, rel) for x, y in zip(a, b))


def _norm_key(r: tuple) -> tuple:
    """Exact-match key (floats rounded) for the fast first matching pass."""
    out = []
    for v in r:
        if _is_num(v) and not isinstance(v, numbers.Integral):
            f = float(v)
            out.append(("n", f) if math.isnan(f) or math.isinf(f) else ("n", float(f"{f:.12g}")))
        elif _is_num(v):
            out.append(("n", float(int(v))) if abs(int(v)) < 2**53 else ("i", int(v)))
        else:
            out.append((type(v).__name__, v))
    return tuple(out)


def _bag_diff(expected: list[tuple], actual: list[tuple], rel: float) -> tuple[list[tuple], list[tuple]]:
    """(expected rows not matched in actual, actual rows not matched in expected)."""
    pool: dict[tuple, list[tuple]] = defaultdict(list)
    for r in actual:
        pool[_norm_key(r)].append(r)
    leftover_e = []
    for r in expected:
        bucket = pool.get(_norm_key(r))
        if bucket:
            bucket.pop()
        else:
            leftover_e.append(r)
    leftover_a = [r for b in pool.values() for r in b]
    missing = []
    for r in leftover_e:  # tolerance pass
        for k, c in enumerate(leftover_a):
            if _row_eq(r, c, rel):
                del leftover_a[k]
                break
        else:
            missing.append(r)
    return missing, leftover_a


def _sort_key(r: tuple):
    return tuple((v is None, type(v).__name__ if not _is_num(v) else "num", v if v is not None else 0) for v in r)


def _fmt(r: tuple) -> str:
    return "(" + ", ".join(repr(v) for v in r) + ")"


def _head(rows: list, n: int = 30) -> list:
    return rows if len(rows) <= n else rows[:n] + [("…", f"{len(rows) - n} more")]


def _exact(x: float) -> Fraction:
    """Decimal value the user wrote (0.1 → 1/10), not the binary float's."""
    if isinstance(x, int):
        return Fraction(x)
    return Fraction(repr(float(x)))


# ---------------------------------------------------------------------------
# evaluation


class _Failed:
    """The value of an operation that overflowed (and of everything computed from it)."""

    _one = None

    def __new__(cls):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "FAILED"


FAILED = _Failed()


class _Failure(Exception):
    """R(τ) cannot be evaluated: the query fails at τ."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checked(v):
    """An integer result outside the 64-bit range is FAILED."""
    return FAILED if _is_int(v) and not LONG_MIN <= v <= LONG_MAX else v


@dataclass
class _Item:
    name: str  # alias, else stream name
    schema: StreamSchema
    window: A.Window | None
    visible: list[dict]  # visible substream in arrival order (its ts are instants); a relation: its visible updates
    held: list[dict]  # what the window holds from: the visible tuples that pass its condition
    updates: list[dict] | None = None  # a stored relation: all its updates (every level) in arrival order
    levels: frozenset[str] = frozenset()  # a stored relation: the levels of the rows the item holds


class _Evaluator:
    def __init__(self, q: A.Query, config: Config, level: str, streams: dict[str, list[dict]]):
        self.q = q
        self.config = config
        self.lat: Lattice = config.lattice
        self.level = level
        self.dom = self.lat.dominated(level)
        self.items: list[_Item] = []
        for f in q.from_:
            schema = config.stream(f.stream)
            assert schema is not None, f.stream
            tuples = _normalize_stream(schema, self.lat, _lookup_stream(streams, schema.name))
            allowed = self._window_levels(f.window) & self.dom
            visible = [t for t in tuples if t["level"] in allowed]
            if schema.relation:  # visible = its visible updates; refuse an invalid delete up front
                _live_rows(schema.name, tuples, None)
                self.items.append(_Item(f.alias or schema.name, schema, f.window, visible, visible, tuples, allowed))
                continue
            self.items.append(_Item(f.alias or schema.name, schema, f.window, visible, visible))
        self._col_cache: dict[A.Column, tuple[int, str]] = {}
        for it in self.items:  # a window condition filters the visible substream before the window
            if it.window is not None and getattr(it.window, "filter", None) is not None:
                one = object.__new__(_Evaluator)  # the condition reads its own item's attributes only
                one.lat, one.items, one._col_cache = self.lat, [it], {}
                it.held = [t for t in it.visible if one.eval(it.window.filter, (t,)) is True]
        self.agg_in_select = q.select is not None and any(A.aggregates_in(s.expr) for s in q.select)
        self.is_aggregate = bool(q.group_by) or q.having is not None or self.agg_in_select
        self.r2s = q.r2s or (RSTREAM if self.agg_in_select else ISTREAM)
        if config.instant_seconds <= 0:  # pragma: no cover
            raise ValueError("instant_seconds must be positive")

    # -- driver ---------------------------------------------------------------
    def run(self) -> tuple[list[tuple], int | None, str | None]:
        """(rows, failing instant, reason): the query stops at its first failing instant."""
        instants = self.instants()
        out: list[tuple] = []
        prev: Counter = Counter()
        for tau in instants:
            try:
                cur = Counter(self.relation(tau))
            except _Failure as f:
                return out, tau, f.reason
            if self.r2s == ISTREAM:
                emit = cur - prev
            elif self.r2s == DSTREAM:
                emit = prev - cur
            else:
                emit = cur
            for row, n in emit.items():
                out.extend([(tau, *row)] * n)
            prev = cur
        return out, None, None

    # -- instants -----------------------------------------------------------------
    def instants(self) -> list[int]:
        return sorted({t["ts"] for i, it in enumerate(self.items) for t in self._instant_tuples(i)})

    def _instant_tuples(self, i: int) -> list[dict]:
        """Tuples whose ts are instants of the query (SEMANTICS §4-5): the item's visible substream as
        Alg. 3 defines it (the window level clause's set ∩ dominated(L)), whatever a WHERE level
        condition says: optimization never changes the instants (issue 16)."""
        return self.items[i].visible

    def _window_levels(self, w: A.Window | None) -> frozenset[str]:
        if w is None or w.clause is None:
            return frozenset(self.lat.levels)
        c = w.clause
        if c.form == "dominated":
            return self.lat.dominated(self.lat.parse(c.levels[0]))
        if c.form in ("in", "eq"):
            return frozenset(self.lat.parse(x) for x in c.levels)
        raise ValueError(f"unknown level clause form {c.form!r}")  # pragma: no cover

    # -- windows ----------------------------------------------------------------
    def window(self, i: int, tau: int) -> list[dict]:
        it = self.items[i]
        if it.schema.relation:  # no window: every live row at τ whose level the item sees
            return [r for r in _live_rows(it.schema.name, it.updates, tau) if r["level"] in it.levels]
        w = it.window
        upto = [t for t in it.held if t["ts"] <= tau]
        kind = "unbounded" if w is None else w.kind
        if kind == "unbounded":
            return upto
        if kind == "now":
            return [t for t in upto if t["ts"] == tau]
        if kind == "rows":
            return upto[len(upto) - w.rows:] if len(upto) > w.rows else upto
        if kind == "range":
            span = range_instants(w.range_amount, w.range_unit, self.config.instant_seconds)
            end = tau
            if getattr(w, "slide_amount", None) is not None:  # the RANGE window at the last slide boundary
                slide = range_instants(w.slide_amount, w.slide_unit, self.config.instant_seconds)
                end = (tau // slide) * slide
            return [t for t in upto if end - span < t["ts"] <= end]
        if kind == "partition":
            attrs = [_canon_attr(it.schema, a) for a in w.partition_by]
            parts: dict[tuple, list[int]] = defaultdict(list)
            for k, t in enumerate(upto):
                parts[tuple(t[a] for a in attrs)].append(k)
            keep = sorted(k for ks in parts.values() for k in ks[-w.rows:])
            return [upto[k] for k in keep]
        raise ValueError(f"unknown window kind {kind!r}")  # pragma: no cover

    # -- R(τ) -------------------------------------------------------------------
    def relation(self, tau: int) -> list[tuple]:
        """R(τ) as a list of rows ``(level, col1, ...)``; raises _Failure if it fails."""
        contents = [self.window(i, tau) for i in range(len(self.items))]
        q = self.q
        rows = [r for r in itertools.product(*contents) if self.passes(q.where, r, None, "WHERE")]
        out: list[tuple] = []
        if not self.is_aggregate:
            for r in rows:
                lvl = self.lat.lub_all(t["level"] for t in r)
                out.append((lvl, *self._ok(self.select_values(r, None), "SELECT")))
            return self._distinct(out) if q.distinct else out
        groups: dict[tuple, list[tuple]] = {}
        if q.group_by:
            for r in rows:
                key = tuple(self._ok([self.eval(g, r) for g in q.group_by], "GROUP BY"))
                groups.setdefault(key, []).append(r)
        else:
            groups[()] = rows  # one group, even over empty input
        aggs = [a for e in [s.expr for s in q.select or ()] + [q.having] for a in A.aggregates_in(e)]
        for grp in groups.values():  # every aggregate over every group, before HAVING
            for a in aggs:
                if a.arg is None:
                    continue
                vals = self._ok([self.eval(a.arg, r) for r in grp], "an aggregate argument")
                if a.func == "SUM":
                    vals = [v for v in vals if v is not None]
                    if getattr(a, "distinct", False):
                        vals = list(set(vals))
                    if vals and all(_is_int(v) for v in vals) and _checked(sum(vals)) is FAILED:
                        raise _Failure(f"integer overflow: SUM is outside the 64-bit range at {tau}")
        for grp in groups.values():
            rep = grp[0] if grp else None
            if not self.passes(q.having, rep, grp, "HAVING"):
                continue
            lvl = self.lat.lub_all(t["level"] for r in grp for t in r)
            out.append((lvl, *self._ok(self.select_values(rep, grp), "SELECT")))
        return self._distinct(out) if q.distinct else out

    def _distinct(self, rows: list[tuple]) -> list[tuple]:
        """SELECT DISTINCT: one row per distinct value tuple, its level the lub of the levels of the
        rows it stands for (SEMANTICS, issue 16)."""
        levels: dict[tuple, list[str]] = {}
        for lvl, *vals in rows:
            levels.setdefault(tuple(vals), []).append(lvl)
        return [(self.lat.lub_all(lvls), *vals) for vals, lvls in levels.items()]

    def passes(self, cond, row, group, clause: str) -> bool:
        """WHERE/HAVING: False if a top-level conjunct that did not fail is FALSE or NULL, else
        _Failure if one failed, else True."""
        if cond is None:
            return True
        values = [self.eval(c, row, group) for c in _top_conjuncts(cond)]
        if any(v is not FAILED and v is not True for v in values):
            return False
        if any(v is FAILED for v in values):
            raise _Failure(f"integer overflow in {clause}")
        return True

    @staticmethod
    def _ok(values: list, clause: str) -> list:
        if any(v is FAILED for v in values):
            raise _Failure(f"integer overflow in {clause}")
        return values

    def select_values(self, row, group) -> list:
        if self.q.select is None:  # SELECT *: all user attributes, FROM order
            return [t[c] for t, it in zip(row, self.items) for c in it.schema.column_names]
        return [self.eval(s.expr, row, group) for s in self.q.select]

    # -- expressions ---------------------------------------------------------------
    def column(self, c: A.Column) -> tuple[int, str]:
        hit = self._col_cache.get(c)
        if hit is not None:
            return hit
        if c.qualifier is not None:
            idx = [k for k, it in enumerate(self.items) if it.name.lower() == c.qualifier.lower()]
            if len(idx) != 1:
                raise ValueError(f"cannot resolve {c.qualifier}.{c.name}")
            attr = _canon_attr(self.items[idx[0]].schema, c.name)
            if attr is None:
                raise ValueError(f"cannot resolve {c.qualifier}.{c.name}")
            hit = (idx[0], attr)
        else:
            hits = [(k, _canon_attr(it.schema, c.name)) for k, it in enumerate(self.items)]
            hits = [(k, a) for k, a in hits if a is not None]
            if len(hits) != 1:
                raise ValueError(f"cannot resolve column {c.name}")
            hit = hits[0]
        self._col_cache[c] = hit
        return hit

    @staticmethod
    def _is_level_col(e: A.Expr) -> bool:
        return isinstance(e, A.Column) and e.name.lower() == "level"

    def _is_level_typed(self, e: A.Expr) -> bool:
        return self._is_level_col(e) or isinstance(e, A.LevelLiteral)

    def _as_level(self, e: A.Expr) -> str | None:
        """A level literal written next to ``level``: U, "S", [1,B], or 5 if a level."""
        if isinstance(e, A.LevelLiteral):
            return self.lat.parse(e.text)
        if isinstance(e, A.Column) and e.qualifier is None and self.lat.contains(e.name):
            return self.lat.parse(e.name)
        if isinstance(e, A.Literal) and e.type == "string":
            return self.lat.parse(e.value)
        if isinstance(e, A.Literal) and e.type == "long" and self.lat.contains(str(e.value)):
            return self.lat.parse(str(e.value))
        return None

    def eval(self, e: A.Expr, row, group=None):
        """Value of ``e`` on a joined row; in a group context ``row`` is a representative."""
        if isinstance(e, A.Literal):
            return e.value
        if isinstance(e, A.LevelLiteral):
            return self.lat.parse(e.text)
        if isinstance(e, A.Column):
            k, attr = self.column(e)
            if row is None:
                raise ValueError(f"column {e.name} evaluated without a row")
            return row[k][attr]
        if isinstance(e, A.Aggregate):
            if group is None:
                raise ValueError("aggregate outside a group")
            return self.aggregate(e, group)
        if isinstance(e, A.Unary):
            v = self.eval(e.operand, row, group)
            if v is FAILED:
                return FAILED
            if e.op == "NOT":
                return None if v is None else (not v)
            if e.op == "-":
                return None if v is None else _checked(-v)
            raise ValueError(f"unknown unary {e.op}")  # pragma: no cover
        if isinstance(e, A.Binary):
            return self.binary(e, row, group)
        if isinstance(e, A.InList):
            if self._is_level_typed(e.operand):
                v = self.eval(e.operand, row, group)
                lvls = [self._as_level(x) for x in e.items]
                if any(x is None for x in lvls):
                    raise ValueError("level IN with a non-level item")
                res = v in lvls
                return (not res) if e.negated else res
            v = self.eval(e.operand, row, group)
            vals = [self.eval(x, row, group) for x in e.items]
            if v is FAILED or any(x is FAILED for x in vals):
                return FAILED
            res = _sql_in(v, vals)
            if e.negated:
                return None if res is None else (not res)
            return res
        if isinstance(e, A.DominatedBy):
            v = self.eval(e.operand, row, group)
            return self.lat.leq(v, self.lat.parse(e.level.text))
        if isinstance(e, A.IsNull):
            v = self.eval(e.operand, row, group)
            if v is FAILED:
                return FAILED
            return (v is not None) if e.negated else (v is None)
        raise ValueError(f"unsupported expression {e!r}")  # pragma: no cover

    def binary(self, e: A.Binary, row, group):
        op = e.op
        if op in A.COMPARISONS:
            # `level = U`: a bare name / string next to `level` is a level literal
            if self._is_level_col(e.left):
                lv = self._as_level(e.right)
                if lv is not None:
                    return _compare(op, self.eval(e.left, row, group), lv)
            if self._is_level_col(e.right):
                lv = self._as_level(e.left)
                if lv is not None:
                    return _compare(op, lv, self.eval(e.right, row, group))
        # eager: both operands are always evaluated, and a failed one fails the result
        a, b = self.eval(e.left, row, group), self.eval(e.right, row, group)
        if a is FAILED or b is FAILED:
            return FAILED
        if op == "AND":
            if a is False or b is False:
                return False
            if a is None or b is None:
                return None
            return True
        if op == "OR":
            if a is True or b is True:
                return True
            if a is None or b is None:
                return None
            return False
        if op in A.COMPARISONS:
            return _compare(op, a, b)
        return _arith(op, a, b)

    def aggregate(self, e: A.Aggregate, group: list) -> Any:
        if e.arg is None:  # COUNT(*)
            return len(group)
        vals = [self.eval(e.arg, r) for r in group]
        vals = [v for v in vals if v is not None]
        if getattr(e, "distinct", False):
            vals = list(set(vals))  # SQL equality: 0.0 and -0.0 are one value (so are they in a Python set)
        if e.func == "COUNT":
            return len(vals)
        if not vals:
            return None
        if e.func == "SUM":
            return _checked(_sum(vals))  # exact; relation() fails the instant when out of range
        if e.func == "AVG":
            s = _sum(vals)  # an exact integer sum, correctly rounded by the division
            return float(s) / len(vals) if isinstance(s, float) else s / len(vals)
        if e.func == "MIN":
            return min(vals)
        if e.func == "MAX":
            return max(vals)
        raise ValueError(f"unknown aggregate {e.func}")  # pragma: no cover


# ---------------------------------------------------------------------------
# scalar semantics


def _sum(vals: list):
    if any(isinstance(v, float) for v in vals):
        return math.fsum(float(v) for v in vals)  # order-independent, exactly rounded
    return sum(int(v) for v in vals)


def _numeric_pair(a, b):
    """A long compared with a double is compared as a double (SQL's widening, Spark's rule)."""
    if isinstance(a, float) and _is_int(b):
        return a, float(b)
    if isinstance(b, float) and _is_int(a):
        return float(a), b
    return a, b


def _compare(op: str, a, b):
    if a is None or b is None:
        return None
    a, b = _numeric_pair(a, b)
    if op == "=":
        return a == b
    if op == "!=":
        return a != b
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    raise ValueError(f"unknown comparison {op}")  # pragma: no cover


def _arith(op: str, a, b):
    if a is None or b is None:
        return None
    if op == "+":
        return _checked(a + b)
    if op == "-":
        return _checked(a - b)
    if op == "*":
        return _checked(a * b)
    if op == "/":  # always double; x/0 = NULL
        if b == 0:
            return None
        return float(a) / float(b)
    if op == "%":  # truncating (Java), x % 0 = NULL
        if b == 0:
            return None
        if isinstance(a, float) or isinstance(b, float):
            return math.fmod(float(a), float(b))
        r = abs(a) % abs(b)
        return r if a >= 0 else -r
    raise ValueError(f"unknown operator {op}")  # pragma: no cover


def _sql_in(v, vals: list):
    if v is None:
        return None
    if any(x is not None and _compare("=", v, x) for x in vals):
        return True
    if any(x is None for x in vals):
        return None
    return False


def _evaluator_of(q, config: Config, level: str, streams: dict[str, list[dict]]):
    if isinstance(q, A.Compound):
        return _CompoundEvaluator(q, config, level, streams)
    if any(getattr(f, "subquery", None) is not None for f in q.from_):
        return _DerivedEvaluator(q, config, level, streams)
    return _Evaluator(q, config, level, streams)


class _DerivedEvaluator:
    """``SELECT … FROM (subquery) x [, Stream [window] …] …`` (issue 16): at every instant τ of the
    query (the arrivals of its stream items' visible substreams and each subquery's instants), x
    holds the subquery's R(τ), each row with ``ts`` = τ, its level and its columns (named as the
    front end names them); the outer query reads x through the window ``[NOW]``.  A subquery
    failing at τ fails the query at τ."""

    def __init__(self, q: A.Query, config: Config, level: str, streams: dict[str, list[dict]]):
        self.subs: dict[int, tuple] = {}  # outer FROM position → (evaluator, column names)
        pseudo: dict[str, StreamSchema] = {}
        from_ = []
        for k, f in enumerate(q.from_):
            if f.subquery is None:
                from_.append(f)
                continue
            # x's columns as the front end names and types them (naming is syntax: AS or the attribute)
            outs = compile_query(to_text(f.subquery), config, level).outputs
            self.subs[k] = (_evaluator_of(f.subquery, config, level, streams), [o.name for o in outs])
            pseudo[f.alias] = StreamSchema(
                f.alias, tuple((o.name, {"level": "string", "null": "string"}.get(o.type, o.type)) for o in outs))
            from_.append(A.FromItem(f.alias, A.Window("now"), None))
        self.outer = _Evaluator(replace(q, from_=tuple(from_)), replace(config, streams={**config.streams, **pseudo}),
                                level, streams)
        self.lat, self.r2s = config.lattice, self.outer.r2s
        self.agg_in_select = self.outer.agg_in_select

    def instants(self) -> list[int]:
        own = {t["ts"] for k, it in enumerate(self.outer.items) if k not in self.subs for t in it.visible}
        return sorted(own.union(*(set(ev.instants()) for ev, _ in self.subs.values())))

    def relation(self, tau: int) -> list[tuple]:
        for k, (ev, names) in self.subs.items():  # x at τ: the subquery's R(τ) (a _Failure propagates)
            rows = [{"ts": tau, "level": lvl, **dict(zip(names, vals))} for lvl, *vals in ev.relation(tau)]
            self.outer.items[k].visible = self.outer.items[k].held = rows
        return self.outer.relation(tau)

    run = _Evaluator.run


class _CompoundEvaluator:
    """``q1 UNION [ALL] q2 EXCEPT …`` (issue 16): the instants are those of every SELECT's FROM
    items; at each, every SELECT's R(τ) is built as above and they are combined left to right:
    UNION ALL keeps both bags; UNION one row per value tuple at the lub of the rows (of either side)
    with those values; EXCEPT one row per value tuple of the left side absent from the right side,
    at the lub of the left rows with those values; INTERSECT one row per value tuple of the left
    side present on the right side, at the lub of the rows of both sides with those values.  A
    SELECT may be a parenthesized compound (also an INTERSECT after another operator: it binds
    tighter), evaluated the same way.  A SELECT failing at τ fails the query at τ.
    The stream operator applies to the combined relation (default RSTREAM if a SELECT's list has
    an aggregate, else ISTREAM)."""

    def __init__(self, q: A.Compound, config: Config, level: str, streams: dict[str, list[dict]]):
        self.branches = [_evaluator_of(b, config, level, streams) for b in q.branches]
        self.ops = q.ops
        self.lat = config.lattice
        self.agg_in_select = any(b.agg_in_select for b in self.branches)
        self.r2s = q.r2s or (RSTREAM if self.agg_in_select else ISTREAM)

    run = _Evaluator.run
    _distinct = _Evaluator._distinct

    def instants(self) -> list[int]:
        return sorted({t for b in self.branches for t in b.instants()})

    def relation(self, tau: int) -> list[tuple]:
        acc = self.branches[0].relation(tau)
        for op, b in zip(self.ops, self.branches[1:]):
            right = b.relation(tau)
            if op == "UNION ALL":
                acc = acc + right
            elif op == "UNION":
                acc = self._distinct(acc + right)
            elif op == "INTERSECT":  # the left values the right side has, at the lub of both sides' rows
                there = {tuple(vals): lvl for lvl, *vals in self._distinct(right)}
                acc = [(self.lat.lub(lvl, there[tuple(vals)]), *vals) for lvl, *vals in self._distinct(acc)
                       if tuple(vals) in there]
            else:  # EXCEPT
                gone = {tuple(vals) for _, *vals in right}
                acc = [r for r in self._distinct(acc) if tuple(r[1:]) not in gone]
        return acc


# ---------------------------------------------------------------------------
# input normalization


def _canon_attr(schema: StreamSchema, name: str) -> str | None:
    """The key of attribute ``name`` in a tuple of the stream of ``schema``, or None when it has none.

    docs/semantics.md §8 (*Names*): attribute names are case-insensitive, and every tuple has
    ``ts`` and ``level`` besides its stream's declared attributes (written as declared)."""
    keys: dict[str, str] = {"ts": "ts", "level": "level"}
    for attribute, _type in schema.columns:
        keys.setdefault(attribute.lower(), attribute)
    return keys.get(name.lower())


def _lookup_stream(streams: dict[str, list[dict]], name: str) -> list[dict]:
    if name in streams:
        return streams[name]
    for k, v in streams.items():
        if k.lower() == name.lower():
            return v
    return []


def _coerce(v, typ: str):
    if v is None:
        return None
    if typ == "double":
        return float(v)
    if typ in ("long", "timestamp"):
        return int(v)
    if typ == "boolean":
        return bool(v)
    if typ == "string":
        return str(v)
    return v


def _normalize_stream(schema: StreamSchema, lat: Lattice, tuples: list[dict]) -> list[dict]:
    """The tuples as dicts ``ts``, ``level``, attributes (typed); a relation's updates also ``op``."""
    out = []
    last = None
    for k, t in enumerate(tuples):
        lower = {str(key).lower(): val for key, val in t.items()}
        ts = int(lower["ts"])
        if last is not None and ts < last:
            raise ValueError(f"stream {schema.name}: tuple {k} has ts {ts} < previous ts {last}")
        last = ts
        d = {"ts": ts, "level": lat.parse(lower["level"])}
        for c, typ in schema.columns:
            d[c] = _coerce(t[c] if c in t else lower.get(c.lower()), typ)
        if schema.relation:
            op = str(lower.get("op")).lower()
            if op not in ("insert", "delete"):
                raise ValueError(f"relation {schema.name}: update {k} has op {lower.get('op')!r}, not insert or delete")
            d["op"] = op
        out.append(d)
    return out


def _value_key(v) -> tuple:
    """Equality of attribute values for a delete: NULL = NULL, NaN = NaN, -0.0 = 0.0 (== does that)."""
    if v is None:
        return ("null",)
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    return (type(v).__name__, v)


def _live_rows(name: str, updates: list[dict], tau: int | None) -> list[dict]:
    """The rows of relation ``name`` live at τ (None: after every update), in arrival order: the
    updates with ts ≤ τ replayed in arrival order; an insert adds a row (its ts, level, attributes),
    a delete removes the oldest live row with its level and equal attributes.  A delete matching no
    live row is invalid input: ValueError."""
    live: dict[int, dict] = {}  # arrival position of the insert → row; a dict keeps arrival order
    by_key: dict[tuple, deque[int]] = defaultdict(deque)  # level and values → live positions, oldest first
    for k, u in enumerate(updates):
        if tau is not None and u["ts"] > tau:
            break  # ts are non-decreasing
        row = {a: v for a, v in u.items() if a != "op"}
        key = (row["level"], *(_value_key(v) for a, v in row.items() if a not in ("ts", "level")))
        if u["op"] == "insert":
            live[k] = row
            by_key[key].append(k)
        elif by_key[key]:
            del live[by_key[key].popleft()]
        else:
            values = {a: v for a, v in row.items() if a not in ("ts", "level")}
            raise ValueError(f"relation {name}: update {k} (delete at ts {u['ts']}, level {u['level']}, "
                             f"{values}) matches no live row")
    return list(live.values())


def _top_conjuncts(e):
    if e is None:
        return []
    if isinstance(e, A.Binary) and e.op == "AND":
        return _top_conjuncts(e.left) + _top_conjuncts(e.right)
    return [e]
