"""Parse MLS-CQL text into the AST (grammar in ``grammar.lark``)."""

from __future__ import annotations

import dataclasses

from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ast as A
from .errors import LimitError, ParseError, QueryError
from .limits import MAX_EXPR_DEPTH, MAX_NESTING, check_text, check_tree

__all__ = ["parse", "QueryError", "ParseError"]


_UNITS = {
    "ms": "milliseconds", "millisecond": "milliseconds", "milliseconds": "milliseconds",
    "sec": "seconds", "secs": "seconds", "second": "seconds", "seconds": "seconds",
    "min": "minutes", "mins": "minutes", "minute": "minutes", "minutes": "minutes",
    "hour": "hours", "hours": "hours", "day": "days", "days": "days",
}
_COMP = {"==": "=", "<>": "!="}


def _unquote(tok: str) -> str:
    q = tok[0]
    return tok[1:-1].replace(q + q, q)


@v_args(inline=True)
class _ToAst(Transformer):
    # ---- query ----
    def start(self, q):
        return q

    def wrapped(self, r2s, q):
        if q.r2s is not None:
            raise ParseError(f"{r2s.upper()}(...) wraps a query that already says {q.r2s}")
        if isinstance(q, A.Compound):
            return dataclasses.replace(q, r2s=str(r2s).upper(), wrapped=True)
        return A.Query(q.select, q.from_, q.where, q.group_by, q.having, r2s=str(r2s).upper(), wrapped=True,
                       distinct=q.distinct)

    def set_op(self, left, op, right):
        """``left op right``: the stream operator may stand on the first SELECT only (it applies to
        the combined relation).  A compound on the left is extended (left to right is left-nested);
        one on the right (parentheses, or an INTERSECT binding tighter) stays one branch."""
        if right.r2s is not None:
            raise ParseError(f"{right.r2s} on a later SELECT of {str(op).split()[0].upper()}: put the stream "
                             f"operator on the first SELECT or around the whole query ({right.r2s}(...))")
        op = " ".join(str(op).upper().split())
        if isinstance(left, A.Compound):
            return A.Compound(left.branches + (right,), left.ops + (op,), left.r2s)
        return A.Compound((dataclasses.replace(left, r2s=None), right), (op,), left.r2s)

    def parenthesized(self, q):
        """``( q )`` in a compound query: a relation, so without a stream operator of its own."""
        if q.r2s is not None:
            raise ParseError(f"{q.r2s} inside parentheses: put the stream operator on the first SELECT or around "
                             f"the whole query ({q.r2s}(...))")
        return q

    def select_stmt(self, r2s, distinct, select, from_, *rest):
        where = group = having = None
        for part in rest:
            if part is None:
                continue
            kind, val = part
            if kind == "where":
                where = val
            elif kind == "group":
                group = val
            else:
                having = val
        return A.Query(select, from_, where, group or (), having, str(r2s).upper() if r2s else None,
                       distinct=distinct is not None)

    def select_star(self):
        return None

    def select_items(self, *items):
        return tuple(items)

    def select_item(self, expr, alias):
        return A.SelectItem(expr, str(alias) if alias else None)

    def from_list(self, *items):
        return tuple(items)

    def from_subquery(self, q, alias):
        """``(SELECT …) x``: a derived table; a relation, so its SELECTs carry no stream operator."""
        inner = q.branches if isinstance(q, A.Compound) else (q,)
        r2s = q.r2s or next((b.r2s for b in inner if b.r2s), None)
        if r2s:
            raise ParseError(f"a subquery in FROM is a relation: {r2s} belongs to the outer query")
        return A.FromItem(str(alias), None, str(alias), subquery=q)

    def from_item(self, name, window, alias):
        return A.FromItem(str(name), window, str(alias) if alias else None)

    def from_item_alias_first(self, name, alias, window):
        return A.FromItem(str(name), window, str(alias))

    def where_clause(self, e):
        return ("where", e)

    def group_clause(self, *es):
        return ("group", tuple(es))

    def having_clause(self, e):
        return ("having", e)

    # ---- windows ----
    def window(self, spec: A.Window, cond=None):
        clause, filt = cond if isinstance(cond, tuple) else (cond, None)
        if clause is not None:
            if spec.clause is not None:
                raise ParseError("a window has two level clauses")
            spec = dataclasses.replace(spec, clause=clause)
        return dataclasses.replace(spec, filter=filt) if filt is not None else spec

    def relation_window(self, clause):
        """``Units [level in {U, C}]``: a stored relation's level clause (it has no window)."""
        return A.Window("relation", clause=clause)

    def window_where(self, e):
        """``[… WHERE cond]``: (level clause, filter).  The conjunct on ``level`` in one of the level
        clause's forms is the level clause; the other conjuncts, left-nested, filter the stream
        before the window.  ``level`` anywhere else in the condition is refused: the level clause
        decides the instants, a filter does not, and one condition cannot be both."""
        clause, rest = None, []
        for c in A.conjuncts(e):
            lc = _level_clause_of(c)
            if lc is not None:
                if clause is not None:
                    raise ParseError("a window has two level conditions; write one (level in {...})")
                clause = lc
                continue
            if any(isinstance(x, A.Column) and x.name.lower() == "level" for x in A.walk(c)) or \
                    any(isinstance(x, (A.DominatedBy, A.LevelLiteral)) for x in A.walk(c)):
                raise ParseError("in a window, a condition on level must be a conjunct of its own "
                                 "(level in {...}, level = X or level DOMINATED BY X)")
            if A.aggregates_in(c):
                raise ParseError("a window condition cannot use aggregates")
            rest.append(c)
        filt = None
        for c in rest:
            filt = c if filt is None else A.Binary("AND", filt, c)
        return clause, filt

    def w_rows(self, n):
        return A.Window("rows", rows=int(n))

    def w_unbounded(self):
        return A.Window("unbounded")

    def w_range(self, amount, unit=None):
        # the length is bounded in instants by the analyzer (limits.py)
        unit = _UNITS[str(unit).lower()] if unit else "seconds"
        return A.Window("range", range_amount=float(amount), range_unit=unit)

    def w_range_slide(self, amount, unit, slide, slide_unit):
        w = self.w_range(amount, unit)
        return dataclasses.replace(w, slide_amount=float(slide),
                                   slide_unit=_UNITS[str(slide_unit).lower()] if slide_unit else "seconds")

    def w_now(self):
        return A.Window("now")

    def w_partition(self, _kw, names, n):
        return A.Window("partition", rows=int(n), partition_by=names)

    def w_partition_level(self, _kw, names, cond, n):
        # `[Partition By level in {C} Rows 100]`: partition by level, level clause `in {C}`
        if names[-1].lower() != "level":
            raise ParseError(
                f"a level condition after PARTITION BY must follow the attribute 'level', not {names[-1]!r}"
            )
        return A.Window("partition", rows=int(n), partition_by=names, clause=cond)

    def name_list(self, *names):
        return tuple(str(n) for n in names)

    def level_clause(self, word, cond):
        if str(word).lower() != "level":
            raise ParseError(f"a window clause filters on 'level' only, not {str(word)!r}")
        return cond

    def lc_in(self, *lits):
        return A.LevelClause("in", tuple(lits))

    def lc_eq(self, lit):
        return A.LevelClause("eq", (lit,))

    def lc_dominated(self, lit):
        return A.LevelClause("dominated", (lit,))

    def level_lit(self, tok):
        if isinstance(tok, str) and not isinstance(tok, Token):
            return tok  # already a vector
        if tok.type == "STRING":
            return _unquote(tok)
        return str(tok)

    def level_vector(self, *comps):
        return "[" + ",".join(comps) + "]"

    def vcomp(self, tok):
        return str(tok)

    # ---- expressions ----
    def or_(self, a, b):
        return A.Binary("OR", a, b)

    def and_(self, a, b):
        return A.Binary("AND", a, b)

    def not_(self, a):
        return A.Unary("NOT", a)

    def compare(self, a, op, b):
        return A.Binary(_COMP.get(str(op), str(op)), a, b)

    def arith(self, a, op, b):
        return A.Binary(str(op), a, b)

    def neg(self, a):
        if isinstance(a, A.Literal) and a.type in ("long", "double"):
            return A.Literal(-a.value, a.type)
        return A.Unary("-", a)

    def in_set(self, a, *items):
        return A.InList(a, tuple(items), False, True)

    def not_in_set(self, a, _kw, *items):
        return A.InList(a, tuple(items), True, True)

    def in_list(self, a, *items):
        return A.InList(a, tuple(items), False, False)

    def not_in_list(self, a, _kw, *items):
        return A.InList(a, tuple(items), True, False)

    def set_item(self, tok):
        if not isinstance(tok, Token):
            return A.LevelLiteral(tok)  # a vector
        if tok.type == "NAME":
            return A.Column(None, str(tok))  # a level name; analysis decides
        if tok.type == "STRING":
            return A.Literal(_unquote(tok), "string")
        if tok.type == "INT":
            return A.Literal(int(tok), "long")
        return A.Literal(float(tok), "double")

    def dominated_by(self, a, lit):
        return A.DominatedBy(a, A.LevelLiteral(lit))

    def is_null(self, a):
        return A.IsNull(a, False)

    def is_not_null(self, a):
        return A.IsNull(a, True)

    def int_lit(self, t):
        return A.Literal(int(t), "long")

    def dec_lit(self, t):
        return A.Literal(float(t), "double")

    def str_lit(self, t):
        return A.Literal(_unquote(t), "string")

    def true_lit(self, _t):
        return A.Literal(True, "boolean")

    def false_lit(self, _t):
        return A.Literal(False, "boolean")

    def null_lit(self, _t):
        return A.Literal(None, "null")

    def column(self, name):
        return A.Column(None, str(name))

    def qcolumn(self, q, name):
        return A.Column(str(q), str(name))

    def count_star(self, agg):
        if str(agg).upper() != "COUNT":
            raise ParseError(f"{str(agg).upper()}(*) is not an aggregate; only COUNT(*) takes *")
        return A.Aggregate("COUNT", None)

    def aggregate(self, agg, e):
        return A.Aggregate(str(agg).upper(), e)

    def aggregate_distinct(self, agg, _distinct, e):
        return A.Aggregate(str(agg).upper(), e, distinct=True)

    def vector_lit(self, v):
        return A.LevelLiteral(v)


def _level_text(e: A.Expr) -> str | None:
    """A level as written next to ``level`` in a window condition (a name, a string, a number, a
    vector), or None."""
    if isinstance(e, A.Column) and e.qualifier is None:
        return e.name
    if isinstance(e, A.LevelLiteral):
        return e.text
    if isinstance(e, A.Literal) and e.type == "string":
        return str(e.value)
    if isinstance(e, A.Literal) and e.type == "long":
        return str(e.value)
    return None


def _level_clause_of(c: A.Expr) -> A.LevelClause | None:
    """``c`` as a level clause if it is one in the forms a window takes: ``level in {..}``,
    ``level = X``, ``level DOMINATED BY X`` (``level`` unqualified or qualified)."""
    def is_level(x):
        return isinstance(x, A.Column) and x.name.lower() == "level"

    if isinstance(c, A.InList) and not c.negated and is_level(c.operand):
        levels = [_level_text(i) for i in c.items]
        return A.LevelClause("in", tuple(levels)) if None not in levels else None
    if isinstance(c, A.Binary) and c.op == "=" and is_level(c.left):
        lv = _level_text(c.right)
        return A.LevelClause("eq", (lv,)) if lv is not None else None
    if isinstance(c, A.DominatedBy) and is_level(c.operand):
        return A.LevelClause("dominated", (c.level.text,))
    return None


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", maybe_placeholders=True, propagate_positions=False)


_TERMINAL_NAMES = {
    "NAME": "a name", "INT": "an integer", "DECIMAL": "a number", "STRING": "a string",
    "COMMA": "','", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'",
    "RBRACE": "'}'", "SEMICOLON": "';'", "DOT": "'.'", "STAR": "'*'", "EQUAL": "'='",
    "$END": "end of query", "COMP_OP": "a comparison", "ADD_OP": "'+' or '-'", "MUL_OP": "'*' or '/'",
}


def _describe_expected(expected) -> str:
    names = []
    for t in sorted(expected):
        if t.startswith("__ANON"):
            continue
        names.append(_TERMINAL_NAMES.get(t, t))
    # keywords (FROM, WHERE, ...) first: they are what a user most likely mistyped
    names = sorted(set(names), key=lambda n: (not n.isalpha(), n))
    if len(names) > 8:
        names = names[:8] + ["…"]
    return ", ".join(names)


_TOO_DEEP = (f"query too deeply nested to parse here (at most {MAX_NESTING} nested SELECTs and {MAX_EXPR_DEPTH} "
              f"nested operators)")


def parse(text: str) -> A.Query | A.Compound:
    """Parse one MLS-CQL query; raises ParseError with line/column on bad input, LimitError for a
    text, a nesting of SELECTs or an expression beyond the bounds of ``limits.py`` or a number
    written with absurdly many digits (window sizes and values are bounded by the analyzer)."""
    if not isinstance(text, str) or not text.strip():
        raise ParseError("empty query")
    check_text(text)  # before lark: its time grows with the text
    try:
        tree = _parser().parse(text)  # LALR: iterative, whatever the nesting
        # before anything recursive (the transformer recurses once per level of the tree) and before
        # int()/float() meet a number of thousands of digits; itself iterative
        check_tree(tree)
        return _ToAst().transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, QueryError):
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):  # out of stack within the bounds: still one line
            raise LimitError(_TOO_DEEP) from None
        raise
    except RecursionError:
        raise LimitError(_TOO_DEEP) from None
    except UnexpectedEOF as e:
        raise ParseError(f"unexpected end of query; expected {_describe_expected(e.expected)}") from None
    except UnexpectedToken as e:
        got = "end of query" if e.token.type == "$END" else repr(str(e.token))
        raise ParseError(
            f"line {e.line}, column {e.column}: unexpected {got}; expected {_describe_expected(e.expected)}"
        ) from None
    except UnexpectedCharacters as e:
        ch = text[e.pos_in_stream] if e.pos_in_stream is not None and e.pos_in_stream < len(text) else "?"
        raise ParseError(f"line {e.line}, column {e.column}: unexpected character {ch!r}") from None
    except UnexpectedInput as e:  # pragma: no cover - other lark input errors
        raise ParseError(str(e).splitlines()[0]) from None
