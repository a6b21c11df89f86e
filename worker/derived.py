"""A query over subqueries in FROM (``SELECT … FROM (SELECT …) x [, Vitals [ROWS 5] v]``).

Each subquery is evaluated as RSTREAM over the chunk's instants (and the previous instant when
the outer query reports differences), on its own FROM items of the chunk: its output rows are its
relation R(τ) at every instant.  Those rows become the table of ``x`` (``ts`` = the instant,
``level`` = the row's level, the subquery's columns) and the outer query is evaluated over those
tables and its stream items' tables through ``[NOW]`` at the same instants, as any query is: one
Spark statement per subquery, one for the outer query.  A failure of a subquery at τ is the
query's failure at τ: the outer query is evaluated at the instants before it only
(docs/semantics.md §3, *Subqueries in FROM*).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import ARROW_TYPES
from strata.chunking.model import LegacyMode, QueryChunk, legacy_mode
from strata.mlscql.analyze import CompiledQuery

__all__ = ["DerivedRun"]


class DerivedRun:
    """Evaluation of one chunk of a query over subqueries; ``engine.evaluate`` runs each part."""

    def __init__(self, engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
        self.e, self.cq, self.chunk, self.mode = engine, cq, chunk, mode

    def execute(self):
        cq, chunk = self.cq, self.chunk
        instants = sorted(set(int(t) for t in chunk.instants))
        empty = self.e.result_schema(cq).empty_table()
        if not instants:
            return empty, None, None
        outer, failure = self.outer_chunk()
        if failure is not None:  # a subquery fails at τ: so does the query
            instants = [t for t in instants if t < failure[0]]
        if not instants:
            return empty, None, failure
        outer = dataclasses.replace(outer, instants=instants)
        out, outer_failure = self.e.evaluate(cq.outer, outer, legacy_mode(cq.outer))
        return out, None, outer_failure if outer_failure is not None else failure

    def outer_chunk(self) -> tuple[QueryChunk, tuple[int, str] | None]:
        """The outer query's chunk (its stream items' tables and each subquery's rows, at all the
        chunk's instants) and the first failure of a subquery, ``(error_ts, reason)`` (never before
        the chunk's first instant), or None.  Evaluates every subquery (one Spark statement each)."""
        cq, chunk = self.cq, self.chunk
        instants = sorted(set(int(t) for t in chunk.instants))
        prev = chunk.prev_instant if cq.r2s in ("ISTREAM", "DSTREAM") else None
        evals = ([int(prev)] if prev is not None else []) + instants
        tables, failure, start = [], None, 0
        for k, sub in enumerate(cq.subqueries):
            if sub is None:  # a stream item of the outer query: its table as the chunker cut it
                tables.append(chunk.items[start])
                start += 1
                continue
            part = chunk.items[start:start + len(sub.items)]
            start += len(sub.items)
            rows, f = self.e.evaluate(sub, QueryChunk(chunk.query_id, chunk.chunk_id, part, evals), self.mode)
            if f is not None and (failure is None or f[0] < failure[0]):
                failure = f
            tables.append(self._table(rows, k))
        if failure is not None:  # never before the chunk's first instant
            failure = (max(int(failure[0]), instants[0]), failure[1])
        return QueryChunk(chunk.query_id, chunk.chunk_id, tables, instants, prev), failure

    def _table(self, rows: pa.Table, k: int) -> pa.Table:
        """The subquery's output rows as the table of the outer query's FROM item ``k``: the tuples of
        its (rewritten, optimized) window's level set, as the chunker gives a stream's."""
        item = self.cq.outer.items[k]
        arrays = {"_seq": pa.array(np.arange(rows.num_rows, dtype=np.int64)), "ts": rows.column("ts"),
                  "level": rows.column("level")}
        for j, (name, typ) in enumerate(item.schema.columns):
            arrays[name] = rows.column(j + 2).cast(ARROW_TYPES[typ])
        table = pa.table(arrays)
        levels = self.cq.outer.query.from_[k].window.levels
        if levels is not None and table.num_rows:
            table = table.filter(pc.is_in(table.column("level"), value_set=pa.array(sorted(levels), pa.string())))
            table = table.set_column(0, "_seq", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        return table
