"""Helpers: tuples as dicts <-> Arrow tables in a stream's schema, and the Vitals tuples the tests make
(:func:`vitals`, one builder for every test's variant; :func:`vital` and :func:`mixed_vitals` as dicts)."""

from __future__ import annotations

import threading

import pyarrow as pa

from strata.arrowio import ARROW_TYPES

#: the example configs' Vitals stream (``strata.examples.BATTLEFIELD_TOML``) in Arrow types
VITALS_TYPES = {"ts": pa.int64(), "level": pa.string(), "sid": pa.string(), "bp": pa.float64(), "pr": pa.float64(),
                "weight": pa.float64()}


def counting(start=0):
    """A column of ``start``, ``start + 1``, ... tuple by tuple (see :func:`vitals`)."""
    return lambda i, t: start + i


def in_turn(*values):
    """A column of ``values`` in turn, tuple by tuple (see :func:`vitals`)."""
    return lambda i, t: values[i % len(values)]


def vitals(ts=(), *, level="S", sid="a", bp=counting(0.0), pr=1.0, weight=1.0, seq=None, typed=True) -> pa.Table:
    """Vitals tuples, one per entry of ``ts``: their instants, or whole tuples ``(ts, level, sid, bp[, pr])``
    whose fields take the place of the keywords'.

    ``level``, ``sid``, ``bp``, ``pr``, ``weight`` and ``seq``: each one value for every tuple, a list (or an
    Arrow array, taken as it is) with one per tuple, or a function of a tuple's index ``i`` and instant
    ``t``.  ``seq``: a leading ``_seq`` column (a chunk's rows on a worker carry one); none by default.
    ``typed``: the columns in the stream's Arrow types; ``False``: as Arrow infers them from the values
    (input that is wrong on purpose)."""
    ts = list(ts)
    rows = ts if ts and isinstance(ts[0], tuple) else None
    if rows is not None:
        ts = [r[0] for r in rows]
        level, sid, bp = ([r[k] for r in rows] for k in (1, 2, 3))
        pr = [r[4] if len(r) > 4 else _value(pr, i, r[0]) for i, r in enumerate(rows)]
    cols = {} if seq is None else {"_seq": (_values(seq, ts), pa.int64())}
    for name, spec in (("ts", ts), ("level", level), ("sid", sid), ("bp", bp), ("pr", pr), ("weight", weight)):
        cols[name] = (spec if name == "ts" else _values(spec, ts), VITALS_TYPES[name])
    return pa.table({name: values if isinstance(values, pa.Array) or not typed else pa.array(values, typ)
                     for name, (values, typ) in cols.items()})


def _value(spec, i: int, t):
    return spec(i, t) if callable(spec) else spec


def _values(spec, ts: list):
    if isinstance(spec, (list, tuple, range, pa.Array)):
        return spec if isinstance(spec, pa.Array) else list(spec)
    return [_value(spec, i, t) for i, t in enumerate(ts)]


def two_per_instant(ts0: int, n: int, **columns) -> pa.Table:
    """``n`` Vitals tuples, two at each instant from ``ts0``: levels U, C, S, TS in turn, sids s0, s1, s2 in
    turn, bp 100, 101, ... (``columns``: others, as :func:`vitals` takes them)."""
    return vitals([ts0 + i // 2 for i in range(n)],
                  **{"level": in_turn("U", "C", "S", "TS"), "sid": lambda i, t: f"s{i % 3}", "bp": counting(100.0),
                     **columns})


def vital(ts: int, level: str, sid: str, bp, **more) -> dict:
    """One Vitals tuple as a dict (pr and weight 1.0)."""
    return {"ts": ts, "level": level, "sid": sid, "bp": float(bp), "pr": 1.0, "weight": 1.0, **more}


def mixed_vitals(lo: int, hi: int, per: int) -> list[dict]:
    """``per`` Vitals tuples (dicts) at each instant of ``lo``..``hi - 1``: levels U, C, S, TS in turn, five
    sids and values between 90 and 179 spread by the instant and the tuple's place in it."""
    return [vital(ts, ["U", "C", "S", "TS"][(ts + k) % 4], f"s{(ts * 7 + k) % 5}", 90 + (ts * 13 + k * 29) % 90)
            for ts in range(lo, hi) for k in range(per)]


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
