"""The adversarial timing test of the host's slot gate (issue 33): does a lower level's output timing
depend on a higher level's load?

Two co-hosted level groups of the battlefield config, S and TS, one Spark worker each, on the same
CPUs (no ``cpus``), started with ``strata up --levels S,TS`` and ``[cluster] scheduler =
"fixed_slot"`` (so ``strata up`` starts the gate, ``strata slots``).  An S producer sends one tuple
an instant and closes the instant; an S subscriber records when each instant's result arrives
(monotonic clock).  The S instants go in blocks of :data:`BLOCK`, alternately while TS is *busy* (a
TS producer, a process of its own, feeds a RANGE ... GROUP BY over 10 000 tuples an instant, each
next instant as soon as the last one's result is out: TS's worker never waits) and while TS is
*idle* (that producer stopped and its last result out).  Alternating blocks put both conditions
under the same background load (2 cores, shared with other users).

What an S user can observe is when its results arrive: an instant's **latency** (from the call
that sends it to its result's arrival; inter-arrival times are the sending period plus the
difference of two latencies).  Under a slot gate a latency is mostly the wait for S's next slot,
which depends on the phase of the send within the gate's round, so the sends are *stratified by
phase*: every block starts on the same point of a :data:`ROUND` grid of the test's clock and its
sends are ``ROUND + ROUND / BLOCK`` apart, so the i-th send of every block falls on the same phase of
the gate's round.  Per phase, the mean latency with TS busy less the one with TS idle
(:func:`paired`); the statistic is the median of those per-phase differences (robust to the
transient after TS starts, below), reported with every phase's, each condition's median and 90th
percentile, and the share of the time S's master was stopped (sampled every 5 ms, weighted by time): what S's timing
can depend on, measured directly.  The master's
linger (``[cluster] dispatch_linger``, which waits for more input for up to a job's time) is off:
it reacts to S's own job times and only adds noise here.

* Under ``fixed_slot``: S's master is stopped the same share of the time whether TS is busy or idle
  (within 0.03), the *block difference* is within :data:`TOLERANCE`, and S's result rows are
  exactly its input's.  The block difference: each block's mean latency (a block holds every phase
  once), then the median of the busy blocks' less the median of the idle blocks'; a burst of the
  machine's other load that hits one block (a few seconds) moves neither median, while it moves
  every phase's paired difference.
* Under ``round_robin`` (started by hand, ``strata slots --scheduler round_robin``, after the
  fixed-slot gate was stopped: every process runs again): S is stopped half the time while TS is
  busy and seldom while it is idle (TS then only gets a short probe now and then): the stopped
  shares differ by more than 0.2, and S's results are later while TS is busy (the median paired
  difference is positive).  This is the channel the slot policies close; the test shows it exists.

What is asserted, and why not more: on this machine the latencies alone do not separate the two
gates reliably (below), so the test asserts what is reliable, when S runs, which is what the gate
decides, and writes the latencies down (printed, and in docs/scheduling.md).

**The tolerance's basis** (measured on this 2-core machine while other users' test suites ran, load
average 0.5-16; docs/scheduling.md has the numbers): a slot is 0.25 s, the most a higher level can
add to one wait.  Round robin's channel measured +0.064 to +0.202 s (S stopped 0.50-0.59 of the time
while TS was busy, 0.095-0.146 while it was idle); no gate at all (``shared``) +0.023 s (TS takes CPU
from S, but on 2 cores S's short jobs mostly find one free).  Under fixed slots S was stopped the
same share of the time either way (0.51 against 0.51, at most 0.01 apart), yet the median paired
difference measured -0.014 to +0.072 s, mostly positive: a residual the gate does not remove, most
likely the disk (TS's big ingest is written and synced where S's master syncs its own event log)
and the caches (TS's work runs through those S's runs next); it is largest right after TS starts
(single phases up to +0.3 s; +0.04 to +0.06 s with a CPU-heavy join over 200 tuples an instant as
TS's load instead).  Round robin's median paired difference was +0.064 and +0.065 s in two runs of
seven, below that residual's largest.  :data:`TOLERANCE` = 0.125 s, half a slot, bounds the residual
(a gate that let TS's load decide when S runs would add up to a slot).

The disk is kept out (the fixture :func:`state_dir`): the cluster's state lives in ``/dev/shm`` when it has
room, as a device per level would give.  With the state on disk and a Spark suite beside it the
fixed-slot paired difference measured +0.23 and +0.24 s (CI failed once on +0.15 s), in memory
+0.036 s.  Over the tolerance (or over the stopped shares' 0.03: a full suite once measured 0.485
against 0.516 beside the other suite process, 0.031), the fixed-slot measurement is taken once more and
the second one asserted (both printed): a leaking gate shifts every measurement, a burst of other load
seldom two.
The paired differences are printed with every run, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from strata.client import ClientError
from strata.examples import BATTLEFIELD_TOML

from .helpers import login, strata, write_config
from .polling import poll, wait_for

#: the workers this module starts warm up (conftest.py: the suite's default skips it): its latencies are the
#: measurement: S's and TS's workers start warm, as users' do
WORKER_WARM_UP = True

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: ``[cluster] slot_seconds`` (the default) and the round of two levels
SLOT = 0.25
ROUND = 2 * SLOT
#: S instants per block (one per phase of the round); blocks per policy: busy, idle, busy, idle, ...
BLOCK, BLOCKS = 8, 6
#: seconds between two sends of a block: each next one a BLOCK-th of a round later in the round
PERIOD = ROUND + ROUND / BLOCK
#: the largest median paired difference of S's latencies with TS busy and idle under fixed_slot (docstring)
TOLERANCE = 0.125
#: the largest difference of the shares of the time S's master was stopped with TS busy and idle (docstring)
STOPPED_TOLERANCE = 0.03
#: TS's load: tuples an instant and its query (a heavy RANGE GROUP BY)
TS_TUPLES = 10_000
TS_QUERY = "SELECT sid, AVG(bp), COUNT(*) FROM Vitals [RANGE 10] GROUP BY sid"
S_QUERY = "SELECT sid, bp FROM Vitals [NOW]"


def signals_work() -> str | None:
    """Why process groups cannot be stopped and continued here (None: they can)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        os.killpg(p.pid, signal.SIGSTOP)
        stopped = poll(lambda: states([p.pid]) == ["T"], 5, 0.02)
        os.killpg(p.pid, signal.SIGCONT)
        return None if stopped else "a process group sent SIGSTOP did not stop"
    except OSError as e:
        return f"signals to a process group are refused here: {e}"
    finally:
        p.kill()
        p.wait()


def states(pids: list[int]) -> list[str]:
    """Each process's state letter (T: stopped), or ``gone``."""
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            out.append("gone")
    return out


def vitals(ts: int, level: str, n: int = 1) -> pa.Table:
    return pa.table({"ts": pa.array([ts] * n, pa.int64()), "level": [level] * n,
                     "sid": [f"s{i % 500}" for i in range(n)] if n > 1 else ["a"],
                     "bp": pa.array([float(ts % 100_000) * 1000 + i for i in range(n)], pa.float64()),
                     "pr": pa.array([1.0] * n, pa.float64()), "weight": pa.array([1.0] * n, pa.float64())})


class Results:
    """A subscriber thread: when each instant's result arrived (monotonic) and its rows."""

    def __init__(self, client, qid: str):
        self.arrived: dict[int, float] = {}
        self.rows: dict[int, list] = {}
        self.cond = threading.Condition()
        self.client, self.qid = client, qid
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        try:
            for _, table in self.client.subscribe([self.qid]):
                now = time.monotonic()
                if table is None:
                    return
                with self.cond:
                    for row in table.to_pylist():
                        self.arrived.setdefault(row["ts"], now)
                        self.rows.setdefault(row["ts"], []).append(tuple(v for c, v in row.items() if c != "ts"))
                    self.cond.notify_all()
        except (ClientError, grpc.RpcError):  # the cluster was stopped
            return

    def wait(self, ts: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: ts in self.arrived, timeout)


# ---- TS's load: a process of its own (its client's work is not in the measuring process) ----------------
def ts_load_main(cluster_json: str) -> None:
    """The TS producer's process: ``busy`` on stdin starts it feeding (each next instant once the last
    one's result is out), ``idle`` stops it and answers ``idle N`` (N: its instants done so far) once
    its last instant's result is out; end of input ends it."""
    cluster = json.loads(cluster_json)
    client = login(cluster, "tess", "TS")
    results = Results(login(cluster, "tess", "TS"), client.register([TS_QUERY])[0].query_id)
    table = vitals(0, "TS", TS_TUPLES)
    run = threading.Event()
    state = {"next": 1}

    def feed() -> None:
        while True:
            run.wait()
            k = state["next"]
            state["next"] += 1
            client.ingest([("Vitals", table.set_column(0, "ts", pa.array([k] * TS_TUPLES, pa.int64())), k)],
                          labelled=True)
            results.wait(k, 300)

    threading.Thread(target=feed, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "busy":
            run.set()
        elif line.strip() == "idle":
            run.clear()
            with results.cond:  # the instant being fed when told, if any, is finished
                results.cond.wait_for(lambda: state["next"] - 1 in results.arrived or state["next"] == 1, 300)
            print(f"idle {len(results.arrived)}", flush=True)


class TsLoad:
    """Drives :func:`ts_load_main` in a child process."""

    def __init__(self, cluster: dict):
        code = "import sys; from tests.test_slot_timing import ts_load_main; ts_load_main(sys.argv[1])"
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(cluster)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "ready", "TS's producer did not start"
        self.done = 0

    def busy(self) -> None:
        self.proc.stdin.write("busy\n")
        self.proc.stdin.flush()

    def idle(self) -> int:
        """Stop feeding; once TS is idle, the TS instants done meanwhile."""
        self.proc.stdin.write("idle\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "idle", "TS's producer stopped"
        before, self.done = self.done, int(line[1])
        return self.done - before

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class Stopped:
    """While open, samples every few milliseconds whether a process is stopped: ``stopped`` of ``seconds``
    seconds (each interval between two samples counted half to each one's state).  Weighted by time, not
    by the count of samples: this thread samples less often while the machine is busy, which with TS busy
    is mostly while S is stopped (TS's slot), so counting samples made S's share look smaller with TS busy
    (0.495-0.499 against 0.53 idle in a full suite) without anything having changed when S ran."""

    def __init__(self, pid: int):
        self.pid, self.seconds, self.stopped = pid, 0.0, 0.0
        self.halt = threading.Event()

    def _run(self) -> None:
        last, was = time.monotonic(), states([self.pid]) == ["T"]
        while not self.halt.wait(0.005):
            now, is_ = time.monotonic(), states([self.pid]) == ["T"]
            self.seconds += now - last
            self.stopped += (now - last) * (was + is_) / 2
            last, was = now, is_

    def __enter__(self) -> "Stopped":
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.thread.join()


def measure(s_client, s_results: Results, ts: TsLoad, first: int, s_master: int) -> tuple[dict, int]:
    """S's latencies over :data:`BLOCKS` alternating blocks, by TS's condition and then by phase
    (``{"busy": [[block 0's], [block 2's], ...], "idle": [...]}``); the share of the time S's master
    was stopped, by TS's condition; TS's instants done while busy; the next free S instant."""
    lat: dict[str, list[list[float]]] = {"busy": [], "idle": []}
    stopped = {"busy": [0.0, 0.0], "idle": [0.0, 0.0]}  # seconds stopped, seconds sampled
    ts_done = 0
    k = first
    pace = threading.Event()  # never set: the producer's pacing waits on it
    origin = time.monotonic()
    for b in range(BLOCKS):
        busy = b % 2 == 0
        if busy:
            ts.busy()
        else:
            ts_done += ts.idle()
        # the same point of the round grid for every block, a round from now at least (TS under way)
        start = origin + (int((time.monotonic() - origin) / ROUND) + 2) * ROUND
        sent = {}
        with Stopped(s_master) as sampled:
            for i in range(BLOCK):
                left = start + i * PERIOD - time.monotonic()
                if left > 0:
                    pace.wait(left)
                sent[k] = time.monotonic()
                s_client.ingest([("Vitals", vitals(k, "S"), k)], labelled=True)
                k += 1
        assert s_results.wait(k - 1, 60), "S's last instant never came out"
        cond = "busy" if busy else "idle"
        lat[cond].append([s_results.arrived[t] - at for t, at in sent.items()])
        stopped[cond][0] += sampled.stopped
        stopped[cond][1] += sampled.seconds
    return {"latency": lat, "ts_instants_while_busy": ts_done,
            "s_stopped": {c: round(n / total if total else 0.0, 3) for c, (n, total) in stopped.items()}}, k


def paired(lat: dict) -> list[float]:
    """Per phase: the mean latency with TS busy less the mean latency with TS idle at that phase."""
    return [statistics.mean(b[i] for b in lat["busy"]) - statistics.mean(b[i] for b in lat["idle"])
            for i in range(BLOCK)]


def summary(result: dict) -> dict:
    d = paired(result["latency"])
    out = {"paired_difference": round(statistics.median(d), 4), "paired_mean": round(statistics.mean(d), 4),
           "by_phase": [round(x, 3) for x in d], "ts_instants_while_busy": result["ts_instants_while_busy"],
           "s_stopped": result["s_stopped"]}
    for cond, blocks in result["latency"].items():
        xs = [x for b in blocks for x in b]
        out[cond] = {"median": round(statistics.median(xs), 4), "p90": round(statistics.quantiles(xs, n=10)[-1], 4),
                     "n": len(xs)}
    out["median_difference"] = round(out["busy"]["median"] - out["idle"]["median"], 4)
    # per block, its mean latency (a block covers every phase once); busy less idle by the blocks' medians:
    # one block hit by a burst of the machine's other load moves neither median
    means = {c: [statistics.mean(b) for b in blocks] for c, blocks in result["latency"].items()}
    out["block_means"] = {c: [round(x, 3) for x in xs] for c, xs in means.items()}
    out["block_difference"] = round(statistics.median(means["busy"]) - statistics.median(means["idle"]), 4)
    return out


@pytest.fixture
def state_dir(tmp_path: Path):
    """The cluster's state: in memory (``/dev/shm``) when it has room, else ``tmp_path``; an in-memory
    one is removed after the test, whatever its outcome."""
    shm = Path(os.environ.get("STRATA_TEST_SHM", "/dev/shm"))
    try:
        st = os.statvfs(shm)
        base = Path(tempfile.mkdtemp(prefix="strata-slots-", dir=shm)) if st.f_bavail * st.f_frsize >= 2 << 30 else None
    except OSError:
        base = None
    try:
        yield (base or tmp_path) / "state"
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


def test_a_higher_levels_load_does_not_move_a_lower_levels_timing_under_fixed_slots(tmp_path, state_dir):
    why = signals_work()
    if why:
        pytest.skip(f"the slot gate needs SIGSTOP/SIGCONT of process groups: {why}")
    cfg = write_config(tmp_path, BATTLEFIELD_TOML + f'\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = {SLOT}\n'
                       'dispatch_linger = false\n',
                       {"sam": "S", "tess": "TS"})
    state = state_dir
    t0 = time.monotonic()
    r = strata("up", "--config", str(cfg), "--levels", "S,TS", "--workers", "1", "--state-dir", str(state),
               timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    cluster = json.loads(r.stdout)
    manual = ts = None
    try:
        record = json.loads((state / "cluster.json").read_text())
        gate = next(p for p in record["processes"] if p["role"] == "gate")
        assert (gate["name"], gate["level"]) == ("slots", "host")
        levels = [p["pid"] for p in record["processes"] if p["role"] != "gate"]
        wait_for(lambda: "T" in states(levels), 10, "the gate stopping a level")  # one level is always stopped

        s = login(cluster, "sam", "S")
        s_results = Results(login(cluster, "sam", "S"), s.register([S_QUERY])[0].query_id)
        ts = TsLoad(cluster)
        s_master = next(p["pid"] for p in record["processes"] if p["role"] == "master" and p["level"] == "S")
        fixed, k = measure(s, s_results, ts, 1, s_master)
        first, st = None, summary(fixed)
        # once more when either fixed-slot bound is passed: a leak shows again, a burst of other load seldom
        if abs(st["block_difference"]) > TOLERANCE or \
                abs(st["s_stopped"]["busy"] - st["s_stopped"]["idle"]) > STOPPED_TOLERANCE:
            first = st
            fixed, k = measure(s, s_results, ts, k, s_master)

        # stop the fixed-slot gate: every process runs again; then a round-robin gate, by hand
        os.killpg(gate["pid"], signal.SIGTERM)
        wait_for(lambda: states([gate["pid"]])[0] in ("gone", "Z"), 10, "the gate to exit")
        wait_for(lambda: "T" not in states(levels), 5, "every process continued")
        ready = tmp_path / "rr.json"
        manual = subprocess.Popen([sys.executable, "-m", "strata", "slots", "--state-dir", str(state), "--scheduler",
                                   "round_robin", "--ready-file", str(ready)], start_new_session=True,
                                  stdout=open(tmp_path / "rr.log", "wb"), stderr=subprocess.STDOUT)
        wait_for(ready.exists, 20, "the round-robin gate")
        rr, k = measure(s, s_results, ts, k, s_master)
        rr["ts_instants_while_busy"] += ts.idle()
    finally:
        if ts is not None:
            ts.close()
        if manual is not None:
            manual.terminate()
            manual.wait(10)
        down = strata("down", "--state-dir", str(state), timeout=120)
    gates = [f.read_text().strip().splitlines()[-1] for f in (state / "logs" / "slots.log", tmp_path / "rr.log")]
    assert down.returncode == 0, down.stderr

    report = {"fixed_slot": summary(fixed), "fixed_slot_first": first, "round_robin": summary(rr),
              "seconds": round(time.monotonic() - t0, 1),
              "gates": gates}
    print(json.dumps(report, indent=1))
    # S's results are exactly its input, one row per instant, whatever TS did
    assert all(s_results.rows.get(t) == [("S", "a", float(t % 100_000) * 1000)] for t in range(1, k)), "S's rows"
    # TS really was busy while it was said to be, under both gates
    assert report["fixed_slot"]["ts_instants_while_busy"] >= 2, report
    assert report["round_robin"]["ts_instants_while_busy"] >= 2, report
    fixed, rr = report["fixed_slot"], report["round_robin"]
    # fixed slot: when S runs, and so its timing, does not depend on TS's load
    assert abs(fixed["s_stopped"]["busy"] - fixed["s_stopped"]["idle"]) <= STOPPED_TOLERANCE, report
    assert abs(fixed["block_difference"]) <= TOLERANCE, report
    # round robin: it does (the channel the slot policies close; its size is written down, see above)
    assert rr["s_stopped"]["busy"] - rr["s_stopped"]["idle"] > 0.2, report
    assert rr["paired_difference"] > 0, report
