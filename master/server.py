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

from .core import MasterCore
from .sessions import Sessions

__all__ = ["MasterServicer", "DispatchLoop", "serve_master"]

log = logging.getLogger("strata.master")
MAX_INGEST_ROWS = 1_000_000
MAX_INGEST_BYTES = 64 * 1024 * 1024  # per batch; the transport allows twice that so a bigger one is counted


class MasterServicer(rpc.MasterServicer):
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

    def Login(self, request, context):
        try:
            s = self.sessions.login(request.user, request.password, request.level)
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        return pb.LoginReply(token=s.token, level=s.principal.level, master_level=self.core.level)

    def Logout(self, request, context):
        md = dict(context.invocation_metadata())
        self.sessions.logout(md.get("authorization", "")[7:])
        return pb.Empty()

    def Register(self, request, context):
        s = self._session(context)
        try:
            infos = self.core.register(s.principal.user, list(request.queries))
        except QueryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterReply(queries=[
            pb.RegisteredQuery(query_id=i.query_id, rewritten=i.rewritten, r2s=i.r2s, columns=i.columns)
            for i in infos
        ])

    def Subscribe(self, request, context):
        s = self._session(context)
        mine = [q for q, info in self.core.queries.items() if info.owner == s.principal.user]
        qids = list(request.query_ids) or mine
        for q in qids:
            if q not in mine:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"query {q} is not one of this user's queries")
        cursor: dict[str, int] = {}
        after = request.resume_after_ts
        token = self._token(context)
        while context.is_active():
            released, done = self.core.wait_results(qids, cursor, timeout=0.5)
            try:  # a revoked user's stream stops here, before anything newer is sent
                self.sessions.check(token)
            except AuthError as e:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"session ended: {e}")
            for r in released:
                if r.last_ts <= after:
                    continue
                rows = r.rows
                if after >= 0 and r.first_ts <= after:
                    rows = rows.filter(pc.greater(rows.column("ts"), after))
                yield pb.ResultBatch(query_id=r.query_id, first_ts=r.first_ts, last_ts=r.last_ts,
                                     arrow=to_ipc(rows))
            if done:
                for q in qids:
                    yield pb.ResultBatch(query_id=q, end=True)
                return

    def Ingest(self, request_iterator, context):
        s = self._session(context)
        accepted = dropped = rejected = 0
        for batch in request_iterator:
            try:
                if len(batch.arrow) > MAX_INGEST_BYTES:
                    self.core.count_rejected("oversized")
                    raise ValueError(f"batch of {len(batch.arrow)} bytes exceeds {MAX_INGEST_BYTES}; split it")
                try:
                    table = from_ipc(batch.arrow)
                except (ValueError, pa.ArrowInvalid) as e:
                    self.core.count_rejected("bad_batch")
                    raise ValueError(f"stream {batch.stream}: not an Arrow IPC stream: {e}") from None
                if table.num_rows > MAX_INGEST_ROWS:
                    self.core.count_rejected("oversized")
                    raise ValueError(f"batch of {table.num_rows} rows exceeds {MAX_INGEST_ROWS}; split it")
                source = None if batch.labelled else s.principal.level
                a, d = self.core.ingest(batch.stream, table, source)
                accepted += a
                dropped += d
            except (ValueError, pa.ArrowInvalid) as e:
                rejected += 1
                return pb.IngestReply(accepted=accepted, dropped_by_shepherd=dropped, rejected=rejected,
                                      error=str(e).splitlines()[0])
        return pb.IngestReply(accepted=accepted, dropped_by_shepherd=dropped, rejected=rejected)

    def Advance(self, request, context):
        self._session(context)
        n = self.core.advance(request.upto_ts, finish=request.finish)
        return pb.AdvanceReply(chunks=n)

    def Status(self, request, context):
        self._session(context)
        st = self.core.status()
        workers = [pb.WorkerStatus(sid=w["sid"], cpu=w["cpu"], pid=w.get("pid", 0), state=w["state"],
                                   chunks_done=w["done"], in_flight=w["in_flight"]) for w in st["workers"]]
        rejected = {k: int(v) for k, v in st["rejected"].items()}
        rejected.update({f"shepherd:{k}": int(v) for k, v in st["dropped_by_shepherd"].items()})
        return pb.StatusReply(level=st["level"], workers=workers, backlog_chunks=st["backlog_chunks"],
                              ready_chunks=st["ready_chunks"],
                              lag_seconds=st["lag_instants"], rejected=rejected,
                              counters={k: int(v) for k, v in st["counters"].items()}
                              | {"failed_logins": self.sessions.failed_logins, "logouts": self.sessions.logouts},
                              timings=st.get("timings", {}))


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
        for sid, hb in self.member.snapshot().items():
            self.core.heartbeat(sid, hb.cpu, hb.state, hb.pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sync_group()
            self.core.expire()
            sent = self.core.assignments()
            for chunk, sid in sent:
                self._send(chunk, sid)
            if not sent:
                with self.core.cond:
                    self.core.cond.wait(0.05)

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
        fut = self._stub(sid).Execute.future(req, timeout=self.rpc_deadline, metadata=md)
        cid = chunk.chunk_id

        def done(f):
            try:
                reply = f.result()
            except grpc.RpcError as e:
                code = e.code()
                log.warning("chunk %s on %s failed: %s %s", cid, sid, code, e.details())
                self.core.on_failure(cid, sid, drop_worker=code in (grpc.StatusCode.UNAVAILABLE,))
                return
            self.core.on_result(cid, sid, [decode_result(b) for b in reply.results])

        fut.add_done_callback(done)


class UsersWatch:
    """Applies changes of the users file while the master runs (privacy switches).

    Every ``interval`` it re-reads the file if it changed; a user who was
    removed, or whose clearance no longer dominates this master's level, loses
    their sessions and their queries stop from the next instant
    (:meth:`MasterCore.revoke_user`).  ``strata users remove`` and
    ``strata users set-clearance`` are the administrator's switches.
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
        """Revoke whoever lost access since the last check; returns the users revoked."""
        try:
            st = self.users.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        try:
            known = self.users.load()
        except Exception as e:  # a half-edited file must not revoke everyone
            log.warning("users file unreadable, keeping current access: %s", e)
            return []
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
            if u is None or not lat.leq(self.core.level, u.clearance):
                self.sessions.end_user(user)  # first: a subscriber stops before its queries end
                qids = self.core.revoke_user(user, "removed" if u is None else f"clearance {u.clearance}")
                log.warning("revoked %s (%s): queries %s stop after instant %s", user,
                            "removed" if u is None else f"clearance now {u.clearance}", qids,
                            self.core.pipeline.chunker.closed_until - 1)
                gone.append(user)
        return gone

    def _run(self):
        while not self._stop.wait(self.interval):
            self.check()


def serve_master(config, level: str, listen: str, spec, users, chunk_instants: int = 1,
                 ready=None, stop_event: threading.Event | None = None, tls_dir=None, state_path=None) -> None:
    """Run a master until SIGTERM/SIGINT (or ``stop_event``).

    With ``tls_dir``: clients must present a ``client`` certificate of this
    level, and workers a ``worker`` certificate of this level.  With
    ``state_path`` (a SQLite file) queries, sessions and accepted input
    survive a restart: the master replays them before it serves.
    """
    from strata.worker.group import GroupMember

    from .store import MasterStore, config_fingerprint

    lv = config.lattice.parse(level)
    store = MasterStore(state_path, lv, config_fingerprint(config)) if state_path else None
    core = MasterCore(config, level, chunk_instants=chunk_instants, store=store)
    sessions = Sessions(users, core.level, persist=store)
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
