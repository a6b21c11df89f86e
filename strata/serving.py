"""What the master and worker processes share: their command-line options, group spec, TLS
directory and ready file; building a gRPC server; running until a signal."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Callable

import grpc

from .errors import CliError
from .groups import group_spec
from .logs import capture_output, flush_output
from .tls import has_material

__all__ = ["build_server", "add_port", "run_until_stopped", "exit_now", "MAX_MESSAGE", "progress", "free_udp_port", "group_spec_of",
           "ready_writer", "server_tls", "add_process_options", "pid_alive", "start_logging"]

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
    return server, f"{host}:{add_port(server, listen, credentials)}"


#: how long a given port (a restart on its address, a deployment's kept port) is tried again while it is
#: taken: a killed process's port in the ephemeral range can be held for a moment by another socket, even by
#: a peer's own reconnect to it (Linux's TCP self-connect: a client's source port equal to the dead port)
BIND_PATIENCE = 15.0


def add_port(server, listen: str, credentials=None, patience: float = BIND_PATIENCE) -> int:
    """Bind ``server`` (a grpc or grpc.aio server) to ``listen`` and return the port.  Port 0 is tried once;
    a given port again every 0.2 s for ``patience`` seconds before :class:`OSError` says it is in use."""
    deadline = time.monotonic() + (0.0 if listen.endswith(":0") else patience)
    while True:
        try:
            port = server.add_secure_port(listen, credentials) if credentials is not None \
                else server.add_insecure_port(listen)
        except RuntimeError:  # grpcio >= 1.5x raises where older versions returned 0
            port = 0
        if port:
            return port
        if time.monotonic() >= deadline:
            raise OSError(f"cannot listen on {listen}: the address is in use or not this host's")
        time.sleep(0.2)


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


def exit_now(code: int = 0) -> None:
    """End a server process (``strata master``/``worker``) once its cleanup has run: flush and
    leave without the interpreter's finalization (py4j's and gRPC's threads, module teardown),
    which took 0.2-0.4 s of every stop of an embedded cluster.  Only for the process's entry
    point: whatever must survive is closed by the cleanup before (the master's store)."""
    logging.shutdown()
    flush_output()  # a --log-file: what the pipe still holds reaches the file
    os._exit(code)


def progress(msg: str) -> None:
    print(f"[strata] {msg}", file=sys.stderr, flush=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (one of another user counts as alive; a zombie, dead and not
    yet reaped by its parent, as gone: a killed process of `strata up` is reaped by init, which may
    take a moment)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def group_spec_of(config, level: str, state_dir: str | Path | None = None, multicast_port: int | None = None,
                  create_key: bool = False):
    """The group a process of ``level`` joins (:func:`strata.groups.group_spec`), on ``multicast_port``
    when one is given (``--multicast-port``: an embedded cluster's own port)."""
    spec = group_spec(config, level, Path(state_dir) if state_dir else None, create_key=create_key)
    if multicast_port:
        spec = replace(spec, port=int(multicast_port))
    return spec


def ready_writer(path: str | None, role: str):
    def ready(address, core, member):
        if path:
            tmp = Path(path + ".tmp")
            tmp.write_text(json.dumps({"role": role, "address": address, "pid": os.getpid()}))
            tmp.replace(path)
        progress(f"{role} listening on {address}")

    return ready


def server_tls(level: str, role: str, tls_dir: str | Path | None = None, state_dir: str | Path | None = None,
               insecure: bool = False) -> Path | None:
    """The TLS directory a master/worker of ``level`` (canonical) serves with: ``tls_dir``, else
    ``state_dir``/tls; None when ``insecure``.  Without its certificate there: one line (exit 1)."""
    if insecure:
        progress(f"WARNING: {role} runs without TLS (--insecure); only the group key protects it")
        return None
    path = Path(tls_dir) if tls_dir else (Path(state_dir) / "tls" if state_dir else None)
    if path is None or not has_material(path, role, level):
        where = path or "--tls-dir"
        raise CliError(f"no TLS certificate for the {role} of level {level} in {where}: create one with "
                       f"`strata certs --config ... --levels {level} --out DIR` and pass --tls-dir DIR "
                       f"(or --insecure for a development cluster)")
    return path


def start_logging(log_file: str | None) -> None:
    """A process's ``--log-file``: its output (and its children's) from now on into that file, rotated."""
    if log_file:
        capture_output(log_file)


def add_process_options(p, level=True) -> None:
    """The options every process of a level takes (``strata master``, ``strata worker``)."""
    p.add_argument("--config", required=True)
    if level:
        p.add_argument("--level", required=True)
    p.add_argument("--state-dir", help="where keys, logs and state live")
    p.add_argument("--multicast-port", type=int, help="override the group's multicast port")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--log-file", metavar="PATH",
                   help="write this process's output (and its children's: the Spark JVM's) to PATH, rotated at "
                        "16 MiB with two older files kept (strata/logs.py); default: inherited stdout/stderr")
    if level:
        p.add_argument("--tls-dir", help="certificates from `strata certs` (default: STATE_DIR/tls)")
        p.add_argument("--insecure", action="store_true", help="no TLS (development only)")
