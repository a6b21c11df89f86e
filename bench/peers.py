"""Peers on the same machine and data: Spark Structured Streaming and single-process DuckDB.

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


def _spark():
    from strata.worker.spark import get_session

    return get_session(master="local[2]", app_name="strata-bench-peers")


def structured_streaming(table: pa.Table, files_per_batch: int) -> dict:
    """Run the tumbling-window AVG over ``table`` with Structured Streaming; seconds and rows."""
    from pyspark.sql import functions as F

    spark = _spark()
    d = Path(tempfile.mkdtemp(prefix="strata-sss-"))
    try:
        src = d / "in"
        src.mkdir()
        ts = table.column("ts").to_numpy()
        cuts = np.flatnonzero(np.diff(ts)) + 1
        bounds = np.concatenate(([0], cuts, [len(ts)]))
        for i in range(len(bounds) - 1):
            a, b = int(bounds[i]), int(bounds[i + 1])
            pq.write_table(table.slice(a, b - a).select(["ts", "level", "sid", "bp", "pr", "weight"]),
                           src / f"part-{i:06d}.parquet")
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
    from bench.check import BenchCheckFailed

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
