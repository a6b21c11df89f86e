"""Micro-benchmark of the Spark chunk engine (worker/engine.py); not a test.

Dissertation §9.2-style battlefield queries at level TS over 4 levels (U, C, S,
TS; a quarter of the tuples each), chunks built by hand: ``N`` new tuples per
instant, ``k`` instants per chunk, legacy = the last 100 tuples before the chunk
(the ROWS 100 windows' Def. 13 legacy, which is also the window at the previous
instant that ISTREAM needs).  Reports new tuples per second of wall time per
``Engine.run`` (median of ``--reps`` runs after ``--warmup`` runs), as a
markdown table on stdout and in ``docs/benchmarks/engine_micro.md``.

    .venv/bin/python bench/engine_micro.py                     # 1k/10k/50k × 1/4 instants
    .venv/bin/python bench/engine_micro.py --sizes 1000 10000 --reps 3
    .venv/bin/python bench/engine_micro.py --queries long-arith long-sum group-long-sum state-long-sum --out -

The ``long-*`` queries use 64-bit arithmetic and SUM/AVG of longs (``ts``), whose
overflow checks (SEMANTICS §8) are the only per-row cost queries over doubles do
not pay.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata.chunking.model import QueryChunk  # noqa: E402
from strata.config import parse_config  # noqa: E402
from strata.examples import BATTLEFIELD_TOML  # noqa: E402
from strata.mlscql import compile_query  # noqa: E402

CONFIG = BATTLEFIELD_TOML

QUERIES = {
    "select": "SELECT sid, bp FROM Vitals[ROWS 100] WHERE bp > 120",
    "group-avg": "SELECT sid, AVG(bp) FROM Vitals[ROWS 100] GROUP BY sid",
    "avg": "SELECT AVG(bp) FROM Vitals[ROWS 100]",
    "join": "SELECT v.sid, v.bp, p.lat FROM Vitals[ROWS 100] v, Positions[ROWS 100] p WHERE v.sid = p.sid",
}
#: optional extras (--queries range-group state-group): windows that hold whole instants
EXTRA = {
    "range-group": "SELECT sid, AVG(bp) FROM Vitals[RANGE 1 SECONDS] GROUP BY sid",
    "state-group": "SELECT sid, AVG(bp) FROM Vitals GROUP BY sid",
    # 64-bit integer arithmetic and SUM/AVG of longs (checked for overflow; SEMANTICS §8 Arithmetic)
    "long-arith": "SELECT sid, ts * 2 + 1 AS t2 FROM Vitals[ROWS 100] WHERE ts % 2 = 0 AND ts - 1 >= 0",
    "long-sum": "SELECT SUM(ts), AVG(ts) FROM Vitals[ROWS 100]",
    "group-long-sum": "SELECT sid, SUM(ts), COUNT(*) FROM Vitals[RANGE 1 SECONDS] GROUP BY sid",
    "state-long-sum": "SELECT sid, SUM(ts), MAX(ts) - MIN(ts) FROM Vitals GROUP BY sid",
}
ALL = {**QUERIES, **EXTRA}
LEVELS = np.array(["U", "C", "S", "TS"])
LEGACY = 100
SIDS = 200


def make_stream(stream: str, per_instant: int, instants: int, seed: int) -> pa.Table:
    """``LEGACY`` tuples at instant 0, then ``per_instant`` tuples at each instant 1..instants."""
    rng = np.random.default_rng(seed)
    n = LEGACY + per_instant * instants
    ts = np.concatenate([np.zeros(LEGACY, np.int64), np.repeat(np.arange(1, instants + 1, dtype=np.int64), per_instant)])
    cols = {
        "_seq": pa.array(np.arange(n, dtype=np.int64)),
        "ts": pa.array(ts),
        "level": pa.array(LEVELS[np.arange(n) % 4]),
        "sid": pa.array(np.char.add("s", (rng.integers(0, SIDS, n)).astype(str))),
    }
    if stream == "Vitals":
        cols["bp"] = pa.array(rng.normal(120, 15, n))
        cols["pr"] = pa.array(rng.normal(70, 10, n))
        cols["weight"] = pa.array(rng.normal(80, 10, n))
    else:
        cols["lat"] = pa.array(rng.uniform(-90, 90, n))
        cols["lon"] = pa.array(np.where(rng.random(n) < 0.5, "E", "W"))
    return pa.table(cols)


def shift(table: pa.Table, offset: int) -> pa.Table:
    if not offset:
        return table
    i = table.column_names.index("ts")
    return table.set_column(i, "ts", pa.compute.add(table.column("ts"), offset))


def run(args) -> str:
    from strata.worker.engine import Engine
    from strata.worker.spark import get_session

    conf = {}
    if args.aqe is not None:
        conf["spark.sql.adaptive.enabled"] = args.aqe
    if args.shuffle_partitions is not None:
        conf["spark.sql.shuffle.partitions"] = args.shuffle_partitions
    spark = get_session(master=args.master, app_name="strata-bench", conf=conf)
    cfg = parse_config(CONFIG)
    engine = Engine(spark, cfg, membership=args.membership)
    lines = [
        "| query | tuples/instant | instants/chunk | new tuples/chunk | out rows | median s | tuples/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    # JVM warm-up (JIT, class loading) so the first configurations are not penalized
    for w in range(args.jvm_warmup):
        for name in args.queries:
            cq = compile_query(ALL[name], cfg, "TS")
            tables = [make_stream(it.stream, 1000, 2, seed=1) for it in cq.items]
            engine.run(cq, QueryChunk("warm", w, [shift(t, w * 10) for t in tables],
                                      [w * 10 + 1, w * 10 + 2], prev_instant=w * 10))
    for name in args.queries:
        cq = compile_query(ALL[name], cfg, "TS")
        for n in args.sizes:
            for k in args.instants:
                tables = [make_stream(it.stream, n, k, seed=7 + j) for j, it in enumerate(cq.items)]
                new = sum(t.num_rows - LEGACY for t in tables)
                times, out = [], 0
                for rep in range(args.warmup + args.reps):
                    # every run gets other instants, as consecutive chunks do (no plan/codegen reuse
                    # from identical literals)
                    off = 0 if args.same_instants else (rep + 1) * 1000
                    chunk = QueryChunk("bench", rep, [shift(t, off) for t in tables],
                                       list(range(off + 1, off + k + 1)), prev_instant=off)
                    t0 = time.perf_counter()
                    res = engine.run(cq, chunk)
                    if rep >= args.warmup:
                        times.append(time.perf_counter() - t0)
                        out = res.rows.num_rows
                med = statistics.median(times)
                row = f"| {name} | {n:,} | {k} | {new:,} | {out:,} | {med:.3f} | {new / med:,.0f} |"
                lines.append(row)
                print(row, flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000], help="tuples per instant")
    ap.add_argument("--instants", type=int, nargs="+", default=[1, 4], help="instants per chunk")
    ap.add_argument("--queries", nargs="+", default=list(QUERIES), choices=list(ALL))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured runs per configuration")
    ap.add_argument("--jvm-warmup", type=int, default=10, help="rounds of all queries before measuring")
    ap.add_argument("--shuffle-partitions", default=None, help="override spark.sql.shuffle.partitions")
    ap.add_argument("--master", default=os.environ.get("STRATA_SPARK_MASTER", "local[2]"))
    ap.add_argument("--membership", choices=["arrow", "spark"], default="arrow",
                    help="window intervals in NumPy with pruning (default) or Spark lead()")
    ap.add_argument("--same-instants", action="store_true",
                    help="repeat the identical chunk (lets Spark reuse generated code; optimistic)")
    ap.add_argument("--aqe", choices=["true", "false"], default=None, help="override spark.sql.adaptive.enabled")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "engine_micro.md"),
                    help="markdown file to write ('-' for none)")
    args = ap.parse_args(argv)
    print(f"Spark master {args.master}; {os.cpu_count()} CPUs; Python {platform.python_version()}", flush=True)
    table = run(args)
    print()
    print(table)
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = (
            "# Engine micro-benchmark\n\n"
            "`bench/engine_micro.py`: one `Engine.run` per chunk, queries at TS over 4 levels "
            f"(a quarter of the tuples each), {SIDS} sids, legacy = last {LEGACY} tuples per stream, "
            "ISTREAM/RSTREAM defaults, `prev_instant` set. tuples/s = new tuples in the chunk "
            "(both streams for the join) / median wall time of "
            f"{args.reps} runs after {args.warmup} warm-up runs"
            + (" of the identical chunk" if args.same_instants else ", each run at other instants (as consecutive chunks)")
            + ".\n\n"
            f"Machine: {os.cpu_count()} CPUs, Spark master `{args.master}`, "
            f"Python {platform.python_version()}, adaptive execution "
            f"{args.aqe or 'default (off)'}, window membership `{args.membership}`.\n\n"
        )
        out.write_text(header + table + "\n", encoding="utf-8")
        print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
