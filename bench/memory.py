"""The master's memory over one long run on the user's path (issue 14: "a 10 M-tuple run keeps the
master's memory flat").  ``python -m bench.run --only memory`` (quick: 2 M tuples, full: 10 M).

Everything is the CLI as a user types it, as subprocesses, default settings, nothing injected
(bench/userpath.py's set-up: a config, a user cleared TS with every role, level S):

* ``strata up --levels S --workers 2`` once (a master and 2 Spark workers in the background,
  mutual TLS, the master persisting its event log in the state dir as by default);
* ``strata query --query "SELECT AVG(bp) FROM Vitals [ROWS 100]"`` following the results to a CSV;
* ``strata ingest --labelled --finish`` of one battlefield CSV (bench/workloads.vitals, 20,000
  tuples per instant, four levels, 1/4 each; the CLI leaves the TS quarter out at S), as fast as
  the master takes it.

Every 0.5 s the harness reads the master's ``VmRSS`` (/proc/<pid>/status) and asks ``Status`` (an
operator session) for the tuples accepted so far, the backlog and the lag.  Reported: RSS when 10 %,
50 %, 90 % and 100 % of the input had been accepted (the first sample at or after each; its actual
fraction is given), after the last result and once idle, the peak (``VmHWM``), and the slope of
RSS against input tuples over the second half (least squares over the samples from 50 % to the
first at 100 %, MB per million input tuples).  The output CSV is checked against DuckDB on every
instant and the reference evaluator at sampled instants (bench/userpath.py, bench/check.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv

from bench.load import cpu_seconds, rss_kb
from bench import userpath as U
from bench import workloads as W
from bench.check import BenchCheckFailed
from strata.arrowio import from_ipc, to_ipc
from strata.chunking.model import ChunkResult
from strata.client import Client
from strata.inputs import instant_batches
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.core import MasterCore
from strata.master.store import MasterStore, config_fingerprint

EVERY = 0.5
POINTS = (0.1, 0.5, 0.9, 1.0)


def _log(msg: str) -> None:
    import sys

    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class Sampler:
    """RSS of the master and its Status counters every ``every`` s, on a thread."""

    def __init__(self, pid: int, client, every: float = EVERY, state: Path | None = None):
        self.pid, self.client, self.every, self.state = pid, client, every, state
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            rss = rss_kb(self.pid)
            try:
                st = self.client.status()
                acc = int(st.counters.get("accepted", 0))
                extra = {"backlog": int(st.backlog_chunks), "ready": int(st.ready_chunks),
                         "lag": float(st.lag_seconds), "chunks": int(st.counters.get("chunks", 0)),
                         "checkpoints": int(st.counters.get("checkpoints", 0)),
                         "ckpt_running": int(st.counters.get("checkpoint_running", 0)),
                         "ckpt_mb": round(int(st.counters.get("last_checkpoint_bytes", 0)) / 2**20, 1),
                         "ckpt_ms": int(st.counters.get("last_checkpoint_ms", 0))}
            except Exception:  # noqa: BLE001  (a busy master: the RSS sample still counts)
                acc, extra = None, {}
            if self.state is not None:
                extra["log_mb"] = round(_state_bytes(self.state) / 2**20, 1)
            if rss is not None:
                self.samples.append({"t": round(t - self._t0, 3), "rss_kb": rss, "accepted": acc, **extra})
            self._stop.wait(max(0.0, self.every - (time.monotonic() - t)))

    def stop(self) -> list[dict]:
        self._stop.set()
        self._t.join()
        return self.samples


def _state_bytes(state: Path) -> int:
    """Bytes of the masters' state files (event log, checkpoint, WAL) in ``state``."""
    total = 0
    for f in state.glob("master-*.sqlite*"):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def analyse(samples: list[dict], expected: int, tuples: int) -> dict:
    """RSS at the fractions of ``POINTS`` of ``expected`` accepted tuples and the second half's slope
    in MB per million input tuples (``tuples`` input rows for ``expected`` accepted ones)."""
    acc = [s for s in samples if s.get("accepted") is not None]
    at = {}
    for p in POINTS:
        s = next((x for x in acc if x["accepted"] >= p * expected), None)
        if s is not None:
            at[f"{round(p * 100)}"] = {"rss_mb": round(s["rss_kb"] / 1024, 1), "fraction": round(s["accepted"] / expected, 3),
                                       "t": s["t"], "backlog": s.get("backlog")}
    first_full = next((i for i, x in enumerate(acc) if x["accepted"] >= expected), len(acc) - 1)
    half = [x for x in acc[:first_full + 1] if x["accepted"] >= 0.5 * expected]
    slope = None
    if len(half) >= 2 and half[-1]["accepted"] > half[0]["accepted"]:
        x = np.array([h["accepted"] for h in half], float) * (tuples / expected) / 1e6
        y = np.array([h["rss_kb"] for h in half], float) / 1024
        slope = round(float(np.polyfit(x, y, 1)[0]), 2)
    rng = [round(min(h["rss_kb"] for h in half) / 1024, 1), round(max(h["rss_kb"] for h in half) / 1024, 1)] \
        if half else None
    return {"at": at, "slope_mb_per_m": slope, "slope_samples": len(half), "second_half_range_mb": rng}


def run(args, res: dict) -> None:
    """The ``memory`` section of bench/run.py."""
    n = args.p["mem_tuples"]
    d = Path(tempfile.mkdtemp(prefix="strata-memory-"))
    cfg = U.setup(d)
    csv = d / f"vitals_{n}.csv"
    data = W.vitals(n, U.PER_INSTANT)
    pcsv.write_csv(data, csv)
    expected = int(np.isin(data.column("level").to_numpy(zero_copy_only=False), U.VISIBLE).sum())
    la = round(os.getloadavg()[0], 1)
    state = d / "state"
    env = U._env()
    up = U.run_cmd(U.STRATA + ["up", "--config", str(cfg), "--levels", U.LEVEL, "--workers", "2", "--state-dir",
                               str(state)], env, stdout=subprocess.PIPE)
    out = d / "out.csv"
    try:
        rec = json.loads((state / "cluster.json").read_text())
        m = next(p for p in rec["processes"] if p["role"] == "master")
        m_pid, address = int(m["pid"]), m["address"]
        env["STRATA_TLS_DIR"] = rec["tls_dir"]
        op = Client(address, tls_dir=rec["tls_dir"], level=U.LEVEL)
        op.login("jane", U.PASSWORD, U.LEVEL)
        rss_idle = rss_kb(m_pid)
        client = ["--config", str(cfg), "--master", address, "--user", "jane", "--level", U.LEVEL]
        with open(out, "w") as f:
            q = subprocess.Popen(U.STRATA + ["query"] + client + ["--query", U.QUERY], env=env, stdout=f,
                                 stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 60
            while not op.status().counters.get("queries"):  # registered before the first tuple
                if q.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"strata query did not register: {q.stderr.read()[-1500:]}")
                time.sleep(0.1)
            rss_registered = rss_kb(m_pid)
            cpu0 = cpu_seconds(m_pid)
            sampler = Sampler(m_pid, op, state=state)
            t0 = time.monotonic()
            ing = subprocess.run(U.STRATA + ["ingest"] + client + ["--input", f"Vitals={csv}", "--labelled",
                                                                   "--finish"],
                                 env=env, capture_output=True, text=True)
            t_ingest = time.monotonic() - t0
            if ing.returncode != 0:
                raise RuntimeError(f"strata ingest exited {ing.returncode}: {ing.stderr[-1500:]}")
            q.wait(timeout=1800)
            t_done = time.monotonic() - t0
            rss_done = rss_kb(m_pid)
            cpu = cpu_seconds(m_pid) - cpu0
            time.sleep(3.0)  # idle: what the master keeps once the run is over
            settle = time.monotonic() + 120  # and a checkpoint begun meanwhile has ended
            while op.status().counters.get("checkpoint_running", 0) and time.monotonic() < settle:
                time.sleep(0.5)
            samples = sampler.stop()
            rss_after, hwm = rss_kb(m_pid), rss_kb(m_pid, "VmHWM")
            st = op.status()
        if q.returncode != 0:
            raise RuntimeError(f"strata query exited {q.returncode}: {q.stderr.read()[-1500:]}")
        op.close()
        db = _state_bytes(state)
    finally:
        subprocess.run(U.STRATA + ["down", "--state-dir", str(state)], env=env, capture_output=True)
    accepted = int(st.counters.get("accepted", 0))
    if accepted != expected:
        raise BenchCheckFailed(f"memory: the master accepted {accepted} tuples, {expected} expected")
    check = U.check_query_output(out, data)
    shutil.rmtree(d, ignore_errors=True)  # the CSV and the event log: hundreds of MB at 10 M tuples
    a = analyse(samples, expected, n)
    mb = lambda kb: None if kb is None else round(kb / 1024, 1)  # noqa: E731
    res["memory"] = {"tuples": n, "accepted": accepted, "per_instant": U.PER_INSTANT, "query": U.QUERY,
                     "level": U.LEVEL, "workers": 2, "every": EVERY, "up_seconds": up["seconds"],
                     "ingest_seconds": round(t_ingest, 2), "seconds": round(t_done, 2),
                     "throughput": round(n / t_done), "master_cpu_seconds": round(cpu, 2),
                     "rss_idle_mb": mb(rss_idle), "rss_registered_mb": mb(rss_registered),
                     "rss_done_mb": mb(rss_done), "rss_after_mb": mb(rss_after), "hwm_mb": mb(hwm),
                     "peak_sample_mb": mb(max(s["rss_kb"] for s in samples)) if samples else None,
                     "event_log_mb": round(db / 2**20, 1),
                     "event_log_peak_mb": max((x.get("log_mb") or 0 for x in samples), default=None),
                     "checkpoints": int(st.counters.get("checkpoints", 0)), "load_start": la,
                     "load_end": round(os.getloadavg()[0], 1), **a, "samples": samples, "checks": [check]}
    r = res["memory"]
    _log(f"memory {n:,} tuples: ingest {t_ingest:.1f} s, last result {t_done:.1f} s; master RSS idle "
         f"{r['rss_idle_mb']} MB, " + ", ".join(f"{k} %: {v['rss_mb']} MB (at {v['fraction']:.0%})"
                                                for k, v in a["at"].items())
         + f", after {r['rss_after_mb']} MB, peak {r['hwm_mb']} MB; slope {a['slope_mb_per_m']} MB per M tuples "
         f"over the second half ({a['slope_samples']} samples); state file {r['event_log_mb']} MB at the end, "
         f"{r['event_log_peak_mb']} MB at most, {r['checkpoints']} checkpoints")


# ---- what grows? a one-process reproduction ------------------------------------------------------
def reproduce(tuples: int, per_instant: int = 20_000, trace: bool = False, every: float = 0.1) -> list[dict]:
    """The master's data path in this process: ``MasterCore`` with its event log (``MasterStore``,
    linger on, as ``strata master`` runs it), the CLI's batches (``instant_batches``, 65,536 rows,
    through Arrow IPC as on the wire), a worker that answers every chunk at once (one row per
    instant, no engine) and a subscriber.  Prints and returns, at every ``every`` of the input, the
    RSS, the bytes in Arrow's memory pool, the Python allocations (``tracemalloc``, with
    ``trace``) and the backlog; with ``trace`` also the allocation sites that grew over the second
    half.  ``python -m bench.memory --repro [N] [--per-instant P] [--trace]``."""
    import gc
    import tracemalloc

    import pyarrow as pa
    import pyarrow.compute as pc

    def own_rss() -> float:
        return (rss_kb(os.getpid()) or 0) / 1024

    cfg = parse_config(BATTLEFIELD_TOML)
    d = Path(tempfile.mkdtemp(prefix="strata-memory-repro-"))
    core = MasterCore(cfg, "S", chunk_instants=1, store=MasterStore(d / "m.sqlite", "S", config_fingerprint(cfg)),
                      linger=True)
    qid = core.register("jane", ["SELECT AVG(bp) FROM Vitals [ROWS 100]"])[0].query_id
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            core.heartbeat("w1", 10.0, slots=2)
            for chunk, sid in core.assignments():
                out = [ChunkResult(qc.query_id, chunk.chunk_id, pa.table({
                    "ts": pa.array(qc.instants, pa.int64()), "level": pa.array(["S"] * len(qc.instants)),
                    "avg_bp": pa.array([1.0] * len(qc.instants))})) for qc in chunk.queries]
                core.on_result(chunk.chunk_id, sid, out, span=(chunk.first_ts, chunk.last_ts))
            with core.cond:
                core.cond.wait(0.02)

    def subscriber():
        cursor: dict = {}
        while not core.wait_results([qid], cursor, 0.5)[1]:
            pass

    threading.Thread(target=worker, daemon=True).start()
    sub = threading.Thread(target=subscriber, daemon=True)
    sub.start()
    data = W.vitals(tuples, per_instant)
    data = data.filter(pc.is_in(data.column("level"), value_set=pa.array(["U", "C", "S"])))
    gc.collect()
    if trace:
        tracemalloc.start(10)
    rows, mid, nxt, seq = [], None, 0.0, 0
    sent = 0

    def row(label):
        r = {"at": label, "rss_mb": round(own_rss(), 1), "arrow_pool_mb": round(pa.total_allocated_bytes() / 2**20, 1),
             "python_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 1) if trace else None,
             "backlog": core.pipeline.backlog}
        rows.append(r)
        print("  ".join(f"{k} {v}" for k, v in r.items()), flush=True)

    row("start (the input table in memory)")
    for stream, t, upto in instant_batches(cfg, [("Vitals", data)], "S", rows=65536):
        seq += 1
        core.ingest_batch(stream, from_ipc(to_ipc(t)) if t is not None else None, None, advance_upto=upto,
                          producer="jane/repro", seq=seq)
        sent += 0 if t is None else t.num_rows
        if sent >= nxt * data.num_rows:
            row(f"{sent / data.num_rows:.0%}")
            if trace and mid is None and sent >= data.num_rows / 2:
                gc.collect()
                mid = tracemalloc.take_snapshot()
            nxt += every
    core.advance(finish=True)
    sub.join(300)
    stop.set()
    gc.collect()
    row("after the last result")
    core.store.close()
    shutil.rmtree(d, ignore_errors=True)
    if trace and mid is not None:
        print("grew over the second half (allocation site, size, count):")
        for st in tracemalloc.take_snapshot().compare_to(mid, "lineno")[:12]:
            if st.size_diff > 0:
                print(f"  {st}")
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=reproduce.__doc__.split("\n")[0])
    ap.add_argument("--repro", type=int, nargs="?", const=10_000_000, required=True, metavar="TUPLES")
    ap.add_argument("--per-instant", type=int, default=20_000)
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args()
    reproduce(a.repro, a.per_instant, a.trace)
