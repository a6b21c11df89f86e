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

Other modes (each prints markdown tables; the figures in ``docs/benchmarks/engine_micro.md``):

    .venv/bin/python bench/engine_micro.py --ab            # interleaved A/B in one process (engine choices)
    .venv/bin/python bench/engine_micro.py --jvm           # JVM options, a fresh process per run
    .venv/bin/python bench/engine_micro.py --first-chunk   # first chunks after ready vs warm-up budget
    .venv/bin/python bench/engine_micro.py --startup [--head DIR]  # `strata worker` exec -> ready

``--head DIR``: also start workers from the source tree in DIR (e.g. ``git archive HEAD``
unpacked there) for a before/after comparison.  Timings on the shared VM are noisy: every
mode interleaves its variants and reports CPU seconds (process tree, JVM included) next
to wall time, and the 1-minute load average.
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
    # deferred: child() times a fresh process's imports of the worker's modules; at the top they would load first
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


# ---- helpers shared by the modes below -------------------------------------------------------------
def _tree_cpu(pid: int | None = None) -> float:
    """CPU seconds of a process and its descendants (the Spark JVM included)."""
    import psutil

    p = psutil.Process(pid)
    total = 0.0
    for q in [p] + p.children(recursive=True):
        try:
            c = q.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def _vitals(n_instants: int, per: int, seed: int = 5, first: int = 0) -> pa.Table:
    """Battlefield Vitals (ts, level, sid, bp, pr, weight), ``per`` tuples per instant."""
    rng = np.random.default_rng(seed)
    n = n_instants * per
    return pa.table({"ts": np.repeat(np.arange(first, first + n_instants, dtype=np.int64), per),
                     "level": LEVELS[np.arange(n) % 4],
                     "sid": np.char.add("s", rng.integers(0, SIDS, n).astype(str)),
                     "bp": rng.normal(120, 15, n), "pr": rng.normal(70, 10, n), "weight": rng.normal(80, 10, n)})


def _chunks(cfg, queries: list[str], table: pa.Table, k: int, level: str = "TS"):
    """The master's chunks of ``k`` instants (legacy included, ROWS windows pruned as on the wire)."""
    # deferred: child() times a fresh process's imports of the worker's modules; at the top they would load first
    from strata.chunking.prune import prune_chunk
    from strata.master.local import cut_chunks

    p, ids, chunks = cut_chunks(cfg, level, queries, {"Vitals": table}, k)
    return p, [prune_chunk(c, p.queries) for c in chunks]


def _median_row(label: str, runs: list[tuple[float, float]]) -> str:
    w = statistics.median(x[0] for x in runs)
    c = statistics.median(x[1] for x in runs)
    return f"{label} | {w:.3f} | {c:.3f}"


# ---- --ab: engine choices, interleaved in one process ------------------------------------------------
def run_ab(args) -> str:
    """Each comparison runs its variants alternately on consecutive chunks of one stream, after
    a warm-up; median wall and CPU seconds per chunk."""
    # deferred: child() times a fresh process's imports of the worker's modules; at the top they would load first
    from strata.worker.engine import Engine
    from strata.worker.warmup import warm_up
    from strata.worker.shared import SharedExecutor
    from strata.worker.spark import get_session

    spark = get_session(master=args.master, app_name="strata-bench-ab")
    cfg = parse_config(CONFIG)
    base = Engine(spark, cfg)
    for _ in range(2):
        warm_up(base, cfg, "TS", budget=float("inf"), rounds=1)
    out = [f"Load at start {_load()}; Spark master `{args.master}`; median of {args.reps} chunks per variant.", "",
           "| comparison | variant | median wall s | median CPU s |", "|---|---|---:|---:|"]

    def compare(title, variants, queries, k, per, sharing=False):
        p, chunks = _chunks(cfg, queries, _vitals(k * (args.reps + 2) + 12, per), k)
        chunks = chunks[-args.reps:]
        res = {name: [] for name in variants}
        for i, c in enumerate(chunks):
            order = list(variants.items())
            if i % 2:
                order.reverse()
            for name, run in order:
                c0, t0 = _tree_cpu(), time.perf_counter()
                run(p, c)
                res[name].append((time.perf_counter() - t0, _tree_cpu() - c0))
        for name, v in res.items():
            row = f"| {title} | " + _median_row(name, v) + " |"
            out.append(row)
            print(row, flush=True)

    def alone(engine):
        return lambda p, c: [engine.run(p.queries[q.query_id], q) for q in c.queries]

    def executor(engine, sharing=False):
        ex = SharedExecutor(engine, cfg, enabled=sharing)
        return lambda p, c: ex.run(p.queries, c.queries)

    explode = Engine(spark, cfg)
    explode.preagg_min_rows = 10 ** 12
    rng = ["SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid"]
    compare("RANGE 10 s GROUP BY, 25 instants x 20k (+9 legacy)",
            {"pre-aggregate per (ts, group)": alone(base), "explode every tuple": alone(explode)}, rng, 25, 20000)
    one = Engine(spark, cfg, batch=False)
    four = ["SELECT AVG(bp) FROM Vitals [ROWS 100]", "SELECT sid, AVG(bp) FROM Vitals [ROWS 100] GROUP BY sid",
            "SELECT sid, bp FROM Vitals [ROWS 100] WHERE bp > 150", "SELECT MAX(pr) FROM Vitals [ROWS 50]"]
    for k in (1, 5):
        compare(f"4 ROWS queries (no sharing), {k} instant(s) x 400",
                {"one statement (run_many)": executor(base), "one statement per query": executor(one)},
                four, k, 400)
    interp = Engine(spark, cfg)
    interp.small_rows = 10 ** 12
    codegen = Engine(spark, cfg, small_rows=0)
    for label, q, k in (("avg ROWS 100, 1 instant x 20k (pruned)", "SELECT AVG(bp) FROM Vitals [ROWS 100]", 1),
                        ("avg ROWS 100, 25 instants x 20k (pruned)", "SELECT AVG(bp) FROM Vitals [ROWS 100]", 25),
                        ("RANGE 10 s GROUP BY, 1 instant x 20k (+9 legacy)", rng[0], 1),
                        ("RANGE 10 s GROUP BY, 25 instants x 20k (+9 legacy)", rng[0], 25)):
        compare(label, {"interpreted session": alone(interp), "code-generating session": alone(codegen)}, [q], k, 20000)
    undeclared = Engine(spark, cfg, single=False)
    for label, q, k, per in (("ROWS 100 GROUP BY, 1 instant x 20k (pruned)", four[1], 1, 20000),
                             ("RANGE 10 s GROUP BY, 1 instant x 2k (+9 legacy)", rng[0], 1, 2000)):
        compare(label, {"one partition declared (coalesce(1))": alone(base),
                        "undeclared (exchange before aggregating)": alone(undeclared)}, [q], k, per)
    compare("RANGE 10 s GROUP BY, 1 instant x 2k (+9 legacy)",
            {"interpreted session": alone(interp), "code-generating session": alone(codegen)}, rng, 1, 2000)
    batch10k = Engine(spark, cfg)
    batch10k.PARTITION_ROWS = 10_000  # Spark's default record batch: one partition per 10,000 rows
    compare("RANGE 10 s GROUP BY, 25 instants x 20k: input partitions",
            {"one per core (default)": alone(base), "one per 10,000 rows (Spark default)": alone(batch10k)},
            rng, 25, 20000)
    return "\n".join(out)


# ---- --jvm / --first-chunk: fresh processes ---------------------------------------------------------
def child(spec: dict) -> dict:
    """Runs in a fresh process: session, warm-up (``spec['budget']``), then chunks; timings."""
    t_start = time.perf_counter()
    # deferred: a fresh worker process pays these imports; t_session measures them too
    from strata.worker.engine import Engine
    from strata.worker.warmup import warm_up
    from strata.worker.shared import SharedExecutor
    from strata.worker.spark import get_session

    spark = get_session(master=spec.get("master", "local[1]"), app_name="strata-bench-child")
    t_session = time.perf_counter() - t_start
    cpu_session = _tree_cpu()
    cfg = parse_config(CONFIG)
    engine = Engine(spark, cfg)
    t0 = time.perf_counter()
    warm = warm_up(engine, cfg, "S", budget=spec.get("budget", -1.0), rounds=spec.get("rounds"))
    t_warm = time.perf_counter() - t0
    cpu_ready = _tree_cpu()
    from strata.deploy.demo import QUERIES  # deferred: the demo's queries, not this module's QUERIES

    queries = spec.get("queries") or QUERIES
    from strata.deploy.demo import battlefield_data  # deferred: measured with the child's run, as above

    vit, pos = battlefield_data(spec.get("instants", 20), spec.get("per_instant", 400))
    # deferred: measured with the child's run, as above
    from strata.master.local import cut_chunks
    from strata.chunking.prune import prune_chunk

    data = {"Vitals": pa.table(vit), "Positions": pa.table(pos)}
    p, ids, chunks = cut_chunks(cfg, "S", queries, data, spec.get("k", 5))
    ex = SharedExecutor(engine, cfg)
    times = []
    for c in chunks[: spec.get("chunks", 4)]:
        c = prune_chunk(c, p.queries)
        c0, t = _tree_cpu(), time.perf_counter()
        ex.run(p.queries, c.queries)
        times.append((round(time.perf_counter() - t, 3), round(_tree_cpu() - c0, 3)))
    return {"session": round(t_session, 2), "cpu_session": round(cpu_session, 2), "warm": round(t_warm, 2),
            "warm_info": warm, "cpu_ready": round(cpu_ready, 2), "chunks": times, "cpu_total": round(_tree_cpu(), 2)}


def _spawn(spec: dict, env: dict | None = None) -> dict:
    import json
    import subprocess

    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=str(ROOT))
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child failed: {out.stderr[-2000:]}")


JVM_VARIANTS = {
    "Spark defaults (tiered C1+C2, G1, no CDS)": {"STRATA_JAVA_OPTS": "", "STRATA_CDS": "0"},
    "AppCDS archive": {"STRATA_JAVA_OPTS": ""},
    "C1 only (-XX:TieredStopAtLevel=1)": {"STRATA_JAVA_OPTS": "-XX:TieredStopAtLevel=1", "STRATA_CDS": "0"},
    "C1 only + AppCDS": {"STRATA_JAVA_OPTS": "-XX:TieredStopAtLevel=1"},
    "C1 only + AppCDS + SerialGC, 1 GB initial heap, unchecked Arrow (default)": {},
    "C1 only + AppCDS + ParallelGC": {"STRATA_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC"},
}


def run_jvm(args) -> str:
    """Fresh process per run: session wall/CPU, the first warm-up step (the JVM's first
    statements), then 4 demo chunks of 5 instants; variants interleaved, ``--reps`` rounds.
    AppCDS variants need their archive: built first (``build_archive``) per option set."""
    from strata.worker import spark as S  # deferred: fails here, before any variant runs, if it does not import

    for name, env in JVM_VARIANTS.items():
        if env.get("STRATA_CDS") != "0":
            import subprocess

            subprocess.run([sys.executable, "-m", "strata.worker.spark", "--build-archive"], capture_output=True,
                           env={**os.environ, **env}, cwd=str(ROOT))
    del S
    res = {name: [] for name in JVM_VARIANTS}
    loads = []
    spec = {"budget": 0.0, "chunks": 4, "k": 5}
    for r in range(args.reps):
        for name, env in JVM_VARIANTS.items():
            loads.append(_load())
            got = _spawn(spec, env)
            res[name].append(got)
            print(name, got, flush=True)
    lines = [f"{args.reps} fresh processes per variant, interleaved; load {min(loads)}-{max(loads)}; medians.", "",
             "| JVM options | session s | session CPU s | first warm-up step s | CPU at ready s | "
             "4 demo chunks s | 4 demo chunks CPU s | total CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in res.items():
        med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
        lines.append(f"| {name} | {med(lambda x: x['session']):.1f} | {med(lambda x: x['cpu_session']):.1f} | "
                     f"{med(lambda x: x['warm']):.1f} | {med(lambda x: x['cpu_ready']):.1f} | "
                     f"{med(lambda x: sum(c[0] for c in x['chunks'])):.2f} | "
                     f"{med(lambda x: sum(c[1] for c in x['chunks'])):.2f} | {med(lambda x: x['cpu_total']):.1f} |")
    return "\n".join(lines)


def run_first_chunk(args) -> str:
    """First demo chunks after the session is ready, by warm-up budget (fresh process each)."""
    budgets = [-1.0, 0.0, 6.0, 12.0]
    res = {b: [] for b in budgets}
    loads = []
    for r in range(args.reps):
        for b in budgets:
            loads.append(_load())
            got = _spawn({"budget": b, "chunks": 4, "k": 5})
            res[b].append(got)
            print(b, got, flush=True)
    lines = [f"{args.reps} fresh processes per budget, interleaved; load {min(loads)}-{max(loads)}; medians. "
             "Demo queries (`deploy/demo.py`), chunks of 5 instants x 400 Vitals + 100 Positions tuples.", "",
             "| warm-up budget | warm-up s (chunks) | CPU at ready s | chunk 1 s | chunk 2 s | chunk 3 s | chunk 4 s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for b, runs in res.items():
        med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
        label = "none" if b < 0 else ("first step only" if b == 0 else f"{b:.0f} s")
        cells = " | ".join(f"{med(lambda x, i=i: x['chunks'][i][0]):.2f}" for i in range(4))
        lines.append(f"| {label} | {med(lambda x: x['warm']):.1f} ({med(lambda x: x['warm_info'].get('steps', 0)):.0f}) | "
                     f"{med(lambda x: x['cpu_ready']):.1f} | {cells} |")
    return "\n".join(lines)


# ---- --startup: `strata worker` from exec to ready --------------------------------------------------
#: runs ``strata`` from the source tree given as first argument (the editable install maps the
#: ``strata.*`` packages to this checkout; the shim points its mapping at the other tree)
_ROOT_SHIM = """import sys, runpy
root = sys.argv.pop(1)
for m in list(sys.modules.values()):
    mp = getattr(m, "MAPPING", None)
    if isinstance(mp, dict) and "strata.worker" in mp:
        old = mp["strata"][: -len("/strata")]
        for k, v in list(mp.items()):
            mp[k] = root + v[len(old):]
sys.argv[0] = "strata"
runpy.run_module("strata", run_name="__main__", alter_sys=True)
"""


def _start_workers(n: int, root: Path, tmp: Path, env: dict) -> list[dict]:
    """Start ``n`` workers at once from the tree ``root``; seconds from exec to ready each."""
    import secrets
    import socket
    import subprocess

    cfg = tmp / "strata.toml"
    key = tmp / "S.key"
    key.write_text(secrets.token_hex(32))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cfg.write_text(CONFIG + f'\n[groups."S"]\nkey_file = "{key}"\nport = {port}\n')
    procs = []
    t0 = time.perf_counter()
    for i in range(n):
        ready = tmp / f"ready-{i}"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-c", _ROOT_SHIM, str(root), "worker", "--config", str(cfg), "--level", "S",
               "--insecure", "--state-dir", str(tmp), "--ready-file", str(ready)]
        err = open(tmp / f"worker-{i}.err", "w")
        procs.append((subprocess.Popen(cmd, cwd=str(root), stdout=subprocess.DEVNULL, stderr=err,
                                       env={**os.environ, **env}, start_new_session=True), ready, err))
    out = [None] * n
    while any(o is None for o in out) and time.perf_counter() - t0 < 300:
        for i, (proc, ready, err) in enumerate(procs):
            if out[i] is None and ready.exists():
                out[i] = {"ready": round(time.perf_counter() - t0, 2), "cpu": round(_tree_cpu(proc.pid), 1)}
            elif out[i] is None and proc.poll() is not None:
                out[i] = {"ready": None, "error": (tmp / f"worker-{i}.err").read_text()[-500:]}
        time.sleep(0.05)
    import signal

    for i, (proc, ready, err) in enumerate(procs):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for i, (proc, ready, err) in enumerate(procs):
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            os.killpg(proc.pid, signal.SIGKILL)
        err.close()
        text = (tmp / f"worker-{i}.err").read_text()
        line = [x for x in text.splitlines() if "worker start-up" in x]
        if out[i] is not None and line:
            out[i]["split"] = line[-1].split("worker start-up: ", 1)[1]
    return out


def run_startup(args) -> str:
    import tempfile

    trees = {"this tree": ROOT}
    if args.head:
        trees["before (HEAD)"] = Path(args.head).resolve()
    rows = []
    for r in range(args.reps):
        for n in (1, 2):
            for name, root in trees.items():
                with tempfile.TemporaryDirectory(prefix="strata-startup-") as d:
                    load = _load()
                    got = _start_workers(n, root, Path(d), {})
                    rows.append((name, n, load, got))
                    print(name, n, load, got, flush=True)
    lines = ["`strata worker` (level S, `local[1]`, no TLS) from exec to its ready file; "
             "n workers started at the same moment; CPU = the worker's process tree at ready.", "",
             "| tree | workers | load | exec -> ready s (each) | CPU s (each) | split (this tree) |",
             "|---|---:|---:|---|---|---|"]
    for name, n, load, got in rows:
        ready = ", ".join(str(g.get("ready")) for g in got)
        cpu = ", ".join(str(g.get("cpu")) for g in got)
        split = "; ".join(g.get("split", "") for g in got)
        lines.append(f"| {name} | {n} | {load} | {ready} | {cpu} | {split} |")
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
    ap.add_argument("--ab", action="store_true", help="engine choices, interleaved A/B in one process")
    ap.add_argument("--jvm", action="store_true", help="JVM options, fresh processes")
    ap.add_argument("--first-chunk", action="store_true", help="first chunks after ready vs warm-up budget")
    ap.add_argument("--startup", action="store_true", help="`strata worker` exec -> ready, alone and two at once")
    ap.add_argument("--head", help="--startup: also the source tree in this directory (before/after)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import json

        print(json.dumps(child(json.loads(args.child))), flush=True)
        os._exit(0)
    for mode, fn in (("ab", run_ab), ("jvm", run_jvm), ("first_chunk", run_first_chunk), ("startup", run_startup)):
        if getattr(args, mode):
            print(f"load {_load()}; {os.cpu_count()} CPUs; Python {platform.python_version()}", flush=True)
            table = fn(args)
            print()
            print(table)
            return
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
