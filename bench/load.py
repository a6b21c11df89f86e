"""Many subscribers on one master (issue 14): status latency, master memory and CPU vs subscribers.

``python -m bench.run --only load``.  A load benchmark, not a timed test: one embedded cluster
(``start_cluster``: a master and 2 Spark workers as processes, mutual TLS, default settings, the
harness's :class:`bench.e2e.BenchCluster`), a fresh master for each subscriber count N:

* 5 analysts each register ``SELECT AVG(bp) FROM Vitals [ROWS 100]`` at S (5 queries, always, so
  the workers' work is the same for every N) and log in 5 sessions each (25 sessions); N
  subscribers (``Subscribe`` streams, resume after -1) are spread round-robin over the 25 sessions:
  at most 8 per session and 40 per user, within the default ``[limits] max_streams_per_session`` (8)
  and ``max_streams_per_user`` (64): no limit is raised.  The subscribers run in a separate process
  (``python -m bench.load subscribe``, ``grpc.aio``, one TLS channel per session, as 25 client programs would), so the process that
  times ``Status`` is not also decoding N streams.
* A producer (the ``IngestStream`` of ``strata ingest``, labelled rows at or below S as
  ``strata ingest --labelled`` sends them) sends instant 0 first; once every subscriber has its
  result the paced phase starts: ``instants`` more instants of ``per_instant`` tuples at
  ``instant_rate`` instants per second (each batch closes its instant), then finish.
* Meanwhile an operator session calls ``Status`` (the cluster part included) every 0.2 s while the
  producer sends (and at least 50 times): p50 / p99 / max latency as the client sees it (TLS round trip included); the master's
  RSS (``VmRSS`` of /proc/<pid>/status) every 0.25 s; the master's CPU seconds over the paced phase
  (psutil, user + system).
* Correctness: every subscriber's stream must end (state ``ended``) holding one row per instant,
  each equal to DuckDB's window AVG on every instant (bench/check.py), and subscriber 0's output
  must equal the Python reference evaluator at sampled instants.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench import workloads as W
from bench.check import BenchCheckFailed, check_sample, compare_avg, duckdb_avg_rows
from bench.e2e import BenchCluster
from strata.arrowio import from_ipc
from strata.client import Client
from strata.examples import BATTLEFIELD_TOML
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.tls import _material, dns_name
from strata.users import UserStore

ROOT = Path(__file__).resolve().parents[1]
QUERY = "SELECT AVG(bp) FROM Vitals [ROWS 100]"
LEVEL = "S"
VISIBLE = ["U", "C", "S"]
ORDER = ["U", "C", "S", "TS"]
PASSWORD = "load bench passphrase, not a secret"
USERS = 5
SESSIONS_PER_USER = 5
STATUS_EVERY = 0.2
RSS_EVERY = 0.25


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def rss_kb(pid: int, field: str = "VmRSS") -> int | None:
    """``field`` (VmRSS, VmHWM) of /proc/<pid>/status in kB; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


# ---- the subscribers' process (``python -m bench.load subscribe``, the plan as JSON on stdin) ------
def _subscribers_main() -> int:
    """One aio channel per session, one Subscribe per plan entry (session index, token, query id);
    prints ``ready`` once every subscriber has a first result, then one JSON line:
    {"rows": [[[ts, level, avg], ...] per subscriber], "states": [...]} or {"error": ...}."""
    import json
    import sys

    a = json.loads(sys.stdin.read())

    def ready():
        print("ready", flush=True)

    try:
        got = asyncio.run(_subscribe_all(a["address"], a["tls_dir"], a["level"], a["plan"], ready, a["timeout"]))
    except BaseException as e:  # noqa: BLE001
        got = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(got), flush=True)
    return 0


async def _subscribe_all(address, tls_dir, level, plan, ready, timeout) -> dict:
    import grpc

    opts = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
    sessions = sorted({s for s, _, _ in plan})
    channels = {}
    for s in sessions:
        if tls_dir:
            ca, cert, key = _material(tls_dir, "client", level)
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            channels[s] = grpc.aio.secure_channel(address, creds, opts + [
                ("grpc.ssl_target_name_override", dns_name("master", level))])
        else:
            channels[s] = grpc.aio.insecure_channel(address, opts)
    rows: list[list[tuple]] = [[] for _ in plan]
    states: list[str] = [""] * len(plan)
    have_first = [0]

    async def one(k: int, s: int, token: str, qid: str) -> None:
        stub = rpc.MasterStub(channels[s])
        call = stub.Subscribe(pb.SubscribeRequest(query_ids=[qid], resume_after_ts=-1),
                              metadata=(("authorization", f"Bearer {token}"),))
        first = True
        async for batch in call:
            if batch.end:
                states[k] = batch.state or "ended"
                return
            t = from_ipc(batch.arrow)
            rows[k].extend(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), t.column(2).to_pylist()))
            if first and t.num_rows:
                first = False
                have_first[0] += 1
                if have_first[0] == len(plan):
                    ready()

    try:
        await asyncio.wait_for(asyncio.gather(*(one(k, s, tok, q) for k, (s, tok, q) in enumerate(plan))), timeout)
    finally:
        for ch in channels.values():
            await ch.close()
    return {"rows": rows, "states": states}


# ---- one subscriber count ------------------------------------------------------------------------
def _visible(t: pa.Table) -> pa.Table:
    return t.filter(pc.is_in(t.column("level"), value_set=pa.array(VISIBLE)))


def run_one(cluster, n_subs: int, data: pa.Table, instant_rate: float, status_calls: int = 50,
            timeout: float = 600.0) -> dict:
    """A fresh master, 25 sessions, ``n_subs`` subscribers, a paced producer; the figures."""
    cluster.new_master()
    m_pid = next(p["pid"] for p in cluster.record["processes"] if p["role"] == "master" and p["level"] == cluster.level)

    def login(user: str) -> Client:
        c = Client(cluster.address, tls_dir=cluster.tls_dir, level=cluster.level) if cluster.tls_dir \
            else Client(cluster.address)
        c.login(user, PASSWORD, cluster.level)
        return c

    sessions: list[tuple[str, str]] = []  # (token, the user's query id), 5 per user
    owners = []  # each user's first session (it registered the query; its Status shows the query's state)
    for u in range(USERS):
        first = login(f"sub{u}")
        qid = first.register([QUERY])[0].query_id
        sessions.append((first.token, qid))
        owners.append(first)
        for _ in range(SESSIONS_PER_USER - 1):
            c = login(f"sub{u}")
            sessions.append((c.token, qid))
            c.close()
    plan = [(k % len(sessions), *sessions[k % len(sessions)]) for k in range(n_subs)]
    per_session = max([sum(1 for p in plan if p[0] == s) for s in range(len(sessions))] or [0])
    op = cluster.client()  # the harness user: every role (producer, operator)
    prod = cluster.client()
    ts = data.column("ts").to_numpy()
    instants = np.unique(ts)
    sent = _visible(data)
    sts = sent.column("ts").to_numpy()
    sb = np.searchsorted(sts, np.append(instants, instants[-1] + 1))
    time.sleep(1.0)  # logins' argon2 buffers settle
    rss_base = rss_kb(m_pid)

    # instant 0, then wait for every subscriber to have its result
    prod.ingest([("Vitals", sent.slice(int(sb[0]), int(sb[1] - sb[0])), int(instants[0]))], labelled=True)
    proc = None
    t_ready = time.monotonic()
    if n_subs:
        proc = subprocess.Popen([sys.executable, "-m", "bench.load", "subscribe"], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        _children.append(proc)
        proc.stdin.write(json.dumps({"address": cluster.address, "tls_dir": cluster.tls_dir, "level": cluster.level,
                                     "plan": plan, "timeout": timeout}))
        proc.stdin.close()
        lines = _lines(proc)
        line = _readline(lines, 120)
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"{n_subs} subscribers did not all get instant 0's result: {line.strip()[:500]}")
    t_ready = time.monotonic() - t_ready
    rss_subscribed = rss_kb(m_pid)

    # the paced phase: producer thread, RSS sampler thread, Status calls here
    stop = threading.Event()
    rss: list[tuple[float, int]] = []
    perr: list[BaseException] = []

    def sample_rss():
        while not stop.is_set():
            v = rss_kb(m_pid)
            if v is not None:
                rss.append((time.monotonic(), v))
            stop.wait(RSS_EVERY)

    def produce():
        try:
            t0 = time.monotonic()

            def paced():
                for i in range(1, len(instants)):
                    wait = t0 + (i - 1) / instant_rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    yield "Vitals", sent.slice(int(sb[i]), int(sb[i + 1] - sb[i])), int(instants[i])

            r = prod.ingest_stream(paced(), f"load-{n_subs}", labelled=True)
            if r.error:
                raise RuntimeError(f"ingest refused: {r.error}")
            prod.advance(finish=True)
        except BaseException as e:  # noqa: BLE001
            perr.append(e)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    producer = threading.Thread(target=produce, daemon=True)
    cpu0 = cpu_seconds(m_pid)
    t0 = time.monotonic()
    sampler.start()
    producer.start()
    lat = []
    during = 0  # calls that ended while the producer was still sending
    while len(lat) < status_calls or producer.is_alive():
        ta = time.monotonic()
        op.status()
        lat.append(time.monotonic() - ta)
        during += producer.is_alive()
        time.sleep(max(0.0, STATUS_EVERY - (time.monotonic() - ta)))
    producer.join(timeout)
    if perr:
        raise perr[0]
    got = None
    if proc is not None:
        line = _readline(lines, timeout)
        proc.wait(30)
        got = json.loads(line) if line.strip() else {"error": f"no output (exit status {proc.poll()})"}
    else:  # nobody reads: wait for the queries to end all the same (the same work for the workers)
        deadline = time.monotonic() + timeout
        while any(q.state == "running" for c in owners for q in c.status().queries) and time.monotonic() < deadline:
            time.sleep(0.2)
    wall = time.monotonic() - t0
    cpu = cpu_seconds(m_pid) - cpu0
    stop.set()
    sampler.join()
    time.sleep(0.5)
    rss_end, hwm = rss_kb(m_pid), rss_kb(m_pid, "VmHWM")
    st = op.status()
    for c in (op, prod, *owners):
        c.close()
    accepted = int(st.counters.get("accepted", 0))
    if accepted != sent.num_rows:
        raise BenchCheckFailed(f"load N={n_subs}: the master accepted {accepted} tuples of {sent.num_rows} sent")

    rec = {"subscribers": n_subs, "sessions": len(sessions), "users": USERS, "max_per_session": per_session,
           "queries": USERS, "instants": int(len(instants)), "tuples": int(data.num_rows), "accepted": accepted,
           "instant_rate": instant_rate, "tuple_rate": round(instant_rate * data.num_rows / len(instants)),
           "status_calls": len(lat), "status_during_input": during,
           "status_p50_ms": round(pct(lat, 50) * 1000, 1), "status_p99_ms": round(pct(lat, 99) * 1000, 1),
           "status_max_ms": round(max(lat) * 1000, 1), "status_mean_ms": round(statistics.mean(lat) * 1000, 1),
           "rss_base_mb": _mb(rss_base), "rss_subscribed_mb": _mb(rss_subscribed),
           "rss_peak_mb": _mb(max(v for _, v in rss)) if rss else None, "rss_end_mb": _mb(rss_end),
           "hwm_mb": _mb(hwm), "cpu_seconds": round(cpu, 2), "seconds": round(wall, 2),
           "cpu_percent": round(100 * cpu / wall, 1) if wall > 0 else None, "ready_seconds": round(t_ready, 2),
           "load": round(os.getloadavg()[0], 1), "chunks": int(st.counters.get("chunks", 0))}
    rec["check"] = _check(got, n_subs, data, len(instants)) if n_subs else "no subscribers (input accepted)"
    _log(f"load N={n_subs}: Status p50 {rec['status_p50_ms']} ms p99 {rec['status_p99_ms']} ms max "
         f"{rec['status_max_ms']} ms; master RSS {rec['rss_base_mb']} -> peak {rec['rss_peak_mb']} MB, end "
         f"{rec['rss_end_mb']} MB; master CPU {rec['cpu_seconds']} s in {rec['seconds']} s ({rec['cpu_percent']} %); "
         f"load {rec['load']}")
    return rec


_children: list[subprocess.Popen] = []  # subscriber processes, killed by run() if a run fails


def _lines(proc) -> queue.Queue:
    """``proc``'s stdout lines as they come (None at its end), read by a thread."""
    q: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _readline(q, timeout: float) -> str:
    """The next line from :func:`_lines`, or "" after ``timeout`` s or at the end."""
    try:
        return q.get(timeout=timeout) or ""
    except queue.Empty:
        return ""


def _mb(kb) -> float | None:
    return None if kb is None else round(kb / 1024, 1)


def _check(got: dict | None, n_subs: int, data: pa.Table, n_instants: int) -> str:
    """Every subscriber: ended, one row per instant, equal to DuckDB on every instant; subscriber 0
    also equal to the reference evaluator at sampled instants."""
    if got is None or "error" in got:
        raise BenchCheckFailed(f"load N={n_subs}: the subscribers failed: {(got or {}).get('error')}")
    states = got["states"]
    if set(states) != {"ended"}:
        raise BenchCheckFailed(f"load N={n_subs}: result streams ended as {sorted(set(states))}")
    exp, _ = duckdb_avg_rows(data, "bp", 100, VISIBLE, ORDER)
    tables = []
    for k, rows in enumerate(got["rows"]):
        if len(rows) != exp.num_rows:
            raise BenchCheckFailed(f"load N={n_subs}: subscriber {k} got {len(rows)} rows, DuckDB has {exp.num_rows}")
        t = pa.table({"ts": pa.array([r[0] for r in rows], pa.int64()), "level": [r[1] for r in rows],
                      "avg": pa.array([r[2] for r in rows], pa.float64())})
        try:
            compare_avg(t, exp)
        except BenchCheckFailed as e:
            raise BenchCheckFailed(f"load N={n_subs}: subscriber {k}: {e}") from None
        tables.append(t)
    taus = check_sample(BATTLEFIELD_TOML, LEVEL, QUERY, {"Vitals": data}, tables[0], k=3)
    return (f"N={n_subs}: all {n_subs} subscribers got all {exp.num_rows} results, each equal to DuckDB on every "
            f"instant; subscriber 0 equals the reference at instants {taus}")


def run(args, res: dict) -> None:
    """The ``load`` section of bench/run.py."""
    p = args.p
    counts, per_instant, n_inst, rate = p["load_subscribers"], p["load_per_instant"], p["load_instants"], \
        p["load_instant_rate"]
    data = W.vitals((n_inst + 1) * per_instant, per_instant)  # instant 0 + the paced ones
    la = round(os.getloadavg()[0], 1)
    cl = BenchCluster(BATTLEFIELD_TOML, LEVEL, 2, tls=not args.insecure, cpu_reading="process")
    runs, checks = [], []
    try:
        users = UserStore(cl.cfg.users_path, cl.cfg.lattice)
        for u in range(USERS):
            users.add(f"sub{u}", LEVEL, PASSWORD, replace=True, roles=["analyst"])
        for n in counts:
            rec = run_one(cl, n, data, rate)
            runs.append(rec)
            checks.append(rec["check"])
    finally:
        for proc in _children:
            if proc.poll() is None:
                proc.kill()
        cl.stop()
    res["load"] = {"runs": runs, "checks": checks, "query": QUERY, "level": LEVEL, "per_instant": per_instant,
                   "instants": n_inst, "instant_rate": rate, "workers": 2, "tls": not args.insecure,
                   "users": USERS, "sessions": USERS * SESSIONS_PER_USER, "status_every": STATUS_EVERY,
                   "rss_every": RSS_EVERY, "load_start": la, "load_end": round(os.getloadavg()[0], 1),
                   "cluster_start_seconds": round(cl.start_seconds, 1)}


if __name__ == "__main__" and sys.argv[1:] == ["subscribe"]:
    sys.exit(_subscribers_main())
