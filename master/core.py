"""The master of one level as a plain object: queries, input, dispatch, results.

The gRPC servicer and the dispatch thread in :mod:`strata.master.server` only
translate messages and move bytes; every decision is made here:

* queries are registered per session through the front end at the master's level,
  and stopped by their owner (:meth:`cancel`), a revocation, or their own failure;
* input goes through the stream name check and the shepherd *outside* the lock
  (:meth:`QueryPipeline.screen`), then, on kept rows only, through the limits and
  the chunker (:class:`QueryPipeline`);
* :meth:`assignments` hands ready chunks to workers with a free evaluation slot
  whose external load is below Algorithm 5's threshold (:mod:`.dispatch`), several
  consecutive ready chunks merged into one when a backlog builds (adaptive
  chunking, below), :meth:`on_result` splits a reply per chunk and merges results
  in instant order, :meth:`on_failure` and :meth:`expire` put chunks of failed or
  vanished workers back in the queue; a chunk that fails ``chunk_retries`` times
  (error replies, deadline overruns; not the loss of a worker) is given up: its
  queries stop with an error and later chunks flow;
* released results are kept per query so a subscriber can resume after the
  last instant it acknowledged.

Adaptive chunking: instants are cut into chunks of ``chunk_instants`` as they
close (the latency target: with paced input each chunk goes out alone as soon as
it is cut), and the chunks form the unit of ordering, retries and restarts.
When chunks wait for a worker, the next dispatch takes the oldest
``ceil(ready / workers)`` consecutive ones (``workers``: those that take chunks,
busy or not: :meth:`MasterCore._shares`, and no more than one per ``split_rows`` rows the
backlog gives Spark once pruned: :meth:`MasterCore._split`; at most ``max_unit_rows`` tuples, and
never a chunk that already failed) as one merged chunk: one Spark job per share of the
backlog, so that every worker with work worth a job stays busy and none is left with all of it.  The answer does not
depend on these decisions (tests/test_adaptive.py).

Metadata is data: nothing this object reports (status, counters, error texts)
depends on a row above the master's level.  Rows the shepherd drops are counted
only in the reply to the producer whose batch it was.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.chunker import ChunkingError, merge_chunks, split_result
from strata.chunking.model import Chunk, ChunkResult
from strata.chunking.prune import new_rows, work_rows
from strata.config import Config
from strata.edge import EdgeError, conform, stream_targets

from . import checkpoint
from .dispatch import Dispatcher
from .timings import ChunkTimings
from .shepherd import ShepherdError
from .pipeline import QueryPipeline, Released, one_line

__all__ = ["MasterCore", "QueryInfo", "Refused", "NotYours", "BatchOutcome", "MAX_INGEST_ROWS", "MAX_INGEST_BYTES",
           "DEFAULT_MAX_TS", "DEFAULT_ADVANCE_HORIZON", "STATES"]

MAX_INGEST_ROWS = 1_000_000  # per batch, counted on the rows the shepherd kept
MAX_INGEST_BYTES = 64 * 1024 * 1024  # per batch (kept rows); the transport allows twice that
DEFAULT_MAX_TS = 2**53 - 1
DEFAULT_ADVANCE_HORIZON = 3600
#: released rows kept per query for subscribers that resume ([limits] result_retention_rows)
DEFAULT_RESULT_RETENTION_ROWS = 1_000_000
DEFAULT_RESULT_RETENTION_RESULTS = 10_000  # ... and results per query (each costs ~1-2 kB besides its rows)
#: rows of cut, unreleased chunks above which a producer's next batch waits ([limits] max_backlog_rows; 0: never)
DEFAULT_MAX_BACKLOG_ROWS = 4_000_000
#: rows / events logged after which a master checkpoints ([limits] checkpoint_rows, checkpoint_events)
DEFAULT_CHECKPOINT_ROWS = 1_000_000
DEFAULT_CHECKPOINT_EVENTS = 10_000
#: at most this many tuples (before pruning) in a merged dispatch unit; a single chunk may be larger
MAX_UNIT_ROWS = 1_000_000
#: rows (after pruning) a share of a backlog must give Spark before the backlog is split over another
#: worker (:meth:`MasterCore._split`): a job's fixed cost (~0.15-0.2 s of planning and scheduling,
#: warm) is what ~100-200 k rows of evaluation cost, and on a small host two jobs at once also
#: take each other's cores
SPLIT_ROWS = 100_000
#: a query's state as its owner sees it
STATES = ("running", "ended", "cancelled", "failed", "revoked")


class Refused(ValueError):
    """A call refused by a limit or a check; ``reason`` is the counter it is counted under."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class BatchOutcome:
    """What one ingest batch did: rows kept and applied (for a duplicate: what its first delivery
    applied), rows the shepherd dropped (told to its producer only), chunks its advance cut, and
    whether it was a duplicate (at or below its producer's high-water mark: not applied again)."""

    accepted: int = 0
    dropped: int = 0
    chunks: int = 0
    duplicate: bool = False


#: longest producer id (the client's part; the master prefixes the session's user)
MAX_PRODUCER_ID = 128


class ResultsGone(LookupError):
    """A subscriber asked for results the master no longer keeps (``[limits] result_retention_rows``)."""


class NotYours(LookupError):
    """A query id that is not one of the caller's queries (or does not exist: the same answer)."""


@dataclass
class QueryInfo:
    query_id: str
    text: str
    owner: str  # user
    rewritten: str
    r2s: str
    columns: list[str]
    results: list[Released] = field(default_factory=list)
    base: int = 0  # results dropped from the front (retention); cursors count from the first result ever
    kept_rows: int = 0  # rows in ``results``
    dropped_upto: int | None = None  # the last instant of the newest dropped result
    ended: bool = False  # no result will ever be added to ``results``
    revoked_after: int | None = None  # stopped: no result with ts above this is ever released
    state: str = "running"  # running, cancelled, failed, revoked (shown as ended once a running query ends)
    error: str = ""  # failed: the one-line reason its owner sees
    last_ts: int | None = None  # the last instant released for it

    @property
    def shown_state(self) -> str:
        return "ended" if self.state == "running" and self.ended else self.state


def _fits(chunk: Chunk, results: list[ChunkResult]) -> bool:
    """Whether ``results`` can be ``chunk``'s alone: no row or state beyond its instants."""
    for r in results:
        if r.state_upto is not None and int(r.state_upto) > chunk.last_ts:
            return False
        if r.error_ts is not None and int(r.error_ts) > chunk.last_ts:
            return False
        rows = r.rows
        if rows is not None and rows.num_rows and "ts" in rows.column_names:
            top = pc.max(rows.column("ts")).as_py()
            if top is not None and top > chunk.last_ts:
                return False
    return True


def _query_number(qid: str) -> int:
    """The number of query id ``qN`` (ids continue after the largest after a restart)."""
    return int(qid.lstrip("q") or 0)


def _limit(config, name: str, default: int) -> int:
    """``[limits] name`` of ``config`` (``default`` for a config without that section)."""
    return int(getattr(getattr(config, "limits", None), name, default))


class MasterCore:
    def __init__(self, config: Config, level: str, chunk_instants: int = 1, cpu_threshold: float = 90.0,
                 max_in_flight: int = 2, worker_timeout: float = 3.0, chunk_deadline: float = 60.0,
                 clock=time.monotonic, store=None, chunk_retries: int = 3, adaptive: bool = True,
                 max_unit_rows: int = MAX_UNIT_ROWS, linger: bool = False, split_rows: int = SPLIT_ROWS):
        """``store``: a :class:`~strata.master.store.MasterStore`; every registration,
        accepted batch, advance and stopped query is logged there before it is
        acknowledged, and :meth:`restore` replays a previous run's log.
        ``chunk_retries``: failed attempts (error replies, deadline overruns) after which a
        chunk is given up and its queries stop with an error.
        ``max_in_flight``: the evaluation slots of a worker whose heartbeat does not report them.
        ``adaptive``: merge consecutive ready chunks under a backlog (off: one chunk per call).
        ``linger``: while input arrives faster than a job takes, gather ready chunks for up to one
        job's time (at most one chunk period) before sending them (:meth:`_holding`).
        ``split_rows``: a backlog is spread over another worker only for every this many rows it gives
        Spark once pruned (0: always one share per worker; :meth:`_split`)."""
        self.config = config
        self.store = store
        self._qids = itertools.count(1)
        self.pipeline = QueryPipeline(config, level, chunk_instants)
        self.level = self.pipeline.level
        hb = float(((getattr(config, "sections", None) or {}).get("cluster") or {}).get("heartbeat_seconds", 0.5))
        self.dispatcher = Dispatcher(cpu_threshold, max_in_flight, worker_timeout, own_window=2 * hb + 0.1)
        self.chunk_deadline = chunk_deadline
        self.chunk_retries = max(1, int(chunk_retries))
        self.adaptive = adaptive
        self.max_unit_rows = int(max_unit_rows)
        self.split_rows = max(0, int(split_rows))
        self._work: dict[int, int] = {}  # chunk id -> rows it gives Spark once pruned (ready chunks)
        self._chunk_rows: dict[int, int] = {}  # chunk id -> its rows, while cut and not released
        self._backlog_rows = 0  # their sum (:meth:`backlog_rows`)
        self.max_backlog_rows = _limit(config, "max_backlog_rows", DEFAULT_MAX_BACKLOG_ROWS)
        self.linger = linger
        self.chunk_period = float(chunk_instants) * float(getattr(config, "instant_seconds", 1.0) or 1.0)
        self._advanced: deque[float] = deque(maxlen=2)  # when the last two advances cut chunks
        self._cut_at: dict[int, float] = {}  # chunk id -> when it was cut (ready)
        self.job_seconds: float | None = None  # moving average of a unit's round trip
        self.max_ts = _limit(config, "max_ts", DEFAULT_MAX_TS)
        self.advance_horizon = _limit(config, "advance_horizon", DEFAULT_ADVANCE_HORIZON)
        self.result_retention_rows = _limit(config, "result_retention_rows", DEFAULT_RESULT_RETENTION_ROWS)
        self.result_retention_results = _limit(config, "result_retention_results", DEFAULT_RESULT_RETENTION_RESULTS)
        self.starvation_seconds = 1.0
        self._blocked_since: float | None = None
        self.queries: dict[str, QueryInfo] = {}
        self._ready: deque[int] = deque()  # chunk ids waiting for a worker, ascending
        #: dispatch units in flight: unit id (its first chunk's id) -> the chunk ids it covers
        self._units: dict[int, tuple[int, ...]] = {}
        self._spans: dict[int, tuple[int, int]] = {}  # unit id -> (first_ts, last_ts) as sent
        self._cap: dict[int, int] = {}  # chunk id -> at most this many chunks per unit (after a timeout)
        self._share = 0  # the share of the current backlog a freed slot takes (0: no backlog)
        self._sent_at: dict[int, float] = {}  # unit id -> when it was sent
        self._attempts: dict[int, int] = {}  # chunk id → failed attempts so far
        self._last_failure: dict[int, tuple[str, str]] = {}  # chunk id → (kind, detail) of its last failure
        self.timings = ChunkTimings()  # where chunks' time goes (strata status)
        self._finished = False
        self._clock = clock
        self.cond = threading.Condition()
        self.redispatched = 0
        self.failed_chunks = 0
        self.last_chunk_error = ""
        self.cancelled = 0
        self.refused: dict[str, int] = {}  # calls refused at the transport (reason → n)
        self.revocations = 0
        self.input_rejected: dict[str, int] = {}  # refused batches and calls (reason → n)
        self.group_rejected = None  # callable → Counter of refused heartbeats (set by the server)
        self.last_input_ts: int | None = None  # the largest instant of a kept (accepted) row
        #: exactly-once ingest: producer ("user/id") -> the largest batch seq in the log (its high-water mark)
        self.producers: dict[str, int] = {}
        self.last_output_ts: int | None = None
        # checkpoints ([limits] checkpoint_rows / checkpoint_events): rows and events logged since the last
        self.checkpoint_rows = _limit(config, "checkpoint_rows", DEFAULT_CHECKPOINT_ROWS)
        self.checkpoint_events = _limit(config, "checkpoint_events", DEFAULT_CHECKPOINT_EVENTS)
        self._logged_rows = 0
        self._logged_events = 0
        self.checkpoints = 0
        self.checkpoint_failures = 0
        self.checkpoint_running = False
        self.added_streams: dict[str, tuple] = {}  # streams added at run time: name -> columns
        self.last_checkpoint: dict = {}

    # -- queries ------------------------------------------------------------------------
    def register(self, user: str, texts: list[str]) -> list[QueryInfo]:
        """Compile all texts first (all or nothing), then start them."""
        from strata.mlscql import compile_query

        try:
            compiled = [compile_query(t, self.config, self.level) for t in texts]
        except Exception:  # QueryError: counted, then the caller gets the message
            self.count_rejected("query")
            raise
        out = []
        with self.cond:
            for text, cq in zip(texts, compiled):
                out.append(self._start_query(f"q{next(self._qids)}", text, user, cq))
                self._append("register", {"query_id": out[-1].query_id, "owner": user, "text": text})
        return out

    def _start_query(self, qid: str, text: str, user: str, cq=None) -> QueryInfo:
        qid, cq = self.pipeline.add_query(text, query_id=qid, compiled=cq)
        info = QueryInfo(qid, text, user, cq.rewritten, cq.r2s, [c.name for c in cq.outputs])
        self.queries[qid] = info
        return info

    def _restart_query(self, qid: str, text: str, user: str) -> None:
        """A logged registration again (restore).  A query this version no longer accepts (a limit
        tightened since it was registered: tests/test_query_depth.py) comes back failed, with its one
        line, instead of stopping the master from starting; the other queries go on."""
        from strata.mlscql import QueryError

        try:
            self._start_query(qid, text, user)
        except QueryError as e:
            self.queries[qid] = QueryInfo(qid, text, user, text, "", [], ended=True, revoked_after=-1, state="failed",
                                          error=f"no longer accepted by this version of Strata: {one_line(e)}")

    def _stop_query(self, qid: str, revoked_after: int | None, state: str, error: str = "") -> None:
        """Stop ``qid`` after instant ``revoked_after``: chunks cut from now on do not carry it,
        results of chunks already cut are still released up to that instant."""
        info = self.queries.get(qid)
        if info is None:
            return
        upto = -1 if revoked_after is None else int(revoked_after)
        self.pipeline.remove_query(qid, after=upto)  # later chunks no longer carry it: its branch is not computed
        info.revoked_after = upto
        info.state = state
        info.error = error
        self._refresh_ended()

    def _log_stop(self, info: QueryInfo, reason: str) -> None:
        self._append("remove", {"query_id": info.query_id, "revoked_after": info.revoked_after,
                                "reason": reason, "state": info.state, "error": info.error})

    def _append(self, kind: str, body: dict) -> None:
        """Log one event (counted toward the next checkpoint); nothing without a store."""
        if self.store is not None:
            self.store.append(kind, body)
            self._logged_events += 1

    def owned(self, user: str) -> list[str]:
        with self.cond:
            return [q for q, i in self.queries.items() if i.owner == user]

    def query_view(self, qid: str) -> dict:
        with self.cond:
            return self._view(self.queries[qid])

    @staticmethod
    def _view(i: QueryInfo) -> dict:
        return {"query_id": i.query_id, "text": i.rewritten, "state": i.shown_state,
                "last_ts": -1 if i.last_ts is None else i.last_ts, "error": i.error,
                "stopped_after": -1 if i.revoked_after is None else i.revoked_after}

    def cancel(self, user: str, qids: list[str]) -> list[dict]:
        """Stop some of ``user``'s queries from the next instant (logged, so a restart keeps them
        stopped); returns their views.  Raises :class:`NotYours` (nothing stopped) if one of
        them is not the user's.  Stopping an already stopped query changes nothing."""
        with self.cond:
            for q in qids:
                info = self.queries.get(q)
                if info is None or info.owner != user:
                    raise NotYours(f"query {q} is not one of this user's queries")
            upto = self.pipeline.chunker.closed_until - 1
            for q in dict.fromkeys(qids):
                info = self.queries[q]
                if info.state == "running" and not info.ended:
                    self._stop_query(q, upto, "cancelled")
                    self._log_stop(info, "cancelled")
                    self.cancelled += 1
            self.cond.notify_all()
            return [self._view(self.queries[q]) for q in dict.fromkeys(qids)]

    # -- streams added at run time (issue 16) -------------------------------------------------
    def add_stream(self, name: str, columns: list[tuple[str, str]], log: bool = True) -> tuple[dict, bool]:
        """Declare stream ``name`` with ``columns`` ((attribute, type) pairs) from now on: logged before it
        is applied, so a restart declares it again.  Returns (the stream's view, whether it is new):
        the same declaration again changes nothing; another one for an existing name, or a bad one,
        raises :class:`Refused` (``bad_stream``) with one line."""
        from strata.config import StreamError, stream_of, with_streams
        from strata.names import MAX_NAME_CHARS

        with self.cond:
            have = self.config.stream(name) if isinstance(name, str) else None
            if have is not None and have.relation:
                raise Refused(f"{have.name} is a stored relation ([relations.{have.name}]); a stream cannot take its "
                              f"name (streams and relations share one namespace)", "bad_stream")
            if have is not None:
                if have.name == name and list(have.columns) == [tuple(c) for c in columns]:
                    return self._stream_view(have), False
                raise Refused(f"stream {have.name} exists with attributes "
                              f"{', '.join(f'{c}={t}' for c, t in have.columns)}", "bad_stream")
            try:
                schema = stream_of(name, [tuple(c) for c in columns], self.config.streams)
            except StreamError as e:
                shown = name if isinstance(name, str) and len(name) <= MAX_NAME_CHARS else "(name)"
                raise Refused(f"stream {shown}: {e}" + (f" ({e.key})" if e.key else ""), "bad_stream") from None
            if log:
                self._log([("stream", {"name": schema.name, "columns": [list(c) for c in schema.columns]}, None)],
                          what="stream")
            self.config = with_streams(self.config, [schema])
            self.pipeline.add_stream(self.config)
            self.added_streams[schema.name] = schema.columns
            return self._stream_view(schema), True

    @staticmethod
    def _stream_view(s) -> dict:
        return {"name": s.name, "columns": [list(c) for c in s.columns]}

    def streams(self) -> list[dict]:
        """Every stream this master accepts: the configuration's, then those added at run time."""
        with self.cond:
            return [self._stream_view(s) | {"added": s.name in self.added_streams} for s in self.config.streams.values()]

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
                self._stop_query(q, upto, "revoked")
                self._append("remove", {"query_id": q, "revoked_after": upto, "reason": reason,
                                        "state": "revoked", "error": ""})
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
        client already has are skipped by its ``resume_after_ts``.  Cancelled,
        failed and revoked queries come back stopped, after the same instant.
        """
        n = {"queries": 0, "batches": 0, "chunks": 0}
        if self.store is None:
            return n
        with self.cond:
            top, after, snap = 0, 0, None
            try:
                snap = checkpoint.decode(self.store.read_checkpoint())
                if snap is not None:
                    top, after = self._load(snap), snap.upto_seq
            except (ChunkingError, ValueError) as e:
                from .store import StateMismatch

                k = getattr(snap, "meta", {}).get("pipeline", {}).get("chunker", {}).get("chunk_instants")
                hint = f"start the master with --chunk-seconds {k * self.config.instant_seconds:g} or " if \
                    k and k != self.pipeline.chunker.K else ""
                raise StateMismatch(f"{getattr(self.store, 'path', 'state')}: cannot continue from its checkpoint "
                                    f"({one_line(e)}); {hint}move the file away to start afresh") from None
            if snap is not None:
                n |= {"checkpoint": after, "queries": len(self.queries), "chunks": len(snap.chunks)}
            for ev in self.store.events(after=after):
                if ev.kind == "register":
                    self._restart_query(ev.body["query_id"], ev.body["text"], ev.body["owner"])
                    top = max(top, _query_number(ev.body["query_id"]))
                    n["queries"] += 1
                elif ev.kind == "remove":
                    state = ev.body.get("state") or ("cancelled" if ev.body.get("reason") == "cancelled" else "revoked")
                    self._stop_query(ev.body["query_id"], ev.body.get("revoked_after"), state,
                                     ev.body.get("error") or "")
                elif ev.kind == "ingest":
                    self._push(ev.body["stream"], from_ipc(ev.data), log=False)
                    n["batches"] += 1
                elif ev.kind == "advance":
                    n["chunks"] += self._advance(ev.body.get("upto"), ev.body.get("finish", False), log=False)
                elif ev.kind == "stream":
                    self.add_stream(ev.body["name"], [tuple(c) for c in ev.body["columns"]], log=False)
                    n["streams"] = n.get("streams", 0) + 1
            self._qids = itertools.count(top + 1)
            marks = getattr(self.store, "producers", None)
            self.producers = dict(marks()) if marks is not None else {}
            n["producers"] = len(self.producers)
        return n

    # -- checkpoints (issue 14) -------------------------------------------------------------
    def checkpoint_due(self) -> bool:
        """Whether to checkpoint now: ``checkpoint_rows`` rows or ``checkpoint_events`` events were
        logged since the last one, and the backlog (whose chunks the checkpoint holds) is small: at
        most a quarter of ``checkpoint_rows`` rows, or at most half the rows the checkpoint drops from
        the log (a backlog that does not drain: each checkpoint then still shrinks the state file, which
        stays within a few times ``max(checkpoint_rows, max_backlog_rows)`` rows)."""
        if self.store is None or not hasattr(self.store, "write_checkpoint"):
            return False
        rows, events = self._logged_rows, self._logged_events
        if not ((self.checkpoint_rows and rows >= self.checkpoint_rows)
                or (self.checkpoint_events and events >= self.checkpoint_events)):
            return False
        return self._backlog_rows <= max(self.checkpoint_rows // 4, rows // 2)

    def snapshot(self) -> "checkpoint.Snapshot":
        """This master's state as of the newest logged event (take it under ``cond``; every logged
        event is applied under it)."""
        pmeta, tables, chunks = self.pipeline.export_state()
        queries = [{"query_id": i.query_id, "text": i.text, "owner": i.owner, "rewritten": i.rewritten, "r2s": i.r2s,
                    "columns": list(i.columns), "base": i.base, "dropped_upto": i.dropped_upto, "ended": i.ended,
                    "revoked_after": i.revoked_after, "state": i.state, "error": i.error, "last_ts": i.last_ts}
                   for i in self.queries.values()]
        meta = {"queries": queries, "live": list(self.pipeline.queries), "pipeline": pmeta,
                "streams": [[n, [list(c) for c in cols]] for n, cols in self.added_streams.items()],
                "last_input_ts": self.last_input_ts, "last_output_ts": self.last_output_ts,
                "finished": self._finished, "logged": [self._logged_rows, self._logged_events]}
        return checkpoint.Snapshot(self.store.last_seq(), meta, tables, chunks,
                                   {q: list(i.results) for q, i in self.queries.items() if i.results})

    def checkpoint(self) -> dict:
        """Snapshot under the lock, write it and drop the log before it outside; returns what was done
        (also in status).  Raises what the store raises (nothing changed then; counted)."""
        t0 = time.perf_counter()
        with self.cond:
            snap = self.snapshot()
            self.checkpoint_running = True
        sizes: list[int] = []
        try:
            dropped = self.store.write_checkpoint(snap.upto_seq, checkpoint.encode(snap, sizes))
        except Exception:
            with self.cond:
                self.checkpoint_failures += 1
                self.checkpoint_running = False
            raise
        rows, events = snap.meta["logged"]
        with self.cond:
            self._logged_rows -= rows
            self._logged_events -= events
            self.checkpoints += 1
            self.checkpoint_running = False
            self.last_checkpoint = {"upto_seq": snap.upto_seq, "events_dropped": dropped,
                                    "bytes": sum(sizes), "chunks": len(snap.chunks),
                                    "seconds": round(time.perf_counter() - t0, 3)}
            return dict(self.last_checkpoint)

    def _load(self, snap: "checkpoint.Snapshot") -> int:
        """Take a checkpoint into this fresh core; returns the largest query number it knew."""
        meta = snap.meta
        for name, cols in meta.get("streams", []):  # before the queries that read them
            self.add_stream(name, [tuple(c) for c in cols], log=False)
        infos = {q["query_id"]: q for q in meta["queries"]}
        for qid in meta["live"]:  # the chunker's queries, in their order
            self.pipeline.add_query(infos[qid]["text"], query_id=qid)
        self.pipeline.import_state(meta["pipeline"], snap.tables, snap.chunks)
        top = 0
        for q in meta["queries"]:
            info = QueryInfo(q["query_id"], q["text"], q["owner"], q["rewritten"], q["r2s"], list(q["columns"]),
                             base=int(q["base"]), dropped_upto=q["dropped_upto"], ended=bool(q["ended"]),
                             revoked_after=q["revoked_after"], state=q["state"], error=q["error"], last_ts=q["last_ts"])
            info.results = snap.results.get(info.query_id, [])
            info.kept_rows = sum(r.rows.num_rows for r in info.results)
            self.queries[info.query_id] = info
            top = max(top, _query_number(info.query_id))
        self.last_input_ts, self.last_output_ts = meta["last_input_ts"], meta["last_output_ts"]
        self._finished = bool(meta["finished"])
        self._admit(snap.chunks)
        self.checkpoints, self.last_checkpoint = 0, {"upto_seq": snap.upto_seq, "restored": True}
        return top

    # -- input ----------------------------------------------------------------------------
    def ingest(self, stream: str, table: pa.Table, source_level: str | None) -> tuple[int, int]:
        """Admit a batch whole or refuse it whole; returns (accepted, dropped by the shepherd).

        The stream name and the shepherd run outside the lock; the limits, the chunker's
        checks and everything counted look only at the rows the shepherd kept.  The
        dropped count is for the producer that sent the batch and nobody else.  The batch is
        in the event log before anything of it is applied (:meth:`ingest_batch`)."""
        o = self.ingest_batch(stream, table, source_level)
        return o.accepted, o.dropped

    def ingest_batch(self, stream: str, table: pa.Table | None, source_level: str | None,
                     advance_upto: int | None = None, producer: str | None = None, seq: int = 0) -> BatchOutcome:
        """One producer batch, whole or not at all: its rows (``table``; None: an advance only), then
        its advance (close the instants up to ``advance_upto``).

        Order: the edge (encoded columns sized as decoded, then decoded: :meth:`_conform`), the stream
        name and the shepherd (outside the lock), the limits, then under the lock
        every check of the chunker and of the advance; then the batch (kept rows, advance) and
        ``producer``'s new high-water mark ``seq`` are written to the event log in one transaction;
        only then is it applied.  A batch that cannot be logged is refused with nothing applied.

        Exactly once: ``producer`` (``user/id``) with ``seq`` at or below its logged high-water mark
        is a duplicate (a re-send after a lost acknowledgement or a restart): acknowledged as such,
        nothing applied, nothing logged.  Without ``producer`` every batch is applied as it comes."""
        if producer is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
            self.count_rejected("bad_seq")
            raise Refused(f"batch seq {seq!r} of producer {producer}: must be an integer from 1", "bad_seq")
        name, kept, dropped = stream, None, 0
        if table is not None:
            table = self._conform(stream, table)
            try:
                name, kept, dropped = self.pipeline.screen(stream, table, source_level)
            except ChunkingError as e:
                self.count_rejected(e.reason)
                raise
            except ShepherdError:
                self.count_rejected("bad_level")
                raise
            self._check_limits(name, kept)
        with self.cond:
            if producer is not None and seq <= self.producers.get(producer, 0):
                self.pipeline.counters["duplicate_batches"] += 1
                return BatchOutcome(kept.num_rows if kept is not None else 0, dropped, 0, duplicate=True)
            if advance_upto is not None:
                advance_upto = int(advance_upto)

            def log_then_apply(checked: pa.Table) -> None:  # every check passed; nothing applied yet
                n = checked.num_rows
                if advance_upto is not None:
                    top = int(checked.column("ts")[n - 1].as_py()) if n else None
                    self._check_horizon(advance_upto, top, prefix="advance refused: ")
                if self.store is None:  # no event log (an embedded replay's master): nothing to encode
                    return
                events = []
                if n:  # only what the shepherd let through reaches the disk
                    events.append(("ingest", {"stream": name} | ({"producer": producer, "seq": seq} if producer else {}),
                                   to_ipc(kept)))
                if advance_upto is not None:
                    events.append(("advance", {"upto": advance_upto, "finish": False}, None))
                self._log(events, producer, seq)
                self._logged_rows += n

            accepted = 0
            if kept is not None:
                accepted = self._push(name, kept, log=True, before_commit=log_then_apply)
            else:
                log_then_apply(pa.table({"ts": pa.array([], pa.int64())}))
            if producer is not None:  # in the log now: a re-send is a duplicate from here on
                self.producers[producer] = max(seq, self.producers.get(producer, 0))
            chunks = self._advance(advance_upto, False, log=False) if advance_upto is not None else 0
            return BatchOutcome(accepted, dropped, chunks)

    def _conform(self, stream: str, table: pa.Table) -> pa.Table:
        """The batch with its encoded columns (dictionary, run-end, views, large strings) decoded to the
        stream's types, so the shepherd, the limits, the log and the chunker see plain columns only;
        refused (``bad_type``, ``oversized``) if a column's type is not accepted or the columns would
        decode to more than the transport's cap: sizes are those after decoding, counted first
        (:mod:`strata.edge`).  An unknown stream is left to the pipeline's message."""
        schema = self.config.stream(stream) if isinstance(stream, str) else None
        if schema is None:
            return table
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            return table  # not Arrow: the chunker says it cannot read it
        try:
            return conform(table, stream_targets(schema), 2 * MAX_INGEST_BYTES, f"{schema.kind} {schema.name}")
        except EdgeError as e:
            self.count_rejected(e.reason)
            raise Refused(str(e), e.reason) from None

    def _log(self, events: list, producer: str | None = None, seq: int = 0, what: str = "batch") -> None:
        """Write events (and a producer's high-water mark) in one transaction, or refuse (counted
        ``log_failed``) with nothing written: the caller applies nothing then."""
        if self.store is None or not events and producer is None:
            return
        try:
            if hasattr(self.store, "append_batch"):
                self.store.append_batch(events, producer, seq)
            else:  # a minimal store (tests): one event at a time
                for kind, body, data in events:
                    self.store.append(kind, body, data)
            self._logged_events += len(events)
        except Exception as e:  # noqa: BLE001 - disk full, I/O error, closed store: nothing is applied
            self.input_rejected["log_failed"] = self.input_rejected.get("log_failed", 0) + 1
            raise Refused(f"{what} not written to the event log ({one_line(e) or type(e).__name__}); "
                          f"nothing of it was applied", "log_failed") from None

    def _check_limits(self, stream: str, kept: pa.Table) -> None:
        """Batch size and timestamp bounds, on kept rows only."""
        if kept.num_rows > MAX_INGEST_ROWS:
            self.count_rejected("oversized")
            raise Refused(f"batch of {kept.num_rows} rows exceeds {MAX_INGEST_ROWS}; split it", "oversized")
        if kept.nbytes > MAX_INGEST_BYTES:
            self.count_rejected("oversized")
            raise Refused(f"batch of {kept.nbytes} bytes exceeds {MAX_INGEST_BYTES}; split it", "oversized")
        if not kept.num_rows:
            return
        lower = {c.lower(): c for c in kept.column_names}
        if "ts" not in lower:
            return  # the chunker names the missing column
        try:
            top = pc.max(kept.column(lower["ts"]).cast(pa.int64())).as_py()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return  # not integers: the chunker refuses the type
        if top is not None and top > self.max_ts:
            self.count_rejected("ts_out_of_range")
            raise Refused(f"stream {stream}: ts {top} is beyond the largest instant accepted "
                          f"({self.max_ts}, [limits] max_ts); nothing of this batch was applied", "ts_out_of_range")

    def _push(self, stream: str, kept: pa.Table, log: bool, before_commit=None) -> int:
        """Rows into the chunker.  ``log``: a live batch (refusals counted); ``before_commit`` then
        logs it after every check and before anything is applied (a replayed batch: None)."""
        if self._finished:
            raise Refused("input is finished; no more tuples are accepted", "finished")
        try:
            accepted = self.pipeline.push(stream, kept, before_commit=before_commit)
        except ChunkingError as e:
            if log:
                self.count_rejected(e.reason)
            raise
        if accepted:
            mx = pc.max(kept.column("ts").cast(pa.int64())).as_py()
            self.last_input_ts = mx if self.last_input_ts is None else max(self.last_input_ts, mx)
        return accepted

    def count_rejected(self, reason: str, n: int = 1) -> None:
        """Count ``n`` refused batches (or calls) under ``reason`` (operators see these counts)."""
        with self.cond:
            self.input_rejected[reason] = self.input_rejected.get(reason, 0) + max(int(n), 1)

    def advance(self, upto_ts: int | None = None, finish: bool = False) -> int:
        """Close instants up to ``upto_ts`` (at most ``advance_horizon`` past the largest ingested
        instant), or finish all input; returns the number of chunks cut."""
        with self.cond:
            if not finish and upto_ts is not None:
                self._check_horizon(int(upto_ts))
            return self._advance(upto_ts, finish, log=True)

    def _check_horizon(self, upto_ts: int, top: int | None = None, prefix: str = "") -> None:
        """Refuse (counted) closing instants beyond the latest kept instant ingested (or ``top``, the
        latest of a batch about to be applied) plus ``advance_horizon``."""
        base = self.last_input_ts if self.last_input_ts is not None else 0
        if top is not None and (self.last_input_ts is None or top > base):
            base = top
        bound = base + self.advance_horizon
        if upto_ts > bound:
            self.input_rejected["advance_beyond_horizon"] = self.input_rejected.get("advance_beyond_horizon", 0) + 1
            raise Refused(f"{prefix}advance to {upto_ts} refused: at most {self.advance_horizon} instants "
                          f"([limits] advance_horizon) past the latest instant ingested ({base}), "
                          f"i.e. up to {bound}", "advance_beyond_horizon")

    def _advance(self, upto_ts: int | None, finish: bool, log: bool) -> int:
        if log:  # written before it is applied (closing instants cannot fail after the checks)
            self._log([("advance", {"upto": upto_ts, "finish": finish}, None)], what="advance")
        chunks = self.pipeline.finish() if finish else self.pipeline.advance(upto_ts)
        if finish:
            self._finished = True
        return self._admit(chunks)

    def _admit(self, chunks: list[Chunk]) -> int:
        """Chunks the pipeline cut (or a checkpoint held) join the ready queue and the backlog."""
        for c in chunks:
            self._ready_add(c.chunk_id)
            n = new_rows(c)  # its legacy is an earlier chunk's (or history's) rows: counted there
            self._chunk_rows[c.chunk_id] = n
            self._backlog_rows += n
        now = self._clock()
        if chunks:
            self._advanced.append(now)
            for c in chunks:
                self._cut_at[c.chunk_id] = now
        for c in chunks:
            self.timings.ready(c.chunk_id, now)
        self._refresh_ended()
        self.cond.notify_all()
        return len(chunks)

    # -- group table (fed by multicast heartbeats) ----------------------------------------------
    def heartbeat(self, sid: str, cpu: float, state: str = "ready", pid: int = 0, slots: int | None = None,
                  seq=None) -> None:
        """A worker's heartbeat: its CPU reading, state, pid, evaluation ``slots`` (None: the
        default) and, if known, the heartbeat's sequence number (tells a new reading from the
        same heartbeat seen again)."""
        with self.cond:
            self.dispatcher.heartbeat(sid, cpu, self._clock(), state, pid, slots=slots, seq=seq)
            self.cond.notify_all()

    def expire(self) -> list[int]:
        """Drop silent workers and units past their deadline; requeue their chunks.

        A deadline overrun counts as a failed attempt of its chunks; a lost worker does not.
        Returns the ids of the units taken back."""
        now = self._clock()
        with self.cond:
            lost = self.dispatcher.expire(now)
            late = [u for u, t in self._sent_at.items() if now - t > self.deadline(u) and u not in lost]
            self._requeue(lost)
            for u in late:
                self.dispatcher.unassign(u, now)
                self._failed_attempt(u, "DEADLINE", f"no result within {self.chunk_deadline:g} s")
            return lost + late

    def deadline_factor(self, unit: int) -> float:
        """How much longer than one chunk unit ``unit`` may take: 1 + 1/4 per extra chunk (at most 10)."""
        return min(10.0, 1.0 + 0.25 * (len(self._units.get(unit, (unit,))) - 1))

    def deadline(self, unit: int) -> float:
        """Seconds after which unit ``unit`` counts as overdue (``chunk_deadline`` for one chunk)."""
        return self.chunk_deadline * self.deadline_factor(unit)

    def _unit(self, unit: int) -> tuple[int, ...]:
        """The chunks of a dispatch unit (a unit not in flight: the chunk of that id)."""
        return self._units.get(unit, (unit,))

    def _ready_add(self, cid: int) -> bool:
        """Put ``cid`` in the ready queue in id order (new chunks go last); False if it is there."""
        q = self._ready
        if not q or cid > q[-1]:
            q.append(cid)
            return True
        for i, x in enumerate(q):
            if x == cid:
                return False
            if x > cid:
                q.insert(i, cid)
                return True
        return False  # not reached

    def _requeue(self, units: list[int]) -> None:
        """Put the chunks of ``units`` whose results are not in back in the ready queue (not counted
        as failures)."""
        for u in units:
            self._sent_at.pop(u, None)
            self.timings.unsent(u)
            self._spans.pop(u, None)
            for cid in self._units.pop(u, (u,)):
                if cid in self.pipeline.chunks and not self.pipeline.recorded(cid) and self._ready_add(cid):
                    self.redispatched += 1
        if units:
            self.cond.notify_all()

    def _failed_attempt(self, unit: int, kind: str, detail: str) -> None:
        """One more failed attempt of every chunk of ``unit`` still unanswered: requeue them, or give
        up those that reached the cap.  A chunk that failed once travels alone from then on, so
        the failures of a bad chunk are its own.  A merged unit that only ran out of time says
        nothing against any of its chunks: they go back uncounted, in units half as large."""
        self._spans.pop(unit, None)
        chunks = [c for c in self._units.pop(unit, (unit,))
                  if c in self.pipeline.chunks and not self.pipeline.recorded(c)]
        self._sent_at.pop(unit, None)
        self.timings.unsent(unit)
        if len(chunks) > 1 and kind in ("DEADLINE", "DEADLINE_EXCEEDED"):
            for cid in chunks:
                self._cap[cid] = max(1, min(self._cap.get(cid, len(chunks)), len(chunks) // 2))
            self._requeue(chunks)
            return
        again = []
        for cid in chunks:
            self._attempts[cid] = self._attempts.get(cid, 0) + 1
            self._last_failure[cid] = (kind, one_line(detail))
            if self._attempts[cid] >= self.chunk_retries:
                self._give_up(cid)
            else:
                again.append(cid)
        self._requeue(again)

    def _give_up(self, cid: int) -> None:
        """Stop every live query of chunk ``cid`` with an error naming its instants and the last
        failure, and release the chunk so that later chunks flow."""
        chunk = self.pipeline.chunks[cid]
        kind, detail = self._last_failure.get(cid, ("ERROR", ""))
        n = self._attempts.get(cid, 0)
        span = f"{chunk.first_ts}-{chunk.last_ts}" if chunk.first_ts != chunk.last_ts else f"{chunk.first_ts}"
        # the owners see the kind of failure only: a worker's text may name another user's query
        msg = f"the chunk of instants {span} failed {n} times on the workers (last failure: {kind}); query stopped"
        self.failed_chunks += 1
        self.last_chunk_error = f"chunk {cid} (instants {span}) given up after {n} failed attempts; last: " \
                                f"{kind}: {detail}".rstrip(": ")
        try:
            self._ready.remove(cid)
        except ValueError:
            pass
        self.timings.forget(cid)
        results = [ChunkResult(qc.query_id, cid, pa.table({}), error=msg,
                               error_ts=qc.instants[0] if qc.instants else chunk.first_ts)
                   for qc in self._live_view(chunk).queries]
        self._release(cid, results)

    # -- dispatch (Algorithm 5) ----------------------------------------------------------------
    def _live(self, qid: str, chunk: Chunk) -> bool:
        info = self.queries.get(qid)
        return info is not None and (info.revoked_after is None or chunk.first_ts <= info.revoked_after)

    def _live_view(self, chunk: Chunk) -> Chunk:
        """``chunk`` without the queries stopped before it (nothing of theirs is computed)."""
        live = [qc for qc in chunk.queries if self._live(qc.query_id, chunk)]
        return chunk if len(live) == len(chunk.queries) else replace(chunk, queries=live)

    def assignments(self) -> list[tuple[Chunk, str]]:
        """Units to send now (without stopped queries), each with the worker chosen for it.

        A unit is one ready chunk or, when several wait, the oldest ``ceil(ready / workers)``
        consecutive ones merged (:func:`~strata.chunking.chunker.merge_chunks`; its id is its first
        chunk's).  A chunk left with no live query is released here without a worker."""
        out = []
        with self.cond:
            now = self._clock()
            if self._holding(now):
                return out
            floor = self._share if self._ready else 0
            issued = 0
            while self._ready:
                cid = self._ready[0]
                if cid not in self.pipeline.chunks or self.pipeline.recorded(cid):
                    self._ready.popleft()
                    continue
                view = self._live_view(self.pipeline.chunks[cid])
                if not view.queries:
                    self._ready.popleft()
                    self.timings.forget(cid)
                    self._release(cid, [])
                    continue
                starving = self._blocked_since is not None and now - self._blocked_since > self.starvation_seconds
                sid = self.dispatcher.pick(starving=starving)
                if sid is None:
                    if self._blocked_since is None:
                        self._blocked_since = now
                    break
                self._blocked_since = None
                # the workers busy before this call and those still free share what is ready; a
                # slot that frees later takes no smaller a share of the same backlog (else the
                # shares would shrink geometrically: many small jobs)
                want = max(floor, self._unit_size(len(self._ready), self._split(self._shares() - len(out))))
                issued = max(issued, want)
                views = self._take(view, want)
                unit = views[0].chunk_id
                ids = tuple(v.chunk_id for v in views)
                self._units[unit] = ids
                self._spans[unit] = (views[0].first_ts, views[-1].last_ts)
                self.dispatcher.assign(unit, sid, now)
                self._sent_at[unit] = now
                self.timings.sent(unit, ids, now)
                out.append((merge_chunks(views), sid))
            self._share = max(floor, issued) if self._ready and self.adaptive else 0
        return out

    #: how long a lone advance's chunks wait for a next advance (:meth:`_holding`): a bulk sender's
    #: batches come a few tens of ms apart; paced input pays this once per chunk period
    PROBE_SECONDS = 0.1

    def linger_seconds(self) -> float:
        """How long ready chunks may gather: one job's round trip as measured (none yet: a chunk
        period, the first jobs being the slow ones), between 50 ms and one chunk period."""
        est = self.job_seconds if self.job_seconds is not None else self.chunk_period
        return min(self.chunk_period, max(0.05, est))

    def _holding(self, now: float) -> bool:
        """Whether to keep ready chunks back a little: input is arriving faster than a job takes
        (the last two advances, and the last one, within :meth:`linger_seconds`), the input is not
        finished, and the oldest ready chunk has waited less than that.  Then sending what is
        ready now would start jobs of a few instants each while many more instants arrive within
        one job's time; waiting that long makes fewer, larger jobs.  A lone advance (the first, or
        one long after the previous: paced input, or the start of a burst) is held for
        :data:`PROBE_SECONDS` only, to see whether another follows: a bulk replay's first
        advance otherwise went out as small jobs whose fixed cost (and CPU taken from the sender
        on a small host) made a 1 M-tuple replay run 6 jobs for 1.2 s of the JVMs' CPU (2 jobs,
        0.4 s with the probe; processing 1.3 s → 0.9 s).  A finished input is never held."""
        if not self.linger or self._finished or not self._ready or not self._advanced:
            return False
        wait = self.linger_seconds()
        last = self._advanced[-1]
        if len(self._advanced) < 2 or last - self._advanced[0] >= wait:
            return now - last < min(wait, self.PROBE_SECONDS)  # a lone advance: is more coming?
        if now - last >= wait:
            return False
        oldest = self._cut_at.get(self._ready[0])
        return oldest is not None and now - oldest < wait

    def _shares(self) -> int:
        """How many units a backlog is cut into: one per worker that takes chunks (ready, external
        load below the threshold; busy or not), not one per slot.  A unit is one Spark job whose
        fixed cost (planning, scheduling: ~0.1 s of CPU) dwarfs a pruned instant's rows, and a
        worker's slots share its Spark cores: per slot, a 1 M-tuple replay on 2 workers ran 7-10
        jobs for 2.0-2.5 s of the JVMs' CPU; per worker, 4-6 jobs for 1.2-1.8 s.  The slots still
        keep the next unit on a worker when its current one ends."""
        table = self.dispatcher.table.values()
        live = [e for e in table if e.state == "ready" and e.external < self.dispatcher.cpu_threshold]
        return len(live or [e for e in table if e.state == "ready"])

    def _split(self, shares: int) -> int:
        """How many of ``shares`` the ready backlog is cut into: one per :attr:`split_rows` rows it
        gives Spark once pruned, at least one, at most ``shares``.  A backlog of pruned ROWS-window
        chunks (a few thousand rows however many tuples arrived) is one job on one worker: two jobs
        of half of it each cost two jobs' fixed cost, at the same time on a 2-core host (a 1 M-tuple
        replay: two 25-instant jobs ~0.37 s each side by side, one 50-instant job ~0.2 s).  A backlog
        of RANGE windows, whose rows all count, is spread over every worker."""
        if not self.split_rows or shares <= 1:
            return shares
        work = 0
        for cid in self._ready:
            w = self._work.get(cid)
            if w is None:
                chunk = self.pipeline.chunks.get(cid)
                try:
                    w = 0 if chunk is None else work_rows(chunk, self.pipeline.queries)
                except Exception:  # noqa: BLE001 - an estimate only: count every row
                    w = chunk.num_rows
                self._work[cid] = w
            work += w
            if work >= shares * self.split_rows:
                return shares
        return max(1, min(shares, math.ceil(work / self.split_rows)))

    def _unit_size(self, ready: int, shares: int) -> int:
        """How many ready chunks the next unit takes: an equal share of the backlog per worker of
        the group (:meth:`_shares`), busy ones included.  A worker that frees while others are
        still busy takes its share, not the whole backlog (which would leave one worker with all
        of it while the others finish their units and idle)."""
        if not self.adaptive:
            return 1
        return max(1, math.ceil(ready / max(1, shares)))

    def _take(self, head: Chunk, want: int) -> list[Chunk]:
        """Pop the head of the ready queue (``head``: its live view) and up to ``want - 1`` chunks
        cut right after it, stopping at a chunk that failed before or at the row cap."""
        self._ready.popleft()
        views = [head]
        want = min(want, self._cap.get(head.chunk_id, want))
        if want <= 1 or self._attempts.get(head.chunk_id):
            return views
        rows = head.num_rows
        last = head.chunk_id
        while len(views) < want and self._ready:
            nxt = self.pipeline.after.get(last)
            if nxt is None or self._ready[0] != nxt or self._attempts.get(nxt):
                break
            want = min(want, self._cap.get(nxt, want))
            if len(views) >= want:
                break
            view = self._live_view(self.pipeline.chunks[nxt])
            if not view.queries:  # nothing to compute: release it here and look past it
                self._ready.popleft()
                self.timings.forget(nxt)
                self._release(nxt, [])
                last = nxt
                continue
            # a merged unit carries the first chunk's legacy only: the others add their new rows (counted
            # when the chunk was cut; a view without its stopped queries is counted again)
            added = self._chunk_rows.get(nxt) if view is self.pipeline.chunks[nxt] else None
            if added is None:
                try:
                    added = new_rows(view)
                except Exception:  # noqa: BLE001 - an estimate only: count every row
                    added = view.num_rows
            if rows + added > self.max_unit_rows:
                break
            self._ready.popleft()
            views.append(view)
            rows += added
            last = nxt
        return views

    def _parts(self, lo: int, hi: int, first: int) -> list[Chunk]:
        """The unreleased cut chunks inside instants ``lo..hi`` (a unit's chunks), in order."""
        chunks = self.pipeline.chunks
        if first in chunks:  # the usual case: follow the cut order from the unit's first chunk
            out, cid = [], first
            while cid is not None and cid in chunks and chunks[cid].last_ts <= hi:
                out.append(chunks[cid])
                cid = self.pipeline.after.get(cid)
            return out
        return [c for c in chunks.values() if lo <= c.first_ts and c.last_ts <= hi]

    def on_result(self, chunk_id: int, sid: str, results: list[ChunkResult],
                  span: tuple[int, int] | None = None) -> list[Released]:
        """A worker's results for unit ``chunk_id``, split per cut chunk and merged in order.

        ``span``: the instants (first_ts, last_ts) the unit covered when it was sent; it names
        the unit's chunks also when the reply comes late and they travel in other units now.
        Without it (callers that send single chunks) a reply that is not for the unit in
        flight must fit the one chunk ``chunk_id`` or it is ignored."""
        with self.cond:
            now = self._clock()
            unit = self._units.get(chunk_id)
            # the same id may have been re-sent with other chunks: the span tells the calls apart
            mine = self.dispatcher.owner(chunk_id) == sid and unit is not None and \
                (span is None or self._spans.get(chunk_id) == (int(span[0]), int(span[1])))
            if span is not None:
                parts = self._parts(int(span[0]), int(span[1]), chunk_id)
            elif mine:
                parts = [self.pipeline.chunks[c] for c in unit if c in self.pipeline.chunks]
            else:
                parts = [self.pipeline.chunks[chunk_id]] if chunk_id in self.pipeline.chunks else []
                if parts and not _fits(parts[0], results):
                    self.pipeline.merger.duplicates += 1  # a late reply of a unit no longer known
                    return []
            released: list[Released] = []
            try:
                if not parts or len(parts) == 1 and parts[0].chunk_id == chunk_id:
                    released += self._release(chunk_id, results)
                else:
                    per: dict[int, list[ChunkResult]] = {c.chunk_id: [] for c in parts}
                    for r in results:
                        for cid, part in split_result(r, parts).items():
                            per[cid].append(part)
                    for c in parts:
                        if not self.pipeline.recorded(c.chunk_id):
                            released += self._release(c.chunk_id, per[c.chunk_id])
            except ChunkingError as e:  # an inconsistent reply (e.g. a state snapshot beyond its chunk)
                if mine:
                    self.dispatcher.unassign(chunk_id, now)
                    self._failed_attempt(chunk_id, "BAD_REPLY", str(e))
                return released
            if mine:
                sent = self._sent_at.get(chunk_id)
                if sent is not None:
                    rtt = max(0.0, now - sent)
                    self.job_seconds = rtt if self.job_seconds is None else 0.7 * self.job_seconds + 0.3 * rtt
                self.dispatcher.complete(chunk_id, now, chunks=len(unit))
                self._units.pop(chunk_id, None)
                self._spans.pop(chunk_id, None)
                self._sent_at.pop(chunk_id, None)
            elif sid in self.dispatcher.table:
                self.dispatcher.table[sid].done += max(1, len(parts))
            self.timings.done(chunk_id, now, sum(float((r.stats or {}).get("seconds", 0.0)) for r in results))
            return released

    def _release(self, chunk_id: int, results: list[ChunkResult]) -> list[Released]:
        """Merge a chunk's results (any order); handle what is now released in chunk order."""
        released = self.pipeline.complete(chunk_id, results)
        for cid in {r.chunk_id for r in released} | {chunk_id}:
            if cid not in self.pipeline.chunks:
                self._backlog_rows -= self._chunk_rows.pop(cid, 0)
                self._cut_at.pop(cid, None)
                self._work.pop(cid, None)
                self._attempts.pop(cid, None)
                self._last_failure.pop(cid, None)
                self._cap.pop(cid, None)
        for r in released:
            info = self.queries.get(r.query_id)
            if info is None:
                continue
            if info.revoked_after is not None and r.first_ts > info.revoked_after:
                continue  # stopped before this chunk
            if r.rows.num_rows:
                info.results.append(r)
                info.kept_rows += r.rows.num_rows
                self._trim(info)
            upto = r.last_ts if r.error_ts is None else r.error_ts - 1
            if info.revoked_after is not None:
                upto = min(upto, info.revoked_after)
            info.last_ts = upto if info.last_ts is None else max(info.last_ts, upto)
            self.last_output_ts = r.last_ts if self.last_output_ts is None else max(self.last_output_ts, r.last_ts)
            if r.error is not None and info.state == "running":
                self._stop_query(r.query_id, r.error_ts - 1, "failed", r.error)
                self._log_stop(info, "failed")
        self._refresh_ended()
        self.cond.notify_all()
        return released

    def on_failure(self, chunk_id: int, sid: str, drop_worker: bool = False, reason: str = "",
                   kind: str = "ERROR") -> None:
        """A worker's call for ``chunk_id`` failed.  ``drop_worker`` (the worker is unreachable):
        drop it and requeue its chunks, not counted against them; otherwise one failed attempt."""
        with self.cond:
            if drop_worker:
                self._requeue(self.dispatcher.remove(sid))
            elif self.dispatcher.owner(chunk_id) == sid:
                self.dispatcher.unassign(chunk_id, self._clock())
                self._failed_attempt(chunk_id, kind, reason)

    def _refresh_ended(self) -> None:
        """Mark queries that will never get another result: stopped ones once every chunk up to
        their last instant is released; all of them once the input is finished and drained."""
        if not self.pipeline.chunks:  # ids still queued belong to chunks released meanwhile (a late reply)
            self._ready.clear()
        drained = self._finished and not self.pipeline.chunks
        for q, info in self.queries.items():
            if info.ended:
                continue
            if info.state != "running":
                info.ended = not self.pipeline.pending_for(q, info.revoked_after)
            elif drained:
                info.ended = True

    # -- results ----------------------------------------------------------------------------------
    def _trim(self, info: QueryInfo) -> None:
        """Bound the results kept for resuming subscribers: drop the oldest while the query keeps more
        than ``result_retention_rows`` rows or ``result_retention_results`` results (the newest
        result always stays).  A subscriber that still needs a dropped one gets
        :class:`ResultsGone`, never a silent gap."""
        while ((info.kept_rows > self.result_retention_rows or len(info.results) > self.result_retention_results)
               and len(info.results) > 1):
            old = info.results.pop(0)
            info.base += 1
            info.kept_rows -= old.rows.num_rows
            info.dropped_upto = old.last_ts if info.dropped_upto is None else max(info.dropped_upto, old.last_ts)

    def backlog_rows(self) -> int:
        """New rows of the chunks cut and not yet released (the input waiting for or in the workers; a
        chunk's legacy is counted with the chunk or history it came from).  Only
        rows the master keeps count (at or below its level), so waiting on it (:meth:`backlog_full`)
        tells a session of this level nothing it may not know."""
        return self._backlog_rows

    def backlog_full(self) -> bool:
        """Whether a producer's next batch should wait: ``[limits] max_backlog_rows`` reached.  The
        workers drain the backlog; input that would only pile up in the master's memory waits in the
        producer instead (gRPC flow control: the producer's sends block)."""
        return bool(self.max_backlog_rows) and self._backlog_rows >= self.max_backlog_rows

    def _retention(self) -> str:
        return f"retention {self.result_retention_rows} rows, {self.result_retention_results} results"

    def check_resume(self, qids: list[str], after_ts: int) -> None:
        """Refuse (:class:`ResultsGone`) a subscription that resumes after ``after_ts`` when results of
        later instants were dropped: the subscriber would miss them."""
        with self.cond:
            for q in qids:
                info = self.queries[q]
                if info.dropped_upto is not None and info.dropped_upto > after_ts:
                    raise ResultsGone(f"query {q}: results up to instant {info.dropped_upto} are no longer kept "
                                      f"({self._retention()}); resume after that instant")

    def wait_results(self, qids: list[str], cursor: dict[str, int], timeout: float) -> tuple[list[Released], list[str]]:
        """Results after ``cursor[qid]`` (a count of the query's results since its first, dropped
        ones included), and the queries among ``qids`` that have ended with every result taken;
        blocks up to ``timeout``.  A subscriber whose next result was dropped before it read it (a
        reader slower than the retention) gets :class:`ResultsGone`."""
        deadline = self._clock() + timeout
        with self.cond:
            for q in qids:  # a new subscriber starts at the oldest result kept
                cursor.setdefault(q, self.queries[q].base)
            while True:
                out, ended = [], []
                for q in qids:
                    info = self.queries[q]
                    if cursor[q] < info.base:
                        raise ResultsGone(f"query {q}: results up to instant {info.dropped_upto} were dropped before "
                                          f"this subscriber read them ({self._retention()})")
                    out.extend(info.results[cursor[q] - info.base:])
                    cursor[q] = info.base + len(info.results)
                    if info.ended:
                        ended.append(q)
                if out or ended:
                    return out, ended
                left = deadline - self._clock()
                if left <= 0:
                    return [], []
                self.cond.wait(left)

    def end_of(self, qid: str) -> tuple[str, str]:
        """(state, error) of a query, for the last message of its result stream."""
        with self.cond:
            info = self.queries[qid]
            return info.shown_state, info.error

    # -- status -------------------------------------------------------------------------------------
    def status(self, user: str | None = None, cluster: bool = True) -> dict:
        """What a session may read: the level and ``user``'s own queries; with ``cluster`` (operators)
        also workers, loads, backlog, lag, timings, counters and refusals.  Nothing here depends
        on a row above the level: lag and latest instants come from kept rows, shepherd drops
        are not counted."""
        with self.cond:
            out = {"level": self.level,
                   "queries": [self._view(i) for i in self.queries.values() if user is not None and i.owner == user]}
            if not cluster:
                return out
            workers = [
                {"sid": e.sid, "cpu": e.cpu, "pid": e.pid, "state": e.state, "in_flight": len(e.in_flight), "done": e.done}
                for e in self.dispatcher.table.values()
            ]
            lag = 0.0
            if self.last_input_ts is not None:
                lag = float(self.last_input_ts - (self.last_output_ts if self.last_output_ts is not None else -1))
            out.update({
                "workers": workers,
                "backlog_chunks": self.pipeline.backlog,
                "ready_chunks": len(self._ready),
                "lag_instants": max(0.0, lag),
                "rejected": dict(self.input_rejected)
                | {f"transport:{k}": v for k, v in self.refused.items()}
                | {f"multicast:{k}": v for k, v in (self.group_rejected() if self.group_rejected else {}).items()},
                "timings": self.timings.summary(),
                "last_chunk_error": self.last_chunk_error,
                "counters": dict(self.pipeline.counters) | {"redispatched": self.redispatched,
                                                              "duplicates": self.pipeline.merger.duplicates,
                                                              "revocations": self.revocations,
                                                              "cancelled": self.cancelled,
                                                              "failed_chunks": self.failed_chunks,
                                                              "checkpoints": self.checkpoints,
                                                              "checkpoint_failures": self.checkpoint_failures,
                                                              "events_since_checkpoint": self._logged_events,
                                                              "checkpoint_running": int(self.checkpoint_running),
                                                              "last_checkpoint_bytes":
                                                                  int(self.last_checkpoint.get("bytes", 0)),
                                                              "last_checkpoint_ms":
                                                                  int(1000 * self.last_checkpoint.get("seconds", 0)),
                                                              "queries": sum(i.revoked_after is None
                                                                             for i in self.queries.values())},
            })
            return out
