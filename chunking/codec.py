"""Wire format of chunks and chunk results.

Layout (all integers big-endian)::

    magic (4 bytes: b"STC1" chunk, b"STR1" result)
    u32  header length, header (UTF-8 JSON)
    per table, in the order the header lists them:
        u64 length, Arrow IPC *stream* bytes (schema + record batches)

Tables keep their schema (including metadata) and may be empty.  Absent
tables (``state=None``) are simply not written; the header says which exist.
"""

from __future__ import annotations

import json
import struct

import pyarrow as pa
import pyarrow.ipc as ipc

from strata.arrowio import MAX_DECODED_BYTES, from_ipc

from .model import Chunk, ChunkResult, QueryChunk

__all__ = ["encode_chunk", "decode_chunk", "encode_result", "decode_result", "CodecError"]

CHUNK_MAGIC = b"STC1"
RESULT_MAGIC = b"STR1"
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class CodecError(ValueError):
    """Bytes that are not a chunk / result of this format."""


def _table_bytes(t: pa.Table) -> bytes:
    if not isinstance(t, pa.Table):
        raise CodecError(f"expected a pyarrow Table, got {type(t).__name__}")
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


def _pack(magic: bytes, header: dict, tables: list[pa.Table]) -> bytes:
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    parts = [magic, _U32.pack(len(h)), h]
    for t in tables:
        b = _table_bytes(t)
        parts.append(_U64.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


class _Reader:
    def __init__(self, data, magic: bytes, what: str):
        self.buf = memoryview(bytes(data) if not isinstance(data, (bytes, bytearray, memoryview)) else data)
        self.pos = 0
        self.what = what
        if bytes(self.buf[:4]) != magic:
            raise CodecError(f"not an encoded {what} (bad magic {bytes(self.buf[:4])!r})")
        self.pos = 4
        self.budget = MAX_DECODED_BYTES  # what all tables of one chunk/result may decode to together

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise CodecError(f"truncated encoded {self.what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def header(self) -> dict:
        (n,) = _U32.unpack(self.take(4))
        try:
            return json.loads(bytes(self.take(n)).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CodecError(f"bad header in encoded {self.what}: {e}") from None

    def table(self) -> pa.Table:
        (n,) = _U64.unpack(self.take(8))
        raw = self.take(n)
        try:
            t = from_ipc(bytes(raw), max_bytes=self.budget)
        except ValueError as e:  # malformed, or over the budget (compressed IPC is bounded too)
            raise CodecError(f"bad Arrow data in encoded {self.what}: {e}") from None
        self.budget -= t.get_total_buffer_size()
        return t

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise CodecError(f"{len(self.buf) - self.pos} trailing bytes after encoded {self.what}")


def encode_chunk(chunk: Chunk) -> bytes:
    tables: list[pa.Table] = []
    qs = []
    for q in chunk.queries:
        qs.append(
            {
                "query_id": q.query_id,
                "chunk_id": int(q.chunk_id),
                "instants": [int(x) for x in q.instants],
                "prev_instant": None if q.prev_instant is None else int(q.prev_instant),
                "state_upto": None if q.state_upto is None else int(q.state_upto),
                "items": len(q.items),
                "state": q.state is not None,
            }
        )
        tables.extend(q.items)
        if q.state is not None:
            tables.append(q.state)
    header = {
        "chunk_id": int(chunk.chunk_id),
        "first_ts": int(chunk.first_ts),
        "last_ts": int(chunk.last_ts),
        "queries": qs,
    }
    if chunk.streams:
        header["streams"] = [[name, [list(c) for c in cols]] for name, cols in chunk.streams]
    return _pack(CHUNK_MAGIC, header, tables)


def decode_chunk(data) -> Chunk:
    r = _Reader(data, CHUNK_MAGIC, "chunk")
    h = r.header()
    try:
        queries = []
        for qh in h["queries"]:
            items = [r.table() for _ in range(int(qh["items"]))]
            state = r.table() if qh["state"] else None
            queries.append(
                QueryChunk(
                    query_id=qh["query_id"],
                    chunk_id=qh["chunk_id"],
                    items=items,
                    instants=list(qh["instants"]),
                    prev_instant=qh["prev_instant"],
                    state=state,
                    state_upto=qh["state_upto"],
                )
            )
        streams = tuple((str(n), tuple((str(c), str(t)) for c, t in cols)) for n, cols in h.get("streams", ()))
        chunk = Chunk(chunk_id=h["chunk_id"], first_ts=h["first_ts"], last_ts=h["last_ts"], queries=queries,
                      streams=streams)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CodecError):
            raise
        raise CodecError(f"bad chunk header: {e!r}") from None
    r.done()
    return chunk


def encode_result(result: ChunkResult) -> bytes:
    header = {
        "query_id": result.query_id,
        "chunk_id": int(result.chunk_id),
        "state_upto": None if result.state_upto is None else int(result.state_upto),
        "state": result.state is not None,
        "stats": result.stats or {},
    }
    if result.error is not None:
        header["error"] = str(result.error)
        header["error_ts"] = None if result.error_ts is None else int(result.error_ts)
    tables = [result.rows] + ([result.state] if result.state is not None else [])
    return _pack(RESULT_MAGIC, header, tables)


def decode_result(data) -> ChunkResult:
    r = _Reader(data, RESULT_MAGIC, "result")
    h = r.header()
    try:
        rows = r.table()
        state = r.table() if h["state"] else None
        res = ChunkResult(
            query_id=h["query_id"],
            chunk_id=h["chunk_id"],
            rows=rows,
            state=state,
            state_upto=h["state_upto"],
            stats=dict(h.get("stats") or {}),
            error=None if h.get("error") is None else str(h["error"]),
            error_ts=None if h.get("error_ts") is None else int(h["error_ts"]),
        )
    except (KeyError, TypeError) as e:
        raise CodecError(f"bad result header: {e!r}") from None
    r.done()
    return res
