"""Why the front end refuses a query: one exception class per stage.

Every message is one line, names the clause, and says nothing about data (the
front end sees only the query text, the schema and the lattice).
"""

from __future__ import annotations

__all__ = [
    "QueryError", "ParseError", "LimitError", "SemanticError", "AuthorizationError", "OptimizationError",
]


class QueryError(ValueError):
    """A query was rejected; ``stage`` is parse, limit, semantic, authorization or optimization."""

    stage = "query"

    def __init__(self, message: str):
        message = " ".join(str(message).split("\n"))
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.stage} error: {self.message}"


class ParseError(QueryError):
    stage = "parse"


class LimitError(QueryError):
    """A literal beyond a limit: a window size, a RANGE length, a number that fits no column type."""

    stage = "limit"


class SemanticError(QueryError):
    stage = "semantic"


class AuthorizationError(QueryError):
    stage = "authorization"


class OptimizationError(QueryError):
    stage = "optimization"
