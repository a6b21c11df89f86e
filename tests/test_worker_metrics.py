"""A worker's own metrics endpoint (worker/metrics.py, issue 35).

Offline: the families of a worker core and how they move as units are evaluated (a stand-in engine),
the endpoint's TLS rule (only the scraper certificate of the worker's level; none, another CA's,
another level's and every other role's are refused), the hook's settings, and that every metric the
Grafana dashboard (docs/grafana/strata.json) plots is one the exporter or a worker serves.  Against a
running cluster (``[groups."S"] worker_metrics_port = 0``): the same refusals on a real worker, values
that move as its chunks are evaluated, and a worker's scrapes the same with and without tuples above S
arriving at its master (the volatile values aside), like tests/test_metrics.py for the exporter."""

from __future__ import annotations

import json
import re
import ssl
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.chunking.codec import encode_chunk
from strata.chunking.model import ChunkResult
from strata.config import parse_config
from strata.errors import CliError
from strata.examples import BATTLEFIELD_TOML
from strata.master.local import cut_chunks
from strata.rpc import strata_pb2 as pb
from strata.tls import create_deployment
from strata.worker.metrics import (BOUNDS, MetricsEndpoint, WorkerMetrics, endpoint_of, issue_scraper, metrics_file,
                                   metrics_host, on_ready, scrape, scraper_level)
from strata.worker.service import QuerySpecData, WorkerCore

from .polling import poll

ROOT = Path(__file__).resolve().parents[1]
QUERY = "SELECT sid, COUNT(*) AS n FROM Vitals [ROWS 2] GROUP BY sid"


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _vitals(rows) -> pa.Table:
    n = len(rows)
    return pa.table({"ts": pa.array([t for t, _ in rows], pa.int64()), "level": [lv for _, lv in rows],
                     "sid": [f"s{t % 3}" for t, _ in rows], "bp": [float(100 + t) for t, _ in rows],
                     "pr": [1.0] * n, "weight": [1.0] * n})


class FakeEngine:
    """Results without rows, each taking ``seconds`` of "engine" time; ``fail``: query ids that fail."""

    def __init__(self, config, seconds: float = 0.002, fail=()):
        self.config, self.seconds, self.fail = config, seconds, set(fail)
        self.gate: threading.Event | None = None  # set: run() waits for it (a unit in flight)

    def run(self, cq, qc, isolate: bool = True):
        if self.gate is not None:
            self.gate.wait(30)
        rows = pa.schema([pa.field("ts", pa.int64()), pa.field("level", pa.string())]).empty_table()
        error = "integer overflow: test" if qc.query_id in self.fail else None
        return ChunkResult(qc.query_id, qc.chunk_id, rows, stats={"seconds": self.seconds},
                           error=error, error_ts=min(qc.instants) if error else None)


class FakeMember:
    slots = 2

    def __init__(self):
        self.value = 37.5

    def reading(self):
        return self.value


@pytest.fixture(scope="module")
def battlefield():
    return parse_config(BATTLEFIELD_TOML)


def _units(cfg, queries, rows):
    """The encoded chunks (one unit each) of ``queries`` over Vitals ``rows`` at S, and the query ids."""
    _, ids, chunks = cut_chunks(cfg, "S", queries, {"Vitals": _vitals(rows)}, 2)
    return [encode_chunk(c) for c in chunks], ids


# ---- offline ------------------------------------------------------------------------------------------
def test_the_values_move_as_units_are_evaluated(battlefield):
    engine = FakeEngine(battlefield, seconds=1e-6)  # less than any call takes: engine is not capped by it
    core = WorkerCore(battlefield, "S", engine)
    member = FakeMember()
    m = WorkerMetrics(core, member, sid="127.0.0.1:5000").instrument()
    before = _samples(m.render().decode())
    assert before[("strata_worker_info", (("level", "S"), ("worker", "127.0.0.1:5000")))] == 1
    assert before[("strata_worker_chunks_evaluated_total", ())] == 0
    assert before[("strata_worker_chunk_seconds_count", (("stage", "engine"),))] == 0
    assert ("strata_worker_load_percent", ()) not in before  # no heartbeat yet

    rows = [(1, "U"), (2, "S"), (3, "C"), (4, "S"), (5, "U"), (6, "C")]
    units, ids = _units(battlefield, [QUERY, "SELECT AVG(bp) FROM Vitals [ROWS 3]"], rows)
    engine.fail = {ids[1]}
    texts = {ids[0]: QUERY, ids[1]: "SELECT AVG(bp) FROM Vitals [ROWS 3]"}
    for u in units:
        core.execute("S", [QuerySpecData(q, texts[q], "S") for q in ids], u)
    member.reading()  # a heartbeat's reading
    got = _samples(m.render().decode())
    n = len(units)
    assert n >= 2
    assert got[("strata_worker_chunks_evaluated_total", ())] == n
    assert got[("strata_worker_query_chunks_total", ())] == 2 * n
    assert got[("strata_worker_query_failures_total", ())] == n  # the failing query, in every unit
    assert got[("strata_worker_tuples_total", (("level", "U"),))] >= 2
    assert {k[1][0][1] for k in got if k[0] == "strata_worker_tuples_total"} == {"U", "C", "S"}
    for stage in ("engine", "transport", "call"):
        assert got[("strata_worker_chunk_seconds_count", (("stage", stage),))] == n
        counts = [got[("strata_worker_chunk_seconds_bucket", (("le", repr(b)), ("stage", stage)))] for b in BOUNDS]
        assert counts == sorted(counts)
    # engine: the results' own seconds (two queries per unit), within the call's
    assert got[("strata_worker_chunk_seconds_sum", (("stage", "engine"),))] == pytest.approx(n * 2 * 1e-6)
    assert got[("strata_worker_chunk_seconds_sum", (("stage", "call"),))] == pytest.approx(
        got[("strata_worker_chunk_seconds_sum", (("stage", "engine"),))]
        + got[("strata_worker_chunk_seconds_sum", (("stage", "transport"),))])
    assert got[("strata_worker_load_percent", ())] == 37.5 and got[("strata_worker_heartbeats_total", ())] == 1
    assert got[("strata_worker_in_flight_units", ())] == 0 and got[("strata_worker_slots", ())] == 2
    assert not any(k[0].startswith("strata_worker_spark") for k in got)  # no Spark session here

    # a unit in flight shows while it is evaluated
    engine.gate = threading.Event()
    t = threading.Thread(target=core.execute, args=("S", [QuerySpecData(q, texts[q], "S") for q in ids], units[0]))
    t.start()
    try:
        assert poll(lambda: _samples(m.render().decode())[("strata_worker_in_flight_units", ())] == 1, 10)
    finally:
        engine.gate.set()
        t.join(30)
    assert _samples(m.render().decode())[("strata_worker_in_flight_units", ())] == 0

    # a refused call is counted by reason, not as a unit
    with pytest.raises(PermissionError):
        core.execute("TS", [], units[0])
    got = _samples(m.render().decode())
    assert got[("strata_worker_refused_total", (("reason", "wrong_level"),))] == 1
    assert got[("strata_worker_chunks_evaluated_total", ())] == n + 1


def test_the_registry_is_the_workers_own(battlefield):
    from prometheus_client import REGISTRY

    m = WorkerMetrics(WorkerCore(battlefield, "S", FakeEngine(battlefield)), sid="w")
    assert m.registry is not REGISTRY
    assert not any(name.startswith("strata_worker") for name in REGISTRY._names_to_collectors)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A CA with the certificates of S and TS, their scraper certificates, and another deployment's."""
    d = tmp_path_factory.mktemp("tls")
    create_deployment(d / "ca", ["S", "TS"])
    for lv in ("S", "TS"):
        issue_scraper(d / "ca", lv)
    create_deployment(d / "other", ["S"], roles=("worker",))
    issue_scraper(d / "other", "S")
    return d


def test_a_scraper_certificate_names_its_level(tls):
    assert scraper_level((tls / "ca" / "scraper-S.pem").read_bytes()) == "S"
    assert scraper_level((tls / "ca" / "scraper-TS.pem").read_bytes()) == "TS"
    for role in ("client", "master", "worker"):
        assert scraper_level((tls / "ca" / f"{role}-S.pem").read_bytes()) is None
    assert scraper_level(b"not a certificate") is None
    with pytest.raises(Exception, match="no CA"):
        issue_scraper(tls / "nowhere", "S")


def test_strata_scraper_cert_issues_per_level(tmp_path, capsys):
    from strata.cli import main
    from strata.errors import EXIT_OK

    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    argv = ["scraper-cert", "--config", str(cfg), "--levels", "S,TS", "--out", str(tmp_path / "pki")]
    assert main(argv) != EXIT_OK  # no CA there: refused in one line
    assert "no CA in" in capsys.readouterr().err
    create_deployment(tmp_path / "pki", ["S"])
    assert main(argv) == EXIT_OK
    assert [scraper_level((tmp_path / "pki" / f"scraper-{lv}.pem").read_bytes()) for lv in ("S", "TS")] == ["S", "TS"]
    assert oct((tmp_path / "pki" / "scraper-S.key").stat().st_mode & 0o777) == "0o600"


def _refusals(endpoint, tls_dir: Path, other: Path) -> None:
    """Everything but the scraper certificate of the endpoint's level is refused."""
    with pytest.raises(ssl.SSLError):
        scrape(endpoint.address, tls_dir, "S", cert=None)  # no client certificate: no handshake
    # a scraper certificate of another deployment's CA: no handshake either (the scraper checks the
    # worker against its own CA, so present it with this CA's trust but the other's key)
    import shutil

    mixed = other / "mixed"
    mixed.mkdir(exist_ok=True)
    shutil.copy(tls_dir / "ca.pem", mixed / "ca.pem")
    for f in ("scraper-S.pem", "scraper-S.key"):
        shutil.copy(other / f, mixed / f)
    with pytest.raises(ssl.SSLError):
        scrape(endpoint.address, mixed, "S")
    assert scrape(endpoint.address, tls_dir, "S", cert=("scraper", "TS"))[0] == 403  # another level's
    for role in ("client", "master", "worker"):  # the level's other certificates
        assert scrape(endpoint.address, tls_dir, "S", cert=(role, "S"))[0] == 403, role
    assert scrape(endpoint.address, tls_dir, "S", path="/")[0] == 404


def test_only_the_levels_scraper_certificate_may_scrape(battlefield, tls):
    d = tls / "ca"
    endpoint = MetricsEndpoint(d, "S").start()
    try:
        assert endpoint.address.startswith("127.0.0.1:") and not endpoint.address.endswith(":0")
        code, body = scrape(endpoint.address, d, "S")
        assert code == 503, body  # serving before the worker is ready: not yet
        endpoint.metrics = WorkerMetrics(WorkerCore(battlefield, "S", FakeEngine(battlefield)), sid="w")
        code, body = scrape(endpoint.address, d, "S")
        assert code == 200 and "strata_worker_chunks_evaluated_total 0.0" in body
        _refusals(endpoint, d, tls / "other")
        assert endpoint.refused == {"not_ready": 1, "tls_handshake": 2, "tls_identity": 4, "not_found": 1}
        # a scraper that checks the worker's name: a TS worker's certificate is not an S worker's
        ts = MetricsEndpoint(d, "TS").start()
        try:
            with pytest.raises(ssl.SSLError):
                scrape(ts.address, d, "S")  # expects worker.s.strata, the server says worker.ts.strata
        finally:
            ts.stop()
    finally:
        endpoint.stop()


def test_the_hook_follows_the_setting(battlefield, tls, tmp_path):
    assert endpoint_of(battlefield, "S", "127.0.0.1:0", tls / "ca") is None  # off by default
    on = parse_config(BATTLEFIELD_TOML + '\n[groups."S"]\nworker_metrics_port = 0\n')
    assert on.group("S").worker_metrics_port == 0 and on.group("TS").worker_metrics_port is None
    with pytest.raises(CliError, match="over TLS only"):
        endpoint_of(on, "S", "127.0.0.1:0", None)  # --insecure
    with pytest.raises(CliError, match="cannot serve"):
        endpoint_of(on, "S", "127.0.0.1:0", tmp_path)  # no certificate
    endpoint = endpoint_of(on, "S", "127.0.0.1:0", tls / "ca")
    try:
        taken = parse_config(BATTLEFIELD_TOML + f'\n[groups."S"]\nworker_metrics_port = '
                                                f'{endpoint.address.rsplit(":", 1)[1]}\n')
        with pytest.raises(CliError, match="cannot serve"):
            endpoint_of(taken, "S", "127.0.0.1:0", tls / "ca")  # the port is in use: one line
        ready_file = tmp_path / "worker-s-0.json"
        called = []
        hook = on_ready(endpoint, str(ready_file), lambda *a: called.append(a))
        core = WorkerCore(battlefield, "S", FakeEngine(battlefield))
        hook("127.0.0.1:4711", core, FakeMember())
        assert len(called) == 1 and endpoint.metrics is not None
        info = json.loads(metrics_file(ready_file).read_text())
        assert metrics_file(ready_file).name == "worker-s-0.metrics.json"
        assert info["address"] == endpoint.address and info["worker"] == "127.0.0.1:4711" and info["level"] == "S"
        assert scrape(info["address"], tls / "ca", "S")[0] == 200
    finally:
        endpoint.stop()
    assert on_ready(None, None, print) is print
    assert metrics_host("10.0.0.5:7000") == "10.0.0.5" and metrics_host("[::1]:7000") == "::1"
    assert metrics_host("0.0.0.0:7000", {}) == "127.0.0.1"  # never every interface
    assert metrics_host("0.0.0.0:7000", {"STRATA_GROUP_INTERFACE": "10.0.0.6"}) == "10.0.0.6"


def test_the_dashboard_plots_only_served_metrics(battlefield):
    """Every metric docs/grafana/strata.json queries is one the exporter (strata/metrics.py) or a worker
    serves."""
    from strata.metrics import render

    reply = pb.StatusReply(level="S", cluster=True, workers=[pb.WorkerStatus(sid="w", cpu=1.0)],
                           counters={"accepted": 1}, rejected={"bad_type": 1}, timings={"engine_p99_ms": 1.0},
                           histograms={"latency_le_0.005": 1, "latency_sum": 0.001, "latency_count": 1})
    served = {s[0] for s in _samples(render(reply).decode())}
    m = WorkerMetrics(WorkerCore(battlefield, "S", FakeEngine(battlefield)), FakeMember(), sid="w").instrument()
    m.core.refused["wrong_level"] += 1
    m.core.seen_levels["S"] += 1
    m.member.reading()
    served |= {s[0] for s in _samples(m.render().decode())}
    served |= {"strata_worker_spark_jobs_total", "strata_worker_spark_active_jobs"}  # with a Spark session
    board = json.loads((ROOT / "docs" / "grafana" / "strata.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    named = {n for e in exprs for n in re.findall(r"\b(strata_[a-z_]+)", e)}
    assert named and named <= served, named - served
    assert any(n.startswith("strata_worker_chunk_seconds") for n in named)  # the workers' own panels


# ---- against a running cluster -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    """An S cluster of the battlefield config whose worker serves its metrics (port 0)."""
    from .helpers import WarmCluster

    cluster = WarmCluster(tmp_path_factory.mktemp("metered"),
                          BATTLEFIELD_TOML + '\n[groups."S"]\nworker_metrics_port = 0\n', "S", 1)
    try:
        tls = cluster.state / "tls"
        # strata up issued S's scraper certificate (S's workers serve /metrics); TS's for the refusals below
        assert (tls / "scraper-S.pem").exists() and (tls / "scraper-S.key").exists()
        issue_scraper(tls, "TS")
        yield cluster
    finally:
        cluster.stop()


def _volatile(name: str) -> bool:
    """Times, loads, Spark jobs and what depends on how the master merged chunks into units."""
    return name.startswith(("strata_worker_chunk_seconds", "strata_worker_busy_seconds", "strata_worker_load_percent",
                            "strata_worker_heartbeats", "strata_worker_spark", "strata_worker_in_flight",
                            "strata_worker_chunks_evaluated", "strata_worker_query_chunks"))


@pytest.mark.slow
def test_a_workers_metrics_move_and_do_not_depend_on_input_above_its_level(metered, tmp_path):
    from .helpers import login

    ready = json.loads((metered.state / "cluster.json").read_text())["processes"]
    worker = next(p for p in ready if p["role"] == "worker")
    info = json.loads(metrics_file(worker["ready"]).read_text())
    tls = metered.state / "tls"
    assert info["address"].startswith("127.0.0.1:") and info["level"] == "S"
    address = info["address"]
    _refusals(type("E", (), {"address": address})(), tls, _other_ca(tmp_path))

    rows = [(1, "U"), (2, "S"), (3, "C"), (4, "S"), (5, "U")]
    above = [(2, "TS"), (4, "TS"), (6, "TS")]
    seen = []
    for with_ts in (False, True):
        cl = metered.renew({"op": ("S", "operator,producer,analyst")})
        op = login(cl, "op")
        try:
            assert poll(lambda: len(op.status().workers) == 1, 30), "the worker did not join the fresh master"
            code, body = scrape(address, tls, "S")
            assert code == 200, body
            before = _samples(body)
            q = op.register([QUERY])[0].query_id
            op.ingest([("Vitals", _vitals(sorted(rows + (above if with_ts else []))))], labelled=True)
            op.advance(finish=True)
            assert poll(lambda: next(x for x in op.status().queries if x.query_id == q).state == "ended", 60), \
                "the query did not end"
            code, body = scrape(address, tls, "S")
            assert code == 200, body
            after = _samples(body)
            status = op.status()
        finally:
            op.close()
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        units = delta[("strata_worker_chunks_evaluated_total", ())]
        assert units >= 1  # the values move as the worker evaluates the run's units
        assert delta[("strata_worker_chunk_seconds_count", (("stage", "engine"),))] == units
        assert delta[("strata_worker_query_chunks_total", ())] == units
        assert sum(v for k, v in delta.items() if k[0] == "strata_worker_tuples_total") >= len(rows)
        assert status.workers[0].chunks_done >= units  # the master counts its chunks, merged into units here
        assert 0 <= after[("strata_worker_load_percent", ())] <= 100
        assert after[("strata_worker_spark_jobs_total", ())] >= 1
        assert after[("strata_worker_info", (("level", "S"), ("worker", worker["address"])))] == 1
        # what does not depend on timing: which series there are, and the stable counters' increments
        seen.append((sorted(after), {k: v for k, v in delta.items() if not _volatile(k[0])}))
    assert not any(("level", "TS") in k[1] for k in seen[1][0])
    assert seen[0] == seen[1]  # the S worker's metrics do not depend on the TS tuples


def _other_ca(tmp_path: Path) -> Path:
    other = tmp_path / "other"
    create_deployment(other, ["S"], roles=("worker",))
    issue_scraper(other, "S")
    return other


def test_the_pictures_evaluator_reads_every_panel_as_prometheus_would():
    """bench/dashboard_png.py draws docs/dashboard.png by evaluating the dashboard's PromQL itself:
    every expression parses, and rate, sum by, division and histogram_quantile give Prometheus's values."""
    import math

    from bench.dashboard_png import Query, Series, histogram_quantile

    board = json.loads((ROOT / "docs" / "grafana" / "strata.json").read_text())
    for p in board["panels"]:
        for t in p["targets"]:
            Query(t["expr"], {"job": ".+", "worker_job": ".+"})
    s = Series()
    for t in range(0, 130, 10):
        base = (("job", "a"),)
        s.add(t, {(("__name__", "c_total"), *base): 5.0 * t if t < 70 else 5.0 * (t - 70),  # a reset at 70
                  (("__name__", "h_bucket"), *base, ("le", "0.1")): 1.0 * t,
                  (("__name__", "h_bucket"), *base, ("le", "1.0")): 2.0 * t,
                  (("__name__", "h_bucket"), *base, ("le", "+Inf")): 2.0 * t,
                  (("__name__", "h_sum"), *base): 0.5 * t, (("__name__", "h_count"), *base): 2.0 * t})
    assert Query('rate(c_total{job=~".+"}[1m])').at(s, 60) == {(("job", "a"),): 5.0}
    # across the reset: 250, 300, 0 (reset), 50, 100, 150 over 50 s
    assert Query('rate(c_total{job=~".+"}[1m])').at(s, 100) == {(("job", "a"),): pytest.approx(200 / 50)}
    assert Query('rate(c_total{job!~"a"}[1m])').at(s, 60) == {}
    q = 'histogram_quantile({q}, sum by (le, job) (rate(h_bucket[5m])))'
    assert Query(q.format(q=0.5)).at(s, 100) == {(("job", "a"),): pytest.approx(0.1)}
    assert Query(q.format(q=0.99)).at(s, 100) == {(("job", "a"),): pytest.approx(0.1 + 0.9 * 0.98)}
    assert Query("sum by (job) (rate(h_sum[5m])) / sum by (job) (rate(h_count[5m]))").at(s, 100) == \
        {(("job", "a"),): pytest.approx(0.25)}
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]))
    assert histogram_quantile(0.99, [(0.1, 1), (math.inf, 10)]) == 0.1  # in +Inf: the highest finite bound
