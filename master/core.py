"""The master of one level as a plain object: queries, input, dispatch, results.

The gRPC servicer and the dispatch thread in :mod:`strata.master.server` only
translate messages and move bytes; every decision is made here:

* queries are registered per session through the front end at the master's level;
* input goes through the shepherd into the chunker (:class:`QueryPipeline`);
* :meth:`assignments` hands ready chunks to non-busy workers (Algorithm 5),
  :meth:`on_result` merges results in instant order, :meth:`on_failure` and
  :meth:`expire` put chunks of failed or vanished workers back in the queue;
* released results are kept per query so a subscriber can resume after the
  last instant it acknowledged.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.model import Chunk, ChunkResult
from strata.config import Config

from .dispatch import Dispatcher
from .pipeline import QueryPipeline, Released

__all__ = ["MasterCore", "QueryInfo"]


@dataclass
class QueryInfo:
    query_id: str
    text: str
    owner: str  # user
    rewritten: str
    r2s: str
    columns: list[str]
    results: list[Released] = field(default_factory=list)
    ended: bool = False


class MasterCore:
    def __init__(self, config: Config, level: str, chunk_instants: int = 1, cpu_threshold: float = 90.0,
                 max_in_flight: int = 2, worker_timeout: float = 3.0, chunk_deadline: float = 60.0,
                 clock=time.monotonic):
        self.config = config
        self.pipeline = QueryPipeline(config, level, chunk_instants)
        self.level = self.pipeline.level
        self.dispatcher = Dispatcher(cpu_threshold, max_in_flight, worker_timeout)
        self.chunk_deadline = chunk_deadline
        self.starvation_seconds = 1.0
        self._blocked_since: float | None = None
        self.queries: dict[str, QueryInfo] = {}
        self._ready: deque[int] = deque()  # chunk ids waiting for a worker
        self._sent_at: dict[int, float] = {}
        self._finished = False
        self._clock = clock
        self.cond = threading.Condition()
        self.redispatched = 0
        self.refused: dict[str, int] = {}  # calls refused at the transport (reason → n)
        self.last_input_ts: int | None = None
        self.last_output_ts: int | None = None

    # -- queries ------------------------------------------------------------------------
    def register(self, user: str, texts: list[str]) -> list[QueryInfo]:
        """Compile all texts first (all or nothing), then start them."""
        from strata.mlscql import compile_query

        compiled = [compile_query(t, self.config, self.level) for t in texts]  # raises QueryError
        out = []
        with self.cond:
            for text, cq in zip(texts, compiled):
                qid, cq = self.pipeline.add_query(text, compiled=cq)
                info = QueryInfo(qid, text, user, cq.rewritten, cq.r2s, [c.name for c in cq.outputs])
                self.queries[qid] = info
                out.append(info)
        return out

    # -- input ----------------------------------------------------------------------------
    def ingest(self, stream: str, table: pa.Table, source_level: str | None) -> tuple[int, int]:
        with self.cond:
            if self._finished:
                raise ValueError("input is finished; no more tuples are accepted")
            accepted, dropped = self.pipeline.ingest(stream, table, source_level)
            if accepted:
                mx = pc.max(table.column("ts")).as_py()
                self.last_input_ts = mx if self.last_input_ts is None else max(self.last_input_ts, mx)
            return accepted, dropped

    def advance(self, upto_ts: int | None = None, finish: bool = False) -> int:
        with self.cond:
            chunks = self.pipeline.finish() if finish else self.pipeline.advance(upto_ts)
            if finish:
                self._finished = True
            self._ready.extend(c.chunk_id for c in chunks)
            self._maybe_end()
            self.cond.notify_all()
            return len(chunks)

    # -- group table (fed by multicast heartbeats) ----------------------------------------------
    def heartbeat(self, sid: str, cpu: float, state: str = "ready", pid: int = 0) -> None:
        with self.cond:
            self.dispatcher.heartbeat(sid, cpu, self._clock(), state, pid)
            self.cond.notify_all()

    def expire(self) -> list[int]:
        """Drop silent workers and chunks past their deadline; requeue their chunks."""
        now = self._clock()
        with self.cond:
            lost = self.dispatcher.expire(now)
            late = [cid for cid, t in self._sent_at.items() if now - t > self.chunk_deadline and cid not in lost]
            for cid in late:
                sid = self.dispatcher.owner(cid)
                if sid is not None:
                    self.dispatcher.table[sid].in_flight.discard(cid)
            self._requeue(lost + late)
            return lost + late

    def _requeue(self, chunk_ids: list[int]) -> None:
        for cid in sorted(chunk_ids, reverse=True):
            if cid in self.pipeline.chunks and cid not in self._ready:
                self._sent_at.pop(cid, None)
                self._ready.appendleft(cid)
                self.redispatched += 1
        if chunk_ids:
            self.cond.notify_all()

    # -- dispatch (Algorithm 5) ----------------------------------------------------------------
    def assignments(self) -> list[tuple[Chunk, str]]:
        """Chunks to send now, each with the worker chosen for it."""
        out = []
        with self.cond:
            now = self._clock()
            while self._ready:
                starving = self._blocked_since is not None and now - self._blocked_since > self.starvation_seconds
                sid = self.dispatcher.pick(starving=starving)
                if sid is None:
                    if self._blocked_since is None:
                        self._blocked_since = now
                    break
                self._blocked_since = None
                cid = self._ready.popleft()
                if cid not in self.pipeline.chunks:
                    continue
                self.dispatcher.assign(cid, sid)
                self._sent_at[cid] = self._clock()
                out.append((self.pipeline.chunks[cid], sid))
        return out

    def on_result(self, chunk_id: int, sid: str, results: list[ChunkResult]) -> list[Released]:
        with self.cond:
            if self.dispatcher.owner(chunk_id) == sid:
                self.dispatcher.complete(chunk_id)
            elif sid in self.dispatcher.table:
                self.dispatcher.table[sid].done += 1
            self._sent_at.pop(chunk_id, None)
            released = self.pipeline.complete(chunk_id, results)
            for r in released:
                info = self.queries.get(r.query_id)
                if info is not None and r.rows.num_rows:
                    info.results.append(r)
                self.last_output_ts = r.last_ts if self.last_output_ts is None else max(self.last_output_ts, r.last_ts)
            self._maybe_end()
            self.cond.notify_all()
            return released

    def on_failure(self, chunk_id: int, sid: str, drop_worker: bool = False) -> None:
        with self.cond:
            if drop_worker:
                self._requeue(self.dispatcher.remove(sid))
            elif self.dispatcher.owner(chunk_id) == sid:
                self.dispatcher.table[sid].in_flight.discard(chunk_id)
                self._requeue([chunk_id])

    def _maybe_end(self) -> None:
        if self._finished and not self.pipeline.chunks and not self._ready:
            for info in self.queries.values():
                info.ended = True

    # -- results ----------------------------------------------------------------------------------
    def wait_results(self, qids: list[str], cursor: dict[str, int], timeout: float) -> tuple[list[Released], bool]:
        """Results after ``cursor[qid]`` (an index into each query's results); blocks up to ``timeout``."""
        deadline = self._clock() + timeout
        with self.cond:
            while True:
                out = []
                for q in qids:
                    info = self.queries[q]
                    out.extend(info.results[cursor.get(q, 0):])
                    cursor[q] = len(info.results)
                done = all(self.queries[q].ended for q in qids)
                if out or done:
                    return out, done
                left = deadline - self._clock()
                if left <= 0:
                    return [], False
                self.cond.wait(left)

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.cond:
            workers = [
                {"sid": e.sid, "cpu": e.cpu, "pid": e.pid, "state": e.state, "in_flight": len(e.in_flight), "done": e.done}
                for e in self.dispatcher.table.values()
            ]
            lag = 0.0
            if self.last_input_ts is not None:
                lag = float(self.last_input_ts - (self.last_output_ts if self.last_output_ts is not None else -1))
            return {
                "level": self.level,
                "workers": workers,
                "backlog_chunks": self.pipeline.backlog,
                "ready_chunks": len(self._ready),
                "lag_instants": max(0.0, lag),
                "rejected": dict(self.pipeline.chunker.rejected) | {f"transport:{k}": v for k, v in self.refused.items()},
                "dropped_by_shepherd": dict(self.pipeline.shepherd.dropped),
                "counters": dict(self.pipeline.counters) | {"redispatched": self.redispatched,
                                                              "duplicates": self.pipeline.merger.duplicates},
            }
