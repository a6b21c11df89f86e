"""Arrow IPC stream bytes <-> tables (what client, master and worker messages carry).

Decoding is bounded (:func:`from_ipc`): the bytes on the wire say nothing about what they
decode to, since IPC bodies may be LZ4/zstd-compressed (0.13 MB of zstd decoded to 201 MB).
Every message's metadata is read first and the decoded size it declares is summed *before*
anything is decompressed; a stream over its reader's cap is refused whole, with one line.
"""

from __future__ import annotations

import struct

import pyarrow as pa

__all__ = ["ARROW_TYPES", "to_ipc", "from_ipc", "IpcError", "BatchTooLarge", "MAX_DECODED_BYTES", "same_table"]

#: Arrow type of each MLS-CQL value type (declared attributes, levels, output columns)
ARROW_TYPES = {
    "string": pa.string(),
    "double": pa.float64(),
    "long": pa.int64(),
    "timestamp": pa.int64(),
    "boolean": pa.bool_(),
    "level": pa.string(),
    "null": pa.string(),
}

#: default cap on what one IPC stream may decode to (callers with a tighter bound pass theirs)
MAX_DECODED_BYTES = 1 << 30


class IpcError(ValueError):
    """Bytes that are not a well-formed Arrow IPC stream (a ValueError: callers refuse the batch)."""


class BatchTooLarge(IpcError):
    """An IPC stream that would decode to more bytes or rows than its reader allows."""


def same_table(a: pa.Table | None, b: pa.Table | None) -> bool:
    """Whether two tables (or None) hold the same schema and values (the same object: at once)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return a.num_rows == b.num_rows and a.schema.equals(b.schema) and a.equals(b)


def to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data, max_bytes: int | None = MAX_DECODED_BYTES, max_rows: int | None = None) -> pa.Table:
    """The table of an IPC stream, or :class:`BatchTooLarge` if it decodes to more than
    ``max_bytes`` (all batches and dictionaries together) or holds more than ``max_rows``
    rows (``None``: no cap).

    Compressed bodies are accepted only within the cap: each compressed buffer starts with
    its decoded length, which is exactly what pyarrow allocates for it, so the sum of the
    declared lengths bounds the memory before any decompression happens.  The batches are
    then read one at a time and the running totals checked again (belt and braces).
    Anything malformed raises :class:`IpcError` with one line; both are ValueErrors, so a
    caller's ``except ValueError`` refuses the batch and applies nothing of it."""
    buf = pa.py_buffer(data)
    try:
        _check_declared(buf, max_bytes, max_rows)
        return _read_capped(buf, max_bytes, max_rows)
    except (pa.ArrowException, OSError) as e:  # e.g. an OSError for a truncated message body
        raise IpcError(_one_line(e)) from None


def _enforce(total: int, rows: int, max_bytes: int | None, max_rows: int | None) -> None:
    if max_bytes is not None and total > max_bytes:
        raise BatchTooLarge(f"batch too large: decodes to more than {_size(max_bytes)}")
    if max_rows is not None and rows > max_rows:
        raise BatchTooLarge(f"batch too large: more than {max_rows} rows")


def _check_declared(buf: pa.Buffer, max_bytes: int | None, max_rows: int | None) -> None:
    """Pass 1, metadata only: what every message declares it decodes to (nothing decompressed)."""
    total = rows = 0
    for msg in pa.ipc.MessageReader.open_stream(pa.BufferReader(buf)):
        n, size = _declared(msg)
        rows += n
        total += size
        _enforce(total, rows, max_bytes, max_rows)


def _read_capped(buf: pa.Buffer, max_bytes: int | None, max_rows: int | None) -> pa.Table:
    """Pass 2: decode batch by batch, stopping as soon as a running total is over a cap;
    each batch is validated in full (offsets in bounds, UTF-8), since nothing downstream
    expects a table whose buffers lie about their contents."""
    batches = []
    total = rows = 0
    with pa.ipc.open_stream(buf) as reader:
        for batch in reader:
            total += batch.get_total_buffer_size()  # reads no data; a shared dictionary counts per batch
            rows += batch.num_rows
            _enforce(total, rows, max_bytes, max_rows)
            batch.validate(full=True)  # IPC data is not checked by pyarrow: bad offsets would crash later
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=reader.schema)


# ---- the flatbuffer metadata of one IPC message (format/Message.fbs) -------------------------------
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # MessageHeader union tags


def _declared(msg: pa.ipc.Message) -> tuple[int, int]:
    """(rows, decoded bytes) a message declares; a schema declares none."""
    fb = _Flat(msg.metadata)
    root = fb.root()
    kind = fb.scalar(root, 1, "B", 0)
    header = fb.table(root, 2)
    if kind == _SCHEMA:
        return 0, 0
    if kind == _DICTIONARY_BATCH:
        data = fb.table(header, 1) if header is not None else None
        return 0, _batch_bytes(fb, data, msg.body)
    if kind == _RECORD_BATCH:
        rows = fb.scalar(header, 0, "q", 0) if header is not None else 0
        if rows < 0:
            raise IpcError("IPC batch declares a negative number of rows")
        return rows, _batch_bytes(fb, header, msg.body)
    raise IpcError(f"not a record batch stream (IPC message of type {kind})")


def _batch_bytes(fb: "_Flat", batch: int | None, body) -> int:
    """Decoded size of a RecordBatch's buffers: their lengths, or for a compressed body the
    decoded length each buffer's first 8 bytes declare (-1: stored uncompressed)."""
    if batch is None:
        raise IpcError("IPC batch message without its header")
    buffers = fb.structs(batch, 2, 16)
    compressed = fb.table(batch, 3) is not None
    view = memoryview(body) if body is not None else memoryview(b"")
    total = 0
    for pos in buffers:
        offset, length = fb.unpack("<qq", pos)
        if offset < 0 or length < 0 or offset + length > len(view):
            raise IpcError("IPC buffer outside the message body")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise IpcError("compressed IPC buffer shorter than its length prefix")
        (decoded,) = struct.unpack_from("<q", view, offset)
        if decoded < -1:
            raise IpcError("compressed IPC buffer declares a negative length")
        total += length - 8 if decoded == -1 else decoded
    return total


class _Flat:
    """Bounds-checked reads of a flatbuffer (tables, scalars, vectors of structs): just what
    :func:`_declared` needs, so the limits are known before pyarrow decodes anything."""

    def __init__(self, buf):
        self.b = memoryview(buf) if buf is not None else memoryview(b"")

    def unpack(self, fmt: str, pos: int) -> tuple:
        size = struct.calcsize(fmt)
        if pos < 0 or pos + size > len(self.b):
            raise IpcError("bad IPC message metadata (offset out of range)")
        return struct.unpack_from(fmt, self.b, pos)

    def root(self) -> int:
        return self.unpack("<I", 0)[0]

    def _field(self, table: int, index: int) -> int | None:
        """Absolute position of field ``index`` of the table at ``table``, None if absent."""
        vtable = table - self.unpack("<i", table)[0]
        vt_size = self.unpack("<H", vtable)[0]
        if 4 + 2 * index + 2 > vt_size:
            return None
        off = self.unpack("<H", vtable + 4 + 2 * index)[0]
        return table + off if off else None

    def scalar(self, table: int, index: int, fmt: str, default):
        pos = self._field(table, index)
        return default if pos is None else self.unpack("<" + fmt, pos)[0]

    def table(self, table: int, index: int) -> int | None:
        pos = self._field(table, index)
        return None if pos is None else pos + self.unpack("<I", pos)[0]

    def structs(self, table: int, index: int, size: int) -> list[int]:
        """Positions of the elements of a vector of ``size``-byte structs (empty if absent)."""
        vec = self.table(table, index)
        if vec is None:
            return []
        n = self.unpack("<I", vec)[0]
        if vec + 4 + n * size > len(self.b):
            raise IpcError("bad IPC message metadata (vector out of range)")
        return [vec + 4 + i * size for i in range(n)]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
