"""Helpers: tuples as dicts <-> Arrow tables in a stream's schema."""

from __future__ import annotations

import threading

import pyarrow as pa

from strata.arrowio import ARROW_TYPES

def to_table(config, stream: str, rows: list[dict]) -> pa.Table:
    schema = config.streams[stream]
    fields = [pa.field("ts", pa.int64()), pa.field("level", pa.string())]
    fields += [pa.field(c, ARROW_TYPES[t]) for c, t in schema.columns]
    if schema.relation:  # a stored relation's input rows insert or delete
        fields.append(pa.field("op", pa.string()))
    sch = pa.schema(fields)
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in sch} for r in rows], schema=sch)


def inputs_of(config, streams: dict[str, list[dict]]) -> dict[str, pa.Table]:
    return {s: to_table(config, s, rows) for s, rows in streams.items()}


def rows_of(table) -> list[tuple]:
    if table is None:
        return []
    cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
    return list(zip(*cols))


def collect_in_background(client, query_ids: list[str]) -> tuple[dict[str, list[tuple]], threading.Event]:
    """Subscribe to ``query_ids`` on a thread; rows arrive in the returned dict, the event
    is set when every stream has ended."""
    got: dict[str, list[tuple]] = {q: [] for q in query_ids}
    ended = threading.Event()

    def collect():
        for qid, table in client.subscribe(list(query_ids)):
            if table is not None:
                got[qid].extend(rows_of(table))
        ended.set()

    threading.Thread(target=collect, daemon=True).start()
    return got, ended
