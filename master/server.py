"""The master process: gRPC front for clients, dispatch thread for workers.

Thin by design: :class:`MasterServicer` translates messages to
:class:`MasterCore` calls; :class:`Dispatcher thread <DispatchLoop>` moves
chunk bytes to workers and results back.  All decisions live in the core.

Many clients: the master serves its clients with ``grpc.aio`` (:class:`AioMaster` on an event
loop of its own, :class:`MasterServer`).  An open stream (Subscribe, Ingest, IngestStream) holds
no thread while it waits: a subscriber waits for the core's notifications on the event loop, a
slow reader waits on its own HTTP/2 flow control, and only the work of one call or one batch
(a status, a login, decoding and logging a batch, encoding a result) runs on a thread of a
bounded pool (ingest batches on a pool of their own).  Open streams are limited per session and
per user (``[limits] max_streams_per_session``, ``max_streams_per_user``): one more is refused
with RESOURCE_EXHAUSTED and counted (``too_many_streams``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.codec import decode_result, encode_chunk
from strata.groups import AUTH_HEADER, sign_request
from strata.mlscql import QueryError
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.users import AuthError
from strata.logs import RepeatLimiter
from strata.serving import MAX_MESSAGE, run_until_stopped
from strata.groups import execute_digest, execute_wire

from .core import MAX_INGEST_BYTES, MAX_INGEST_ROWS, MAX_PRODUCER_ID, BatchOutcome, MasterCore, NotYours, Refused, \
    ResultsGone
from .checkpoint import Checkpointer
from .pipeline import one_line
from .sessions import RoleError, Sessions, dominates

__all__ = ["MasterServicer", "AioMaster", "MasterServer", "StreamLimits", "DispatchLoop", "UsersWatch", "serve_master",
           "build_core", "client_tls", "MasterLoops", "warm_up",
           "MAX_INGEST_ROWS", "MAX_INGEST_BYTES", "DEFAULT_MAX_STREAMS_PER_SESSION", "DEFAULT_MAX_STREAMS_PER_USER"]

log = logging.getLogger("strata.master")
#: warnings of the loops (dispatch, results, heartbeats, the users file): once a minute each, with a count
limited = RepeatLimiter(log)

#: open Subscribe/Ingest/IngestStream streams per session and per user ([limits]; defaults)
DEFAULT_MAX_STREAMS_PER_SESSION = 8
DEFAULT_MAX_STREAMS_PER_USER = 64


class StreamLimits:
    """Open streams per session and per user: one more than allowed is refused (counted under
    ``too_many_streams``), so no one user can hold the master's streams."""

    def __init__(self, per_session: int = DEFAULT_MAX_STREAMS_PER_SESSION,
                 per_user: int = DEFAULT_MAX_STREAMS_PER_USER, count=None):
        self.per_session = int(per_session)
        self.per_user = int(per_user)
        self._count = count  # reason -> None: counts a refusal (the core's rejected counts)
        self._lock = threading.Lock()
        self.sessions: Counter = Counter()  # session token -> open streams
        self.users: Counter = Counter()

    @classmethod
    def of(cls, config, count=None) -> "StreamLimits":
        lim = getattr(config, "limits", None)
        return cls(getattr(lim, "max_streams_per_session", DEFAULT_MAX_STREAMS_PER_SESSION),
                   getattr(lim, "max_streams_per_user", DEFAULT_MAX_STREAMS_PER_USER), count)

    def open(self, session, call: str) -> str | None:
        """Take a stream slot for ``session``; None, or the one-line reason it is refused."""
        key, user = session.token, session.principal.user
        with self._lock:
            if self.sessions[key] >= self.per_session:
                why = (f"too many open streams: this session already has {self.sessions[key]} open (limit "
                       f"{self.per_session}, [limits] max_streams_per_session); {call} refused, close one first")
            elif self.users[user] >= self.per_user:
                why = (f"too many open streams: user {user} already has {self.users[user]} open across its "
                       f"sessions (limit {self.per_user}, [limits] max_streams_per_user); {call} refused")
            else:
                self.sessions[key] += 1
                self.users[user] += 1
                return None
        if self._count is not None:
            self._count("too_many_streams")
        return why

    def close(self, session) -> None:
        key, user = session.token, session.principal.user
        with self._lock:
            for c, k in ((self.sessions, key), (self.users, user)):
                c[k] -= 1
                if c[k] <= 0:
                    del c[k]

    def open_streams(self) -> int:
        with self._lock:
            return sum(self.sessions.values())


class MasterServicer(rpc.MasterServicer):
    """Thin: checks the session and its role, translates messages, calls :class:`MasterCore`.

    Every reply is computed by the core from what the master's level dominates;
    a call outside the session's roles is refused with PERMISSION_DENIED and
    counted (operators see ``role:<call>`` under ``rejected``)."""

    def __init__(self, core: MasterCore, sessions: Sessions, limits: StreamLimits | None = None):
        self.core = core
        self.sessions = sessions
        self.limits = limits if limits is not None else StreamLimits.of(core.config, core.count_rejected)
        #: a master with standbys (master/standby.py): waits until the attached standbys confirmed every
        #: write so far (bounded), called before a write is acknowledged; None: no standbys
        self.replicate = None
        self.extra_counters = None  # () -> dict: the replication's counters for operators

    def _replicated(self) -> None:
        if self.replicate is not None:
            self.replicate()

    def _open_stream(self, context, session, call: str) -> None:
        why = self.limits.open(session, call)
        if why is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    @staticmethod
    def _token(context) -> str | None:
        auth = dict(context.invocation_metadata()).get("authorization", "")
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def _session(self, context):
        try:
            return self.sessions.check(self._token(context))
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def _require(self, context, roles: tuple[str, ...], call: str, token=None, ended: bool = False):
        """The session if it has one of ``roles``; else abort (UNAUTHENTICATED / PERMISSION_DENIED).
        ``ended``: the session was valid when the call began (a stream): say it ended."""
        try:
            return self.sessions.require(token if token is not None else self._token(context), roles, call)
        except RoleError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"session ended: {e}" if ended else str(e))

    def Login(self, request, context):
        try:
            s = self.sessions.login(request.user, request.password, request.level, peer=context.peer())
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        self._replicated()  # the session is in the standby's copy before its token is given out
        return pb.LoginReply(token=s.token, level=s.principal.level, master_level=self.core.level,
                             roles=sorted(s.principal.roles))

    def Logout(self, request, context):
        md = dict(context.invocation_metadata())
        self.sessions.logout(md.get("authorization", "")[7:])
        self._replicated()
        return pb.Empty()

    def Register(self, request, context):
        """A client's query text never gets UNKNOWN: a refused query is INVALID_ARGUMENT with its one
        line (limits.py bounds the text, the nesting and the expressions before anything recursive
        runs); running out of stack anyway is refused the same way, anything else unexpected is
        INTERNAL with one line, logged here once with its traceback."""
        s = self._require(context, ("analyst",), "Register")
        try:
            infos = self.core.register(s.principal.user, list(request.queries))
        except QueryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))  # one line (QueryError)
        except RecursionError:
            log.warning("Register: a query of %s ran out of stack within the limits (refused)", s.principal.user)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit error: query too deeply nested to compile")
        except Exception as e:  # noqa: BLE001 - a bug or a failing disk: one line to the client, the log has the rest
            log.exception("Register failed for %s", s.principal.user)
            context.abort(grpc.StatusCode.INTERNAL,
                          one_line(f"master error while registering: {type(e).__name__}: {e}"))
        self._replicated()
        return pb.RegisterReply(queries=[
            pb.RegisteredQuery(query_id=i.query_id, rewritten=i.rewritten, r2s=i.r2s, columns=i.columns)
            for i in infos
        ])

    def _subscribe_start(self, request, context):
        """The checks before a result stream: session and role, the queries are the user's, the results
        to resume from are still kept.  Returns (session, query ids)."""
        s = self._require(context, ("analyst",), "Subscribe")
        mine = self.core.owned(s.principal.user)
        qids = list(dict.fromkeys(request.query_ids)) or mine
        for q in qids:
            if q not in mine:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"query {q} is not one of this user's queries")
        try:
            self.core.check_resume(qids, request.resume_after_ts)
        except ResultsGone as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, one_line(e))
        return s, qids

    @staticmethod
    def _result_message(r, after: int) -> pb.ResultBatch:
        rows = r.rows
        if after >= 0 and r.first_ts <= after:
            rows = rows.filter(pc.greater(rows.column("ts"), after))
        return pb.ResultBatch(query_id=r.query_id, first_ts=r.first_ts, last_ts=r.last_ts, arrow=to_ipc(rows))

    def Subscribe(self, request, context):
        token = self._token(context)
        s, qids = self._subscribe_start(request, context)
        self._open_stream(context, s, "Subscribe")
        try:
            yield from self._subscribe(request, context, token, qids)
        finally:
            self.limits.close(s)

    def _subscribe(self, request, context, token, qids):
        """The thread-per-stream loop (in-process callers; the master serves :class:`AioMaster`)."""
        cursor: dict[str, int] = {}
        after = request.resume_after_ts
        open_ids = list(qids)
        while open_ids and context.is_active():
            try:
                released, ended = self.core.wait_results(open_ids, cursor, timeout=0.5)
            except ResultsGone as e:  # a reader slower than the retention: told, never a silent gap
                context.abort(grpc.StatusCode.OUT_OF_RANGE, one_line(e))
            if not released and not ended:  # idle: a revoked session's stream still ends within a second
                self._require(context, ("analyst",), "Subscribe", token, ended=True)
            for r in released:
                if r.last_ts <= after:
                    continue
                # re-checked before every message: nothing is sent once the session or role is gone
                self._require(context, ("analyst",), "Subscribe", token, ended=True)
                yield self._result_message(r, after)
            for q in ended:
                state, error = self.core.end_of(q)
                self._require(context, ("analyst",), "Subscribe", token, ended=True)
                yield pb.ResultBatch(query_id=q, end=True, state=state, error=error)
                open_ids.remove(q)

    def _producer(self, s, batch) -> str | None:
        """The producer key of an exactly-once batch: the session's user and the client's id."""
        pid = batch.producer_id
        if not pid:
            return None
        if len(pid) > MAX_PRODUCER_ID or not pid.isprintable():
            self.core.count_rejected("bad_producer")
            raise ValueError(f"producer id: at most {MAX_PRODUCER_ID} printable characters")
        return f"{s.principal.user}/{pid}"

    def _ingest_one(self, context, token, batch) -> BatchOutcome:
        """One batch of an ingest stream: the session checked again, decoded, then logged and applied by
        the core (or acknowledged as a duplicate).  Raises ValueError (refused, nothing applied)."""
        # every batch: a revoked, logged-out or downgraded producer's open stream is cut here,
        # before anything of this batch is applied
        s = self._require(context, ("producer",), "Ingest", token, ended=True)
        table = None
        if batch.arrow or not batch.HasField("advance_upto"):
            try:
                table = from_ipc(batch.arrow, max_bytes=2 * MAX_INGEST_BYTES, max_rows=2 * MAX_INGEST_ROWS)
            except (ValueError, pa.ArrowInvalid) as e:
                self.core.count_rejected("bad_batch")
                raise ValueError(f"stream {batch.stream}: not an Arrow IPC stream: {e}") from None
        producer = self._producer(s, batch)
        source = None if batch.labelled else s.principal.level
        upto = batch.advance_upto if batch.HasField("advance_upto") else None  # after this batch's rows
        outcome = self.core.ingest_batch(batch.stream, table, source, advance_upto=upto, producer=producer,
                                         seq=int(batch.seq))
        self._replicated()  # acknowledged once the standbys stored it (a duplicate: once they have it)
        return outcome

    def Ingest(self, request_iterator, context):
        token = self._token(context)
        s = self._require(context, ("producer",), "Ingest", token)
        self._open_stream(context, s, "Ingest")
        try:
            reply = pb.IngestReply()
            for batch in request_iterator:
                if not _add_batch(reply, lambda: self._ingest_one(context, token, batch)):
                    break
            return reply
        finally:
            self.limits.close(s)

    def IngestStream(self, request_iterator, context):
        """Ingest acknowledged per batch (thread-per-stream form; the master serves :class:`AioMaster`)."""
        token = self._token(context)
        s = self._require(context, ("producer",), "Ingest", token)
        self._open_stream(context, s, "IngestStream")
        try:
            for n, batch in enumerate(request_iterator, 1):
                ack = _ack(batch, n, lambda: self._ingest_one(context, token, batch))
                yield ack
                if ack.error:
                    return
        finally:
            self.limits.close(s)

    def Advance(self, request, context):
        if request.finish:
            self._require(context, ("producer", "operator"), "Advance(finish)")
        else:
            self._require(context, ("producer",), "Advance")
        try:
            n = self.core.advance(request.upto_ts, finish=request.finish)
        except Refused as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        self._replicated()
        return pb.AdvanceReply(chunks=n)

    def Cancel(self, request, context):
        s = self._require(context, ("analyst",), "Cancel")
        try:
            views = self.core.cancel(s.principal.user, list(request.query_ids))
        except NotYours as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e.args[0]))
        self._replicated()
        return pb.CancelReply(queries=[pb.QueryStatus(**v) for v in views])

    def AddStream(self, request, context):
        self._require(context, ("operator",), "AddStream")
        try:
            view, created = self.core.add_stream(request.name, [(a.name, a.type) for a in request.attributes])
        except Refused as e:
            self.core.count_rejected(e.reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._replicated()
        return _stream_info(view, added=True, created=created)

    def Streams(self, request, context):
        self._session(context)
        return pb.StreamsReply(streams=[_stream_info(v, v["added"]) for v in self.core.streams()])

    def Status(self, request, context):
        s = self._session(context)
        operator = "operator" in s.principal.roles
        st = self.core.status(s.principal.user, cluster=operator)
        reply = pb.StatusReply(level=st["level"], user=s.principal.user, roles=sorted(s.principal.roles),
                               queries=[pb.QueryStatus(**v) for v in st["queries"]], cluster=operator)
        if not operator:
            return reply
        reply.workers.extend(pb.WorkerStatus(sid=w["sid"], cpu=w["cpu"], pid=w.get("pid", 0), state=w["state"],
                                             chunks_done=w["done"], in_flight=w["in_flight"]) for w in st["workers"])
        reply.backlog_chunks = st["backlog_chunks"]
        reply.ready_chunks = st["ready_chunks"]
        reply.lag_seconds = st["lag_instants"]
        rejected = {k: int(v) for k, v in st["rejected"].items()}
        with self.sessions._lock:
            denied = dict(self.sessions.denied)
        rejected.update({f"role:{k}": int(v) for k, v in denied.items()})
        reply.rejected.update(rejected)
        reply.counters.update({k: int(v) for k, v in st["counters"].items()}
                              | {"failed_logins": self.sessions.failed_logins, "logouts": self.sessions.logouts,
                                 "permission_denied": int(sum(denied.values()))})
        if self.extra_counters is not None:
            reply.counters.update({k: int(v) for k, v in self.extra_counters().items()})
        reply.timings.update(st.get("timings", {}))
        reply.last_chunk_error = st.get("last_chunk_error", "")
        return reply


def _add_batch(reply: pb.IngestReply, apply) -> bool:
    """Add one batch's outcome (``apply()``) to an Ingest reply; False (error set) if it was refused."""
    try:
        o = apply()
    except (ValueError, pa.ArrowInvalid) as e:
        reply.rejected += 1
        reply.error = one_line(e)
        return False
    reply.accepted += o.accepted
    reply.dropped_by_shepherd += o.dropped  # rows of this producer's own batches: told to it, nobody else
    reply.chunks += o.chunks
    return True


def _ack(batch, n: int, apply) -> pb.IngestAck:
    """The acknowledgement of one batch (the ``n``-th of its stream): its outcome, or its refusal."""
    seq = int(batch.seq) if batch.producer_id else n
    try:
        o = apply()
    except (ValueError, pa.ArrowInvalid) as e:
        return pb.IngestAck(seq=seq, error=one_line(e))
    return pb.IngestAck(seq=seq, accepted=o.accepted, dropped_by_shepherd=o.dropped, duplicate=o.duplicate,
                        chunks=o.chunks)


# ---- the master's client front on grpc.aio --------------------------------------------------------------
class _Abort(Exception):
    def __init__(self, code, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class _CallContext:
    """What :class:`MasterServicer`'s methods ask of a context, for an aio call whose work runs on a
    pool thread: metadata and peer (read on the event loop), ``abort`` raising :class:`_Abort` (the
    event loop then aborts the call)."""

    def __init__(self, context):
        self._md = tuple((m[0], m[1]) for m in (context.invocation_metadata() or ()))
        self._peer = context.peer()

    def invocation_metadata(self):
        return self._md

    def peer(self):
        return self._peer

    def abort(self, code, details):
        raise _Abort(code, details)

    def is_active(self) -> bool:
        return True


class _News:
    """Wakes result streams waiting on the event loop when the core notifies (a result released, a
    query ended, …).  ``notify`` is called from any thread with the core's lock held: it only schedules
    one wake-up on the loop (coalesced); each waiter then checks its own queries without the lock."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending = False
        self._waiters: set[asyncio.Future] = set()

    def notify(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (shutting down)
            pass

    def _wake(self) -> None:
        self._pending = False
        for f in self._waiters:
            if not f.done():
                f.set_result(None)

    async def wait_for(self, predicate, timeout: float) -> bool:
        """Until ``predicate()`` (checked on every notification) or ``timeout`` s; its last value."""
        deadline = self.loop.time() + timeout
        while not predicate():
            left = deadline - self.loop.time()
            if left <= 0:
                return False
            f = self.loop.create_future()
            self._waiters.add(f)
            try:
                await asyncio.wait_for(f, left)
            except asyncio.TimeoutError:
                return bool(predicate())
            finally:
                self._waiters.discard(f)
        return True


class _NotifyingCondition(threading.Condition):
    """The core's condition, also telling the event loop (:class:`_News`) on every ``notify_all``."""

    def __init__(self, hook):
        super().__init__()
        self._hook = hook

    def notify_all(self) -> None:
        super().notify_all()
        self._hook()


class AioMaster(rpc.MasterServicer):
    """The master's client front on ``grpc.aio``: :class:`MasterServicer`'s calls, with no thread held
    by an open stream.

    Unary calls run the servicer's method on the ``calls`` pool; a result stream waits for the core's
    notifications on the event loop (:class:`_News`) and uses a pool thread only to take new results
    and encode a message; an ingest stream uses an ``ingest`` pool thread per batch.  A slow reader
    waits on its own flow control: results stay in the core (bounded by ``result_retention_rows``),
    the dispatch thread never waits for a subscriber.  Must be built on the event loop it serves on;
    from then on the core notifies that loop."""

    def __init__(self, servicer: MasterServicer | None, peer_check=None, call_threads: int = 16,
                 ingest_threads: int = 8, replication=None):
        """``servicer`` None: a master with standbys that is not active yet (``replication`` refuses the
        client calls until :meth:`install` gives it one).  ``replication`` (master/standby.py
        :class:`~strata.master.standby.Node`): the master-to-master calls (Follow, Probe) and the gate
        of client calls (a standby refuses them); None: a master without standbys, as before."""
        self.peer_check = peer_check
        self.replication = replication
        self.loop = asyncio.get_running_loop()
        self.calls = ThreadPoolExecutor(call_threads, thread_name_prefix="master-call")
        self.ingest = ThreadPoolExecutor(ingest_threads, thread_name_prefix="master-ingest")
        self.news = _News(self.loop)
        self.sync = self.core = self.limits = None
        if servicer is not None:
            self.install(servicer)

    def install(self, servicer: MasterServicer) -> None:
        """Serve ``servicer``'s core from now on (at start, or when a standby takes over: before its
        dispatch thread starts, nobody waits on the core's condition yet)."""
        with servicer.core.cond:
            servicer.core.cond = _NotifyingCondition(self.news.notify)
        self.sync, self.core, self.limits = servicer, servicer.core, servicer.limits

    def shutdown(self) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.ingest.shutdown(wait=False, cancel_futures=True)

    # -- plumbing --------------------------------------------------------------------------------
    async def _enter(self, context) -> _CallContext:
        """The transport check (client certificate of this level) and the call's context for a thread;
        a master that is not active (a standby) refuses here."""
        if self.peer_check is not None:
            refusal = _peer_refusal(self.peer_check, context)
            if refusal is not None:
                await context.abort(*refusal)
        if self.replication is not None:
            refusal = self.replication.gate()
            if refusal is not None:
                await context.abort(*refusal)
        return _CallContext(context)

    async def _enter_master(self, context, kind: str, digest: bytes):
        """A master-to-master call: a master certificate of this level (with TLS) and a request signed
        with the level's group key; refused (counted) otherwise."""
        rep = self.replication
        if rep is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master has no standbys (strata master --peers)")
        if rep.peer_check is not None:
            refusal = _peer_refusal(rep.peer_check, context)
            if refusal is not None:
                await context.abort(*refusal)
        header = dict(context.invocation_metadata() or ()).get(AUTH_HEADER)
        if not rep.verify(kind, digest, header):
            rep.refused["unsigned_" + kind] = rep.refused.get("unsigned_" + kind, 0) + 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "request not signed with this level's group key")

    # -- master to master (standbys) ------------------------------------------------------------
    async def Probe(self, request, context):
        await self._enter_master(context, "probe", request.SerializeToString())
        return await self.loop.run_in_executor(self.calls, self.replication.probe, request)  # reads the store

    async def Follow(self, request_iterator, context):
        await self._enter_master(context, "follow", b"")
        async for record in self.replication.follow(request_iterator, context):
            yield record

    async def _run(self, pool, context, fn, *args):
        """``fn(*args)`` on a pool thread; an abort it asks for aborts the call."""
        try:
            return await self.loop.run_in_executor(pool, functools.partial(fn, *args))
        except _Abort as a:
            await context.abort(a.code, a.details)

    async def _unary(self, name: str, request, context):
        """A unary call on the ``calls`` pool.  An exception the servicer did not turn into a status
        would reach the client as UNKNOWN with a multi-line ``Unexpected <class …>`` text: it is
        logged here once and the call ends INTERNAL with one line."""
        ctx = await self._enter(context)
        try:
            return await self._run(self.calls, context, getattr(self.sync, name), request, ctx)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - never UNKNOWN, never a traceback to a client
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, one_line(f"master error in {name}: {type(e).__name__}: {e}"))

    async def _check(self, context, ctx, roles: tuple[str, ...], call: str, token, ended: bool = True):
        """The session's check on the event loop (in memory): abort the stream if it is gone."""
        try:
            return self.sync._require(ctx, roles, call, token, ended=ended)
        except _Abort as a:
            await context.abort(a.code, a.details)

    async def _open(self, context, session, call: str) -> None:
        why = self.limits.open(session, call)
        if why is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    # -- unary calls -------------------------------------------------------------------------------
    async def Login(self, request, context):
        return await self._unary("Login", request, context)

    async def Logout(self, request, context):
        return await self._unary("Logout", request, context)

    async def Register(self, request, context):
        return await self._unary("Register", request, context)

    async def Advance(self, request, context):
        return await self._unary("Advance", request, context)

    async def Cancel(self, request, context):
        return await self._unary("Cancel", request, context)

    async def Status(self, request, context):
        return await self._unary("Status", request, context)

    async def AddStream(self, request, context):
        return await self._unary("AddStream", request, context)

    async def Streams(self, request, context):
        return await self._unary("Streams", request, context)

    # -- streams -----------------------------------------------------------------------------------
    def _news_for(self, qids: list[str], cursor: dict[str, int]) -> bool:
        """Whether one of ``qids`` has a result after ``cursor`` or has ended (read without the lock:
        a stale answer only means one more look after the next notification)."""
        queries = self.core.queries
        for q in qids:
            info = queries.get(q)
            if info is None or info.ended or getattr(info, "base", 0) + len(info.results) != cursor.get(q, 0):
                return True
        return False

    async def Subscribe(self, request, context):
        ctx = await self._enter(context)
        token = self.sync._token(ctx)
        s, qids = await self._run(self.calls, context, self.sync._subscribe_start, request, ctx)
        await self._open(context, s, "Subscribe")
        try:
            cursor: dict[str, int] = {}
            after = request.resume_after_ts
            open_ids = list(qids)
            while open_ids:
                try:
                    released, ended = await self._run(self.calls, context, self.core.wait_results, open_ids, cursor, 0.0)
                except ResultsGone as e:  # a reader slower than the retention: told, never a silent gap
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE, one_line(e))
                if not released and not ended:
                    if not await self.news.wait_for(lambda: self._news_for(open_ids, cursor), 0.5):
                        # idle: a revoked session's stream still ends within a second
                        await self._check(context, ctx, ("analyst",), "Subscribe", token)
                    continue
                for r in released:
                    if r.last_ts <= after:
                        continue
                    msg = await self._run(self.calls, context, self.sync._result_message, r, after)
                    # re-checked before every message: nothing is sent once the session or role is gone
                    await self._check(context, ctx, ("analyst",), "Subscribe", token)
                    yield msg  # a slow reader waits here, on its own stream's flow control
                for q in ended:
                    state, error = self.core.end_of(q)
                    await self._check(context, ctx, ("analyst",), "Subscribe", token)
                    yield pb.ResultBatch(query_id=q, end=True, state=state, error=error)
                    open_ids.remove(q)
        finally:
            self.limits.close(s)

    async def _ingest_start(self, context, call: str):
        ctx = await self._enter(context)
        token = self.sync._token(ctx)
        s = await self._check(context, ctx, ("producer",), "Ingest", token, ended=False)
        await self._open(context, s, call)
        return ctx, token, s

    #: how often a producer held back by a full backlog looks again (:meth:`_backlog_wait`)
    BACKLOG_POLL_SECONDS = 0.02

    async def _backlog_wait(self, context, batch) -> None:
        """Hold a batch with rows while the master's backlog is full (``[limits] max_backlog_rows``):
        its producer's stream is not read meanwhile, so gRPC flow control blocks the producer's
        sends and the input waits there instead of in the master's memory.  Only this stream waits
        (other calls, other producers' advances and every subscriber are served); the backlog holds
        only rows of this master's level or below, the only level whose sessions it serves."""
        if not batch.arrow or not self.core.backlog_full():
            return
        while self.core.backlog_full() and not context.done():
            await asyncio.sleep(self.BACKLOG_POLL_SECONDS)

    async def Ingest(self, request_iterator, context):
        ctx, token, s = await self._ingest_start(context, "Ingest")
        try:
            reply = pb.IngestReply()
            async for batch in request_iterator:
                await self._backlog_wait(context, batch)
                ok = await self._run(self.ingest, context, _add_batch, reply,
                                     functools.partial(self.sync._ingest_one, ctx, token, batch))
                if not ok:
                    break
            return reply
        finally:
            self.limits.close(s)

    async def IngestStream(self, request_iterator, context):
        ctx, token, s = await self._ingest_start(context, "IngestStream")
        try:
            n = 0
            async for batch in request_iterator:
                n += 1
                await self._backlog_wait(context, batch)
                ack = await self._run(self.ingest, context, _ack, batch, n,
                                      functools.partial(self.sync._ingest_one, ctx, token, batch))
                yield ack
                if ack.error:
                    return
        finally:
            self.limits.close(s)


def _peer_refusal(peer_check, context):
    """(code, message) if :class:`strata.tls.PeerCheck` refuses this call's client certificate (counted
    there), else None."""

    class Probe:
        auth_context = staticmethod(context.auth_context)

        @staticmethod
        def abort(code, message):
            raise _Abort(code, message)

    try:
        peer_check._check(Probe())
    except _Abort as a:
        return a.code, a.details
    return None


class MasterServer:
    """The master's gRPC server on ``grpc.aio``, on an event loop in a thread of its own (the rest of
    the master is threads: the core, the dispatch loop, the users watch)."""

    def __init__(self, servicer: MasterServicer | None, listen: str, credentials=None, peer_check=None,
                 max_receive: int = 2 * MAX_INGEST_BYTES, call_threads: int = 16, ingest_threads: int = 8,
                 replication=None):
        self.servicer = servicer
        self.replication = replication
        self.listen = listen
        self.credentials = credentials
        self.peer_check = peer_check
        self.max_receive = max_receive
        self.threads = (call_threads, ingest_threads)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="master-grpc-aio", daemon=True)
        self._thread.start()
        self.server = None
        self.front: AioMaster | None = None
        try:
            self.address = self._on_loop(self._bind())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    def _on_loop(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _bind(self) -> str:
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.max_receive),
                                               ("grpc.max_send_message_length", MAX_MESSAGE),
                                               ("grpc.so_reuseport", 0)])
        self.front = AioMaster(self.servicer, self.peer_check, *self.threads, replication=self.replication)
        rpc.add_MasterServicer_to_server(self.front, self.server)
        host = self.listen.rsplit(":", 1)[0]
        port = (self.server.add_secure_port(self.listen, self.credentials) if self.credentials is not None
                else self.server.add_insecure_port(self.listen))
        if port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        return f"{host}:{port}"

    def start(self) -> "MasterServer":
        self._on_loop(self.server.start())
        return self

    def stop(self, grace: float = 2.0) -> None:
        try:
            self._on_loop(self.server.stop(grace), timeout=grace + 10)
        finally:
            if self.front is not None:
                self.front.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


def _stream_info(view: dict, added: bool, created: bool = False) -> "pb.StreamInfo":
    return pb.StreamInfo(name=view["name"], attributes=[pb.Attribute(name=c, type=t) for c, t in view["columns"]],
                         added=added, created=created)


class DispatchLoop:
    """Sends ready chunks to workers (async gRPC) and feeds results back to the core."""

    def __init__(self, core: MasterCore, key: bytes, member, rpc_deadline: float = 30.0, tls_dir=None,
                 epoch: int = 0, on_fenced=None):
        """``epoch``: this master's epoch (a master with standbys; 0: none), signed into every Execute;
        ``on_fenced(detail)``: a worker refused it for a newer master's epoch (the master steps down)."""
        self.core = core
        self.key = key
        self.member = member
        self.rpc_deadline = rpc_deadline
        self.tls_dir = tls_dir
        self.epoch = int(epoch)
        self.on_fenced = on_fenced
        self._executes: dict[str, object] = {}  # worker -> its Execute (serialized requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dispatch", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        with self.core.cond:
            self.core.cond.notify_all()
        self._thread.join(timeout=5)

    def _execute(self, sid: str):
        """The worker's Execute taking an already serialized request (:func:`execute_wire`): a unit's
        tens of MB are copied once, not into a message, its serialization and out for the digest."""
        if sid not in self._executes:
            opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
            if self.tls_dir is not None:  # the worker must prove it is a worker of this level
                from strata.tls import secure_channel

                ch = secure_channel(sid, self.tls_dir, "master", self.core.level, "worker", opts)
            else:
                ch = grpc.insecure_channel(sid, opts)
            self._executes[sid] = ch.unary_unary("/strata.rpc.Worker/Execute",
                                                 response_deserializer=pb.ExecuteReply.FromString)
        return self._executes[sid]

    def _sync_group(self) -> None:
        """Feed Algorithm 5 the heartbeats of the workers listed by the group member.

        The master's member lists an address only for the identity key that an Info call
        at that address returned (strata/groups/membership.py): the probes run in the background
        (:class:`~strata.groups.membership.AddressProver`), so this never blocks, and a worker
        gets no chunk before its address is proven.  A heartbeat the dispatcher refuses
        is skipped; the loop goes on."""
        prover = self.__dict__.get("_prover")
        if prover is None and hasattr(self.member, "claimed"):
            from strata.groups.membership import AddressProver, info_probe

            def channel(sid: str):  # one short-lived channel per probe, as this level's master
                if self.tls_dir is not None:
                    from strata.tls import secure_channel

                    return secure_channel(sid, self.tls_dir, "master", self.core.level, "worker", [])
                return grpc.insecure_channel(sid)

            prover = self._prover = AddressProver(self.member, info_probe(channel, self.key, self.core.level))
        if prover is not None:
            prover.step()
        for sid, hb in self.member.snapshot().items():
            try:
                self.core.heartbeat(sid, hb.cpu, hb.state, hb.pid, slots=hb.slots, seq=hb.seq)
            except (TypeError, ValueError) as e:
                limited.warning("heartbeat", "heartbeat of %s not used: %s", sid, one_line(e))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sent = self._step()
            except Exception:  # noqa: BLE001 - the dispatch thread never dies: log, wait a little, go on
                limited.exception("dispatch", "dispatch step failed; continuing")
                sent = []
            if not sent:
                with self.core.cond:
                    self.core.cond.wait(0.05)

    def _step(self) -> list:
        self._sync_group()
        self.core.expire()
        sent = self.core.assignments()
        for chunk, sid in sent:
            try:
                self._send(chunk, sid)
            except Exception as e:  # noqa: BLE001 - e.g. encoding failed: one failed attempt of this chunk
                limited.exception("send", "chunk %s could not be sent to %s", chunk.chunk_id, sid)
                self.core.on_failure(chunk.chunk_id, sid, reason=f"not sent: {e}", kind="SEND")
        return sent

    def _wire(self, chunk):
        """What travels: the chunk without new tuples no ROWS window can hold (chunking/prune.py).

        The full chunk stays in the core for re-dispatch; any failure sends it unpruned."""
        from strata.chunking.prune import prune_chunk

        try:
            return prune_chunk(chunk, dict(getattr(self.core.pipeline, "queries", {}) or {}))
        except Exception as e:  # noqa: BLE001 - pruning is an optimization only
            limited.warning("prune", "chunk %s sent unpruned: %s", chunk.chunk_id, e)
            return chunk

    def _send(self, chunk, sid: str) -> None:
        specs = [pb.QuerySpec(query_id=qc.query_id, text=self.core.queries[qc.query_id].text, level=self.core.level)
                 for qc in chunk.queries if qc.query_id in self.core.queries]
        head = pb.ExecuteRequest(level=self.core.level, queries=specs, epoch=self.epoch)
        body = encode_chunk(self._wire(chunk))
        md = ((AUTH_HEADER, sign_request(self.key, self.core.level, execute_digest(head, body))),)
        # a merged unit computes several chunks: it gets more time before it counts as failed
        timeout = self.rpc_deadline * self.core.deadline_factor(chunk.chunk_id)
        fut = self._execute(sid).future(execute_wire(head, body), timeout=timeout, metadata=md)
        cid = chunk.chunk_id
        span = (chunk.first_ts, chunk.last_ts)  # which cut chunks this unit covers, whatever happens meanwhile

        def done(f):
            try:
                try:
                    reply = f.result()
                except grpc.RpcError as e:
                    code = e.code()
                    if code == grpc.StatusCode.FAILED_PRECONDITION and self.on_fenced is not None and \
                            (e.details() or "").startswith("fenced"):
                        self.on_fenced(f"worker {sid}: {e.details()}")  # a newer master drives the workers
                        return
                    limited.warning("chunk-failed", "chunk %s on %s failed: %s %s", cid, sid, code, e.details())
                    # a lost worker is dropped (its chunks go elsewhere, not counted against them);
                    # an error reply or an overrun deadline is one failed attempt of the chunk
                    self.core.on_failure(cid, sid, drop_worker=code in (grpc.StatusCode.UNAVAILABLE,),
                                         reason=str(e.details() or ""), kind=getattr(code, "name", str(code)))
                    return
                try:
                    results = [decode_result(b) for b in reply.results]
                    self.core.on_result(cid, sid, results, span=span)
                except Exception as e:  # noqa: BLE001 - an undecodable or inconsistent reply
                    limited.warning("bad-reply", "chunk %s on %s: bad reply: %s", cid, sid, e)
                    self.core.on_failure(cid, sid, reason=f"bad reply: {e}", kind="BAD_REPLY")
            except Exception:  # noqa: BLE001 - never lose a callback silently
                limited.exception("result", "chunk %s on %s: result handling failed", cid, sid)

        fut.add_done_callback(done)


class UsersWatch:
    """Applies changes of the users file while the master runs (privacy switches).

    Every ``interval`` it re-reads the file if it changed; a user who was
    removed, or whose clearance no longer dominates this master's level (or is
    missing or unknown: a bad entry means no access), loses their sessions and
    their queries stop from the next instant (:meth:`MasterCore.revoke_user`).
    Role changes (``strata users set-roles``) apply to open sessions at their
    next call or message.  ``strata users remove``, ``set-clearance``,
    ``set-roles`` and ``logout`` are the administrator's switches.  The thread
    never dies: an error is logged and the next check runs as usual.
    """

    def __init__(self, core: MasterCore, sessions: Sessions, users, interval: float = 0.5):
        self.core = core
        self.sessions = sessions
        self.users = users
        self.interval = interval
        self._stamp = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="users-watch", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> list[str]:
        """Revoke whoever lost access since the last check and apply role changes; returns the
        users revoked."""
        try:
            st = self.users.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return []
        try:
            known = self.users.load()
        except Exception as e:  # noqa: BLE001 - a half-edited file must not revoke everyone
            limited.warning("users-file", "users file unreadable, keeping current access: %s", one_line(e))
            self._stamp = stamp
            return []
        self._stamp = stamp
        lat = self.users.lattice
        gone = []
        for user in sorted(self.sessions.users()):
            u = known.get(user)
            if u is not None and u.sessions_after:  # strata users logout / a replaced password
                n = self.sessions.end_before(user, u.sessions_after)
                if n:
                    log.warning("ended %d session(s) of %s opened before %s", n, user, u.sessions_after)
        for user in sorted(self.core.owners() | self.sessions.users()):
            u = known.get(user)
            if u is None or not dominates(lat, self.core.level, getattr(u, "clearance", None)):
                why = "removed" if u is None else (f"clearance {u.clearance}" if u.clearance is not None
                                                   else "bad users-file entry")
                self.sessions.end_user(user)  # first: a subscriber stops before its queries end
                qids = self.core.revoke_user(user, why)
                log.warning("revoked %s (%s): queries %s stop after instant %s", user, why, qids,
                            self.core.pipeline.chunker.closed_until - 1)
                gone.append(user)
            else:
                n = self.sessions.set_roles(user, getattr(u, "roles", ()))
                if n:
                    log.warning("roles of %s now %s (%d open session(s))", user,
                                ", ".join(sorted(getattr(u, "roles", ()))), n)
        return gone

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - revocation must keep working: log, check again later
                limited.exception("users", "users-file check failed; will check again")
                self._stamp = None


def warm_up(config, level: str) -> None:
    """Do once, before the master says it is ready, what the first login, registration, batch and
    chunk would otherwise pay for: pyarrow's lazy pandas import, the certificate parser, building
    the MLS-CQL parser, the chunker, merging, pruning and encoding.  Never fatal."""
    try:
        import pandas  # noqa: F401 - pyarrow imports it on the first array built from Python objects
        from cryptography import x509  # noqa: F401 - the first TLS peer check's (tls.read_identity): ~0.2 s
        from cryptography.x509.oid import NameOID  # noqa: F401

        from strata.chunking.chunker import merge_chunks
        from strata.chunking.codec import encode_chunk
        from strata.chunking.prune import prune_chunk

        from .pipeline import QueryPipeline

        stream = next(iter(config.streams.values()), None)
        if stream is None:
            return
        p = QueryPipeline(config, level)
        p.add_query(f"SELECT COUNT(*) FROM {stream.name} [ROWS 1]")
        row = {"ts": 0, "level": p.level, **{c: None for c, _ in stream.columns}}
        p.ingest(stream.name, pa.Table.from_pylist([row, {**row, "ts": 1}]))
        chunks = p.finish()
        encode_chunk(prune_chunk(merge_chunks(chunks), p.queries))
    except Exception as e:  # noqa: BLE001 - the first user just pays the cost
        log.warning("master warm-up failed: %s", e)


def build_core(config, level: str, store, users, chunk_instants: int = 1, owner: str | None = None):
    """A master's core and sessions over ``store`` (None: in memory), restored from it: (core, sessions,
    what was restored)."""
    cluster = (getattr(config, "sections", None) or {}).get("cluster") or {}
    # [cluster] dispatch_linger = false: send ready chunks at once even while input floods in
    core = MasterCore(config, level, chunk_instants=chunk_instants, store=store,
                      linger=bool(cluster.get("dispatch_linger", True)))
    sessions = Sessions(users, core.level, persist=store, owner=owner)
    restored = {}
    if store is not None:
        restored = core.restore()
        restored["sessions"] = sessions.restore()
    return core, sessions, restored


def client_tls(tls_dir, level: str, refused):
    """(server credentials, the check of clients' certificates) of a master of ``level``; (None, None)
    without TLS."""
    if tls_dir is None:
        return None, None
    from strata.tls import PeerCheck, server_credentials

    return server_credentials(tls_dir, "master", level), PeerCheck(level, ("client",), refused=refused)


class MasterLoops:
    """A serving master's threads besides its gRPC server: the group member (heartbeats), the dispatch
    loop, the checkpointer (with a store) and the users-file watch (checked once here: users removed
    while the master was down lose their restored sessions and queries)."""

    def __init__(self, core: MasterCore, sessions: Sessions, users, spec, address: str, tls_dir=None,
                 store=None, epoch: int = 0, on_fenced=None):
        from strata.groups.membership import GroupMember

        self.member = GroupMember(spec, sid=address, role="master")
        self.member.state = "master"
        core.group_rejected = lambda: self.member.rejected
        self.dispatch = DispatchLoop(core, spec.key, self.member, tls_dir=tls_dir, epoch=epoch, on_fenced=on_fenced)
        self.checkpoints = Checkpointer(core) if store is not None else None
        self.watch = UsersWatch(core, sessions, users)
        self.watch.check()

    def start(self) -> "MasterLoops":
        self.member.start()
        self.dispatch.start()
        self.watch.start()
        if self.checkpoints is not None:
            self.checkpoints.start()
        return self

    def stop(self) -> None:
        self.watch.stop()
        if self.checkpoints is not None:
            self.checkpoints.stop()
        self.dispatch.stop()
        self.member.stop()


def serve_master(config, level: str, listen: str, spec, users, chunk_instants: int = 1,
                 ready=None, stop_event: threading.Event | None = None, tls_dir=None, state_path=None,
                 owner: str | None = None) -> None:
    """Run a master until SIGTERM/SIGINT (or ``stop_event``).

    ``owner``: a user who has every role on this master (the private master of an
    embedded run a user starts for themself); everyone else has the users file's roles.

    With ``tls_dir``: clients must present a ``client`` certificate of this
    level, and workers a ``worker`` certificate of this level.  With
    ``state_path`` (a SQLite file) queries, sessions and accepted input
    survive a restart: the master replays them before it serves.  (A master with standbys:
    :func:`strata.master.standby.serve_replicated`.)
    """
    from .store import MasterStore, config_fingerprint

    lv = config.lattice.parse(level)
    warm_up(config, lv)
    store = MasterStore(state_path, lv, config_fingerprint(config)) if state_path else None
    core, sessions, restored = build_core(config, level, store, users, chunk_instants, owner)
    if any(restored.values()):
        log.warning("restored from %s: %s", state_path, restored)
    servicer = MasterServicer(core, sessions)
    creds, peer_check = client_tls(tls_dir, core.level, core.refused)
    # grpc.aio: open streams hold no thread; call work runs on bounded pools (AioMaster)
    server = MasterServer(servicer, listen, credentials=creds, peer_check=peer_check)
    address = server.address
    loops = MasterLoops(core, sessions, users, spec, address, tls_dir, store)
    server.start()
    loops.start()
    log.info("master %s level %s serving", address, level)

    def cleanup():
        loops.stop()
        server.stop(grace=2)
        if store is not None:
            store.close()

    run_until_stopped(stop_event, ready and (lambda: ready(address, core, loops.member)), cleanup)
