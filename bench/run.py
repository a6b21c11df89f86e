"""The benchmark harness: one command, results in ``docs/benchmarks/``.

    .venv/bin/python -m bench.run --quick            # every section, small data (~10-15 min here)
    .venv/bin/python -m bench.run                    # full sizes (see docs/benchmarks/README.md)
    .venv/bin/python -m bench.run --only bf peers    # some sections; others keep their last results

Sections (dissertation ch. 9; facts in bench/workloads.py):

* ``userpath`` the headline (bench/userpath.py): the CLI as a user runs it, default settings,
               nothing injected, start-up reported separately: ``strata replay`` of 1 M and
               20 k battlefield tuples (throughput = (1 M − 20 k) / (T_1M − T_20k)), the same
               into a running ``strata up`` cluster, ``strata ingest`` into one, ``./dev run``
* ``bf``       battlefield §9.2/§9.3.2: select, AVG GROUP BY, AVG, ROWS-100 join at TS
               through a real cluster (master + N Spark workers as processes), for
               each worker count, MLS and vanilla interleaved in the same run, as fast
               as the cluster goes
* ``overhead`` MLS overhead as the dissertation measured it (Table 9.7): paced input,
               execution time first tuple in -> last result out, MLS vs vanilla
* ``mpath``    the master's data path (shepherd, chunker, pruning, encoding) in one
               process, MLS vs vanilla: CPU per tuple where the MLS work is
* ``latency``  per-instant result latency with input paced at 50 k tuples/s
* ``chunks``   throughput of the target query vs chunk length (instants per chunk)
* ``cw``       Chinese Wall experiments 1-6 of §9.5, MLS vs vanilla
* ``peers``    Spark Structured Streaming (time-window AVG) and single-process DuckDB
* ``load``     many subscribers on one master (bench/load.py): Status latency, master RSS and
               CPU for 0-200 subscribers over 25 sessions (default limits), a paced producer
* ``memory``   the master's RSS over one `strata ingest` run of 10 M tuples (quick: 2 M) on the
               user's path, sampled every 0.5 s (bench/memory.py)
* ``scaling``  issue 31's scaling figure (bench/scaling.py): RANGE 10 s GROUP BY and ROWS 100 AVG at TS
               against Strata workers (1, 2), Spark executors behind one worker (a standalone cluster
               with authentication and encryption, 1 and 2 executors of 1 core) and hosts (network
               namespaces with disjoint CPU sets, `strata deploy`), on the user's path; per-tuple and
               per-chunk costs of master and workers, and a projection to 1-16 hosts
* ``streaming`` issue 35's streaming protocol (bench/streaming.py): the highest input rate each system sustains
               at p99 <= 2 s (Strata on `strata up` with 2 workers vs Spark Structured Streaming in its own
               JVM, same rows at the same pace, side by side), RANGE 10 s GROUP BY, ROWS 100 AVG, a windowed
               join; catch-up from the same CSV (`strata replay` vs `availableNow`); ~1 h
* ``micro``    the engine micro-benchmark (bench/engine_micro.py), not in the default set
* ``access``   issue 34 (bench/access.py, bench/access_cluster.py; not in the default set, ~15-25 min): the
               cost of security punctuations and privacy switches on the master path, then end to end on a
               `strata up` cluster against the same plans without them; writes docs/benchmarks/access.md
* ``trusted``  issue 33, dissertation Tables 9.13-9.15 (bench/trusted.py; not in the default set, ~15 min): the
               same two-level workload (S and TS, four queries each) on `strata up` replicated (a master and a
               worker per level), trusted (one master, two workers) and trusted with sharing off, same Spark
               cores; plan generation vanilla vs MLS; writes docs/benchmarks/trusted.md
* ``overhead_trusted`` issue 33, dissertation Table 9.13 (not in the default set, ~16 min): ``overhead``'s
               protocol with a no-sharing trusted cluster of U, C, S and TS as the MLS side
* ``turns``    issue 33, dissertation Table 9.8 (bench/turns.py; not in the default set, ~10 min): one query at
               each of U, C, S and TS on `strata up --mode trusted`, 40,000 U tuples/s in all, under the
               trusted worker's round robin, fixed slot and no turns; writes docs/benchmarks/turns.md

Every run's output is compared with the reference evaluator on sampled instants
(and the target query's whole output with DuckDB); a mismatch stops the harness
with exit status 1.  Results go to ``docs/benchmarks/results.json``; the README
and plots are regenerated from it (``--report-only`` redoes just that).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import workloads as W  # noqa: E402
from bench.check import BenchCheckFailed, check_sample, compare_avg, duckdb_avg_rows  # noqa: E402
from bench.e2e import BenchCluster, replay, _log  # noqa: E402

OUT = ROOT / "docs" / "benchmarks"
SECTIONS = ["userpath", "bf", "overhead", "mpath", "latency", "chunks", "alg5", "cw", "peers", "load", "memory",
            "scaling", "streaming"]

QUICK = dict(bf_tuples=400_000, bf_per_instant=50_000, bf_workers=[2, 1], bf_queries=list(W.BF_QUERIES), reps=1,
             chunk=4, lat_tuples=400_000, lat_rate=50_000, lat_chunks=[1, 2, 4], chunk_lengths=[1, 2, 4, 8], chunk_tuples=800_000,
             cw_tuples=200_000, cw6_tuples=50_000, peer_tuples=400_000, sample=2,
             ov_sizes=[1_000_000], ov_rate=100_000, ov_runs=2, ov_discard=1)
FULL = dict(bf_tuples=1_000_000, bf_per_instant=50_000, bf_workers=[3, 2, 1], bf_queries=list(W.BF_QUERIES), reps=3,
            chunk=4, lat_tuples=1_500_000, lat_rate=50_000, lat_chunks=[1, 2, 4], chunk_lengths=[1, 2, 4, 8, 16], chunk_tuples=2_000_000,
            cw_tuples=2_000_000, cw6_tuples=250_000, peer_tuples=2_000_000, sample=3,
            ov_sizes=[1_000_000, 2_000_000], ov_rate=100_000, ov_runs=4, ov_discard=1)
# load (bench/load.py): subscriber counts, a paced producer (instant 0, then instants of per_instant tuples
# at instant_rate per second); memory (bench/memory.py): tuples of the one `strata ingest` run
QUICK.update(load_subscribers=[0, 50, 200], load_per_instant=5_000, load_instants=60, load_instant_rate=5.0,
             mem_tuples=2_000_000)
FULL.update(load_subscribers=[0, 50, 100, 200], load_per_instant=5_000, load_instants=60, load_instant_rate=5.0,
            mem_tuples=10_000_000)
# scaling (bench/scaling.py): the large and small run of each (configuration, workload), interleaved pairs
# after one unmeasured warm-up of each size
QUICK.update(scale_tuples=400_000, scale_small=20_000, scale_reps=1)
FULL.update(scale_tuples=1_000_000, scale_small=20_000, scale_reps=3)
# access (bench/access.py): the master path's tuples and runs; on the cluster the tuples per stream and run
# as fast as it goes and paced, the paced runs' rate, measured runs per variant (interleaved, after an
# unmeasured round)
QUICK.update(access_tuples=100_000, access_reps=3, access_fast_tuples=500_000, access_paced_tuples=200_000,
             access_rate=40_000, access_cluster_reps=3)
FULL.update(access_tuples=400_000, access_reps=5, access_fast_tuples=2_000_000, access_paced_tuples=500_000,
            access_rate=40_000, access_cluster_reps=5)
# trusted (bench/trusted.py): tuples per stream and run, rounds (each mode's cluster started once a round),
# measured runs per cluster start, rounds of the in-process plan generation
QUICK.update(trusted_tuples=100_000, trusted_rounds=1, trusted_runs=1, trusted_plan_rounds=50)
FULL.update(trusted_tuples=500_000, trusted_rounds=3, trusted_runs=2, trusted_plan_rounds=200)
# turns (bench/turns.py): U tuples per level and run, rounds, measured runs per cluster start
QUICK.update(turns_tuples=40_000, turns_rounds=1, turns_runs=1)
FULL.update(turns_tuples=100_000, turns_rounds=2, turns_runs=2)


def machine() -> dict:
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    except OSError:
        cpu = "?"
    try:
        import pyspark
        spark = pyspark.__version__
    except Exception:  # noqa: BLE001
        spark = "?"
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[:1]
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "pyspark": spark,
            "java": java[0] if java else "?", "os": platform.platform(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def loadavg() -> float:
    return round(os.getloadavg()[0], 1)


def _run(cluster: BenchCluster, w: W.Workload, vanilla: bool, chunk: int, args, checks: list, rate=None,
         check: bool = True) -> dict:
    query = w.vanilla_query if vanilla else w.query
    data = w.vanilla_data if vanilla else w.data
    cfg = w.vanilla_config if vanilla else w.config
    level = w.vanilla_level if vanilla else w.level
    cluster.new_master(chunk_seconds=chunk)
    la = loadavg()
    r = replay(cluster, query, data, instants_per_call=1, rate=rate)
    rec = {"workload": w.name, "vanilla": vanilla, "workers": cluster.workers, "chunk_instants": chunk,
           "tuples": r.tuples, "sent": r.sent, "offered_throughput": round(r.sent / r.seconds),
           "cpu_seconds": round(r.cpu_seconds, 3), "tail_seconds": round(r.seconds - r.ingest_seconds, 3),
           "cpu_reading": cluster.cpu_reading, "seconds": round(r.seconds, 3), "throughput": round(r.throughput),
           "ingest_seconds": round(r.ingest_seconds, 3), "p50": round(r.pct(50), 3), "p99": round(r.pct(99), 3), "instants": r.instants, "chunks": r.chunks,
           "out_rows": 0 if r.rows is None else r.rows.num_rows, "rate": rate, "load": la,
           "redispatched": r.extra.get("redispatched", 0), "timings": r.extra.get("timings", {})}
    _log(f"{w.name:10s} {'vanilla' if vanilla else 'MLS':7s} w={cluster.workers} K={chunk} "
         f"{r.tuples:,} tuples {r.seconds:.2f} s {r.throughput:,.0f}/s p50 {r.pct(50):.2f} p99 {r.pct(99):.2f} "
         f"rows {rec['out_rows']} cpu {r.cpu_seconds:.2f} s load {la}")
    if check:
        first = query if isinstance(query, str) else query[0]  # several queries: rows are the first's
        taus = check_sample(cfg, level, first, data, r.rows, k=args.p["sample"])
        checks.append(f"{w.name} {'vanilla' if vanilla else 'MLS'} w={cluster.workers} K={chunk}: "
                      f"reference agrees at instants {taus}")
        if w.name == "avg" and not vanilla:
            exp, _ = duckdb_avg_rows(data["Vitals"], "bp", 100, W.BF_LEVELS, W.BF_LEVELS)
            compare_avg(r.rows, exp)
            checks[-1] += f"; DuckDB agrees on all {exp.num_rows} instants"
    return rec


def _warm(cluster: BenchCluster, w: W.Workload, vanilla: bool, chunk: int, args) -> None:
    """One unmeasured run (the dissertation discards its first runs): JIT, first compiles, caches."""
    _run(cluster, w, vanilla, chunk, args, [], check=False)


# ---- sections ---------------------------------------------------------------------------------
def sec_bf(args, res: dict) -> None:
    p = args.p
    wls = {q: W.battlefield(q, p["bf_tuples"], p["bf_per_instant"]) for q in p["bf_queries"]}
    any_w = next(iter(wls.values()))
    n = max(p["bf_workers"])
    mls = BenchCluster(any_w.config, any_w.level, n, tls=not args.insecure, cpu_reading=args.cpu_reading)
    van = BenchCluster(any_w.vanilla_config, any_w.vanilla_level, n, tls=not args.insecure, cpu_reading=args.cpu_reading)
    runs, checks = [], []
    try:
        _warm(mls, any_w, False, p["chunk"], args)
        _warm(van, any_w, True, p["chunk"], args)
        for workers in sorted(p["bf_workers"], reverse=True):
            while mls.workers > workers:
                mls.drop_worker()
                van.drop_worker()
            for q, w in wls.items():
                for rep in range(p["reps"]):
                    for vanilla in (False, True) if rep % 2 == 0 else (True, False):
                        rec = _run(van if vanilla else mls, w, vanilla, p["chunk"], args, checks, check=rep == 0)
                        rec["rep"] = rep
                        runs.append(rec)
    finally:
        mls.stop()
        van.stop()
    res["bf"] = {"runs": runs, "checks": checks, "tuples": p["bf_tuples"], "per_instant": p["bf_per_instant"],
                 "chunk_instants": p["chunk"], "queries": {q: W.BF_QUERIES[q] for q in p["bf_queries"]}}


def sec_overhead(args, res: dict, mode: str = "replicated") -> None:
    """MLS overhead the way the dissertation measured it (§9.3.2, Table 9.7; with ``mode`` ``trusted``,
    Table 9.13: a trusted cluster serving U, C, S and TS, sharing off, against the vanilla one).

    Input paced at a fixed rate the cluster sustains; execution time = first tuple in to last
    result out; per configuration ``ov_runs`` runs of MLS and of vanilla, alternating, the first
    ``ov_discard`` of each discarded (the dissertation: five runs, the first two discarded, mean
    and standard deviation of the rest).  Also the cluster's CPU seconds per run (the work
    done, whatever the pacing) and per-instant latency."""
    p = args.p
    exps = {e: W.TABLE_9_7[e][0] for e in W.TABLE_9_7}
    first = W.battlefield_set("exp1", exps["exp1"], p["ov_sizes"][0], p["bf_per_instant"])
    if mode == "trusted":  # Table 9.13: vanilla vs no-sharing trusted
        mls = BenchCluster(first.config + "\n[sharing]\nenabled = false\n", [first.level] + [
            lv for lv in W.BF_LEVELS if lv != first.level], 2, chunk_seconds=p["chunk"], tls=not args.insecure,
            cpu_reading=args.cpu_reading, mode="trusted")
    else:
        mls = BenchCluster(first.config, first.level, 2, tls=not args.insecure, cpu_reading=args.cpu_reading)
    van = BenchCluster(first.vanilla_config, first.vanilla_level, 2, tls=not args.insecure, cpu_reading=args.cpu_reading)
    runs, checks = [], []
    try:
        _warm(mls, first, False, p["chunk"], args)
        _warm(van, first, True, p["chunk"], args)
        for size in p["ov_sizes"]:
            for e, qs in exps.items():
                w = W.battlefield_set(e, qs, size, p["bf_per_instant"])
                for rep in range(p["ov_runs"]):
                    for vanilla in (False, True) if rep % 2 == 0 else (True, False):
                        rec = _run(van if vanilla else mls, w, vanilla, p["chunk"], args, checks,
                                   rate=p["ov_rate"], check=rep == p["ov_discard"])
                        rec.update(rep=rep, size=size, discarded=rep < p["ov_discard"])
                        runs.append(rec)
    finally:
        mls.stop()
        van.stop()
    res["overhead" if mode == "replicated" else f"overhead_{mode}"] = {
                       "runs": runs, "checks": checks, "rate": p["ov_rate"], "per_instant": p["bf_per_instant"],
                       "chunk_instants": p["chunk"], "workers": 2, "runs_per_config": p["ov_runs"],
                       "discarded": p["ov_discard"],
                       "experiments": {e: [W.BF_QUERIES[q] for q in qs] for e, qs in exps.items()},
                       "dissertation": {e: W.TABLE_9_7[e][1] for e in exps}}


def sec_overhead_trusted(args, res: dict) -> None:
    """Table 9.13 (§9.4): the Table 9.7 protocol with a no-sharing trusted cluster of U, C, S and TS as the MLS
    side (docs/benchmarks/trusted.md)."""
    sec_overhead(args, res, mode="trusted")


def sec_mpath(args, res: dict) -> None:
    """The master's data path in this process, MLS vs vanilla: where the MLS work is (bench/master_path.py)."""
    from bench import master_path

    p = args.p
    parts = [master_path.compare(W.battlefield_set(e, W.TABLE_9_7[e][0], p["ov_sizes"][0], p["bf_per_instant"]),
                                 chunk_instants=p["chunk"]) for e in W.TABLE_9_7]
    for x in parts:
        _log(f"master path {x['workload']}: " + ", ".join(
            f"{k} {x[k]['mls_ns']:.0f}/{x[k]['van_ns']:.0f}" for k in (*master_path.STEPS, "total"))
             + " ns per tuple (MLS/vanilla)")
    res["mpath"] = {"parts": parts}


def _target_runs(args, w: W.Workload, chunk_lengths, rate=None, cpu_reading=None) -> tuple[list, list]:
    """The target query on a fresh 2-worker cluster (one warm-up run), once per chunk length."""
    cl = BenchCluster(w.config, w.level, 2, tls=not args.insecure, cpu_reading=cpu_reading or args.cpu_reading)
    runs, checks = [], []
    try:
        _warm(cl, w, False, 4, args)
        for k in chunk_lengths:
            runs.append(_run(cl, w, False, k, args, checks, rate=rate))
    finally:
        cl.stop()
    return runs, checks


def sec_latency(args, res: dict) -> None:
    p = args.p
    w = W.battlefield("avg", p["lat_tuples"], p["lat_rate"])
    runs, checks = _target_runs(args, w, p["lat_chunks"], rate=p["lat_rate"])
    res["latency"] = {"runs": runs, "checks": checks, "rate": p["lat_rate"], "query": w.query}


def sec_chunks(args, res: dict) -> None:
    p = args.p
    w = W.battlefield("avg", p["chunk_tuples"], p["bf_per_instant"])
    runs, checks = _target_runs(args, w, p["chunk_lengths"])
    res["chunks"] = {"runs": runs, "checks": checks, "query": w.query, "per_instant": p["bf_per_instant"]}


def sec_alg5(args, res: dict) -> None:
    """The target query with Algorithm 5 reading the shared host's CPU, each worker's own processes,
    or an idle reading (one emulated host per worker)."""
    p = args.p
    w = W.battlefield("avg", p["chunk_tuples"], p["bf_per_instant"])
    runs, checks = [], []
    for reading in ("host", "process", "dedicated"):
        r, c = _target_runs(args, w, (1, 4), cpu_reading=reading)
        runs += r
        checks += c
    res["alg5"] = {"runs": runs, "checks": checks, "query": w.query}


def sec_cw(args, res: dict) -> None:
    p = args.p
    exps = list(W.CW_EXPERIMENTS)
    wls = {e: W.chinese_wall(e, p["cw6_tuples"] if e == "cw6" else p["cw_tuples"],
                             2_500 if e == "cw6" else 50_000) for e in exps}
    levels = sorted({w.level for w in wls.values()})
    mls = BenchCluster(W.AUDIT_TOML, levels, 1, clearance="[T,T]", tls=not args.insecure, cpu_reading=args.cpu_reading)
    van = BenchCluster(W.VANILLA_CW_TOML, "P", 1, tls=not args.insecure, cpu_reading=args.cpu_reading)
    runs, checks = [], []
    try:
        _warm(van, wls["cw2"], True, p["chunk"], args)
        for e, w in wls.items():
            mls.use(w.level)
            if e in ("cw1", "cw3", "cw4", "cw5"):  # first use of each level's group
                _warm(mls, w, False, p["chunk"], args)
            for rep in range(p["reps"]):
                for vanilla in (False, True) if rep % 2 == 0 else (True, False):
                    rec = _run(van if vanilla else mls, w, vanilla, p["chunk"], args, checks, check=rep == 0)
                    rec["rep"] = rep
                    rec["level"] = w.vanilla_level if vanilla else w.level
                    runs.append(rec)
    finally:
        mls.stop()
        van.stop()
    res["cw"] = {"runs": runs, "checks": checks,
                 "experiments": {e: {"query": w.query, "level": w.level, "vanilla_query": w.vanilla_query,
                                     "notes": w.notes, "tuples": w.tuples, "per_instant": w.per_instant}
                                 for e, w in wls.items()}}


def sec_peers(args, res: dict) -> None:
    from bench import peers

    p = args.p
    w = W.battlefield("avg", p["peer_tuples"], p["bf_per_instant"])
    out: dict = {"tuples": p["peer_tuples"], "per_instant": p["bf_per_instant"], "checks": []}
    # DuckDB: the ROWS 100 query (the ceiling) and the per-instant time-window AVG
    exp_rows, secs = duckdb_avg_rows(w.data["Vitals"], "bp", 100, W.BF_LEVELS, W.BF_LEVELS)
    out["duckdb_rows100"] = {"seconds": round(secs, 3), "throughput": round(w.tuples / secs)}
    dd_range, secs = peers.duckdb_range(w.data["Vitals"])
    out["duckdb_range"] = {"seconds": round(secs, 3), "throughput": round(w.tuples / secs)}
    # Spark Structured Streaming: tumbling 1-instant window AVG over micro-batches of one chunk
    sss = peers.structured_streaming(w.data["Vitals"], p["chunk"])
    out["sss_range"] = {k: v for k, v in sss.items() if k != "rows"}
    peers.compare_range(sss["rows"], dd_range, "Structured Streaming vs DuckDB")
    out["checks"].append(f"Structured Streaming per-instant AVG equals DuckDB's on all {dd_range.num_rows} instants")
    # Strata on the same data: the ROWS 100 target and the RANGE 1 query
    mls = BenchCluster(w.config, w.level, 2, tls=not args.insecure, cpu_reading=args.cpu_reading)
    checks: list = []
    try:
        _warm(mls, w, False, p["chunk"], args)
        out["strata_rows100"] = _run(mls, w, False, p["chunk"], args, checks)
        wr = W.Workload(name="avg-range", config=w.config, level=w.level, query=peers.STRATA_RANGE_QUERY,
                        data=w.data, vanilla_config=w.vanilla_config, vanilla_level=w.vanilla_level,
                        vanilla_query=peers.STRATA_RANGE_QUERY, vanilla_data=w.vanilla_data, per_instant=w.per_instant)
        rec = _run(mls, wr, False, p["chunk"], args, checks, check=False)
        out["strata_range"] = rec
    finally:
        mls.stop()
    out["checks"] += checks
    out["sss_rows_rejected"] = peers.sss_rows_window_error()
    res["peers"] = out


def sec_userpath(args, res: dict) -> None:
    """The user's path: CLI commands as subprocesses, default settings (bench/userpath.py)."""
    from bench import userpath

    userpath.run(args, res)


def sec_load(args, res: dict) -> None:
    """Subscribers vs status latency, master memory and CPU through a real cluster (bench/load.py)."""
    from bench import load

    load.run(args, res)


def sec_memory(args, res: dict) -> None:
    """The master's memory over one long `strata ingest` run on the user's path (bench/memory.py)."""
    from bench import memory

    memory.run(args, res)


def sec_scaling(args, res: dict) -> None:
    """Throughput against workers, Spark executors and hosts; per-chunk costs; projection (bench/scaling.py)."""
    from bench import scaling

    scaling.run(args, res)


def sec_streaming(args, res: dict) -> None:
    """Issue 35's streaming protocol (bench/streaming.py): the highest input rate sustained at p99 <= 2 s,
    Strata against Spark Structured Streaming side by side, and catch-up from the same CSV."""
    from bench import streaming

    streaming.run(args, res)


def sec_access(args, res: dict) -> None:
    """Security punctuations and privacy switches against the same plans without them: the master path in
    one process, then end to end on a cluster (bench/access.py, bench/access_cluster.py); access.md."""
    from bench import access, access_cluster

    p = args.p
    m = access.measure(p["access_tuples"], 20_000, p["access_reps"])
    c = access_cluster.merge([
        access_cluster.measure(p["access_fast_tuples"], p["access_rate"], p["access_cluster_reps"], ("fast",)),
        access_cluster.measure(p["access_paced_tuples"], p["access_rate"], p["access_cluster_reps"], ("paced",))])
    access.write_doc(master_text=access.render(m), cluster_text=access_cluster.render(c))
    res["access"] = {"master_path": m, "cluster": c, "file": "access.md"}


def sec_trusted(args, res: dict) -> None:
    """Replicated vs trusted vs trusted without sharing on `strata up` (bench/trusted.py); trusted.md."""
    from bench import trusted

    p = args.p
    r = trusted.measure(p["trusted_tuples"], p["trusted_rounds"], p["trusted_runs"], p["trusted_plan_rounds"])
    trusted.write_doc(trusted.render(r))
    res["trusted"] = {"summary": r["summary"], "plan_generation": r["plan_generation"], "checks": len(r["checks"]),
                      "started": r["started"], "finished": r["finished"], "load": [r["load_start"], r["load_end"]],
                      "file": "trusted.md"}


def sec_turns(args, res: dict) -> None:
    """The trusted worker's turns: round robin vs fixed slot vs none, Table 9.8 (bench/turns.py); turns.md."""
    from bench import turns

    p = args.p
    r = turns.measure(p["turns_tuples"], p["turns_rounds"], p["turns_runs"])
    turns.write_doc(turns.render(r))
    res["turns"] = {"summary": r["summary"], "checks": len(r["checks"]), "started": r["started"],
                    "finished": r["finished"], "load": [r["load_start"], r["load_end"]], "file": "turns.md"}


def sec_micro(args, res: dict) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "engine_micro.py"), "--reps", "3"]
    if args.quick:
        cmd += ["--sizes", "10000", "50000", "--instants", "1", "4", "--jvm-warmup", "3"]
    subprocess.run(cmd, check=True)
    res["micro"] = {"file": "engine_micro.md"}


# ---- main ----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Strata benchmark harness (docs/benchmarks/README.md)")
    ap.add_argument("--quick", action="store_true", help="small data, one repetition (minutes)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS + ["micro", "access", "trusted", "turns", "overhead_trusted"], help="run only these sections")
    ap.add_argument("--insecure", action="store_true", help="clusters without mutual TLS")
    ap.add_argument("--cpu-reading", choices=["host", "process", "dedicated"], default="process",
                    help="Algorithm 5's load reading of the sections' own clusters (userpath always runs the "
                         "defaults): the shared host's CPU (host), each worker's own processes (process, the "
                         "embedded cluster's default, default here) or an injected idle reading emulating one "
                         "host per worker (dedicated: such figures are labelled injected)")
    ap.add_argument("--report-only", action="store_true", help="regenerate README and plots from results.json")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--seconds", type=int, help="streaming: measured seconds per rate step (default 60, quick 20)")
    ap.add_argument("--queries", nargs="+", choices=["range", "rows", "join"], help="streaming: these queries only")
    ap.add_argument("--no-catchup", dest="catchup", action="store_false", help="streaming: no catch-up runs")
    args = ap.parse_args(argv)
    args.p = QUICK if args.quick else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rfile = out / "results.json"
    res = json.loads(rfile.read_text()) if rfile.exists() else {}
    status = 0
    if not args.report_only:
        res["meta"] = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "mode": "quick" if args.quick else "full", "machine": machine(),
                       "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "params": args.p, "tls": not args.insecure, "cpu_reading": args.cpu_reading, "load_start": loadavg()}
        t0 = time.monotonic()
        for sec in args.only or SECTIONS:
            ts = time.monotonic()
            _log(f"=== section {sec}")
            try:
                globals()[f"sec_{sec}"](args, res)
                if isinstance(res.get(sec), dict):
                    res[sec]["mode"] = "quick" if args.quick else "full"
                    res[sec]["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                res.setdefault("durations", {})[sec] = round(time.monotonic() - ts)
            except BenchCheckFailed as e:
                _log(f"CORRECTNESS CHECK FAILED in {sec}: {e}")
                res.setdefault("failures", {})[sec] = str(e)[:2000]
                status = 1
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res.setdefault("failures", {})[sec] = f"{type(e).__name__}: {e}"[:2000]
                status = 1
            else:
                res.get("failures", {}).pop(sec, None)
            rfile.write_text(json.dumps(res, indent=1, default=str))
        res["meta"]["seconds"] = round(time.monotonic() - t0)
        rfile.write_text(json.dumps(res, indent=1, default=str))
    from bench.report import write_report

    write_report(res, out)
    _log(f"wrote {out / 'README.md'}")
    if res.get("failures"):
        _log(f"FAILED sections: {', '.join(res['failures'])}")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
