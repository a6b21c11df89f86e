"""The master process: gRPC front for clients, dispatch thread for workers.

Thin by design: :class:`MasterServicer` translates messages to
:class:`MasterCore` calls; :class:`Dispatcher thread <DispatchLoop>` moves
chunk bytes to workers and results back.  All decisions live in the core.
"""

from __future__ import annotations

import logging
import threading

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
from strata.serving import MAX_MESSAGE, build_server, run_until_stopped
from strata.worker.server import execute_digest

from .core import MAX_INGEST_BYTES, MAX_INGEST_ROWS, MasterCore, NotYours, Refused, ResultsGone
from .pipeline import one_line
from .sessions import RoleError, Sessions, dominates

__all__ = ["MasterServicer", "DispatchLoop", "UsersWatch", "serve_master", "MAX_INGEST_ROWS", "MAX_INGEST_BYTES"]

log = logging.getLogger("strata.master")


class MasterServicer(rpc.MasterServicer):
    """Thin: checks the session and its role, translates messages, calls :class:`MasterCore`.

    Every reply is computed by the core from what the master's level dominates;
    a call outside the session's roles is refused with PERMISSION_DENIED and
    counted (operators see ``role:<call>`` under ``rejected``)."""

    def __init__(self, core: MasterCore, sessions: Sessions):
        self.core = core
        self.sessions = sessions

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
        return pb.LoginReply(token=s.token, level=s.principal.level, master_level=self.core.level,
                             roles=sorted(s.principal.roles))

    def Logout(self, request, context):
        md = dict(context.invocation_metadata())
        self.sessions.logout(md.get("authorization", "")[7:])
        return pb.Empty()

    def Register(self, request, context):
        s = self._require(context, ("analyst",), "Register")
        try:
            infos = self.core.register(s.principal.user, list(request.queries))
        except QueryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterReply(queries=[
            pb.RegisteredQuery(query_id=i.query_id, rewritten=i.rewritten, r2s=i.r2s, columns=i.columns)
            for i in infos
        ])

    def Subscribe(self, request, context):
        token = self._token(context)
        s = self._require(context, ("analyst",), "Subscribe", token)
        mine = self.core.owned(s.principal.user)
        qids = list(dict.fromkeys(request.query_ids)) or mine
        for q in qids:
            if q not in mine:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"query {q} is not one of this user's queries")
        cursor: dict[str, int] = {}
        after = request.resume_after_ts
        open_ids = list(qids)
        try:
            self.core.check_resume(open_ids, after)
        except ResultsGone as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, one_line(e))
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
                rows = r.rows
                if after >= 0 and r.first_ts <= after:
                    rows = rows.filter(pc.greater(rows.column("ts"), after))
                # re-checked before every message: nothing is sent once the session or role is gone
                self._require(context, ("analyst",), "Subscribe", token, ended=True)
                yield pb.ResultBatch(query_id=r.query_id, first_ts=r.first_ts, last_ts=r.last_ts,
                                     arrow=to_ipc(rows))
            for q in ended:
                state, error = self.core.end_of(q)
                self._require(context, ("analyst",), "Subscribe", token, ended=True)
                yield pb.ResultBatch(query_id=q, end=True, state=state, error=error)
                open_ids.remove(q)

    def Ingest(self, request_iterator, context):
        token = self._token(context)
        s = self._require(context, ("producer",), "Ingest", token)
        accepted = dropped = rejected = chunks = 0
        for batch in request_iterator:
            # every batch: a revoked, logged-out or downgraded producer's open stream is cut here,
            # before anything of this batch is applied
            s = self._require(context, ("producer",), "Ingest", token, ended=True)
            try:
                if batch.arrow or not batch.HasField("advance_upto"):
                    try:
                        table = from_ipc(batch.arrow, max_bytes=2 * MAX_INGEST_BYTES, max_rows=2 * MAX_INGEST_ROWS)
                    except (ValueError, pa.ArrowInvalid) as e:
                        self.core.count_rejected("bad_batch")
                        raise ValueError(f"stream {batch.stream}: not an Arrow IPC stream: {e}") from None
                    source = None if batch.labelled else s.principal.level
                    a, d = self.core.ingest(batch.stream, table, source)
                    accepted += a
                    dropped += d  # rows of this producer's own batches: told to it, nobody else
                if batch.HasField("advance_upto"):  # in order with the batches before it
                    try:
                        chunks += self.core.advance(batch.advance_upto)
                    except Refused as e:
                        raise ValueError(f"advance refused: {e}") from None
            except (ValueError, pa.ArrowInvalid) as e:
                rejected += 1
                return pb.IngestReply(accepted=accepted, dropped_by_shepherd=dropped, rejected=rejected,
                                      error=one_line(e), chunks=chunks)
        return pb.IngestReply(accepted=accepted, dropped_by_shepherd=dropped, rejected=rejected, chunks=chunks)

    def Advance(self, request, context):
        if request.finish:
            self._require(context, ("producer", "operator"), "Advance(finish)")
        else:
            self._require(context, ("producer",), "Advance")
        try:
            n = self.core.advance(request.upto_ts, finish=request.finish)
        except Refused as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        return pb.AdvanceReply(chunks=n)

    def Cancel(self, request, context):
        s = self._require(context, ("analyst",), "Cancel")
        try:
            views = self.core.cancel(s.principal.user, list(request.query_ids))
        except NotYours as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e.args[0]))
        return pb.CancelReply(queries=[pb.QueryStatus(**v) for v in views])

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
        reply.timings.update(st.get("timings", {}))
        reply.last_chunk_error = st.get("last_chunk_error", "")
        return reply


class DispatchLoop:
    """Sends ready chunks to workers (async gRPC) and feeds results back to the core."""

    def __init__(self, core: MasterCore, key: bytes, member, rpc_deadline: float = 30.0, tls_dir=None):
        self.core = core
        self.key = key
        self.member = member
        self.rpc_deadline = rpc_deadline
        self.tls_dir = tls_dir
        self._stubs: dict[str, rpc.WorkerStub] = {}
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

    def _stub(self, sid: str) -> rpc.WorkerStub:
        if sid not in self._stubs:
            opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
            if self.tls_dir is not None:  # the worker must prove it is a worker of this level
                from strata.tls import secure_channel

                ch = secure_channel(sid, self.tls_dir, "master", self.core.level, "worker", opts)
            else:
                ch = grpc.insecure_channel(sid, opts)
            self._stubs[sid] = rpc.WorkerStub(ch)
        return self._stubs[sid]

    def _sync_group(self) -> None:
        """Feed Algorithm 5 the heartbeats of the workers listed by the group member.

        The master's member lists an address only for the identity key that an Info call
        at that address returned (worker/group.py): the probes run in the background
        (:class:`~strata.worker.group.AddressProver`), so this never blocks, and a worker
        gets no chunk before its address is proven.  A heartbeat the dispatcher refuses
        is skipped; the loop goes on."""
        prover = self.__dict__.get("_prover")
        if prover is None and hasattr(self.member, "claimed"):
            from strata.worker.group import AddressProver, info_probe

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
                log.warning("heartbeat of %s not used: %s", sid, one_line(e))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sent = self._step()
            except Exception:  # noqa: BLE001 - the dispatch thread never dies: log, wait a little, go on
                log.exception("dispatch step failed; continuing")
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
                log.exception("chunk %s could not be sent to %s", chunk.chunk_id, sid)
                self.core.on_failure(chunk.chunk_id, sid, reason=f"not sent: {e}", kind="SEND")
        return sent

    def _wire(self, chunk):
        """What travels: the chunk without new tuples no ROWS window can hold (chunking/prune.py).

        The full chunk stays in the core for re-dispatch; any failure sends it unpruned."""
        from strata.chunking.prune import prune_chunk

        try:
            return prune_chunk(chunk, dict(getattr(self.core.pipeline, "queries", {}) or {}))
        except Exception as e:  # noqa: BLE001 - pruning is an optimization only
            log.warning("chunk %s sent unpruned: %s", chunk.chunk_id, e)
            return chunk

    def _send(self, chunk, sid: str) -> None:
        specs = [pb.QuerySpec(query_id=qc.query_id, text=self.core.queries[qc.query_id].text, level=self.core.level)
                 for qc in chunk.queries if qc.query_id in self.core.queries]
        req = pb.ExecuteRequest(level=self.core.level, queries=specs, chunk=encode_chunk(self._wire(chunk)))
        md = ((AUTH_HEADER, sign_request(self.key, self.core.level, execute_digest(req))),)
        # a merged unit computes several chunks: it gets more time before it counts as failed
        timeout = self.rpc_deadline * self.core.deadline_factor(chunk.chunk_id)
        fut = self._stub(sid).Execute.future(req, timeout=timeout, metadata=md)
        cid = chunk.chunk_id
        span = (chunk.first_ts, chunk.last_ts)  # which cut chunks this unit covers, whatever happens meanwhile

        def done(f):
            try:
                try:
                    reply = f.result()
                except grpc.RpcError as e:
                    code = e.code()
                    log.warning("chunk %s on %s failed: %s %s", cid, sid, code, e.details())
                    # a lost worker is dropped (its chunks go elsewhere, not counted against them);
                    # an error reply or an overrun deadline is one failed attempt of the chunk
                    self.core.on_failure(cid, sid, drop_worker=code in (grpc.StatusCode.UNAVAILABLE,),
                                         reason=str(e.details() or ""), kind=getattr(code, "name", str(code)))
                    return
                try:
                    results = [decode_result(b) for b in reply.results]
                    self.core.on_result(cid, sid, results, span=span)
                except Exception as e:  # noqa: BLE001 - an undecodable or inconsistent reply
                    log.warning("chunk %s on %s: bad reply: %s", cid, sid, e)
                    self.core.on_failure(cid, sid, reason=f"bad reply: {e}", kind="BAD_REPLY")
            except Exception:  # noqa: BLE001 - never lose a callback silently
                log.exception("chunk %s on %s: result handling failed", cid, sid)

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
            log.warning("users file unreadable, keeping current access: %s", one_line(e))
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
                log.exception("users-file check failed; will check again")
                self._stamp = None


def warm_up(config, level: str) -> None:
    """Do once, before the master says it is ready, what the first registration, batch and
    chunk would otherwise pay for: pyarrow's lazy pandas import, building the MLS-CQL parser,
    the chunker, merging, pruning and encoding.  Never fatal."""
    try:
        import pandas  # noqa: F401 - pyarrow imports it on the first array built from Python objects

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


def serve_master(config, level: str, listen: str, spec, users, chunk_instants: int = 1,
                 ready=None, stop_event: threading.Event | None = None, tls_dir=None, state_path=None,
                 owner: str | None = None) -> None:
    """Run a master until SIGTERM/SIGINT (or ``stop_event``).

    ``owner``: a user who has every role on this master (the private master of an
    embedded run a user starts for themself); everyone else has the users file's roles.

    With ``tls_dir``: clients must present a ``client`` certificate of this
    level, and workers a ``worker`` certificate of this level.  With
    ``state_path`` (a SQLite file) queries, sessions and accepted input
    survive a restart: the master replays them before it serves.
    """
    from strata.worker.group import GroupMember

    from .store import MasterStore, config_fingerprint

    lv = config.lattice.parse(level)
    warm_up(config, lv)
    store = MasterStore(state_path, lv, config_fingerprint(config)) if state_path else None
    cluster = (getattr(config, "sections", None) or {}).get("cluster") or {}
    # [cluster] dispatch_linger = false: send ready chunks at once even while input floods in
    core = MasterCore(config, level, chunk_instants=chunk_instants, store=store,
                      linger=bool(cluster.get("dispatch_linger", True)))
    sessions = Sessions(users, core.level, persist=store, owner=owner)
    if store is not None:
        restored = core.restore()
        restored["sessions"] = sessions.restore()
        if any(restored.values()):
            log.warning("restored from %s: %s", state_path, restored)
    servicer = MasterServicer(core, sessions)
    creds, interceptors = None, ()
    if tls_dir is not None:
        from strata.tls import PeerCheck, server_credentials

        creds = server_credentials(tls_dir, "master", core.level)
        interceptors = (PeerCheck(core.level, ("client",), refused=core.refused),)
    server, address = build_server(rpc.add_MasterServicer_to_server, servicer, listen, credentials=creds,
                                   max_workers=16, max_receive=2 * MAX_INGEST_BYTES, interceptors=interceptors)
    member = GroupMember(spec, sid=address, role="master")
    member.state = "master"
    core.group_rejected = lambda: member.rejected
    loop = DispatchLoop(core, spec.key, member, tls_dir=tls_dir)
    watch = UsersWatch(core, sessions, users)
    watch.check()  # users removed while the master was down lose their restored sessions and queries
    server.start()
    member.start()
    loop.start()
    watch.start()
    log.info("master %s level %s serving", address, level)

    def cleanup():
        watch.stop()
        loop.stop()
        member.stop()
        server.stop(grace=2).wait()
        if store is not None:
            store.close()

    run_until_stopped(stop_event, ready and (lambda: ready(address, core, member)), cleanup)
