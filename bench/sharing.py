"""Sharing benchmark (dissertation §9.3.4 complete/partial sharing, §9.4.3): 4-9
identical or overlapping queries, throughput with and without shared execution.

In one process: the master's ``QueryPipeline`` (shepherd, chunker with legacy
windows) cuts a battlefield Vitals stream (4 levels U < C < S < TS, a quarter of
the tuples each, §9.2/§9.3.4) into chunks; a worker's ``SharedExecutor`` over
one ``Engine`` evaluates every chunk's queries, with sharing on (each shared
plan once per chunk, results fanned out) and off (one ``Engine.run`` per
query per chunk).  Queries run at level S (a replicated-mode level group).
Reported: wall seconds of chunk evaluation (median of ``--reps`` runs after a
warm-up), input tuples per second, engine runs, and the gain
``(t_off - t_on) / t_off`` as in Tables 9.9-9.12.  Results are checked equal.

    .venv/bin/python bench/sharing.py                        # n = 4, 6, 9; all workloads
    .venv/bin/python bench/sharing.py --n 4 9 --reps 3 --markdown docs/benchmarks/sharing.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")

from strata.config import parse_config  # noqa: E402
from strata.examples import BATTLEFIELD_TOML  # noqa: E402
from strata.master.pipeline import QueryPipeline  # noqa: E402
from strata.worker.engine import Engine  # noqa: E402
from strata.worker.shared import SharedExecutor  # noqa: E402
from strata.worker.spark import get_session  # noqa: E402

LEVEL = "S"


def _identical(n: int) -> list[str]:
    # Table 9.9/9.10 style: the same aggregate query registered n times
    return ["SELECT sid, AVG(bp) FROM Vitals [RANGE 10 seconds] GROUP BY sid"] * n


def _overlap_select(n: int) -> list[str]:
    # loose partial sharing (Def. 8, Q6/Q7-style): one window, one shared selection bp > 120,
    # each further query adds its own condition and projects other attributes
    cols = ["sid, bp", "sid, pr", "bp, pr", "sid", "sid, bp, pr", "pr", "bp", "sid, weight", "weight"]
    out = ["SELECT sid, bp FROM Vitals [ROWS 500] WHERE bp > 120"]
    out += [f"SELECT {cols[i % len(cols)]} FROM Vitals [ROWS 500] WHERE bp > 120 AND pr > {60 + 5 * i}"
            for i in range(1, n)]
    return out


def _overlap_agg(n: int) -> list[str]:
    # one window and grouping, different aggregates / HAVING (one merged aggregate)
    aggs = ["AVG(bp)", "MAX(bp)", "MIN(pr)", "COUNT(*)", "SUM(weight)", "AVG(pr)", "MAX(pr) - MIN(pr)",
            "COUNT(bp)", "AVG(weight)"]
    out = []
    for i in range(n):
        having = f" HAVING COUNT(*) > {i}" if i % 3 == 2 else ""
        out.append(f"SELECT sid, {aggs[i % len(aggs)]} FROM Vitals [RANGE 10 seconds] GROUP BY sid{having}")
    return out


def _mixed(n: int) -> list[str]:
    # §9.3.4 "overlapping": half identical copies, half selections over the same window
    half = n // 2
    return _identical(half) + [f"SELECT sid, bp FROM Vitals [RANGE 10 seconds] WHERE bp > {110 + 10 * i}"
                               for i in range(n - half)]


WORKLOADS = {"identical": _identical, "overlap-select": _overlap_select, "overlap-agg": _overlap_agg,
             "mixed": _mixed}


def make_vitals(tuples: int, instants: int, sids: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = np.sort(rng.integers(0, instants, tuples)).astype(np.int64)
    return pa.table({
        "ts": ts,
        "level": pa.array(np.array(["U", "C", "S", "TS"])[rng.integers(0, 4, tuples)]),
        "sid": pa.array([f"s{i}" for i in rng.integers(0, sids, tuples)]),
        "bp": rng.normal(125, 20, tuples).round(1),
        "pr": rng.normal(80, 15, tuples).round(1),
        "weight": rng.normal(75, 10, tuples).round(1),
    })


def run_once(config, engine, texts, vitals, chunk_instants, enabled):
    p = QueryPipeline(config, LEVEL, chunk_instants=chunk_instants)
    ids = [p.add_query(t)[0] for t in texts]
    p.ingest("Vitals", vitals)
    chunks = p.finish()
    ex = SharedExecutor(engine, config, enabled=enabled)
    out = {q: [] for q in ids}
    t0 = time.perf_counter()
    for ch in chunks:
        for r in ex.run(p.queries, ch.queries):
            out[r.query_id].append(r.rows)
            p.chunker.confirm(r)
    secs = time.perf_counter() - t0
    rows = {q: sum(t.num_rows for t in ts) for q, ts in out.items()}
    sharing = p.sharing_report()
    return secs, dict(ex.counters), rows, out, len(chunks), sharing


def _same(a: dict, b: dict) -> bool:
    for q in a:
        ta = pa.concat_tables(a[q]) if a[q] else None
        tb = pa.concat_tables(b[q]) if b[q] else None
        if (ta is None) != (tb is None):
            return False
        if ta is None:
            continue
        key = [(c, "ascending") for c in ta.column_names]
        if not ta.sort_by(key).equals(tb.sort_by(key)):
            # doubles summed in another order may differ in the last bits
            sa, sb = ta.sort_by(key).to_pylist(), tb.sort_by(key).to_pylist()
            if len(sa) != len(sb):
                return False
            for x, y in zip(sa, sb):
                for k in x:
                    if isinstance(x[k], float) and isinstance(y[k], float):
                        if abs(x[k] - y[k]) > 1e-9 * max(1.0, abs(x[k])):
                            return False
                    elif x[k] != y[k]:
                        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4, 6, 9], help="queries per workload")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--tuples", type=int, default=50_000)
    ap.add_argument("--instants", type=int, default=100)
    ap.add_argument("--chunk-instants", type=int, default=10)
    ap.add_argument("--sids", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)

    config = parse_config(BATTLEFIELD_TOML)
    spark = get_session(master=os.environ.get("STRATA_SPARK_MASTER", "local[2]"), app_name="strata-bench-sharing")
    engine = Engine(spark, config)
    vitals = make_vitals(args.tuples, args.instants, args.sids, 7)
    # warm-up: JVM code paths for every query shape
    for w in args.workloads:
        run_once(config, engine, WORKLOADS[w](2), vitals.slice(0, 2000), args.chunk_instants, True)
        run_once(config, engine, WORKLOADS[w](2), vitals.slice(0, 2000), args.chunk_instants, False)
    results = []
    for w in args.workloads:
        for n in args.n:
            texts = WORKLOADS[w](n)
            times = {True: [], False: []}
            last = {}
            for rep in range(args.reps):
                for enabled in ((False, True) if rep % 2 == 0 else (True, False)):
                    secs, counters, rows, out, chunks, sharing = run_once(
                        config, engine, texts, vitals, args.chunk_instants, enabled)
                    times[enabled].append(secs)
                    last[enabled] = (counters, rows, out, chunks, sharing)
            same = _same(last[True][2], last[False][2])
            t_on, t_off = statistics.median(times[True]), statistics.median(times[False])
            kinds = sorted({d["kind"] for d in last[True][4]["decisions"]})
            r = {
                "workload": w, "n": n, "chunks": last[True][3], "tuples": args.tuples,
                "sharing": kinds,
                "engine_runs_on": last[True][0].get("engine_runs", 0),
                "engine_runs_off": last[False][0].get("engine_runs", 0),
                "seconds_on": round(t_on, 3), "seconds_off": round(t_off, 3),
                "tuples_per_s_on": round(args.tuples / t_on), "tuples_per_s_off": round(args.tuples / t_off),
                "gain_pct": round(100 * (t_off - t_on) / t_off, 1),
                "plan_nodes": last[True][4]["nodes"], "plan_nodes_unshared": last[True][4]["nodes_without_sharing"],
                "results_equal": same, "output_rows": sum(last[True][1].values()),
            }
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    table = _markdown(results, args)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0 if all(r["results_equal"] for r in results) else 1


def _markdown(results, args) -> str:
    lines = [
        "| workload | queries | sharing (analysis) | plan nodes merged/separate | engine runs on/off | "
        "s on | s off | tuples/s on | tuples/s off | gain | equal |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['workload']} | {r['n']} | {', '.join(r['sharing'])} | {r['plan_nodes']}/{r['plan_nodes_unshared']} | "
            f"{r['engine_runs_on']}/{r['engine_runs_off']} | {r['seconds_on']:.2f} | {r['seconds_off']:.2f} | "
            f"{r['tuples_per_s_on']:,} | {r['tuples_per_s_off']:,} | {r['gain_pct']:.1f} % | "
            f"{'yes' if r['results_equal'] else 'NO'} |")
    head = (f"{args.tuples:,} Vitals tuples over {args.instants} instants, {args.chunk_instants} instants per chunk, "
            f"{args.sids} sids, level {LEVEL}; median of {args.reps} runs; "
            f"{platform.python_version()}, {os.cpu_count()} CPUs, Spark local[2].\n")
    return head + "\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
