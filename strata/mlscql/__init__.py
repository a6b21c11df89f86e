"""MLS-CQL front end: parse, bound, analyze, authorize, rewrite, optimize."""

from .analyze import CompiledQuery, ItemInfo, LegacyMode, OutputColumn, analyze, legacy_mode
from .analyze import compile_query as _compile_query
from .authorize import authorize, may_read
from .errors import AuthorizationError, LimitError, OptimizationError, ParseError, QueryError, SemanticError
from .limits import MAX_EXPR_DEPTH, MAX_NESTING
from .parser import parse
from .printer import expr_text, to_text

__all__ = [
    "AuthorizationError", "CompiledQuery", "ItemInfo", "LegacyMode", "LimitError", "OptimizationError", "OutputColumn",
    "ParseError", "QueryError", "SemanticError", "analyze", "authorize", "compile_query", "expr_text",
    "legacy_mode", "may_read", "parse", "to_text",
]


def compile_query(text: str, config, level: str) -> CompiledQuery:
    """Parse, analyze, authorize, rewrite and optimize ``text`` for a session at ``level``.

    The parser refuses a query beyond the bounds of ``limits.py`` before anything recursive runs;
    should a stage still run out of Python's stack (a bug: the bounds are measured to leave
    hundreds of frames to spare), the query is refused with a one-line LimitError, never a
    traceback."""
    try:
        return _compile_query(text, config, level)
    except RecursionError:
        raise LimitError(f"query too deeply nested to compile (at most {MAX_NESTING} nested SELECTs and "
                         f"{MAX_EXPR_DEPTH} nested operators; see docs/semantics.md)") from None
