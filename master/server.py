"""The master process: its thin gRPC servicer over the core, and :func:`serve_master`.

:class:`MasterServicer` only translates: it checks the session and its role on every call (and
on every batch of an ingest stream, every message of a result stream), turns messages into calls
of plain logic (:class:`~strata.master.core.MasterCore`, :class:`~strata.master.sessions.Sessions`,
:mod:`strata.master.admission`) and their answers or refusals into replies and status codes.  Its
public methods (:meth:`~MasterServicer.require`, :meth:`~MasterServicer.subscribe_start`,
:meth:`~MasterServicer.ingest_one`, ...) are what the ``grpc.aio`` front
(:class:`~strata.master.aio_server.AioMaster`) runs on its pools; its RPC methods also serve
in-process callers thread-per-stream.

:func:`serve_master` runs a master: the core and sessions restored from its state file
(:func:`~strata.master.loops.build_core`), the ``grpc.aio`` server
(:class:`~strata.master.aio_server.MasterServer`) and the threads beside it
(:class:`~strata.master.loops.MasterLoops`: heartbeats, dispatch, checkpoints, the users file).
A master with standbys: :func:`strata.master.standby.serve_replicated`.
"""

from __future__ import annotations

import logging
import threading

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.chunker import merge_chunks
from strata.chunking.codec import encode_chunk
from strata.chunking.prune import prune_chunk
from strata.errors import one_line
from strata.mlscql import QueryError
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import run_until_stopped
from strata.tls import PeerCheck, server_credentials
from strata.users import AuthError

from .admission import MAX_INGEST_BYTES, MAX_INGEST_ROWS, BatchOutcome, Refused, producer_key
from .aio_server import MasterServer
from .core import MasterCore
from .loops import MasterLoops, build_core
from .pipeline import QueryPipeline
from .queries import NotYours, ResultsGone
from .sessions import RoleError, Sessions, StreamLimits
from .store import MasterStore, config_fingerprint

__all__ = ["MasterServicer", "serve_master", "client_tls", "warm_up"]

log = logging.getLogger("strata.master")


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
    def token(context) -> str | None:
        auth = dict(context.invocation_metadata()).get("authorization", "")
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def session(self, context):
        try:
            return self.sessions.check(self.token(context))
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def require(self, context, roles: tuple[str, ...], call: str, token=None, ended: bool = False):
        """The session if it has one of ``roles``; else abort (UNAUTHENTICATED / PERMISSION_DENIED).
        ``ended``: the session was valid when the call began (a stream): say it ended."""
        try:
            return self.sessions.require(token if token is not None else self.token(context), roles, call)
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
        s = self.require(context, ("analyst",), "Register")
        try:
            infos = self.core.register(s.principal.user, list(request.queries), roles=s.principal.roles)
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

    def subscribe_start(self, request, context):
        """The checks before a result stream: session and role, the queries are the user's, the results
        to resume from are still kept.  Returns (session, query ids)."""
        s = self.require(context, ("analyst",), "Subscribe")
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
    def result_message(r, after: int) -> pb.ResultBatch:
        rows = r.rows
        if after >= 0 and r.first_ts <= after:
            rows = rows.filter(pc.greater(rows.column("ts"), after))
        return pb.ResultBatch(query_id=r.query_id, first_ts=r.first_ts, last_ts=r.last_ts, arrow=to_ipc(rows))

    def Subscribe(self, request, context):
        token = self.token(context)
        s, qids = self.subscribe_start(request, context)
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
                self.require(context, ("analyst",), "Subscribe", token, ended=True)
            for r in released:
                if r.last_ts <= after:
                    continue
                # re-checked before every message: nothing is sent once the session or role is gone
                self.require(context, ("analyst",), "Subscribe", token, ended=True)
                yield self.result_message(r, after)
            for q in ended:
                state, error = self.core.end_of(q)
                self.require(context, ("analyst",), "Subscribe", token, ended=True)
                yield pb.ResultBatch(query_id=q, end=True, state=state, error=error)
                open_ids.remove(q)

    def ingest_one(self, context, token, batch) -> BatchOutcome:
        """One batch of an ingest stream: the session checked again, decoded, then logged and applied by
        the core (or acknowledged as a duplicate).  Raises ValueError (refused, nothing applied)."""
        # every batch: a revoked, logged-out or downgraded producer's open stream is cut here,
        # before anything of this batch is applied
        s = self.require(context, ("producer",), "Ingest", token, ended=True)
        table = None
        if batch.arrow or not batch.HasField("advance_upto"):
            try:
                table = from_ipc(batch.arrow, max_bytes=2 * MAX_INGEST_BYTES, max_rows=2 * MAX_INGEST_ROWS)
            except (ValueError, pa.ArrowInvalid) as e:
                self.core.count_rejected("bad_batch")
                raise ValueError(f"stream {batch.stream}: not an Arrow IPC stream: {e}") from None
        producer = producer_key(s.principal.user, batch.producer_id, self.core.count_rejected)
        source = None if batch.labelled else s.principal.level
        upto = batch.advance_upto if batch.HasField("advance_upto") else None  # after this batch's rows
        outcome = self.core.ingest_batch(batch.stream, table, source, advance_upto=upto, producer=producer,
                                         seq=int(batch.seq))
        self._replicated()  # acknowledged once the standbys stored it (a duplicate: once they have it)
        return outcome

    def add_batch(self, reply: pb.IngestReply, context, token, batch) -> bool:
        """One batch of an Ingest stream into its single reply; False (the reply's error set) if refused."""
        return _add_batch(reply, lambda: self.ingest_one(context, token, batch))

    def ack_batch(self, batch, n: int, context, token) -> pb.IngestAck:
        """One batch of an IngestStream (its ``n``-th) and its acknowledgement (or its refusal)."""
        return _ack(batch, n, lambda: self.ingest_one(context, token, batch))

    def Ingest(self, request_iterator, context):
        token = self.token(context)
        s = self.require(context, ("producer",), "Ingest", token)
        self._open_stream(context, s, "Ingest")
        try:
            reply = pb.IngestReply()
            for batch in request_iterator:
                if not self.add_batch(reply, context, token, batch):
                    break
            return reply
        finally:
            self.limits.close(s)

    def IngestStream(self, request_iterator, context):
        """Ingest acknowledged per batch (thread-per-stream form; the master serves :class:`AioMaster`)."""
        token = self.token(context)
        s = self.require(context, ("producer",), "Ingest", token)
        self._open_stream(context, s, "IngestStream")
        try:
            for n, batch in enumerate(request_iterator, 1):
                ack = self.ack_batch(batch, n, context, token)
                yield ack
                if ack.error:
                    return
        finally:
            self.limits.close(s)

    def Advance(self, request, context):
        if request.finish:
            self.require(context, ("producer", "operator"), "Advance(finish)")
        else:
            self.require(context, ("producer",), "Advance")
        try:
            n = self.core.advance(request.upto_ts, finish=request.finish)
        except Refused as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        self._replicated()
        return pb.AdvanceReply(chunks=n)

    def Cancel(self, request, context):
        s = self.require(context, ("analyst",), "Cancel")
        try:
            views = self.core.cancel(s.principal.user, list(request.query_ids))
        except NotYours as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e.args[0]))
        self._replicated()
        return pb.CancelReply(queries=[pb.QueryStatus(**v) for v in views])

    def AddStream(self, request, context):
        self.require(context, ("operator",), "AddStream")
        try:
            view, created = self.core.add_stream(request.name, [(a.name, a.type) for a in request.attributes])
        except Refused as e:
            self.core.count_rejected(e.reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._replicated()
        return _stream_info(view, added=True, created=created)

    def Access(self, request, context):
        """A privacy switch (operator of this level; master/access.py): thin over the core."""
        s = self.require(context, ("operator",), "Access")
        try:
            v = self.core.access(s.principal.user, request.user, request.query_id, request.stream, request.grant)
        except Refused as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._replicated()
        return pb.AccessReply(switch=_switch_status(v), instant=v["instant"], changed=v["changed"])

    def Streams(self, request, context):
        self.session(context)
        return pb.StreamsReply(streams=[_stream_info(v, v["added"]) for v in self.core.streams()])

    def Status(self, request, context):
        s = self.session(context)
        operator = "operator" in s.principal.roles
        st = self.core.status(s.principal.user, cluster=operator)
        reply = pb.StatusReply(level=st["level"], user=s.principal.user, roles=sorted(s.principal.roles),
                               queries=[pb.QueryStatus(**v) for v in st["queries"]], cluster=operator)
        self._shed_status(reply, st.get("shedding"))
        if not operator:
            return reply
        reply.workers.extend(pb.WorkerStatus(sid=w["sid"], cpu=w["cpu"], pid=w.get("pid", 0), state=w["state"],
                                             chunks_done=w["done"], in_flight=w["in_flight"]) for w in st["workers"])
        reply.backlog_chunks = st["backlog_chunks"]
        reply.ready_chunks = st["ready_chunks"]
        reply.lag_seconds = st["lag_instants"]
        rejected = {k: int(v) for k, v in st["rejected"].items()}
        denied = self.sessions.denied_counts()
        rejected.update({f"role:{k}": int(v) for k, v in denied.items()})
        reply.rejected.update(rejected)
        reply.counters.update({k: int(v) for k, v in st["counters"].items()}
                              | {"failed_logins": self.sessions.failed_logins, "logouts": self.sessions.logouts,
                                 "permission_denied": int(sum(denied.values()))})
        if self.extra_counters is not None:
            reply.counters.update({k: int(v) for k, v in self.extra_counters().items()})
        reply.timings.update(st.get("timings", {}))
        reply.histograms.update(st.get("histograms", {}))
        reply.last_chunk_error = st.get("last_chunk_error", "")
        reply.switches.extend(_switch_status(v) for v in st.get("switches", []))
        return reply

    @staticmethod
    def _shed_status(reply: pb.StatusReply, shed: dict | None) -> None:
        """The level's load shedding, for every session (master/shedding.py :meth:`Shedder.view`)."""
        if shed is None:
            return
        reply.shedding.CopyFrom(pb.ShedStatus(
            mode=shed["mode"], active=shed["active"], shed_backlog_rows=shed["shed_backlog_rows"],
            resume_backlog_rows=shed["resume_backlog_rows"], rows=shed["rows"], instants=shed["instants"],
            ranges=[pb.InstantRange(first=a, last=b) for a, b in shed["ranges"]], ranges_total=shed["ranges_total"],
            batches=shed["batches"], episodes=shed["episodes"]))


def _switch_status(v: dict) -> pb.SwitchStatus:
    return pb.SwitchStatus(query_id=v["query_id"], user=v["user"], stream=v["stream"], state=v["state"],
                           since=v["since"], access_counter=v["access_counter"], blocked=v["blocked"],
                           passed=v["passed"])


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
    if o.shed:  # rows the level shed (its own load): told to this producer, counted in every session's status
        first = o.shed_first if not reply.shed else min(reply.shed_first_ts, o.shed_first)
        reply.shed_first_ts, reply.shed_last_ts = first, max(reply.shed_last_ts, o.shed_last)
        reply.shed += o.shed
    return True


def _ack(batch, n: int, apply) -> pb.IngestAck:
    """The acknowledgement of one batch (the ``n``-th of its stream): its outcome, or its refusal."""
    seq = int(batch.seq) if batch.producer_id else n
    try:
        o = apply()
    except (ValueError, pa.ArrowInvalid) as e:
        return pb.IngestAck(seq=seq, error=one_line(e))
    return pb.IngestAck(seq=seq, accepted=o.accepted, dropped_by_shepherd=o.dropped, duplicate=o.duplicate,
                        chunks=o.chunks, shed=o.shed, shed_first_ts=max(o.shed_first, 0),
                        shed_last_ts=max(o.shed_last, 0))


def _stream_info(view: dict, added: bool, created: bool = False) -> "pb.StreamInfo":
    return pb.StreamInfo(name=view["name"], attributes=[pb.Attribute(name=c, type=t) for c, t in view["columns"]],
                         added=added, created=created)


def warm_up(config, level: str) -> None:
    """Do once, before the master says it is ready, what the first login, registration, batch and
    chunk would otherwise pay for: pyarrow's lazy pandas import, the certificate parser, building
    the MLS-CQL parser, the chunker, merging, pruning and encoding.  Never fatal."""
    try:
        import pandas  # noqa: F401 - pyarrow imports it on the first array built from Python objects
        from cryptography import x509  # noqa: F401 - the first TLS peer check's (tls.read_identity): ~0.2 s
        from cryptography.x509.oid import NameOID  # noqa: F401

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


def client_tls(tls_dir, level: str, refused):
    """(server credentials, the check of clients' certificates) of a master of ``level``; (None, None)
    without TLS."""
    if tls_dir is None:
        return None, None
    return server_credentials(tls_dir, "master", level), PeerCheck(level, ("client",), refused=refused)


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
