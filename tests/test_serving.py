"""Binding a server's port (strata/serving.py add_port): a restart on its old address waits for a port that
something else holds for a moment, and says in one line when it stays taken."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from strata.serving import add_port


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _server() -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=[("grpc.so_reuseport", 0)])


def test_a_given_port_is_tried_again_until_its_holder_lets_go():
    held = _held_port()
    port = held.getsockname()[1]
    threading.Timer(0.6, held.close).start()  # e.g. a peer's reconnect that connected to itself, then gave up
    server = _server()
    t0 = time.monotonic()
    try:
        assert add_port(server, f"127.0.0.1:{port}", patience=10) == port
        assert time.monotonic() - t0 >= 0.5
    finally:
        server.stop(0)


def test_a_port_that_stays_taken_is_one_line_and_port_0_is_tried_once():
    held = _held_port()
    port = held.getsockname()[1]
    server = _server()
    try:
        with pytest.raises(OSError) as e:
            add_port(server, f"127.0.0.1:{port}", patience=0.5)
        assert str(e.value) == f"cannot listen on 127.0.0.1:{port}: the address is in use or not this host's"
        assert add_port(server, "127.0.0.1:0", patience=10) > 0
    finally:
        held.close()
        server.stop(0)
