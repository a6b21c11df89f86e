"""Bounds on the literals of a query: what the front end refuses with :class:`LimitError`.

* ``ROWS n`` and ``PARTITION BY .. ROWS n``: ``1 ≤ n ≤ MAX_ROWS``;
* ``RANGE t unit``: its length in instants (``Window.range_instants``) within
  ``1 .. config.limits.max_ts``;
* integer literals fit a signed 64-bit long, decimal literals are finite doubles;
* no number may be written with more than ``MAX_NUMBER_CHARS`` characters
  (checked on the parse tree, before any conversion).

Every message names the clause (``SELECT``, ``WHERE``, ``GROUP BY``, ``HAVING``,
``window of <item>``).
"""

from __future__ import annotations

import math

from lark import Token, Tree

from . import ast as A
from .errors import LimitError

__all__ = ["MAX_ROWS", "LONG_MIN", "LONG_MAX", "MAX_NUMBER_CHARS", "check_number_tokens", "check_query"]

MAX_ROWS = 2**31 - 1
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
MAX_NUMBER_CHARS = 100
_DBL_MAX = "1.7976931348623157e308"

_CLAUSES = {"select_items": "SELECT", "where_clause": "WHERE", "group_clause": "GROUP BY", "having_clause": "HAVING"}
_ITEMS = ("from_item", "from_item_alias_first")


def check_number_tokens(tree: Tree) -> None:
    """Refuse a number token longer than MAX_NUMBER_CHARS before the parser converts it."""
    for sub in tree.iter_subtrees_topdown():
        rule = str(sub.data)
        if rule in _CLAUSES:
            ctx = _CLAUSES[rule]
        elif rule in _ITEMS:
            names = [c for c in sub.children if isinstance(c, Token) and c.type == "NAME"]
            ctx = f"window of {names[-1]}"
        else:
            continue
        for tok in sub.scan_values(lambda t: isinstance(t, Token) and t.type in ("INT", "DECIMAL")):
            if len(tok) > MAX_NUMBER_CHARS:
                raise LimitError(
                    f"{ctx}: a number written with {len(tok)} characters is beyond any limit "
                    f"(at most {MAX_NUMBER_CHARS})"
                )


def check_query(q: A.Query, max_ts: int, instant_seconds: float) -> None:
    """Raise LimitError for the first literal of ``q`` (in text order) beyond a limit."""
    for s in q.select or ():
        _check_expr(s.expr, "SELECT")
    for f in q.from_:
        if f.window is not None:
            _check_window(f.window, f"window of {f.name}", max_ts, instant_seconds)
            _check_expr(f.window.filter, f"window of {f.name}")
    _check_expr(q.where, "WHERE")
    for g in q.group_by:
        _check_expr(g, "GROUP BY")
    _check_expr(q.having, "HAVING")


def _check_expr(e: A.Expr | None, ctx: str) -> None:
    if e is None:
        return
    for x in A.walk(e):
        if not isinstance(x, A.Literal) or isinstance(x.value, bool):
            continue
        if x.type == "long" and not LONG_MIN <= x.value <= LONG_MAX:
            raise LimitError(
                f"{ctx}: integer literal {_int_text(x.value)} does not fit a signed 64-bit long "
                f"({LONG_MIN} to {LONG_MAX})"
            )
        if x.type == "double" and not math.isfinite(x.value):
            raise LimitError(f"{ctx}: a decimal literal is beyond the range of a double (at most ±{_DBL_MAX})")


def _length(ctx: str, word: str, amount: float, unit: str | None, instant_seconds: float) -> tuple[str, float]:
    """(``ctx: WORD amount unit`` for messages, the length in instants before rounding)."""
    unit = (unit or "seconds").lower()
    return f"{ctx}: {word} {_float_text(float(amount))} {unit}", float(amount) * A.UNIT_SECONDS[unit] / float(instant_seconds)


def _check_window(w: A.Window, ctx: str, max_ts: int, instant_seconds: float) -> None:
    if w.kind in ("rows", "partition") and not (isinstance(w.rows, int) and 1 <= w.rows <= MAX_ROWS):
        raise LimitError(f"{ctx}: ROWS {_int_text(w.rows)}: a window holds 1 to {MAX_ROWS} rows")
    if w.kind == "range":
        spec, span = _length(ctx, "RANGE", w.range_amount, w.range_unit, instant_seconds)
        if not math.isfinite(span):
            raise LimitError(f"{spec} is longer than any limit (at most {max_ts} instants: [limits] max_ts)")
        if span > max_ts:
            raise LimitError(f"{spec} is about {span:.3g} instants; at most {max_ts} ([limits] max_ts)")
        if w.range_instants(instant_seconds) < 1:
            raise LimitError(f"{spec} spans no instant (one instant is {instant_seconds:g} s)")
        if w.slide_amount is not None:
            sspec, slide = _length(ctx, "SLIDE", w.slide_amount, w.slide_unit, instant_seconds)
            if not math.isfinite(slide) or slide > max_ts:
                raise LimitError(f"{sspec} is longer than any limit (at most {max_ts} instants: [limits] max_ts)")
            if slide <= 0:
                raise LimitError(f"{sspec} must be positive")


def _int_text(v: int) -> str:
    digits = len(str(abs(v)))
    return str(v) if digits <= 25 else f"of {digits} digits"


def _float_text(v: float) -> str:
    return str(int(v)) if math.isfinite(v) and v.is_integer() and abs(v) < 1e15 else f"{v:g}"
