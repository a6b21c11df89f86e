"""Scaling figure (issue 31): throughput against workers, Spark executors and hosts, and a projection.

``python -m bench.run --only scaling [--quick]`` measures two battlefield workloads at level TS,

* ``range``: ``SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid`` (every tuple reaches
  a worker: the master cannot prune a time window),
* ``rows``:  ``SELECT AVG(bp) FROM Vitals [ROWS 100]`` (the master prunes each instant to its last
  100 tuples before a chunk leaves it),

against three axes, each on the path users run:

(a) **workers** of the level: ``strata up --levels TS --workers W`` (W = 1, 2; each worker's Spark
    ``local[1]``, the default), then ``strata replay --cluster STATE`` per run (a fresh master,
    the warm workers);
(b) **Spark executors** behind one Strata worker: the level's own Spark standalone cluster, started
    here with the pyspark package's ``spark-class`` as docs/deploy.md *A Spark cluster per level*
    writes it (a master and two Spark workers of 1 core, authentication, network and I/O
    encryption on, the level's secret in a 0600 file), ``[groups."TS"] spark_master`` pointing at it
    with ``spark.executor.cores = 1`` and ``spark.cores.max = E`` (E = 1, 2 executors), then
    ``strata up --workers 1`` and ``strata replay --cluster``;
(c) **hosts**: network namespaces made here (a bridge namespace, a master host ``m`` and worker
    hosts ``h1``, ``h2`` on 10.78.0.0/24; nothing touches the root namespace's interfaces),
    ``strata deploy up`` with ``transport = "netns"`` and one worker per host, each host's config
    pinning the level to its CPU set with ``[groups."TS"] cpus`` (h1 on CPU 0, h2 on CPU 1, the
    master on CPU 1; the client ``strata replay --master`` runs on the master's host under
    ``taskset -c 1``).  With 2 cores the master and its client share CPU 1 with h2 at N = 2; at
    N = 1 the worker host has CPU 0 to itself.  A fresh master per run: the harness stops the
    deployed master and starts its recorded command again with a new event log (what ``strata
    replay --cluster`` does for a ``strata up`` cluster; ``strata deploy`` has no such command).
    Without root (or ``ip netns``) this axis is skipped and the reason recorded.

Each configuration first runs every (workload, size) once **unmeasured** (the workers' Spark has
then run the query's shape at both sizes: the warm path, labelled), then ``reps`` interleaved
pairs of a small and a large run.  Throughput = tuples / the replay's own ``process`` time (first
tuple sent → last result; the fresh master's start is reported apart).  Per run the harness
records the load average before and after, the replay's ``--timings`` (the master's ``strata
status`` counters and per-chunk timings), the CPU seconds (psutil, whole process trees, JVMs
included) of the master, of the worker side (Strata workers and, on a Spark cluster, its daemons
and executors) and of the client, and on the hosts axis the bytes on the master host's link.
Every output (warm-up runs too) is checked against DuckDB on every instant (bench/check.py,
bench/peers.py); a mismatch fails the section.

Per-tuple costs are marginal: (large − small) / (tuples large − tuples small), which takes out the
fresh master's start and every fixed cost of a run.  The projection to N hosts
(:func:`project`): T(N) = min(1 / c_master, N / c_worker), c_worker the worker side's CPU per tuple
(engine and transport per chunk, over the tuples of a chunk) on a host of its own, c_master the
master's CPU per tuple (ingest, shepherd, chunking, encoding, dispatch, results), both from the
hosts axis at N = 1 (or from one worker on the shared host when namespaces were not available).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from bench import userpath as U
from bench import workloads as W
from bench.check import compare_avg, duckdb_avg_rows
from bench.e2e import _instant_slices
from bench.peers import check_range10, duckdb_range10
from strata.chunking.chunker import merge_chunks
from strata.chunking.codec import encode_chunk
from strata.chunking.prune import prune_chunk
from strata.config import load_config, parse_config
from strata.deploy import netns
from strata.deploy.inventory import load_inventory
from strata.deploy.local import alive
from strata.deploy.units import group_env
from strata.examples import BATTLEFIELD_TOML
from strata.master.pipeline import QueryPipeline
from strata.users import ROLES, UserStore
from strata.worker.load import tree_cpu_times

ROOT = Path(__file__).resolve().parents[1]
LEVEL = "TS"
PER_INSTANT = 20_000
QUERIES = {
    "range": "SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid",
    "rows": "SELECT AVG(bp) FROM Vitals [ROWS 100]",
}
PASSWORD = "scaling bench passphrase, not a secret"
USER = "jane"
STRATA = [sys.executable, "-m", "strata"]
SUBNET = "10.78.0"
NETNS_HOSTS = {"m": 5, "h1": 2, "h2": 3}  # host -> last octet
#: the CPU set of each namespace host (2 cores: the master host shares CPU 1 with h2)
HOST_CPUS = {"m": "1", "h1": "0", "h2": "1"}
GROUP_ADDRESS = "239.255.78.4"
GROUP_PORT = 47300
LINK_BYTES_PER_S = 125e6  # 1 Gbit/s, the link the projection assumes between a master and its hosts
HOSTS_PROJECTED = list(range(1, 17))


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


# ---- the model (pure; tests/test_bench.py) ----------------------------------------------------------
def marginal(small: float | None, big: float | None, n_small: int, n_big: int) -> float | None:
    """(big − small) / (n_big − n_small): what one more tuple (or chunk) costs, fixed costs taken out."""
    if small is None or big is None or n_big == n_small:
        return None
    return (big - small) / (n_big - n_small)


def project(c_master: float, c_worker: float, hosts=HOSTS_PROJECTED, c_net: float | None = None) -> dict:
    """Throughput with N worker hosts of one level: T(N) = min(1 / c_master, N / c_worker[, 1 / c_net]).

    ``c_master``: the master's CPU seconds per tuple (one master per level, one process);
    ``c_worker``: a worker host's CPU seconds per tuple (engine and transport per chunk over the
    tuples of a chunk; one worker with one core per host); ``c_net``: the master link's seconds per
    tuple (bytes per tuple / link bandwidth), if known.  Returns the points, the knee N* = c_worker /
    c_master where the master becomes the bottleneck, and which term bounds each point."""
    if not c_master or not c_worker or c_master <= 0 or c_worker <= 0:
        raise ValueError("per-tuple costs must be positive")
    master_bound = 1.0 / c_master
    net_bound = 1.0 / c_net if c_net else None
    pts = []
    for n in hosts:
        workers_bound = n / c_worker
        t = min(master_bound, workers_bound, net_bound if net_bound else float("inf"))
        bound = ("workers" if t == workers_bound else "master" if t == master_bound else "network")
        pts.append({"hosts": n, "throughput": t, "bound": bound})
    return {"points": pts, "knee": c_worker / c_master, "master_bound": master_bound, "net_bound": net_bound,
            "model": "T(N) = min(1 / c_master, N / c_worker" + (", 1 / c_net)" if net_bound else ")")}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], workload: str, small: int, big: int) -> dict:
    """Medians over the measured runs of one configuration and workload, and the marginal costs."""
    mine = [r for r in runs if r["workload"] == workload and not r.get("warmup")]
    s = [r for r in mine if r["tuples"] == small]
    b = [r for r in mine if r["tuples"] == big]

    def med(rs, key):
        return _median([r.get(key) for r in rs])

    out = {"runs": len(b), "throughput": med(b, "throughput"), "process": med(b, "process"),
           "process_small": med(s, "process"), "load_before": [r["load_before"] for r in mine],
           "load_after": [r["load_after"] for r in mine], "chunks": med(b, "chunks"),
           "units": med(b, "units"), "merged_p50": med(b, "merged_p50"),
           "engine_ms_unit": med(b, "engine_p50_ms"), "transport_ms_unit": med(b, "transport_p50_ms"),
           "wait_ms_unit": med(b, "wait_p50_ms"), "ingested": med(b, "ingested"),
           "master_cpu": med(b, "master_cpu"), "worker_cpu": med(b, "worker_cpu"),
           "client_cpu": med(b, "client_cpu")}
    dp = marginal(out["process_small"], out["process"], small, big)
    out["throughput_marginal"] = round(1 / dp) if dp and dp > 0 else None
    for key in ("master_cpu", "worker_cpu", "client_cpu"):
        out[f"{key}_per_tuple"] = marginal(med(s, key), med(b, key), small, big)
        # the large runs' average, fixed costs included: an upper bound where the marginal is lost in noise
        out[f"{key}_per_tuple_avg"] = med(b, key) / big if med(b, key) is not None else None
    # cores the master kept busy at the marginal rate (> 1: its threads outside the interpreter lock ran in parallel)
    if out["throughput_marginal"] and out["master_cpu_per_tuple"]:
        out["master_cores_marginal"] = out["throughput_marginal"] * out["master_cpu_per_tuple"]
    ch_s, ch_b = med(s, "chunks"), med(b, "chunks")
    if ch_s is not None and ch_b is not None and ch_b > ch_s:
        out["worker_cpu_per_chunk"] = (med(b, "worker_cpu") - med(s, "worker_cpu")) / (ch_b - ch_s)
        out["master_cpu_per_chunk"] = (med(b, "master_cpu") - med(s, "master_cpu")) / (ch_b - ch_s)
        out["tuples_per_chunk"] = (big - small) / (ch_b - ch_s)
    if out.get("merged_p50"):
        out["engine_ms_chunk"] = out["engine_ms_unit"] / out["merged_p50"] if out["engine_ms_unit"] is not None else None
        out["transport_ms_chunk"] = (out["transport_ms_unit"] / out["merged_p50"]
                                     if out["transport_ms_unit"] is not None else None)
    nb = [r["net_bytes"] for r in b if r.get("net_bytes") is not None]
    ns = [r["net_bytes"] for r in s if r.get("net_bytes") is not None]
    if nb and ns:
        out["net_bytes_per_tuple"] = marginal(_median(ns), _median(nb), small, big)
    # the worker side's busy share of the large runs' processing: < 1 means it waited (not the bottleneck)
    if out["worker_cpu"] is not None and out["process"]:
        out["worker_busy"] = out["worker_cpu"] / out["process"]
    if out["master_cpu"] is not None and out["process"] and not any(r.get("master_cpu_includes_start") for r in b):
        out["master_busy"] = out["master_cpu"] / out["process"]  # (only where its start is measured apart)
    return out


# ---- inputs and checks ------------------------------------------------------------------------------
def make_config(d: Path, extra: str = "") -> Path:
    """The battlefield config (+ ``extra``) in ``d`` and its users file: jane, cleared TS, every role."""

    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + extra)
    c = load_config(cfg)
    UserStore(c.users_path, c.lattice).add(USER, "TS", PASSWORD, replace=True, roles=ROLES)
    return cfg


class Expected:
    """DuckDB's answer for each (workload, size), on every instant, computed once."""

    def __init__(self, tables: dict):
        self.tables = tables
        self._cache: dict = {}

    def check(self, workload: str, n: int, out_csv: Path) -> str:


        t = self.tables[n]
        key = (workload, n)
        got = pcsv.read_csv(out_csv)
        if workload == "rows":
            if key not in self._cache:
                self._cache[key] = duckdb_avg_rows(t, "bp", 100, W.BF_LEVELS, W.BF_LEVELS)[0]
            exp = self._cache[key]
            compare_avg(pa.table({"ts": got.column(0).cast(pa.int64()), "level": got.column(1).cast(pa.string()),
                                  "avg": got.column(2).cast(pa.float64())}), exp)
            return f"DuckDB agrees on all {exp.num_rows} instants"
        if key not in self._cache:
            self._cache[key] = (duckdb_range10(t)[0], set(int(x) for x in np.unique(t.column("ts").to_numpy())))
        exp, instants = self._cache[key]
        groups = check_range10(exp, got, f"{workload} {n:,}", instants, levels=True)
        return f"DuckDB agrees on all {len(instants)} instants ({groups:,} (instant, sid) groups, levels included)"


# ---- one configuration ----------------------------------------------------------------------------------
def _tree_cpu(pids) -> float:

    total = 0.0
    for pid in pids:
        try:
            total += sum(tree_cpu_times(pid).values())
        except Exception:  # noqa: BLE001 - a process gone meanwhile
            pass
    return total


@dataclass
class Target:
    """One configuration of an axis: how the client replays into it and whose CPU is whose."""

    axis: str  # workers | executors | hosts
    count: int
    label: str
    cfg: Path  # the config the client gives
    extra: list[str]  # replay arguments naming the cluster: --cluster STATE, or --master A --tls-dir D
    master_pid: Callable[[], int]
    side_pids: Callable[[], list[int]]  # the worker side: Strata workers (+ a Spark cluster's daemons)
    prefix: list[str] = field(default_factory=list)  # the client's argv prefix (ip netns exec, taskset)
    before: Callable[[], None] | None = None  # a fresh master before each run (hosts)
    net_bytes: Callable[[], int] | None = None  # bytes through the master host's link so far
    master_child: bool = True  # the master is a child of the replay (replay --cluster): its CPU is in the tree
    shares: str = ""
    setup: dict = field(default_factory=dict)


def one_run(t: Target, workload: str, n: int, csv: Path, d: Path, tag: str, expected: Expected,
            warmup: bool = False) -> dict:

    m0 = None
    if t.before is not None:
        t.before()
        m0 = _tree_cpu([t.master_pid()])  # the fresh master's start, apart from the run
    out, tfile = d / f"out_{tag}.csv", d / f"timings_{tag}.json"
    cmd = t.prefix + STRATA + ["replay", "--config", str(t.cfg), "--user", USER, "--level", LEVEL, "--query",
                               QUERIES[workload], "--input", f"Vitals={csv}", "--output", str(out),
                               "--timings", str(tfile)] + t.extra
    la0 = loadavg()
    side = t.side_pids()
    w0 = _tree_cpu(side)
    b0 = t.net_bytes() if t.net_bytes else None
    r = U.run_cmd(cmd, {**U._env(), "STRATA_PASSWORD": PASSWORD})
    w1 = _tree_cpu(side)
    b1 = t.net_bytes() if t.net_bytes else None
    mcpu = _tree_cpu([t.master_pid()])
    la1 = loadavg()
    tm = json.loads(tfile.read_text()) if tfile.exists() else {}
    ch, co = tm.get("chunks") or {}, tm.get("counters") or {}
    process = tm.get("process")
    rec = {"workload": workload, "tuples": n, "warmup": warmup, "seconds": r["seconds"], "process": process,
           "start": tm.get("start"), "throughput": round(n / process) if process else None,
           "load_before": la0, "load_after": la1, "accepted": co.get("accepted"), "chunks": co.get("chunks"),
           "redispatched": co.get("redispatched"), "units": ch.get("chunks"), "merged_p50": ch.get("merged_p50"),
           "engine_p50_ms": ch.get("engine_p50_ms"), "transport_p50_ms": ch.get("transport_p50_ms"),
           "rtt_p50_ms": ch.get("rtt_p50_ms"), "wait_p50_ms": ch.get("wait_p50_ms"),
           "ingested": tm.get("ingested"), "read_wait": tm.get("read_wait"),
           # the master's CPU: over the run (hosts: its start measured apart), or since its start
           # (replay --cluster starts it; the marginal cost takes the start out)
           "master_cpu": round(mcpu - (m0 or 0.0), 3), "master_cpu_includes_start": m0 is None,
           "worker_cpu": round(w1 - w0, 3),
           "client_cpu": round(r["cpu_seconds"] - (mcpu if t.master_child else 0.0), 3),
           "net_bytes": (b1 - b0) if b0 is not None and b1 is not None else None}
    if co.get("accepted") not in (None, n):
        raise RuntimeError(f"{workload} {n}: the master accepted {co.get('accepted')} tuples")
    rec["check"] = expected.check(workload, n, out)
    out.unlink(missing_ok=True)
    _log(f"{t.label} {workload:5s} {n:>9,} {'(warm-up) ' if warmup else ''}process {process} s "
         f"({rec['throughput'] or 0:,}/s), start {rec['start']} s, chunks {rec['chunks']} in {rec['units']} units, "
         f"master {rec['master_cpu']} s, workers {rec['worker_cpu']} s, client {rec['client_cpu']} s CPU, "
         f"load {la0}->{la1}")
    return rec


def measure(t: Target, files: dict[int, Path], d: Path, reps: int, expected: Expected) -> dict:
    """Warm-up (each workload at each size, unmeasured), then ``reps`` interleaved small/large pairs."""
    small, big = min(files), max(files)
    runs: list[dict] = []
    checks: list[str] = []
    for wl in QUERIES:
        for n in (small, big):
            r = one_run(t, wl, n, files[n], d, f"{t.axis}{t.count}_{wl}_{n}_warm", expected, warmup=True)
            runs.append(r)
            checks.append(f"{t.label} {wl} {n:,} (warm-up): {r['check']}")
        for rep in range(reps):
            for n in ((small, big) if rep % 2 == 0 else (big, small)):
                r = one_run(t, wl, n, files[n], d, f"{t.axis}{t.count}_{wl}_{n}_{rep}", expected)
                r["rep"] = rep
                runs.append(r)
                checks.append(f"{t.label} {wl} {n:,} run {rep + 1}: {r['check']}")
    return {"axis": t.axis, "count": t.count, "label": t.label, "shares": t.shares, "setup": t.setup,
            "runs": runs, "checks": checks,
            "summary": {wl: summarize(runs, wl, small, big) for wl in QUERIES}}


# ---- (a) workers and (b) executors: strata up on this host ---------------------------------------------
@contextlib.contextmanager
def up_target(d: Path, cfg: Path, workers: int, axis: str, count: int, label: str, shares: str,
              extra_side: Callable[[], list[int]] = lambda: [], setup: dict | None = None):
    """``strata up --levels TS --workers W`` for the block; replays with ``--cluster``."""

    state = d / "state"
    env = {**U._env(), "STRATA_PASSWORD": PASSWORD}
    t0 = time.monotonic()
    try:
        U.run_cmd(STRATA + ["up", "--config", str(cfg), "--levels", LEVEL, "--workers", str(workers),
                            "--state-dir", str(state)], env, stdout=subprocess.PIPE)
        up_s = round(time.monotonic() - t0, 1)
        _log(f"{label}: strata up in {up_s} s")

        def procs(role):
            return [p["pid"] for p in json.loads((state / "cluster.json").read_text())["processes"]
                    if p["role"] == role]

        yield Target(axis=axis, count=count, label=label, cfg=cfg, extra=["--cluster", str(state)],
                     master_pid=lambda: procs("master")[0], side_pids=lambda: procs("worker") + extra_side(),
                     shares=shares, setup={"up_seconds": up_s, **(setup or {})})
    finally:
        subprocess.run(STRATA + ["down", "--state-dir", str(state)], env=env, capture_output=True, timeout=120)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(pid: int, timeout: float = 20.0) -> None:

    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def spark_standalone(d: Path, secret: str, workers: int = 2, cores: int = 1, memory: str = "1g"):
    """A Spark standalone master and ``workers`` Spark workers of ``cores`` cores on 127.0.0.1, started
    with the pyspark package's ``spark-class`` (docs/deploy.md), authentication and encryption on."""
    from pyspark.find_spark_home import _find_spark_home

    spark_class = Path(_find_spark_home()) / "bin" / "spark-class"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    props = d / "spark.properties"
    props.write_text(f"spark.authenticate true\nspark.authenticate.secret {secret}\n"
                     "spark.network.crypto.enabled true\nspark.network.crypto.saslFallback false\n"
                     "spark.io.encryption.enabled true\nspark.master.rest.enabled false\n"
                     "spark.ui.killEnabled false\n")
    props.chmod(0o600)
    (d / "conf").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_CONF_DIR=str(d / "conf"), SPARK_LOG_DIR=str(d / "logs"),
               SPARK_LOCAL_DIRS=str(d / "local"))
    port, webui = _free_port(), _free_port()
    procs: list[subprocess.Popen] = []

    def start(name, args):
        with open(d / f"{name}.log", "wb") as log:
            p = subprocess.Popen([str(spark_class), *args], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        procs.append(p)
        return p

    def status() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=5) as r:
                return json.loads(r.read().decode())
        except (OSError, ValueError):
            return {}

    def wait(pred, what, p, log):
        deadline = time.monotonic() + 180
        while not pred():
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Spark standalone {what} did not come up: "
                                   + (d / log).read_text(errors="replace")[-1500:])
            time.sleep(0.2)

    t0 = time.monotonic()
    try:
        m = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                             "--webui-port", str(webui), "--properties-file", str(props)])
        wait(lambda: status().get("status") == "ALIVE", "master", m, "master.log")
        for i in range(workers):
            (d / f"work{i}").mkdir(exist_ok=True)
            w = start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                                     "--host", "127.0.0.1", "--port", str(_free_port()), "--cores", str(cores),
                                     "--memory", memory, "--webui-port", str(_free_port()),
                                     "--work-dir", str(d / f"work{i}"), "--properties-file", str(props)])
        wait(lambda: status().get("aliveworkers", 0) >= workers, "workers", w, f"worker{workers - 1}.log")
        secs = round(time.monotonic() - t0, 1)
        _log(f"Spark standalone master + {workers} workers ({cores} core each) up in {secs} s")
        yield {"url": f"spark://127.0.0.1:{port}", "pids": lambda: [p.pid for p in procs], "status": status,
               "seconds": secs, "dir": d}
    finally:
        for p in reversed(procs):
            _kill_group(p.pid)


def tasks_per_executor(d: Path) -> dict[str, int]:
    """Finished tasks in each executor's log (the Spark workers' work dirs): which executors worked."""
    out = {}
    for f in sorted(d.glob("work*/app-*/*/stderr")):
        key = f"{f.parent.parent.parent.name.replace('work', 'spark worker ')}: {f.parent.parent.name} executor {f.parent.name}"
        out[key] = f.read_text(errors="replace").count("Finished task")
    return out


# ---- (c) hosts: network namespaces and strata deploy -----------------------------------------------------
def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can); the runs pin with ``taskset``."""
    return netns.unavailable(tools=("taskset",))


class Topology(netns.Topology):
    """The benchmark's hosts (:data:`NETNS_HOSTS` on :data:`SUBNET`): strata.deploy.netns's namespaces."""

    def __init__(self, hosts: dict[str, int] = NETNS_HOSTS):
        super().__init__("sc", SUBNET, hosts)


INVENTORY = """\
[deployment]
name = "scaling-{n}"
config = "{operator}"
push_config = false
state_dir = "{state}/default"
python = "{python}"
secrets = "secrets"
tls = true
transport = "netns"
chunk_seconds = 1.0
ready_timeout = 300

[levels.TS]
address = "{group}"
port = {port}
ttl = 1
"""

HOST_ENTRY = """
[[hosts]]
name = "{name}"
netns = "{ns}"
address = "{address}"
state_dir = "{state}/{name}"
config = "{config}"
levels = {levels}
"""


def _deploy(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(STRATA + ["deploy", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "STRATA_PASSWORD": PASSWORD})


@contextlib.contextmanager
def hosts_target(topo: Topology, d: Path, n: int):
    """``strata deploy up`` of level TS: its master on host m, one worker on each of h1..hn, each host's
    config pinning the level to the host's CPUs; a fresh master before every run."""

    d.mkdir(parents=True, exist_ok=True)
    operator = make_config(d / "operator")
    workers = [f"h{i}" for i in range(1, n + 1)]
    cfgs = {h: make_config(d / "hosts" / h, f'\n[groups."TS"]\ncpus = "{HOST_CPUS[h]}"\n') for h in ["m"] + workers}
    state = d / "state"
    text = INVENTORY.format(n=n, operator=operator, state=state, python=sys.executable, group=GROUP_ADDRESS,
                            port=GROUP_PORT)
    text += HOST_ENTRY.format(name="m", ns=topo.ns["m"], address=topo.address("m"), state=state, config=cfgs["m"],
                              levels="{ TS = { master = true } }")
    for h in workers:
        text += HOST_ENTRY.format(name=h, ns=topo.ns[h], address=topo.address(h), state=state, config=cfgs[h],
                                  levels="{ TS = 1 }")
    inv_path = d / "inventory.toml"
    inv_path.write_text(text)
    inv = load_inventory(inv_path)
    t0 = time.monotonic()
    up = _deploy("up", "--inventory", str(inv_path))
    up_s = round(time.monotonic() - t0, 1)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"strata deploy up ({n} hosts) failed: {up.stderr[-3000:]}")
        out = json.loads(up.stdout)
        address = out["masters"]["TS"]
        _log(f"hosts N={n}: strata deploy up in {up_s} s; master {address}, workers {out['workers']['TS']}")
        m_state = state / "m"
        record_path = m_state / "run" / "deployment.json"
        host_m = inv.host("m")
        proc_m = next(p for p in host_m.processes(inv) if p.role == "master")
        genv = group_env(inv, host_m, proc_m)

        def master_entry(rec):
            return next(p for p in rec["processes"] if p["role"] == "master")

        def master_pid() -> int:
            return int(master_entry(json.loads(record_path.read_text()))["pid"])

        def worker_pids() -> list[int]:
            pids = []
            for h in workers:
                rec = json.loads((state / h / "run" / "deployment.json").read_text())
                pids += [int(p["pid"]) for p in rec["processes"] if p["role"] == "worker"]
            return pids

        def fresh_master() -> None:
            """Stop the deployed master, set its event log aside (deleted: a benchmark's) and start its
            recorded command again in host m, with the environment `strata deploy` gives it."""
            rec = json.loads(record_path.read_text())
            p = master_entry(rec)
            _kill_group(int(p["pid"]))
            for f in m_state.glob("master-TS.sqlite*"):
                f.unlink()
            ready = Path(p["ready"])
            ready.unlink(missing_ok=True)
            env = {**{k: v for k, v in os.environ.items() if k != "STRATA_SPARK_MASTER"}, **genv}
            with open(p["log"], "ab") as log:
                child = subprocess.Popen(["ip", "netns", "exec", topo.ns["m"], *p["argv"]], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         cwd=str(m_state), start_new_session=True, close_fds=True)
            p["pid"] = child.pid  # `strata deploy down` stops this one
            tmp = record_path.with_name(record_path.name + ".tmp")
            tmp.write_text(json.dumps(rec, indent=2))
            tmp.replace(record_path)
            deadline = time.monotonic() + 90
            while not ready.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the fresh master did not start: "
                                       + Path(p["log"]).read_text(errors="replace")[-1500:])
                time.sleep(0.05)
            _wait_workers(topo, cfgs["m"], address, d / "secrets" / "tls", n)

        shares = ("the master and the client on CPU 1, the worker host h1 alone on CPU 0" if n == 1 else
                  "h1 alone on CPU 0; h2 shares CPU 1 with the master and the client")
        yield Target(axis="hosts", count=n, label=f"hosts N={n}", cfg=cfgs["m"],
                     extra=["--master", address, "--tls-dir", str(d / "secrets" / "tls")],
                     prefix=["ip", "netns", "exec", topo.ns["m"], "taskset", "-c", HOST_CPUS["m"]],
                     master_pid=master_pid, side_pids=worker_pids, before=fresh_master,
                     net_bytes=lambda: topo.link_bytes("m"), master_child=False, shares=shares,
                     setup={"up_seconds": up_s, "cpus": {h: HOST_CPUS[h] for h in ["m"] + workers},
                            "addresses": {h: topo.address(h) for h in ["m"] + workers}})
    finally:
        r = _deploy("down", "--inventory", str(inv_path), timeout=300)
        if r.returncode != 0:
            _log(f"strata deploy down ({n} hosts): {r.stderr[-500:]}")


def _wait_workers(topo: Topology, cfg: Path, address: str, tls: Path, n: int, timeout: float = 60.0) -> None:
    """Until the master's table lists ``n`` workers (heard across the bridge)."""
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run(["ip", "netns", "exec", topo.ns["m"], *STRATA, "status", "--config", str(cfg), "--level",
                            LEVEL, "--master", address, "--user", USER, "--tls-dir", str(tls), "--json"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "STRATA_PASSWORD": PASSWORD})
        if r.returncode == 0 and len(json.loads(r.stdout).get("workers", [])) >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fresh master does not see {n} workers: {r.stdout[-500:]} {r.stderr[-500:]}")
        time.sleep(0.3)


# ---- the master's data path, per step, in one process ----------------------------------------------------
def master_breakdown(table, reps: int = 3, units: int = 1) -> dict:
    """CPU per tuple of the master's data path for each workload, in this process (as
    bench/master_path.py): ``ingest`` = the shepherd and the chunker, ``advance`` = cutting one-instant
    chunks with their window's legacy, then the wire step (pruning + Arrow IPC encoding) two ways:
    ``wire_live`` every chunk alone (live input: each chunk leaves as it is cut, with its legacy) and
    ``wire`` the run's chunks merged into ``units`` dispatch units (what the replays here did: adaptive
    chunking merges a backlog, and a merged unit carries its first chunk's legacy only).  Median of
    ``reps``, ns per tuple, and bytes per tuple encoded."""



    cfg = parse_config(BATTLEFIELD_TOML)
    n = table.num_rows
    data = {"Vitals": table}
    all_ts, bounds = _instant_slices(data)
    out = {}
    for wl, q in QUERIES.items():
        xs = []
        for _ in range(reps):
            p = QueryPipeline(cfg, LEVEL, chunk_instants=1)
            p.add_query(q)
            spent = dict.fromkeys(("ingest", "advance", "wire_live", "wire"), 0.0)
            chunks, live_bytes = [], 0
            for i in range(len(all_ts)):
                a, b = int(bounds["Vitals"][i]), int(bounds["Vitals"][i + 1])
                t0 = time.process_time()
                p.ingest("Vitals", table.slice(a, b - a))
                t1 = time.process_time()
                cut = p.advance(int(all_ts[i]))
                t2 = time.process_time()
                for c in cut:
                    live_bytes += len(encode_chunk(prune_chunk(c, p.queries)))
                spent["wire_live"] += time.process_time() - t2
                spent["ingest"] += t1 - t0
                spent["advance"] += t2 - t1
                chunks += cut
            t3 = time.process_time()
            size = math.ceil(len(chunks) / max(1, units))
            merged_bytes = sum(len(encode_chunk(prune_chunk(merge_chunks(chunks[i:i + size]), p.queries)))
                               for i in range(0, len(chunks), size))
            spent["wire"] = time.process_time() - t3
            xs.append((spent, live_bytes, merged_bytes))
        res = {k: statistics.median(x[0][k] for x in xs) / n * 1e9 for k in ("ingest", "advance", "wire_live", "wire")}
        res["total"] = res["ingest"] + res["advance"] + res["wire"]
        res["total_live"] = res["ingest"] + res["advance"] + res["wire_live"]
        res["bytes_per_tuple_live"] = xs[0][1] / n
        res["bytes_per_tuple"] = xs[0][2] / n
        res["units"] = units
        out[wl] = res
    return out


# ---- the section ---------------------------------------------------------------------------------------
def costs_and_projection(targets: list[dict], breakdown: dict | None) -> dict:
    """Per workload: the per-tuple and per-chunk costs of the configuration the model uses (hosts N = 1,
    else workers W = 1), the projection to 1..16 hosts and the efficiency measured against it."""
    by = {(t["axis"], t["count"]): t for t in targets}
    src = by.get(("hosts", 1)) or by.get(("workers", 1))
    out = {}
    if not src:
        return out
    for wl in QUERIES:
        s = src["summary"][wl]
        c_m, c_w = s.get("master_cpu_per_tuple"), s.get("worker_cpu_per_tuple")
        fallback = []
        # a marginal lost in the noise (a pruned query leaves the workers almost nothing per tuple): the
        # large runs' average per tuple instead, fixed costs included (an upper bound), and said so
        if (c_m is None or c_m <= 0) and s.get("master_cpu_per_tuple_avg"):
            c_m = s["master_cpu_per_tuple_avg"]
            fallback.append("c_master")
        if (c_w is None or c_w <= 0) and s.get("worker_cpu_per_tuple_avg"):
            c_w = s["worker_cpu_per_tuple_avg"]
            fallback.append("c_worker")
        entry = {"source": src["label"], "c_master": c_m, "c_worker": c_w, "c_client": s.get("client_cpu_per_tuple"),
                 "averaged": fallback, "c_master_marginal": s.get("master_cpu_per_tuple"),
                 "c_worker_marginal": s.get("worker_cpu_per_tuple"),
                 "worker_cpu_per_chunk": s.get("worker_cpu_per_chunk"),
                 "master_cpu_per_chunk": s.get("master_cpu_per_chunk"), "tuples_per_chunk": s.get("tuples_per_chunk"),
                 "engine_ms_chunk": s.get("engine_ms_chunk"), "transport_ms_chunk": s.get("transport_ms_chunk"),
                 "net_bytes_per_tuple": s.get("net_bytes_per_tuple"), "worker_busy": s.get("worker_busy")}
        if breakdown and wl in breakdown:
            entry["master_path_ns"] = breakdown[wl]
        if not c_m or not c_w or c_m <= 0 or c_w <= 0:
            entry["error"] = "a marginal cost was not positive (noise): no projection"
            out[wl] = entry
            continue
        c_net = entry["net_bytes_per_tuple"] / LINK_BYTES_PER_S if entry.get("net_bytes_per_tuple") else None
        p = project(c_m, c_w, c_net=c_net)
        entry.update(p)
        if entry.get("c_client") and entry["c_client"] > 0:  # the source on the master's core, as measured here
            entry["master_host_bound"] = 1.0 / (c_m + entry["c_client"])
        measured = {}
        for (axis, count), t in by.items():
            if axis == (src["axis"]) and t["summary"][wl].get("throughput"):
                tm = t["summary"][wl]["throughput"]
                mm = t["summary"][wl].get("throughput_marginal")
                model = p["points"][count - 1]["throughput"]
                measured[count] = {"throughput": tm, "model": model, "efficiency": tm / model,
                                   "marginal": mm, "efficiency_marginal": mm / model if mm else None}
        entry["measured"] = measured
        out[wl] = entry
    return out


def refresh(sc: dict) -> dict:
    """Recompute the summaries and the model of stored results with this version's analysis (the
    report does, so ``--report-only`` renders older results.json the same way); returns ``sc``."""
    small, big = (sc.get("sizes") or [None, None])[:2]
    if small is None:
        return sc
    for t in sc.get("targets") or []:
        if t.get("runs"):
            t["summary"] = {wl: summarize(t["runs"], wl, small, big) for wl in QUERIES}
    if sc.get("targets"):
        sc["model"] = costs_and_projection(sc["targets"], sc.get("master_path"))
    return sc


def run(args, res: dict) -> None:
    """The ``scaling`` section of bench/run.py."""


    p = args.p
    small, big, reps = p["scale_small"], p["scale_tuples"], p["scale_reps"]
    d = Path(tempfile.mkdtemp(prefix="strata-scaling-"))
    out: dict = {"queries": QUERIES, "level": LEVEL, "per_instant": PER_INSTANT, "sizes": [small, big], "reps": reps,
                 "cpus": os.cpu_count(), "load_start": loadavg(), "targets": [], "checks": []}
    files = U.write_inputs(d, [small, big])  # bench/workloads.vitals: 20,000 tuples per instant, 4 levels
    tables = {n: pcsv.read_csv(f) for n, f in files.items()}
    expected = Expected(tables)
    axes = p.get("scale_axes", ["workers", "executors", "hosts"])
    old = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # clean up (namespaces, daemons, clusters) on SIGTERM too
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_term)
    topo = None
    ok = False
    try:
        out["master_path"] = master_breakdown(tables[big], reps=1 if getattr(args, "quick", False) else 3, units=1)

        def add(t: Target) -> None:
            m = measure(t, files, d / "runs", reps, expected)
            out["targets"].append(m)
            out["checks"] += m["checks"]

        (d / "runs").mkdir()
        if "workers" in axes:
            for w in p.get("scale_workers", [1, 2]):
                cfg = make_config(d / f"workers{w}")
                with up_target(d / f"workers{w}", cfg, w, "workers", w, f"workers W={w}",
                               "master, client and the workers share both cores (no pinning, defaults)") as t:
                    add(t)
        if "executors" in axes:
            secret = os.urandom(24).hex()
            sd = d / "spark"
            with spark_standalone(sd, secret, workers=max(p.get("scale_executors", [1, 2]))) as sp:
                for e in p.get("scale_executors", [1, 2]):
                    cd = d / f"executors{e}"
                    (cd / "keys").mkdir(parents=True, exist_ok=True)
                    sf = cd / "keys" / "TS.spark"
                    sf.write_text(secret + "\n")
                    sf.chmod(0o600)
                    cfg = make_config(cd, f'\n[groups."TS"]\nspark_master = "{sp["url"]}"\n'
                                          f'spark_secret_file = "keys/TS.spark"\n'
                                          f'spark_conf = {{ "spark.executor.cores" = "1", "spark.cores.max" = "{e}", '
                                          f'"spark.executor.memory" = "1g" }}\n')
                    before = tasks_per_executor(sd)
                    with up_target(cd, cfg, 1, "executors", e, f"executors E={e}",
                                   "master, client, the Strata worker (Spark driver), the executors and the Spark "
                                   "daemons share both cores", extra_side=sp["pids"],
                                   setup={"spark_start_seconds": sp["seconds"]}) as t:
                        apps = [a for a in sp["status"]().get("activeapps", []) if a.get("name") == "strata-worker-TS"]
                        t.setup["executor_cores"] = apps[0].get("cores") if apps else None
                        add(t)
                    after = tasks_per_executor(sd)
                    # this worker's executors (new since the last configuration): tasks each finished
                    out["targets"][-1]["setup"]["tasks_per_executor"] = {
                        k: v - before.get(k, 0) for k, v in after.items() if k not in before or v > before[k]}
        if "hosts" in axes:
            reason = netns_unavailable()
            out["netns"] = reason is None
            if reason:
                out["netns_reason"] = reason
                _log(f"hosts axis skipped: {reason}")
            else:
                topo = Topology()
                topo.up()
                for n in p.get("scale_hosts", [1, 2]):
                    with hosts_target(topo, d / f"hosts{n}", n) as t:
                        add(t)
        out["model"] = costs_and_projection(out["targets"], out.get("master_path"))
        ok = True
        res["scaling"] = out  # (a failed run keeps the last complete results; the harness records the failure)
    finally:
        if topo is not None:
            topo.down()
        signal.signal(signal.SIGTERM, old)
        out["load_end"] = loadavg()
        if ok:
            shutil.rmtree(d, ignore_errors=True)
        else:  # the processes' logs stay for the failure's diagnosis (the inputs go)
            for f in d.glob("vitals_*.csv"):
                f.unlink(missing_ok=True)
            _log(f"scaling: logs kept in {d}")


def plot(sc: dict, out: Path) -> str | None:
    """docs/benchmarks/scaling.png: the three axes and the projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    targets = sc.get("targets") or []
    if not targets:
        return None
    fig, axs = plt.subplots(2, 2, figsize=(10, 7.5))
    titles = {"workers": "(a) Strata workers of the level (one host)",
              "executors": "(b) Spark executors behind one worker (1 core each)",
              "hosts": "(c) hosts (namespaces, 1 CPU each)"}
    styles = {"range": "-o", "rows": "-s"}
    colors = {"range": "tab:blue", "rows": "tab:orange"}
    for ax, axis in zip(axs.flat, ("workers", "executors", "hosts")):
        ts = sorted((t for t in targets if t["axis"] == axis), key=lambda t: t["count"])
        for wl in QUERIES:
            pts = [(t["count"], t["summary"][wl].get("throughput")) for t in ts if t["summary"][wl].get("throughput")]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], styles[wl], color=colors[wl],
                        label=f"{wl}: {QUERIES[wl]}")
        ax.set_title(titles[axis], fontsize=9)
        ax.set_xlabel(axis)
        ax.set_ylabel("tuples/s (processing)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.set_xticks([1, 2])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=.3)
        if not ts:
            ax.text(0.5, 0.5, sc.get("netns_reason", "not measured"), ha="center", va="center", fontsize=8,
                    transform=ax.transAxes, wrap=True)
    axs.flat[0].legend(fontsize=6)
    ax = axs.flat[3]
    model = sc.get("model") or {}
    for wl in QUERIES:
        m = model.get(wl) or {}
        if not m.get("points"):
            continue
        ns = [q["hosts"] for q in m["points"]]
        ax.plot(ns, [q["throughput"] for q in m["points"]], "--", color=colors[wl],
                label=f"{wl}: model, knee N* = {m['knee']:.1f}")
        meas = m.get("measured") or {}
        if meas:
            ax.plot([int(k) for k in meas], [v["throughput"] for v in meas.values()], styles[wl][1:],
                    color=colors[wl], label=f"{wl}: measured ({m.get('source', '').split()[0]} axis)")
        ax.plot(ns, [n / m["c_worker"] for n in ns], ":", color=colors[wl], lw=.8,
                label=f"{wl}: workers' side N / c_worker")
        if 1 <= m["knee"] <= 16:
            ax.axvline(m["knee"], color=colors[wl], lw=.6, ls=":")
    ax.set_title("projection T(N) = min(1/c_master, N/c_worker)", fontsize=9)
    ax.set_xlabel("hosts N (one worker, one core each)")
    ax.set_ylabel("tuples/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(0.9, 17)
    ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bounds = [m["master_bound"] for m in model.values() if m.get("master_bound")]
    if bounds:
        ax.set_ylim(top=20 * max(bounds))
    ax.grid(alpha=.3, which="both")
    ax.legend(fontsize=6)
    shared = " (under load: a shared VM)" if max(sc.get("load_start") or 0, sc.get("load_end") or 0) > (sc.get("cpus") or 2) else ""
    fig.suptitle(f"Scaling at level TS ({sc.get('mode', '?')} mode, {sc.get('date', '?')}, load "
                 f"{sc.get('load_start')}-{sc.get('load_end')}{shared})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)
    return "scaling.png"
