"""The master's client front on ``grpc.aio``: no thread held by an open stream.

:class:`MasterServer` runs a ``grpc.aio`` server on an event loop in a thread of its own (the rest
of the master is threads: the core, the dispatch loop, the users watch).  Its servicer
:class:`AioMaster` runs :class:`~strata.master.server.MasterServicer`'s logic: a unary call on a
thread of the ``calls`` pool; a result stream waits for the core's changes on the event loop (an
:class:`~strata.master.notify.AsyncNotifier` attached to ``core.changes``) and uses a pool thread
only to take new results and encode a message; an ingest stream uses a thread of the ``ingest``
pool per batch.  A slow reader waits on its own HTTP/2 flow control: results stay in the core
(bounded by ``result_retention_rows``), the dispatch thread never waits for a subscriber.

Open streams are limited per session and per user (``[limits] max_streams_per_session``,
``max_streams_per_user``; :class:`~strata.master.sessions.StreamLimits`): one more is refused with
RESOURCE_EXHAUSTED and counted (``too_many_streams``).  A master with standbys also answers the
master-to-master calls here (Probe, Follow) and refuses client calls while it is not the active
one (:class:`~strata.master.standby.Node`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from strata.errors import one_line
from strata.groups import AUTH_HEADER
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import MAX_MESSAGE, add_port

from .admission import MAX_INGEST_BYTES
from .notify import AsyncNotifier
from .queries import ResultsGone

if TYPE_CHECKING:
    from .server import MasterServicer

__all__ = ["AioMaster", "MasterServer"]

log = logging.getLogger("strata.master")


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


class AioMaster(rpc.MasterServicer):
    """The master's client front on ``grpc.aio``: :class:`MasterServicer`'s calls, with no thread held
    by an open stream.

    Unary calls run the servicer's method on the ``calls`` pool; a result stream waits for the core's
    changes on the event loop (:attr:`news`, attached to ``core.changes``) and uses a pool thread only
    to take new results and encode a message; an ingest stream uses an ``ingest`` pool thread per
    batch.  A slow reader waits on its own flow control: results stay in the core (bounded by
    ``result_retention_rows``), the dispatch thread never waits for a subscriber.  Must be built on
    the event loop it serves on; the core it serves notifies that loop."""

    def __init__(self, servicer: MasterServicer | None, peer_check=None, call_threads: int = 16,
                 ingest_threads: int = 8, replication=None, turn=None):
        """``servicer`` None: a master with standbys that is not active yet (``replication`` refuses the
        client calls until :meth:`install` gives it one).  ``replication`` (master/standby.py
        :class:`~strata.master.standby.Node`): the master-to-master calls (Follow, Probe) and the gate
        of client calls (a standby refuses them); None: a master without standbys, as before.
        ``turn(kind)``: a context manager every pool call of this front waits in (a trusted master's turns
        of its level, strata/turns.py: the level's calls, batches and result messages run in its slots)."""
        self.peer_check = peer_check
        self.turn = turn
        self.replication = replication
        self.loop = asyncio.get_running_loop()
        self.calls = ThreadPoolExecutor(call_threads, thread_name_prefix="master-call")
        self.ingest = ThreadPoolExecutor(ingest_threads, thread_name_prefix="master-ingest")
        self.news = AsyncNotifier(self.loop)  # attached to the core it serves (install)
        self.sync = self.core = self.limits = None
        if servicer is not None:
            self.install(servicer)

    def install(self, servicer: MasterServicer) -> None:
        """Serve ``servicer``'s core from now on (at start, or when a standby takes over): its changes
        wake this loop's result streams from now on."""
        if self.core is not None:
            self.core.changes.detach(self.news)
        servicer.core.changes.attach(self.news)
        self.sync, self.core, self.limits = servicer, servicer.core, servicer.limits

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.changes.detach(self.news)
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.ingest.shutdown(wait=False, cancel_futures=True)

    # -- plumbing --------------------------------------------------------------------------------
    async def _enter(self, context) -> _CallContext:
        """The transport check (client certificate of this level) and the call's context for a thread;
        a master that is not active (a standby) refuses here."""
        if self.peer_check is not None:
            refusal = self.peer_check.refusal(context)
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
            refusal = rep.peer_check.refusal(context)
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

    async def _run(self, pool, context, fn, *args, turn: str | None = "call"):
        """``fn(*args)`` on a pool thread (with turns, in the level's turn as work of kind ``turn``: ``call``,
        ``ingest``, ``message``; None: no turn, a mere look at the core's memory); an abort it asks for aborts
        the call."""
        if self.turn is None or turn is None:
            call = functools.partial(fn, *args)
        else:
            call = functools.partial(self._in_turn, turn, fn, *args)
        try:
            return await self.loop.run_in_executor(pool, call)
        except _Abort as a:
            await context.abort(a.code, a.details)

    def _in_turn(self, kind: str, fn, *args):
        with self.turn(kind):
            return fn(*args)

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
            return self.sync.require(ctx, roles, call, token, ended=ended)
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

    async def Access(self, request, context):
        return await self._unary("Access", request, context)

    # -- streams -----------------------------------------------------------------------------------
    async def Subscribe(self, request, context):
        ctx = await self._enter(context)
        token = self.sync.token(ctx)
        s, qids = await self._run(self.calls, context, self.sync.subscribe_start, request, ctx)
        await self._open(context, s, "Subscribe")
        try:
            cursor: dict[str, int] = {}
            after = request.resume_after_ts
            open_ids = list(qids)
            while open_ids:
                try:
                    # a look at what is there (no turn: an idle subscriber does not wait for its level's slot
                    # every half second, which would read as work to a round-robin plan); the encoding of each
                    # message below is in the level's turn
                    released, ended = await self._run(self.calls, context, self.core.wait_results, open_ids, cursor,
                                                      0.0, turn=None)
                except ResultsGone as e:  # a reader slower than the retention: told, never a silent gap
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE, one_line(e))
                if not released and not ended:
                    if not await self.news.wait_for(lambda: self.core.has_news(open_ids, cursor), 0.5):
                        # idle: a revoked session's stream still ends within a second
                        await self._check(context, ctx, ("analyst",), "Subscribe", token)
                    continue
                for r in released:
                    if r.last_ts <= after:
                        continue
                    msg = await self._run(self.calls, context, self.sync.result_message, r, after, turn="message")
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
        token = self.sync.token(ctx)
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
                ok = await self._run(self.ingest, context, self.sync.add_batch, reply, ctx, token, batch, turn="ingest")
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
                ack = await self._run(self.ingest, context, self.sync.ack_batch, batch, n, ctx, token, turn="ingest")
                yield ack
                if ack.error:
                    return
        finally:
            self.limits.close(s)


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
        self.front = self.make_front()
        rpc.add_MasterServicer_to_server(self.front, self.server)
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{add_port(self.server, self.listen, self.credentials)}"

    def make_front(self):
        """The servicer the server serves, built on its event loop (a trusted master's routes calls to one
        such front per level: master/trusted.py)."""
        return AioMaster(self.servicer, self.peer_check, *self.threads, replication=self.replication)

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
