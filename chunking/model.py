"""What travels from master to worker and back, as plain data (Arrow tables).

A :class:`QueryChunk` is everything a worker needs to evaluate one query over
one run of instants, with no state kept on the worker between chunks:

* ``items[i]``: the *visible* tuples of FROM item ``i`` (level in the rewritten
  window level set), legacy first then new, in arrival order.  Columns:
  ``_seq`` (int64, arrival index within the stream; increasing), ``ts``
  (int64), ``level`` (string, canonical), then the stream's attributes in
  declaration order.  Legacy rows (dissertation Def. 13) are those with
  ``ts < instants[0]``.
* ``instants``: the instants to evaluate and output, ascending: the distinct
  ``ts`` of new visible rows over all items (SEMANTICS §5).
* ``prev_instant``: the query's evaluation instant just before
  ``instants[0]`` (``None`` at the start of the stream).  ISTREAM/DSTREAM
  compare ``R(instants[0])`` with ``R(prev_instant)``; the legacy holds what
  that needs.
* ``state``/``state_upto``: for queries evaluated with a running state
  (``LegacyMode.STATE``), an engine-defined Arrow table summarizing every
  visible tuple with ``ts <= state_upto``; ``items`` then hold only tuples with
  ``ts > state_upto``.  The master never looks inside ``state``.

A :class:`ChunkResult` carries the output rows (``ts``, ``level``, then the
query's output columns) for ``instants`` only, and, for STATE queries, the state
after ``instants[-1]``.

A query that *fails* in a chunk (SEMANTICS §8: integer overflow, or an error
while compiling or evaluating it on the worker) gets a ChunkResult with
``error`` (one line, no stack trace) and ``error_ts`` (the first instant of
``instants`` whose evaluation fails; ``None`` only if the chunk has no instant
for the query), ``rows`` holding exactly its output for the instants before
``error_ts`` (possibly none; a query that does not compile has only ``ts`` and
``level`` columns), and no state.  The result does not depend on how the input
was chunked: the master releases those rows, then stops the query with the
error at ``error_ts``.  The chunk's other queries get their normal results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

# how a compiled query's history travels; it lives with the compiled query (strata.mlscql)
from strata.mlscql.analyze import LegacyMode, legacy_mode

__all__ = ["Chunk", "LegacyMode", "QueryChunk", "ChunkResult", "SYSTEM_FIELDS", "legacy_mode"]

SYSTEM_FIELDS = ("_seq", "ts", "level")


@dataclass
class QueryChunk:
    query_id: str
    chunk_id: int
    items: list[pa.Table]
    instants: list[int]
    prev_instant: int | None = None
    state: pa.Table | None = None
    state_upto: int | None = None

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self.items)


@dataclass
class Chunk:
    """One dispatch unit: a run of instants ``[first_ts, last_ts]`` for a query set.

    ``queries`` holds a QueryChunk for every query that has at least one
    visible instant in the run (a query with none produces no output there).
    """

    chunk_id: int
    first_ts: int
    last_ts: int
    queries: list[QueryChunk]
    #: schemas of the streams its queries read that were added at run time (``strata streams add``):
    #: ((name, ((attribute, type), ...)), ...); a worker knows only its configuration's streams
    streams: tuple = ()

    @property
    def num_rows(self) -> int:
        return sum(q.num_rows for q in self.queries)


@dataclass
class ChunkResult:
    query_id: str
    chunk_id: int
    rows: pa.Table
    state: pa.Table | None = None
    state_upto: int | None = None
    stats: dict = field(default_factory=dict)
    #: the query failed (integer overflow, an engine error): a one-line reason, safe to show its owner.
    #: ``rows`` then hold its output for the instants before ``error_ts`` only, and the query stops at
    #: ``error_ts`` (the first instant whose evaluation failed); ``state`` and ``state_upto`` are None.
    error: str | None = None
    error_ts: int | None = None
