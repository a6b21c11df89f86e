"""The master's data path for one level, as plain logic (no networking).

    input ─► stream shepherd ─► chunker (legacy windows) ─► chunks ─► (workers)
    results ─► ordered merger ─► per-query output, in instant order, exactly once

``QueryPipeline`` is driven by the gRPC master and by the in-process runner
(:mod:`strata.master.local`) alike.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from strata.chunking.chunker import Chunker
from strata.chunking.model import Chunk, ChunkResult
from strata.config import Config
from strata.mlscql import CompiledQuery, compile_query
from strata.sharing import SharedPlan, sharing_enabled

from .merge import OrderedMerger
from .shepherd import Shepherd

__all__ = ["QueryPipeline", "Released"]

_STRENGTH = {"complete": 3, "loose_partial": 2, "strict_partial": 1, "none": 0}


@dataclass(frozen=True)
class Released:
    """Output of one query for one chunk, ready for its subscribers."""

    query_id: str
    chunk_id: int
    first_ts: int
    last_ts: int
    rows: pa.Table


class QueryPipeline:
    def __init__(self, config: Config, level: str, chunk_instants: int = 1):
        self.config = config
        self.level = config.lattice.parse(level)
        self.shepherd = Shepherd(config.lattice, self.level)
        self.chunker = Chunker(config, {}, chunk_instants=chunk_instants)
        self.merger: OrderedMerger[list[ChunkResult]] = OrderedMerger()
        self.queries: dict[str, CompiledQuery] = {}
        self.chunks: dict[int, Chunk] = {}  # dispatched, not yet merged: kept for re-dispatch
        self.counters: Counter = Counter()
        self._ids = itertools.count(1)
        #: the merged operator DAG of this level's queries (replicated mode: one level per master);
        #: workers evaluate each shared plan once per chunk when ``[sharing] enabled`` (default)
        self.sharing_enabled = sharing_enabled(config)
        self.sharing = SharedPlan("replicated", config.instant_seconds, config.lattice)

    # -- queries ----------------------------------------------------------------------
    def add_query(self, text: str, query_id: str | None = None,
                  compiled: CompiledQuery | None = None) -> tuple[str, CompiledQuery]:
        """Compile at the master's level (raises QueryError) and start feeding it.

        ``compiled``: ``text`` already compiled at this level (not compiled again).
        """
        cq = compiled if compiled is not None else compile_query(text, self.config, self.level)
        qid = query_id or f"q{next(self._ids)}"
        self.chunker.add_query(qid, cq)
        self.queries[qid] = cq
        try:
            decisions = self.sharing.add(qid, cq)
        except Exception:  # noqa: BLE001 - the analysis never blocks a query (workers re-plan anyway)
            self.counters["sharing_analysis_errors"] += 1
            decisions = []
        best = max(decisions, key=lambda d: _STRENGTH[d.kind], default=None)
        if best is not None and best.kind != "none":
            self.counters[f"sharing_{best.kind}"] += 1
        return qid, cq

    def remove_query(self, query_id: str) -> None:
        self.chunker.remove_query(query_id)
        self.queries.pop(query_id, None)
        self.sharing.remove(query_id)  # shared nodes stay while another query uses them

    def sharing_report(self) -> dict:
        """The sharing decisions among this level's queries (see ``strata explain``)."""
        return {"enabled": self.sharing_enabled, **self.sharing.to_json()}

    # -- input ---------------------------------------------------------------------------
    def ingest(self, stream: str, table: pa.Table, source_level: str | None = None,
               kept_sink: list | None = None) -> tuple[int, int]:
        """Admit a batch; returns (accepted, dropped by the shepherd).

        ``source_level``: the level of a source session; its tuples are stamped
        with it and may carry no other.  ``None``: labelled input (replay of a
        file whose rows carry levels), filtered by the shepherd.
        ``kept_sink``: receives the table the shepherd let through (what the
        master may persist: never a tuple above its level).
        """
        if source_level is not None:
            table = self.shepherd.check_source(source_level, table)
        before = self.shepherd.dropped[stream]
        kept = self.shepherd.admit(stream, table)
        dropped = self.shepherd.dropped[stream] - before
        accepted = self.chunker.push(stream, kept) if kept.num_rows else 0
        if kept_sink is not None and accepted:
            kept_sink.append(kept)
        self.counters["accepted"] += accepted
        self.counters["dropped_by_shepherd"] += dropped
        return accepted, dropped

    def advance(self, upto_ts: int) -> list[Chunk]:
        return self._register(self.chunker.close(upto_ts))

    def finish(self) -> list[Chunk]:
        return self._register(self.chunker.finish())

    def _register(self, chunks: list[Chunk]) -> list[Chunk]:
        for c in chunks:
            self.merger.expect(c.chunk_id)
            self.chunks[c.chunk_id] = c
        self.counters["chunks"] += len(chunks)
        return chunks

    # -- results ---------------------------------------------------------------------------
    def complete(self, chunk_id: int, results: list[ChunkResult]) -> list[Released]:
        """Record a chunk's results (any order, duplicates ignored); return what is now in order."""
        if chunk_id not in self.chunks:
            self.merger.duplicates += 1
            return []
        for r in results:
            self.chunker.confirm(r)
        out = []
        for cid, res in self.merger.add(chunk_id, results):
            chunk = self.chunks.pop(cid)
            for r in res:
                if r.query_id in self.queries:
                    out.append(Released(r.query_id, cid, chunk.first_ts, chunk.last_ts, r.rows))
        return out

    @property
    def backlog(self) -> int:
        return len(self.chunks)
