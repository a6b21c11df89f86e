"""The master's data path for one level, as plain logic (no networking).

    input ─► stream shepherd ─► chunker (legacy windows) ─► chunks ─► (workers)
    results ─► ordered merger ─► per-query output, in instant order, exactly once

``QueryPipeline`` is driven by the gRPC master and by the in-process runner
(:mod:`strata.master.local`) alike.

Input is admitted in two steps so that the master can run the first outside
its lock: :meth:`QueryPipeline.screen` (stream name, then the shepherd: pure,
no shared state) and :meth:`QueryPipeline.push` (the chunker, on kept rows
only).  Every check after the shepherd sees only the rows the master may hold.

A query whose evaluation fails in a chunk (a result with ``error``) is stopped
when that chunk is *released* (in chunk order): its rows before ``error_ts`` are
released, then the query is removed, and its results in later chunks are
dropped.  Other queries of the chunk are released as usual.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from strata import punctuations
from strata.chunking.chunker import Chunker, ChunkingError
from strata.chunking.model import Chunk, ChunkResult
from strata.config import Config
from strata.errors import one_line  # the master's modules take it from here
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
    #: the query failed in this chunk: a one-line reason; ``rows`` hold its output before ``error_ts``
    error: str | None = None
    error_ts: int | None = None


def _ts_at_most(rows: pa.Table, upto: int) -> pa.Table:
    """``rows`` with ``ts <= upto`` (all of them when there is no ts column)."""
    if rows is None:
        return pa.table({})
    if not rows.num_rows or "ts" not in rows.column_names:
        return rows
    return rows.filter(pc.less_equal(rows.column("ts"), upto))


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
        #: stopped queries (cancelled, revoked, failed) → the last instant whose results are still released
        self.stopped: dict[str, int] = {}
        #: per query, the unreleased chunks that carry it
        self.carrying: dict[str, set[int]] = {}
        #: cut order: chunk id -> the id of the chunk cut right after it (unreleased chunks only);
        #: only chunks adjacent in this order may travel merged (chunking.chunker.merge_chunks)
        self.after: dict[int, int] = {}
        self._last_cut: int | None = None
        self._ids = itertools.count(1)
        #: the merged operator DAG of this level's queries (replicated mode: one level per master);
        #: workers evaluate each shared plan once per chunk when ``[sharing] enabled`` (default)
        self.sharing_enabled = sharing_enabled(config)
        self.sharing = SharedPlan("replicated", config.instant_seconds, config.lattice)

    # -- queries ----------------------------------------------------------------------
    def add_query(self, text: str, query_id: str | None = None, compiled: CompiledQuery | None = None,
                  principal: tuple | None = None) -> tuple[str, CompiledQuery]:
        """Compile at the master's level (raises QueryError) and start feeding it.

        ``compiled``: ``text`` already compiled at this level (not compiled again).  ``principal``:
        (user, roles) of the session registering it (what security punctuations grant or deny).
        """
        cq = compiled if compiled is not None else compile_query(text, self.config, self.level)
        qid = query_id or f"q{next(self._ids)}"
        self.chunker.add_query(qid, cq, principal)
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

    def add_stream(self, config: Config) -> None:
        """Continue with ``config``, which declares one more stream (``strata streams add``)."""
        self.config = config
        self.chunker.add_stream(config)

    def remove_query(self, query_id: str, after: int | None = None) -> None:
        """Stop a query: chunks cut from now on no longer carry it (its branch is not computed).

        ``after``: results of chunks already cut are still released up to this instant
        (``None``: nothing more is released)."""
        self.chunker.remove_query(query_id)
        live = self.queries.pop(query_id, None) is not None
        self.sharing.remove(query_id)  # shared nodes stay while another query uses them
        if live or query_id not in self.stopped:
            self.stopped[query_id] = -1 if after is None else int(after)

    def pending_for(self, query_id: str, upto: int | None = None) -> bool:
        """Whether an unreleased chunk carrying ``query_id`` starts at or before ``upto`` (any, if None)."""
        return any(upto is None or self.chunks[c].first_ts <= upto
                   for c in self.carrying.get(query_id, ()) if c in self.chunks)

    def sharing_report(self) -> dict:
        """The sharing decisions among this level's queries (see ``strata explain``)."""
        return {"enabled": self.sharing_enabled, **self.sharing.to_json()}

    # -- privacy switches (paper 004; docs/semantics.md §12) -------------------------------------
    def switch(self, query_id: str, user: str, stream: str, on: bool, at: int | None = None):
        """``user``'s access to ``stream`` for ``query_id`` on or off from instant ``at`` (default: the
        first instant not closed): the initial switch (the chunker keeps the stream's tuples of off
        instants out of the query's input) and the terminal switch (:meth:`terminal`).  Returns (the
        switch, whether it changed, the instant)."""
        return self.chunker.set_switch(query_id, user, stream, on, at)

    def terminal(self, query_id: str, rows: pa.Table) -> pa.Table:
        """The terminal switch: ``rows`` of ``query_id`` without those at instants when its owner's
        access to one of its streams is off."""
        sh = self.chunker.shields
        if rows is None or not rows.num_rows or "ts" not in rows.column_names or not sh.query_switched(query_id):
            return rows
        off = sh.terminal_off(query_id, rows.column("ts").to_numpy())
        return rows.filter(pa.array(~off)) if off.any() else rows

    # -- input ---------------------------------------------------------------------------
    def screen(self, stream: str, table: pa.Table, source_level: str | None = None) -> tuple[str, pa.Table, int]:
        """(stream name, rows the master may hold, rows dropped): the stream name is checked
        first, then the shepherd.  Pure: no shared state is read or written, so it may run
        outside the master's lock.  Raises ChunkingError (unknown stream) or ShepherdError.

        ``source_level``: the level of a source session; its tuples are stamped with it and may
        carry no other.  ``None``: labelled input (replay of a file whose rows carry levels).
        """
        schema = punctuations.input_schema(self.config, stream)
        if schema is None:
            raise ChunkingError(f"unknown stream {stream!r} (streams: {', '.join(self.config.streams)})",
                                "unknown_stream")
        if source_level is not None:
            table = self.shepherd.check_source(source_level, table)
        kept, dropped = self.shepherd.filter(table)
        return schema.name, kept, dropped

    def push(self, stream: str, kept: pa.Table, before_commit=None) -> int:
        """Hand rows the shepherd kept to the chunker (column, type and ts checks; all or nothing).

        An empty batch is still checked for its columns (a property of the batch, not of its rows).
        ``before_commit(checked)``: see :meth:`Chunker.push` (the master logs the batch there)."""
        accepted = self.chunker.push(stream, kept, before_commit=before_commit)
        self.counters["accepted"] += accepted
        return accepted

    def ingest(self, stream: str, table: pa.Table, source_level: str | None = None,
               kept_sink: list | None = None) -> tuple[int, int]:
        """:meth:`screen` then :meth:`push`; returns (accepted, dropped by the shepherd).

        ``kept_sink``: receives the table the shepherd let through (what the
        master may persist: never a tuple above its level).
        """
        name, kept, dropped = self.screen(stream, table, source_level)
        if dropped:
            self.shepherd.dropped[name] += dropped
        accepted = self.push(name, kept)
        if kept_sink is not None and accepted:
            kept_sink.append(kept)
        return accepted, dropped

    def advance(self, upto_ts: int) -> list[Chunk]:
        return self._register(self.chunker.close(upto_ts))

    def finish(self) -> list[Chunk]:
        return self._register(self.chunker.finish())

    def _register(self, chunks: list[Chunk]) -> list[Chunk]:
        for c in chunks:
            self.merger.expect(c.chunk_id)
            self.chunks[c.chunk_id] = c
            if self._last_cut is not None and self._last_cut in self.chunks:
                self.after[self._last_cut] = c.chunk_id
            self._last_cut = c.chunk_id
            for qc in c.queries:
                self.carrying.setdefault(qc.query_id, set()).add(c.chunk_id)
        self.counters["chunks"] += len(chunks)
        return chunks

    # -- checkpoints -------------------------------------------------------------------------
    def export_state(self) -> tuple[dict, dict[str, pa.Table], list[Chunk]]:
        """The chunker's state, what this pipeline knows beyond its queries, and the chunks cut and
        not released (oldest first): a checkpoint (:mod:`strata.master.checkpoint`)."""
        chunker, tables = self.chunker.export_state()
        meta = {"chunker": chunker, "stopped": dict(self.stopped), "last_cut": self._last_cut,
                "released_upto": self.merger.released_upto, "counters": dict(self.counters),
                "duplicates": self.merger.duplicates}
        return meta, tables, [self.chunks[c] for c in sorted(self.chunks)]

    def import_state(self, meta: dict, tables: dict[str, pa.Table], chunks: list[Chunk]) -> None:
        """Continue from :meth:`export_state`; the live queries are added already, in order."""
        self.chunker.import_state(meta["chunker"], tables)
        self.stopped = {str(q): int(v) for q, v in meta["stopped"].items()}
        self.merger.resume_after(int(meta["released_upto"]))
        self._register(chunks)  # unreleased: computed again; cut order, carriers and adjacency as before
        self._last_cut = meta["last_cut"]
        self.counters = Counter(meta["counters"])
        self.merger.duplicates = int(meta["duplicates"])

    # -- results ---------------------------------------------------------------------------
    def complete(self, chunk_id: int, results: list[ChunkResult]) -> list[Released]:
        """Record a chunk's results (any order, duplicates ignored); return what is now in order.

        At release, a result with ``error`` releases its rows before ``error_ts`` (with the error)
        and stops its query there: later chunks' results for it are dropped.  A stopped query's
        results are released up to the instant it was stopped after."""
        if chunk_id not in self.chunks:
            self.merger.duplicates += 1
            return []
        for r in results:
            if not r.error:
                self.chunker.confirm(r)
        out = []
        for cid, res in self.merger.add(chunk_id, results):
            chunk = self.chunks.pop(cid)
            self.after.pop(cid, None)
            firsts = {qc.query_id: (qc.instants[0] if qc.instants else chunk.first_ts) for qc in chunk.queries}
            for q in firsts:
                self.carrying.get(q, set()).discard(cid)
            for r in res:
                q = r.query_id
                if q in self.queries:
                    if r.error:
                        ets = int(r.error_ts) if r.error_ts is not None else firsts.get(q, chunk.first_ts)
                        out.append(Released(q, cid, chunk.first_ts, chunk.last_ts,
                                            self.terminal(q, _ts_at_most(r.rows, ets - 1)),
                                            one_line(r.error) or "evaluation failed", ets))
                        self.remove_query(q, after=ets - 1)
                        self.counters["failed_queries"] += 1
                    else:
                        out.append(Released(q, cid, chunk.first_ts, chunk.last_ts, self.terminal(q, r.rows)))
                elif q in self.stopped and chunk.first_ts <= self.stopped[q]:
                    out.append(Released(q, cid, chunk.first_ts, chunk.last_ts,
                                        self.terminal(q, _ts_at_most(r.rows, self.stopped[q]))))
        return out

    def recorded(self, chunk_id: int) -> bool:
        """Whether ``chunk_id``'s results are in (released, or waiting for an earlier chunk)."""
        return chunk_id not in self.chunks or self.merger.has_result(chunk_id)

    @property
    def backlog(self) -> int:
        return len(self.chunks)
