"""Bounds on the literals of a query: what the front end refuses with :class:`LimitError`.

* ``ROWS n`` and ``PARTITION BY .. ROWS n``: ``1 ≤ n ≤ MAX_ROWS``;
* ``RANGE t unit``: its length in instants (``Window.range_instants``) within
  ``1 .. config.limits.max_ts``;
* integer literals fit a signed 64-bit long, decimal literals are finite doubles;
* no number may be written with more than ``MAX_NUMBER_CHARS`` characters
  (checked on the parse tree, before any conversion).

Bounds on the shape of a query, checked before anything recursive runs (so that a query
deep enough to exhaust Python's stack in the transformer, the analyzer, the printer, sharing
or the worker, or to take Spark minutes to compile, is refused with one line instead):

* the text has at most ``MAX_QUERY_CHARS`` characters (checked before lark runs: its
  LALR parse is iterative, about 1 s for 100 000 characters of the worst shape);
* SELECTs nest at most ``MAX_NESTING`` deep: each SELECT, each set operation and each
  pair of parentheses around a query is one level (``SELECT .. FROM (SELECT ..) x`` is 2
  deep, ``a UNION b UNION c`` 3: set operations chain left-nested, ``a UNION (b UNION c)``
  4);
* an expression nests at most ``MAX_EXPR_DEPTH`` operators deep: every ``AND``, ``OR``,
  ``NOT``, comparison, ``IN``, ``IS [NOT] NULL``, ``DOMINATED BY``, aggregate, arithmetic
  operator and unary minus is one level (a chain of one precedence nests left:
  ``a AND b AND c`` is 2 ANDs deep, 3 with its comparisons; parentheses alone add nothing);
* and at most ``MAX_ARITH_DEPTH`` of those levels are arithmetic (``+ - * / %``, unary
  minus): the worker checks 64-bit arithmetic for overflow with SQL that grows with the
  square of that depth, and Spark's parser slows down accordingly.

:func:`check_tree` walks lark's parse tree with an explicit stack.  The numbers are
measured (tests/test_query_depth.py has the shapes; 2 shared cores, a fresh Spark session
each): at these limits every stage (the front end, sharing, the master's chunker, the
worker's SQL) needs at most ~250 Python frames of the default 1000, on a pool thread like
the master's and the worker's (8 MiB stacks); a query at a limit runs its first chunk in
0.2 to 7 s (12 nested subqueries with a 64-deep WHERE innermost: 6 s; 12 EXCEPT/INTERSECT:
7 s; 16 nested arithmetic operators in SELECT, GROUP BY and HAVING at once: 6 s).  Past
them Spark degrades fast: a UNION chain takes ~2x longer per SELECT past 14 (20: 67 s), 32
nested 64-bit operators 8 to 16 s to compile and 64 of them exhaust a 2 GB heap.

Every message names the clause (``SELECT``, ``WHERE``, ``GROUP BY``, ``HAVING``,
``window of <item>``).
"""

from __future__ import annotations

import math

from lark import Token, Tree

from . import ast as A
from .errors import LimitError

__all__ = ["MAX_ROWS", "LONG_MIN", "LONG_MAX", "MAX_NUMBER_CHARS", "MAX_QUERY_CHARS", "MAX_NESTING", "MAX_EXPR_DEPTH",
           "MAX_ARITH_DEPTH", "check_text", "check_tree", "check_number_tokens", "check_query"]

MAX_ROWS = 2**31 - 1
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
MAX_NUMBER_CHARS = 100
#: characters of a query's text
MAX_QUERY_CHARS = 100_000
#: SELECTs nested in one another (subqueries in FROM, parenthesized queries, set-operation chains)
MAX_NESTING = 12
#: operators nested in one expression
MAX_EXPR_DEPTH = 64
#: arithmetic operators (+ - * / %, unary minus) nested in one expression
MAX_ARITH_DEPTH = 16
_DBL_MAX = "1.7976931348623157e308"

_CLAUSES = {"select_items": "SELECT", "where_clause": "WHERE", "group_clause": "GROUP BY", "having_clause": "HAVING"}
_ITEMS = ("from_item", "from_item_alias_first")


#: parse-tree nodes that are one level of SELECT nesting
_QUERY_NODES = frozenset({"select_stmt", "set_op", "parenthesized"})
#: parse-tree nodes that are one operator of an expression (grammar.lark's expression rules)
_OPERATORS = frozenset({
    "or_", "and_", "not_", "compare", "arith", "neg", "in_set", "not_in_set", "in_list", "not_in_list",
    "dominated_by", "is_null", "is_not_null", "aggregate", "aggregate_distinct",
})
#: the arithmetic ones among them
_ARITHMETIC = frozenset({"arith", "neg"})


def check_text(text: str) -> None:
    """Refuse a text longer than MAX_QUERY_CHARS (before the parser sees it)."""
    if len(text) > MAX_QUERY_CHARS:
        raise LimitError(f"query of {len(text)} characters (at most {MAX_QUERY_CHARS})")


def _context(node: Tree) -> str | None:
    rule = str(node.data)
    if rule in _CLAUSES:
        return _CLAUSES[rule]
    if rule in _ITEMS:
        names = [c for c in node.children if isinstance(c, Token) and c.type == "NAME"]
        return f"window of {names[-1]}"
    return None


def check_tree(tree: Tree) -> None:
    """Refuse a parse tree nesting SELECTs deeper than MAX_NESTING, an expression nesting operators
    deeper than MAX_EXPR_DEPTH (arithmetic deeper than MAX_ARITH_DEPTH), or a number token longer
    than MAX_NUMBER_CHARS (before the transformer converts it).  Iterative (an explicit stack): it
    runs before anything that recurses.  Says the deepest nesting of SELECTs, else the first clause
    (in text order) nested too deep with its depth, else the first number too long."""
    nesting = 0
    deep: dict[int, list] = {}  # clause number -> [context, deepest operators, deepest arithmetic]
    number = None
    clauses = 0
    # (node, context, clause number, SELECT nesting, operators and arithmetic operators above it)
    stack: list[tuple] = [(tree, None, 0, 0, 0, 0)]
    while stack:
        node, ctx, clause, nest, depth, arith = stack.pop()
        if isinstance(node, Token):
            if number is None and node.type in ("INT", "DECIMAL") and len(node) > MAX_NUMBER_CHARS and ctx:
                number = f"{ctx}: a number written with {len(node)} characters is beyond any limit " \
                         f"(at most {MAX_NUMBER_CHARS})"
            continue
        if not isinstance(node, Tree):
            continue  # a placeholder (None) of an optional part
        rule = str(node.data)
        if rule in _QUERY_NODES:
            nest += 1
            nesting = max(nesting, nest)
        elif rule in _OPERATORS:
            depth += 1
            arith += rule in _ARITHMETIC
            if depth > MAX_EXPR_DEPTH or arith > MAX_ARITH_DEPTH:
                seen = deep.setdefault(clause, [ctx or "query", 0, 0])
                seen[1], seen[2] = max(seen[1], depth), max(seen[2], arith)
        new = _context(node)
        if new is not None:
            ctx, clauses, depth, arith = new, clauses + 1, 0, 0
            clause = clauses
        stack.extend((c, ctx, clause, nest, depth, arith) for c in reversed(node.children))
    if nesting > MAX_NESTING:
        raise LimitError(f"query nests SELECTs {nesting} deep (subqueries in FROM, set operations and "
                         f"parenthesized queries; at most {MAX_NESTING})")
    if deep:
        ctx, depth, arith = deep[min(deep)]
        if depth > MAX_EXPR_DEPTH:
            raise LimitError(f"{ctx}: expression nested {depth} operators deep (at most {MAX_EXPR_DEPTH})")
        raise LimitError(f"{ctx}: arithmetic nested {arith} operators deep (+ - * / % and unary minus; "
                         f"at most {MAX_ARITH_DEPTH})")
    if number is not None:
        raise LimitError(number)


def check_number_tokens(tree: Tree) -> None:
    """Refuse a number token longer than MAX_NUMBER_CHARS before the parser converts it (with the
    other bounds of :func:`check_tree`, which does the work)."""
    check_tree(tree)


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
