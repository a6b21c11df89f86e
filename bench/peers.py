"""Peers on the same machine and data: Spark Structured Streaming and single-process DuckDB.

``python -m bench.peers`` runs the RANGE comparison (:func:`range_comparison`): Strata's engine
path against Structured Streaming's sliding window on ``SELECT sid, AVG(bp) FROM Vitals [RANGE 10
SECONDS] GROUP BY sid``, both checked against DuckDB on every instant.

Structured Streaming cannot express a ``ROWS n`` window on a stream (it rejects
non-time-based windows, see :func:`sss_rows_window_error`), so the closest
expressible query is the per-instant time-window aggregate, i.e. Strata's
``SELECT AVG(bp) FROM Vitals [RANGE 1 SECONDS]`` with one-second instants:
``groupBy(window(event_time, "1 second")).avg("bp")``.  The input is written
as one Parquet file per instant and read ``maxFilesPerTrigger`` = chunk length
files per micro-batch (the analogue of a chunk), ``trigger(availableNow)``,
update mode into a memory sink.  DuckDB evaluates both the ROWS-100 query
(window SQL) and the per-instant AVG from the in-memory Arrow table: the
single-process ceiling without any distribution, security or streaming cost.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import userpath as U
from bench.check import BenchCheckFailed
from bench.workloads import vitals
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.local import cut_chunks
from strata.worker.engine import Engine
from strata.worker.spark import get_session

STRATA_RANGE_QUERY = "SELECT AVG(bp) FROM Vitals [RANGE 1 SECONDS]"


def duckdb_range(table: pa.Table) -> tuple[pa.Table, float]:
    import duckdb

    con = duckdb.connect()
    con.register("src", table.select(["ts", "bp"]))
    t0 = time.perf_counter()
    out = con.sql("SELECT ts, AVG(bp) AS a FROM src GROUP BY ts ORDER BY ts").to_arrow_table()
    secs = time.perf_counter() - t0
    if hasattr(out, "read_all"):
        out = out.read_all()
    return out, secs


#: Structured Streaming's driver JVM as Spark starts it (tiered C1+C2 compilers, G1), not the worker's
#: (C1 only, tuned for many short jobs): in one process per option set, 2026-11-26, the extra 980 k
#: tuples of :func:`range_cli` took Structured Streaming 3.0-3.1 s with these and 4.2-4.6 s in the
#: worker's JVM (bench/NOTES.md).  The Spark settings (shuffle partitions = cores, no UI, ...) stay.
PEER_JVM = {"spark.driver.extraJavaOptions": ""}


def _spark(peer_jvm: bool = False):
    """This process's session; ``peer_jvm``: if this call starts the JVM, start it as Spark does
    (:data:`PEER_JVM`).  The first call of a process decides."""
    return get_session(master="local[2]", app_name="strata-bench-peers", conf=PEER_JVM if peer_jvm else None)


def _parquet_per_instant(table: pa.Table, src: Path) -> Path:
    """``table`` (sorted by ts) as one Parquet file per instant in ``src``, in instant order: the
    source Structured Streaming reads, ``maxFilesPerTrigger`` instants per micro-batch."""
    src.mkdir()
    ts = table.column("ts").to_numpy()
    cuts = np.flatnonzero(np.diff(ts)) + 1
    bounds = np.concatenate(([0], cuts, [len(ts)]))
    for i in range(len(bounds) - 1):
        a, b = int(bounds[i]), int(bounds[i + 1])
        pq.write_table(table.slice(a, b - a).select(["ts", "level", "sid", "bp", "pr", "weight"]),
                       src / f"part-{i:06d}.parquet")
    return src


def structured_streaming(table: pa.Table, files_per_batch: int) -> dict:
    """Run the tumbling-window AVG over ``table`` with Structured Streaming; seconds and rows."""
    from pyspark.sql import functions as F

    spark = _spark()
    d = Path(tempfile.mkdtemp(prefix="strata-sss-"))
    try:
        src = _parquet_per_instant(table, d / "in")
        schema = spark.read.parquet(str(src / "part-000000.parquet")).schema
        df = (spark.readStream.schema(schema).option("maxFilesPerTrigger", files_per_batch).parquet(str(src)))
        agg = (df.withColumn("et", F.timestamp_seconds("ts"))
               .groupBy(F.window("et", "1 second")).agg(F.avg("bp").alias("a"))
               .select(F.unix_timestamp(F.col("window.start")).alias("ts"), "a"))
        name = f"sss_{int(time.time() * 1000)}"
        t0 = time.perf_counter()
        q = (agg.writeStream.outputMode("update").format("memory").queryName(name)
             .option("checkpointLocation", str(d / "ckpt")).trigger(availableNow=True).start())
        q.awaitTermination()
        secs = time.perf_counter() - t0
        batches = len(q.recentProgress)
        rows = spark.sql(f"SELECT ts, a FROM {name}").toArrow()
        return {"seconds": round(secs, 3), "throughput": round(table.num_rows / secs), "micro_batches": batches,
                "files_per_batch": files_per_batch, "rows": rows}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def compare_range(rows: pa.Table, expected: pa.Table, what: str) -> None:
    # update mode may emit a window more than once: keep the last value per window
    got = {}
    for t, a in zip(rows.column("ts").to_pylist(), rows.column("a").to_pylist()):
        got[t] = a
    exp = dict(zip(expected.column("ts").to_pylist(), expected.column("a").to_pylist()))
    if set(got) != set(exp):
        raise BenchCheckFailed(f"{what}: instants differ")
    bad = [t for t in exp if not np.isclose(got[t], exp[t], rtol=1e-9)]
    if bad:
        raise BenchCheckFailed(f"{what}: AVG differs at instant {bad[0]}: {got[bad[0]]} vs {exp[bad[0]]}")


def sss_rows_window_error() -> str:
    """What Structured Streaming says to a ROWS-100 window over a stream."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    spark = _spark()
    d = Path(tempfile.mkdtemp(prefix="strata-sss-"))
    try:
        pq.write_table(pa.table({"ts": [0, 1], "bp": [1.0, 2.0]}), d / "a.parquet")
        df = spark.readStream.schema(spark.read.parquet(str(d)).schema).parquet(str(d))
        w = Window.orderBy("ts").rowsBetween(-99, 0)
        q = df.select(F.avg("bp").over(w).alias("a")).writeStream.format("memory").queryName("rows_probe") \
            .option("checkpointLocation", str(d / "ck")).trigger(availableNow=True).start()
        q.awaitTermination()
        return "accepted (unexpected)"
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0]
        return msg[:300]
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- RANGE windows where every tuple counts: Strata's engine path vs a sliding window ---------------
RANGE10_QUERY = "SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid"
#: the same query at TS for Structured Streaming: window [s, s + 10 s) sliding by 1 s; Strata's
#: window at instant τ is (τ - 10, τ], i.e. the sliding window starting at τ - 9
RANGE10_SECONDS = 10
_RANK = {"U": 0, "C": 1, "S": 2, "TS": 3}


def duckdb_range10(table: pa.Table) -> tuple[dict, float]:
    """``{(τ, sid): (avg, level)}`` at every instant with DuckDB (window ``τ-9 ≤ ts ≤ τ``; level =
    the highest of the group's tuples, the lub in the battlefield's total order); and seconds."""
    import duckdb

    con = duckdb.connect()
    lv = pa.array([_RANK[x] for x in table.column("level").to_pylist()], pa.int64())
    con.register("src", pa.table({"ts": table.column("ts"), "sid": table.column("sid"),
                                  "bp": table.column("bp"), "lv": lv}))
    t0 = time.perf_counter()
    out = con.sql(
        f"SELECT t.ts AS tau, s.sid, AVG(s.bp) AS a, MAX(s.lv) AS lv FROM (SELECT DISTINCT ts FROM src) t "
        f"JOIN src s ON s.ts BETWEEN t.ts - {RANGE10_SECONDS - 1} AND t.ts GROUP BY 1, 2").fetchall()
    secs = time.perf_counter() - t0
    names = {v: k for k, v in _RANK.items()}
    return {(int(t), s): (a, names[int(v)]) for t, s, a, v in out}, secs


def strata_range10(table: pa.Table, chunk_instants: int, engine=None) -> dict:
    """Strata's engine path in one process: the master's chunker cuts ``table`` into chunks of
    ``chunk_instants`` instants (with the RANGE legacy of each), the worker's engine evaluates
    them one after the other (``Engine.run``, the interpreted session for small chunks, the
    pre-aggregation for RANGE aggregates).  Seconds of cutting and of evaluation, and the rows."""
    cfg = parse_config(BATTLEFIELD_TOML)
    engine = engine or Engine(_spark(), cfg)
    t0 = time.perf_counter()
    p, ids, chunks = cut_chunks(cfg, "TS", [RANGE10_QUERY], {"Vitals": table}, chunk_instants)
    cut = time.perf_counter() - t0
    parts = []
    t1 = time.perf_counter()
    for c in chunks:
        for qc in c.queries:
            r = engine.run(p.queries[qc.query_id], qc)
            if r.error:
                raise RuntimeError(r.error)
            parts.append(r.rows)
    secs = time.perf_counter() - t1
    rows = pa.concat_tables(parts) if parts else None
    return {"seconds": round(cut + secs, 3), "cut_seconds": round(cut, 3), "engine_seconds": round(secs, 3),
            "chunks": len(chunks), "rows": rows}


def sss_range10(table: pa.Table, files_per_batch: int) -> dict:
    """Structured Streaming: ``groupBy(window(ts, "10 seconds", "1 second"), sid).avg(bp)`` over one
    Parquet file per instant, ``files_per_batch`` files per micro-batch, update mode, memory sink."""
    from pyspark.sql import functions as F

    spark = _spark()
    d = Path(tempfile.mkdtemp(prefix="strata-sss-"))
    try:
        src = _parquet_per_instant(table, d / "in")
        schema = spark.read.parquet(str(src / "part-000000.parquet")).schema
        df = spark.readStream.schema(schema).option("maxFilesPerTrigger", files_per_batch).parquet(str(src))
        agg = (df.withColumn("et", F.timestamp_seconds("ts"))
               .groupBy(F.window("et", f"{RANGE10_SECONDS} seconds", "1 second"), "sid").agg(F.avg("bp").alias("a"))
               .select((F.unix_timestamp(F.col("window.end")) - 1).alias("tau"), "sid", "a"))
        name = f"sss_range_{int(time.time() * 1000)}"
        t0 = time.perf_counter()
        q = (agg.writeStream.outputMode("update").format("memory").queryName(name)
             .option("checkpointLocation", str(d / "ckpt")).trigger(availableNow=True).start())
        q.awaitTermination()
        secs = time.perf_counter() - t0
        rows = spark.sql(f"SELECT tau, sid, a FROM {name}").toArrow()
        spark.catalog.dropTempView(name)
        return {"seconds": round(secs, 3), "micro_batches": len(q.recentProgress), "rows": rows}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def check_range10(expected: dict, rows: pa.Table, what: str, instants: set[int], levels: bool) -> int:
    """Compare a run with DuckDB at every instant (every (τ, sid) group, AVG within 1e-9, and the
    level when the run has one); returns how many groups were compared."""
    got: dict = {}
    names = rows.column_names
    tau_col = "ts" if "ts" in names else "tau"
    avg_col = [c for c in names if c not in (tau_col, "sid", "level")][0]
    lv = rows.column("level").to_pylist() if levels else [None] * rows.num_rows
    for t, s, a, l in zip(rows.column(tau_col).to_pylist(), rows.column("sid").to_pylist(),
                          rows.column(avg_col).to_pylist(), lv):
        if int(t) in instants:
            got[(int(t), s)] = (a, l)  # update mode: the last emission of a window wins
    exp = {k: v for k, v in expected.items() if k[0] in instants}
    if set(got) != set(exp):
        missing = sorted(set(exp) - set(got))[:3]
        extra = sorted(set(got) - set(exp))[:3]
        raise BenchCheckFailed(f"{what}: groups differ from DuckDB (missing {missing}, extra {extra})")
    for k, (a, l) in exp.items():
        ga, gl = got[k]
        if not np.isclose(ga, a, rtol=1e-9, atol=1e-9):
            raise BenchCheckFailed(f"{what}: AVG at {k} is {ga}, DuckDB {a}")
        if levels and gl != l:
            raise BenchCheckFailed(f"{what}: level at {k} is {gl}, DuckDB {l}")
    return len(exp)


def range_comparison(tuples: int = 1_000_000, per_instant: int = 20_000, chunk_lengths=(1, 25),
                     runs: int = 3) -> dict:
    """Strata's engine path vs Structured Streaming on ``RANGE10_QUERY``'s data, both checked
    against DuckDB on every instant; runs interleaved (Strata, SSS, Strata, ...) in one session."""
    import os

    table = vitals(tuples, per_instant)
    instants = set(int(t) for t in np.unique(table.column("ts").to_numpy()))
    expected, dd_secs = duckdb_range10(table)
    engine = Engine(_spark(), parse_config(BATTLEFIELD_TOML))
    out = {"tuples": tuples, "per_instant": per_instant, "duckdb_seconds": round(dd_secs, 3), "configs": []}
    for k in chunk_lengths:
        cfg = {"chunk_instants": k, "strata": [], "sss": [], "load": []}
        for r in range(runs):
            cfg["load"].append(round(os.getloadavg()[0], 2))
            s = strata_range10(table, k, engine)
            cfg["checked_groups"] = check_range10(expected, s.pop("rows"), f"Strata K={k}", instants, levels=True)
            cfg["strata"].append(s)
            m = sss_range10(table, k)
            check_range10(expected, m.pop("rows"), f"Structured Streaming K={k}", instants, levels=False)
            cfg["sss"].append(m)
            print(f"K={k} run {r + 1}: Strata {s['seconds']:.2f} s ({s['chunks']} chunks), "
                  f"Structured Streaming {m['seconds']:.2f} s ({m['micro_batches']} micro-batches), "
                  f"load {cfg['load'][-1]}", flush=True)
        out["configs"].append(cfg)
    return out


def range_cli(tuples: int = 1_000_000, small: int = 20_000, runs: int = 2, warm: bool = False) -> dict:
    """The user's path: ``strata replay --level TS --workers 2 --chunk-seconds 1`` (an embedded
    cluster per run, default settings otherwise, nothing injected) of battlefield CSVs of ``tuples``
    and ``small`` tuples with ``RANGE10_QUERY``, against Structured Streaming in this process's warm
    session on the same data (default trigger: every file in one micro-batch), runs interleaved.
    Each side's cost of the extra ``tuples - small`` tuples is the difference of the medians:
    Strata's from the replay's own ``process`` timing (after the cluster is ready; its start-up is
    reported apart), Structured Streaming's from its query time, in a JVM started with Spark's own
    options (:data:`PEER_JVM`).  Every output is checked against DuckDB on every instant (the
    replay's written CSV with levels).

    ``warm``: the fast path for repeated runs instead: ``strata up --levels TS --workers 2`` once,
    one unmeasured ``strata replay --cluster`` per size (the workers have run the query's shape),
    then ``strata replay --cluster`` per run (a fresh master onto the warm workers, whose CPU is
    counted too)."""
    import contextlib
    import statistics

    import pyarrow.csv as pcsv

    d = Path(tempfile.mkdtemp(prefix="strata-range-cli-"))
    cluster = contextlib.ExitStack()  # the warm path's `strata up` cluster, stopped at the end
    try:
        cfg = U.setup(d)
        files = U.write_inputs(d, [small, tuples])
        tables = {n: vitals(n, U.PER_INSTANT) for n in (small, tuples)}
        expected = {n: duckdb_range10(t)[0] for n, t in tables.items()}
        instants = {n: set(int(x) for x in np.unique(t.column("ts").to_numpy())) for n, t in tables.items()}
        out = {"tuples": tuples, "small": small, "strata": [], "sss": [], "load": [],
               "sss_jvm": "Spark's defaults (tiered C1+C2, G1)", "warm": warm}
        _spark(peer_jvm=True)  # Structured Streaming in the JVM Spark itself would start
        sss_range10(tables[small], 10 ** 6)  # unmeasured: Structured Streaming's runs below are in a warm session
        extra, also = None, []
        if warm:
            state = d / "up-state"
            out["up_seconds"] = cluster.enter_context(U.up_cluster(cfg, state, "TS"))["seconds"]
            extra, also = ["--cluster", str(state)], U.worker_pids(state)
            for n in (small, tuples):  # unmeasured: the workers run the query's shape once
                U.replay_once(cfg, d, files[n], f"warm_{n}", extra, also=also, query=RANGE10_QUERY, level="TS")
        for r in range(runs):
            for n in ((small, tuples) if r % 2 == 0 else (tuples, small)):
                run = U.replay_once(cfg, d, files[n], f"{n}_{r}", extra, also=also, query=RANGE10_QUERY, level="TS")
                out["load"].append(run["load"])
                t = run["timings"]
                check_range10(expected[n], pcsv.read_csv(run["output"]), f"strata replay {n:,}", instants[n],
                              levels=True)
                out["strata"].append({"tuples": n, "seconds": run["seconds"], "cpu_seconds": run["cpu_seconds"],
                                      "start": t.get("start"), "process": t.get("process")})
                m = sss_range10(tables[n], 10 ** 6)
                check_range10(expected[n], m.pop("rows"), f"Structured Streaming {n:,}", instants[n], levels=False)
                out["sss"].append({"tuples": n, **m})
                print(f"run {r + 1}, {n:,} tuples: strata replay {run['seconds']:.2f} s (start-up {t.get('start')} s, "
                      f"processing {t.get('process')} s), Structured Streaming {m['seconds']:.2f} s", flush=True)

        def med(side, n, key):
            return statistics.median(x[key] for x in out[side] if x["tuples"] == n)

        out["strata_extra_seconds"] = round(med("strata", tuples, "process") - med("strata", small, "process"), 3)
        out["sss_extra_seconds"] = round(med("sss", tuples, "seconds") - med("sss", small, "seconds"), 3)
        out["ratio"] = round(out["sss_extra_seconds"] / out["strata_extra_seconds"], 2) \
            if out["strata_extra_seconds"] > 0 else None
        out["strata_start"] = med("strata", small, "start")
        return out
    finally:
        cluster.close()
        shutil.rmtree(d, ignore_errors=True)


def record(res: dict, key: str = "range_peers") -> None:
    """Keep ``res`` in docs/benchmarks/results.json as ``key`` (dated, with the load range)."""
    import datetime
    import json

    path = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "results.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    loads = [x for c in res.get("configs", [res]) for x in c.get("load", [])]
    doc[key] = {**res, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "load": f"{min(loads):g}-{max(loads):g}" if loads else "?"}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> int:
    """``python -m bench.peers``: the RANGE comparison, as a markdown table on stdout."""
    import argparse
    import json
    import statistics

    ap = argparse.ArgumentParser(description="Strata's engine path vs Structured Streaming on RANGE 10 s")
    ap.add_argument("--tuples", type=int, default=1_000_000)
    ap.add_argument("--per-instant", type=int, default=20_000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 25], help="instants per chunk / micro-batch")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--record", action="store_true",
                    help="also keep them in docs/benchmarks/results.json (range_peers) for the README's headline")
    ap.add_argument("--cli", action="store_true",
                    help="the user's path instead: `strata replay` vs Structured Streaming (range_cli)")
    ap.add_argument("--warm", action="store_true",
                    help="with --cli: `strata replay --cluster` onto a `strata up` cluster's warm workers "
                         "(range_cli_warm)")
    args = ap.parse_args(argv)
    if args.warm and not args.cli:
        ap.error("--warm goes with --cli")
    if args.cli:
        res = range_cli(args.tuples, runs=args.runs, warm=args.warm)
        if args.record:
            record(res, "range_cli_warm" if args.warm else "range_cli")
        print(f"\nstrata replay{' --cluster (warm workers)' if args.warm else ''} (processing after ready) "
              f"{res['strata_extra_seconds']} s vs Structured Streaming {res['sss_extra_seconds']} s for the extra "
              f"{args.tuples - res['small']:,} tuples: {res['ratio']}x; every output checked against DuckDB on every instant")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    res = range_comparison(args.tuples, args.per_instant, args.chunks, args.runs)
    if args.record:
        record(res)
    print(f"\n{args.tuples:,} Vitals tuples, {args.per_instant:,} per instant, `{RANGE10_QUERY}` at TS; "
          f"DuckDB {res['duckdb_seconds']} s; every run checked against DuckDB on all instants "
          f"({res['configs'][0].get('checked_groups', 0):,} (instant, sid) groups).\n")
    print("| instants per chunk / micro-batch | run | Strata s | Strata tuples/s | Structured Streaming s | "
          "SSS tuples/s | Strata / SSS speed | load |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for cfg in res["configs"]:
        for r, (s, m) in enumerate(zip(cfg["strata"], cfg["sss"])):
            label = "1 (cold)" if r == 0 else str(r + 1)
            print(f"| {cfg['chunk_instants']} | {label} | {s['seconds']:.2f} | {args.tuples / s['seconds']:,.0f} | "
                  f"{m['seconds']:.2f} | {args.tuples / m['seconds']:,.0f} | {m['seconds'] / s['seconds']:.1f}x | "
                  f"{cfg['load'][r]} |")
        if len(cfg["strata"]) > 1:
            ms = statistics.median(x["seconds"] for x in cfg["strata"][1:])
            mm = statistics.median(x["seconds"] for x in cfg["sss"][1:])
            print(f"| {cfg['chunk_instants']} | median 2-{len(cfg['strata'])} | {ms:.2f} | {args.tuples / ms:,.0f} | "
                  f"{mm:.2f} | {args.tuples / mm:,.0f} | {mm / ms:.1f}x | |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
