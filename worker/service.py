"""What a worker does with a chunk, as plain logic (no gRPC).

A worker has one fixed level.  It executes chunks only for masters of its own
level, compiles the queries it is sent itself (at that level, so the front end's
authorization runs again on the worker), refuses any chunk holding a tuple its
level does not dominate, and counts what it saw per level.

A trusted worker (``[cluster] mode = "trusted"``, docs/trusted.md) serves several
levels: it does the same for each chunk at the chunk's own level (the level of
the master pipeline that sent it), as a worker of that level alone would.

A whole call is refused (:class:`WorkerRefused`, or ``ValueError`` for bytes
that do not decode) only for what concerns the call: the master's or a
query's level is not the worker's, a tuple is above the worker's level, or the
chunk carries a query without its text.  Anything that concerns *one* query (it
does not compile on the worker, or its evaluation fails) gives that query a
``ChunkResult`` with ``error`` (one line) and ``error_ts`` (the first instant of
its chunk that fails; rows before it are kept), and the chunk's other queries
are evaluated as usual (see ``Engine.run`` and ``SharedExecutor``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.codec import decode_chunk, encode_result
from strata.chunking.model import ChunkResult
from strata.config import Config, StreamSchema, with_streams
from strata.errors import one_line  # worker/server.py takes it from here
from strata.mlscql import CompiledQuery, QueryError, compile_query
from strata.visibility import Visibility

from .pools import pool_name
from .shared import SharedExecutor

__all__ = ["WorkerCore", "WorkerRefused", "WorkerFenced", "QuerySpecData", "one_line"]


class WorkerRefused(PermissionError):
    """A request this worker must not execute (wrong level, unauthorized data)."""


class WorkerFenced(WorkerRefused):
    """An Execute from a master of an epoch below the highest this worker has seen: a master that a
    standby replaced (docs/operations.md, *Standby masters*) must not drive the level's workers."""


@dataclass(frozen=True)
class QuerySpecData:
    query_id: str
    text: str
    level: str


class WorkerCore:
    def __init__(self, config: Config, level: str, engine, sharing: bool | None = None, levels=(),
                 across_levels: bool | None = None):
        """``levels``: a trusted worker's levels (docs/trusted.md; ``level`` is their top, dominating
        them all): it executes chunks of masters of any of them, each checked against its own level
        as a worker of that level alone would; default ``level`` alone."""
        self.config = config
        self.level = config.lattice.parse(level)
        self.levels = tuple(dict.fromkeys(config.lattice.parse(lv) for lv in levels)) or (self.level,)
        below = [lv for lv in self.levels if not config.lattice.leq(lv, self.level)]
        if below:
            raise ValueError(f"a trusted worker of level {self.level} cannot serve {', '.join(below)}")
        self.engine = engine
        #: evaluates each shared plan of a chunk once (``[sharing] enabled``, default on)
        self.shared = SharedExecutor(engine, config, enabled=sharing, levels=self.levels, across_levels=across_levels)
        #: what this worker may see: a chunk's labels are canonical (its master's shepherd made them so)
        self.visibility = Visibility(self.config.lattice, self.level, canonical=True)
        #: per served level (a trusted worker): a chunk of level L is checked as a worker of L would
        self.visible = {lv: Visibility(self.config.lattice, lv, canonical=True) for lv in self.levels}
        self._compiled: dict[tuple[str, str], CompiledQuery] = {}
        self._lock = threading.Lock()
        self.counters: Counter = Counter()
        self.seen_levels: Counter = Counter()  # tuples received, per level
        self.refused: Counter = Counter()
        self.busy_seconds = 0.0
        self.epoch = 0  # the highest master epoch seen in a signed Execute (0: none; masters without standbys)
        #: a trusted worker's scheduler (strata/turns.py, ``[cluster] scheduler``): when each level's calls
        #: run; None: no gate (a worker of one level, or ``shared``: the levels' calls run concurrently)
        self.turns = None

    def _config_for(self, streams: tuple):
        """This worker's configuration plus the streams a chunk says were added at run time (the
        master declares them: ``strata streams add``); a stream of the configuration keeps its schema."""
        return with_streams(self.config, (StreamSchema(n, tuple(cols)) for n, cols in streams))

    def _compile(self, spec: QuerySpecData, streams: tuple = ()) -> CompiledQuery:
        key = (spec.text, spec.level, streams)
        with self._lock:
            cq = self._compiled.get(key)
        if cq is None:
            cq = compile_query(spec.text, self._config_for(streams), spec.level)
            with self._lock:
                if len(self._compiled) > 1024:
                    self._compiled.clear()
                self._compiled[key] = cq
        return cq

    def fence(self, epoch: int) -> None:
        """Fencing: refuse (:class:`WorkerFenced`, counted ``stale_epoch``) a signed Execute whose master
        epoch is below the highest seen so far, else remember it.  Epoch 0 (a master without standbys)
        is neither checked nor remembered."""
        epoch = int(epoch or 0)
        if not epoch:
            return
        with self._lock:
            if epoch < self.epoch:
                self.refused["stale_epoch"] += 1
                raise WorkerFenced(f"fenced: epoch {epoch} is older than epoch {self.epoch} this worker has seen; "
                                   f"a newer master of level {self.level} is active")
            self.epoch = epoch

    def execute(self, level: str, specs: list[QuerySpecData], chunk_bytes: bytes) -> list[bytes]:
        if level not in self.levels:
            self.refused["wrong_level"] += 1
            serves = f"level {self.level}" if len(self.levels) == 1 else f"levels {', '.join(self.levels)}"
            raise WorkerRefused(f"this worker serves {serves}, not {level}")
        if self.turns is None:
            return self._execute(level, specs, chunk_bytes)
        with self.turns.turn(level):  # a trusted worker's scheduler: the level's call runs in its turn
            return self._execute(level, specs, chunk_bytes)

    def _execute(self, level: str, specs: list[QuerySpecData], chunk_bytes: bytes) -> list[bytes]:
        by_id = {}
        rejected: dict[str, str] = {}  # query id → why it does not compile here (its own failure)
        chunk = decode_chunk(chunk_bytes)
        for s in specs:
            if s.level != level:  # a chunk's queries run at its master's level (each level its own chunks)
                self.refused["wrong_level"] += 1
                raise WorkerRefused(f"query {s.query_id} runs at {s.level}; this worker serves {level}")
            try:
                by_id[s.query_id] = self._compile(s, chunk.streams)
            except QueryError as e:
                rejected[s.query_id] = one_line(f"query rejected on the worker: {e}")
        seen: Counter = Counter()
        for qc in chunk.queries:
            if qc.query_id not in by_id and qc.query_id not in rejected:
                self.refused["unknown_query"] += 1
                raise WorkerRefused(f"chunk carries query {qc.query_id} without its text")
            for t in qc.items:
                if t.num_rows == 0:
                    continue
                counts = pc.value_counts(t.column("level"))
                for entry in counts.to_pylist():
                    seen[entry["values"]] += entry["counts"]
        labels = self.visible[level].labels(seen)
        if labels.hidden or labels.unknown or labels.nulls:
            self.refused["level_above_worker"] += 1
            raise WorkerRefused(f"chunk holds tuples this worker's level {level} does not dominate")
        if len(self.levels) > 1:
            self._pool(level)
        t0 = time.perf_counter()
        runnable = [qc for qc in chunk.queries if qc.query_id in by_id]
        done = {r.query_id: r for r in self.shared.run(by_id, runnable)} if runnable else {}
        for qc in chunk.queries:
            if qc.query_id in rejected:
                done[qc.query_id] = _failed(qc, rejected[qc.query_id])
        failed = sum(1 for r in done.values() if r.error is not None)
        out = [encode_result(done[qc.query_id]) for qc in chunk.queries]
        with self._lock:
            self.counters["failed_query_chunks"] += failed
            self.busy_seconds += time.perf_counter() - t0
            self.seen_levels.update(seen)
            self.counters["chunks_done"] += 1
            self.counters["tuples"] += sum(seen.values())
        return out

    def _pool(self, level: str) -> None:
        """A trusted worker runs a level's Spark jobs in that level's scheduler pool (its session is
        started with ``spark.scheduler.mode`` FAIR and the pools of worker/pools.py): jobs of different
        levels share the task slots instead of queueing in the order they were submitted, and the least
        level's jobs take the slots first (docs/trusted.md)."""
        sc = getattr(getattr(self.engine, "spark", None), "sparkContext", None)
        if sc is not None:
            sc.setLocalProperty("spark.scheduler.pool", pool_name(level))

    def stats(self) -> dict:
        with self._lock:
            return {
                "chunks_done": self.counters["chunks_done"],
                "failed_query_chunks": self.counters["failed_query_chunks"],
                "tuples": self.counters["tuples"],
                "seen_levels": dict(self.seen_levels),
                "refused": dict(self.refused),
                "busy_seconds": round(self.busy_seconds, 3),
                "sharing": {"enabled": self.shared.enabled, **dict(self.shared.counters)},
            }


def _failed(qc, reason: str) -> ChunkResult:
    """The result of a query that fails at the first instant of its chunk (no rows)."""
    instants = sorted(int(t) for t in qc.instants)
    rows = pa.schema([pa.field("ts", pa.int64()), pa.field("level", pa.string())]).empty_table()
    return ChunkResult(qc.query_id, qc.chunk_id, rows, stats={"error": reason},
                       error=reason, error_ts=instants[0] if instants else None)
