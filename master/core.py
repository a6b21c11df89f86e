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

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.model import Chunk, ChunkResult
from strata.config import Config

from .dispatch import Dispatcher
from .timings import ChunkTimings
from .shepherd import ShepherdError
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
    revoked_after: int | None = None  # revoked: no result with ts above this is ever released


class MasterCore:
    def __init__(self, config: Config, level: str, chunk_instants: int = 1, cpu_threshold: float = 90.0,
                 max_in_flight: int = 2, worker_timeout: float = 3.0, chunk_deadline: float = 60.0,
                 clock=time.monotonic, store=None):
        """``store``: a :class:`~strata.master.store.MasterStore`; every registration,
        accepted batch and advance is logged there before it is acknowledged, and
        :meth:`restore` replays a previous run's log."""
        self.config = config
        self.store = store
        self._qids = itertools.count(1)
        self.pipeline = QueryPipeline(config, level, chunk_instants)
        self.level = self.pipeline.level
        self.dispatcher = Dispatcher(cpu_threshold, max_in_flight, worker_timeout)
        self.chunk_deadline = chunk_deadline
        self.starvation_seconds = 1.0
        self._blocked_since: float | None = None
        self.queries: dict[str, QueryInfo] = {}
        self._ready: deque[int] = deque()  # chunk ids waiting for a worker
        self._sent_at: dict[int, float] = {}
        self.timings = ChunkTimings()  # where chunks' time goes (strata status)
        self._finished = False
        self._clock = clock
        self.cond = threading.Condition()
        self.redispatched = 0
        self.refused: dict[str, int] = {}  # calls refused at the transport (reason → n)
        self.revocations = 0
        self.input_rejected: dict[str, int] = {}  # rejections the chunker does not count (reason → n)
        self.group_rejected = None  # callable → Counter of refused heartbeats (set by the server)
        self.last_input_ts: int | None = None
        self.last_output_ts: int | None = None

    # -- queries ------------------------------------------------------------------------
    def register(self, user: str, texts: list[str]) -> list[QueryInfo]:
        """Compile all texts first (all or nothing), then start them."""
        from strata.mlscql import compile_query

        try:
            compiled = [compile_query(t, self.config, self.level) for t in texts]
        except Exception:  # QueryError: counted, then the caller gets the message
            with self.cond:
                self.input_rejected["query"] = self.input_rejected.get("query", 0) + 1
            raise
        out = []
        with self.cond:
            for text, cq in zip(texts, compiled):
                out.append(self._start_query(f"q{next(self._qids)}", text, user, cq))
                if self.store is not None:
                    self.store.append("register", {"query_id": out[-1].query_id, "owner": user, "text": text})
        return out

    def _start_query(self, qid: str, text: str, user: str, cq=None) -> QueryInfo:
        qid, cq = self.pipeline.add_query(text, query_id=qid, compiled=cq)
        info = QueryInfo(qid, text, user, cq.rewritten, cq.r2s, [c.name for c in cq.outputs])
        self.queries[qid] = info
        return info

    def _stop_query(self, qid: str, revoked_after: int | None = None) -> None:
        info = self.queries.get(qid)
        if info is None:
            return
        self.pipeline.remove_query(qid)  # later chunks no longer carry it: its branch is not computed
        info.revoked_after = revoked_after if revoked_after is not None else -1
        info.results = [r for r in info.results if r.last_ts <= info.revoked_after]
        info.ended = True

    # -- revocation (privacy switches) --------------------------------------------------------
    def revoke_user(self, user: str, reason: str = "revoked") -> list[str]:
        """Stop every query of ``user`` from the next instant on; returns their ids.

        Instants closed before the call still deliver; nothing after the last
        closed instant is computed or released for these queries.  Other
        queries, shared or not, are untouched.
        """
        with self.cond:
            upto = self.pipeline.chunker.closed_until - 1
            qids = [q for q, i in self.queries.items() if i.owner == user and i.revoked_after is None]
            for q in qids:
                self._stop_query(q, upto)
                if self.store is not None:
                    self.store.append("remove", {"query_id": q, "revoked_after": upto, "reason": reason})
            self.revocations += bool(qids)
            self.cond.notify_all()
            return qids

    def owners(self) -> set[str]:
        with self.cond:
            return {i.owner for i in self.queries.values() if i.revoked_after is None}

    # -- restart ----------------------------------------------------------------------------
    def restore(self) -> dict:
        """Replay the store's log into this (fresh) core; returns what was restored.

        The chunks it makes are computed again by the workers; results a
        client already has are skipped by its ``resume_after_ts``.
        """
        n = {"queries": 0, "batches": 0, "chunks": 0}
        if self.store is None:
            return n
        with self.cond:
            top = 0
            for ev in self.store.events():
                if ev.kind == "register":
                    self._start_query(ev.body["query_id"], ev.body["text"], ev.body["owner"])
                    top = max(top, int(ev.body["query_id"].lstrip("q") or 0))
                    n["queries"] += 1
                elif ev.kind == "remove":
                    self._stop_query(ev.body["query_id"], ev.body.get("revoked_after"))
                elif ev.kind == "ingest":
                    self._ingest(ev.body["stream"], from_ipc(ev.data), None, log=False)
                    n["batches"] += 1
                elif ev.kind == "advance":
                    n["chunks"] += self._advance(ev.body.get("upto"), ev.body.get("finish", False), log=False)
            self._qids = itertools.count(top + 1)
        return n

    # -- input ----------------------------------------------------------------------------
    def ingest(self, stream: str, table: pa.Table, source_level: str | None) -> tuple[int, int]:
        with self.cond:
            return self._ingest(stream, table, source_level, log=True)

    def _ingest(self, stream: str, table: pa.Table, source_level: str | None, log: bool) -> tuple[int, int]:
        if self._finished:
            raise ValueError("input is finished; no more tuples are accepted")
        kept: list[pa.Table] = []
        try:
            accepted, dropped = self.pipeline.ingest(stream, table, source_level,
                                                     kept_sink=kept if log and self.store is not None else None)
        except ShepherdError:  # the chunker counts its own rejections; count the shepherd's here
            self.count_rejected("bad_level", table.num_rows)
            raise
        if accepted:
            if kept:  # only what the shepherd let through reaches the disk
                self.store.append("ingest", {"stream": stream}, to_ipc(kept[0]))
            mx = pc.max(table.column("ts")).as_py()
            self.last_input_ts = mx if self.last_input_ts is None else max(self.last_input_ts, mx)
        return accepted, dropped

    def count_rejected(self, reason: str, n: int = 1) -> None:
        with self.cond:
            self.input_rejected[reason] = self.input_rejected.get(reason, 0) + max(int(n), 1)

    def advance(self, upto_ts: int | None = None, finish: bool = False) -> int:
        with self.cond:
            return self._advance(upto_ts, finish, log=True)

    def _advance(self, upto_ts: int | None, finish: bool, log: bool) -> int:
        chunks = self.pipeline.finish() if finish else self.pipeline.advance(upto_ts)
        if log and self.store is not None:
            self.store.append("advance", {"upto": upto_ts, "finish": finish})
        if finish:
            self._finished = True
        self._ready.extend(c.chunk_id for c in chunks)
        now = self._clock()
        for c in chunks:
            self.timings.ready(c.chunk_id, now)
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
                self.timings.sent(cid, self._sent_at[cid])
                out.append((self.pipeline.chunks[cid], sid))
        return out

    def on_result(self, chunk_id: int, sid: str, results: list[ChunkResult]) -> list[Released]:
        with self.cond:
            if self.dispatcher.owner(chunk_id) == sid:
                self.dispatcher.complete(chunk_id)
            elif sid in self.dispatcher.table:
                self.dispatcher.table[sid].done += 1
            self._sent_at.pop(chunk_id, None)
            self.timings.done(chunk_id, self._clock(), sum(float((r.stats or {}).get("seconds", 0.0)) for r in results))
            released = self.pipeline.complete(chunk_id, results)
            for r in released:
                info = self.queries.get(r.query_id)
                if info is not None and r.rows.num_rows and info.revoked_after is None:
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
                "rejected": dict(self.pipeline.chunker.rejected) | self.input_rejected
                | {f"transport:{k}": v for k, v in self.refused.items()}
                | {f"multicast:{k}": v for k, v in (self.group_rejected() if self.group_rejected else {}).items()},
                "dropped_by_shepherd": dict(self.pipeline.shepherd.dropped),
                "timings": self.timings.summary(),
                "counters": dict(self.pipeline.counters) | {"redispatched": self.redispatched,
                                                              "duplicates": self.pipeline.merger.duplicates,
                                                              "revocations": self.revocations,
                                                              "queries": sum(i.revoked_after is None
                                                                             for i in self.queries.values())},
            }
