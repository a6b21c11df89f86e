"""Arrow IPC stream bytes <-> tables (what client, master and worker messages carry)."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["ARROW_TYPES", "to_ipc", "from_ipc"]

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


def to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
