"""Run a query set in one process: the pipeline plus N engine instances.

Used by tests (random chunk assignment, out-of-order completion) and as the
embedded fallback.  All engines share this process's SparkSession.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

import pyarrow as pa

from strata.chunking.model import Chunk
from strata.chunking.prune import prune_chunk
from strata.config import Config

from .pipeline import QueryPipeline, Released

__all__ = ["run_local", "collect"]


def cut_chunks(config: Config, level: str, queries: list[str], inputs: dict[str, pa.Table],
               chunk_instants: int = 1) -> tuple[QueryPipeline, list[str], list[Chunk]]:
    """A pipeline with ``queries`` registered, all of ``inputs`` ingested and cut into chunks."""
    p = QueryPipeline(config, level, chunk_instants=chunk_instants)
    ids = [p.add_query(q)[0] for q in queries]
    for stream, table in inputs.items():
        if table is not None and table.num_rows:
            p.ingest(stream, table)
    return p, ids, p.finish()


def run_local(
    config: Config,
    level: str,
    queries: list[str],
    inputs: dict[str, pa.Table],
    engines: list,
    chunk_instants: int = 1,
    assign: Callable[[Chunk, int], int] | None = None,
    shuffle: random.Random | None = None,
    batch: int = 0,
    prune: bool = False,
) -> dict[str, pa.Table]:
    """Evaluate ``queries`` at ``level`` over labelled ``inputs``; results per query id.

    ``assign(chunk, n)`` picks the engine of a chunk (default round robin).  With
    ``shuffle``, chunks are cut in groups of ``batch`` (all at once if 0) and
    each group runs in a random order, so results arrive out of order and
    running states lag behind, as with pipelined dispatch.  ``prune``: evaluate the
    chunks as the cluster ships them (:mod:`strata.chunking.prune`).
    """
    p, ids, chunks = cut_chunks(config, level, queries, inputs, chunk_instants)
    assign = assign or (lambda c, n: c.chunk_id % n)
    released: list[Released] = []
    groups = [chunks] if not batch else [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
    # note: chunks were all cut before any result was confirmed, so STATE queries
    # carry every retained row since the start: the slowest, most general case
    for group in groups:
        order = list(group)
        if shuffle is not None:
            shuffle.shuffle(order)
        for chunk in order:
            if prune:  # what the master's dispatch sends on the wire (ROWS windows pruned)
                chunk = prune_chunk(chunk, p.queries)
            eng = engines[assign(chunk, len(engines)) % len(engines)]
            results = [eng.run(p.queries[qc.query_id], qc) for qc in chunk.queries]
            released.extend(p.complete(chunk.chunk_id, results))
    return collect(released, {qid: p.queries[qid] for qid in ids})


def collect(released: Iterable[Released], queries: dict) -> dict[str, pa.Table]:
    parts: dict[str, list[pa.Table]] = {qid: [] for qid in queries}
    for r in released:
        parts[r.query_id].append(r.rows)
    out = {}
    for qid, tables in parts.items():
        tables = [t for t in tables if t.num_rows]
        out[qid] = pa.concat_tables(tables) if tables else None
    return out
