"""``strata metrics``: a level's master's status as Prometheus metrics, for an operator's scraper.

An exporter beside the master (the Prometheus pattern): it serves ``/metrics`` over HTTPS and, for each
scrape, asks the master for the status *of the scraping operator's session*, so a scrape carries
exactly what ``strata status`` shows an operator of the level, nothing that depends on data above it
(the master builds that status from kept rows only: docs/semantics.md §9), and nothing more.

Who may scrape, two checks like every other link of the level:

* TLS with a client certificate of the level (``client-<level>`` of the deployment's CA, as ``strata
  up`` or ``strata certs`` make it): the handshake fails without one, a certificate of another level
  or role is refused with 403;
* HTTP basic authentication with a user's password: the exporter logs that user in at the level
  (the master checks the password with argon2 and throttles guesses; the session is kept for later
  scrapes with the same credentials) and serves only if the session has the ``operator`` role (403
  otherwise; 401 for a failed login).  The exporter holds no password of its own.

The metrics (all gauges or counters of the status's values; ``level`` is a label of ``strata_info``):
workers (cpu, chunks done, in flight), backlog and ready chunks, lag in instants, the counters
(``strata_events_total{event=...}``), refusals (``strata_rejected_total{reason=...}``), and the last
chunks' timings per stage (``strata_chunk_milliseconds{stage, quantile}``), and every chunk's since the
master started as histograms (``strata_chunk_seconds{stage}``: wait, rtt, engine, transport, latency).  docs/operations.md
*Metrics* has the scrape configuration and docs/grafana/strata.json a dashboard.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import signal
import ssl
import threading
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from .errors import EXIT_OK, EXIT_REJECTED, CliError
from .tls import TlsError, cert_paths, read_identity

__all__ = ["families", "MetricsServer", "add_parsers", "cmd_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def families(reply) -> list:
    """The metric families of an operator's StatusReply (``reply.cluster`` set)."""
    info = GaugeMetricFamily("strata_info", "the master's level (value 1)", labels=["level"])
    info.add_metric([reply.level], 1)
    out = [info]
    workers = GaugeMetricFamily("strata_workers", "workers the master lists")
    workers.add_metric([], len(reply.workers))
    cpu = GaugeMetricFamily("strata_worker_cpu_percent", "a worker's CPU reading (Algorithm 5)", labels=["worker"])
    flight = GaugeMetricFamily("strata_worker_in_flight", "chunks a worker computes now", labels=["worker"])
    done = CounterMetricFamily("strata_worker_chunks", "chunks a worker computed", labels=["worker"])
    for w in reply.workers:
        cpu.add_metric([w.sid], w.cpu)
        flight.add_metric([w.sid], w.in_flight)
        done.add_metric([w.sid], w.chunks_done)
    out += [workers, cpu, flight, done]
    for name, doc, value in (("strata_backlog_chunks", "chunks cut and not yet released", reply.backlog_chunks),
                             ("strata_ready_chunks", "closed chunks waiting for a worker", reply.ready_chunks),
                             ("strata_lag_instants", "latest instant ingested minus latest released",
                              reply.lag_seconds)):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        out.append(g)
    events = CounterMetricFamily("strata_events", "the master's counters (accepted rows, chunks, failures, ...)",
                                 labels=["event"])
    for k, v in sorted(reply.counters.items()):
        events.add_metric([k], v)
    rejected = CounterMetricFamily("strata_rejected", "refused input, calls and datagrams by reason",
                                   labels=["reason"])
    for k, v in sorted(reply.rejected.items()):
        rejected.add_metric([k], v)
    timing = GaugeMetricFamily("strata_chunk_milliseconds", "the last chunks' time per stage (wait, rtt, engine, "
                               "transport) at the 50th and 99th percentile", labels=["stage", "quantile"])
    extra = {}
    for k, v in sorted(reply.timings.items()):
        parts = k.split("_")
        if len(parts) == 3 and parts[1] in ("p50", "p99") and parts[2] == "ms":
            timing.add_metric([parts[0], "0." + parts[1][1:]], v)
        else:
            extra[k] = v
    out += [events, rejected, timing]
    hist = histogram_family(dict(reply.histograms))
    if hist is not None:
        out.append(hist)
    if extra:  # chunks (units timed), merged_p50 / merged_max (chunks per unit)
        g = GaugeMetricFamily("strata_chunk_timing", "the units behind strata_chunk_milliseconds: how many "
                              "(chunks) and chunks per unit (merged_p50, merged_max)", labels=["value"])
        for k, v in extra.items():
            g.add_metric([k], v)
        out.append(g)
    return out


def histogram_family(h: dict):
    """``strata_chunk_seconds{stage}``: every dispatch unit since the master started, per stage (wait,
    rtt, engine, transport, latency = ready to result), from the status's cumulative counts
    (master/timings.py); None before the first unit."""
    stages: dict[str, dict] = {}
    for k, v in h.items():
        stage, _, rest = k.partition("_")
        st = stages.setdefault(stage, {"buckets": []})
        if rest.startswith("le_"):
            st["buckets"].append((rest[3:], v))
        else:
            st[rest] = v
    if not stages:
        return None
    fam = HistogramMetricFamily("strata_chunk_seconds", "every dispatch unit since the master started: seconds per "
                                "stage (wait: closed to sent; rtt: sent to result; engine; transport; latency: "
                                "closed to result)", labels=["stage"])
    for stage, st in sorted(stages.items()):
        buckets = sorted(st["buckets"], key=lambda b: float(b[0]))
        fam.add_metric([stage], [(b, n) for b, n in buckets], sum_value=st.get("sum", 0.0))
    return fam


def render(reply) -> bytes:
    """The Prometheus text exposition of an operator's StatusReply."""
    class _Once(Collector):
        def collect(self):
            return families(reply)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once())
    return generate_latest(registry)


class _Sessions:
    """Logged-in sessions by the digest of the credentials that opened them (one login per user)."""

    def __init__(self, master: str, level: str, tls_dir: str, connect):
        self.master, self.level, self.tls_dir, self._connect = master, level, tls_dir, connect
        self._by_key: dict[str, object] = {}
        self._lock = threading.Lock()

    def status(self, user: str, password: str):
        from .api import SessionEnded  # deferred: loads pyarrow and gRPC (only once a scrape comes)

        key = hashlib.sha256(f"{user}\0{password}".encode()).hexdigest()
        with self._lock:
            s = self._by_key.get(key)
            if s is None:
                s = self._connect(self.master, user, self.level, tls_dir=self.tls_dir, password=password)
                self._by_key[key] = s
        try:
            return s.client.status()
        except SessionEnded:
            with self._lock:
                self._by_key.pop(key, None)
            raise

    def close(self) -> None:
        with self._lock:
            for s in self._by_key.values():
                s.close()
            self._by_key.clear()


class MetricsServer:
    """The HTTPS exporter of one level's master (see the module's doc).  ``listen``: ``host:port``
    (port 0: any free one; :attr:`address` says which)."""

    def __init__(self, master: str, level: str, tls_dir: str | Path, listen: str = "127.0.0.1:0", connect=None):
        if connect is None:
            from .api import connect  # deferred: loads pyarrow and gRPC
        self.level = level
        self.sessions = _Sessions(master, level, str(tls_dir), connect)
        self.refused: dict[str, int] = {}
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert, key = cert_paths(tls_dir, "client", level)
        ca = Path(tls_dir) / "ca.pem"
        missing = [str(p) for p in (ca, cert, key) if not p.exists()]
        if missing:
            raise TlsError(f"TLS material missing: {', '.join(missing)} (create it with `strata certs`)")
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        host, _, port = listen.rpartition(":")
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # the exporter's log is its refusals' counts
                pass

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", extra=()):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self, code: int, reason: str, text: str, extra=()):
                exporter.refused[reason] = exporter.refused.get(reason, 0) + 1
                self._send(code, (text + "\n").encode(), extra=extra)

            def do_GET(self):
                if self.path.split("?", 1)[0] != "/metrics":
                    return self._refuse(404, "not_found", "only /metrics is served")
                der = self.connection.getpeercert(binary_form=True)
                who = read_identity(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
                if who is None or who.role != "client" or who.level != exporter.level:
                    return self._refuse(403, "tls_identity", f"a client certificate of level {exporter.level} "
                                                             "is required")
                user, password = _basic(self.headers.get("Authorization"))
                if user is None:
                    return self._refuse(401, "no_credentials", "an operator's user and password are required "
                                        "(HTTP basic authentication)",
                                        extra=[("WWW-Authenticate", 'Basic realm="strata"')])
                from .api import LoginFailed, SessionEnded, StrataError  # deferred: loads pyarrow and gRPC

                try:
                    reply = exporter.sessions.status(user, password)
                except (LoginFailed, SessionEnded) as e:
                    return self._refuse(401, "login_failed", str(e),
                                        extra=[("WWW-Authenticate", 'Basic realm="strata"')])
                except StrataError as e:
                    return self._refuse(502, "master_unavailable", f"the master did not answer: {e}")
                if not reply.cluster:
                    return self._refuse(403, "not_operator", "the operator role is required")
                self._send(200, render(reply), CONTENT_TYPE)

        self.httpd = http.server.ThreadingHTTPServer((host or "127.0.0.1", int(port or 0)), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.address = f"{self.httpd.server_address[0]}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="strata-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.sessions.close()


def _basic(header: str | None) -> tuple[str | None, str | None]:
    if not header or not header.startswith("Basic "):
        return None, None
    try:
        user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None, None
    return (user, password) if sep and user else (None, None)


# ---- the command ---------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    p = sub.add_parser("metrics", help="serve a level's master's status as Prometheus metrics over HTTPS "
                                       "(scrapers: the level's client certificate and an operator's password)")
    p.add_argument("--master", required=True, help="the level's master, host:port (or its masters a:port,b:port)")
    p.add_argument("--level", required=True, help="the master's level")
    p.add_argument("--tls-dir", help="the CA and the level's client certificate (default $STRATA_TLS_DIR)")
    p.add_argument("--listen", default="127.0.0.1:9464", help="address to serve on (default 127.0.0.1:9464)")
    p.add_argument("--ready-file", help="write {\"address\": ...} here once serving")
    p.set_defaults(func=cmd_metrics)


def cmd_metrics(args) -> int:
    tls_dir = args.tls_dir or os.environ.get("STRATA_TLS_DIR")
    if not tls_dir:
        raise CliError("give --tls-dir (the CA and the level's client certificate): metrics are served over TLS only",
                       EXIT_REJECTED)
    try:
        server = MetricsServer(args.master, args.level, tls_dir, args.listen)
    except (TlsError, ssl.SSLError, OSError) as e:
        raise CliError(f"cannot serve metrics: {e}") from None
    server.start()
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps({"address": server.address}))
    print(f"strata: serving metrics of the {args.level} master {args.master} on https://{server.address}/metrics",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return EXIT_OK
