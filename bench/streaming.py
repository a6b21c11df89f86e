"""The streaming protocol (issue 35, item 1): sustained rate at bounded latency, and catch-up.

``python -m bench.run --only streaming`` (or ``python -m bench.streaming``) runs, side by side in one
run, Strata (a ``strata up`` cluster of level TS with 2 workers, a fresh master per step onto the warm
workers, as ``strata replay --cluster`` does) and Spark Structured Streaming (its own Python process
and JVM, ``local[*]``, Spark's default options but for binding to loopback and no web UI) on the same
rows arriving at the same pace, and reports the highest rate each sustains.

Sustained rate at bounded latency
    Input: battlefield tuples (bench/workloads.vitals / positions), ``R`` tuples per instant, one
    instant per wall second (the instant is the event-time second, so ``R`` tuples/s), for
    ``warmup + seconds`` instants.  Strata's producer is a process of its own (``python -m
    bench.streaming produce``) doing exactly what ``strata ingest --labelled --rate R --finish``
    does (the CLI's own ``instant_batches`` and pacing: batches of ``min(R, 65536)`` tuples, the
    advance closing an instant riding on its last batch, the last instant closed by the finish)
    and logging the wall time at which it hands each closing advance to gRPC.  The peer's source
    gets one Parquet file per instant, renamed into its source directory at the same offset from
    the run's start at which the producer closes that instant (the same schedule), its landing
    wall time logged.
    Latency of an output row = when it reached the subscriber (Strata: the Python API's
    ``Session.subscribe`` in the harness; the peer: after ``toArrow()`` of the micro-batch in its
    ``foreachBatch`` sink) minus when its instant closed at the source.  For the peer an instant's
    rows are final in the micro-batch that read its file (update mode may have emitted a group's
    row earlier, as a partial); that batch's sink time is the latency of all rows of the instant
    (the micro-batch's files are read from the checkpoint's source log).  The first ``warmup``
    instants (one window length) are not in the percentiles (JIT, first plans: both sides).
    A rate is *sustained* when, over the measured instants, p99 <= 2 s, the last instant's rows
    arrive within 2 s of its close, the producer never fell behind its schedule by more than 1 s,
    and (Strata) the master's backlog (``strata status``: chunks cut and not dispatched) when the
    last instant closes is at most its value when the first measured instant closed + 2.
    Search: doubling from a start rate while either side sustains, then bisection of each side's
    bracket (a few steps: each costs ``warmup + seconds`` of input per side).

Catch-up
    Both sides start from the same CSV file and the clock includes reading it: ``strata replay``
    with its defaults (an embedded cluster; its own ``process`` timing, first tuple sent -> last
    result, is reported with the total) against Structured Streaming reading the CSV with its file
    source and ``trigger(availableNow=True)``, the clock from ``start()`` to the end of the query
    (the JVM started before, as ``strata replay``'s start-up is reported apart).

Every output is checked on every instant against DuckDB (levels included for Strata).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench import userpath as U
from bench.check import BenchCheckFailed, compare_avg, duckdb_avg_rows
from bench.userpath import PASSWORD
from bench.workloads import positions, vitals
from strata.api import connect, status_view
from strata.commands import instant_batches
from strata.config import load_config, parse_config
from strata.deploy.local import renew_master
from strata.examples import BATTLEFIELD_TOML

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RANGE_Q = "SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid"
ROWS_Q = "SELECT AVG(bp) FROM Vitals [ROWS 100]"
#: the windowed join: each new (Vitals, Positions) pair of the same sid within 10 s, once, at the instant
#: the later of the two arrives (ISTREAM of the RANGE 10 s join), selective filters on both sides
JOIN_BP, JOIN_LAT = 160, 85
JOIN_Q = (f"ISTREAM(SELECT v.sid, v.bp, p.lat FROM Vitals [RANGE 10 SECONDS] v, Positions [RANGE 10 SECONDS] p "
          f"WHERE v.sid = p.sid AND v.bp > {JOIN_BP} AND p.lat > {JOIN_LAT})")
QUERIES = {"range": (RANGE_Q, ["Vitals"]), "rows": (ROWS_Q, ["Vitals"]), "join": (JOIN_Q, ["Vitals", "Positions"])}
LEVEL = "TS"
BOUND_P99 = 2.0
BOUND_LAST = 2.0
BOUND_LAG = 1.0
BOUND_BACKLOG = 2
WARMUP = 10
MAX_RATE = 320_000  # the search stops doubling here (memory of the harness's copies and checks)
RANK = {"U": 0, "C": 1, "S": 2, "TS": 3}


def _log(msg: str) -> None:
    print(f"[streaming] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- data and schedule ---------------------------------------------------------------------------
def make_inputs(query: str, rate: int, instants: int) -> dict[str, pa.Table]:
    """``rate`` tuples per instant in all (split evenly over the streams the query reads)."""

    streams = QUERIES[query][1]
    per = max(1, rate // len(streams))
    out = {}
    for s in streams:
        out[s] = vitals(per * instants, per) if s == "Vitals" else positions(per * instants, per)
    return out


def schedule(inputs: dict[str, pa.Table], rate: float) -> dict[int, float]:
    """Seconds from the run's start at which the CLI's paced ingest closes each instant: the batches
    of ``strata ingest --labelled --rate R --finish`` (its ``instant_batches``), each sent at
    ``start + tuples before it / R``; an instant closes with the batch carrying its advance (the last
    instant: with the last batch, the finish follows)."""

    cfg = parse_config(BATTLEFIELD_TOML)
    rows = max(1, min(65536, int(rate)))
    sent, out, last = 0, {}, None
    for _stream, t, upto in instant_batches(cfg, list(inputs.items()), LEVEL, rows=rows):
        at = sent / rate
        sent += t.num_rows
        last = at
        if upto is not None:
            for tau in range(max(out, default=-1) + 1, int(upto) + 1):
                out[tau] = at
    top = max(int(t.column("ts").to_numpy()[-1]) for t in inputs.values())
    for tau in range(max(out, default=-1) + 1, top + 1):
        out[tau] = last
    return out


# ---- latency and the verdict ---------------------------------------------------------------------
def latency_stats(close: dict[int, float], arrive: dict[int, float], weights: dict[int, int],
                  warmup: int, last: int) -> dict:
    """Row latencies (each instant's arrival - its close, weighted by its rows) over the instants
    ``warmup..last``; ``missing``: instants with rows that never arrived."""
    taus = [t for t in range(warmup, last + 1) if weights.get(t, 0) > 0]
    missing = [t for t in taus if t not in arrive]
    lat = np.array([arrive[t] - close[t] for t in taus if t in arrive])
    w = np.array([weights[t] for t in taus if t in arrive])
    if not len(lat):
        return {"p50": None, "p99": None, "max": None, "last": None, "missing": len(missing), "rows": 0}
    rows = np.repeat(lat, w)
    lt = (arrive[last] - close[last]) if last in arrive else None
    return {"p50": round(float(np.percentile(rows, 50)), 3), "p99": round(float(np.percentile(rows, 99)), 3),
            "max": round(float(lat.max()), 3), "last": None if lt is None else round(lt, 3),
            "missing": len(missing), "rows": int(w.sum())}


def verdict(lat: dict, lag: float, backlog: tuple[int, int] | None = None) -> tuple[bool, str]:
    why = []
    if lat.get("p99") is None or lat["missing"]:
        why.append(f"{lat.get('missing')} instants without their rows")
    elif lat["p99"] > BOUND_P99:
        why.append(f"p99 {lat['p99']} s > {BOUND_P99} s")
    if lat.get("last") is None or lat["last"] > BOUND_LAST:
        why.append(f"last instant {lat.get('last')} s after its close")
    if lag > BOUND_LAG:
        why.append(f"source {lag:.2f} s behind its schedule")
    if backlog is not None and backlog[1] > backlog[0] + BOUND_BACKLOG:
        why.append(f"master backlog {backlog[0]} -> {backlog[1]} chunks")
    return (not why), "; ".join(why) or "sustained"


def next_rate(results: dict[int, bool], start: int, step: int = 1000) -> int | None:
    """Doubling from ``start`` while every tested rate passed; then bisection between the highest pass
    and the lowest fail above it (to ``step`` or within 10 %); halving when the start already fails."""
    if not results:
        return start
    passed = [r for r, ok in results.items() if ok]
    failed = [r for r, ok in results.items() if not ok]
    if not failed:
        nxt = max(passed) * 2
        return nxt if nxt <= MAX_RATE else None
    hi = min(failed)
    lo = max((r for r in passed if r < hi), default=None)
    if lo is None:
        nxt = (hi // 2) // step * step
        return nxt if nxt >= step and nxt not in results else None
    if hi - lo <= max(step, lo // 10):
        return None
    mid = (lo + hi) // 2 // step * step
    return mid if mid not in results and lo < mid < hi else None


# ---- correctness ---------------------------------------------------------------------------------
def expected(query: str, inputs: dict[str, pa.Table]):
    """DuckDB's answer on every instant, in the form :func:`check` takes."""
    from bench.peers import duckdb_range10  # deferred: bench.peers loads PySpark (the peer's side only)

    if query == "range":
        return duckdb_range10(inputs["Vitals"])[0]
    if query == "rows":
        return duckdb_avg_rows(inputs["Vitals"], "bp", 100, list(RANK), list(RANK))[0]
    return duckdb_join(inputs["Vitals"], inputs["Positions"])


def duckdb_join(v: pa.Table, p: pa.Table) -> dict:
    """``{"istream": {τ: Counter((sid, bp, lat, level))}, "pairs": {τ: Counter((sid, bp, lat))}}``:
    the ISTREAM of the RANGE 10 s join (bag difference R(τ) - R(τ-1), exactly) and every matching
    pair once at the later of its two instants (Structured Streaming's interval join)."""
    import collections

    import duckdb

    con = duckdb.connect()
    for name, t in (("v", v), ("p", p)):
        lv = pa.array([RANK[x] for x in t.column("level").to_pylist()], pa.int64())
        con.register(name + "0", t.append_column("lv", lv))
    pairs = con.sql(
        f"SELECT v.ts AS vt, p.ts AS pt, v.sid, v.bp, p.lat, GREATEST(v.lv, p.lv) AS lv FROM v0 v JOIN p0 p "
        f"ON v.sid = p.sid AND ABS(v.ts - p.ts) <= 9 WHERE v.bp > {JOIN_BP} AND p.lat > {JOIN_LAT}").fetchall()
    taus = sorted(set(v.column("ts").to_pylist()) | set(p.column("ts").to_pylist()))
    names = {r: k for k, r in RANK.items()}
    rel = collections.defaultdict(collections.Counter)  # R(τ): pairs with both instants in (τ-10, τ]
    once = collections.defaultdict(collections.Counter)
    for vt, pt, sid, bp, lat, lv in pairs:
        hi, lo = max(vt, pt), min(vt, pt)
        once[hi][(sid, bp, lat)] += 1
        for tau in range(hi, lo + 10):
            rel[tau][(sid, bp, lat, names[lv])] += 1
    ist = {}
    for tau in taus:
        d = rel.get(tau, collections.Counter()) - rel.get(tau - 1, collections.Counter())
        if d:
            ist[tau] = d
    return {"istream": ist, "pairs": dict(once)}


def check(query: str, exp, rows: pa.Table | None, instants: set[int], strata: bool, what: str) -> int:
    """Compare a run's rows with DuckDB on every instant of ``instants``; raises BenchCheckFailed."""
    import collections

    from bench.peers import check_range10  # deferred: bench.peers loads PySpark (the peer's side only)
    import pyarrow.compute as pc

    if query == "range":
        if rows is None:
            raise BenchCheckFailed(f"{what}: no rows")
        return check_range10(exp, rows, what, instants, levels=strata)
    if query == "rows":
        got = rows.filter(pc.is_in(rows.column("ts"), pa.array(sorted(instants), rows.column("ts").type)))
        e = exp.filter(pc.is_in(exp.column("ts"), pa.array(sorted(instants), exp.column("ts").type)))
        if not strata:
            got = got.append_column("level", e.column("level")) if got.num_rows == e.num_rows else got
            got = got.select(["ts", "level", got.column_names[1]])
        compare_avg(got.select([0, 1, 2]) if strata else got, e)
        return e.num_rows
    # join
    key = "istream" if strata else "pairs"
    want = {t: c for t, c in exp[key].items() if t in instants}
    have = collections.defaultdict(collections.Counter)
    if rows is not None and rows.num_rows:
        cols = rows.column_names
        tcol = "ts" if "ts" in cols else "tau"
        vals = [c for c in cols if c not in (tcol, "level")]
        lvl = rows.column("level").to_pylist() if strata else None
        data = list(zip(*[rows.column(c).to_pylist() for c in [tcol] + vals]))
        for i, r in enumerate(data):
            if r[0] in instants:
                have[r[0]][tuple(r[1:]) + ((lvl[i],) if strata else ())] += 1
    have = {t: c for t, c in have.items() if c}
    if have != want:
        bad = sorted(set(have) ^ set(want) | {t for t in set(have) & set(want) if have[t] != want[t]})[:3]
        raise BenchCheckFailed(f"{what}: join rows differ from DuckDB at instants {bad}")
    return sum(sum(c.values()) for c in want.values())


# ---- Strata ---------------------------------------------------------------------------------------
class StrataSide:
    """A ``strata up --levels TS --workers 2`` cluster; :meth:`run` gives it a fresh master per step."""

    def __init__(self, d: Path):

        self.d = d
        self.cfg = U.setup(d)
        self.state = d / "up-state"
        self._up = U.up_cluster(self.cfg, self.state, LEVEL)
        self.up = self._up.__enter__()
        rec = json.loads((self.state / "cluster.json").read_text())
        self.tls = rec["tls_dir"]
        self.pids = [p["pid"] for p in rec["processes"]]

    def close(self) -> None:
        self._up.__exit__(None, None, None)

    def run(self, query: str, data_dir: Path, inputs: dict[str, pa.Table], rate: int, warmup: int,
            timeout: float) -> dict:

        master, _, _ = renew_master(self.state, LEVEL)
        sub = connect(master, "jane", LEVEL, tls_dir=self.tls, password=PASSWORD)
        ops = connect(master, "jane", LEVEL, tls_dir=self.tls, password=PASSWORD)
        q = sub.register(QUERIES[query][0])
        follower = U.Subscriber(sub, q, clock=time.time)  # wall clock: the producer logs its closes in it
        th, parts, arrive, err = follower.thread, follower.parts, follower.arrive, follower.errors
        samples: list[tuple[float, int, int, float]] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    v = status_view(ops.client.status(), [])
                    samples.append((time.time(), int(v.get("backlog", 0)), int(v.get("ready", 0)),
                                    float(v.get("lag", 0.0))))
                except Exception:  # noqa: BLE001 - a sample lost
                    pass
                stop.wait(1.0)

        sm = threading.Thread(target=sample, daemon=True)
        sm.start()
        log = data_dir / f"producer_{query}_{rate}.json"
        env = {**os.environ, "STRATA_PASSWORD": PASSWORD}
        cmd = [sys.executable, "-m", "bench.streaming", "produce", "--config", str(self.cfg), "--master", master,
               "--tls-dir", self.tls, "--rate", str(rate), "--log", str(log)] + \
            [f"--input={s}={data_dir / (s + '.arrow')}" for s in inputs]
        la0 = loadavg()
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            stop.set()
            raise RuntimeError(f"producer exited {p.returncode}: {p.stderr[-2000:]}")
        plog = json.loads(log.read_text())
        th.join(timeout=max(10.0, 3 * BOUND_LAST))  # the query ends after the finish: its last rows
        ended = not th.is_alive()
        try:
            st = ops.client.status()
            timings = {k: round(float(v), 4) for k, v in st.timings.items()}
            counters = {k: int(v) for k, v in st.counters.items()}
        except Exception:  # noqa: BLE001
            timings, counters = {}, {}
        stop.set()
        sm.join()
        la1 = loadavg()
        for s in (sub, ops):
            try:
                s.close()
            except Exception:  # noqa: BLE001
                pass
        if err:
            raise RuntimeError(f"subscriber failed: {err[0]}")
        close = {int(k): v for k, v in plog["close"].items()}
        last = max(close)
        first_measured = close.get(warmup, close[min(close)])

        def backlog_at(t):
            before = [s for s in samples if s[0] <= t]
            return before[-1][1] if before else (samples[0][1] if samples else 0)

        backlog = (backlog_at(first_measured), backlog_at(close[last]))
        rows = pa.concat_tables(parts) if parts else None
        weights = {}
        if rows is not None:
            ts, counts = np.unique(rows.column("ts").to_numpy(), return_counts=True)
            weights = {int(t): int(c) for t, c in zip(ts, counts)}
        return {"rows": rows, "close": close, "arrive": arrive, "weights": weights, "last": last,
                "lag": plog["max_lag"], "backlog": backlog, "ended": ended, "timings": timings,
                "counters": counters, "load": [la0, la1], "producer_seconds": plog["seconds"],
                "backlog_max": max((s[1] for s in samples), default=0)}


def produce(argv: list[str]) -> int:
    """``python -m bench.streaming produce``: what ``strata ingest --labelled --rate R --finish`` does
    (the CLI's batching and pacing), logging when each instant's closing advance is handed to gRPC."""
    ap = argparse.ArgumentParser(prog="bench.streaming produce")
    ap.add_argument("--config", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--tls-dir", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--input", action="append", required=True)
    ap.add_argument("--log", required=True)
    a = ap.parse_args(argv)

    cfg = load_config(a.config)
    inputs = []
    for spec in a.input:
        s, path = spec.split("=", 1)
        with pa.memory_map(path) as f:
            inputs.append((s, pa.ipc.open_file(f).read_all()))
    sess = connect(a.master, "jane", LEVEL, tls_dir=a.tls_dir)
    c = sess.client
    rows = max(1, min(65536, int(a.rate)))
    batches = instant_batches(cfg, inputs, c.level, rows=rows)
    close: dict[int, float] = {}
    lag = [0.0]
    sent = [0]
    top = max(int(t.column("ts").to_numpy()[-1]) for _, t in inputs)
    t0, w0 = time.monotonic(), time.time()

    def paced():
        for stream, t, upto in batches:  # as strata.commands.cmd_ingest's paced()
            if t is not None:
                wait = t0 + sent[0] / a.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                lag[0] = max(lag[0], -wait)
                sent[0] += t.num_rows
            if upto is not None:
                now = time.time()
                for tau in range(max(close, default=-1) + 1, int(upto) + 1):
                    close[tau] = now
            yield stream, t, upto

    r = c.ingest_stream(paced(), f"bench-streaming-{uuid.uuid4().hex[:12]}", labelled=True)
    if r.error:
        raise SystemExit(f"ingest refused: {r.error}")
    now = time.time()
    c.advance(finish=True)  # closes the rest (the last instant)
    for tau in range(max(close, default=-1) + 1, top + 1):
        close[tau] = now
    sess.close()
    Path(a.log).write_text(json.dumps({"close": close, "max_lag": round(lag[0], 3), "sent": sent[0],
                                       "seconds": round(time.time() - w0, 3), "start": w0}))
    return 0


# ---- the peer: Structured Streaming in its own process and JVM ------------------------------------
#: the join's event time on the peer: ``PEER_EPOCH + ts`` seconds after the Unix epoch, not ``ts`` seconds.  Spark's
#: watermark starts at 0 ms (the epoch itself) and a stream-stream join drops every input row whose event time is
#: <= the current watermark as late (``WatermarkSupport.watermarkExpression``: ``et <= watermark``), already in the
#: first micro-batch: instant 0's rows (event time = the epoch) never joined (the query's
#: ``numRowsDroppedByWatermark`` = exactly the rows of instant 0 that pass the filters) and the pairs with one of them
#: were missing.  A constant shift changes no pair (the condition is on differences) and the output's ``tau`` is
#: still ``ts``.  (The RANGE query is unaffected: its watermark compares a window's end, >= 1 s.)
PEER_EPOCH = 1_000_000_000

SCHEMAS = {"Vitals": "ts BIGINT, level STRING, sid STRING, bp DOUBLE, pr DOUBLE, weight DOUBLE",
           "Positions": "ts BIGINT, level STRING, sid STRING, lat DOUBLE, lon STRING"}


def _peer_session(app: str, conf: list[str]):
    """The peer's SparkSession in this process: ``local[*]`` on loopback, no web UI, Spark's defaults
    otherwise plus ``conf`` (``k=v`` each)."""
    from pyspark.sql import SparkSession

    b = (SparkSession.builder.master("local[*]").appName(app)
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false"))
    for kv in conf:
        k, v = kv.split("=", 1)
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def peer_main(argv: list[str]) -> int:
    """``python -m bench.streaming peer``: a Structured Streaming driver (its own JVM) kept for the whole
    section, as Strata's workers are: it reads one JSON job per stdin line (query, source, checkpoint,
    output, instants), starts the query (1 s processing-time trigger, ``foreachBatch`` sink recording
    when each micro-batch's rows were written and which input files, i.e. instants, it read), prints
    ``ready``, and after the batch that read the last instant stops it, writes the rows and prints
    ``done``."""
    ap = argparse.ArgumentParser(prog="bench.streaming peer")
    ap.add_argument("--conf", action="append", default=[], help="k=v beyond Spark's defaults")
    a = ap.parse_args(argv)
    spark = _peer_session("strata-bench-sss-peer", a.conf)
    print("started", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        _peer_job(spark, json.loads(line))
        print("done", flush=True)
    spark.stop()
    return 0


def _peer_job(spark, job: dict) -> None:
    from pyspark.sql import functions as F

    query, src, ck, out_path, n = job["query"], Path(job["src"]), Path(job["ckpt"]), job["out"], job["instants"]
    streams = QUERIES[query][1]
    reads = {s: spark.readStream.schema(SCHEMAS[s]).parquet(str(src / s)) for s in streams}
    if query == "range":
        out = (reads["Vitals"].withColumn("et", F.timestamp_seconds("ts")).withWatermark("et", "10 seconds")
               .groupBy(F.window("et", "10 seconds", "1 second"), "sid").agg(F.avg("bp").alias("a"))
               .select((F.unix_timestamp(F.col("window.end")) - 1).alias("tau"), "sid", "a"))
        mode = "update"
    elif query == "join":
        v = (reads["Vitals"].where(F.col("bp") > JOIN_BP)
             .withColumn("vet", F.timestamp_seconds(F.col("ts") + PEER_EPOCH))
             .withWatermark("vet", "10 seconds").alias("v"))
        p = (reads["Positions"].where(F.col("lat") > JOIN_LAT)
             .withColumn("pet", F.timestamp_seconds(F.col("ts") + PEER_EPOCH))
             .withWatermark("pet", "10 seconds").alias("p"))
        out = (v.join(p, F.expr("v.sid = p.sid AND v.vet >= p.pet - INTERVAL 9 SECONDS AND "
                                "v.vet <= p.pet + INTERVAL 9 SECONDS"))
               .select(F.greatest(F.col("v.ts"), F.col("p.ts")).alias("tau"), F.col("v.sid").alias("sid"),
                       F.col("v.bp").alias("bp"), F.col("p.lat").alias("lat")))
        mode = "append"
    else:
        raise SystemExit("Structured Streaming has no ROWS window over a stream (bench/peers.py)")
    batches: list[dict] = []
    parts: list[pa.Table] = []
    done = threading.Event()
    seen: set[int] = set()

    def files_of(bid: int) -> set[int]:
        """The instants whose files micro-batch ``bid`` had read by its end, from every source: the offset log
        names, per source, the last source-log batch it covers (``logOffset``), every file logged up to it is
        in (source-log batch ids are not micro-batch ids: a no-data micro-batch logs no files).  An instant
        counts only once each source's file of it is in (the join: Vitals' file of an instant can be read a
        micro-batch before Positions'; its pairs with Positions' rows come in the later one)."""
        lines = (ck / "offsets" / str(bid)).read_text().splitlines()
        offs = [json.loads(x)["logOffset"] for x in lines[2:2 + len(streams)]]
        per = []
        for k, upto in enumerate(offs):
            got = set()
            d = ck / "sources" / str(k)
            for f in (d.iterdir() if d.exists() else []):
                name = f.name.split(".")[0]
                if not name.isdigit() or int(name) > upto:
                    continue
                for ln in f.read_text().splitlines()[1:]:
                    e = json.loads(ln)
                    if e.get("batchId", 0) <= upto:
                        got.add(int(Path(e["path"]).stem[1:]))
            per.append(got)
        return set.intersection(*per) if per else set()

    def sink(df, bid):
        t = df.toArrow()
        now = time.time()
        inst = files_of(bid) - seen
        batches.append({"batch": bid, "written": now, "instants": sorted(inst), "rows": t.num_rows})
        if t.num_rows:
            parts.append(t)
        seen.update(inst)
        if n - 1 in seen:
            done.set()

    q = (out.writeStream.outputMode(mode).foreachBatch(sink).trigger(processingTime="1 second")
         .option("checkpointLocation", str(ck)).start())
    print("ready", flush=True)
    done.wait(job.get("timeout", 600))
    progress = []
    for pr in q.recentProgress:  # where a micro-batch's time goes (ms): Spark's own breakdown
        progress.append({"batch": pr.batchId, **{k: int(v) for k, v in (pr.durationMs or {}).items()},
                         "dropped": sum(int(o.numRowsDroppedByWatermark or 0) for o in (pr.stateOperators or []))})
    q.stop()
    if parts:
        import pyarrow.feather as feather
        feather.write_feather(pa.concat_tables(parts), out_path + ".arrow")
    Path(out_path + ".json").write_text(json.dumps({"batches": batches, "complete": done.is_set(),
                                                    "progress": progress}))


class Peer:
    """The Structured Streaming driver process (:func:`peer_main`), started once."""

    def __init__(self, conf: list[str] = ()):
        self.conf = list(conf)
        cmd = [sys.executable, "-m", "bench.streaming", "peer"] + [f"--conf={c}" for c in conf]
        self.log = open(Path(tempfile.gettempdir()) / f"strata-bench-peer-{os.getpid()}-{len(conf)}.log", "w")
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True)
        line = self.p.stdout.readline()
        if line.strip() != "started":
            self.p.kill()
            raise RuntimeError(f"peer did not start: {line!r}")

    def send(self, job: dict) -> None:
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()

    def expect(self, word: str) -> None:
        line = self.p.stdout.readline()
        if line.strip() != word:
            raise RuntimeError(f"peer said {line!r}, expected {word!r} (exit {self.p.poll()})")

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except Exception:  # noqa: BLE001
            self.p.kill()
        self.log.close()


def peer_run(peer: Peer, query: str, d: Path, inputs: dict[str, pa.Table], rate: int, timeout: float) -> dict:
    """Land one Parquet file per instant into the peer's source directory on :func:`schedule`."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    run = d / f"peer_{query}_{rate}_{uuid.uuid4().hex[:6]}"
    stage, src = run / "stage", run / "src"
    instants = sorted(set(int(x) for t in inputs.values() for x in np.unique(t.column("ts").to_numpy())))
    for s, t in inputs.items():
        (stage / s).mkdir(parents=True)
        (src / s).mkdir(parents=True)
        ts = t.column("ts").to_numpy()
        bounds = np.searchsorted(ts, instants + [instants[-1] + 1])
        for i, tau in enumerate(instants):
            pq.write_table(t.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i])), stage / s / f"i{tau:06d}.parquet")
    sched = schedule(inputs, rate)
    peer.send({"query": query, "src": str(src), "ckpt": str(run / "ckpt"), "out": str(run / "out"),
               "instants": len(instants), "timeout": timeout})
    peer.expect("ready")
    la0 = loadavg()
    land: dict[int, float] = {}
    lag = 0.0
    t0 = time.monotonic()
    for tau in instants:
        wait = t0 + sched[tau] - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # the input's pace
        lag = max(lag, -wait)
        for s in inputs:
            os.rename(stage / s / f"i{tau:06d}.parquet", src / s / f"i{tau:06d}.parquet")
        land[tau] = time.time()
    peer.expect("done")
    la1 = loadavg()
    info = json.loads((run / "out.json").read_text())
    rows = feather.read_table(str(run / "out.arrow")) if (run / "out.arrow").exists() else None
    arrive = {}
    for b in info["batches"]:
        for tau in b["instants"]:
            arrive[tau] = b["written"]
    shutil.rmtree(run, ignore_errors=True)
    spark_ms = {}
    prog = info.get("progress") or []
    for k in ("triggerExecution", "addBatch", "queryPlanning", "walCommit", "getBatch", "latestOffset"):
        xs = [pr[k] for pr in prog if k in pr]
        if xs:
            spark_ms[k + "_p50_ms"] = float(np.median(xs))
    return {"rows": rows, "close": land, "arrive": arrive, "last": instants[-1], "lag": round(lag, 3),
            "complete": info["complete"], "batches": len(info["batches"]), "load": [la0, la1],
            "timings": spark_ms, "dropped_by_watermark": sum(pr.get("dropped", 0) for pr in prog)}


# ---- one step: both sides at one rate --------------------------------------------------------------
def step(side: str, query: str, rate: int, seconds: int, warmup: int, d: Path, strata: StrataSide | None,
         peer: Peer | None = None) -> dict:
    instants = warmup + seconds
    inputs = make_inputs(query, rate, instants)
    data_dir = d / f"data_{query}_{rate}"
    data_dir.mkdir(exist_ok=True)
    for s, t in inputs.items():
        with pa.OSFile(str(data_dir / f"{s}.arrow"), "wb") as f:
            with pa.ipc.new_file(f, t.schema) as w:
                w.write_table(t)
    exp = expected(query, inputs)
    timeout = instants + 120.0
    if side == "strata":
        r = strata.run(query, data_dir, inputs, rate, warmup, timeout)
    else:
        r = peer_run(peer, query, d, inputs, rate, timeout)
    shutil.rmtree(data_dir, ignore_errors=True)
    all_inst = set(range(instants))
    # every instant's rows against DuckDB (the peer: those its last emissions cover)

    try:
        checked, bad = check(query, exp, r.pop("rows"), all_inst, side == "strata", f"{side} {query} at {rate:,}/s"), None
    except BenchCheckFailed as e:  # recorded: the step is not sustained, the section fails at its end
        checked, bad = 0, str(e)
    if side == "strata":
        weights = r["weights"]
    else:  # the rows of each instant, as DuckDB has them (update mode re-emits; count the relation)
        weights = exp_weights(query, exp)
    lat = latency_stats(r["close"], r["arrive"], weights, warmup, r["last"])
    ok, why = verdict(lat, r["lag"], r.get("backlog") if side == "strata" else None)
    if bad:
        ok, why = False, f"OUTPUT WRONG: {bad}"
    rec = {"side": side, "query": query, "rate": rate, "seconds": seconds, "warmup": warmup, **lat,
           "sustained": ok, "why": why, "lag": r["lag"], "checked": checked, "load": r["load"]}
    if bad:
        rec["check_failed"] = bad
    for k in ("backlog", "backlog_max", "timings", "counters", "ended", "batches", "complete", "producer_seconds",
              "dropped_by_watermark"):
        if k in r:
            rec[k] = r[k]
    _log(f"{side:6s} {query} {rate:>9,}/s: p50 {lat['p50']} s, p99 {lat['p99']} s, last {lat['last']} s -> "
         f"{why}; checked {checked:,} against DuckDB; load {r['load'][0][0]}-{r['load'][1][0]}")
    return rec


def exp_weights(query: str, exp) -> dict[int, int]:
    import collections

    if query == "range":
        c = collections.Counter(t for t, _ in exp)
        return dict(c)
    if query == "rows":
        return {int(t): 1 for t in exp.column("ts").to_pylist()}
    return {t: sum(c.values()) for t, c in exp["pairs"].items()}


def sustained_search(query: str, sides: list[str], start: int, seconds: int, warmup: int, d: Path,
                     strata: StrataSide | None, peers: dict, max_steps: int,
                     rates: dict[str, list[int]] | None = None) -> dict:
    """Every side at each rate of the doubling ladder (side by side, Strata first), then each side's
    bisection; one unmeasured warm-up run per side first (a low rate, ``warmup + 5`` instants), so that
    neither side's first measured step pays its JVM's first plans and JIT.  ``rates`` (side -> rates): no
    search, each of those sides at exactly those rates, in turn (a repeat of given steps)."""
    if rates:
        sides = [s for s in sides if s in rates]
    warm = []
    for s in sides:
        rec = step(s, query, 1000, 5, warmup, d, strata, peers.get(s))
        warm.append({k: rec[k] for k in ("side", "rate", "p99", "sustained", "load", "why") + (
            ("check_failed",) if "check_failed" in rec else ())})
    results = {s: {} for s in sides}
    runs = []
    for i in range(max(len(r) for r in rates.values()) if rates else max_steps):
        if rates:
            todo = {s: rates[s][i] for s in sides if i < len(rates[s])}
        else:
            todo = {s: next_rate(results[s], start) for s in sides}
        todo = {s: r for s, r in todo.items() if r is not None}
        if not todo:
            break
        for s, r in todo.items():
            rec = step(s, query, r, seconds, warmup, d, strata, peers.get(s))
            results[s][r] = rec["sustained"]
            runs.append(rec)
    best = {s: max((r for r, ok in results[s].items() if ok), default=0) for s in sides}
    out = {"query": QUERIES[query][0], "runs": runs, "warm": warm, "best": best, "seconds": seconds,
           "warmup": warmup, "ratio": {}, **({"fixed_rates": rates} if rates else {})}
    for s in sides:
        if s != "strata":
            out["ratio"][s] = round(best["strata"] / best[s], 2) if best[s] else None
    return out


# ---- catch-up --------------------------------------------------------------------------------------
def catchup(d: Path, tuples: int, per_instant: int, runs: int, peers: list[str] = ("sss", "sss_p2")) -> dict:
    """``strata replay`` (defaults: an embedded cluster, 2 workers) vs Structured Streaming with
    ``availableNow`` over the same CSV, the RANGE query, interleaved; every output checked."""
    import pyarrow.csv as pcsv

    from bench.peers import check_range10, duckdb_range10  # deferred: bench.peers loads PySpark (the peer's side only)

    cfg = U.setup(d)
    table = vitals(tuples, per_instant)
    csv = d / f"vitals_{tuples}.csv"
    pcsv.write_csv(table, csv)
    exp = duckdb_range10(table)[0]
    inst = set(int(x) for x in np.unique(table.column("ts").to_numpy()))
    out = {"tuples": tuples, "per_instant": per_instant, "strata": [], "peers": list(peers)}
    for r in range(runs):
        run = U.replay_once(cfg, d, csv, f"catchup_{r}", [], query=RANGE_Q, level=LEVEL)  # the defaults
        check_range10(exp, pcsv.read_csv(run["output"]), "strata replay (catch-up)", inst, levels=True)
        t = run["timings"]
        out["strata"].append({"seconds": run["seconds"], "start": t.get("start"), "process": t.get("process"),
                              "read": t.get("read"), "cpu_seconds": run["cpu_seconds"], "load": loadavg()})
        _log(f"catch-up strata replay: {run['seconds']} s (start-up {t.get('start')} s, processing "
             f"{t.get('process')} s), load {out['strata'][-1]['load'][0]}")
        for name in peers:
            res = d / f"{name}_catchup_{r}"
            la = loadavg()
            p = subprocess.run([sys.executable, "-m", "bench.streaming", "catchup-peer", "--csv", str(csv), "--out",
                                str(res)] + [f"--conf={c}" for c in PEERS[name]], cwd=ROOT, capture_output=True,
                               text=True, timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"catch-up peer exited {p.returncode}: {p.stderr[-2000:]}")
            info = json.loads(Path(str(res) + ".json").read_text())
            import pyarrow.feather as feather
            check_range10(exp, feather.read_table(str(res) + ".arrow"), f"Structured Streaming {name} (catch-up)",
                          inst, levels=False)
            info["load"] = la
            out.setdefault(name, []).append(info)
            _log(f"catch-up Structured Streaming ({name}): query {info['seconds']} s (JVM start-up {info['start']} s), "
                 f"load {la[0]}")
    out["strata_seconds"] = float(np.median([x["seconds"] for x in out["strata"]]))
    out["strata_process"] = float(np.median([x["process"] for x in out["strata"]]))
    out["strata_after_start"] = float(np.median([x["seconds"] - x["start"] for x in out["strata"]]))
    for name in peers:
        out[name + "_seconds"] = float(np.median([x["seconds"] for x in out[name]]))
        out[name + "_total"] = float(np.median([x["seconds"] + x["start"] for x in out[name]]))
    return out


def catchup_peer(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.streaming catchup-peer")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--conf", action="append", default=[])
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    from pyspark.sql import functions as F

    spark = _peer_session("strata-bench-sss-catchup", a.conf)
    start = time.perf_counter() - t0
    src = Path(tempfile.mkdtemp(prefix="sss-catchup-"))
    os.link(a.csv, src / Path(a.csv).name) if os.stat(a.csv).st_dev == os.stat(src).st_dev else \
        shutil.copy(a.csv, src / Path(a.csv).name)
    parts: list[pa.Table] = []
    t1 = time.perf_counter()
    df = spark.readStream.schema(SCHEMAS["Vitals"]).option("header", True).csv(str(src))
    out = (df.withColumn("et", F.timestamp_seconds("ts")).withWatermark("et", "10 seconds")
           .groupBy(F.window("et", "10 seconds", "1 second"), "sid").agg(F.avg("bp").alias("a"))
           .select((F.unix_timestamp(F.col("window.end")) - 1).alias("tau"), "sid", "a"))
    q = (out.writeStream.outputMode("update").foreachBatch(lambda b, _i: parts.append(b.toArrow()))
         .option("checkpointLocation", str(src / "_ckpt")).trigger(availableNow=True).start())
    q.awaitTermination()
    secs = time.perf_counter() - t1
    import pyarrow.feather as feather
    feather.write_feather(pa.concat_tables(parts), a.out + ".arrow")
    Path(a.out + ".json").write_text(json.dumps({"seconds": round(secs, 3), "start": round(start, 3),
                                                  "micro_batches": len(q.recentProgress)}))
    spark.stop()
    shutil.rmtree(src, ignore_errors=True)
    return 0


# ---- the section -------------------------------------------------------------------------------------
#: the peers: Spark's defaults, and the one setting every Structured Streaming guide tells a local user
#: to change (spark.sql.shuffle.partitions: 200 by default, one state store per partition per micro-batch)
PEERS = {"sss": [], "sss_p2": ["spark.sql.shuffle.partitions=2"]}


def run(args, res: dict) -> None:
    """The ``streaming`` section of bench/run.py."""
    quick = getattr(args, "quick", False)
    seconds = getattr(args, "seconds", None) or (20 if quick else 60)
    queries = getattr(args, "queries", None) or ["range", "rows", "join"]
    peer_names = getattr(args, "peers", None) or list(PEERS)
    d = Path(tempfile.mkdtemp(prefix="strata-streaming-"))
    out = {"load_start": loadavg(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "bounds": {"p99": BOUND_P99, "last": BOUND_LAST, "lag": BOUND_LAG, "backlog": BOUND_BACKLOG},
           "peers": {k: PEERS[k] for k in peer_names}}
    prev = dict(res.get("streaming", {}))
    repeat = bool(getattr(args, "repeat", False) or getattr(args, "rates", None))
    for qn in QUERIES:  # a query of an earlier run kept beside this one's keeps that run's date, loads and code
        if isinstance(prev.get(qn), dict) and "date" not in prev[qn]:
            prev[qn] = {**prev[qn], **{k: prev[k] for k in ("date", "load_start", "load_end", "code") if k in prev}}
    out["code"] = _code()
    command = getattr(args, "command", None) or "python -m bench.run " + " ".join(sys.argv[1:])
    side, peers = None, {}

    failed: list[BaseException] = []  # correctness failures: the rest runs, the section fails at the end
    if getattr(args, "catchup_only", False):
        queries = []
    try:
        side = StrataSide(d) if queries else None
        out["up_seconds"] = side.up["seconds"] if side else None
        for k in (peer_names if queries else []):
            peers[k] = Peer(PEERS[k])
        starts = {"range": 10_000, "rows": 20_000, "join": 10_000}
        for qn in queries:
            # ROWS: Structured Streaming has no ROWS window over a stream; the join: only the tuned peer (Spark's
            # defaults sustain no rate at all on the RANGE query, and each step costs a minute and more)
            sides = ["strata"] + ([] if qn == "rows" else [p for p in peer_names if qn == "range" or p != "sss"])
            stamp = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": loadavg(),
                     "command": command, "code": out["code"]}
            try:
                out[qn] = sustained_search(qn, sides, getattr(args, "start", None) or starts[qn], seconds, WARMUP,
                                           d, side, peers, getattr(args, "max_steps", None) or 7,
                                           _rates(getattr(args, "rates", None)))
                out[qn].update(stamp, load_end=loadavg())
                if repeat and isinstance(prev.get(qn), dict) and prev[qn].get("runs"):  # kept beside the first run
                    out[qn] = {**prev[qn], "repeats": prev[qn].get("repeats", []) + [out[qn]]}
            except Exception as e:  # noqa: BLE001 - the other queries still run; the failure is reported
                import traceback
                traceback.print_exc()
                out[qn] = {"query": QUERIES[qn][0], "error": f"{type(e).__name__}: {e}"[:2000]}
                if type(e).__name__ == "BenchCheckFailed":
                    failed.append(e)
            res["streaming"] = {**prev, **out}
            _save_partial(res)
            for rec in out[qn].get("runs", []) + out[qn].get("warm", []):
                if rec.get("check_failed"):
                    failed.append(BenchCheckFailed(rec["check_failed"]))
    finally:
        for p in peers.values():
            p.close()
        if side is not None:
            side.close()
    if getattr(args, "catchup", True):
        out["catchup"] = catchup(d, 400_000 if quick else 2_000_000, 20_000,
                                 getattr(args, "catchup_runs", None) or (1 if quick else 2), peer_names)
    if not queries:  # the catch-up alone: the sustained-rate figures of the last run stay as they are
        res["streaming"] = {**prev, "catchup": {**out["catchup"], "date": out["date"]}}
    else:
        out["load_end"] = loadavg()
        res["streaming"] = {**prev, **out}
    shutil.rmtree(d, ignore_errors=True)
    if failed:
        raise failed[0]


def _rates(specs: list[str] | None) -> dict[str, list[int]] | None:
    """``--rates strata=60000,65000 sss_p2=1000`` -> ``{"strata": [60000, 65000], "sss_p2": [1000]}``."""
    if not specs:
        return None
    out = {}
    for spec in specs:
        side, _, rs = spec.partition("=")
        out[side] = [int(r) for r in rs.split(",") if r]
    return out


def _code() -> str:
    """The code a run measured: HEAD, and which top-level directories carried uncommitted changes (other
    engineers work in the same tree: the workers run the tree as it was at ``strata up``, each step's fresh
    master and the peer as it was at that step)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                            text=True, timeout=30).stdout.splitlines()
    except Exception:  # noqa: BLE001 - not a git checkout
        return "?"
    dirs = sorted({ln[3:].split("/")[0] for ln in st if ln[3:]})
    return f"HEAD {head}" + (f" plus uncommitted changes in {', '.join(dirs)}" if dirs else "")


def merge_results(path: Path, streaming: dict) -> None:
    """Write ``streaming`` as the ``streaming`` entry of ``path`` (results.json: re-read now, every other entry
    as it is on disk) and regenerate streaming.md beside it, as bench/report.py does."""
    res = json.loads(path.read_text()) if path.exists() else {}
    res["streaming"] = streaming
    path.write_text(json.dumps(res, indent=1, default=str))
    sec = report_section(streaming)
    (path.parent / "streaming.md").write_text(
        "# Streaming protocol (issue 35, item 1)\n\nGenerated by `bench/run.py` (`--only streaming`) or "
        "`python -m bench.streaming --merge` from results.json; method in bench/streaming.py, analysis in "
        "bench/NOTES.md.\n\n" + "\n".join(sec[1:]) + "\n", encoding="utf-8")


def _save_partial(res: dict) -> None:
    """Each query's figures as soon as they exist (a long section interrupted keeps them)."""
    path = ROOT / "out" / "streaming_partial.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(res.get("streaming", {}), indent=1, default=str))


# ---- the report (docs/benchmarks/README.md and streaming.md) ---------------------------------------
SIDE_NAMES = {"strata": "Strata (`strata up`, 2 workers)", "sss": "Structured Streaming, Spark's defaults",
              "sss_p2": "Structured Streaming, `spark.sql.shuffle.partitions=2`"}


def _f(x, d=2):
    return "—" if x is None else f"{x:,.{d}f}"


def report_section(st: dict) -> list[str]:
    """The ``streaming`` section's markdown (bench/report.py appends it to the README)."""
    b = st.get("bounds", {})
    L = [f"## Streaming protocol: sustained rate at p99 ≤ {b.get('p99', 2)} s, and catch-up (issue 35)"
         f" ({st.get('mode', '?')} mode, {st.get('date', '?')})", "",
         f"Input paced at R tuples/s (R tuples per instant, one instant per second) for {WARMUP} s of warm-up "
         f"plus the measured seconds; latency of a row = its arrival at the subscriber (Strata: the Python "
         f"API; Structured Streaming: its `foreachBatch` sink after `toArrow()`) − the wall time its instant "
         f"closed at the source. Sustained = p99 ≤ {b.get('p99')} s over the measured instants, the last "
         f"instant's rows within {b.get('last')} s of its close, the source never more than {b.get('lag')} s "
         f"behind its schedule, and (Strata) the master's backlog at the last close ≤ its value at the first "
         f"measured close + {b.get('backlog')} chunks. Structured Streaming: its own process and JVM, "
         "`local[*]`, 1 s processing-time trigger, one Parquet file per instant landing on the same schedule "
         "(bench/streaming.py says exactly how the semantics line up). Every run's output checked against "
         "DuckDB on every instant. " + (
             f"{st.get('cpus')} CPUs, shared; each query's run under *Runs* with its date and 1-minute load average "
             "at its start and end, each step's below." if any(isinstance(st.get(q), dict) and st[q].get("date")
                                                               for q in QUERIES) else
             f"1-minute load average at the start {st.get('load_start', ['?'])[0]} on {st.get('cpus')} CPUs (each "
             "step's load below)."), ""]
    rows = []

    def searches(q: dict) -> list[tuple[str, dict]]:
        """A query's search and its other runs (``--repeat``), each with its label for the tables."""
        return [("", q)] + [(f" (other run {i}, {x.get('date', '?')})", x)
                            for i, x in enumerate(q.get("repeats", []), 1)]

    every = [(qn + tag, q) for qn in ("range", "rows", "join") if st.get(qn) for tag, q in searches(st[qn])]
    for qn, q in every:
        if q.get("error"):
            L += [f"`{q['query']}` ({qn}): **failed**: {q['error'][:300]}", ""]
            continue
        # fixed rates (no search): a side's highest rate sustained with no higher one tried is a lower bound
        low = {sd: bool(q.get("fixed_rates")) and b > 0 and b == max(q["fixed_rates"].get(sd, [0]))
               for sd, b in q["best"].items()}
        for side, best in q["best"].items():
            at = [r for r in q["runs"] if r["side"] == side and r["rate"] == best]
            r = at[0] if at else {}
            ratio = q.get("ratio", {}).get(side) if side != "strata" else None
            ge = "≥ " if low.get(side) or (side != "strata" and low.get("strata")) else ""
            rows.append(f"| {qn} | {SIDE_NAMES.get(side, side)} | {'≥ ' if low[side] else ''}{best:,} | "
                        f"{'' if side == 'strata' else ('—' if ratio is None else f'{ge}{ratio}x')} | "
                        f"{_f(r.get('p50'))} | {_f(r.get('p99'))} | "
                        f"{_f(r['load'][0][0], 1) + '-' + _f(r['load'][1][0], 1) if r else '—'} |")
        if q.get("fixed_rates"):
            rows.append(f"| {qn} | (fixed rates, no search: " + "; ".join(
                f"{k} {', '.join(f'{x:,}' for x in v)}" for k, v in q["fixed_rates"].items()) + ") | | | | | |")
    L += ["| query | system | highest sustained R (tuples/s) | Strata / this | p50 s at R | p99 s at R | load |",
          "|---|---|---:|---:|---:|---:|---:|"] + rows + [""]
    L += ["Queries: " + "; ".join(f"{qn}: `{st[qn]['query']}`" for qn in ("range", "rows", "join") if st.get(qn)), ""]
    dated = [(qn.split(",")[0] + (")" if "," in qn else ""), q) for qn, q in every if q.get("date")]
    if dated:
        L += ["Runs: " + "; ".join(
            f"{qn}: {q['date']}" + (f", load {q['load_start'][0]} at its start" if q.get("load_start") else "")
            + (f" and {q['load_end'][0]} at its end" if q.get("load_end") else "")
            + (f", `{q['command']}`" if q.get("command") else "") + (f", code {q['code']}" if q.get("code") else "")
            + (f"; {q['note']}" if q.get("note") else "")
            for qn, q in dated) + ".", ""]
    missing = [qn for qn in ("range", "rows", "join") if not st.get(qn)]
    if missing:
        L += [f"Not measured in this run: {', '.join(missing)} (bench/NOTES.md, *Streaming protocol*, says why).", ""]
    L += ["Every step (in the order run; a 0 means no tested rate was sustained):", "",
          "| query | system | R | p50 s | p99 s | last s | source lag s | master backlog | p50 ms: Strata engine / transport / wait; Spark batch / addBatch / walCommit | verdict | load |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for qn, q in every:
        qn = qn.split(",")[0] + (")" if "," in qn else "")  # "join (other run 1)"
        for r in q.get("runs", []):
            t = r.get("timings") or {}
            keys = ("engine_p50_ms", "transport_p50_ms", "wait_p50_ms") if r["side"] == "strata" else \
                ("triggerExecution_p50_ms", "addBatch_p50_ms", "walCommit_p50_ms")
            ms = " / ".join(f"{t[k]:.0f}" if k in t else "—" for k in keys) if t else ""
            bl = "→".join(str(x) for x in r["backlog"]) if r.get("backlog") else ""
            L.append(f"| {qn} | {r['side']} | {r['rate']:,} | {_f(r['p50'])} | {_f(r['p99'])} | {_f(r['last'])} | "
                     f"{_f(r['lag'])} | {bl} | {ms} | {r['why']} | {r['load'][0][0]}-{r['load'][1][0]} |")
    L += [""]
    cu = st.get("catchup")
    if cu:
        L += [f"Catch-up from the same CSV ({cu['tuples']:,} Vitals tuples, {cu['per_instant']:,} per instant, "
              f"the RANGE query; {cu.get('date', st.get('date', '?'))}), medians: `strata replay` with its defaults "
              f"(an embedded cluster, 2 workers): {_f(cu['strata_seconds'])} s in all, "
              f"{_f(cu['strata_after_start'])} s after its cluster was ready (first tuple sent → last result "
              f"{_f(cu['strata_process'])} s).", "",
              "| peer | query seconds (`start()` → end, CSV read included) | with its JVM's start-up | "
              "Strata after start-up is faster by | Strata in all vs the peer with start-up | loads |",
              "|---|---:|---:|---:|---:|---|"]
        for name in cu.get("peers", ["sss"]):
            if name + "_seconds" not in cu:
                continue
            L.append(f"| {SIDE_NAMES.get(name, name)} | {_f(cu[name + '_seconds'])} | {_f(cu[name + '_total'])} | "
                     f"{_f(cu[name + '_seconds'] / cu['strata_after_start'])}x | "
                     f"{_f(cu[name + '_total'] / cu['strata_seconds'])}x | "
                     + ", ".join(str(x["load"][0]) for x in cu.get(name, [])) + " |")
        L += ["", "Strata's loads: " + ", ".join(str(x["load"][0]) for x in cu["strata"]) + ".", ""]
    return L


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "produce":
        return produce(argv[1:])
    if argv and argv[0] == "peer":
        return peer_main(argv[1:])
    if argv and argv[0] == "catchup-peer":
        return catchup_peer(argv[1:])
    ap = argparse.ArgumentParser(description="the streaming protocol (issue 35): sustained rate and catch-up")
    ap.add_argument("--queries", nargs="+", choices=list(QUERIES))
    ap.add_argument("--seconds", type=int, help="measured seconds per step (default 60; after a 10 s warm-up)")
    ap.add_argument("--start", type=int, help="the first rate tried (tuples/s)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--rates", nargs="+", metavar="SIDE=R,R",
                    help="no search: each named side (strata, sss, sss_p2) at exactly these rates, e.g. a repeat "
                         "of earlier steps (the report's best is then the highest of these sustained)")
    ap.add_argument("--no-catchup", dest="catchup", action="store_false")
    ap.add_argument("--peers", nargs="+", choices=list(PEERS))
    ap.add_argument("--catchup-only", action="store_true", help="only the catch-up runs")
    ap.add_argument("--repeat", action="store_true",
                    help="with --merge: add this run of each query as a repeat beside the one in the file (its "
                         "figures stay the query's headline) instead of replacing it; implied by --rates")
    ap.add_argument("--catchup-runs", type=int, help="catch-up runs per system (default 2, quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--merge", metavar="RESULTS_JSON",
                    help="keep the other queries' figures of this file's `streaming` entry, write the entry back "
                         "with this run's queries replacing theirs (the file's other entries untouched) and "
                         "regenerate streaming.md beside it")
    args = ap.parse_args(argv)
    args.command = "python -m bench.streaming " + " ".join(argv)
    res: dict = {}
    if args.merge and Path(args.merge).exists():
        res["streaming"] = json.loads(Path(args.merge).read_text()).get("streaming", {})
    run(args, res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if args.merge:
        merge_results(Path(args.merge), res["streaming"])
    print(json.dumps(res["streaming"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
