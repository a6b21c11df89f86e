"""A worker's own Prometheus metrics, served by the worker itself over HTTPS with mutual TLS (issue 35).

``[groups."L"] worker_metrics_port`` turns it on for the workers of level L (unset: off, the default;
0: any free port).  Each worker then serves ``/metrics`` on its own address: the host of its
``--listen`` (a worker listening on every interface serves on ``STRATA_GROUP_INTERFACE``, else on
loopback; never on every interface), answering 503 until the worker is ready.  It says where in one
line of its log and, in an embedded cluster, in ``run/worker-<level>-<i>.metrics.json`` beside its
ready file (:func:`metrics_file`).

Who may scrape: only the holder of the level's **scraper certificate** (``scraper-<level>.pem``:
``O=Strata, OU=<level>, CN=scraper.<level>.strata``, client authentication only), which the
deployment's CA issues with ``strata scraper-cert`` (:func:`issue_scraper`) and which is given to
the level's operators' Prometheus only.  The TLS handshake requires a certificate of the CA (none, or
another CA's: no handshake); then the certificate must be the scraper certificate of the worker's
own level (403 otherwise: a scraper certificate of another level, the level's ``client``
certificate, a ``master`` or ``worker`` one).  Why a certificate of its own: the level's client
certificate is every user's of the level (analysts log in with it), while what a worker shows is the
operational view the master gives only to operators (``strata status``'s cluster part); the
components' certificates must not leave their hosts.  No password is asked: the worker has no
sessions and no users; the certificate is the credential.  The worker serves with its own
``worker-<level>`` certificate (a scraper checks the name ``worker.<level>.strata``).

What a scrape carries (a registry of the worker's own, not the process's global one): chunks
evaluated (dispatch units, one per Execute), query chunks, tuples received per level, query
failures, refused calls by reason, the seconds per unit as histograms (``strata_worker_chunk_seconds``,
stages ``engine``: the queries' engine time, the same measure the master's ``engine`` stage sums;
``call``: the whole evaluation on the worker, decoding, checks and encoding included;
``transport``: ``call`` minus ``engine``, the worker's part of the master's ``transport`` stage),
busy seconds, units in flight, the CPU reading its last heartbeat carried (Algorithm 5's load, as
the master sees it) and the Spark jobs its session started.  A worker of level L evaluates only
chunks whose every tuple L dominates (:class:`~strata.worker.service.WorkerCore` refuses any other
whole, before evaluating it; the level's master drops the rest on arrival), so everything here is
level-L data; tests/test_worker_metrics.py compares a worker's scrapes with and without input above
its level arriving at its master.  (A trusted worker serving several levels counts them all: its
metrics are data of the level it runs at, their top, and only that level's scraper may scrape.)

The module is plain logic around a :class:`~strata.worker.service.WorkerCore` and a group member
(:class:`WorkerMetrics`, :class:`MetricsEndpoint`); worker/main.py hooks it in (:func:`endpoint_of`,
:func:`on_ready`).
"""

from __future__ import annotations

import http.server
import json
import os
import ssl
import sys
import threading
import time
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from strata.errors import EXIT_OK, EXIT_REJECTED, CliError
from strata.tls import SCRAPER, TlsError, cert_paths, dns_name, issue_scraper

__all__ = ["SCRAPER", "BOUNDS", "STAGES", "WorkerMetrics", "MetricsEndpoint", "scraper_level", "issue_scraper",
           "metrics_host", "metrics_file", "endpoint_of", "on_ready", "scrape", "add_parsers", "CONTENT_TYPE"]

#: the histograms' upper bounds in seconds (the master's chunk histograms', master/timings.py)
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: the stages of ``strata_worker_chunk_seconds``
STAGES = ("engine", "transport", "call")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Histogram:
    """Cumulative counts of observations per stage at or under each bound, their sums and counts."""

    def __init__(self, stages=STAGES, bounds=BOUNDS):
        self.bounds = tuple(bounds)
        self._counts = {s: [0] * (len(self.bounds) + 1) for s in stages}
        self._sums = dict.fromkeys(stages, 0.0)
        self._lock = threading.Lock()

    def observe(self, stage: str, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        i = next((k for k, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        with self._lock:
            self._counts[stage][i] += 1
            self._sums[stage] += seconds

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["stage"])
        with self._lock:
            for stage, counts in self._counts.items():
                cum, buckets = 0, []
                for bound, n in zip((*self.bounds, float("inf")), counts):
                    cum += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
                fam.add_metric([stage], buckets, sum_value=self._sums[stage])
        return fam


class WorkerMetrics:
    """The metrics of one worker, on a registry of their own (:attr:`registry`).

    ``core``: the worker's :class:`~strata.worker.service.WorkerCore`; ``member``: its group member
    (heartbeats; None: no load reading); ``sid``: the worker's address (its name in the master's
    status).  :meth:`instrument` wraps the core's ``execute`` (and its shared executor's ``run``)
    and the member's ``reading`` to time each unit and keep the last reading sent; counters are read
    from the core at each scrape."""

    def __init__(self, core, member=None, sid: str = ""):
        self.core, self.member, self.sid = core, member, sid
        self.seconds = _Histogram()
        self.load: float | None = None  # the CPU reading of the last heartbeat
        self.heartbeats = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._instrumented = False
        metrics = self

        class _Collect(Collector):
            def collect(self):
                return metrics.families()

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collect())

    # -- observing ----------------------------------------------------------------------------
    def instrument(self) -> WorkerMetrics:
        """Time every unit the core evaluates and keep the member's heartbeat readings (once)."""
        if self._instrumented:
            return self
        self._instrumented = True
        core, local = self.core, threading.local()
        execute, run = core.execute, core.shared.run

        def timed_run(compiled, chunks):
            results = run(compiled, chunks)
            local.engine = getattr(local, "engine", 0.0) + sum(float((r.stats or {}).get("seconds", 0.0))
                                                               for r in results)
            return results

        def timed_execute(level, specs, chunk_bytes):
            local.engine = 0.0
            with self._lock:
                self.in_flight += 1
            t0 = time.perf_counter()
            try:
                out = execute(level, specs, chunk_bytes)
            finally:
                with self._lock:
                    self.in_flight -= 1
            self.observe(local.engine, time.perf_counter() - t0)
            return out

        core.shared.run = timed_run
        core.execute = timed_execute
        if self.member is not None:
            reading = self.member.reading

            def kept_reading():
                value = reading()
                with self._lock:
                    self.load, self.heartbeats = value, self.heartbeats + 1
                return value

            self.member.reading = kept_reading
        return self

    def observe(self, engine: float, call: float) -> None:
        """One evaluated unit: its engine seconds (the results' own) within ``call`` seconds."""
        engine = min(max(0.0, engine), call)
        self.seconds.observe("engine", engine)
        self.seconds.observe("transport", call - engine)
        self.seconds.observe("call", call)

    # -- the families ---------------------------------------------------------------------------
    def families(self) -> list:
        st = self.core.stats()
        level = str(self.core.level)
        info = GaugeMetricFamily("strata_worker_info", "this worker's level and address (value 1)",
                                 labels=["level", "worker"])
        info.add_metric([level, self.sid], 1)
        out = [info]

        def counter(name, doc, value, labels=None):
            fam = CounterMetricFamily(name, doc, labels=list(labels or {}))
            if labels is None:
                fam.add_metric([], value)
            else:
                for k, v in sorted(value.items()):
                    fam.add_metric([k], v)
            out.append(fam)

        def gauge(name, doc, value):
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            out.append(fam)

        counter("strata_worker_chunks_evaluated", "dispatch units evaluated (one Execute each: one or several "
                "merged chunks of the level's master)", st["chunks_done"])
        counter("strata_worker_query_chunks", "query chunks evaluated (one per query and unit)",
                st.get("sharing", {}).get("query_chunks", 0))
        counter("strata_worker_tuples", "tuples received in evaluated units, by their level", st["seen_levels"],
                {"level": None})
        counter("strata_worker_query_failures", "query chunks whose evaluation failed (the query's own failure: "
                "integer overflow, an engine error, not compiling on the worker)", st["failed_query_chunks"])
        counter("strata_worker_refused", "Execute calls refused, by reason", st["refused"], {"reason": None})
        counter("strata_worker_busy_seconds", "seconds spent evaluating queries", st["busy_seconds"])
        out.append(self.seconds.family("strata_worker_chunk_seconds", "seconds per evaluated unit on this worker "
                                       "(engine: the queries' engine time; call: the whole evaluation, decoding, "
                                       "checks and encoding included; transport: call - engine)"))
        with self._lock:
            in_flight, load, beats = self.in_flight, self.load, self.heartbeats
        gauge("strata_worker_in_flight_units", "units being evaluated now", in_flight)
        if self.member is not None:
            gauge("strata_worker_slots", "units this worker evaluates concurrently (advertised)",
                  getattr(self.member, "slots", 0))
            if load is not None:
                gauge("strata_worker_load_percent", "the CPU reading of this worker's last heartbeat (Algorithm 5: "
                      "busy at 90)", load)
            counter("strata_worker_heartbeats", "heartbeat readings taken (one per heartbeat)", beats)
        jobs = spark_jobs(getattr(self.core.engine, "spark", None))
        if jobs is not None:
            counter("strata_worker_spark_jobs", "Spark jobs this worker's session started", jobs[0])
            gauge("strata_worker_spark_active_jobs", "Spark jobs running now", jobs[1])
        return out

    def render(self) -> bytes:
        """The Prometheus text exposition of this worker's registry."""
        return generate_latest(self.registry)


def spark_jobs(spark) -> tuple[int, int] | None:
    """(jobs started, jobs running) of a Spark session from its status tracker (job ids count up from
    0: the highest retained one + 1), None without a session or if Spark does not answer."""
    if spark is None:
        return None
    try:
        tracker = spark.sparkContext.statusTracker()
        ids = list(tracker.getJobIdsForGroup(None)) + list(tracker.getActiveJobsIds())
        return (max(ids) + 1 if ids else 0), len(tracker.getActiveJobsIds())
    except Exception:  # noqa: BLE001 - a scrape never fails because Spark did not answer
        return None


# ---- who may scrape ---------------------------------------------------------------------------------
def scraper_level(pem: bytes) -> str | None:
    """The level of a scraper certificate (``O=Strata, OU=<level>, CN=scraper.<level>.strata``), else
    None.  Its chain is the TLS handshake's to check."""
    from cryptography import x509  # deferred: cryptography loads only once a scrape comes
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    name = cert.subject
    org = name.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    ou = name.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cn = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(org) != 1 or org[0].value != "Strata" or len(ou) != 1 or len(cn) != 1:
        return None
    level = str(ou[0].value)
    return level if str(cn[0].value) == dns_name(SCRAPER, level) else None


# ---- the endpoint ------------------------------------------------------------------------------------
class MetricsEndpoint:
    """``/metrics`` of one worker over HTTPS (see the module's doc): the socket is bound at once
    (``host``, ``port``; 0: any free one, :attr:`address` says which); :meth:`start` serves, with
    503 until the worker's metrics are set (:attr:`metrics`).  ``refused``: refusals by reason."""

    def __init__(self, tls_dir: Path | str, level: str, host: str = "127.0.0.1", port: int = 0,
                 handshake_seconds: float = 10.0):
        self.level = level
        self.metrics: WorkerMetrics | None = None
        self.refused: dict[str, int] = {}
        self._refused_lock = threading.Lock()
        cert, key = cert_paths(tls_dir, "worker", level)
        ca = Path(tls_dir) / "ca.pem"
        missing = [str(p) for p in (ca, cert, key) if not p.exists()]
        if missing:
            raise TlsError(f"TLS material missing: {', '.join(missing)} (create it with `strata certs`)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # the endpoint's log is its refusals' counts
                pass

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self, code: int, reason: str, text: str):
                endpoint.count(reason)
                self._send(code, (text + "\n").encode())

            def do_GET(self):
                if self.path.split("?", 1)[0] != "/metrics":
                    return self._refuse(404, "not_found", "only /metrics is served")
                der = self.connection.getpeercert(binary_form=True)
                level = scraper_level(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
                if level != endpoint.level:
                    return self._refuse(403, "tls_identity", f"the scraper certificate of level {endpoint.level} "
                                                             "is required (strata scraper-cert)")
                metrics = endpoint.metrics
                if metrics is None:
                    return self._refuse(503, "not_ready", "the worker is starting")
                self._send(200, metrics.render(), CONTENT_TYPE)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def finish_request(self, request, client_address):
                # the handshake in the request's own thread: a client that stalls it holds up no other
                request.settimeout(handshake_seconds)
                try:
                    tls = ctx.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    endpoint.count("tls_handshake")
                    return
                try:
                    super().finish_request(tls, client_address)
                finally:
                    tls.close()

        self.httpd = Server((host, int(port)), Handler, bind_and_activate=True)
        self.address = f"{self.httpd.server_address[0]}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def count(self, reason: str) -> None:
        with self._refused_lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    @property
    def url(self) -> str:
        host, port = self.address.rsplit(":", 1)
        return f"https://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def start(self, metrics: WorkerMetrics | None = None) -> MetricsEndpoint:
        """Serve (503 until :attr:`metrics` is set: the worker still starts)."""
        if metrics is not None:
            self.metrics = metrics
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="strata-worker-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()


def scrape(address: str, tls_dir: Path | str, level: str, cert: tuple[str, str] | None = ("", ""),
           path: str = "/metrics", timeout: float = 30.0) -> tuple[int, str]:
    """(HTTP status, body) of GET ``path`` from the metrics endpoint of a worker of ``level`` at
    ``address`` (``host:port``), presenting ``cert`` ((role, level) of a certificate in ``tls_dir``;
    by default the level's scraper certificate; None: none) and checking the worker's certificate
    (``worker.<level>.strata`` of the CA in ``tls_dir``).  A refused handshake raises ssl.SSLError."""
    import http.client  # deferred: only scrapers (tests, bench/dashboard_png.py) need the client side

    ctx = ssl.create_default_context(cafile=str(Path(tls_dir) / "ca.pem"))
    if cert == ("", ""):
        cert = (SCRAPER, level)
    if cert is not None:
        ctx.load_cert_chain(*cert_paths(tls_dir, *cert))
    name = dns_name("worker", level)

    class Connection(http.client.HTTPSConnection):
        def connect(self):
            http.client.HTTPConnection.connect(self)
            self.sock = ctx.wrap_socket(self.sock, server_hostname=name)

    host, port = address.rsplit(":", 1)
    conn = Connection(host.strip("[]"), int(port), context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


# ---- the hook of ``strata worker`` -------------------------------------------------------------------
def metrics_host(listen: str, environ=None) -> str:
    """Where a worker listening on ``listen`` serves its metrics: that host (the level's interface),
    else ``STRATA_GROUP_INTERFACE`` for a worker listening on every interface, else loopback."""
    environ = os.environ if environ is None else environ
    host = (listen.rsplit(":", 1)[0] if ":" in listen else listen).strip().strip("[]")
    if host and host not in ("0.0.0.0", "::", "*"):
        return host
    return (environ.get("STRATA_GROUP_INTERFACE") or "").strip() or "127.0.0.1"


def metrics_file(ready_file: str | Path) -> Path:
    """The file beside a worker's ready file that says where it serves its metrics."""
    p = Path(ready_file)
    return p.with_name(p.name[:-5] + ".metrics.json" if p.name.endswith(".json") else p.name + ".metrics.json")


def endpoint_of(config, level: str, listen: str, tls_dir) -> MetricsEndpoint | None:
    """The endpoint ``[groups."L"] worker_metrics_port`` asks for, serving now (503 until the worker is
    ready; a port in use or missing certificates: one line before the worker starts), or None when it
    is unset."""
    port = config.group(level).worker_metrics_port
    if port is None:
        return None
    if tls_dir is None:
        raise CliError(f'[groups."{level}"] worker_metrics_port: a worker serves its metrics over TLS only; '
                       f"it needs its certificate (not --insecure)", EXIT_REJECTED)
    host = metrics_host(listen)
    try:
        return MetricsEndpoint(tls_dir, level, host, port).start()
    except (TlsError, ssl.SSLError, OSError) as e:
        raise CliError(f"cannot serve the worker's metrics on {host}:{port}: {e}") from None


def on_ready(endpoint: MetricsEndpoint | None, ready_file: str | None, ready):
    """The worker's ready callback with its metrics served first (``endpoint`` None: ``ready`` itself)."""
    if endpoint is None:
        return ready

    def serve_then_ready(address, core, member):
        endpoint.start(WorkerMetrics(core, member, sid=address).instrument())
        if ready_file:
            f = metrics_file(ready_file)
            tmp = f.with_name(f.name + ".tmp")
            tmp.write_text(json.dumps({"role": "worker-metrics", "worker": address, "level": str(core.level),
                                       "address": endpoint.address, "url": endpoint.url, "pid": os.getpid()}))
            tmp.replace(f)
        print(f"[strata] worker {address} serves its metrics on {endpoint.url} (the level's scraper certificate "
              f"only)", file=sys.stderr, flush=True)
        if ready is not None:
            ready(address, core, member)

    return serve_then_ready


# ---- strata scraper-cert ---------------------------------------------------------------------------
def add_parsers(sub) -> None:
    p = sub.add_parser("scraper-cert", help="issue a level's scraper certificate: the only one its workers' "
                                            "metrics endpoints answer (give it to the level's operators only)")
    p.add_argument("--config", required=True)
    p.add_argument("--levels", required=True, help="comma-separated levels")
    p.add_argument("--out", required=True, help="the directory of the CA (ca.pem, ca.key) from `strata certs`; "
                                                "scraper-<level>.pem/.key are written there")
    p.set_defaults(func=cmd_scraper_cert)


def cmd_scraper_cert(args) -> int:
    # deferred: the CLI's helpers (the client commands' module) load only for this command
    from strata.cli_support import config_of
    from strata.commands import parse_levels

    cfg = config_of(args)
    try:
        for level in parse_levels(cfg, args.levels):
            for f in issue_scraper(args.out, level):
                print(f)
    except TlsError as e:
        raise CliError(str(e), EXIT_REJECTED) from None
    print(f"[strata] give scraper-<level>.pem/.key only to the level's operators' scraper (its workers' "
          f"/metrics: [groups.\"L\"] worker_metrics_port)", file=sys.stderr, flush=True)
    return EXIT_OK

