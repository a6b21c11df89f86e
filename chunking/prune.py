"""Dropping, before a chunk is sent, the new tuples no window can hold (and the columns no query reads).

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

import dataclasses
from dataclasses import replace

import numpy as np
import pyarrow as pa

from strata.mlscql import ast as A

from .chunker import _partition_tail
from .model import Chunk, QueryChunk

__all__ = ["prune_chunk", "prune_query_chunk", "work_rows", "new_rows", "used_columns", "project_chunk"]


def _unsorted(ts: np.ndarray) -> bool:
    """Whether some ``ts`` is smaller than the one before it (not in arrival order by ts)."""
    return len(ts) > 1 and bool(np.any(ts[1:] < ts[:-1]))


def _last_per_instant(t: pa.Table, n: int) -> pa.Table:
    """Rows among the last ``n`` of their ``ts`` (``t`` sorted by ts, in arrival order)."""
    if t.num_rows <= n:
        return t
    if n <= 0:
        return t.slice(0, 0)
    ts = t.column("ts").to_numpy()
    ends = np.append(np.flatnonzero(ts[1:] != ts[:-1]) + 1, len(ts))  # one past each instant's last row
    begins = np.concatenate(([0], ends[:-1]))
    keep = np.arange(len(ts)) >= np.repeat(np.maximum(begins, ends - n), ends - begins)  # its last n rows
    if keep.all():
        return t
    return t.filter(pa.array(keep))


def _prune_item(table: pa.Table, window, first: int) -> pa.Table:
    kind = getattr(window, "kind", None)
    if kind not in ("rows", "partition") or table.num_rows == 0:
        return table
    n = int(window.rows or 0)
    ts = table.column("ts").to_numpy()
    if _unsorted(ts):
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
    """What travels: ``chunk`` with every query chunk pruned (queries unknown to ``queries`` are kept
    as they are) and its tables cut to the columns its queries read (:func:`project_chunk`)."""
    out = [prune_query_chunk(queries[qc.query_id], qc) if qc.query_id in queries else qc for qc in chunk.queries]
    if not all(a is b for a, b in zip(out, chunk.queries)):
        chunk = replace(chunk, queries=out)
    return project_chunk(chunk, queries)


def _pruned_count(table: pa.Table, window, first: int) -> int:
    """How many rows :func:`_prune_item` keeps, without building the table (partitioned windows and
    unsorted input: all rows, an upper bound)."""
    n_rows = table.num_rows
    if getattr(window, "kind", None) != "rows" or n_rows == 0 or getattr(window, "partition_by", None):
        return n_rows
    n = int(window.rows or 0)
    ts = table.column("ts").to_numpy()
    if _unsorted(ts):
        return n_rows
    k = int(np.searchsorted(ts, first, side="left"))
    new = ts[k:]
    if len(new) <= n:
        return n_rows
    cuts = np.flatnonzero(np.diff(new)) + 1
    counts = np.diff(np.concatenate(([0], cuts, [len(new)])))
    return k + int(np.minimum(counts, n).sum())


def work_rows(chunk: Chunk, queries: dict) -> int:
    """The rows ``chunk`` gives Spark once pruned (:func:`prune_chunk`), summed over its queries: what
    the master weighs when it decides whether a backlog is worth splitting over several workers."""
    total = 0
    for qc in chunk.queries:
        cq = queries.get(qc.query_id)
        if cq is None or not qc.instants or len(cq.query.from_) != len(qc.items):
            total += sum(t.num_rows for t in qc.items)
            continue
        first = int(min(qc.instants))
        total += sum(_pruned_count(t, f.window, first) for t, f in zip(qc.items, cq.query.from_))
    return total


def new_rows(chunk: Chunk) -> int:
    """The rows ``chunk`` adds to a merged unit when it follows another one
    (:func:`~strata.chunking.chunker.merge_chunks` keeps only the first chunk's legacy): its tuples
    at or after each query chunk's first instant.  A RANGE 10 s chunk of one 20 k-tuple instant
    carries 180 k legacy rows and adds 20 k."""
    total = 0
    for qc in chunk.queries:
        if not qc.instants:
            continue
        first = int(min(qc.instants))
        for t in qc.items:
            if t.num_rows:
                ts = t.column("ts").to_numpy()
                if _unsorted(ts):
                    total += int((ts >= first).sum())
                else:
                    total += t.num_rows - int(np.searchsorted(ts, first, side="left"))
    return total


#: the query-tree nodes :func:`used_columns` knows; a query holding any other node is sent whole
_KNOWN_NODES = ("Column", "Literal", "LevelLiteral", "Unary", "Binary", "InList", "DominatedBy", "IsNull",
                "Aggregate", "LevelClause", "Window", "FromItem", "SelectItem", "Query")
#: columns every chunk table keeps whatever the query reads (the engine's own: ts, level, and what a
#: stored relation's delete removes)
_ALWAYS = ("ts", "level", "_del")
#: window kinds whose contents depend on arrival order beyond the rows' order in the table: ROWS
#: windows evaluated in Spark (``lead .. ORDER BY _seq``) and stored relations (a delete names the
#: ``_seq`` of the row it removes); only chunks with one of these keep ``_seq``
_SEQ_KINDS = ("rows", "partition", "relation")


def used_columns(query) -> set[str] | None:
    """Lower-cased names of every attribute ``query`` reads anywhere (select, where, group by, having,
    windows' PARTITION BY), whatever its qualifier; None for ``SELECT *`` and when the tree holds a
    node this function does not know (then nothing is left out)."""
    out: set[str] = set()

    def visit(x) -> bool:
        if isinstance(x, (list, tuple)):
            return all(visit(y) for y in x)
        if not dataclasses.is_dataclass(x):
            return True
        if type(x).__name__ not in _KNOWN_NODES or getattr(A, type(x).__name__, None) is not type(x):
            return False
        if isinstance(x, A.Column):
            out.add(x.name.lower())
            return True
        if isinstance(x, A.Query) and x.select is None:  # SELECT *: every attribute
            return False
        if isinstance(x, A.Window):
            out.update(c.lower() for c in x.partition_by)
        return all(visit(getattr(x, f.name)) for f in dataclasses.fields(x))

    return out if visit(query) else None


def project_chunk(chunk: Chunk, queries: dict) -> Chunk:
    """``chunk`` with every table cut to the columns some query of the chunk reads (plus ``ts``,
    ``level``, and ``_seq`` when a query of the chunk has a ROWS window or a stored relation): the
    same projection for all of them, so tables that were equal (the sharing executor checks) stay
    equal.  A RANGE aggregate of ``bp`` by ``sid`` leaves ``pr``, ``weight`` and ``_seq`` of every
    legacy and new tuple behind: 45 % of the bytes encoded, sent and decoded.  Without ``_seq`` a
    table's rows are in arrival order (the chunker's); unknown queries or query forms leave the
    chunk as it is."""
    keep = set(_ALWAYS)
    for qc in chunk.queries:
        cq = queries.get(qc.query_id)
        cols = None if cq is None else used_columns(cq.query)
        if cols is None:
            return chunk
        keep |= cols
        if any(f.window.kind in _SEQ_KINDS for f in cq.query.from_):
            keep.add("_seq")
    out = []
    changed = False
    for qc in chunk.queries:
        items = []
        for t in qc.items:
            names = [n for n in t.column_names if n.lower() in keep]
            if len(names) < t.num_columns:
                t = t.select(names)
                changed = True
            items.append(t)
        out.append(replace(qc, items=items) if changed else qc)
    return replace(chunk, queries=out) if changed else chunk
