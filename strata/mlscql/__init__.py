"""MLS-CQL front end: parse, analyze, authorize, rewrite, optimize."""

from .analyze import (
    AuthorizationError,
    CompiledQuery,
    ItemInfo,
    OptimizationError,
    OutputColumn,
    SemanticError,
    analyze,
    compile_query,
)
from .parser import ParseError, QueryError, parse
from .printer import expr_text, to_text

__all__ = [
    "AuthorizationError", "CompiledQuery", "ItemInfo", "OptimizationError", "OutputColumn",
    "ParseError", "QueryError", "SemanticError", "analyze", "compile_query", "expr_text",
    "parse", "to_text",
]
