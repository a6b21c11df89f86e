"""Print an AST back to MLS-CQL text that re-parses to the same query."""

from __future__ import annotations

import re
from dataclasses import replace

from strata.names import NAME_KEYWORDS, RESERVED_WORDS

from . import ast as A

__all__ = ["to_text", "expr_text"]

_PREC = {"OR": 1, "AND": 2, "NOT": 3, "=": 4, "!=": 4, "<": 4, "<=": 4, ">": 4, ">=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_ATOM = 9


def _prec(e: A.Expr) -> int:
    if isinstance(e, A.Binary):
        return _PREC[e.op]
    if isinstance(e, A.Unary):
        return 3 if e.op == "NOT" else 7
    if isinstance(e, (A.InList, A.DominatedBy, A.IsNull)):
        return 4
    if isinstance(e, A.Literal) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool) and e.value < 0:
        return 7
    return _ATOM


def _wrap(e: A.Expr, min_prec: int, strict: bool = False) -> str:
    s = expr_text(e)
    p = _prec(e)
    return f"({s})" if p < min_prec or (strict and p == min_prec) else s


def _number(v) -> str:
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    r = repr(float(v))
    return r if any(c in r for c in ".e") else r + ".0"


def _literal(e: A.Literal) -> str:
    if e.type == "null":
        return "NULL"
    if e.type == "boolean":
        return "TRUE" if e.value else "FALSE"
    if e.type == "string":
        return "'" + str(e.value).replace("'", "''") + "'"
    return _number(e.value)


def expr_text(e: A.Expr) -> str:
    if isinstance(e, A.Column):
        return f"{e.qualifier}.{e.name}" if e.qualifier else e.name
    if isinstance(e, A.Literal):
        return _literal(e)
    if isinstance(e, A.LevelLiteral):
        return level_text(e.text)
    if isinstance(e, A.Aggregate):
        return f"{e.func}({'*' if e.arg is None else ('DISTINCT ' if e.distinct else '') + expr_text(e.arg)})"
    if isinstance(e, A.Unary):
        if e.op == "NOT":
            return "NOT " + _wrap(e.operand, 3)
        return "-" + _wrap(e.operand, 8)
    if isinstance(e, A.Binary):
        p = _PREC[e.op]
        if p == 4:  # comparisons do not associate
            return f"{_wrap(e.left, 5)} {e.op} {_wrap(e.right, 5)}"
        return f"{_wrap(e.left, p)} {e.op} {_wrap(e.right, p, strict=True)}"
    if isinstance(e, A.InList):
        items = ", ".join(expr_text(i) for i in e.items)
        body = "{" + items + "}" if e.braces else "(" + items + ")"
        return f"{_wrap(e.operand, 5)} {'NOT IN' if e.negated else 'IN'} {body}"
    if isinstance(e, A.DominatedBy):
        return f"{_wrap(e.operand, 5)} DOMINATED BY {level_text(e.level.text)}"
    if isinstance(e, A.IsNull):
        return f"{_wrap(e.operand, 5)} IS {'NOT ' if e.negated else ''}NULL"
    raise TypeError(f"not an expression: {e!r}")


def _amount(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


# what the lexer reads as one NAME (grammar.lark's NAME: strata/names.py's NAME_KEYWORDS are not names;
# a test keeps the two lists equal), as an INT, and the words that, where an expression may stand, lex as
# something else (TRUE, NULL, ISTREAM, ..., an aggregate before '(', a time unit after a number)
_NAME = re.compile(r"(?!(" + "|".join(NAME_KEYWORDS) + r")\b)[A-Za-z_][A-Za-z0-9_]*\Z", re.I)
_INT = re.compile(r"[0-9]+\Z")
_WORDS = re.compile(r"(COUNT|SUM|AVG|MIN|MAX|SECONDS?|SECS?|MINUTES?|MINS?|HOURS?|DAYS?|MILLISECONDS?|MS)\Z", re.I)


def _bare_name(text: str) -> bool:
    return bool(_NAME.match(text)) and text.upper() not in RESERVED_WORDS and not _WORDS.match(text)


def _bare_vector(text: str) -> bool:
    """Whether ``text`` reads back as a vector literal (``level_vector``: NAME, INT or ⊥ components;
    inside ``[…]`` the contextual lexer expects nothing else, so ``[TRUE,null]`` is a vector)."""
    if not (text.startswith("[") and text.endswith("]")):
        return False
    return all(c == "⊥" or _INT.match(c) or _NAME.match(c) for c in text[1:-1].split(","))


def level_text(level: str) -> str:
    """A level literal as a query spells it so that it parses back to the same level: a plain name
    (``S``) or a vector the grammar reads as one (``[1,B]``, ``[⊥,T]``) as it is; anything else
    quoted as a string (``'(S,{NATO})'``, ``'(U,{})'``, a vector with a component the lexer does
    not read as a name or a number, a name that is a keyword).  A quoted level is valid wherever
    a level literal stands next to ``level`` (window clauses, ``=``/``!=``, ``IN {…}``/``IN (…)``,
    ``DOMINATED BY``); a level literal anywhere else was written as a vector and prints bare."""
    if _bare_name(level) or _bare_vector(level):
        return level
    return "'" + level.replace("'", "''") + "'"


def window_text(w: A.Window) -> str:
    if w.kind == "rows":
        spec = f"ROWS {w.rows}"
    elif w.kind == "range":
        spec = f"RANGE {_amount(w.range_amount)} {w.range_unit}"
        if w.slide_amount is not None:
            spec += f" SLIDE {_amount(w.slide_amount)} {w.slide_unit}"
    elif w.kind == "unbounded":
        spec = "RANGE UNBOUNDED"
    elif w.kind == "now":
        spec = "NOW"
    elif w.kind == "relation":  # a stored relation: a level clause only
        spec = ""
    else:
        spec = f"PARTITION BY {', '.join(w.partition_by)} ROWS {w.rows}"
    conds = []
    if w.clause is not None:
        c = w.clause
        if c.form == "in":
            conds.append("level in {" + ", ".join(level_text(x) for x in c.levels) + "}")
        elif c.form == "eq":
            conds.append(f"level = {level_text(c.levels[0])}")
        else:
            conds.append(f"level DOMINATED BY {level_text(c.levels[0])}")
    if w.filter is not None:  # a left-nested AND of conjuncts, none of them an AND (parser.window_where)
        conds += [_wrap(c, 3) for c in A.conjuncts(w.filter)]
        return f"[{spec} WHERE {' AND '.join(conds)}]"
    if not spec:
        return f"[{conds[0]}]" if conds else ""
    return f"[{spec} {conds[0]}]" if conds else f"[{spec}]"


def to_text(q: A.Query | A.Compound) -> str:
    if isinstance(q, A.Compound):
        # parentheses where the left-to-right order would read otherwise: around a compound branch,
        # and around what comes before an INTERSECT that follows another operator (INTERSECT binds
        # tighter); the stream operator then goes around the whole
        grouped = any(op == "INTERSECT" and k and any(o != "INTERSECT" for o in q.ops[:k])
                      for k, op in enumerate(q.ops))
        wrapped = q.wrapped or (grouped and q.r2s is not None)
        text = to_text(q.branches[0] if wrapped or q.r2s is None else replace(q.branches[0], r2s=q.r2s))
        mixed = False
        for op, b in zip(q.ops, q.branches[1:]):
            if op == "INTERSECT" and mixed:
                text = f"({text})"
            mixed = mixed or op != "INTERSECT"
            text += f" {op} " + (f"({to_text(b)})" if isinstance(b, A.Compound) else to_text(b))
        return f"{q.r2s}({text})" if wrapped else text
    sel = "*" if q.select is None else ", ".join(
        expr_text(i.expr) + (f" AS {i.alias}" if i.alias else "") for i in q.select
    )
    items = []
    for f in q.from_:
        if f.subquery is not None:
            items.append(f"({to_text(f.subquery)}) {f.alias}")
            continue
        s = f.stream
        win = window_text(f.window) if f.window is not None else ""
        if win:  # (a stored relation without a level clause has none)
            s += " " + win
        if f.alias:
            s += f" {f.alias}"
        items.append(s)
    head = "SELECT " + (f"{q.r2s} " if q.r2s and not q.wrapped else "") + ("DISTINCT " if q.distinct else "")
    text = head + sel + " FROM " + ", ".join(items)
    if q.where is not None:
        text += " WHERE " + expr_text(q.where)
    if q.group_by and (not q.distinct or q.distinct_rows):  # else the analyzer's grouping by the select list
        text += " GROUP BY " + ", ".join(expr_text(g) for g in q.group_by)
    if q.having is not None:
        text += " HAVING " + expr_text(q.having)
    if q.wrapped:
        text = f"{q.r2s}({text})"
    return text
