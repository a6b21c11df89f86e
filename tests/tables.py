"""Helpers: tuples as dicts <-> Arrow tables in a stream's schema."""

from __future__ import annotations

import pyarrow as pa

from strata.arrowio import ARROW_TYPES

def to_table(config, stream: str, rows: list[dict]) -> pa.Table:
    schema = config.streams[stream]
    fields = [pa.field("ts", pa.int64()), pa.field("level", pa.string())]
    fields += [pa.field(c, ARROW_TYPES[t]) for c, t in schema.columns]
    sch = pa.schema(fields)
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in sch} for r in rows], schema=sch)


def inputs_of(config, streams: dict[str, list[dict]]) -> dict[str, pa.Table]:
    return {s: to_table(config, s, rows) for s, rows in streams.items()}


def rows_of(table) -> list[tuple]:
    if table is None:
        return []
    cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
    return list(zip(*cols))
