"""Python client of a Strata master (used by the CLI and tests)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.tls import TlsError, find_client_level, secure_channel

__all__ = ["Client", "ClientError", "LoginFailed", "QueryRejected", "PermissionDenied", "SessionEnded",
           "IngestResult", "master_addresses"]


class ClientError(RuntimeError):
    """A refused or failed call; ``code`` is the gRPC status name (``""`` if none)."""

    def __init__(self, message: str, code: str = "", details: str = ""):
        super().__init__(message)
        self.code = code
        self.details = details or message


class LoginFailed(ClientError):
    pass


class QueryRejected(ClientError):
    pass


class PermissionDenied(ClientError):
    """The call needs a role (or a query) this session does not have; the message says which."""


class SessionEnded(ClientError):
    """The session was ended (revoked, downgraded, logged out) while a call or stream was open."""


def _error(e: grpc.RpcError) -> ClientError:
    """The one-line client error of a refused call."""
    code = e.code()
    details = (e.details() or "").strip()
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(details, code.name, details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return SessionEnded(f"{code.name}: {details}", code.name, details)
    return ClientError(f"{code.name}: {details}", getattr(code, "name", ""), details)


def _lost(e: grpc.RpcError) -> bool:
    """Whether a failed call means the connection to the master was lost (killed, restarted, network),
    not a refusal: then the client may reconnect and go on."""
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    text = (e.details() or "").lower()
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and \
        any(w in text for w in ("rst_stream", "stream removed", "socket closed", "connection reset"))


def _standby(e) -> bool:
    """Whether a failed call (an RpcError or a ClientError) is a standby master's refusal (the level's
    active master is another one: docs/operations.md, *Standby masters*)."""
    code = e.code() if isinstance(e, grpc.RpcError) else None
    name = getattr(code, "name", None) if code is not None else getattr(e, "code", "")
    details = (e.details() or "") if isinstance(e, grpc.RpcError) else getattr(e, "details", "")
    return name == "FAILED_PRECONDITION" and " is a standby; the active one is " in (details or "")


def _named_active(details: str) -> str | None:
    """The active master a standby's refusal names (None: unknown)."""
    marker = " the active one is "
    if marker not in (details or ""):
        return None
    name = details.rsplit(marker, 1)[1].strip()
    return None if not name or name == "unknown" else name


def master_addresses(address) -> list[str]:
    """``host:port`` or ``a:port,b:port`` (or a list): the level's masters, in the order to try them."""
    items = address if isinstance(address, (list, tuple)) else str(address or "").split(",")
    out = [a.strip() for a in items if a and a.strip()]
    if not out:
        raise ValueError("no master address")
    return list(dict.fromkeys(out))


@dataclass
class IngestResult:
    """What an exactly-once ingest achieved (:meth:`Client.ingest_stream`)."""

    accepted: int = 0  # rows kept and applied (duplicates included: applied once, before)
    dropped_by_shepherd: int = 0  # rows above the master's level (this producer's own)
    rejected: int = 0  # 1 if a batch was refused (``error``); the batches after it were not sent
    error: str = ""
    chunks: int = 0
    batches: int = 0  # acknowledged batches
    duplicates: int = 0  # acknowledged as already applied (re-sent after a lost acknowledgement)
    reconnects: int = 0  # connections lost and resumed
    next_seq: int = 1  # the seq the next batch of this producer would get


class _Feed:
    """The batches of an exactly-once ingest: numbered once (``seq``), kept until acknowledged, sent
    again after a reconnect.  Each call's request iterator (:meth:`requests`) sends the unacknowledged
    batches in seq order, then new ones while fewer than ``window`` are unacknowledged; an iterator
    of an abandoned call stops at its next step."""

    def __init__(self, batches: Iterable, make, first_seq: int, window: int):
        self._src = iter(batches)
        self._make = make
        self._src_lock = threading.Lock()
        self.cond = threading.Condition()
        self.pending: dict[int, object] = {}  # seq -> message, in seq order, not yet acknowledged
        self.next_seq = first_seq
        self.exhausted = False
        self.attempt = 0
        self.window = max(1, window)
        self.error: BaseException | None = None  # raised by the batches' source
        self.busy = 0  # request iterators running right now (in gRPC's sending thread)

    def requests(self, attempt: int):
        with self.cond:
            self.busy += 1
        try:
            yield from self._requests(attempt)
        finally:
            with self.cond:
                self.busy -= 1
                self.cond.notify_all()

    def quiet(self, timeout: float) -> bool:
        """Wait until no request iterator runs (gRPC's sending thread is out of it); the process may
        then exit without a gRPC thread in the middle of a send."""
        with self.cond:
            return self.cond.wait_for(lambda: self.busy == 0, timeout)

    def _requests(self, attempt: int):
        nxt = -1  # every seq below this was sent by this attempt
        while True:
            with self.cond:
                while True:
                    if self.attempt != attempt:
                        return
                    seq = next((q for q in self.pending if q >= nxt), None)
                    if seq is not None:
                        msg = self.pending[seq]
                        break
                    if self.exhausted:
                        return
                    if len(self.pending) < self.window:
                        msg = None
                        break
                    self.cond.wait(0.5)
            if msg is not None:
                nxt = seq + 1
                with self.cond:  # suspended at the yield: not running (gRPC may never resume it)
                    self.busy -= 1
                try:
                    yield msg
                finally:
                    with self.cond:
                        self.busy += 1
                continue
            with self._src_lock:  # outside the condition: the source may wait (a paced producer)
                if self.exhausted or self.attempt != attempt:
                    continue
                try:
                    item = next(self._src)
                    msg = self._make(item)
                except StopIteration:
                    item = msg = None
                except BaseException as e:  # noqa: BLE001 - raised again by the caller's thread
                    with self.cond:
                        self.error, self.exhausted = e, True
                        self.cond.notify_all()
                    return
                with self.cond:
                    if msg is None:
                        self.exhausted = True
                    else:
                        msg.seq = self.next_seq
                        self.pending[self.next_seq] = msg
                        self.next_seq += 1
                    self.cond.notify_all()

    def ack(self, seq: int) -> None:
        with self.cond:
            for q in [q for q in self.pending if q <= seq]:
                del self.pending[q]
            self.cond.notify_all()

    def abandon(self) -> None:
        """The current call is over: its request iterator stops."""
        with self.cond:
            self.attempt += 1
            self.cond.notify_all()

    def done(self) -> bool:
        with self.cond:
            return self.exhausted and not self.pending

    def first_unacked(self) -> int:
        with self.cond:
            return next(iter(self.pending), self.next_seq)


class Client:
    """A session with the master of a level.

    ``address``: ``host:port``, or the level's masters (``a:port,b:port`` or a list: an active one and
    its standbys, docs/operations.md *Standby masters*): the client talks to one at a time, tries
    them in order and moves on when one is unreachable (UNAVAILABLE) or refuses as a standby; after a
    lost connection it looks for whichever is active ( :meth:`reconnect`, :meth:`follow`).

    ``tls_dir`` (from ``strata certs``): connect with mutual TLS, presenting the
    ``client-<level>`` certificate and accepting only the master of ``level``
    (default: the level of the only client certificate in the directory).
    Without it the channel is plaintext, which a TLS master refuses.
    """

    #: a master's reply to a login while the client looks for the active one (several masters)
    PROBE_SECONDS = 10.0

    def __init__(self, address, tls_dir=None, level: str | None = None, timeout: float = 60.0):
        self.addresses = master_addresses(address)
        self._opts = [("grpc.max_receive_message_length", 256 * 1024 * 1024),
                      ("grpc.max_send_message_length", 64 * 1024 * 1024),
                      # a restarted master is found again within ~2 s, not after gRPC's default 2 min back-off
                      ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls_dir is not None:
            level = level or find_client_level(tls_dir)
            if level is None:
                raise TlsError(f"{tls_dir}: several or no client certificates; say which level to use")
        self._tls = (tls_dir, level)
        self._channels: dict[str, grpc.Channel] = {}
        self._use(self.addresses[0])
        self.timeout = timeout
        self.token: str | None = None
        self.level: str | None = None
        self.roles: list[str] = []
        #: how each query's result stream ended: query id → (state, error); error is "" unless it failed
        self.ended: dict[str, tuple[str, str]] = {}

    def _use(self, address: str) -> None:
        """Talk to ``address`` from now on (one channel per master, kept: its connection is reused)."""
        ch = self._channels.get(address)
        if ch is None:
            tls_dir, level = self._tls
            if tls_dir is not None:
                ch = secure_channel(address, tls_dir, "client", level, "master", self._opts)
            else:
                ch = grpc.insecure_channel(address, self._opts)
            self._channels[address] = ch
        self.address, self.channel, self.stub = address, ch, rpc.MasterStub(ch)

    @property
    def several(self) -> bool:
        """Whether the client knows several masters of the level (it may move on from one)."""
        return len(self.addresses) > 1

    def moves_on(self, e) -> bool:
        """Whether a failed call (RpcError or ClientError) means: look for the level's active master
        (the connection was lost, or this one is a standby and the client knows others)."""
        if isinstance(e, grpc.RpcError):
            return _lost(e) or self.several and _standby(e)
        return getattr(e, "code", "") in ("UNAVAILABLE", "CANCELLED") or self.several and _standby(e)

    def _order(self, hint: str | None = None) -> list[str]:
        """The masters to try, from the current one on (a standby's named active one first)."""
        i = self.addresses.index(self.address) if self.address in self.addresses else 0
        order = self.addresses[i:] + self.addresses[:i]
        if hint in order:
            order.remove(hint)
            order.insert(0, hint)
        return order

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    def wait_ready(self, timeout: float) -> None:
        """Block until the master answers connections (e.g. after it restarted)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ClientError(f"master not reachable within {timeout:.0f} s") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def _md(self):
        return (("authorization", f"Bearer {self.token}"),)

    def login(self, user: str, password: str, level: str = "") -> str:
        """Log in at the master (with several: the first, in order, that is reachable and not a standby;
        if none is, the last refusal)."""
        req = pb.LoginRequest(user=user, password=password, level=level)
        err = None
        for address in (self._order() if self.several else [self.address]):
            self._use(address)
            try:
                r = self.stub.Login(req, timeout=min(self.timeout, self.PROBE_SECONDS) if self.several else self.timeout)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise LoginFailed(e.details()) from None
                this = ClientError(f"{e.code().name}: {e.details()}", e.code().name, e.details() or "")
                if err is None or not _standby(err):  # a standby's refusal names the active one: keep it
                    err = this
                if self.several and (self.moves_on(e) or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
                raise this from None
            self.token, self.level, self.roles = r.token, r.level, list(r.roles)
            self._credentials = (user, password, level)  # to log in again after a master restart
            return r.level
        raise err

    def _find_active(self, deadline: float, keep_session: bool) -> None:
        """Several masters: until the monotonic ``deadline``, try each in turn until one is active and
        answers; with ``keep_session`` first with this session's token (the active one holds the
        sessions its standby copied), else (or when the token is unknown there) by logging in again."""
        creds = getattr(self, "_credentials", None)
        hint = None
        while True:
            for address in self._order(hint):
                hint = None
                self._use(address)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClientError(f"no active master among {', '.join(self.addresses)} in time", "UNAVAILABLE")
                wait = max(0.5, min(self.PROBE_SECONDS, left))
                try:
                    if keep_session and self.token:
                        try:
                            self.stub.Streams(pb.Empty(), metadata=self._md, timeout=wait)
                            return
                        except grpc.RpcError as e:
                            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                                raise
                    if creds is None:
                        grpc.channel_ready_future(self.channel).result(timeout=wait)
                        return
                    r = self.stub.Login(pb.LoginRequest(user=creds[0], password=creds[1], level=creds[2]), timeout=wait)
                    self.token, self.level, self.roles = r.token, r.level, list(r.roles)
                    return
                except grpc.FutureTimeoutError:
                    continue
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise LoginFailed(e.details()) from None
                    if not (self.moves_on(e) or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise _error(e) from None
                    if _standby(e):
                        hint = _named_active(e.details() or "")
            time.sleep(0.2)  # a standby is taking over, or the active one is restarting

    def reconnect(self, deadline: float) -> None:
        """Wait (until the monotonic ``deadline``) for the master to answer again and log in again with
        the credentials of the last :meth:`login` (a restarted master without the old session, or an
        expired one, still lets the client go on).  With several masters: the one that is active now,
        whichever it is."""
        if self.several:
            return self._find_active(deadline, keep_session=False)
        creds = getattr(self, "_credentials", None)
        while True:
            try:
                grpc.channel_ready_future(self.channel).result(timeout=max(0.1, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise ClientError("master did not come back in time", "UNAVAILABLE") from None
            if creds is None:
                return
            try:
                r = self.stub.Login(pb.LoginRequest(user=creds[0], password=creds[1], level=creds[2]),
                                    timeout=max(1.0, min(self.timeout, deadline - time.monotonic())))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise LoginFailed(e.details()) from None
                if not _lost(e) and e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                    raise _error(e) from None
                time.sleep(0.2)  # the master is starting: its port answers before its servicer does
                continue
            self.token, self.level, self.roles = r.token, r.level, list(r.roles)
            return

    def register(self, queries: list[str]) -> list[pb.RegisteredQuery]:
        try:
            return list(self.stub.Register(pb.RegisterRequest(queries=queries), metadata=self._md,
                                           timeout=self.timeout).queries)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise QueryRejected(e.details(), e.code().name) from None
            raise _error(e) from None

    def _end(self, batch) -> None:
        self.ended[batch.query_id] = (batch.state or "ended", batch.error)

    def subscribe(self, query_ids: list[str] | None = None, resume_after_ts: int = -1) -> Iterator[tuple[str, pa.Table | None]]:
        """Yields (query_id, table) per result batch and (query_id, None) when a query ends
        (how it ended, and a failed query's error, are then in :attr:`ended`)."""
        stream = self.stub.Subscribe(pb.SubscribeRequest(query_ids=query_ids or [], resume_after_ts=resume_after_ts),
                                     metadata=self._md)
        for batch in stream:
            if batch.end:
                self._end(batch)
                yield batch.query_id, None
            else:
                yield batch.query_id, from_ipc(batch.arrow)

    def follow(self, query_ids: list[str], acked: dict[str, int] | None = None,
               reconnect_seconds: float = 120.0, on_reconnect=None) -> Iterator[tuple[str, pa.Table | None]]:
        """Like :meth:`subscribe`, but survives a master restart.

        ``acked`` (query id → last instant received; updated in place) is the
        client's position.  When the master goes away the client waits up to
        ``reconnect_seconds`` for it to come back (same address, same session
        token: the master persisted it), subscribes again after the smallest
        acknowledged instant and drops rows it already has, so every result
        arrives exactly once.  With several masters it resubscribes on whichever
        is active (its standby copied the session; else it logs in again).
        ``on_reconnect(attempt)`` is called before each attempt.
        """
        if not query_ids:
            raise ClientError("follow needs the query ids")
        acked = acked if acked is not None else {}
        open_ids = set(query_ids)
        attempt = 0
        while open_ids:
            after = min(acked.get(q, -1) for q in open_ids)
            try:
                stream = self.stub.Subscribe(pb.SubscribeRequest(query_ids=sorted(open_ids), resume_after_ts=after),
                                             metadata=self._md)
                for batch in stream:
                    attempt = 0
                    if batch.end:
                        open_ids.discard(batch.query_id)
                        self._end(batch)
                        yield batch.query_id, None
                        continue
                    last = acked.get(batch.query_id, -1)
                    if batch.last_ts <= last:
                        continue  # already delivered before the restart
                    table = from_ipc(batch.arrow)
                    if batch.first_ts <= last:
                        table = table.filter(pc.greater(table.column("ts"), last))
                    acked[batch.query_id] = batch.last_ts
                    yield batch.query_id, table
                return
            except grpc.RpcError as e:
                lost = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or \
                    self.several and self.moves_on(e)
                if not lost or attempt > 0 and time.monotonic() > deadline:
                    raise _error(e) from None
                if attempt == 0:
                    deadline = time.monotonic() + reconnect_seconds
                attempt += 1
                if on_reconnect is not None:
                    on_reconnect(attempt)
                if self.several:
                    try:
                        self._find_active(deadline, keep_session=True)
                    except ClientError as err:
                        raise ClientError(f"no master of the level came back within {reconnect_seconds:.0f} s "
                                          f"({err})", "UNAVAILABLE") from None
                    continue
                try:
                    grpc.channel_ready_future(self.channel).result(timeout=max(0.1, deadline - time.monotonic()))
                except grpc.FutureTimeoutError:
                    raise ClientError(f"master did not come back within {reconnect_seconds:.0f} s") from None

    def ingest(self, batches: Iterable[tuple], labelled: bool = False) -> pb.IngestReply:
        """Send ``(stream, table)`` batches in one call; an item ``(stream, table, upto)`` also closes
        the instants up to ``upto`` right after its rows (``table`` may then be None), in order with
        the batches, without waiting for a reply (the producer role, like :meth:`advance`)."""
        def gen():
            for item in batches:
                stream, table = item[0], item[1]
                upto = item[2] if len(item) > 2 else None
                msg = pb.IngestBatch(stream=stream, labelled=labelled)
                if table is not None:
                    msg.arrow = to_ipc(table)
                if upto is not None:
                    msg.advance_upto = int(upto)
                yield msg

        try:
            return self.stub.Ingest(gen(), metadata=self._md, timeout=max(self.timeout, 600))
        except grpc.RpcError as e:
            raise _error(e) from None

    def ingest_stream(self, batches: Iterable[tuple], producer_id: str, labelled: bool = False, first_seq: int = 1,
                      window: int = 8, reconnect_seconds: float = 120.0, on_reconnect=None,
                      on_ack=None) -> IngestResult:
        """Send ``(stream, table[, upto])`` batches exactly once (IngestStream), surviving master restarts.

        Each batch gets a sequence number (from ``first_seq``) under ``producer_id`` and is kept until the
        master acknowledges it (it is then in the master's event log); at most ``window`` batches are
        unacknowledged at a time.  When the connection is lost the client calls
        ``on_reconnect(first unacknowledged seq)`` once, waits up to ``reconnect_seconds`` for the
        master, logs in again and re-sends from the first unacknowledged batch: the master
        acknowledges the batches it had already logged as duplicates without applying them again.
        A refused batch ends the ingest (``error`` in the result; nothing after it was applied).
        ``on_ack(ack)`` sees every acknowledgement."""
        def make(item) -> pb.IngestBatch:
            stream, table = item[0], item[1]
            upto = item[2] if len(item) > 2 else None
            msg = pb.IngestBatch(stream=stream, labelled=labelled, producer_id=producer_id)
            if table is not None:
                msg.arrow = to_ipc(table)
            if upto is not None:
                msg.advance_upto = int(upto)
            return msg

        feed = _Feed(batches, make, first_seq, window)
        try:
            return self._ingest_stream(feed, first_seq, reconnect_seconds, on_reconnect, on_ack)
        finally:
            feed.abandon()
            feed.quiet(5.0)

    def _ingest_stream(self, feed: _Feed, first_seq: int, reconnect_seconds: float, on_reconnect,
                       on_ack) -> IngestResult:
        out = IngestResult(next_seq=first_seq)
        deadline = None  # set while the connection is lost
        while True:
            attempt = feed.attempt
            call = None
            try:
                call = self.stub.IngestStream(feed.requests(attempt), metadata=self._md)
                for ack in call:
                    if ack.error:
                        feed.abandon()
                        call.cancel()
                        out.rejected, out.error = 1, ack.error
                        out.next_seq = feed.next_seq
                        return out
                    feed.ack(ack.seq)
                    deadline = None  # progress: a later loss gets its own time
                    out.batches += 1
                    out.accepted += ack.accepted
                    out.dropped_by_shepherd += ack.dropped_by_shepherd
                    out.chunks += ack.chunks
                    out.duplicates += ack.duplicate
                    if on_ack is not None:
                        on_ack(ack)
                feed.abandon()
                if feed.error is not None:
                    raise feed.error
                if feed.done():
                    out.next_seq = feed.next_seq
                    return out
                # the master ended the stream with batches unacknowledged (it is stopping): go on as
                # after a lost connection
                lost = grpc.StatusCode.UNAVAILABLE
            except grpc.RpcError as e:
                feed.abandon()
                if call is not None:
                    call.cancel()
                if not self.moves_on(e):
                    raise _error(e) from None
                lost = e.code()
            if deadline is None:
                deadline = time.monotonic() + reconnect_seconds
                out.reconnects += 1
                if on_reconnect is not None:
                    on_reconnect(feed.first_unacked())
            elif time.monotonic() > deadline:
                raise ClientError(f"master did not come back within {reconnect_seconds:.0f} s "
                                  f"(connection lost: {getattr(lost, 'name', lost)})", "UNAVAILABLE")
            self.reconnect(deadline)

    def advance(self, upto_ts: int = 0, finish: bool = False) -> int:
        """Close instants up to ``upto_ts`` (producer) or finish the input (producer or operator)."""
        try:
            return self.stub.Advance(pb.AdvanceRequest(upto_ts=upto_ts, finish=finish), metadata=self._md,
                                     timeout=self.timeout).chunks
        except grpc.RpcError as e:
            raise _error(e) from None

    def cancel(self, query_ids: list[str]) -> list[pb.QueryStatus]:
        """Stop some of this user's queries from the next instant; returns their status."""
        try:
            return list(self.stub.Cancel(pb.CancelRequest(query_ids=query_ids), metadata=self._md,
                                         timeout=self.timeout).queries)
        except grpc.RpcError as e:
            raise _error(e) from None

    def add_stream(self, name: str, attributes: list[tuple[str, str]]) -> pb.StreamInfo:
        """Declare stream ``name`` with ``attributes`` ((name, type) pairs) on this master (operator)."""
        try:
            return self.stub.AddStream(pb.AddStreamRequest(name=name, attributes=[
                pb.Attribute(name=a, type=t) for a, t in attributes]), metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

    def access(self, user: str, query_id: str, stream: str, grant: bool) -> pb.AccessReply:
        """A privacy switch (operator): ``user``'s access to ``stream`` for ``query_id`` on (``grant``) or off
        from the master's first instant not closed."""
        try:
            return self.stub.Access(pb.AccessRequest(user=user, query_id=query_id, stream=stream, grant=grant),
                                    metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

    def streams(self) -> list[pb.StreamInfo]:
        """The streams this master accepts (its configuration's, then those added at run time)."""
        try:
            return list(self.stub.Streams(pb.Empty(), metadata=self._md, timeout=self.timeout).streams)
        except grpc.RpcError as e:
            raise _error(e) from None

    def status(self) -> pb.StatusReply:
        """The level, this session's roles and own queries; for operators also the cluster part."""
        try:
            return self.stub.Status(pb.Empty(), metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None
