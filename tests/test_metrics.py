"""``strata metrics`` (strata/metrics.py, issue 35): a level's status as Prometheus metrics over TLS.

Offline: the families of a status reply.  Against a running cluster: the client certificate of the
level and an operator's password are both required (a handshake without a certificate fails; another
role's certificate, no credentials, a wrong password and an analyst are refused with 403/401), the
values are the operator's status, and what an S operator scrapes is the same with and without tuples
above S arriving (the volatile fields of docs/semantics.md §9 aside)."""

from __future__ import annotations

import base64
import http.client
import ssl
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.metrics import MetricsServer, render
from strata.rpc import strata_pb2 as pb
from strata.tls import cert_paths

from .helpers import PASSWORD, login
from .polling import poll


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_families_of_a_status_reply():
    reply = pb.StatusReply(level="S", cluster=True, backlog_chunks=3, ready_chunks=1, lag_seconds=2.0,
                           workers=[pb.WorkerStatus(sid="w1", cpu=12.5, chunks_done=7, in_flight=1)],
                           counters={"accepted": 40, "chunks": 9}, rejected={"bad_type": 2},
                           timings={"engine_p50_ms": 4.0, "engine_p99_ms": 9.5, "chunks": 9.0, "merged_max": 2.0})
    got = _samples(render(reply).decode())
    assert got[("strata_info", (("level", "S"),))] == 1
    assert got[("strata_backlog_chunks", ())] == 3 and got[("strata_ready_chunks", ())] == 1
    assert got[("strata_lag_instants", ())] == 2.0 and got[("strata_workers", ())] == 1
    assert got[("strata_worker_cpu_percent", (("worker", "w1"),))] == 12.5
    assert got[("strata_worker_chunks_total", (("worker", "w1"),))] == 7
    assert got[("strata_events_total", (("event", "accepted"),))] == 40
    assert got[("strata_rejected_total", (("reason", "bad_type"),))] == 2
    assert got[("strata_chunk_milliseconds", (("quantile", "0.99"), ("stage", "engine")))] == 9.5
    assert got[("strata_chunk_timing", (("value", "chunks"),))] == 9.0
    assert not any(k[0].startswith("strata_chunk_seconds") for k in got)  # no unit yet: no histogram


def test_every_chunk_is_counted_in_the_stage_histograms():
    from strata.master.timings import BOUNDS, STAGES, ChunkTimings

    t = ChunkTimings(keep=2)
    for cid, (wait, rtt, engine) in enumerate([(0.001, 0.02, 0.01), (0.3, 0.6, 0.5), (2.0, 12.0, 11.0)]):
        t.ready(cid, 100.0)
        t.sent(cid, 100.0 + wait)
        t.done(cid, 100.0 + wait + rtt, engine)
    reply = pb.StatusReply(level="S", cluster=True, timings=t.summary(), histograms=t.histograms())
    got = _samples(render(reply).decode())
    for stage in STAGES:
        counts = [got[("strata_chunk_seconds_bucket", (("le", repr(b)), ("stage", stage)))] for b in BOUNDS]
        assert counts == sorted(counts)  # cumulative
        assert got[("strata_chunk_seconds_bucket", (("le", "+Inf"), ("stage", stage)))] == 3  # all since the start
        assert got[("strata_chunk_seconds_count", (("stage", stage),))] == 3
    assert got[("strata_chunk_seconds_sum", (("stage", "latency"),))] == pytest.approx(0.021 + 0.9 + 14.0)
    le = {b: got[("strata_chunk_seconds_bucket", (("le", repr(b)), ("stage", "latency")))] for b in BOUNDS}
    assert (le[0.01], le[0.025], le[0.5], le[1.0], le[10.0], le[30.0]) == (0, 1, 1, 2, 2, 3)
    assert t.summary()["chunks"] == 2  # the p50/p99 keep the last ``keep`` units only


def _scrape(server, tls, cert=("client", "S"), auth=("op", PASSWORD)):
    """(status, body) of GET /metrics presenting ``cert`` (None: no certificate) and basic ``auth``."""
    ctx = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    ctx.check_hostname = False  # the exporter's certificate is the level's client certificate (docs/operations.md)
    if cert is not None:
        c, k = cert_paths(tls, *cert)
        ctx.load_cert_chain(c, k)
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request("GET", "/metrics", headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _table(rows):
    n = len(rows)
    return pa.table({"ts": pa.array([t for t, _ in rows], pa.int64()), "level": [lv for _, lv in rows],
                     "sid": [f"s{t % 3}" for t, _ in rows], "bp": [float(100 + t) for t, _ in rows],
                     "pr": [1.0] * n, "weight": [1.0] * n})


def _stable(samples: dict) -> dict:
    """Without the volatile values: timings, CPU readings, redispatches and duplicates (§9)."""
    volatile = ("strata_chunk_milliseconds", "strata_chunk_timing", "strata_worker_cpu_percent",
                "strata_chunk_seconds")  # dispatch units: merged by timing (like strata_chunk_timing's chunks)
    return {k: v for k, v in samples.items()
            if not k[0].startswith(volatile)
            and ("event", "redispatched") not in k[1] and ("event", "duplicates") not in k[1]}


@pytest.mark.slow
def test_an_operator_scrapes_the_status_and_nobody_else_does(warm_s):
    rows = [(1, "U"), (2, "S"), (3, "C"), (4, "S"), (5, "U")]
    above = [(2, "TS"), (4, "TS"), (6, "TS")]
    seen = []
    for with_ts in (False, True):
        cl = warm_s.renew({"op": ("S", "operator,producer,analyst"), "ana": ("S", "analyst")})
        tls = Path(cl["tls"])
        server = MetricsServer(cl["master"], "S", tls).start()
        try:
            op = login(cl, "op")
            assert poll(lambda: len(op.status().workers) == 1, 30), "the worker did not join the fresh master"
            q = op.register(["SELECT sid, COUNT(*) AS n FROM Vitals [ROWS 2] GROUP BY sid"])[0].query_id
            data = sorted(rows + (above if with_ts else []))
            op.ingest([("Vitals", _table(data))], labelled=True)
            op.advance(finish=True)
            assert poll(lambda: next(x for x in op.status().queries if x.query_id == q).state == "ended", 60), \
                "the query did not end"
            code, body = _scrape(server, tls)
            assert code == 200, body
            got = _samples(body)
            st = op.status()
            assert got[("strata_events_total", (("event", "accepted"),))] == st.counters["accepted"] == len(rows)
            assert got[("strata_workers", ())] == len(st.workers) == 1
            # every unit dispatched is in the histograms (their buckets are times: volatile, left out below)
            assert got[("strata_chunk_seconds_count", (("stage", "latency"),))] == st.timings["chunks"] >= 1
            seen.append(_stable(got))
            if not with_ts:
                with pytest.raises(ssl.SSLError):
                    _scrape(server, tls, cert=None)  # no client certificate: no handshake
                assert _scrape(server, tls, cert=("worker", "S"))[0] == 403  # another role's certificate
                assert _scrape(server, tls, auth=None)[0] == 401
                assert _scrape(server, tls, auth=("op", "wrong"))[0] == 401
                assert _scrape(server, tls, auth=("ana", PASSWORD))[0] == 403  # an analyst: no cluster part
                assert server.refused == {"tls_identity": 1, "no_credentials": 1, "login_failed": 1,
                                          "not_operator": 1}
            op.close()
        finally:
            server.stop()
    assert seen[0] == seen[1]  # the S operator's metrics do not depend on the TS tuples
