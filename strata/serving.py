"""What the master and worker processes share: building a gRPC server, running until a signal."""

from __future__ import annotations

import signal
import threading
from concurrent import futures
from typing import Callable

import grpc

__all__ = ["build_server", "run_until_stopped", "MAX_MESSAGE"]

MAX_MESSAGE = 256 * 1024 * 1024


def build_server(add_servicer: Callable, servicer, listen: str, credentials=None, max_workers: int = 8,
                 max_receive: int = MAX_MESSAGE, interceptors=()) -> tuple[grpc.Server, str]:
    """An unstarted server that knows its bound address ("host:port"; port 0 picks one).

    With ``credentials`` (mutual TLS) the port is a TLS port; ``interceptors``
    run before every handler (e.g. :class:`strata.tls.PeerCheck`).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=list(interceptors),
        options=[("grpc.max_receive_message_length", max_receive), ("grpc.max_send_message_length", MAX_MESSAGE),
                 ("grpc.so_reuseport", 0)],
    )
    add_servicer(servicer, server)
    host = listen.rsplit(":", 1)[0]
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return server, f"{host}:{port}"


def run_until_stopped(stop_event: threading.Event | None, on_ready: Callable[[], None] | None,
                      cleanup: Callable[[], None]) -> None:
    """Block until SIGTERM/SIGINT (or ``stop_event``), then run ``cleanup``."""
    stop = stop_event or threading.Event()
    if stop_event is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if on_ready is not None:
        on_ready()
    try:
        stop.wait()
    finally:
        cleanup()
