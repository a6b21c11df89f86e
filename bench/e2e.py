"""End-to-end runs through a real cluster: master and worker processes on loopback.

:class:`BenchCluster` starts one level group with ``strata.deploy.local.start_cluster``
(a master and N Spark workers as separate processes) and can replace the master
between runs (a master has one input timeline, so every run needs a fresh one;
the workers stay warm and join the new master through the group heartbeats)
and stop workers to scale down.

:func:`replay` drives one run the way a source and a subscriber would: for each
group of instants one ``Ingest`` call (labelled tuples, Arrow IPC) then one
``Advance`` closing them; a subscriber thread records the arrival time of every
``ResultBatch``.  Measured:

* throughput = tuples accepted / (arrival of the last result - start of the first ingest);
* per-instant latency = arrival of the batch holding instant τ - the moment the
  ``Advance`` closing τ was sent (includes waiting for the rest of τ's chunk).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from strata.arrowio import from_ipc
from strata.client import Client
from strata.deploy.local import alive, renew_master, start_cluster, stop_cluster
from strata.config import load_config
from strata.rpc import strata_pb2 as pb
from strata.users import ROLES, UserStore
from strata.groups import level_slug
from strata.worker.load import tree_cpu_times

PASSWORD = "bench passphrase, not a secret"
USER = "bench"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class BenchCluster:
    """One level group (master + ``workers`` workers) of ``config_text`` in a temp dir."""

    def __init__(self, config_text: str, level, workers: int, chunk_seconds: float = 1.0,
                 clearance: str | None = None, spark_master: str = "local[1]", tls: bool = True,
                 cpu_reading: str = "host", mode: str = "replicated"):
        """``mode`` ``trusted``: one master and ``workers`` workers serve every level of ``level`` (a list
        whose first is the level the harness replays at; docs/trusted.md)."""
        self.dir = Path(tempfile.mkdtemp(prefix="strata-bench-"))
        self.config_path = self.dir / "strata.toml"
        self.config_path.write_text(config_text)
        self.cfg = load_config(self.config_path)
        levels = [level] if isinstance(level, str) else list(level)
        self.levels = [self.cfg.lattice.parse(lv) for lv in levels]
        self.level = self.levels[0]
        top = clearance or self.cfg.lattice.top
        # the harness ingests, queries and reads the cluster's status: every role
        UserStore(self.cfg.users_path, self.cfg.lattice).add(USER, top, PASSWORD, replace=True, roles=ROLES)
        self.state = self.dir / "state"
        t0 = time.monotonic()
        kw = {"tls": tls} if "tls" in inspect.signature(start_cluster).parameters else {}
        if cpu_reading == "dedicated":
            # emulate one host per worker with an injected idle reading (the in-flight limit
            # still applies)
            kw["worker_env"] = {i: {"STRATA_CPU_OVERRIDE": "0"} for i in range(workers)}
        elif cpu_reading not in ("host", "process"):
            raise ValueError("cpu_reading must be 'host', 'process' or 'dedicated'")
        if "load_reading" in inspect.signature(start_cluster).parameters:
            # Algorithm 5's reading (worker/load.py): the shared host's CPUs, or each worker's own processes
            kw["load_reading"] = "host" if cpu_reading == "host" else "process"
        self.cpu_reading = cpu_reading
        self.mode = mode
        if mode != "replicated":
            kw["mode"] = mode
        out = start_cluster(str(self.config_path), self.levels, workers, self.state, chunk_seconds,
                            spark_master=spark_master, **kw)
        self.addresses = dict(out["masters"])
        self.address = self.addresses[self.level]
        self.tls_dir = out.get("tls_dir")
        self.record = json.loads((self.state / "cluster.json").read_text())
        self.workers = workers
        self.chunk_seconds = chunk_seconds
        self.start_seconds = time.monotonic() - t0
        _log(f"cluster {','.join(self.levels)} x{workers} up in {self.start_seconds:.1f} s")
        for lv in self.levels:
            self.use(lv)
            self.wait_workers(workers)
        self.use(self.levels[0])

    def use(self, level: str) -> "BenchCluster":
        """Make ``level``'s master the one :meth:`client`, :meth:`new_master` and :meth:`drop_worker` act on."""
        self.level = self.cfg.lattice.parse(level)
        self.address = self.addresses[self.level]
        return self

    # -- processes ------------------------------------------------------------------------
    def _serves(self, p: dict) -> bool:
        return self.level in p.get("serves", [p["level"]])  # a trusted process serves several levels

    def _procs(self, role: str) -> list[dict]:
        return [p for p in self.record["processes"] if p["role"] == role and self._serves(p)]

    def pids(self) -> dict[str, int]:
        """Live processes of the current level's group (a trusted cluster's: all of them)."""
        return {p["name"]: p["pid"] for p in self.record["processes"] if self._serves(p) and alive(p["pid"])}

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by this level's master and workers, JVMs included.

        Less sensitive than wall time to other jobs on a shared host: it counts the work the
        cluster did, not how long it waited for a core."""
        return sum(sum(tree_cpu_times(pid).values()) for pid in self.pids().values())

    def client(self) -> Client:
        if self.tls_dir:
            c = Client(self.address, tls_dir=self.tls_dir, level=self.level)
        else:
            c = Client(self.address)
        c.login(USER, PASSWORD, self.level)
        return c

    def wait_workers(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                if len([w for w in c.status().workers]) == n:
                    return
                time.sleep(0.2)
        raise RuntimeError(f"master does not see {n} workers")

    def new_master(self, chunk_seconds: float | None = None) -> None:
        """Replace the master by a fresh one (same group, same workers)."""
        if self.mode == "trusted":  # what strata replay --cluster does: the trusted master restarts whole
            if chunk_seconds is not None and chunk_seconds != self.chunk_seconds:
                raise ValueError("a trusted BenchCluster keeps the chunk length it was started with")
            self.address = renew_master(self.state, self.level)[0]
            self.record = json.loads((self.state / "cluster.json").read_text())
            self.addresses.update({lv: self.address for lv in self.levels})
            self.wait_workers(self.workers)
            return
        m = self._procs("master")[0]
        self._kill(m["pid"])
        if chunk_seconds is not None:
            self.chunk_seconds = chunk_seconds
        ready = Path(m["ready"])
        ready.unlink(missing_ok=True)
        # a master restores its timeline from the state dir (persistence); every run needs a fresh one

        for f in self.state.glob(f"master-{level_slug(self.level)}.sqlite*"):
            f.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "strata", "master", "--config", str(self.config_path.resolve()), "--level",
               self.level, "--listen", "127.0.0.1:0", "--state-dir", str(self.state.resolve()), "--multicast-port",
               str(self.record["multicast_port"]), "--ready-file", str(ready), "--chunk-seconds",
               str(self.chunk_seconds)]
        if not self.tls_dir and "tls" in inspect.signature(start_cluster).parameters:
            cmd.append("--insecure")
        log = open(self.state / "logs" / f"{m['name']}.log", "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        m["pid"] = p.pid
        self._popen = p
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("new master did not start: " +
                                   (self.state / "logs" / f"{m['name']}.log").read_text(errors="replace")[-1500:])
            time.sleep(0.05)
        self.address = json.loads(ready.read_text())["address"]
        self.addresses[self.level] = self.address
        (self.state / "cluster.json").write_text(json.dumps(self.record, indent=2))
        self.wait_workers(self.workers)

    def drop_worker(self) -> None:
        """Stop the last worker (scale down by one); the next master sees one fewer."""
        w = self._procs("worker")[self.workers - 1]
        self._kill(w["pid"])
        self.workers -= 1

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 15
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        stop_cluster(self.state)


# ---- one replay ----------------------------------------------------------------------------------
@dataclass
class RunResult:
    tuples: int  # accepted by the master
    sent: int  # offered (before the shepherd)
    seconds: float  # first ingest -> last result
    ingest_seconds: float  # first ingest -> finish sent
    latencies: np.ndarray  # per instant, seconds
    rows: pa.Table | None  # all output rows, in order
    instants: int
    chunks: int = 0
    extra: dict = field(default_factory=dict)
    cpu_seconds: float = float("nan")  # master + workers (JVMs included), first ingest -> last result

    @property
    def throughput(self) -> float:
        return self.tuples / self.seconds if self.seconds > 0 else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if len(self.latencies) else float("nan")


def _instant_slices(data: dict[str, pa.Table]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Distinct instants over all streams and, per stream, the row offset where each instant starts."""
    all_ts = np.unique(np.concatenate([t.column("ts").to_numpy() for t in data.values()]))
    bounds = {}
    for s, t in data.items():
        ts = t.column("ts").to_numpy()
        bounds[s] = np.searchsorted(ts, np.append(all_ts, all_ts[-1] + 1), side="left")
    return all_ts, bounds


def replay(cluster: BenchCluster, query: str | list[str], data: dict[str, pa.Table], instants_per_call: int = 1,
           rate: float | None = None, timeout: float = 1800.0) -> RunResult:
    """Register ``query`` (or several), replay ``data`` (labelled, arrival order), collect every result.

    With several queries, ``rows`` and the latencies are those of the first; the run ends when
    every query's stream has ended.  ``rate``: offered tuples per second (paced), else as fast as
    the master accepts."""
    queries = [query] if isinstance(query, str) else list(query)
    c = cluster.client()
    regs = c.register(queries)
    reg = regs[0]
    others_done: list[threading.Event] = []
    others_last: list[float] = []

    def drain(qid: str, ev: threading.Event) -> None:
        last = None
        try:
            for b in c.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid], resume_after_ts=-1), metadata=c._md):
                if b.end:
                    break
                last = time.perf_counter()
            if last is not None:
                others_last.append(last)
        except BaseException as e:  # noqa: BLE001
            error.append(e)
        finally:
            ev.set()

    arrivals: list[tuple[float, int, int, pa.Table]] = []
    error: list[BaseException] = []
    done = threading.Event()

    def collect():
        try:
            stream = c.stub.Subscribe(pb.SubscribeRequest(query_ids=[reg.query_id], resume_after_ts=-1), metadata=c._md)
            for b in stream:
                if b.end:
                    break
                arrivals.append((time.perf_counter(), b.first_ts, b.last_ts, from_ipc(b.arrow)))
        except BaseException as e:  # noqa: BLE001
            error.append(e)
        finally:
            done.set()

    th = threading.Thread(target=collect, daemon=True)
    th.start()
    for r in regs[1:]:
        ev = threading.Event()
        others_done.append(ev)
        threading.Thread(target=drain, args=(r.query_id, ev), daemon=True).start()
    cpu0 = cluster.cpu_seconds()
    all_ts, bounds = _instant_slices(data)
    close_at: dict[int, float] = {}
    accepted = 0
    sent = 0
    t0 = time.perf_counter()
    for g in range(0, len(all_ts), instants_per_call):
        lo, hi = g, min(g + instants_per_call, len(all_ts))
        batches = []
        for s, t in data.items():
            a, b = int(bounds[s][lo]), int(bounds[s][hi])
            if b > a:
                batches.append((s, t.slice(a, b - a)))
        n = sum(t.num_rows for _, t in batches)
        if rate:
            wait = t0 + sent / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        reply = c.ingest(batches, labelled=True)
        if reply.error:
            raise RuntimeError(f"ingest rejected: {reply.error}")
        accepted += reply.accepted
        sent += n
        now = time.perf_counter()
        for t in all_ts[lo:hi]:
            close_at[int(t)] = now
        c.advance(upto_ts=int(all_ts[hi - 1]))
    t_in = time.perf_counter() - t0
    c.advance(finish=True)
    if not done.wait(timeout) or not all(ev.wait(timeout) for ev in others_done):
        raise RuntimeError("results did not complete in time")
    if error:
        raise error[0]
    end = max([arrivals[-1][0]] + others_last) if arrivals else time.perf_counter()
    cpu = cluster.cpu_seconds() - cpu0
    lat = []
    for at, first, last, _ in arrivals:
        for t in range(int(first), int(last) + 1):
            if t in close_at:
                lat.append(at - close_at.pop(t))
    tables = [a[3] for a in arrivals if a[3].num_rows]
    rows = pa.concat_tables(tables) if tables else None
    st = c.status()
    c.close()
    return RunResult(tuples=accepted, sent=sent, seconds=end - t0, ingest_seconds=t_in, latencies=np.array(lat), rows=rows,
                     instants=len(all_ts), chunks=int(st.counters.get("chunks", 0)),
                     extra={"redispatched": int(st.counters.get("redispatched", 0)),
                            "timings": dict(getattr(st, "timings", {}) or {})}, cpu_seconds=cpu)
