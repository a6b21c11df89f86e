"""The master of one level as a plain object: every decision, no I/O but its event log's.

The servicers (:mod:`strata.master.server`, :mod:`strata.master.aio_server`) and the dispatch
thread (:mod:`strata.master.dispatch_loop`) only translate messages and move bytes; the
decisions are made here and in the plain parts :class:`MasterCore` puts together:

* **queries** (:mod:`.queries`): registered per session through the front end at the master's
  level, stopped by their owner (:meth:`MasterCore.cancel`), a revocation, or their own failure;
  released results kept per query so a subscriber can resume after the last instant it
  acknowledged;
* **input** (:mod:`.admission`, :class:`~strata.master.pipeline.QueryPipeline`): the stream
  name check and the shepherd run *outside* the lock, then, on kept rows only, the limits and the
  chunker;
* **the event log** (:mod:`.eventlog`): for each stimulus accepted the core makes the events to
  log, writes them, then applies them (a batch is logged before anything of it is applied);
  :meth:`MasterCore.restore` replays a previous run's log through :meth:`MasterCore.apply`;
* **dispatch** (:mod:`.dispatch_state` beside Algorithm 5's :mod:`.dispatch`): ready chunks go to
  workers with a free evaluation slot, several consecutive ones merged under a backlog; replies are
  split per chunk and merged in instant order; failed and overdue units go back to the queue, a
  chunk that fails ``chunk_retries`` times is given up;
* **changes** (:mod:`.notify`): after every change a waiter may care about, :attr:`MasterCore.changes`
  tells whoever attached: threads waiting on :attr:`MasterCore.cond`, the asyncio front's
  subscribers.

Metadata is data: nothing this object reports (status, counters, error texts) depends on a row
above the master's level.  Rows the shepherd drops are counted only in the reply to the producer
whose batch it was.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc
from strata.chunking.chunker import ChunkingError
from strata.chunking.model import Chunk, ChunkResult
from strata.chunking.shield import Switch
from strata.config import Config, with_streams
from strata.errors import one_line
from strata.logs import RepeatLimiter
from strata.mlscql import QueryError, compile_query
from strata.punctuations import is_punctuation_stream

from . import eventlog
from .access import access_event, check_switch
from .admission import (DEFAULT_ADVANCE_HORIZON, DEFAULT_MAX_TS, MAX_INGEST_BYTES, MAX_INGEST_ROWS, MAX_PRODUCER_ID,
                        BatchOutcome, Refused, check_horizon, check_limits, check_seq, conform_batch, declared_stream)
from .dispatch import Dispatcher
from .dispatch_state import MAX_UNIT_ROWS, SPLIT_ROWS, DispatchState
from .eventlog import EventLog
from .notify import Changes, ThreadNotifier
from .pipeline import QueryPipeline, Released
from .queries import STATES, NotYours, QueryInfo, ResultsGone, Retention, has_news, view
from .shedding import Decision, Shedder, ShedRule, instants_of
from .shepherd import ShepherdError
from .timings import ChunkTimings

# the core's errors, limits and query records are defined in its parts and are its API too
__all__ = ["MasterCore", "QueryInfo", "Refused", "NotYours", "ResultsGone", "BatchOutcome", "MAX_INGEST_ROWS",
           "MAX_INGEST_BYTES", "MAX_PRODUCER_ID", "DEFAULT_MAX_TS", "DEFAULT_ADVANCE_HORIZON", "MAX_UNIT_ROWS",
           "SPLIT_ROWS", "STATES"]

log = logging.getLogger("strata.master")


class MasterCore:
    #: see :attr:`DispatchState.PROBE_SECONDS`
    PROBE_SECONDS = DispatchState.PROBE_SECONDS

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
        job's time (at most one chunk period) before sending them (:meth:`DispatchState.holding`).
        ``split_rows``: a backlog is spread over another worker only for every this many rows it gives
        Spark once pruned (0: always one share per worker; :meth:`DispatchState.split`)."""
        self.config = config
        self.store = store
        self.query_ids = itertools.count(1)
        self.pipeline = QueryPipeline(config, level, chunk_instants)
        self.level = self.pipeline.level
        self._clock = clock
        #: the core's lock: every call below takes it; threads wait on it for the next change
        self.cond = threading.Condition()
        self._threads = ThreadNotifier(self.cond)
        #: "something changed": threads waiting on :attr:`cond`, and whoever attaches (the asyncio front)
        self.changes = Changes(self._threads)
        hb = config.cluster.heartbeat_seconds
        self.dispatcher = Dispatcher(cpu_threshold, max_in_flight, worker_timeout, own_window=2 * hb + 0.1)
        self.timings = ChunkTimings()  # where chunks' time goes (strata status)
        self.dispatch = DispatchState(self.pipeline, self.dispatcher, self.timings, clock, self._live_view,
                                      self._release, self.changes.notify, chunk_deadline=chunk_deadline,
                                      chunk_retries=chunk_retries, adaptive=adaptive, max_unit_rows=max_unit_rows,
                                      split_rows=split_rows, linger=linger,
                                      chunk_period=float(chunk_instants) * config.instant_seconds)
        self.eventlog = EventLog(store, self.count_rejected)
        self.max_backlog_rows = config.limits.max_backlog_rows
        #: load shedding ([limits] overload = "shed"; master/shedding.py): decided per batch from the backlog
        self.shedder = Shedder(ShedRule.of(config.limits))
        self._shed_log = RepeatLimiter(log)
        self.max_ts = config.limits.max_ts
        self.advance_horizon = config.limits.advance_horizon
        self.retention = Retention(config.limits.result_retention_rows, config.limits.result_retention_results)
        # checkpoints ([limits] checkpoint_rows / checkpoint_events): rows and events logged since the last
        self.checkpoint_rows = config.limits.checkpoint_rows
        self.checkpoint_events = config.limits.checkpoint_events
        self.queries: dict[str, QueryInfo] = {}
        self.finished = False  # all input closed: no more tuples are accepted
        self.cancelled = 0
        self.refused: dict[str, int] = {}  # calls refused at the transport (reason → n)
        self.revocations = 0
        self.input_rejected: dict[str, int] = {}  # refused batches and calls (reason → n)
        self.group_rejected = None  # callable → Counter of refused heartbeats (set by the server)
        #: a trusted master's turns: callable → this level's own figures (strata/turns.py ``Turns.stats``)
        self.turn_stats = None
        self.last_input_ts: int | None = None  # the largest instant of a kept (accepted) row
        #: exactly-once ingest: producer ("user/id") -> the largest batch seq in the log (its high-water mark)
        self.producers: dict[str, int] = {}
        self.last_output_ts: int | None = None
        self.added_streams: dict[str, tuple] = {}  # streams added at run time: name -> columns

    def wait_change(self, timeout: float) -> bool:
        """Block the calling thread until the next change (or ``timeout`` s; False then)."""
        return self._threads.wait(timeout)

    # -- queries ------------------------------------------------------------------------
    def register(self, user: str, texts: list[str], roles=()) -> list[QueryInfo]:
        """Compile all texts first (all or nothing), then start them.  ``roles``: the registering
        session's (kept with each query: security punctuations grant or deny them)."""
        try:
            compiled = [compile_query(t, self.config, self.level) for t in texts]
        except Exception:  # QueryError: counted, then the caller gets the message
            self.count_rejected("query")
            raise
        out = []
        with self.cond:
            for text, cq in zip(texts, compiled):
                out.append(self._start_query(f"q{next(self.query_ids)}", text, user, cq, roles))
                self.eventlog.append(eventlog.register_event(out[-1].query_id, user, text, out[-1].roles))
        return out

    def _start_query(self, qid: str, text: str, user: str, cq=None, roles=()) -> QueryInfo:
        roles = tuple(sorted(roles))
        qid, cq = self.pipeline.add_query(text, query_id=qid, compiled=cq, principal=(user, frozenset(roles)))
        info = QueryInfo(qid, text, user, cq.rewritten, cq.r2s, [c.name for c in cq.outputs], roles=roles)
        self.queries[qid] = info
        return info

    def _restart_query(self, qid: str, text: str, user: str, roles=()) -> None:
        """A logged registration again (restore).  A query this version no longer accepts (a limit
        tightened since it was registered: tests/test_query_depth.py) comes back failed, with its one
        line, instead of stopping the master from starting; the other queries go on."""
        try:
            self._start_query(qid, text, user, roles=roles)
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

    def owned(self, user: str) -> list[str]:
        with self.cond:
            return [q for q, i in self.queries.items() if i.owner == user]

    def query_view(self, qid: str) -> dict:
        with self.cond:
            return view(self.queries[qid])

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
                    self.eventlog.append(eventlog.stop_event(info, "cancelled"))
                    self.cancelled += 1
            self.changes.notify()
            return [view(self.queries[q]) for q in dict.fromkeys(qids)]

    def revoke_user(self, user: str, reason: str = "revoked") -> list[str]:
        """Stop every query of ``user`` from the next instant on (a privacy switch); returns their ids.

        Instants closed before the call still deliver; nothing after the last
        closed instant is computed or released for these queries.  Other
        queries, shared or not, are untouched.
        """
        with self.cond:
            upto = self.pipeline.chunker.closed_until - 1
            qids = [q for q, i in self.queries.items() if i.owner == user and i.revoked_after is None]
            for q in qids:
                self._stop_query(q, upto, "revoked")
                self.eventlog.append(eventlog.stop_event(self.queries[q], reason))
            self.revocations += bool(qids)
            self.changes.notify()
            return qids

    def access(self, by: str, user: str, qid: str, stream: str, on: bool) -> dict:
        """A privacy switch (master/access.py): ``user``'s access to ``stream`` for query ``qid`` on or
        off from the first instant not closed, made by operator ``by``; logged before it is applied.
        Returns the switch's view with ``instant`` (where it takes effect) and ``changed``.  Raises
        :class:`Refused` (counted) with one line."""
        with self.cond:
            info = self.queries.get(qid)
            try:
                name = check_switch(info, qid, user, stream, self._streams_of(qid) if info else [])
            except Refused as e:
                self.count_rejected(e.reason)
                raise
            at = self.pipeline.chunker.closed_until
            sw = self.pipeline.chunker.shields.switches.get((qid, name)) or Switch(qid, user, name)
            if sw.on_at(at) == on:  # already so (a grant of a never revoked switch too): nothing logged
                return sw.view(at) | {"instant": at, "changed": False}
            self.eventlog.write([access_event(qid, user, name, on, at, by)], what="switch")
            sw, changed, at = self.pipeline.switch(qid, user, name, on, at)
            self.changes.notify()
            return sw.view(at) | {"instant": at, "changed": changed}

    def _streams_of(self, qid: str) -> list[str]:
        return self.pipeline.chunker.streams_of(qid)

    def owners(self) -> set[str]:
        with self.cond:
            return {i.owner for i in self.queries.values() if i.revoked_after is None}

    def last_closed(self) -> int:
        """The last instant closed so far (-1: none)."""
        return self.pipeline.chunker.closed_until - 1

    # -- streams added at run time (issue 16) -------------------------------------------------
    def add_stream(self, name: str, columns: list[tuple[str, str]], log: bool = True) -> tuple[dict, bool]:
        """Declare stream ``name`` with ``columns`` ((attribute, type) pairs) from now on: logged before it
        is applied, so a restart declares it again.  Returns (the stream's view, whether it is new):
        the same declaration again changes nothing; another one for an existing name, or a bad one,
        raises :class:`Refused` (``bad_stream``) with one line."""
        with self.cond:
            schema, new = declared_stream(self.config, name, columns)
            if not new:
                return self._stream_view(schema), False
            if log:
                self.eventlog.write([eventlog.stream_event(schema)], what="stream")
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

    # -- the event log: replay and checkpoints (master/eventlog.py) ------------------------------
    def apply(self, kind: str, body: dict, data: bytes | None = None) -> int:
        """One logged event's transition, without logging it again (:func:`eventlog.restore` replays a
        log through it); returns the chunks it cut.  Take it under :attr:`cond`."""
        if kind == "register":
            self._restart_query(body["query_id"], body["text"], body["owner"], body.get("roles", ()))
        elif kind == "access":
            self.pipeline.switch(body["query_id"], body["user"], body["stream"], bool(body["on"]), int(body["at"]))
        elif kind == "remove":
            state = body.get("state") or ("cancelled" if body.get("reason") == "cancelled" else "revoked")
            self._stop_query(body["query_id"], body.get("revoked_after"), state, body.get("error") or "")
        elif kind == "ingest":
            self._push(body["stream"], from_ipc(data), log=False)
        elif kind == "advance":
            return self._advance(body.get("upto"), body.get("finish", False), log=False)
        elif kind == "stream":
            self.add_stream(body["name"], [tuple(c) for c in body["columns"]], log=False)
        elif kind == "shed":
            self.shedder.commit(Decision.of_body(body))
        return 0

    def restore(self) -> dict:
        """Replay the store's checkpoint and log into this (fresh) core (:func:`eventlog.restore`)."""
        return eventlog.restore(self)

    def checkpoint_due(self) -> bool:
        return eventlog.checkpoint_due(self)

    def snapshot(self):
        return eventlog.snapshot(self)

    def checkpoint(self) -> dict:
        return eventlog.checkpoint(self)

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

        Order: the edge (encoded columns sized as decoded, then decoded: :func:`conform_batch`), the
        stream name and the shepherd (outside the lock), the limits, then under the lock
        every check of the chunker and of the advance; then the batch (kept rows, advance) and
        ``producer``'s new high-water mark ``seq`` are written to the event log in one transaction;
        only then is it applied.  A batch that cannot be logged is refused with nothing applied.

        Exactly once: ``producer`` (``user/id``) with ``seq`` at or below its logged high-water mark
        is a duplicate (a re-send after a lost acknowledgement or a restart): acknowledged as such,
        nothing applied, nothing logged.  Without ``producer`` every batch is applied as it comes."""
        check_seq(producer, seq, self.count_rejected)
        name, kept, dropped = stream, None, 0
        if table is not None:
            table = conform_batch(self.config, stream, table, self.count_rejected)
            try:
                name, kept, dropped = self.pipeline.screen(stream, table, source_level)
            except ChunkingError as e:
                self.count_rejected(e.reason)
                raise
            except ShepherdError:
                self.count_rejected("bad_level")
                raise
            check_limits(name, kept, self.max_ts, self.count_rejected)
        with self.cond:
            if producer is not None and seq <= self.producers.get(producer, 0):
                self.pipeline.counters["duplicate_batches"] += 1
                return BatchOutcome(kept.num_rows if kept is not None else 0, dropped, 0, duplicate=True)
            if advance_upto is not None:
                advance_upto = int(advance_upto)
            shed = self._shed_decision(name, kept)  # load shedding: decided here, logged with the batch
            if shed is not None and shed.rows:
                kept = kept.filter(pa.array(shed.keep))

            def log_then_apply(checked: pa.Table) -> None:  # every check passed; nothing applied yet
                n = checked.num_rows
                if advance_upto is not None:
                    top = int(checked.column("ts")[n - 1].as_py()) if n else None
                    if shed is not None and shed.last is not None:  # shed instants arrived too
                        top = shed.last if top is None else max(top, shed.last)
                    self._check_horizon(advance_upto, top, prefix="advance refused: ")
                if self.store is None:  # no event log (an embedded replay's master): nothing to encode
                    return
                events = eventlog.batch_events(name, kept, n, producer, seq, advance_upto)
                if shed is not None and shed.logged:
                    events.insert(0, eventlog.shed_event(shed.body()))
                self.eventlog.write(events, producer, seq)
                self.eventlog.rows += n

            accepted = 0
            if kept is not None:
                accepted = self._push(name, kept, log=True, before_commit=log_then_apply)
            else:
                log_then_apply(pa.table({"ts": pa.array([], pa.int64())}))
            if producer is not None:  # in the log now: a re-send is a duplicate from here on
                self.producers[producer] = max(seq, self.producers.get(producer, 0))
            if shed is not None:
                self._shed_commit(shed)
            chunks = self._advance(advance_upto, False, log=False) if advance_upto is not None else 0
            if shed is not None and shed.rows:
                return BatchOutcome(accepted, dropped, chunks, shed=shed.rows, shed_first=shed.first,
                                    shed_last=shed.last)
            return BatchOutcome(accepted, dropped, chunks)

    def _shed_decision(self, stream: str, kept: pa.Table | None) -> Decision | None:
        """The load-shedding decision for a batch's kept rows (None: not shedding, or no rows), from this
        master's own backlog (master/shedding.py).  Take it under :attr:`cond`."""
        if kept is None or not kept.num_rows or not self.shedder.enabled or is_punctuation_stream(stream):
            return None  # punctuations are never shed: they govern the later instants too
        ts = instants_of(kept)
        if ts is None:
            return None
        return self.shedder.decide(stream, ts, self.dispatch.backlog_rows, self.pipeline.chunker.closed_until)

    def _shed_commit(self, d: Decision) -> None:
        """Apply a logged (or unlogged: nothing shed, nothing changed) decision; say so in the log."""
        self.shedder.commit(d)
        rule = self.shedder.rule
        if d.flipped and d.active:
            self._shed_log.warning("shed_on", "level %s starts shedding: backlog %d rows (bound %d, resumes "
                                   "below %d)", self.level, d.reading, rule.high, rule.low)
        elif d.flipped:
            self._shed_log.warning("shed_off", "level %s stops shedding: backlog %d rows (below %d)", self.level,
                                   d.reading, rule.low)
        if d.rows:
            self._shed_log.warning("shed", "level %s shed %d rows of %s at instants %d-%d (%d rows shed in all)",
                                   self.level, d.rows, d.stream, d.first, d.last, sum(self.shedder.rows.values()))

    def _push(self, stream: str, kept: pa.Table, log: bool, before_commit=None) -> int:
        """Rows into the chunker.  ``log``: a live batch (refusals counted); ``before_commit`` then
        logs it after every check and before anything is applied (a replayed batch: None)."""
        if self.finished:
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
            self.shedder.kept(mx)  # its instants are decided (kept), also when replayed
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
        if self.shedder.last_shed is not None:  # instants shed arrived: the horizon runs from them too
            top = self.shedder.last_shed if top is None else max(top, self.shedder.last_shed)
        check_horizon(upto_ts, self.last_input_ts, self.advance_horizon, self.count_rejected, top, prefix)

    def _advance(self, upto_ts: int | None, finish: bool, log: bool) -> int:
        if log:  # written before it is applied (closing instants cannot fail after the checks)
            self.eventlog.write([eventlog.advance_event(upto_ts, finish)], what="advance")
        chunks = self.pipeline.finish() if finish else self.pipeline.advance(upto_ts)
        if finish:
            self.finished = True
        return self.admit(chunks)

    def admit(self, chunks: list[Chunk]) -> int:
        """Chunks the pipeline cut (or a checkpoint held) join the ready queue and the backlog."""
        self.dispatch.admit(chunks, self._clock())
        self._refresh_ended()
        self.changes.notify()
        return len(chunks)

    # -- dispatch (Algorithm 5; master/dispatch_state.py) ---------------------------------------
    def heartbeat(self, sid: str, cpu: float, state: str = "ready", pid: int = 0, slots: int | None = None,
                  seq=None) -> None:
        """A worker's heartbeat: its CPU reading, state, pid, evaluation ``slots`` (None: the
        default) and, if known, the heartbeat's sequence number (tells a new reading from the
        same heartbeat seen again)."""
        with self.cond:
            self.dispatcher.heartbeat(sid, cpu, self._clock(), state, pid, slots=slots, seq=seq)
            self.changes.notify()

    def expire(self) -> list[int]:
        """Drop silent workers and units past their deadline; requeue their chunks
        (:meth:`DispatchState.expire`)."""
        now = self._clock()
        with self.cond:
            return self.dispatch.expire(now)

    def assignments(self) -> list[tuple[Chunk, str]]:
        """Units to send now (without stopped queries), each with the worker chosen for it
        (:meth:`DispatchState.assignments`)."""
        with self.cond:
            return self.dispatch.assignments(self._clock(), self.finished)

    def has_ready(self) -> bool:
        """Whether units wait for a worker (or for their linger to end): a dispatch step may send them."""
        return bool(self.dispatch.ready)

    def on_result(self, chunk_id: int, sid: str, results: list[ChunkResult],
                  span: tuple[int, int] | None = None) -> list[Released]:
        """A worker's results for unit ``chunk_id``, split per cut chunk and merged in order
        (:meth:`DispatchState.on_result`)."""
        with self.cond:
            return self.dispatch.on_result(chunk_id, sid, results, span)

    def on_failure(self, chunk_id: int, sid: str, drop_worker: bool = False, reason: str = "",
                   kind: str = "ERROR") -> None:
        """A worker's call for ``chunk_id`` failed (:meth:`DispatchState.on_failure`)."""
        with self.cond:
            self.dispatch.on_failure(chunk_id, sid, drop_worker, reason, kind)

    def deadline_factor(self, unit: int) -> float:
        return self.dispatch.deadline_factor(unit)

    def deadline(self, unit: int) -> float:
        return self.dispatch.deadline(unit)

    def linger_seconds(self) -> float:
        return self.dispatch.linger_seconds()

    def _live(self, qid: str, chunk: Chunk) -> bool:
        info = self.queries.get(qid)
        return info is not None and (info.revoked_after is None or chunk.first_ts <= info.revoked_after)

    def _live_view(self, chunk: Chunk) -> Chunk:
        """``chunk`` without the queries stopped before it (nothing of theirs is computed)."""
        live = [qc for qc in chunk.queries if self._live(qc.query_id, chunk)]
        return chunk if len(live) == len(chunk.queries) else replace(chunk, queries=live)

    def _release(self, chunk_id: int, results: list[ChunkResult]) -> list[Released]:
        """Merge a chunk's results (any order); handle what is now released in chunk order."""
        released = self.pipeline.complete(chunk_id, results)
        self.dispatch.released({r.chunk_id for r in released} | {chunk_id})
        for r in released:
            info = self.queries.get(r.query_id)
            if info is None:
                continue
            if info.revoked_after is not None and r.first_ts > info.revoked_after:
                continue  # stopped before this chunk
            if r.rows.num_rows:
                self.retention.keep(info, r)
            upto = r.last_ts if r.error_ts is None else r.error_ts - 1
            if info.revoked_after is not None:
                upto = min(upto, info.revoked_after)
            info.last_ts = upto if info.last_ts is None else max(info.last_ts, upto)
            self.last_output_ts = r.last_ts if self.last_output_ts is None else max(self.last_output_ts, r.last_ts)
            if r.error is not None and info.state == "running":
                self._stop_query(r.query_id, r.error_ts - 1, "failed", r.error)
                self.eventlog.append(eventlog.stop_event(info, "failed"))
        self._refresh_ended()
        self.changes.notify()
        return released

    def _refresh_ended(self) -> None:
        """Mark queries that will never get another result: stopped ones once every chunk up to
        their last instant is released; all of them once the input is finished and drained."""
        if not self.pipeline.chunks:  # ids still queued belong to chunks released meanwhile (a late reply)
            self.dispatch.ready.clear()
        drained = self.finished and not self.pipeline.chunks
        for q, info in self.queries.items():
            if info.ended:
                continue
            if info.state != "running":
                info.ended = not self.pipeline.pending_for(q, info.revoked_after)
            elif drained:
                info.ended = True

    # -- results ----------------------------------------------------------------------------------
    def backlog_rows(self) -> int:
        """New rows of the chunks cut and not yet released (the input waiting for or in the workers; a
        chunk's legacy is counted with the chunk or history it came from).  Only
        rows the master keeps count (at or below its level), so waiting on it (:meth:`backlog_full`)
        tells a session of this level nothing it may not know."""
        return self.dispatch.backlog_rows

    def backlog_full(self) -> bool:
        """Whether a producer's next batch should wait: ``[limits] max_backlog_rows`` reached.  The
        workers drain the backlog; input that would only pile up in the master's memory waits in the
        producer instead (gRPC flow control: the producer's sends block)."""
        if self.shedder.enabled:  # [limits] overload = "shed": the level sheds instead (master/shedding.py)
            return False
        return bool(self.max_backlog_rows) and self.dispatch.backlog_rows >= self.max_backlog_rows

    def check_resume(self, qids: list[str], after_ts: int) -> None:
        """Refuse (:class:`ResultsGone`) a subscription that resumes after ``after_ts`` when results of
        later instants were dropped: the subscriber would miss them."""
        with self.cond:
            self.retention.check_resume(self.queries, qids, after_ts)

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
                out, ended = self.retention.take(self.queries, qids, cursor)
                if out or ended:
                    return out, ended
                left = deadline - self._clock()
                if left <= 0:
                    return [], []
                self.cond.wait(left)

    def has_news(self, qids: list[str], cursor: dict[str, int]) -> bool:
        """Whether one of ``qids`` has a result after ``cursor`` or has ended (read without the lock:
        a stale answer only means one more look after the next notification)."""
        return has_news(self.queries, qids, cursor)

    def end_of(self, qid: str) -> tuple[str, str]:
        """(state, error) of a query, for the last message of its result stream."""
        with self.cond:
            info = self.queries[qid]
            return info.shown_state, info.error

    # -- status -------------------------------------------------------------------------------------
    def _turn_timings(self) -> dict[str, float]:
        """A trusted master's turns of this level, its own figures only (``turns_calls``, ``turns_waited_ms``,
        ``turns_overruns``, ``turns_overrun_ms``); none without turns."""
        if self.turn_stats is None:
            return {}
        st = self.turn_stats()
        if st.get("policy") not in ("fixed_slot", "revised_fixed_slot"):
            # under round robin and dynamic threshold a level's waits follow the higher levels' work (the open
            # timing channel of docs/scheduling.md): shown in a status field they would be a value a session reads
            return {}
        return {f"turns_{k}": float(st.get(k, 0)) for k in ("calls", "waited_ms", "overruns", "overrun_ms")}

    def status(self, user: str | None = None, cluster: bool = True) -> dict:
        """What a session may read: the level and ``user``'s own queries; with ``cluster`` (operators)
        also workers, loads, backlog, lag, timings, counters and refusals.  Nothing here depends
        on a row above the level: lag and latest instants come from kept rows, shepherd drops
        are not counted."""
        with self.cond:
            out = {"level": self.level,
                   "queries": [view(i) for i in self.queries.values() if user is not None and i.owner == user]}
            if self.shedder.seen:  # every session of the level: its own backlog decided it
                out["shedding"] = self.shedder.view()
            if not cluster:
                return out
            workers = [
                {"sid": e.sid, "cpu": e.cpu, "pid": e.pid, "state": e.state, "in_flight": len(e.in_flight), "done": e.done}
                for e in self.dispatcher.table.values()
            ]
            lag = 0.0
            if self.last_input_ts is not None:
                lag = float(self.last_input_ts - (self.last_output_ts if self.last_output_ts is not None else -1))
            d, log = self.dispatch, self.eventlog
            out.update({
                "workers": workers,
                "backlog_chunks": self.pipeline.backlog,
                "ready_chunks": len(d.ready),
                "lag_instants": max(0.0, lag),
                "rejected": dict(self.input_rejected)
                | {f"transport:{k}": v for k, v in self.refused.items()}
                | {f"multicast:{k}": v for k, v in (self.group_rejected() if self.group_rejected else {}).items()},
                "timings": self.timings.summary() | self._turn_timings(),
                "histograms": self.timings.histograms(),
                "switches": [sw.view(self.pipeline.chunker.closed_until)
                             for sw in self.pipeline.chunker.shields.switches.values()],
                "last_chunk_error": d.last_chunk_error,
                "counters": dict(self.pipeline.counters) | {"redispatched": d.redispatched,
                                                              "duplicates": self.pipeline.merger.duplicates,
                                                              "revocations": self.revocations,
                                                              "cancelled": self.cancelled,
                                                              "failed_chunks": d.failed_chunks,
                                                              "checkpoints": log.checkpoints,
                                                              "checkpoint_failures": log.checkpoint_failures,
                                                              "events_since_checkpoint": log.events,
                                                              "checkpoint_running": int(log.checkpoint_running),
                                                              "last_checkpoint_bytes":
                                                                  int(log.last_checkpoint.get("bytes", 0)),
                                                              "last_checkpoint_ms":
                                                                  int(1000 * log.last_checkpoint.get("seconds", 0)),
                                                              "queries": sum(i.revoked_after is None
                                                                             for i in self.queries.values()),
                                                              "punctuations": self.pipeline.chunker.shields.punctuations}
                | (self.shedder.counters() if self.shedder.seen else {}),
            })
            return out

    # -- the dispatch state's counters and knobs, read (and some set) on the core ---------------------
    chunk_deadline = property(lambda self: self.dispatch.chunk_deadline,
                              lambda self, v: setattr(self.dispatch, "chunk_deadline", v))
    max_unit_rows = property(lambda self: self.dispatch.max_unit_rows,
                             lambda self, v: setattr(self.dispatch, "max_unit_rows", int(v)))
    job_seconds = property(lambda self: self.dispatch.job_seconds)
    redispatched = property(lambda self: self.dispatch.redispatched)
    failed_chunks = property(lambda self: self.dispatch.failed_chunks)
    last_chunk_error = property(lambda self: self.dispatch.last_chunk_error)
    # tests look inside: the ready queue, units, attempts, the unit-size decision (replaceable),
    # what was logged since the last checkpoint
    _ready = property(lambda self: self.dispatch.ready)
    _units = property(lambda self: self.dispatch.units)
    _attempts = property(lambda self: self.dispatch.attempts)
    _unit_size = property(lambda self: self.dispatch.unit_size,
                          lambda self, fn: setattr(self.dispatch, "unit_size", fn))
    _logged_rows = property(lambda self: self.eventlog.rows)
    _logged_events = property(lambda self: self.eventlog.events)
