"""The one rule for the names users give: streams, stored relations and their attributes, wherever
they are declared (``[streams.NAME]`` / ``[relations.NAME]`` in the configuration, ``strata streams
add`` on a running master).

A name is an identifier (``[A-Za-z_][A-Za-z0-9_]*``) of at most :data:`MAX_NAME_CHARS` characters
that a query can spell: not an MLS-CQL reserved word (:data:`RESERVED_WORDS`, the keywords the
grammar never reads as a name, whatever their case), not one of the columns every stream carries
implicitly (:data:`IMPLICIT_COLUMNS`: ``ts``, ``level``, a relation's input column ``op``), and not
starting with ``_`` (Strata's internal columns, ``_seq`` and ``_del``, are spelled so).  All
comparisons are case-insensitive, as names are in queries.  :func:`name_problem` says what is wrong
with a name in one line, or returns None.
"""

from __future__ import annotations

import re

__all__ = ["MAX_NAME_CHARS", "NAME_KEYWORDS", "RESERVED_WORDS", "IMPLICIT_COLUMNS", "name_problem", "is_identifier"]

#: longest name (PostgreSQL allows 63 bytes; names travel in every chunk's schema and every reply)
MAX_NAME_CHARS = 64

#: the words grammar.lark's NAME terminal excludes, in its order (tests/test_printer_roundtrip.py checks
#: the two are the same): never a name anywhere, a vector's components included
NAME_KEYWORDS = ("SELECT", "UNION", "EXCEPT", "DISTINCT", "FROM", "WHERE", "GROUP", "HAVING", "AND", "OR", "NOT",
                 "AS", "IN", "BY", "IS", "ROWS", "RANGE", "NOW", "DOMINATED", "PARTITION", "PARTITIONED",
                 "UNBOUNDED", "SLIDE")

#: keywords a query could not use as a name somewhere it names a stream, an alias or an attribute: NAME's
#: exclusions and the keyword terminals of higher priority (tests/test_names.py checks the list against
#: the grammar: each is refused where a name is expected, every other identifier is accepted)
RESERVED_WORDS = frozenset(NAME_KEYWORDS) | {"INTERSECT", "TRUE", "FALSE", "NULL", "ISTREAM", "RSTREAM", "DSTREAM"}

#: columns every stream has (``ts``, ``level``) or a relation's input has (``op``): a query reads
#: ``ts`` and ``level`` of every item, so no stream, relation or attribute may be named so
IMPLICIT_COLUMNS = ("ts", "level", "op")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_identifier(name) -> bool:
    return isinstance(name, str) and _IDENT.fullmatch(name) is not None


def name_problem(name, what: str = "name") -> str | None:
    """Why ``name`` cannot name a stream, relation or attribute (one line starting with ``what``,
    e.g. ``stream name``), or None if it can."""
    if not isinstance(name, str):
        return f"{what} must be text, not {type(name).__name__}"
    if len(name) > MAX_NAME_CHARS:
        return f"{what} has {len(name)} characters (at most {MAX_NAME_CHARS})"
    if not _IDENT.fullmatch(name):
        return f"{what} {name!r} is not an identifier (a letter or _, then letters, digits or _)"
    if name.startswith("_"):
        return f"{what} {name!r} starts with '_', which is kept for Strata's internal columns"
    if name.upper() in RESERVED_WORDS:
        return f"{what} {name!r} is an MLS-CQL reserved word (a query could not name it)"
    if name.lower() in IMPLICIT_COLUMNS:
        return f"{what} {name!r} is an implicit column (ts and level of every tuple, op of a relation's input)"
    return None
