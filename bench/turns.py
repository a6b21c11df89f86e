"""The trusted worker's MLS scheduler against plain round robin: the dissertation's Table 9.8 (§9.3.3, Exp. 5;
issue 33).  ``python -m bench.turns [--write]`` or ``python -m bench.run --only turns``;
docs/benchmarks/turns.md.

The dissertation ran four queries, one at each of TS, S, C and U, each over its own copy of Vitals holding
only unclassified tuples, at 40,000 tuples/s, and compared the execution time under the regular round-robin
scheduler with the fixed time slot scheduler (0.56-1.81 % more).  Here, on the user's path:

* ``strata up --levels U,C,S,TS --workers 2 --mode trusted`` with ``[cluster] scheduler`` set to each
  policy in turn (``round_robin``, ``fixed_slot``; ``shared`` as the baseline without turns), otherwise the
  defaults (0.25 s slots: a round of four levels is 1 s, the dissertation's heartbeat);
* at each level a session of jane (cleared TS) registers ``SELECT sid, weight FROM Vitals [ROWS 100 level in
  {...}]`` with the level set of the dissertation's query at that level, and follows it (the Python API);
* each level's producer (``strata ingest --labelled --finish --rate R/4``, four launched together) sends the
  same U-only Vitals file: ``R`` = 40,000 tuples/s in all, as the dissertation's rate;
* **execution time** = the ingests launched → the last result of the last level; CPU of the cluster's
  processes over the run; each level's first and last result.

Per policy: one cluster (``strata up``), an unmeasured warm-up run, ``runs`` measured runs (each on a fresh
master: ``renew_master`` restarts the trusted master whole), ``strata down``; the policies' blocks in turn,
reversed every round.  Every run's output is checked against the reference (tests/reference/evaluator.py) at
sampled instants of each level (bench/check.py ``check_sample``: ROWS 100 within an instant of 4,000 tuples)
and its row count against the input's instants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import workloads as W  # noqa: E402
from bench.check import BenchCheckFailed, check_sample  # noqa: E402
from bench.userpath import PASSWORD, STRATA, Subscriber, TreeCpu, _env, setup, up_cluster  # noqa: E402
from strata.api import connect  # noqa: E402
from strata.deploy.local import renew_master  # noqa: E402
from strata.examples import BATTLEFIELD_TOML  # noqa: E402
from strata.worker.load import tree_cpu_times  # noqa: E402

LEVELS = ("U", "C", "S", "TS")
USER = "jane"
#: the dissertation's Exp. 5 queries (Q1-Q4), one at each level, over one Vitals stream here
QUERIES = {"TS": "SELECT sid, weight FROM Vitals [ROWS 100 level in {TS, S, C, U}]",
           "S": "SELECT sid, weight FROM Vitals [ROWS 100 level in {S, C, U}]",
           "C": "SELECT sid, weight FROM Vitals [ROWS 100 level in {C, U}]",
           "U": "SELECT sid, weight FROM Vitals [ROWS 100 level in {U}]"}
POLICIES = ("shared", "round_robin", "fixed_slot")
PER_INSTANT = 4_000
RATE = 40_000
#: Table 9.8 (copied: nothing reads the dissertation at run time): tuples -> (round robin ms, fixed slot ms, %)
PAPER_9_8 = {"1M": (26928, 27424, 1.807), "2M": (51853, 52318, 0.889), "4M": (101966, 102541, 0.560)}


def _log(msg: str) -> None:
    print(f"[bench.turns] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def u_only(n: int) -> pa.Table:
    """Vitals of bench/workloads.py with every tuple unclassified (the dissertation's input of Exp. 5)."""
    t = W.vitals(n, PER_INSTANT)
    return t.set_column(t.schema.get_field_index("level"), "level", pa.array(["U"] * n))


class Cluster:
    """``strata up --mode trusted`` of the four levels with ``[cluster] scheduler = policy``."""

    def __init__(self, d: Path, policy: str):
        self.d, self.policy = d, policy
        d.mkdir(parents=True, exist_ok=True)
        self.cfg = setup(d)
        if policy != "shared":
            self.cfg.write_text(self.cfg.read_text() + f'\n[cluster]\nscheduler = "{policy}"\n')
        self.state = d / "up-state"
        self._up = up_cluster(self.cfg, self.state, ",".join(LEVELS), 2, "trusted")

    def __enter__(self):
        la = loadavg()
        self.up = dict(self._up.__enter__())
        self.up.pop("stderr", None)
        self.up["load"] = la
        self.tls = json.loads((self.state / "cluster.json").read_text())["tls_dir"]
        _log(f"{self.policy}: strata up {self.up['seconds']:.1f} s")
        return self

    def __exit__(self, *exc):
        return self._up.__exit__(*exc)

    def pids(self) -> list[int]:
        procs = json.loads((self.state / "cluster.json").read_text())["processes"]
        return [p["pid"] for p in procs if p["role"] in ("master", "worker")]

    def run(self, csv: Path, tuples: int) -> dict:
        addr, _, _ = renew_master(self.state, "TS")  # the trusted master restarts whole: every level fresh
        sessions, subs = {}, {}
        for lv in LEVELS:
            s = connect(addr, USER, lv, tls_dir=self.tls, password=PASSWORD)
            q = s.register_all([QUERIES[lv]])[0]
            sessions[lv], subs[lv] = s, Subscriber(s, q.query_id)
        pids = self.pids()
        cpu0 = sum(sum(tree_cpu_times(p).values()) for p in pids)
        la0 = loadavg()
        t0 = time.monotonic()
        procs = {}
        for lv in LEVELS:
            procs[lv] = subprocess.Popen(STRATA + ["ingest", "--config", str(self.cfg), "--master", addr, "--tls-dir",
                                                   self.tls, "--user", USER, "--level", lv, "--labelled", "--finish",
                                                   "--rate", str(RATE / len(LEVELS)), "--input", f"Vitals={csv}"],
                                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        icpu = [TreeCpu(p.pid) for p in procs.values()]
        for lv, p in procs.items():
            _, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"strata ingest at {lv} exited {p.returncode}: {err[-1500:]}")
        ingest_cpu = sum(c.stop() for c in icpu)
        for lv, sub in subs.items():
            sub.thread.join(timeout=600)
            if sub.thread.is_alive() or sub.errors:
                raise RuntimeError(f"{self.policy}: the query at {lv} did not end: {sub.errors[:1]}")
        cpu = sum(sum(tree_cpu_times(p).values()) for p in pids) - cpu0
        last = {lv: max(s.arrive.values()) - t0 for lv, s in subs.items()}
        first = {lv: min(s.arrive.values()) - t0 for lv, s in subs.items()}
        latency = {}
        for lv, s in sessions.items():
            hist = {k: float(v) for k, v in s.client.status().histograms.items()}
            n = hist.get("latency_count", 0.0)
            latency[lv] = round(1000 * hist["latency_sum"] / n, 1) if n else None
            s.close()
        seconds = max(last.values())
        return {"policy": self.policy, "seconds": round(seconds, 3), "throughput": round(len(LEVELS) * tuples / seconds),
                "level_last": {lv: round(x, 3) for lv, x in last.items()},
                "level_first": {lv: round(x, 3) for lv, x in first.items()}, "cpu_seconds": round(cpu, 2),
                "ingest_cpu_seconds": round(ingest_cpu, 2), "chunk_latency_ms": latency, "load": [la0, loadavg()],
                "rows": {lv: pa.concat_tables(s.parts) if s.parts else None for lv, s in subs.items()}}


def check(run: dict, data: pa.Table, checks: list, tag: str) -> None:
    """Each level's output: one instant of rows per input instant, and the reference at sampled instants."""
    instants = len(pc.unique(data.column("ts")))
    for lv, rows in run.pop("rows").items():
        got = 0 if rows is None else len(pc.unique(rows.column("ts")))
        if got != instants:
            raise BenchCheckFailed(f"{tag}: {lv} output {got} instants of {instants}")
        taus = check_sample(BATTLEFIELD_TOML, lv, QUERIES[lv], {"Vitals": data}, rows, k=3)
        checks.append(f"{tag} {lv}: {rows.num_rows:,} rows over {instants} instants; the reference agrees at {taus}")


def measure(tuples: int, rounds: int, runs: int, policies=POLICIES) -> dict:
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": loadavg(),
           "tuples_per_level": tuples, "rate": RATE, "per_instant": PER_INSTANT, "queries": QUERIES,
           "cpus": os.cpu_count(), "command": "python -m bench.turns " + " ".join(sys.argv[1:])}
    out: dict[str, list[dict]] = {p: [] for p in policies}
    checks: list[str] = []
    with tempfile.TemporaryDirectory(prefix="strata-bench-turns-") as tmp:
        d = Path(tmp)
        data = u_only(tuples)
        csv = d / "vitals_u.csv"
        pcsv.write_csv(data, csv)
        for rnd in range(rounds):
            for policy in (policies if rnd % 2 == 0 else tuple(reversed(policies))):
                with Cluster(d / f"{policy}-{rnd}", policy) as cl:
                    check(cl.run(csv, tuples), data, checks, f"{policy} round {rnd} warm-up")
                    for k in range(runs):
                        r = cl.run(csv, tuples)
                        check(r, data, checks, f"{policy} round {rnd} run {k}")
                        r["round"] = rnd
                        out[policy].append(r)
                        _log(f"{policy} round {rnd} run {k}: {r['seconds']:.2f} s, CPU {r['cpu_seconds']:.1f} s, "
                             f"last {r['level_last']}, chunk latency {r['chunk_latency_ms']} ms, load {r['load']}")
    res.update(runs=out, checks=checks, summary=summarize(out), load_end=loadavg(),
               finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return res


def summarize(out: dict[str, list[dict]]) -> dict:
    s = {}
    for p, rs in out.items():
        if rs:
            s[p] = {"seconds": statistics.median(r["seconds"] for r in rs),
                    "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs),
                    "chunk_latency_ms": {lv: statistics.median(r["chunk_latency_ms"][lv] or 0 for r in rs) for lv in LEVELS},
                    "level_last": {lv: statistics.median(r["level_last"][lv] for r in rs) for lv in LEVELS},
                    "runs": len(rs), "seconds_all": [r["seconds"] for r in rs]}
    if "round_robin" in s and "fixed_slot" in s:
        rr, fx = s["round_robin"]["seconds"], s["fixed_slot"]["seconds"]
        s["fixed_slot"]["overhead_vs_round_robin_pct"] = round(100 * (fx - rr) / rr, 2)
    if "shared" in s:
        for p in ("round_robin", "fixed_slot"):
            if p in s:
                s[p]["overhead_vs_shared_pct"] = round(100 * (s[p]["seconds"] - s["shared"]["seconds"])
                                                       / s["shared"]["seconds"], 2)
    return s


def render(r: dict) -> str:
    s = r["summary"]
    lines = [f"Measured {r['started']} - {r['finished']} on {r['cpus']} CPUs (load {r['load_start']} -> {r['load_end']}): "
             f"`{r['command']}`; {r['tuples_per_level']:,} U tuples per level ({PER_INSTANT:,} an instant), four "
             f"levels, {r['rate']:,} tuples/s in all; medians of {next(iter(s.values()))['runs']} runs.", "",
             "| scheduler | execution (s) | vs round robin | vs shared | cluster CPU (s) | chunk latency U / C / S / TS (ms) | last result U / C / S / TS (s) |",
             "|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        if p not in s:
            continue
        x = s[p]
        lat = " / ".join(f"{x['chunk_latency_ms'][lv]:.0f}" for lv in LEVELS)
        last = " / ".join(f"{x['level_last'][lv]:.2f}" for lv in LEVELS)
        vs_rr = f"{x['overhead_vs_round_robin_pct']:+.2f} %" if "overhead_vs_round_robin_pct" in x else "—"
        vs_sh = f"{x['overhead_vs_shared_pct']:+.2f} %" if "overhead_vs_shared_pct" in x else "—"
        lines.append(f"| `{p}` | {x['seconds']:.2f} | {vs_rr} | {vs_sh} | {x['cpu_seconds']:.1f} | {lat} | {last} |")
    lines += ["", "The dissertation's Table 9.8 (input 40,000 tuples/s): execution time (ms) under the regular "
              "(round robin) and the MLS (fixed time slot) scheduler:", "",
              "| tuples | round robin (ms) | fixed slot (ms) | overhead |", "|---|---|---|---|"]
    lines += [f"| {k} | {a:,} | {b:,} | {c:.3f} % |" for k, (a, b, c) in PAPER_9_8.items()]
    lines += ["", "Checks: " + "; ".join(r["checks"][:4]) + f" ... ({len(r['checks'])} in all)"]
    return "\n".join(lines)


MARK = "<!-- bench/turns.py: the measured part below is regenerated -->"


def write_doc(text: str, out: Path = ROOT / "docs" / "benchmarks" / "turns.md") -> None:
    head = out.read_text().split(MARK)[0] if out.exists() else "# The trusted worker's turns (Table 9.8)\n\n"
    out.write_text(head.rstrip() + "\n\n" + MARK + "\n\n" + text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.turns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuples", type=int, default=100_000, help="U tuples per level (each level's producer sends them)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2, help="measured runs per cluster")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks/turns.md and turns.json")
    a = ap.parse_args(argv)
    r = measure(a.tuples, a.rounds, a.runs, tuple(a.policies.split(",")))
    text = render(r)
    print(text)
    if a.write:
        (ROOT / "docs" / "benchmarks" / "turns.json").write_text(json.dumps(r, indent=1, default=str))
        write_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
