"""Strata chunking: the master's input chunks (dissertation §7.2) and their wire format."""

from .chunker import Chunker, ChunkingError, stream_schema
from .codec import CodecError, decode_chunk, decode_result, encode_chunk, encode_result
from .model import SYSTEM_FIELDS, Chunk, ChunkResult, LegacyMode, QueryChunk, legacy_mode

__all__ = [
    "Chunk",
    "ChunkResult",
    "Chunker",
    "ChunkingError",
    "CodecError",
    "LegacyMode",
    "QueryChunk",
    "SYSTEM_FIELDS",
    "decode_chunk",
    "decode_result",
    "encode_chunk",
    "encode_result",
    "legacy_mode",
    "stream_schema",
]
