"""RANGE GROUP BY on the user's path with and without the workers' partial aggregates (issue 35, item 2).

``python -m bench.range_partials [--tuples 2000000] [--small 20000] [--pairs 3] [--level TS]``: battlefield
CSVs (bench/workloads.vitals, 20,000 tuples per instant) replayed with ``strata replay --workers 2
--chunk-seconds 1`` (an embedded cluster per run, defaults otherwise) and
``SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid``; the workers' engine switch
``STRATA_RANGE_PARTIALS`` (worker/server.py) alternates ``on`` / ``off`` within each pair, sizes
alternate too.  Per run: the replay's ``process`` (from the "replaying" line to the last result),
the time from ready to exit (T minus start-up), the chunk timings and the 1-minute load average;
every output is checked against DuckDB on every instant (AVG within 1e-9, the level).  Reports
medians per (switch, size) and throughputs ``N / process`` and ``(N - small) / Δprocess``.
``--record``: kept in docs/benchmarks/results.json as ``range_partials``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv

from bench import userpath as U
from bench.peers import RANGE10_QUERY, check_range10, duckdb_range10, record
from bench.workloads import vitals

SWITCH = "STRATA_RANGE_PARTIALS"


def measure(tuples: int, small: int, pairs: int, level: str = "TS", modes=("on", "off")) -> dict:
    d = Path(tempfile.mkdtemp(prefix="strata-range-partials-"))
    saved = os.environ.get(SWITCH)
    try:
        cfg = U.setup(d)
        files = U.write_inputs(d, [small, tuples])
        tables = {n: vitals(n, U.PER_INSTANT) for n in (small, tuples)}
        if level != "TS":
            raise SystemExit("the DuckDB check assumes every tuple visible: --level TS")
        expected = {n: duckdb_range10(t)[0] for n, t in tables.items()}
        instants = {n: set(int(x) for x in np.unique(t.column("ts").to_numpy())) for n, t in tables.items()}
        runs = []
        for p in range(pairs):
            order = list(modes) if p % 2 == 0 else list(reversed(modes))
            sizes = (small, tuples) if p % 2 == 0 else (tuples, small)
            for n in sizes:
                for mode in order:
                    os.environ[SWITCH] = mode
                    run = U.replay_once(cfg, d, files[n], f"{mode}_{n}_{p}", query=RANGE10_QUERY, level=level)
                    t = run["timings"]
                    groups = check_range10(expected[n], pcsv.read_csv(run["output"]), f"replay {mode} {n:,}",
                                           instants[n], levels=True)
                    os.unlink(run["output"])
                    chunks = t.get("chunks", {})
                    print(f"  timings: {json.dumps(chunks)}", flush=True)
                    row = {"mode": mode, "tuples": n, "pair": p, "seconds": run["seconds"], "load": run["load"],
                           "load_after": round(os.getloadavg()[0], 1), "start": t.get("start"),
                           "process": t.get("process"), "ingested": t.get("ingested"),
                           "after_start": round(run["seconds"] - t["start"], 3) if t.get("start") else None,
                           "cpu_seconds": run["cpu_seconds"], "groups_checked": groups,
                           "chunks": {k: v for k, v in chunks.items()
                                      if any(w in k for w in ("engine", "transport", "wait", "units"))}}
                    runs.append(row)
                    print(f"pair {p + 1} {mode:3} {n:>9,}: process {row['process']} s (ingest {row['ingested']} s), "
                          f"ready→exit {row['after_start']} s, start-up {row['start']} s, load {row['load']}"
                          f"→{row['load_after']}, checked {groups:,} groups", flush=True)
        return {"query": RANGE10_QUERY, "level": level, "tuples": tuples, "small": small, "pairs": pairs,
                "runs": runs, "summary": summarize(runs, tuples, small, modes),
                "load": [r["load"] for r in runs]}
    finally:
        if saved is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = saved
        shutil.rmtree(d, ignore_errors=True)


def summarize(runs: list[dict], tuples: int, small: int, modes) -> dict:
    out = {}
    for mode in modes:
        def med(n, key):
            xs = [r[key] for r in runs if r["mode"] == mode and r["tuples"] == n and r[key] is not None]
            return statistics.median(xs) if xs else None

        big_p, small_p = med(tuples, "process"), med(small, "process")
        big_a, small_a = med(tuples, "after_start"), med(small, "after_start")
        out[mode] = {
            "process": {"big": big_p, "small": small_p},
            "after_start": {"big": big_a, "small": small_a},
            "tuples_per_s_process": round(tuples / big_p) if big_p else None,
            "tuples_per_s_ready_to_exit": round(tuples / big_a) if big_a else None,
            "extra_per_s_process": round((tuples - small) / (big_p - small_p)) if big_p and small_p
            and big_p > small_p else None,
            "load": [r["load"] for r in runs if r["mode"] == mode],
        }
    pairs = sorted({r["pair"] for r in runs})
    ratios = []
    for p in pairs:
        got = {r["mode"]: r["process"] for r in runs if r["pair"] == p and r["tuples"] == tuples}
        if len(got) == 2 and all(got.values()):
            ratios.append(round(got[modes[1]] / got[modes[0]], 3))
    out["speedup_per_pair"] = ratios
    out["speedup_median"] = statistics.median(ratios) if ratios else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.range_partials", description=__doc__.splitlines()[0])
    ap.add_argument("--tuples", type=int, default=2_000_000)
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--level", default="TS")
    ap.add_argument("--modes", default="on,off", help="the two switch values alternated (auto, on, off)")
    ap.add_argument("--record", action="store_true", help="keep the figures in docs/benchmarks/results.json")
    ap.add_argument("--json", metavar="FILE", help="write every run's figures (chunk timings included) to FILE")
    args = ap.parse_args(argv)
    res = measure(args.tuples, args.small, args.pairs, args.level, tuple(args.modes.split(",")))
    print(json.dumps(res["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if args.record:
        record(res, "range_partials")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
