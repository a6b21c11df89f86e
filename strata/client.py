"""Python client of a Strata master (used by the CLI and tests)."""

from __future__ import annotations

from typing import Iterable, Iterator

import grpc
import pyarrow as pa

from strata.arrowio import from_ipc, to_ipc
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc

__all__ = ["Client", "ClientError", "LoginFailed", "QueryRejected"]


class ClientError(RuntimeError):
    pass


class LoginFailed(ClientError):
    pass


class QueryRejected(ClientError):
    pass


class Client:
    """A session with one master.

    ``tls_dir`` (from ``strata certs``): connect with mutual TLS, presenting the
    ``client-<level>`` certificate and accepting only the master of ``level``
    (default: the level of the only client certificate in the directory).
    Without it the channel is plaintext, which a TLS master refuses.
    """

    def __init__(self, address: str, tls_dir=None, level: str | None = None, timeout: float = 60.0):
        opts = [("grpc.max_receive_message_length", 256 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024)]
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

    def close(self) -> None:
        self.channel.close()

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
        self.token, self.level = r.token, r.level
        return r.level

    def register(self, queries: list[str]) -> list[pb.RegisteredQuery]:
        try:
            return list(self.stub.Register(pb.RegisterRequest(queries=queries), metadata=self._md,
                                           timeout=self.timeout).queries)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise QueryRejected(e.details()) from None
            raise ClientError(f"{e.code().name}: {e.details()}") from None

    def subscribe(self, query_ids: list[str] | None = None, resume_after_ts: int = -1) -> Iterator[tuple[str, pa.Table | None]]:
        """Yields (query_id, table) per result batch and (query_id, None) when a query ends."""
        stream = self.stub.Subscribe(pb.SubscribeRequest(query_ids=query_ids or [], resume_after_ts=resume_after_ts),
                                     metadata=self._md)
        for batch in stream:
            if batch.end:
                yield batch.query_id, None
            else:
                yield batch.query_id, from_ipc(batch.arrow)

    def ingest(self, batches: Iterable[tuple[str, pa.Table]], labelled: bool = False) -> pb.IngestReply:
        def gen():
            for stream, table in batches:
                yield pb.IngestBatch(stream=stream, arrow=to_ipc(table), labelled=labelled)

        try:
            return self.stub.Ingest(gen(), metadata=self._md, timeout=max(self.timeout, 600))
        except grpc.RpcError as e:
            raise ClientError(f"{e.code().name}: {e.details()}") from None

    def advance(self, upto_ts: int = 0, finish: bool = False) -> int:
        return self.stub.Advance(pb.AdvanceRequest(upto_ts=upto_ts, finish=finish), metadata=self._md,
                                 timeout=self.timeout).chunks

    def status(self) -> pb.StatusReply:
        return self.stub.Status(pb.Empty(), metadata=self._md, timeout=self.timeout)
