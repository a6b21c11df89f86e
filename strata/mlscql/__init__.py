"""MLS-CQL front end: parse, bound, analyze, authorize, rewrite, optimize."""

from .analyze import CompiledQuery, ItemInfo, LegacyMode, OutputColumn, analyze, compile_query, legacy_mode
from .authorize import authorize, may_read
from .errors import AuthorizationError, LimitError, OptimizationError, ParseError, QueryError, SemanticError
from .parser import parse
from .printer import expr_text, to_text

__all__ = [
    "AuthorizationError", "CompiledQuery", "ItemInfo", "LegacyMode", "LimitError", "OptimizationError", "OutputColumn",
    "ParseError", "QueryError", "SemanticError", "analyze", "authorize", "compile_query", "expr_text",
    "legacy_mode", "may_read", "parse", "to_text",
]
