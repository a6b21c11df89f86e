"""Python client of a Strata master (used by the CLI and tests)."""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import from_ipc, to_ipc
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc

__all__ = ["Client", "ClientError", "LoginFailed", "QueryRejected", "PermissionDenied", "SessionEnded"]


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


class Client:
    """A session with one master.

    ``tls_dir`` (from ``strata certs``): connect with mutual TLS, presenting the
    ``client-<level>`` certificate and accepting only the master of ``level``
    (default: the level of the only client certificate in the directory).
    Without it the channel is plaintext, which a TLS master refuses.
    """

    def __init__(self, address: str, tls_dir=None, level: str | None = None, timeout: float = 60.0):
        opts = [("grpc.max_receive_message_length", 256 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                # a restarted master is found again within ~2 s, not after gRPC's default 2 min back-off
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls_dir is not None:
            from strata.tls import TlsError, find_client_level, secure_channel

            level = level or find_client_level(tls_dir)
            if level is None:
                raise TlsError(f"{tls_dir}: several or no client certificates; say which level to use")
            self.channel = secure_channel(address, tls_dir, "client", level, "master", opts)
        else:
            self.channel = grpc.insecure_channel(address, opts)
        self.stub = rpc.MasterStub(self.channel)
        self.timeout = timeout
        self.token: str | None = None
        self.level: str | None = None
        self.roles: list[str] = []
        #: how each query's result stream ended: query id → (state, error); error is "" unless it failed
        self.ended: dict[str, tuple[str, str]] = {}

    def close(self) -> None:
        self.channel.close()

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
        try:
            r = self.stub.Login(pb.LoginRequest(user=user, password=password, level=level), timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise LoginFailed(e.details()) from None
            raise ClientError(f"{e.code().name}: {e.details()}") from None
        self.token, self.level, self.roles = r.token, r.level, list(r.roles)
        return r.level

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
        arrives exactly once.  ``on_reconnect(attempt)`` is called before each
        attempt.
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
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or attempt > 0 and \
                        time.monotonic() > deadline:
                    raise _error(e) from None
                if attempt == 0:
                    deadline = time.monotonic() + reconnect_seconds
                attempt += 1
                if on_reconnect is not None:
                    on_reconnect(attempt)
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

    def status(self) -> pb.StatusReply:
        """The level, this session's roles and own queries; for operators also the cluster part."""
        try:
            return self.stub.Status(pb.Empty(), metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None
