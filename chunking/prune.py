"""Dropping, before a chunk is sent, the new tuples no window can hold.

For a ``[ROWS N]`` window the window at instant τ is the last N visible tuples
with ``ts ≤ τ``; a new tuple that is not among the last N tuples *of its own
instant* is therefore in no window at any instant ≥ its ``ts`` (N later tuples
with ts ≤ τ always follow it).  The same holds per partition for
``[PARTITION BY a ROWS N]``.  Removing such tuples changes no window at any
instant: for a kept tuple, the N-th later tuple lies at the same instant in the
pruned and in the full stream (every instant keeps min(count, N) tuples of
each partition, and all of them when it has fewer than N).  Legacy tuples
(``ts < instants[0]``) are left alone; the chunker already cut them to what
the windows need.  ``instants`` are unchanged, so an instant whose tuples all
vanish (only with ``ROWS 0``) is still evaluated.

With 20 k-100 k tuples per instant and ``ROWS 100`` this removes > 99 % of a
chunk before it is encoded, sent and decoded; the engine (which applies the
same rule through ``worker.windows.useful_rows``) computes the same result from
either form.  Other window kinds are sent as they are.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa

from .chunker import _partition_tail
from .model import Chunk, QueryChunk

__all__ = ["prune_chunk", "prune_query_chunk"]


def _last_per_instant(t: pa.Table, n: int) -> pa.Table:
    """Rows among the last ``n`` of their ``ts`` (``t`` sorted by ts, in arrival order)."""
    if t.num_rows <= n:
        return t
    if n <= 0:
        return t.slice(0, 0)
    ts = t.column("ts").to_numpy()
    ends = np.searchsorted(ts, ts, side="right")
    keep = (ends - np.arange(len(ts))) <= n
    if keep.all():
        return t
    return t.filter(pa.array(keep))


def _prune_item(table: pa.Table, window, first: int) -> pa.Table:
    kind = getattr(window, "kind", None)
    if kind not in ("rows", "partition") or table.num_rows == 0:
        return table
    n = int(window.rows or 0)
    ts = table.column("ts").to_numpy()
    if len(ts) > 1 and bool(np.any(ts[1:] < ts[:-1])):
        return table  # not in arrival order by ts: leave it to the engine
    k = int(np.searchsorted(ts, first, side="left"))  # legacy rows [0, k)
    new = table.slice(k)
    if new.num_rows <= n:
        return table
    if kind == "rows" or not window.partition_by:
        kept = _last_per_instant(new, n)
    else:
        byname = {c.lower(): c for c in table.column_names}
        cols = tuple(byname[p.lower()] for p in window.partition_by) + ("ts",)
        kept = _partition_tail(new, cols, n)
    if kept.num_rows == new.num_rows:
        return table
    if k == 0:
        return kept
    return pa.concat_tables([table.slice(0, k), kept])


def prune_query_chunk(cq, qc: QueryChunk) -> QueryChunk:
    """``qc`` without the new tuples no ROWS/PARTITION window of ``cq`` can hold (a copy)."""
    if not qc.instants or len(cq.query.from_) != len(qc.items):
        return qc
    first = int(min(qc.instants))
    items = [_prune_item(t, f.window, first) for t, f in zip(qc.items, cq.query.from_)]
    if all(a is b for a, b in zip(items, qc.items)):
        return qc
    return replace(qc, items=items)


def prune_chunk(chunk: Chunk, queries: dict) -> Chunk:
    """``chunk`` with every query chunk pruned (queries unknown to ``queries`` are kept as they are)."""
    out = [prune_query_chunk(queries[qc.query_id], qc) if qc.query_id in queries else qc for qc in chunk.queries]
    if all(a is b for a, b in zip(out, chunk.queries)):
        return chunk
    return replace(chunk, queries=out)
