"""A query over a subquery in FROM (``SELECT … FROM (SELECT …) x``): two Spark statements per chunk.

The subquery is evaluated as RSTREAM over the chunk's instants (and the previous instant when the
outer query reports differences): its output rows are its relation R(τ) at every instant.  Those
rows become the table of ``x`` (``ts`` = the instant, ``level`` = the row's level, the subquery's
columns) and the outer query is evaluated over it through ``[NOW]`` at the same instants, as any
query is.  A failure of the subquery at τ is the query's failure at τ: the outer query is evaluated
at the instants before it only (docs/semantics.md §3, *Subqueries in FROM*).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import ARROW_TYPES
from strata.chunking.model import LegacyMode, QueryChunk, legacy_mode
from strata.mlscql.analyze import CompiledQuery

__all__ = ["DerivedRun"]


class DerivedRun:
    """Evaluation of one chunk of a query over a subquery; ``engine.evaluate`` runs each part."""

    def __init__(self, engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
        self.e, self.cq, self.chunk, self.mode = engine, cq, chunk, mode

    def execute(self):
        cq, chunk = self.cq, self.chunk
        instants = sorted(set(int(t) for t in chunk.instants))
        empty = self.e.result_schema(cq).empty_table()
        if not instants:
            return empty, None, None
        prev = chunk.prev_instant if cq.r2s in ("ISTREAM", "DSTREAM") else None
        evals = ([int(prev)] if prev is not None else []) + instants
        rows, failure = self.e.evaluate(cq.inner, QueryChunk(chunk.query_id, chunk.chunk_id, chunk.items, evals),
                                        self.mode)
        if failure is not None:  # the subquery fails at τ: so does the query (never before its first instant)
            failure = (max(int(failure[0]), instants[0]), failure[1])
            instants = [t for t in instants if t < failure[0]]
        if not instants:
            return empty, None, failure
        item = cq.outer.items[0]
        arrays = {"_seq": pa.array(np.arange(rows.num_rows, dtype=np.int64)), "ts": rows.column("ts"),
                  "level": rows.column("level")}
        for k, (name, typ) in enumerate(item.schema.columns):
            arrays[name] = rows.column(k + 2).cast(ARROW_TYPES[typ])
        table = pa.table(arrays)
        # what the chunker does for a stream: x's tuples in the (rewritten, optimized) window's level set
        levels = cq.outer.query.from_[0].window.levels
        if levels is not None and table.num_rows:
            table = table.filter(pc.is_in(table.column("level"), value_set=pa.array(sorted(levels), pa.string())))
            table = table.set_column(0, "_seq", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        outer = QueryChunk(chunk.query_id, chunk.chunk_id, [table], instants, prev)
        out, outer_failure = self.e.evaluate(cq.outer, outer, legacy_mode(cq.outer))
        return out, None, outer_failure if outer_failure is not None else failure
