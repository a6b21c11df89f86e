"""The replicated and the trusted architecture side by side on the user's path: the dissertation's Tables
9.13-9.15 (§9.4; issue 33).  ``python -m bench.trusted [--write]`` or ``python -m bench.run --only trusted``;
docs/benchmarks/trusted.md.

One workload, three clusters, each started by the CLI as a user starts it (``strata up``, default settings,
mutual TLS) with the same number of Spark workers (two ``local[1]`` worker JVMs: two Spark cores in all):

* ``replicated``: ``strata up --levels S,TS --workers 1`` (a master and one worker per level: 2 masters, 2
  workers);
* ``trusted``: ``strata up --levels S,TS --workers 2 --mode trusted`` (one master, two workers serving both
  levels);
* ``trusted/no-sharing``: the same with ``[sharing] enabled = false`` in the configuration.

The workload, at each of S and TS (as the dissertation's Exp. 5: users of two levels each running the same
queries), jane (cleared TS, every role) logged in at the level through the Python API, four queries, two
of which share their window (``AVG ... GROUP BY sid`` and ``MAX`` over ``Vitals [ROWS 100]``) and two
identical ones (Exp. 4's join of ``ROWS 50 level in {U}`` windows, which shares everything); input: battlefield
Vitals and Positions (20,000 tuples an instant per stream, U/C/S/TS a quarter each), labelled, sent to each
level by its own ``strata ingest --labelled --finish`` (the CLI, both launched together; the S one leaves the
TS quarter out, as its client does).  Per run: fresh masters on the warm workers (``renew_master``, what
``strata replay --cluster`` does: for the trusted cluster one restart renews both levels), the sessions log in
and register (the registration's wall time: Table 9.14's plan generation as a client sees it), subscribers
follow every query; then the two ingests.

* **execution time** = both ingests launched → the last result of the last query of both levels (the
  dissertation's "first tuple in → last tuple out", with the ingest commands' own start-up inside);
* **throughput** = the tuples in the input files (both streams, every level) / execution time;
* **CPU** = the cluster's processes (masters' and workers' process trees, JVMs included) over the run, and
  the two ingest commands' own;
* **chunk latency**: each level's master's mean time from a chunk's cut to its results (``strata status``).

Order: per round each cluster in turn (order reversed every round), one cluster up at a time (``strata up``,
an unmeasured warm-up run, ``runs`` measured runs, ``strata down``): the idle JVMs of another cluster never
share the two cores with a measured run.  Medians over the rounds' runs.

Plan generation (Table 9.14) in this process as well: the dissertation's Exp. 1-3 texts, four identical each,
registered with a master's pipeline (``QueryPipeline.add_query``: parse, authorize, rewrite, the chunker's
windows; sharing off) of the vanilla configuration (one level P, the vanilla texts) and of the battlefield one
at TS, alternately, medians of many rounds.

Every run's whole output is checked against the reference (tests/reference/evaluator.py) on every instant:
the windows are ROWS 100 and ROWS 50 over a quarter of the tuples and an instant holds 20,000 tuples per
stream, so instant τ's rows depend only on instants τ-1 and τ (bench/check.py's argument); the reference is
given the last 2,000 tuples of τ-1 and all of τ.  A wrong output stops the run (BenchCheckFailed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import workloads as W  # noqa: E402
from bench.check import BenchCheckFailed, Excerpts  # noqa: E402
from bench.userpath import PASSWORD, STRATA, TreeCpu, _env, setup, up_cluster  # noqa: E402
from strata.api import connect  # noqa: E402
from strata.config import parse_config  # noqa: E402
from strata.deploy.local import renew_master  # noqa: E402
from strata.examples import BATTLEFIELD_TOML  # noqa: E402
from strata.worker.load import tree_cpu_times  # noqa: E402

LEVELS = ("S", "TS")
USER = "jane"
PER_INSTANT = 20_000
TRIM = 2_000  # tuples of instant τ-1 given to the reference with instant τ
Q_GROUP = "SELECT sid, AVG(bp) FROM Vitals [ROWS 100] GROUP BY sid"
Q_MAX = "SELECT MAX(bp) FROM Vitals [ROWS 100]"  # shares Q_GROUP's window
Q_JOIN = ("SELECT v.sid, v.weight, p.lat FROM Positions [ROWS 50 level in {U}] p, Vitals [ROWS 50 level in {U}] v "
          "WHERE v.sid = p.sid")  # Exp. 4's join, twice: complete sharing
QUERIES = [Q_GROUP, Q_MAX, Q_JOIN, Q_JOIN]
NO_SHARING = "\n[sharing]\nenabled = false\n"
#: mode -> (strata up --mode, workers per group, extra configuration)
MODES = {"replicated": ("replicated", 1, ""), "trusted": ("trusted", 2, ""),
         "trusted/no-sharing": ("trusted", 2, NO_SHARING)}
NO_CROSS = "\n[sharing]\nacross_levels = false\n"
if hasattr(parse_config(BATTLEFIELD_TOML).sharing, "across_levels"):  # cross-level reuse (worker/cross_level.py)
    MODES["trusted/no-cross-level"] = ("trusted", 2, NO_CROSS)  # within-level sharing only: the gap is the reuse

#: the dissertation's figures (ch. 9.4; copied: nothing reads the dissertation at run time)
PAPER_9_13 = {  # Vanilla vs no-sharing trusted, execution (ms), input 20,000 tuples/s; overhead %
    "Exp 1 (RANGE UNBOUNDED select)": {"500K": (25051, 25058, 0.031), "1M": (50062, 50073, 0.022),
                                       "2M": (100072, 100084, 0.012)},
    "Exp 2 (ROWS 100 join)": {"500K": (26967, 27419, 1.677), "1M": (51104, 51861, 1.481),
                              "2M": (101404, 102104, 0.691)},
    "Exp 3 (RANGE 10 s AVG)": {"500K": (35016, 35047, 0.089), "1M": (60056, 60083, 0.046),
                               "2M": (110084, 110111, 0.024)},
}
PAPER_9_14 = {"Exp 1": (269.4, 279.9, 3.876), "Exp 2": (272.2, 279.1, 2.531), "Exp 3": (274.8, 282.4, 2.790)}
PAPER_9_15 = {  # Replicated vs trusted, execution (ms), input 40,000 tuples/s; gain %
    "Exp 4 (sharing in one level)": {"500K": (29297, 14024, 108.909), "1M": (49032, 27105, 80.898),
                                     "2M": (88957, 54355, 63.659)},
    "Exp 5 (sharing across levels)": {"500K": (35899, 21466, 67.241), "1M": (66061, 40266, 64.063),
                                      "2M": (113206, 70044, 61.620)},
}
#: Table 9.14's experiments: (vanilla text, trusted text), four identical queries each
PLAN_EXPS = {
    "Exp 1": ("SELECT sid, weight FROM Vitals", "SELECT sid, weight FROM Vitals [RANGE UNBOUNDED level in {TS, S, C, U}]"),
    "Exp 2": ("SELECT * FROM Vitals [ROWS 100], Positions [ROWS 100] WHERE Vitals.sid = Positions.sid",
              "SELECT * FROM Positions [ROWS 100 level in {TS, S, C, U}], Vitals [ROWS 100 level in {TS, S, C, U}] "
              "WHERE Vitals.sid = Positions.sid"),
    "Exp 3": ("SELECT AVG(bp) FROM Vitals [RANGE 10 seconds] WHERE bp > 100",
              "SELECT AVG(bp) FROM Vitals [RANGE 10 seconds level in {S}] WHERE bp > 100"),
}


def tree_state() -> dict:
    """The code a cluster starts with: HEAD and the uncommitted changes to the runtime's directories (other
    engineers edit them while benchmarks run: a figure belongs to the tree its processes started from)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    import hashlib

    dirs = ["master", "worker", "strata", "deploy", "chunking"]
    return {"head": git("rev-parse", "--short", "HEAD").strip(),
            "dirty": git("status", "--short", "--", *dirs).split("\n")[:-1],
            "diff_sha1": hashlib.sha1(git("diff", "HEAD", "--", *dirs).encode()).hexdigest()[:10]}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def inputs(d: Path, tuples: int) -> tuple[dict[str, pa.Table], dict[str, Path]]:
    """``tuples`` per stream (Vitals, Positions), as CSV files a user would have."""
    tables = {"Vitals": W.vitals(tuples, PER_INSTANT), "Positions": W.positions(tuples, PER_INSTANT)}
    files = {}
    for s, t in tables.items():
        files[s] = d / f"{s.lower()}_{tuples}.csv"
        pcsv.write_csv(t, files[s])
    return tables, files


# ---- the reference -----------------------------------------------------------------------------------
class Reference(Excerpts):
    """Expected rows per (level, query text, instant) from tests/reference/evaluator.py on excerpts (above)."""

    def __init__(self, tables: dict[str, pa.Table]):
        super().__init__(tables, TRIM)
        self.cfg = parse_config(BATTLEFIELD_TOML)
        self._cache: dict[tuple[str, str], list[tuple]] = {}

    def rows(self, level: str, query: str) -> list[tuple]:
        from tests.reference.evaluator import evaluate

        key = (level, query)
        if key not in self._cache:
            t0 = time.monotonic()
            rows = []
            for tau in self.instants:
                rows += [r for r in evaluate(query, self.cfg, level, self.excerpt(tau)) if r[0] == tau]
            self._cache[key] = rows
            _log(f"reference {level} {query[:40]}...: {len(rows):,} rows, {time.monotonic() - t0:.0f} s")
        return self._cache[key]


def check(ref: Reference, level: str, query: str, rows: list[tuple], tag: str) -> None:
    from tests.reference.evaluator import compare_results

    try:
        compare_results(rows, ref.rows(level, query), rel=1e-6)
    except AssertionError as e:
        raise BenchCheckFailed(f"trusted {tag} {level} {query}: output differs from the reference: "
                               f"{str(e)[:1500]}") from None


# ---- a cluster and its runs ----------------------------------------------------------------------------
def _tree_cpu(pids: list[int]) -> float:
    return sum(sum(tree_cpu_times(p).values()) for p in pids)


class Cluster:
    """``strata up`` of one mode in ``d`` for the block; :meth:`run` gives it fresh masters and runs the workload."""

    def __init__(self, d: Path, mode: str):
        self.d, self.mode = d, mode
        up_mode, self.workers, extra = MODES[mode]
        d.mkdir(parents=True, exist_ok=True)
        self.cfg = setup(d)
        if extra:
            self.cfg.write_text(self.cfg.read_text() + extra)
        self.state = d / "up-state"
        self._up = up_cluster(self.cfg, self.state, ",".join(LEVELS), self.workers, up_mode)

    def __enter__(self):
        self.tree = tree_state()
        la = loadavg()
        self.up = dict(self._up.__enter__())
        self.up.pop("stderr", None)
        self.up["load"] = la
        self.tls = json.loads((self.state / "cluster.json").read_text())["tls_dir"]
        _log(f"{self.mode}: strata up {self.up['seconds']:.1f} s")
        return self

    def __exit__(self, *exc):
        return self._up.__exit__(*exc)

    def _processes(self) -> list[dict]:
        return json.loads((self.state / "cluster.json").read_text())["processes"]

    def fresh(self) -> dict[str, str]:
        """Fresh masters (a new timeline, no queries) on the warm workers; level -> address."""
        out = {}
        for lv in LEVELS:
            if lv in out:
                continue
            addr, _, _ = renew_master(self.state, lv)
            served = next(p.get("serves", [p["level"]]) for p in self._processes()
                          if p["role"] == "master" and lv in p.get("serves", [p["level"]]))
            out.update({x: addr for x in served})
        return out

    def run(self, files: dict[str, Path], tuples: int, tag: str) -> dict:
        masters = self.fresh()
        procs = self._processes()
        pids = [p["pid"] for p in procs if p["role"] in ("master", "worker")]
        mpids = [p["pid"] for p in procs if p["role"] == "master"]
        sessions, followers, register_ms = {}, {}, {}
        for lv in LEVELS:
            s = connect(masters[lv], USER, lv, tls_dir=self.tls, password=PASSWORD)
            t0 = time.perf_counter()
            qs = s.register_all(QUERIES)
            register_ms[lv] = round(1000 * (time.perf_counter() - t0), 2)
            sessions[lv] = s
            followers[lv] = Follower(s, [q.query_id for q in qs])
        la0 = loadavg()
        cpu0, mcpu0 = _tree_cpu(pids), _tree_cpu(mpids)
        t0 = time.monotonic()
        ingests, icpu = {}, {}
        for lv in LEVELS:
            cmd = STRATA + ["ingest", "--config", str(self.cfg), "--master", masters[lv], "--tls-dir", self.tls,
                            "--user", USER, "--level", lv, "--labelled", "--finish"]
            cmd += [x for s, f in files.items() for x in ("--input", f"{s}={f}")]
            ingests[lv] = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           text=True)
            icpu[lv] = TreeCpu(ingests[lv].pid)
        ing_s = {}
        for lv, p in ingests.items():
            _, err = p.communicate(timeout=1800)
            ing_s[lv] = round(time.monotonic() - t0, 3)
            if p.returncode != 0:
                raise RuntimeError(f"strata ingest at {lv} exited {p.returncode}: {err[-1500:]}")
        client_cpu = sum(c.stop() for c in icpu.values())
        for lv, f in followers.items():
            f.thread.join(timeout=600)
            if f.thread.is_alive():
                raise RuntimeError(f"{tag}: the queries at {lv} did not end within 600 s of the input's end")
            if f.errors:
                raise RuntimeError(f"{tag}: subscriber at {lv} failed: {f.errors[0]}")
        cpu, mcpu = _tree_cpu(pids) - cpu0, _tree_cpu(mpids) - mcpu0
        la1 = loadavg()
        latency, engine, counters = {}, {}, {}
        for lv, s in sessions.items():
            ops = s.client.status()
            hist = {k: float(v) for k, v in ops.histograms.items()}
            n = hist.get("latency_count", 0.0)
            latency[lv] = round(1000 * hist["latency_sum"] / n, 1) if n else None
            counters[lv] = {k: int(v) for k, v in ops.counters.items() if "shar" in k or "cross" in k or "reuse" in k}
            engine[lv] = {k: float(v) for k, v in ops.timings.items()}.get("engine_p50_ms")
            s.close()
        last = {lv: max(f.arrive.values()) - t0 for lv, f in followers.items() if f.arrive}
        first = {lv: min(f.arrive.values()) - t0 for lv, f in followers.items() if f.arrive}
        seconds = max(last.values())
        n_in = 2 * tuples
        return {"mode": self.mode, "tag": tag, "seconds": round(seconds, 3), "throughput": round(n_in / seconds),
                "level_seconds": {lv: round(x, 3) for lv, x in last.items()},
                "first_result": {lv: round(x, 3) for lv, x in first.items()}, "ingest_seconds": ing_s,
                "cpu_seconds": round(cpu, 2), "master_cpu_seconds": round(mcpu, 2),
                "client_cpu_seconds": round(client_cpu, 2),
                "chunk_latency_ms": latency, "engine_p50_ms": engine, "register_ms": register_ms, "counters": counters,
                "load": [la0, la1], "rows": {lv: f.rows() for lv, f in followers.items()}}


class Follower:
    """Every query of a session followed by one thread (``Session.subscribe``): rows per query id, the
    arrival time of each instant's rows; ``thread`` ends when they all end."""

    def __init__(self, session, ids: list[str]):
        self.ids = ids
        self.parts: dict[str, list[pa.Table]] = {q: [] for q in ids}
        self.arrive: dict[tuple[str, int], float] = {}
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._follow, args=(session,), daemon=True)
        self.thread.start()

    def _follow(self, session) -> None:
        try:
            for qid, ts, table in session.subscribe(self.ids):
                self.arrive[(qid, ts)] = time.monotonic()
                self.parts[qid].append(table)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.errors.append(e)

    def rows(self) -> list[list[tuple]]:
        out = []
        for qid in self.ids:
            rows = []
            for t in self.parts[qid]:
                cols = [t.column(i).to_pylist() for i in range(t.num_columns)]
                rows += [tuple(r) for r in zip(*cols)]
            out.append(rows)
        return out


def run_checked(cl: Cluster, ref: Reference, files, tuples: int, tag: str, checks: list) -> dict:
    r = cl.run(files, tuples, tag)
    rows = r.pop("rows")
    n = 0
    for lv, per_query in rows.items():
        for q, got in zip(QUERIES, per_query):
            check(ref, lv, q, got, tag)
            n += len(got)
    checks.append(f"{tag}: the reference agrees on all {len(ref.instants)} instants of the {len(QUERIES)} queries "
                  f"at each of {', '.join(LEVELS)} ({n:,} rows)")
    r["out_rows"] = n
    _log(f"{tag}: {r['seconds']:.2f} s ({r['throughput']:,} tuples/s; S {r['level_seconds'].get('S')} s, TS "
         f"{r['level_seconds'].get('TS')} s), cluster CPU {r['cpu_seconds']:.1f} s, ingest CPU "
         f"{r['client_cpu_seconds']:.1f} s, chunk latency {r['chunk_latency_ms']} ms, registration "
         f"{r['register_ms']} ms, {n:,} rows, load {r['load'][0][0]}-{r['load'][1][0]}")
    return r


# ---- plan generation (Table 9.14) ------------------------------------------------------------------------
def plan_generation(rounds: int) -> dict:
    """Median ms to register each experiment's four identical texts with a fresh master pipeline (sharing off):
    vanilla (one level P, the vanilla text) against MLS at TS (the dissertation's trusted text), alternately."""
    from strata.master.pipeline import QueryPipeline  # deferred: the master's code only for this measurement

    cfgs = {"vanilla": (parse_config(W.VANILLA_BF_TOML + NO_SHARING), "P"),
            "trusted": (parse_config(BATTLEFIELD_TOML + NO_SHARING), "TS")}
    out = {}
    for exp, texts in PLAN_EXPS.items():
        ms: dict[str, list[float]] = {"vanilla": [], "trusted": []}
        for i in range(rounds):
            for k in (("vanilla", "trusted") if i % 2 == 0 else ("trusted", "vanilla")):
                cfg, level = cfgs[k]
                text = texts[0] if k == "vanilla" else texts[1]
                p = QueryPipeline(cfg, level)
                t0 = time.perf_counter()
                for _ in range(4):
                    p.add_query(text)
                ms[k].append((time.perf_counter() - t0) * 1000)
        v, t = statistics.median(ms["vanilla"]), statistics.median(ms["trusted"])
        out[exp] = {"vanilla_ms": round(v, 3), "trusted_ms": round(t, 3), "overhead_pct": round(100 * (t - v) / v, 1)}
    return out


# ---- the measurement -----------------------------------------------------------------------------------
def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for m, rs in runs.items():
        if not rs:
            continue
        x = {k: _med(r.get(k) for r in rs) for k in ("seconds", "throughput", "cpu_seconds", "master_cpu_seconds",
                                                     "client_cpu_seconds")}
        for k in ("level_seconds", "first_result", "chunk_latency_ms", "register_ms"):
            x[k] = {lv: _med(r[k].get(lv) for r in rs) for lv in LEVELS}
        x["load"] = [min(r["load"][0][0] for r in rs), max(r["load"][1][0] for r in rs)]
        x["runs"] = len(rs)
        x["seconds_all"] = [r["seconds"] for r in rs]
        x["out_rows"] = _med(r["out_rows"] for r in rs)
        x["counters"] = rs[-1].get("counters", {})  # the last run's sharing counters per level, as status shows them
        out[m] = x
    base = out.get("replicated")
    for m, x in out.items():
        if base and m != "replicated":  # the dissertation's gain: (t_replicated - t_mode) / t_mode
            x["gain_vs_replicated_pct"] = round(100 * (base["seconds"] - x["seconds"]) / x["seconds"], 1)
            x["cpu_vs_replicated_pct"] = round(100 * (x["cpu_seconds"] / base["cpu_seconds"] - 1), 1)
            pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs["replicated"], runs[m])]
            x["gain_paired_pct"] = round(100 * (statistics.median(pairs) - 1), 1)
    if "trusted" in out and "trusted/no-sharing" in out:
        on, off = out["trusted"], out["trusted/no-sharing"]
        on["gain_vs_no_sharing_pct"] = round(100 * (off["seconds"] - on["seconds"]) / on["seconds"], 1)
    return out


def measure(tuples: int, rounds: int, runs_per_up: int, plan_rounds: int, modes=tuple(MODES),
            save: Path | None = None) -> dict:
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": loadavg(),
           "tuples_per_stream": tuples, "per_instant": PER_INSTANT, "rounds": rounds, "runs_per_up": runs_per_up,
           "queries": QUERIES, "levels": list(LEVELS), "cpus": os.cpu_count(),
           "command": "python -m bench.trusted " + " ".join(sys.argv[1:]) if __name__ == "__main__" else
           "python -m bench.run --only trusted"}
    with tempfile.TemporaryDirectory(prefix="strata-bench-trusted-") as tmp:
        d = Path(tmp)
        tables, files = inputs(d, tuples)
        ref = Reference(tables)
        for lv in LEVELS:  # the reference first, before any cluster shares the cores
            for q in dict.fromkeys(QUERIES):
                ref.rows(lv, q)
        res["plan_generation"] = plan_generation(plan_rounds)
        _log(f"plan generation: {res['plan_generation']}")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        ups: dict[str, list[dict]] = {m: [] for m in modes}
        checks: list[str] = []
        for rnd in range(rounds):
            for m in (modes if rnd % 2 == 0 else tuple(reversed(modes))):
                with Cluster(d / m.replace("/", "-") / f"r{rnd}", m) as cl:
                    ups[m].append({"seconds": cl.up["seconds"], "cpu_seconds": cl.up["cpu_seconds"], "load": cl.up["load"],
                                   "tree": cl.tree})
                    run_checked(cl, ref, files, tuples, f"{m} round {rnd} warm-up", checks)
                    for k in range(runs_per_up):
                        r = run_checked(cl, ref, files, tuples, f"{m} round {rnd} run {k}", checks)
                        r["round"] = rnd
                        runs[m].append(r)
                if save is not None:
                    save.write_text(json.dumps(dict(res, runs=runs, ups=ups, checks=checks, finished="(partial)"),
                                               indent=1, default=str))
    res.update(runs=runs, ups=ups, checks=checks, summary=summarize(runs), load_end=loadavg(),
               finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return res


def merge(results: list[dict]) -> dict:
    """Several runs' results (e.g. the same command at different times of a loaded day) as one: every measured
    run of each mode pooled, the medians taken again; plan generation from the last."""
    results = sorted(results, key=lambda r: r["started"])
    out = dict(results[-1], started=results[0]["started"], load_start=results[0]["load_start"],
               rounds=sum(r["rounds"] for r in results),
               command=" and ".join(dict.fromkeys(r["command"] for r in results)) + f" ({len(results)} runs pooled)"
               if len(results) > 1 else results[0]["command"])
    out["runs"] = {m: [x for r in results for x in r["runs"].get(m, [])] for m in results[-1]["runs"]}
    out["ups"] = {m: [x for r in results for x in r["ups"].get(m, [])] for m in results[-1]["ups"]}
    out["checks"] = [c for r in results for c in r["checks"]]
    out["summary"] = summarize(out["runs"])
    return out


# ---- the report ----------------------------------------------------------------------------------------
def _n(x, fmt="{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(r: dict) -> str:
    s = r["summary"]
    n = r["tuples_per_stream"]
    L = ["## Measured (generated by bench/trusted.py)", "",
         f"`{r['command']}`, {r['started']} - {r['finished']}; load average (1/5/15 min) "
         f"{' / '.join(f'{x:.1f}' for x in r['load_start'])} at the start, "
         f"{' / '.join(f'{x:.1f}' for x in r['load_end'])} at the end (per mode in the table: lowest 1-minute "
         f"value at a run's start to highest at a run's end); a shared {r['cpus']}-core VM. Input: {n:,} tuples per "
         f"stream (Vitals, Positions: {2 * n:,} in all, {r['per_instant']:,} per instant and stream, a quarter of each "
         f"level), sent by one `strata ingest --labelled --finish` per level; queries at each of "
         f"{', '.join(r['levels'])}: " + "; ".join(f"`{q}`" for q in r["queries"]) + f". {r['rounds']} rounds, "
         f"each mode's cluster up alone, one unmeasured warm-up run then {r['runs_per_up']} measured; medians of "
         "the measured runs.", "",
         "| mode | processes | execution s (all runs) | tuples/s | S / TS last result s | cluster CPU s (masters) | "
         "ingest CPU s | chunk latency S / TS ms | registration S / TS ms | gain vs replicated (paired) | load |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    procs = {"replicated": "2 masters, 2 workers (1 per level)"}
    for m, x in s.items():
        gain = "" if m == "replicated" else f"{x['gain_vs_replicated_pct']:+.1f} % ({x['gain_paired_pct']:+.1f} %)"
        L.append(f"| {m} | {procs.get(m, '1 master, 2 workers')} | {x['seconds']:.2f} ({', '.join(f'{t:.2f}' for t in x['seconds_all'])}) | "
                 f"{_n(x['throughput'])} | {_n(x['level_seconds']['S'], '{:.2f}')} / "
                 f"{_n(x['level_seconds']['TS'], '{:.2f}')} | {x['cpu_seconds']:.1f} ({_n(x['master_cpu_seconds'], '{:.1f}')}) | "
                 f"{x['client_cpu_seconds']:.1f} | {_n(x['chunk_latency_ms']['S'])} / "
                 f"{_n(x['chunk_latency_ms']['TS'])} | {_n(x['register_ms']['S'], '{:.0f}')} / "
                 f"{_n(x['register_ms']['TS'], '{:.0f}')} | {gain} | {x['load'][0]}-{x['load'][1]} |")
    trees = [u["tree"] for us in r["ups"].values() for u in us if "tree" in u]
    if trees:
        dirty = sorted({x.split()[-1] for t in trees for x in t["dirty"]})
        shas = list(dict.fromkeys(t["diff_sha1"] for t in trees))
        L += ["", f"Code the clusters started from: HEAD {', '.join(dict.fromkeys(t['head'] for t in trees))}" + (
            f" with uncommitted changes to {', '.join(dirty)} (sha1 of the diff at the cluster starts: "
            f"{', '.join(shas)}" + ("; the tree changed during the run: other engineers' work in progress"
                                    if len(shas) > 1 else "") + ")" if dirty else " (no uncommitted changes)") + "."]
    L += ["", "`strata up` (each round's cluster start, seconds): " + "; ".join(
        f"{m} " + ", ".join(f"{u['seconds']:.1f}" for u in us) for m, us in r["ups"].items()) + ".", "",
        "Plan generation in one process (four identical queries registered with a fresh master pipeline, sharing "
        "off; medians):", "", "| experiment | vanilla (P) ms | MLS at TS ms | overhead | dissertation Table 9.14 "
        "vanilla / trusted ms, overhead |", "|---|---:|---:|---:|---|"]
    for exp, x in r["plan_generation"].items():
        p = PAPER_9_14[exp]
        L.append(f"| {exp} | {x['vanilla_ms']:.2f} | {x['trusted_ms']:.2f} | {x['overhead_pct']:+.1f} % | "
                 f"{p[0]} / {p[1]}, +{p[2]} % |")
    L += ["", f"Correctness: every run's whole output (warm-ups included: {len(r['checks'])} runs, every query at "
          "both levels) equals the reference (tests/reference/evaluator.py) on every instant.", ""]
    return "\n".join(L)


MARK = "<!-- bench/trusted.py: the measured part below is regenerated -->"


def write_doc(text: str, out: Path = ROOT / "docs" / "benchmarks" / "trusted.md") -> None:
    """Replace the measured part of trusted.md (after ``MARK``), keeping the hand-written part above it."""
    head = out.read_text().split(MARK)[0].rstrip() + "\n\n" if out.exists() else "# Trusted vs replicated\n\n"
    out.write_text(head + MARK + "\n\n" + text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="replicated vs trusted vs trusted without sharing (Tables 9.13-9.15)")
    ap.add_argument("--tuples", type=int, default=400_000, help="tuples per stream and run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2, help="measured runs per cluster start")
    ap.add_argument("--plan-rounds", type=int, default=200)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--json", help="write the results here (also while running; with --from-json the pooled ones)")
    ap.add_argument("--write", action="store_true", help="regenerate docs/benchmarks/trusted.md's measured part")
    ap.add_argument("--from-json", nargs="+", help="only render these results files (several: pooled)")
    a = ap.parse_args(argv)
    if a.from_json:
        r = merge([json.loads(Path(f).read_text()) for f in a.from_json])
    else:
        r = measure(a.tuples, a.rounds, a.runs, a.plan_rounds, tuple(a.modes), Path(a.json) if a.json else None)
    if a.json:  # with --from-json: the pooled results
        Path(a.json).write_text(json.dumps(r, indent=1, default=str))
    text = render(r)
    print(text)
    if a.write:
        write_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
