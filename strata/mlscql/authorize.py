"""Authorization: the one rule for which levels a session may read, and its check on queries.

A session at level ``L`` may read a level ``l`` iff ``l ≤ L`` (dissertation Alg. 2
with ≤, SEMANTICS §2 and §4.1).  :func:`may_read` is that rule; a missing or
unknown session level (a user whose users-file entry is broken has clearance
``None``) reads nothing.

:func:`authorize` applies it to every level a query *names*: window level
clauses in every spelling (``level in {..}``, ``level = X``, ``level DOMINATED
BY X``, after ``WHERE`` or ``PARTITION BY level``) and every level condition in
SELECT, WHERE, GROUP BY and HAVING (``=``, ``!=``, ``IN {..}``, ``NOT IN``,
``DOMINATED BY``).  One level the session level does not dominate rejects the
query with a message that names the clause and says nothing about data.
"""

from __future__ import annotations

from typing import Iterator

from ..lattice import Lattice, LevelError
from . import ast as A
from .errors import AuthorizationError

__all__ = ["may_read", "levels_named", "authorize"]


def may_read(lattice: Lattice, session_level: str | None, level: str | None) -> bool:
    """``level ≤ session_level`` for canonical levels of ``lattice``; False for anything else."""
    if not isinstance(session_level, str) or not isinstance(level, str):
        return False
    try:
        if lattice.parse(session_level) != session_level or lattice.parse(level) != level:
            return False
    except LevelError:
        return False
    return lattice.leq(level, session_level)


def levels_named(q: A.Query) -> Iterator[tuple[str, str]]:
    """``(clause, level)`` for every level written in an analyzed query, in text order."""
    for f in q.from_:
        w = f.window
        if w is not None and w.clause is not None:
            for lv in w.clause.levels:
                yield f"window clause of {f.name}", lv
    parts = [(f"window condition of {f.name}", f.window.filter) for f in q.from_
             if f.window is not None and f.window.filter is not None]
    parts += [("SELECT", s.expr) for s in q.select or ()]
    parts += [("WHERE", q.where)] + [("GROUP BY", g) for g in q.group_by] + [("HAVING", q.having)]
    for ctx, e in parts:
        if e is None:
            continue
        for x in A.walk(e):
            if isinstance(x, A.LevelLiteral):
                yield f"{ctx} condition", x.text
            elif isinstance(x, A.DominatedBy):  # its level is a field, not a child
                yield f"{ctx} condition", x.level.text


def authorize(q: A.Query, lattice: Lattice, level: str) -> None:
    """Reject ``q`` unless the session ``level`` dominates every level it names."""
    for ctx, lv in levels_named(q):
        if not may_read(lattice, level, lv):
            raise AuthorizationError(f"{ctx} names level {lv}, which the query level {level} does not dominate")
