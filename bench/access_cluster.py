"""Security punctuations and privacy switches end to end on a cluster, on the user's path (issue 34;
``python -m bench.access --cluster``, ``python -m bench.run --only access``; docs/benchmarks/access.md).

bench/access.py measures the master's data path in one process; this runs the same workload the way a
user does: ``strata up --levels S --workers 2`` once (default settings, mutual TLS), then per run a fresh
master on the warm workers (what ``strata replay --cluster`` does: ``renew_master``), a subscriber (the
Python API, ``Session.subscribe``, as a user's program), ``strata ingest --labelled --finish`` (the
CLI, as a subprocess) of battlefield CSVs at S (20,000 tuples an instant, four levels: the TS quarter is
left out by the client) and, for the switch, ``strata access revoke`` / ``grant`` (the CLI) while it
runs.  The user is jane (cleared TS, every role: producer, analyst, operator).

Two measurements, each with its variants interleaved (order reversed every repetition), one unmeasured
warm-up round first, medians of ``reps`` runs:

* **fast** (throughput): the input as fast as the cluster takes it.  ``throughput`` = input tuples /
  (``strata ingest`` launched → the query's last result received); the fresh master, the login and the
  registration are start-up, outside it; the ingest command's own start (Python, TLS login) is inside.
  Variants, query ``Q_AGG`` = ``SELECT sid, AVG(bp) FROM Vitals [ROWS 100] GROUP BY sid``:
  ``plain`` (no punctuation); ``policy`` (one tuple-level policy at instant 0 for each of U, C, S:
  ``sid=s0|..|s99`` of 200 sids granted to analysts, as bench/access.py: about half the tuples
  hidden; the rows in the reserved stream ``_punctuations``, the first ``--input`` of the same ingest);
  and SCJoin, query ``Q_JOIN`` = a ROWS 100 equi-join of Vitals and Positions on sid: ``join`` (no
  punctuation) and ``join/shielded`` (the same policy on both streams: both sides shielded).
* **paced** (chunk latency and CPU; the switch needs time to act): ``strata ingest --rate R`` (R of the
  tuples sent, i.e. of the 3/4 not TS); at 20 % and 55 % of ``tuples / R`` seconds after the ingest
  command is launched the harness runs a CLI command: ``switch`` runs
  ``strata access revoke`` then ``strata access grant`` for the query's owner, the query and Vitals
  (the replies name the instants from which they act); ``plain`` and ``policy`` run ``strata status``
  at the same moments (the same CLI start-ups on the same cores).  An instant closed before the revoke
  is processed as usual: where the switch lands is whatever the master's first open instant was.

Per run also: the cluster's CPU seconds (the master's and both workers' process trees, JVMs included,
sampled at the start and the end of the run: the work done, whatever the waiting) and the master's
per-chunk timings (``strata status``: chunk latency from cut to results back, engine time).

Every run's whole output is checked against the independent reference (tests/reference/access.py: the
policies and switches applied tuple by tuple, then the reference evaluator) on every instant; the
windows are ROWS 100 and every instant holds about 7,500 (≫ 100) visible tuples of each stream, so instant τ's rows
depend only on instants τ-1 and τ (bench/check.py's argument), which is what the reference is given
(the last 2,000 tuples of τ-1, about 750 visible, and all of τ).  A wrong output fails the run (BenchCheckFailed).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv

from bench import workloads as W
from bench.check import BenchCheckFailed, Excerpts
from bench.userpath import PASSWORD, STRATA, Subscriber, _env, setup, up_cluster, worker_pids
from strata.api import connect
from strata.config import parse_config
from strata.deploy.local import renew_master
from strata.examples import BATTLEFIELD_TOML
from strata.worker.load import tree_cpu_times

LEVEL = "S"
USER = "jane"
ROLES = {"producer", "analyst", "operator"}
PER_INSTANT = 20_000
Q_AGG = "SELECT sid, AVG(bp) FROM Vitals [ROWS 100] GROUP BY sid"
Q_JOIN = "SELECT v.sid, v.bp, p.lat FROM Vitals [ROWS 100] v, Positions [ROWS 100] p WHERE v.sid = p.sid"
FAST = ("plain", "policy", "join", "join/shielded")
PACED = ("plain", "policy", "switch")
#: the paced run's CLI commands, as fractions of the input's duration
HOOKS_AT = (0.20, 0.55)
TRIM = 2_000  # tuples of instant τ-1 given to the reference with instant τ


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def policy_rows(streams: tuple[str, ...]) -> list[dict]:
    """One tuple-level policy at instant 0 per stream and level U, C, S: half the sids, to analysts."""
    sids = "|".join(f"s{i}" for i in range(W.SIDS // 2))
    return [{"ts": 0, "level": lv, "stream": s, "tuples": f"sid={sids}", "attributes": "*", "roles": "analyst",
             "users": "", "sign": "+", "immutable": ""} for s in streams for lv in ("U", "C", "S")]


def _write_punct(path: Path, rows: list[dict]) -> Path:
    types = {"ts": pa.int64(), "immutable": pa.bool_()}  # immutable empty: NULL (= false), unquoted
    pcsv.write_csv(pa.table({c: pa.array([r[c] if r[c] != "" or c != "immutable" else None for r in rows],
                                         types.get(c, pa.string())) for c in rows[0]}), path)
    return path


VARIANT = {  # name -> (query, streams, punctuations' streams or None)
    "plain": (Q_AGG, ("Vitals",), None),
    "policy": (Q_AGG, ("Vitals",), ("Vitals",)),
    "switch": (Q_AGG, ("Vitals",), None),
    "join": (Q_JOIN, ("Vitals", "Positions"), None),
    "join/shielded": (Q_JOIN, ("Vitals", "Positions"), ("Vitals", "Positions")),
}


# ---- the reference ---------------------------------------------------------------------------------
class Reference(Excerpts):
    """Expected rows per (variant, instant), from tests/reference/access.py on excerpts (see above)."""

    def __init__(self, tables: dict[str, pa.Table]):
        super().__init__(tables, TRIM)
        self.cfg = parse_config(BATTLEFIELD_TOML)
        self._cache: dict[str, dict[int, list[tuple]]] = {}

    def at(self, variant: str, tau: int, switches=()) -> list[tuple]:
        from tests.reference.access import evaluate_access

        query, streams, pstreams = VARIANT[variant]
        punct = policy_rows(pstreams) if pstreams else []
        punct = [dict(p, immutable=None) for p in punct]
        out = evaluate_access(query, self.cfg, LEVEL, self.excerpt(tau, streams), punct, (USER, ROLES), switches)
        return [r for r in out.rows if r[0] == tau]

    def rows(self, variant: str) -> dict[int, list[tuple]]:
        """Every instant's rows of a variant without a switch (computed once)."""
        if variant not in self._cache:
            t0 = time.monotonic()
            self._cache[variant] = {tau: self.at(variant, tau) for tau in self.instants}
            _log(f"reference {variant}: {sum(map(len, self._cache[variant].values())):,} rows, "
                 f"{time.monotonic() - t0:.0f} s")
        return self._cache[variant]

    def switched(self, a: int | None, b: int | None) -> dict[int, list[tuple]]:
        """The switch variant's rows when access to Vitals was off over [a, b) (b None: to the end): the
        plain rows outside it, except instant b, whose window lost instant b-1 (computed anew)."""
        plain = self.rows("plain")
        if a is None:
            return plain
        out = {}
        for tau in self.instants:
            if a <= tau and (b is None or tau < b):
                continue
            out[tau] = self.at("switch", tau, [("Vitals", a, b)]) if tau == b else plain[tau]
        return out


def check(ref: Reference, variant: str, rows: list[tuple], switch: tuple | None, tag: str) -> str:
    from tests.reference.evaluator import compare_results

    exp = ref.switched(*switch) if variant == "switch" else ref.rows(variant)
    want = [r for rs in exp.values() for r in rs]
    try:
        compare_results(rows, want, rel=1e-6)
    except AssertionError as e:
        raise BenchCheckFailed(f"access cluster {tag}: output differs from the reference: {str(e)[:1500]}") from None
    return f"{tag}: the reference agrees on all {len(ref.instants)} instants ({len(want):,} rows)"


# ---- one run -----------------------------------------------------------------------------------------
def _tree_cpu(pids: list[int]) -> float:
    return sum(sum(tree_cpu_times(p).values()) for p in pids)


class Cluster:
    """``strata up --levels S --workers 2`` in ``d`` for the block; :meth:`run` gives it a fresh master."""

    def __init__(self, d: Path):
        self.d = d
        self.cfg = setup(d)
        self.state = d / "up-state"
        self._up = up_cluster(self.cfg, self.state, LEVEL)

    def __enter__(self):
        self.up = self._up.__enter__()
        self.tls = json.loads((self.state / "cluster.json").read_text())["tls_dir"]
        return self

    def __exit__(self, *exc):
        return self._up.__exit__(*exc)

    def _cli(self, master: str, words: list[str], args: list[str]) -> tuple[float, str]:
        t0 = time.monotonic()
        r = subprocess.run(STRATA + words + ["--config", str(self.cfg), "--master", master, "--tls-dir", self.tls]
                           + args, env=_env(), capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"strata {' '.join(words)} exited {r.returncode}: {r.stderr[-1500:]}")
        return time.monotonic() - t0, r.stderr

    def run(self, variant: str, files: dict[str, Path], rate: int | None, tuples: int) -> dict:
        query, streams, pstreams = VARIANT[variant]
        master, _, _ = renew_master(self.state, LEVEL)
        rec = json.loads((self.state / "cluster.json").read_text())
        mpid = next(p["pid"] for p in rec["processes"] if p["role"] == "master")
        pids = [mpid] + worker_pids(self.state)
        sub = connect(master, USER, LEVEL, tls_dir=self.tls, password=PASSWORD)
        q = sub.register(query)
        follower = Subscriber(sub, q)
        th, parts, arrive, err = follower.thread, follower.parts, follower.arrive, follower.errors
        cmd = ["ingest", "--user", USER, "--level", LEVEL, "--labelled", "--finish"]
        if pstreams:  # first: the advance closing the first instants rides on the group's last piece, which
            # --rate holds back by its predecessors' rows (0.75 s at 40,000/s when the 3 rows came last)
            cmd += ["--input", f"_punctuations={files['punct_' + '_'.join(pstreams)]}"]
        cmd += [x for s in streams for x in ("--input", f"{s}={files[s]}")]
        if rate:
            cmd += ["--rate", str(rate)]
        hooks: list[dict] = []
        la0 = loadavg()
        cpu0 = _tree_cpu(pids)
        t0 = time.monotonic()
        ing = subprocess.Popen(STRATA + cmd[:1] + ["--config", str(self.cfg), "--master", master, "--tls-dir",
                                                  self.tls] + cmd[1:], env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        ing_end: list[float] = []
        threading.Thread(target=lambda: (ing.wait(), ing_end.append(time.monotonic())), daemon=True).start()
        if rate:  # the CLI commands during the paced input
            duration = tuples / rate
            for i, at in enumerate(HOOKS_AT):
                wait = t0 + at * duration - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # a schedule, not a synchronisation: the run goes on meanwhile
                if variant == "switch":
                    action = ("revoke", "grant")[i]
                    if i and hooks[0]["instant"] is None:
                        hooks.append({"cmd": "access grant", "seconds": 0.0, "instant": None, "at": None})
                        continue
                    try:
                        secs, out = self._cli(master, ["access", action], ["--operator", USER, "--user", USER,
                                                                           "--query", q.query_id, "--stream", "Vitals"])
                    except RuntimeError as e:  # the input ended first (a loaded host): the switch stays as it is
                        if "is ended" not in str(e):
                            raise
                        hooks.append({"cmd": f"access {action}", "seconds": None, "instant": None,
                                      "at": round(time.monotonic() - t0, 3), "note": "the query had ended"})
                        continue
                    m = re.search(r"(?:revoked|granted) from instant (\d+)", out)
                    if not m:
                        raise RuntimeError(f"strata access {action}: no instant in {out[-500:]!r}")
                    hooks.append({"cmd": f"access {action}", "seconds": round(secs, 3), "instant": int(m.group(1)),
                                  "at": round(time.monotonic() - t0, 3)})
                else:
                    secs, _ = self._cli(master, ["status"], ["--user", USER])
                    hooks.append({"cmd": "status", "seconds": round(secs, 3), "at": round(time.monotonic() - t0, 3)})
        _, ierr = ing.communicate(timeout=1800)
        t_ingest = ing_end[0] - t0 if ing_end else time.monotonic() - t0
        if ing.returncode != 0:
            raise RuntimeError(f"strata ingest exited {ing.returncode}: {ierr[-1500:]}")
        th.join(timeout=600)  # the query ends once the finished input's last instant is released
        if th.is_alive():
            raise RuntimeError(f"{variant}: the query did not end within 600 s of the input's end")
        cpu = _tree_cpu(pids) - cpu0
        la1 = loadavg()
        ops = sub.client.status()
        timings = {k: float(v) for k, v in ops.timings.items()}
        hist = {k: float(v) for k, v in ops.histograms.items()}
        counters = {k: int(v) for k, v in ops.counters.items()}
        switches = [{"state": w.state, "since": w.since, "blocked": w.blocked, "passed": w.passed}
                    for w in ops.switches]
        sub.close()
        if err:
            raise RuntimeError(f"subscriber failed: {err[0]}")
        last = max(arrive.values()) if arrive else time.monotonic()
        first = min(arrive.values()) if arrive else last
        rows = []
        for t in parts:
            cols = [t.column(i).to_pylist() for i in range(t.num_columns)]
            rows += [tuple(r) for r in zip(*cols)]
        lat_n = hist.get("latency_count", 0.0)
        switch = None
        if variant == "switch" and hooks[0]["instant"] is not None:
            switch = (hooks[0]["instant"], hooks[1]["instant"])
        return {"variant": variant, "rate": rate, "seconds": round(last - t0, 3), "ingest_seconds": round(t_ingest, 3),
                "throughput": round(tuples / (last - t0)), "cpu_seconds": round(cpu, 2),
                "first_result": round(first - t0, 3),
                "throughput_after_first": round((tuples - PER_INSTANT) / (last - first)) if last - first > 0.1 else None,
                "chunk_latency_ms": round(1000 * hist["latency_sum"] / lat_n, 1) if lat_n else None,
                "engine_p50_ms": timings.get("engine_p50_ms"), "chunks": int(timings.get("chunks", 0)),
                "hooks": hooks, "switch": switch, "switches": switches, "counters": counters,
                "out_rows": len(rows), "instants_out": len(arrive), "load": [la0, la1], "rows": rows}


# ---- the measurement ---------------------------------------------------------------------------------
def measure(tuples: int = 500_000, rate: int = 40_000, reps: int = 3, modes=("fast", "paced"),
            save: Path | None = None) -> dict:
    """The runs (see the module's doc); ``save``: the results so far are written there after each mode."""
    res: dict = {"tuples": tuples, "per_instant": PER_INSTANT, "rate": rate, "reps": reps, "level": LEVEL,
                 "workers": 2, "queries": {"agg": Q_AGG, "join": Q_JOIN}, "hooks_at": list(HOOKS_AT),
                 "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": loadavg(),
                 "cpus": os.cpu_count(), "checks": [], "modes": {},
                 "command": f"python -m bench.{Path(sys.argv[0]).stem} " + " ".join(sys.argv[1:])}
    tables = {"Vitals": W.vitals(tuples, PER_INSTANT, 1), "Positions": W.positions(tuples, PER_INSTANT, 2)}
    ref = Reference(tables)
    for m in modes:  # the references of the unswitched variants, before any cluster runs
        for v in (FAST if m == "fast" else PACED):
            if v != "switch":
                ref.rows(v)
    with tempfile.TemporaryDirectory(prefix="strata-access-") as tmp:
        d = Path(tmp)
        files: dict[str, Path] = {}
        for s, t in tables.items():
            files[s] = d / f"{s.lower()}.csv"
            pcsv.write_csv(t, files[s])
        for ps in (("Vitals",), ("Vitals", "Positions")):
            files["punct_" + "_".join(ps)] = _write_punct(d / f"punct_{'_'.join(ps)}.csv", policy_rows(ps))
        with Cluster(d) as cl:
            res["up_seconds"] = cl.up["seconds"]
            for m in modes:
                variants = FAST if m == "fast" else PACED
                runs: dict[str, list[dict]] = {v: [] for v in variants}
                for rep in range(reps + 1):  # round 0 warms up (JIT, first plans): checked, not counted
                    for v in (variants if rep % 2 == 0 else tuple(reversed(variants))):
                        r = run_checked(cl, ref, v, files, rate if m == "paced" else None, tuples, f"{m} {v} rep {rep}",
                                        res["checks"])
                        if rep:
                            runs[v].append(r)
                res["modes"][m] = summarize(runs, m)
                res["modes"][m].update(tuples=tuples, rate=rate, reps=reps)
                if save is not None:
                    save.write_text(json.dumps(dict(res, finished="(partial)", load_end=loadavg()), indent=1,
                                               default=str))
    res["load_end"] = loadavg()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return res


def merge(results: list[dict]) -> dict:
    """Several runs' results (e.g. ``--modes fast`` and ``--modes paced`` run apart) as one: each mode from
    the last file that has it, with that file's sizes, rate and checks."""
    results = sorted(results, key=lambda r: r["started"])
    source: dict[str, dict] = {}
    for r in results:
        for m in r["modes"]:
            source[m] = r
    first = min(source.values(), key=lambda r: r["started"])
    last = max(source.values(), key=lambda r: r["started"])
    out = dict(first, modes={}, checks=[], finished=last["finished"], load_end=last["load_end"],
               command=" and ".join(dict.fromkeys(r.get("command", "python -m bench.access --cluster")
                                                  for r in sorted(source.values(), key=lambda r: r["started"]))))
    for m, r in source.items():
        out["modes"][m] = dict(r["modes"][m], tuples=r["modes"][m].get("tuples", r["tuples"]),
                               rate=r["modes"][m].get("rate", r["rate"]), reps=r["reps"])
        out["checks"] += [c for c in r["checks"] if c.split()[0] == m]
    return out


def run_checked(cl: Cluster, ref: Reference, v: str, files, rate, tuples, tag: str, checks: list) -> dict:
    r = cl.run(v, files, rate, tuples)
    rows = r.pop("rows")
    checks.append(check(ref, v, rows, r["switch"], tag))
    sw = f", switch off over instants [{r['switch'][0]}, {r['switch'][1]})" if r["switch"] else ""
    _log(f"{tag}: {r['seconds']:.2f} s ({r['throughput']:,}/s; first result after {r['first_result']:.2f} s, "
         f"{r['throughput_after_first'] or 0:,}/s after it), ingest {r['ingest_seconds']:.2f} s, CPU "
         f"{r['cpu_seconds']:.1f} s, chunk latency {r['chunk_latency_ms']} ms, engine p50 {r['engine_p50_ms']} ms, "
         f"{r['out_rows']:,} rows{sw}, load {r['load'][0][0]}-{r['load'][1][0]}")
    return r


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[dict]], mode: str) -> dict:
    base_of = {"policy": "plain", "switch": "plain", "join/shielded": "join", "plain": "plain", "join": "join"}
    out: dict = {"runs": runs, "variants": {}}
    keys = ("seconds", "throughput", "throughput_after_first", "first_result", "cpu_seconds", "chunk_latency_ms",
            "engine_p50_ms", "ingest_seconds")
    for v, rs in runs.items():
        out["variants"][v] = {k: _med(r[k] for r in rs) for k in keys}
        out["variants"][v]["out_rows"] = _med(r["out_rows"] for r in rs)
        out["variants"][v]["load"] = [min(r["load"][0][0] for r in rs), max(r["load"][1][0] for r in rs)]
        if v == "switch":
            out["variants"][v]["switch"] = [r["switch"] for r in rs]
            out["variants"][v]["blocked"] = [r["switches"][0]["blocked"] if r["switches"] else None for r in rs]
    for v, x in out["variants"].items():
        b = out["variants"][base_of[v]]
        for k in ("throughput", "throughput_after_first", "cpu_seconds", "chunk_latency_ms", "seconds"):
            x[f"{k}_vs"] = (x[k] / b[k] - 1) * 100 if x[k] is not None and b[k] else None
        # the same ratio run by run (each run against its round's base), then the median: a round's runs
        # follow each other, so the load they share cancels out more than in the ratio of medians
        for k in ("throughput", "throughput_after_first", "cpu_seconds", "chunk_latency_ms"):
            pr = [a[k] / c[k] for a, c in zip(runs[v], runs[base_of[v]]) if a[k] is not None and c[k]]
            x[f"{k}_paired"] = (statistics.median(pr) - 1) * 100 if pr else None
    return out


# ---- the report ----------------------------------------------------------------------------------------
HEADING = "## End to end on a cluster (the user's path)"


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1f} %"


def _n(x, fmt="{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(r: dict) -> str:
    n_of = {m: x.get("tuples", r["tuples"]) for m, x in r["modes"].items()}
    L = [HEADING, "",
         f"Generated by `{r.get('command', 'python -m bench.access --cluster')}` ({r['started']} - {r['finished']}; "
         f"the page by `python -m bench.access --cluster --write`, or `--from-json` of several runs' `--json`): "
         f"`strata up --levels S --workers 2` (defaults, mutual TLS), a fresh master per run on its warm workers, "
         f"the Python API subscribing, `strata ingest --labelled --finish` of battlefield tuples ("
         f"{r['per_instant']:,} an instant, U/C/S/TS a quarter each: the client leaves TS out), jane (every "
         f"role) at S; the variants of a mode interleaved (order reversed every round), an unmeasured round first, "
         f"medians of the measured rounds. Load average "
         f"(1/5/15 min) {' / '.join(f'{x:.1f}' for x in r['load_start'])} at the start, "
         f"{' / '.join(f'{x:.1f}' for x in r['load_end'])} at the end, per variant in the tables "
         f"(1-minute, lowest at a start to highest at an end): a shared {r['cpus']}-core VM with other engineers' "
         "tests and benchmarks running, so the figures are noisy and pessimistic, and differences of a few per "
         "cent are within the run-to-run noise. What the variants and columns are: `bench/access_cluster.py`.", ""]
    f = r["modes"].get("fast")
    if f:
        per_k = n_of["fast"] / 1000
        L += [f"**As fast as it goes**, {n_of['fast']:,} tuples per stream and run, medians of "
              f"{f.get('reps', r['reps'])} runs each (throughput = input tuples / (`strata ingest` launched → last result), "
              "start-up excluded; CPU = the master's and both workers' process trees during the run; chunk "
              "latency = the master's mean time from a chunk cut to its results back):", "",
              "| variant | query | tuples/s | vs plan without (paired) | ingest command s | first / last result s | "
              "cluster CPU s | vs plan without (paired) | CPU ms per 1000 tuples | chunk latency ms "
              "| engine p50 ms | result rows | load |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for v, x in f["variants"].items():
            q = "join" if v.startswith("join") else "agg"
            L.append(f"| {v} | {q} | {_n(x['throughput'])} | "
                     f"{_pct(x['throughput_vs']) + ' (' + _pct(x['throughput_paired']) + ')' if v not in ('plain', 'join') else ''} | "
                     f"{_n(x['ingest_seconds'], '{:.2f}')} | {_n(x['first_result'], '{:.2f}')} / {_n(x['seconds'], '{:.2f}')} | "
                     f"{_n(x['cpu_seconds'], '{:.2f}')} | "
                     f"{_pct(x['cpu_seconds_vs']) + ' (' + _pct(x['cpu_seconds_paired']) + ')' if v not in ('plain', 'join') else ''} | "
                     f"{_n(x['cpu_seconds'] and 1000 * x['cpu_seconds'] / per_k, '{:.2f}')} | "
                     f"{_n(x['chunk_latency_ms'], '{:.0f}')} | {_n(x['engine_p50_ms'], '{:.0f}')} | "
                     f"{_n(x['out_rows'])} | {x['load'][0]}-{x['load'][1]} |")
        L.append("")
    p = r["modes"].get("paced")
    if p:
        sw = p["variants"].get("switch", {})
        spans = ", ".join("none (revoked after the input's end)" if x is None else
                          f"[{x[0]}, {'the end' if x[1] is None else x[1]})" for x in sw.get("switch", []))
        n, rate = n_of["paced"], p.get("rate", r["rate"])
        L += [f"**Paced**, {n:,} tuples per run, medians of {p.get('reps', r['reps'])} runs each (`strata ingest --rate {rate:,}`: {rate:,} tuples/s of the "
              f"{3 * n // 4:,} sent, {3 * n / 4 / rate:.1f} s of input; at "
              f"{r['hooks_at'][0] * n / rate:.1f} s and {r['hooks_at'][1] * n / rate:.1f} s after `strata "
              f"ingest` is launched `switch` runs `strata access revoke`, then `grant` (each CLI command takes 1-3 s "
              f"here), the others `strata status`; the switch was off over instants {spans} of "
              f"{n // r['per_instant']}, tuples blocked {sw.get('blocked')}):", "",
              "| variant | last result after s | cluster CPU s | vs plain (paired) | chunk latency ms | vs plain (paired) | "
              "engine p50 ms | result rows | load |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for v, x in p["variants"].items():
            L.append(f"| {v} | {_n(x['seconds'], '{:.2f}')} | {_n(x['cpu_seconds'], '{:.1f}')} | "
                     f"{_pct(x['cpu_seconds_vs']) + ' (' + _pct(x['cpu_seconds_paired']) + ')' if v != 'plain' else ''} | "
                     f"{_n(x['chunk_latency_ms'], '{:.0f}')} | "
                     f"{_pct(x['chunk_latency_ms_vs']) + ' (' + _pct(x['chunk_latency_ms_paired']) + ')' if v != 'plain' else ''} | "
                     f"{_n(x['engine_p50_ms'], '{:.0f}')} | {_n(x['out_rows'])} | {x['load'][0]}-{x['load'][1]} |")
        L.append("")
    L += papers(r)
    L += [f"Correctness: every run's whole output (the warm-up round's too: {len(r['checks'])} runs) equals the "
          "reference (tests/reference/access.py) on every instant.", ""]
    return "\n".join(L)


def papers(r: dict) -> list[str]:
    """The figures beside the papers' (paper 003 §6.1: the Security Shield's 1.31-4 ms per 1000 tuples;
    paper 004 §6.2: switches +0.5 % execution time)."""
    per_k = r["modes"].get("fast", {}).get("tuples", r["tuples"]) / 1000
    out = ["**Against the papers, end to end.**"]
    f = r["modes"].get("fast", {}).get("variants", {})
    if "policy" in f and "plain" in f:
        d = 1000 * (f["policy"]["cpu_seconds"] - f["plain"]["cpu_seconds"]) / per_k
        out.append(f"Paper 003 §6.1 puts the Security Shield at 1.31-4 ms per 1000 tuples (CAPE, one CPU); here one "
                   f"policy changes the whole cluster's CPU by {d:+.2f} ms per 1000 input tuples (median CPU, "
                   f"{_pct(f['policy']['cpu_seconds_paired'])} run by run) and the throughput by "
                   f"{_pct(f['policy']['throughput_vs'])} ({_pct(f['policy']['throughput_paired'])} run by run), "
                   "with half the tuples hidden from the query. The shield's own cost (the master-path figure "
                   "above) is paid on the master for every input tuple; what it saves after it (fewer tuples cut, "
                   "encoded, sent and windowed) is small for ROWS 100 windows, whose chunks the master already "
                   "prunes to the last 100 tuples an instant: the cluster CPU figure is the net of the two.")
    if "join/shielded" in f and "join" in f:
        d = 1000 * (f["join/shielded"]["cpu_seconds"] - f["join"]["cpu_seconds"]) / per_k
        out.append(f"SCJoin (both sides shielded) against the same join without policies: CPU {d:+.2f} ms per 1000 "
                   f"input tuples ({_pct(f['join/shielded']['cpu_seconds_paired'])} run by run), throughput "
                   f"{_pct(f['join/shielded']['throughput_vs'])} ({_pct(f['join/shielded']['throughput_paired'])}), "
                   f"chunk latency {_pct(f['join/shielded']['chunk_latency_ms_vs'])}; its output has "
                   f"{_n(f['join/shielded']['out_rows'])} rows against {_n(f['join']['out_rows'])} (each side's "
                   "ROWS 100 window holds only the granted sids, so more of the window pairs match).")
    p = r["modes"].get("paced", {}).get("variants", {})
    if "switch" in p and "plain" in p:
        out.append(f"Paper 004 §6.2 reports privacy switches adding 0.5 % to the execution time on average; here, "
                   f"paced input (so the execution, launch → last result, is mostly the input's own duration), the "
                   f"run with a switch revoked and granted again changes the execution by "
                   f"{_pct(p['switch']['seconds_vs'])}, chunk latency {_pct(p['switch']['chunk_latency_ms_vs'])} "
                   f"({_pct(p['switch']['chunk_latency_ms_paired'])} run by run) and cluster CPU "
                   f"{_pct(p['switch']['cpu_seconds_vs'])} ({_pct(p['switch']['cpu_seconds_paired'])}): while the "
                   "switch is off the query's part of each chunk is empty, so the workers skip its work (the "
                   "paper's in-network switch), and while it is on its cost is the per-tuple instant comparison "
                   "on the master (the master-path `switch` figure above).")
    if "policy" in p and "plain" in p:
        out.append(f"The policy under the same paced input: chunk latency {_pct(p['policy']['chunk_latency_ms_vs'])}, "
                   f"cluster CPU {_pct(p['policy']['cpu_seconds_vs'])}.")
    rows = ["| mechanism | paper's setting | paper's figure | Strata end to end, this run |", "|---|---|---|---|"]
    if "policy" in f and "plain" in f:
        d = 1000 * (f["policy"]["cpu_seconds"] - f["plain"]["cpu_seconds"]) / per_k
        rows.append(f"| Security Shield, one tuple-level policy | 003 §6.1: CAPE (Java), one role, ~half the tuples "
                    f"filtered | 1.31-4 ms per 1000 tuples | {d:+.2f} ms cluster CPU per 1000 input tuples "
                    f"({_pct(f['policy']['cpu_seconds_paired'])}); throughput {_pct(f['policy']['throughput_vs'])} |")
    if "join/shielded" in f and "join" in f:
        d = 1000 * (f["join/shielded"]["cpu_seconds"] - f["join"]["cpu_seconds"]) / per_k
        rows.append(f"| SCJoin (both sides shielded) against the join without policies | 003 §6.3: ROWS 100 windows, "
                    f"its join strategies against each other | none against a plain join (Fig. 16: per-tuple times of "
                    f"the strategies; §6.2, Fig. 15a: the shield's overhead \"low\") | {d:+.2f} ms CPU per 1000 input "
                    f"tuples ({_pct(f['join/shielded']['cpu_seconds_paired'])}); "
                    f"throughput {_pct(f['join/shielded']['throughput_vs'])} |")
    if "switch" in p and "plain" in p:
        rows.append(f"| privacy switch revoked, then granted | 004 §6.2: simulated shared networks | +0.5 % execution "
                    f"time | execution {_pct(p['switch']['seconds_vs'])}; chunk latency "
                    f"{_pct(p['switch']['chunk_latency_ms_vs'])}; CPU {_pct(p['switch']['cpu_seconds_vs'])} |")
    return (rows + [""] if len(rows) > 2 else []) + [" ".join(out), ""]
