"""The user's path, measured as a user runs it (``python -m bench.run --only userpath``).

Nothing here is injected or warmed up unmeasured: every figure is the wall time of CLI
commands run as subprocesses with default settings, exactly as typed by a user:

* ``strata replay --workers 2 --chunk-seconds 1`` (an embedded cluster per run) of battlefield
  CSVs (Vitals ``ts,level,sid,bp,pr,weight``, 20,000 tuples per instant, four levels, 1/4
  each) of 1 M and 20 k tuples, ``SELECT AVG(bp) FROM Vitals [ROWS 100]`` at S (the S
  master's shepherd drops the TS quarter).  Throughput = (1 M − 20 k tuples) / (T_1M − T_20k):
  what one more tuple costs, start-up excluded; the start-up (cluster ready, first worker
  ready) is reported separately, from the run's own ``--timings`` file.
* The fast path for repeated runs: ``strata up`` once, then ``strata replay --cluster DIR``
  per run (a fresh master, the workers' Spark sessions already warm).
* ``strata ingest --finish`` into a cluster of ``strata up`` with ``strata query`` following
  the query: time from the ingest's start to the end of the query's stream.
* ``./dev run`` (the demo): total time, the cluster's start-up and the processing after it.

CPU is summed over the whole process tree of each command (JVMs included; sampled every
0.1 s, each process's last sample kept, so a process that ends between samples loses at
most 0.1 s).  Every output is checked against the reference on every instant: the written
CSV of the AVG query against DuckDB's window SQL (all instants; bench/check.py) and the
Python reference evaluator on sampled instants; the demo's four outputs against the Python
reference on every instant.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from bench import workloads as W
from bench.check import check_sample, compare_avg, duckdb_avg_rows
from strata.config import load_config, parse_config
from strata.deploy.demo import QUERIES
from strata.examples import BATTLEFIELD_TOML
from strata.users import ROLES, UserStore
from strata.worker.load import tree_cpu_times

ROOT = Path(__file__).resolve().parents[1]
QUERY = "SELECT AVG(bp) FROM Vitals [ROWS 100]"
LEVEL = "S"
VISIBLE = ["U", "C", "S"]
PER_INSTANT = 20_000
PASSWORD = "userpath bench passphrase"
STRATA = [sys.executable, "-m", "strata"]


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def write_inputs(d: Path, sizes: list[int]) -> dict[int, Path]:
    """The battlefield CSVs a user would have (bench/workloads.vitals, 20,000 tuples per instant)."""
    out = {}
    for n in sizes:
        path = d / f"vitals_{n}.csv"
        pcsv.write_csv(W.vitals(n, PER_INSTANT), path)
        out[n] = path
    return out


def setup(d: Path) -> Path:
    """A config and a user (cleared TS, every role: she replays and follows her queries)."""
    cfg = d / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    c = load_config(cfg)
    UserStore(c.users_path, c.lattice).add("jane", "TS", PASSWORD, replace=True, roles=ROLES)
    return cfg


def _tree(pid: int) -> dict[int, float]:
    return tree_cpu_times(pid)


class TreeCpu:
    """CPU seconds of a process and all its descendants, sampled until it ends."""

    def __init__(self, pid: int, every: float = 0.1):
        self.pid, self.every = pid, every
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        for pid, t in tree_cpu_times(self.pid).items():
            self.last[pid] = max(t, self.last.get(pid, 0.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return sum(self.last.values())


def run_cmd(cmd: list[str], env: dict, cwd: Path | None = None, stdout=subprocess.DEVNULL,
            also: list[int] = ()) -> dict:
    """Run a CLI command; wall seconds, CPU seconds of its process tree (plus the trees of the
    processes ``also``, e.g. a running cluster's workers, while it runs), exit status."""
    base = {pid: sum(_tree(pid).values()) for pid in also}
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    cpu = [TreeCpu(p.pid)] + [TreeCpu(pid) for pid in also]
    _, err = p.communicate()
    wall = time.monotonic() - t0
    c = sum(x.stop() for x in cpu) - sum(base.values())
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[2:5]))}... exited {p.returncode}: {err[-2000:]}")
    return {"seconds": round(wall, 3), "cpu_seconds": round(c, 2), "stderr": err}


def check_avg_output(csv_path: Path, data: pa.Table) -> str:
    """The written CSV against DuckDB on every instant, and the Python reference on sampled ones."""
    got = pcsv.read_csv(csv_path)
    got = pa.table({"ts": got.column(0).cast(pa.int64()), "level": got.column(1).cast(pa.string()),
                    "avg": got.column(2).cast(pa.float64())})
    exp, _ = duckdb_avg_rows(data, "bp", 100, VISIBLE, ["U", "C", "S", "TS"])
    compare_avg(got, exp)
    taus = check_sample(BATTLEFIELD_TOML, LEVEL, QUERY, {"Vitals": data}, got, k=3)
    return f"{csv_path.name}: DuckDB agrees on all {exp.num_rows} instants, the reference at {taus}"


def _env() -> dict:
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD}
    env.pop("STRATA_CPU_OVERRIDE", None)
    return env


def replay_once(cfg: Path, d: Path, csv: Path, tag: str, extra: list[str] | None = None,
                also: list[int] = (), query: str = QUERY, level: str = LEVEL) -> dict:
    out, tfile = d / f"out_{tag}.csv", d / f"timings_{tag}.json"
    cmd = STRATA + ["replay", "--config", str(cfg), "--user", "jane", "--level", level, "--query", query,
                    "--input", f"Vitals={csv}", "--output", str(out), "--timings", str(tfile)] + (
        extra if extra is not None else ["--workers", "2", "--chunk-seconds", "1"])
    la = round(os.getloadavg()[0], 1)
    r = run_cmd(cmd, _env(), also=also)
    r.pop("stderr")
    r.update(load=la, output=str(out), timings=json.loads(tfile.read_text()) if tfile.exists() else {})
    return r


def _throughput(big: int, small: int, t_big: float, t_small: float) -> float | None:
    dt = t_big - t_small
    return round((big - small) / dt) if dt > 0 else None


def sec_replay(d: Path, cfg: Path, files: dict[int, Path], data: dict[int, pa.Table], reps: int) -> dict:
    """``strata replay`` with an embedded cluster per run, small and large runs interleaved."""
    big, small = max(files), min(files)
    runs, checks = [], []
    for rep in range(reps):
        for n in ((small, big) if rep % 2 == 0 else (big, small)):
            r = replay_once(cfg, d, files[n], f"replay_{n}_{rep}")
            r.update(tuples=n, rep=rep)
            checks.append(check_avg_output(Path(r["output"]), data[n]))
            t = r["timings"]
            _log(f"replay {n:,} tuples: {r['seconds']:.1f} s (start-up {t.get('start', 0):.1f} s: first worker "
                 f"{(t.get('start_split') or {}).get('first')} s; processing {t.get('process', 0):.2f} s), "
                 f"CPU {r['cpu_seconds']:.1f} s, load {r['load']}")
            runs.append(r)
    return _summary(runs, checks, big, small)


def _summary(runs: list[dict], checks: list[str], big: int, small: int) -> dict:
    def med(n, key):
        xs = [r[key] for r in runs if r["tuples"] == n]
        return float(np.median(xs)) if xs else None

    def med_t(n, key):
        xs = [r["timings"].get(key) for r in runs if r["tuples"] == n and r["timings"].get(key) is not None]
        return float(np.median(xs)) if xs else None

    def after_start(n):
        """Median of T − start-up: what the run took once its cluster was ready.  The start-up of
        an embedded cluster varies by ±1 s between runs on a shared host, as much as the 1 M
        run's extra work; subtracting each run's own start-up takes that noise out."""
        xs = [r["seconds"] - r["timings"]["start"] for r in runs
              if r["tuples"] == n and r["timings"].get("start") is not None]
        return float(np.median(xs)) if xs else None

    pairs = []
    for rep in sorted({r["rep"] for r in runs}):
        b = next((r for r in runs if r["rep"] == rep and r["tuples"] == big), None)
        s = next((r for r in runs if r["rep"] == rep and r["tuples"] == small), None)
        if b and s:
            pairs.append(_throughput(big, small, b["seconds"], s["seconds"]))
    return {"runs": runs, "checks": checks, "big": big, "small": small,
            "throughput": _throughput(big, small, med(big, "seconds"), med(small, "seconds")),
            "throughput_after_start": (_throughput(big, small, after_start(big), after_start(small))
                                       if after_start(big) is not None and after_start(small) is not None else None),
            "after_start": {"big": after_start(big), "small": after_start(small)},
            "pair_throughputs": pairs,
            "seconds": {"big": med(big, "seconds"), "small": med(small, "seconds")},
            "cpu_seconds": {"big": med(big, "cpu_seconds"), "small": med(small, "cpu_seconds")},
            "start": med_t(small, "start"), "process": {"big": med_t(big, "process"), "small": med_t(small, "process")},
            "load": [r["load"] for r in runs]}


@contextlib.contextmanager
def up_cluster(cfg: Path, state: Path, level: str = LEVEL, workers: int = 2, mode: str | None = None):
    """``strata up --levels level --workers workers [--mode mode]`` into ``state`` for the block (yields its
    :func:`run_cmd` result; ``level``: one level or several, comma-separated), ``strata down`` after it."""
    up = run_cmd(STRATA + ["up", "--config", str(cfg), "--levels", level, "--workers", str(workers), "--state-dir",
                           str(state)] + (["--mode", mode] if mode else []), _env(), stdout=subprocess.PIPE)
    try:
        yield up
    finally:
        subprocess.run(STRATA + ["down", "--state-dir", str(state)], env=_env(), capture_output=True)


class Subscriber:
    """One query's results followed by a thread through the Python API (``session.subscribe``): ``arrive``
    (instant -> ``clock()`` when its rows came), ``parts`` (the tables, in order), ``errors`` (what ended
    the stream early, if anything); ``thread`` ends with the query."""

    def __init__(self, session, query_id: str, clock=time.monotonic):
        self.arrive: dict[int, float] = {}
        self.parts: list[pa.Table] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._follow, args=(session, query_id, clock), daemon=True)
        self.thread.start()

    def _follow(self, session, query_id: str, clock) -> None:
        try:
            for _qid, ts, table in session.subscribe([query_id]):
                self.arrive[ts] = clock()
                self.parts.append(table)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.errors.append(e)


def worker_pids(state: Path) -> list[int]:
    """The pids of the workers of the ``strata up`` cluster in ``state`` (their CPU is the run's too)."""
    return [p["pid"] for p in json.loads((state / "cluster.json").read_text())["processes"] if p["role"] == "worker"]


def sec_cluster(d: Path, cfg: Path, files: dict[int, Path], data: dict[int, pa.Table], reps: int) -> dict:
    """``strata up`` once, then ``strata replay --cluster`` per run (fresh master, warm workers)."""
    big, small = max(files), min(files)
    state = d / "up-state"
    runs, checks = [], []
    with up_cluster(cfg, state) as up:
        for rep in range(reps):
            for n in ((small, big) if rep % 2 == 0 else (big, small)):
                r = replay_once(cfg, d, files[n], f"cluster_{n}_{rep}", ["--cluster", str(state)],
                                also=worker_pids(state))
                r.update(tuples=n, rep=rep)
                checks.append(check_avg_output(Path(r["output"]), data[n]))
                _log(f"replay --cluster {n:,} tuples: {r['seconds']:.2f} s (fresh master "
                     f"{r['timings'].get('start', 0):.2f} s, processing {r['timings'].get('process', 0):.2f} s), "
                     f"load {r['load']}")
                runs.append(r)
    out = _summary(runs, checks, big, small)
    out["up_seconds"] = up["seconds"]
    return out


def ingest_once(cfg: Path, d: Path, csv: Path, tag: str) -> dict:
    """``strata up``, ``strata query`` following the query, ``strata ingest --finish``; ``down``."""
    state = d / f"ingest-state-{tag}"
    env = _env()
    la = round(os.getloadavg()[0], 1)
    up = run_cmd(STRATA + ["up", "--config", str(cfg), "--levels", LEVEL, "--workers", "2", "--state-dir",
                           str(state)], env, stdout=subprocess.PIPE)
    up.pop("stderr")
    try:
        rec = json.loads((state / "cluster.json").read_text())
        master = next(p["address"] for p in rec["processes"] if p["role"] == "master")
        env["STRATA_TLS_DIR"] = rec["tls_dir"]
        client = ["--config", str(cfg), "--master", master, "--user", "jane", "--level", LEVEL]
        out = d / f"out_{tag}.csv"
        t0 = time.monotonic()
        with open(out, "w") as f:
            q = subprocess.Popen(STRATA + ["query"] + client + ["--query", QUERY], env=env, stdout=f,
                                 stderr=subprocess.PIPE, text=True)
            cpu = TreeCpu(int(rec["processes"][0]["pid"]))  # the master's tree; the workers below
            wcpu = [TreeCpu(int(p["pid"])) for p in rec["processes"][1:]]
            ing = run_cmd(STRATA + ["ingest"] + client + ["--input", f"Vitals={csv}", "--labelled", "--finish"], env)
            q.wait(timeout=1800)
            wall = time.monotonic() - t0
            c = cpu.stop() + sum(w.stop() for w in wcpu) + ing["cpu_seconds"]
        if q.returncode != 0:
            raise RuntimeError(f"strata query exited {q.returncode}: {q.stderr.read()[-1500:]}")
    finally:
        subprocess.run(STRATA + ["down", "--state-dir", str(state)], env=env, capture_output=True)
    return {"seconds": round(wall, 3), "up_seconds": up["seconds"], "ingest_seconds": ing["seconds"],
            "cpu_seconds": round(c, 2), "load": la, "output": str(out)}


def check_query_output(csv_path: Path, data: pa.Table) -> str:
    """``strata query`` CSV (query,ts,level,avg_bp) as the AVG output."""
    t = pcsv.read_csv(csv_path)
    t = t.drop_columns(["query"]) if "query" in t.column_names else t
    tmp = csv_path.with_suffix(".plain.csv")
    pcsv.write_csv(t, tmp)
    return check_avg_output(tmp, data)


def sec_ingest(d: Path, cfg: Path, files: dict[int, Path], data: dict[int, pa.Table], reps: int) -> dict:
    big, small = max(files), min(files)
    runs, checks = [], []
    for rep in range(reps):
        for n in ((small, big) if rep % 2 == 0 else (big, small)):
            r = ingest_once(cfg, d, files[n], f"ingest_{n}_{rep}")
            r.update(tuples=n, rep=rep, timings={})
            checks.append(check_query_output(Path(r["output"]), data[n]))
            _log(f"up + ingest {n:,} tuples: up {r['up_seconds']:.1f} s, ingest → last result {r['seconds']:.2f} s, "
                 f"load {r['load']}")
            runs.append(r)
    out = _summary(runs, checks, big, small)
    out["up_seconds"] = float(np.median([r["up_seconds"] for r in runs]))
    return out


def sec_demo(d: Path, reps: int) -> dict:
    """``./dev run`` (set-up already done: the venv exists), total time and its split."""
    from tests.reference.evaluator import compare_results, evaluate

    runs, checks = [], []
    for rep in range(reps):
        work = d / f"demo{rep}"
        la = round(os.getloadavg()[0], 1)
        r = run_cmd([str(ROOT / "dev"), "run", "--dir", str(work)], {**os.environ}, cwd=ROOT)
        err = r.pop("stderr")
        split = {}
        for line in err.splitlines():
            if line.startswith("[strata] timings "):
                split = json.loads(line[len("[strata] timings "):])
        r.update(load=la, timings=split)
        # every instant of every query against the reference

        cfg = parse_config(BATTLEFIELD_TOML)
        streams = {}
        for s in ("Vitals", "Positions"):
            t = pcsv.read_csv(work / f"{s.lower()}.csv")
            streams[s] = t.to_pylist()
        for i, q in enumerate(QUERIES, 1):
            got = pcsv.read_csv(work / "results" / f"q{i}.csv", convert_options=pcsv.ConvertOptions(
                strings_can_be_null=True))
            rows = list(zip(*[got.column(k).to_pylist() for k in range(got.num_columns)]))
            compare_results(rows, evaluate(q, cfg, "S", streams), rel=1e-9)
        checks.append(f"demo run {rep}: all {len(QUERIES)} queries equal the reference on every instant")
        _log(f"./dev run: {r['seconds']:.1f} s (cluster start-up {split.get('start', '?')} s, processing after "
             f"ready {split.get('after_ready', '?')} s), load {la}")
        runs.append(r)
    return {"runs": runs, "checks": checks,
            "seconds": float(np.median([r["seconds"] for r in runs])),
            "start": float(np.median([r["timings"].get("start", np.nan) for r in runs])),
            "after_ready": float(np.median([r["timings"].get("after_ready", np.nan) for r in runs])),
            "process": float(np.median([r["timings"].get("process") or np.nan for r in runs]))}


def run(args, res: dict) -> None:
    """The ``userpath`` section of bench/run.py."""
    quick = getattr(args, "quick", False)
    # 5 pairs in full mode: the start-up's run-to-run noise (±1 s on a shared 2-core VM) is larger
    # than the 1 M run's extra work, and the median of 3 did not tame it (bench/NOTES.md)
    reps = 2 if quick else 5
    d = Path(tempfile.mkdtemp(prefix="strata-userpath-"))
    cfg = setup(d)
    sizes = [20_000, 1_000_000]
    files = write_inputs(d, sizes)
    data = {n: pcsv.read_csv(p) for n, p in files.items()}
    out: dict = {"query": QUERY, "level": LEVEL, "per_instant": PER_INSTANT, "sizes": sizes, "reps": reps,
                 "cpus": os.cpu_count(), "load_start": round(os.getloadavg()[0], 1)}
    out["replay"] = sec_replay(d, cfg, files, data, reps)
    out["cluster"] = sec_cluster(d, cfg, files, data, reps)
    out["ingest"] = sec_ingest(d, cfg, files, data, 1 if quick else 2)
    out["demo"] = sec_demo(d, 1 if quick else 2)
    out["load_end"] = round(os.getloadavg()[0], 1)
    res["userpath"] = out
