"""Where the CPU of a ``strata replay`` goes, per process, and the 2-core bound it sets (issue 35).

``python -m bench.cpu_budget [--tuples 2000000] [--small 20000] [--runs 3] [--queries range,rows]
[--profile DIR] [--json FILE]``: the battlefield CSVs of bench/userpath.py (20,000 Vitals tuples per
instant, 4 levels) replayed as a user types it, ``strata replay --level TS --workers 2
--chunk-seconds 1`` (an embedded cluster per run, defaults otherwise), with

* ``range``: ``SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid`` (issue 35's query);
* ``rows``: ``SELECT AVG(bp) FROM Vitals [ROWS 100]`` (the ROWS 100 AVG of the user's path, for
  comparison; at TS as well, so both read the same 2 M tuples).

While a run goes, every process of the replay's tree is sampled every 0.1 s from
``/proc/<pid>/stat`` (utime + stime; the tree is rescanned every 0.5 s, so processes that start
later, a JVM's children or the lazily started second worker, are found): the client (the
``strata replay`` process itself), the master (``strata master``), and per worker its Python
(``strata worker``) and its Spark JVM (``java ... SparkSubmit``, the worker's child; any other child,
e.g. spark-submit's shell, counts with the JVM as "JVM + children").  The window is the run after
start-up: from the ``replaying N tuples`` line (cluster ready, input read) to the ``accepted ...``
line (last result received, output written; the client is held with SIGSTOP while the end is read, so
the cluster's stop after it is not counted).  A process that exits inside the window keeps its last
sample.  Per role: CPU seconds in the window, CPU-µs per
tuple, and its share of the window's wall time (1.0 = one core busy throughout); the 2-core bound is
``2 / total CPU per tuple`` (the throughput if both cores did nothing but this run's work, no idle
time, no other jobs).  Each window is also split by the run's own ``--timings`` marks into
*sending* (the "replaying" line to the end of ``Ingest`` + ``Advance(finish)``: client encoding,
gRPC/TLS, the master's decode, shepherd, chunker and event log), *evaluation* (from there to the last
result: dispatch, transport, the engine, results) and *tail* (status call and writing the output),
and the JVMs' CPU by thread (``/proc/<jvm>/task/*``: executor task threads, C1/C2 compiler threads,
the VM thread (the serial collector's pauses run there), other).  The host's busy CPU over the window
(``/proc/stat``) says how much went to processes outside the run (other jobs on the VM, this
harness).  Every output is checked against DuckDB on every instant (bench/peers.check_range10,
levels included; bench/check.compare_avg for ROWS): a wrong output fails the run.

``--small N`` (default 20,000, 0 = none) runs that size too, interleaved, for the marginal CPU per
tuple ((CPU_big - CPU_small) / (N_big - N_small): a run's fixed costs, one Spark job's and the JIT's,
taken out).  Medians of ``--runs`` runs each.  ``--profile DIR`` adds one more RANGE run (not in the
medians) with py-spy (``py-spy record --nonblocking``, 100 Hz, Python frames; stacks blocked in a
wait counted apart) on the client, the master and each worker's Python over the window, and a Java
Flight Recorder recording (the "profile" settings) in each worker JVM, started with the JVM through
``STRATA_JAVA_OPTS`` (without the class-data archive, ``STRATA_CDS=0``: other options would build a
new one in the shared cache) and dumped with ``jcmd`` at the window's end, its samples kept from the
window only; it writes the raw profiles to DIR and prints their top frames.  py-spy's shares are of
samples where a thread was runnable or in a C call, not of CPU time: on a loaded host they are to be
scaled by the process's measured CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv

from bench import userpath as U
from bench.peers import RANGE10_QUERY
from bench.scaling import Expected as Checker  # DuckDB's answer per (workload, size), as the scaling runs check

QUERIES = {"range": RANGE10_QUERY, "rows": "SELECT AVG(bp) FROM Vitals [ROWS 100]"}
LEVEL = "TS"
HZ = os.sysconf("SC_CLK_TCK")
JAVA_BIN = Path(os.environ.get("JAVA_HOME", "/usr/lib/jvm/java-17-openjdk-amd64")) / "bin"
ROLES = ("client", "master", "worker 0 Python", "worker 0 JVM + children", "worker 1 Python",
         "worker 1 JVM + children", "other")
PHASES = ("sending", "evaluation", "tail")


def _log(msg: str) -> None:
    print(f"[cpu_budget] {msg}", flush=True)


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# ---- /proc ----------------------------------------------------------------------------------------------
def _stat(path: str) -> tuple[str, int, int] | None:
    """(comm, ppid, utime + stime ticks) of a /proc/<pid>[/task/<tid>]/stat file, None if gone."""
    try:
        with open(path, "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return None
    lp, rp = s.find("("), s.rfind(")")
    fields = s[rp + 2:].split()
    return s[lp + 1:rp], int(fields[1]), int(fields[11]) + int(fields[12])


def _all_ppids() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(f"/proc/{name}/stat")
            if st is not None:
                out[int(name)] = st[1]
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """{tid: (thread name, ticks)} of a process."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        st = _stat(f"/proc/{pid}/task/{t}/stat")
        if st is not None:
            out[int(t)] = (st[0], st[2])
    return out


def host_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the host since boot (/proc/stat's first line)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    total = sum(f[:8])
    return (total - idle) / HZ, total / HZ


def thread_group(name: str) -> str:
    """A JVM thread's group by its (15-character) name."""
    if name.startswith("Executor task"):
        return "executor tasks (the plan: Arrow → rows, aggregation)"
    if "CompilerThre" in name or name.startswith("C1 ") or name.startswith("C2 "):
        return "JIT compiler threads"
    if name.startswith("VM Thread") or name.startswith("GC ") or name.startswith("G1 "):
        return "VM thread / GC"
    return "other JVM threads (driver, py4j, Arrow serving, netty, ...)"


class Tree:
    """The replay's process tree, sampled every ``every`` s (rescanned every ``rescan`` s)."""

    def __init__(self, root: int, every: float = 0.1, rescan: float = 0.5):
        self.root, self.every, self.rescan = root, every, rescan
        self.last: dict[int, int] = {}  # pid -> last ticks seen
        self.cmd: dict[int, list[str]] = {}
        self.parent: dict[int, int] = {}
        self.series: list[tuple[float, dict[int, int]]] = []
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _scan(self) -> None:
        with self._scan_lock:
            self._scan_locked()

    def _scan_locked(self) -> None:
        ppids = _all_ppids()
        kids = defaultdict(list)
        for pid, pp in ppids.items():
            kids[pp].append(pid)
        found, todo = {self.root}, [self.root]
        while todo:
            for k in kids.get(todo.pop(), ()):
                if k not in found:
                    found.add(k)
                    todo.append(k)
        for pid in found:  # the command line read again: spark-class's shell execs the JVM in its pid
            argv = _cmdline(pid)
            if argv and argv != [""]:
                self.cmd[pid] = argv
            if pid not in self.parent:
                self.parent[pid] = ppids.get(pid, 0)
        self._pids |= found

    def sample(self) -> tuple[float, dict[int, int]]:
        now = time.monotonic()
        snap = {}
        for pid in list(self._pids):
            st = _stat(f"/proc/{pid}/stat")
            if st is not None:
                snap[pid] = st[2]
        with self._lock:
            for pid, t in snap.items():
                self.last[pid] = max(t, self.last.get(pid, 0))
            full = dict(self.last)
            self.series.append((now, full))
        return now, full

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_scan:
                self._scan()
                next_scan = time.monotonic() + self.rescan
            self.sample()
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def mark(self) -> tuple[float, dict[int, int]]:
        """A sample now (the tree rescanned first)."""
        self._scan()
        return self.sample()

    def at(self, t: float) -> dict[int, int]:
        """The last sample at or before ``t``."""
        with self._lock:
            best = self.series[0][1]
            for ts, snap in self.series:
                if ts <= t:
                    best = snap
                else:
                    break
            return best

    # -- roles
    def owner(self, pid: int) -> str:
        """client, master, worker <i>, or '' (not ours)."""
        seen = 0
        while pid and seen < 64:
            if pid == self.root:
                return "client"
            argv = self.cmd.get(pid, [])
            if len(argv) > 3 and argv[1:3] == ["-m", "strata"]:
                if argv[3] == "master":
                    return "master"
                if argv[3] == "worker":
                    rf = argv[argv.index("--ready-file") + 1] if "--ready-file" in argv else ""
                    return f"worker {Path(rf).stem.rsplit('-', 1)[-1] if rf else '?'}"
            pid = self.parent.get(pid, 0)
            seen += 1
        return ""

    def role(self, pid: int) -> str:
        own = self.owner(pid)
        argv = self.cmd.get(pid, [])
        if own.startswith("worker"):
            if len(argv) > 3 and argv[1:4] == ["-m", "strata", "worker"]:
                return f"{own} Python"
            return f"{own} JVM + children"
        if own == "client" and pid != self.root:
            return "other"  # nothing else should be the client's child but the cluster's processes
        return own or "other"

    def is_jvm(self, pid: int) -> bool:
        argv = self.cmd.get(pid, [])
        return bool(argv) and os.path.basename(argv[0]) == "java"

    def by_role(self, a: dict[int, int], b: dict[int, int]) -> dict[str, float]:
        out = dict.fromkeys(ROLES, 0.0)
        for pid, t in b.items():
            r = self.role(pid)
            out[r] = out.get(r, 0.0) + (t - a.get(pid, 0)) / HZ
        return out


# ---- one run ------------------------------------------------------------------------------------------
class Profilers:
    """py-spy on the Python processes of a run over its window, and the JVMs' flight recordings
    (started with the JVM through ``STRATA_JAVA_OPTS``: attaching ``jcmd`` takes seconds on a
    loaded 2-core VM) dumped at its end, their samples kept from the window only."""

    def __init__(self, tree: Tree, d: Path, tag: str):
        self.tree, self.d, self.tag = tree, d, tag
        self.t0 = time.time()
        self.spies: list[tuple[str, subprocess.Popen, Path]] = []
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        for pid in sorted(tree.cmd):
            role = tree.role(pid)
            if not Path(f"/proc/{pid}").exists():
                continue
            if role in ("client", "master") or role.endswith("Python"):
                out = d / f"{tag}_{role.replace(' ', '_')}_{pid}.pyspy.txt"
                # --nonblocking: the process is not paused per sample (--native needs that, and its pauses
                # made a 2 M RANGE run's processing 31 s against ~3 s on this VM)
                p = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw",
                                      "--nonblocking", "--output", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                self.spies.append((role, p, out))

    def stop(self) -> dict:
        t1 = time.time()
        jfrs = []
        for pid in sorted(self.tree.cmd):
            if self.tree.is_jvm(pid) and Path(f"/proc/{pid}").exists():
                role = self.tree.role(pid)
                out = self.d / f"{self.tag}_{role.split(' JVM')[0].replace(' ', '_')}_{pid}.jfr"
                r = subprocess.run([str(JAVA_BIN / "jcmd"), str(pid), "JFR.dump", "name=cpubudget", f"filename={out}"],
                                   capture_output=True, text=True)
                _log(f"JFR.dump of {pid} ({role}): exit {r.returncode}: {(r.stdout + r.stderr).strip()[-200:]}")
                jfrs.append((role, out))
        for role, p, out in self.spies:
            p.send_signal(signal.SIGINT)
        res = {}
        for role, p, out in self.spies:
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if out.exists():
                res[role] = {"file": str(out), **summarize_pyspy(out)}
            else:
                res[role] = {"error": (err or "")[-500:]}
        for role, out in jfrs:
            if out.exists():
                res[role] = {"file": str(out), **summarize_jfr(out, self.t0, t1)}
        return res


JFR_OPTION = "-XX:StartFlightRecording=name=cpubudget,settings=profile"


def profiled_env() -> dict:
    """The profiled run's workers: their JVM options plus a flight recording from the start (no class-data
    archive: a new option set would build one in the shared cache)."""
    from worker.spark import java_options

    return {"STRATA_JAVA_OPTS": " ".join(java_options() + [JFR_OPTION]), "STRATA_CDS": "0"}


IDLE = ("select", "wait", "readinto", "recv", "sleep", "epoll", "poll", "futex", "accept", "pthread_cond",
        "sem_timedwait", "sem_wait", "__libc_read", "nanosleep", "clock_nanosleep", "take_gil", "completion_queue_next",
        "cq_next", "acquire_lock", "simplequeue_get", "os_read", "pthread_join", "wait_for_tstate")


def _idle(names: list[str]) -> bool:
    """A stack blocked in a wait: its leaf, or one of the few frames above an unnamed libc leaf, waits."""
    leaf = names[-1]
    tail = names[-6:] if leaf.startswith("0x") or "(libc" in leaf or "(libpthread" in leaf else names[-1:]
    if any(n.split(" (")[0].endswith("channel_spin") for n in tail):
        return True  # gRPC's channel spin thread: a completion-queue wait in C
    return any(w in n.split(" (")[0].lower() for n in tail for w in IDLE)


def summarize_pyspy(path: Path, top: int = 15) -> dict:
    """Self (leaf) and inclusive frames of a py-spy raw (collapsed) profile, in samples; stacks whose
    leaf is a blocking call (select, wait, recv, futex, ...: py-spy's idle detection misses some) are
    counted apart as idle and left out of the rest."""
    leaf, incl = Counter(), Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [f for f in stack.split(";") if not f.startswith("thread (") and not f.startswith("process ")]
        names = [f.rsplit(":", 1)[0] + ")" if ":" in f else f for f in frames]  # the line number off
        if names and _idle(names):
            idle += n
            continue
        if names:
            leaf[names[-1]] += n
        for f in set(names):
            incl[f] += n
    return {"samples": total, "idle_samples": idle, "active_seconds_at_100hz": (total - idle) / 100,
            "self": leaf.most_common(top), "inclusive": incl.most_common(top + 10)}


def _jfr_time(v) -> float | None:
    import datetime

    if not isinstance(v, str):
        return None
    import re

    g = re.fullmatch(r"([0-9T:-]+)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?", v.strip())
    if not g:
        return None
    zone = "+00:00" if g.group(3) in (None, "Z") else g.group(3)
    m = g.group(1) + (f".{g.group(2)[:6]}" if g.group(2) else "") + zone
    try:
        t = datetime.datetime.fromisoformat(m)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def summarize_jfr(path: Path, t0: float | None = None, t1: float | None = None, top: int = 20) -> dict:
    """Top frames of a JFR recording's execution samples (the Java threads running Java code), those
    between the wall times ``t0`` and ``t1`` only."""
    r = subprocess.run([str(JAVA_BIN / "jfr"), "print", "--json", "--events", "jdk.ExecutionSample",
                        "--stack-depth", "64", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-500:]}
    events = json.loads(r.stdout)["recording"]["events"]
    leaf, incl, threads, cats = Counter(), Counter(), Counter(), Counter()
    kept = 0
    for e in events:
        v = e["values"]
        ts = _jfr_time(v.get("startTime"))
        if t0 is not None and ts is not None and not (t0 <= ts <= t1):
            continue
        kept += 1
        thread = ((v.get("sampledThread") or {}).get("javaName") or "?")
        threads[thread.split(" for task")[0].split(" (")[0]] += 1
        frames = ((v.get("stackTrace") or {}).get("frames") or [])
        names = [f"{f['method']['type']['name']}.{f['method']['name']}" for f in frames]
        if names:
            leaf[names[0]] += 1
        for n in set(names):
            incl[n] += 1
        cats[jvm_category(names, thread)] += 1
    return {"samples": kept, "samples_recorded": len(events), "self": leaf.most_common(top),
            "inclusive": incl.most_common(top + 10),
            "threads": threads.most_common(8), "categories": cats.most_common()}


def jvm_category(names: list[str], thread: str = "") -> str:
    """What a JVM sample (frames leaf first) was doing: by its thread, then by the first frame that tells."""
    low = [n.lower() for n in names]
    if thread.startswith("Executor task"):
        for n in low:
            if "arrow" in n or "columnarbatch" in n or "columnvector" in n:
                return "executor: Arrow batches → rows"
            if "shuffle" in n or "serializer" in n or "sorter" in n:
                return "executor: shuffle write / read"
            if ("generatedclass" in n or "murmur3" in n or "bytestobytesmap" in n or "aggregationmap" in n
                    or "unsaferow" in n or "hashaggregate" in n or "bufferedrowiterator" in n):
                return "executor: generated plan (hash aggregation, expand, projection)"
        return "executor: other"
    if thread.startswith("serve-Arrow") or any("arrowrddserver" in n or "readarrowstream" in n for n in low):
        return "driver: Arrow stream from Python"
    if any("py4j" in n for n in low) or thread.startswith("Thread-"):
        if any("analysis" in n or "analyzer" in n or "optimizer" in n or "queryplanner" in n or "sparkstrategies" in n
               or "queryexecution" in n or "checkanalysis" in n for n in low):
            return "driver: analysis, optimisation, planning (catalyst)"
        if any("dagscheduler" in n or "runjob" in n or "collect" in n for n in low):
            return "driver: job submission / collecting results"
        return "driver: other py4j calls"
    return f"other thread ({thread.split('-')[0][:30]})"


def run_once(cfg: Path, d: Path, csv: Path, query: str, tag: str, profile: Path | None = None) -> dict:
    out, tfile = d / f"out_{tag}.csv", d / f"timings_{tag}.json"
    cmd = U.STRATA + ["replay", "--config", str(cfg), "--user", "jane", "--level", LEVEL, "--query", query,
                      "--input", f"Vitals={csv}", "--output", str(out), "--timings", str(tfile),
                      "--workers", "2", "--chunk-seconds", "1"]
    la0 = loadavg()
    t0 = time.monotonic()
    env = {**U._env(), **(profiled_env() if profile is not None else {})}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tree = Tree(p.pid)
    marks: dict = {}
    err_lines: list[str] = []
    prof = None
    try:
        for line in p.stderr:
            err_lines.append(line)
            if line.startswith("[strata] replaying ") and "start" not in marks:
                marks["start"] = tree.mark()
                marks["host_start"] = host_busy()
                marks["self_start"] = resource.getrusage(resource.RUSAGE_SELF)
                marks["jvm_threads_start"] = {pid: _threads(pid) for pid in tree.cmd if tree.is_jvm(pid)}
                marks["wall_start"] = time.time()
                if profile is not None:
                    prof = Profilers(tree, profile, tag)
            elif line.startswith("[strata] accepted ") and "end" not in marks:
                # the client is held (SIGSTOP) while the window's end is read: right after this line it
                # stops its cluster, and a JVM shutting down would blur the end (its threads gone first)
                os.kill(p.pid, signal.SIGSTOP)
                try:
                    marks["jvm_threads_end"] = {pid: _threads(pid) for pid in tree.cmd if tree.is_jvm(pid)}
                    marks["end"] = tree.sample()
                    marks["host_end"] = host_busy()
                    marks["self_end"] = resource.getrusage(resource.RUSAGE_SELF)
                    if prof is not None:  # the profiles are written before the cluster stops
                        marks["profile"] = prof.stop()
                        prof = None
                finally:
                    os.kill(p.pid, signal.SIGCONT)
        p.wait()
    finally:
        if prof is not None:
            prof.stop()
        tree.stop()
    wall = time.monotonic() - t0
    la1 = loadavg()
    if p.returncode != 0 or "start" not in marks or "end" not in marks:
        raise RuntimeError(f"replay {tag} exited {p.returncode}: {''.join(err_lines)[-2000:]}")
    tm = json.loads(tfile.read_text())
    (ts, a), (te, b) = marks["start"], marks["end"]
    window = te - ts
    roles = tree.by_role(a, b)
    # phases by the run's own marks (relative to the "replaying" line's t2, printed just before it)
    sent, process = tm.get("sent") or tm.get("ingested"), tm.get("process")
    cuts = [ts] + [min(te, ts + x) for x in (sent, process) if x is not None] + [te]
    phases = {}
    if len(cuts) == 4:
        snaps = [a, tree.at(cuts[1]), tree.at(cuts[2]), b]
        for name, s0, s1, c0, c1 in zip(PHASES, snaps, snaps[1:], cuts, cuts[1:]):
            phases[name] = {"seconds": round(c1 - c0, 3),
                            "cpu": {k: round(v, 3) for k, v in tree.by_role(s0, s1).items()
                                                                  if v > 0.0005}}
    jvm_threads: dict = {}
    for pid, end in marks["jvm_threads_end"].items():
        start = marks["jvm_threads_start"].get(pid, {})
        groups = Counter()
        for tid, (name, t) in end.items():
            groups[thread_group(name)] += (t - start.get(tid, (name, 0))[1]) / HZ
        total = (b.get(pid, 0) - a.get(pid, 0)) / HZ
        if not end and total <= 0.0005:
            continue  # spark-class's launcher JVM (it computes the command line and exits before the run)
        groups["threads ended in the window"] = max(0.0, total - sum(groups.values()))
        jvm_threads[f"{tree.role(pid)} {pid}"] = {k: round(v, 3) for k, v in groups.most_common() if v > 0.0005}
    hb = marks["host_end"][0] - marks["host_start"][0]
    su, se = marks["self_start"], marks["self_end"]
    harness = (se.ru_utime + se.ru_stime) - (su.ru_utime + su.ru_stime)
    ours = sum(roles.values())
    procs = {f"{pid} {tree.role(pid)}": " ".join(tree.cmd.get(pid, [])[:4])[:80] for pid in sorted(tree.cmd)}
    return {"tag": tag, "seconds": round(wall, 3), "window": round(window, 3), "start": tm.get("start"),
            "process": process, "sent": sent, "ingested": tm.get("ingested"),
            "after_start": round(wall - tm["start"], 3) if tm.get("start") else None,
            "load_before": la0, "load_after": la1, "cpu": {k: round(v, 3) for k, v in roles.items()},
            "cpu_total": round(ours, 3), "phases": phases, "jvm_threads": jvm_threads,
            "host_busy": round(hb, 3), "host_other": round(hb - ours - harness, 3), "harness_cpu": round(harness, 3),
            "chunks": tm.get("chunks"), "counters": tm.get("counters"), "workers_ready": tm.get("workers_ready"),
            "processes": procs, "output": str(out), "profile": marks.get("profile")}


# ---- the protocol ---------------------------------------------------------------------------------------
def measure(tuples: int, small: int, runs: int, workloads: list[str], profile: Path | None) -> dict:
    d = Path(tempfile.mkdtemp(prefix="strata-cpu-budget-"))
    try:
        cfg = U.setup(d)
        sizes = [n for n in (small, tuples) if n]
        files = U.write_inputs(d, sizes)
        checker = Checker({n: pcsv.read_csv(p) for n, p in files.items()})
        res: list[dict] = []
        for rep in range(runs):
            for wl in (workloads if rep % 2 == 0 else list(reversed(workloads))):
                for n in (sizes if rep % 2 == 0 else list(reversed(sizes))):
                    r = run_once(cfg, d, files[n], QUERIES[wl], f"{wl}_{n}_{rep}")
                    r.update(workload=wl, tuples=n, rep=rep)
                    accepted = (r["counters"] or {}).get("accepted")
                    if accepted not in (None, n):
                        raise RuntimeError(f"{wl} {n}: the master accepted {accepted} tuples")
                    r["check"] = checker.check(wl, n, Path(r["output"]))
                    os.unlink(r["output"])
                    res.append(r)
                    report_run(r)
        prof = None
        if profile is not None and "range" in workloads:
            profile.mkdir(parents=True, exist_ok=True)
            try:
                r = run_once(cfg, d, files[tuples], QUERIES["range"], f"range_{tuples}_profiled", profile=profile)
            except Exception as e:  # noqa: BLE001 - the measured runs stand without it
                _log(f"the profiled run failed: {e}")
                r = None
            if r is not None:
                r.update(workload="range", tuples=tuples, rep="profiled")
                r["check"] = checker.check("range", tuples, Path(r["output"]))
                os.unlink(r["output"])
                report_run(r)
                prof = r
        return {"tuples": tuples, "small": small, "runs": runs, "level": LEVEL,
                "queries": {w: QUERIES[w] for w in workloads},
                "cpus": os.cpu_count(), "results": res, "summary": summarize(res, tuples, small, workloads),
                "profiled_run": prof}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def report_run(r: dict) -> None:
    n = r["tuples"]
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu"].items() if v >= 0.005)
    _log(f"{r['workload']:5} {n:>9,} rep {r['rep']}: start-up {r['start']} s, processing {r['process']} s "
         f"({n / r['process']:,.0f}/s), window {r['window']} s, CPU {r['cpu_total']:.2f} s "
         f"({r['cpu_total'] / n * 1e6:.2f} µs/tuple; {cpu}); host busy {r['host_busy']:.2f} s "
         f"(outside the run {r['host_other']:.2f} s, harness {r['harness_cpu']:.2f} s); "
         f"load {r['load_before']} → {r['load_after']}; {r['check']}")
    if r["phases"]:
        _log("   phases: " + "; ".join(f"{k} {v['seconds']} s: "
                                       + ", ".join(f"{a} {b:.2f}" for a, b in v["cpu"].items())
                                       for k, v in r["phases"].items()))
    if r["jvm_threads"]:
        _log("   JVM threads: " + json.dumps(r["jvm_threads"]))


def summarize(res: list[dict], tuples: int, small: int, workloads: list[str]) -> dict:
    out = {}
    for wl in workloads:
        s: dict = {}
        for n in (tuples, small):
            rs = [r for r in res if r["workload"] == wl and r["tuples"] == n]
            if not rs:
                continue
            med = lambda f: statistics.median([f(r) for r in rs])  # noqa: E731
            roles = {k: med(lambda r, k=k: r["cpu"].get(k, 0.0)) for k in ROLES}
            total = med(lambda r: r["cpu_total"])
            phases = {}
            for ph in PHASES:
                if all(ph in r["phases"] for r in rs):
                    phases[ph] = {"seconds": med(lambda r, ph=ph: r["phases"][ph]["seconds"]),
                                  "cpu": {k: med(lambda r, ph=ph, k=k: r["phases"][ph]["cpu"].get(k, 0.0))
                                          for k in ROLES}}
            per_run = []
            for r in rs:
                merged = Counter()
                for groups in r["jvm_threads"].values():
                    merged.update(groups)
                per_run.append(merged)
            jvm = {g: [m.get(g, 0.0) for m in per_run] for g in set().union(*per_run)}
            s["big" if n == tuples else "small"] = {
                "tuples": n, "runs": len(rs), "seconds": med(lambda r: r["seconds"]),
                "start": med(lambda r: r["start"]), "process": med(lambda r: r["process"]),
                "window": med(lambda r: r["window"]), "after_start": med(lambda r: r["after_start"]),
                "throughput_process": round(n / med(lambda r: r["process"])),
                "throughput_after_start": round(n / med(lambda r: r["after_start"])),
                "cpu": roles, "cpu_total": total,
                "us_per_tuple": {k: v / n * 1e6 for k, v in roles.items()}, "us_per_tuple_total": total / n * 1e6,
                "bound_2_cores": round(2 * n / total), "cores_busy": total / med(lambda r: r["window"]),
                "host_busy": med(lambda r: r["host_busy"]), "host_other": med(lambda r: r["host_other"]),
                "harness_cpu": med(lambda r: r["harness_cpu"]),
                "phases": phases, "jvm_threads": {g: statistics.median(v) for g, v in jvm.items()},
                "stages_ms": {k: med(lambda r, k=k: (r["chunks"] or {}).get(k) or 0.0)
                              for k in ("chunks", "merged_p50", "wait_p50_ms", "wait_p99_ms", "engine_p50_ms",
                                        "engine_p99_ms", "transport_p50_ms", "transport_p99_ms")},
                "sent": med(lambda r: r["sent"] or 0.0), "ingested": med(lambda r: r["ingested"] or 0.0),
                "load": [r["load_before"] for r in rs], "load_after": [r["load_after"] for r in rs],
                "per_run": [{"process": r["process"], "cpu_total": r["cpu_total"], "window": r["window"]} for r in rs]}
        if "big" in s and "small" in s:
            b, m = s["big"], s["small"]
            dn = b["tuples"] - m["tuples"]
            s["marginal_us_per_tuple"] = {k: (b["cpu"][k] - m["cpu"][k]) / dn * 1e6 for k in ROLES}
            s["marginal_us_per_tuple_total"] = (b["cpu_total"] - m["cpu_total"]) / dn * 1e6
            s["marginal_bound_2_cores"] = round(2e6 / s["marginal_us_per_tuple_total"]) \
                if s["marginal_us_per_tuple_total"] > 0 else None
        out[wl] = s
    return out


def print_table(summary: dict) -> None:
    for wl, s in summary.items():
        b = s.get("big")
        if not b:
            continue
        print(f"\n{wl}: {b['tuples']:,} tuples, median of {b['runs']}: processing {b['process']:.2f} s "
              f"({b['throughput_process']:,}/s), ready→exit {b['after_start']:.2f} s "
              f"({b['throughput_after_start']:,}/s), "
              f"window {b['window']:.2f} s, start-up {b['start']:.1f} s, wall {b['seconds']:.1f} s")
        print(f"  {'role':28} {'CPU s':>7} {'µs/tuple':>9} {'marginal':>9}")
        for k in ROLES:
            if b["cpu"][k] < 0.005 and k != "other":
                continue
            marg = s.get("marginal_us_per_tuple", {}).get(k)
            print(f"  {k:28} {b['cpu'][k]:7.2f} {b['us_per_tuple'][k]:9.3f} "
                  f"{'' if marg is None else f'{marg:9.3f}'}")
        mt = s.get("marginal_us_per_tuple_total")
        print(f"  {'total':28} {b['cpu_total']:7.2f} {b['us_per_tuple_total']:9.3f} "
              f"{'' if mt is None else f'{mt:9.3f}'}")
        print(f"  2-core bound 2 / total: {b['bound_2_cores']:,} tuples/s"
              + (f" (marginal: {s['marginal_bound_2_cores']:,}/s)" if s.get("marginal_bound_2_cores") else "")
              + f"; cores busy with the run {b['cores_busy']:.2f} of 2; host busy {b['host_busy']:.2f} s "
                f"(outside the run {b['host_other']:.2f} s); load {b['load']} → {b['load_after']}")
        st = b["stages_ms"]
        print(f"  master's timings: {st['chunks']:.0f} dispatch units (merged p50 {st['merged_p50']:.0f} chunks), "
              f"engine p50/p99 {st['engine_p50_ms']:.0f}/{st['engine_p99_ms']:.0f} ms, transport p50/p99 "
              f"{st['transport_p50_ms']:.0f}/{st['transport_p99_ms']:.0f} ms, wait p50/p99 {st['wait_p50_ms']:.0f}/"
              f"{st['wait_p99_ms']:.0f} ms; sending (Ingest + Advance) {b['sent']:.2f} s")
        for ph, v in b["phases"].items():
            print(f"  {ph:10} {v['seconds']:.2f} s: "
                  + ", ".join(f"{k} {c:.2f}" for k, c in v["cpu"].items() if c >= 0.005))
        if b["jvm_threads"]:
            print("  JVM threads: " + ", ".join(f"{g} {c:.2f}" for g, c in sorted(b["jvm_threads"].items(),
                                                                                  key=lambda x: -x[1])))


def print_profile(prof: dict | None) -> None:
    if not prof or not prof.get("profile"):
        return
    print(f"\nprofiled run: processing {prof['process']} s, CPU {prof['cpu_total']} s ({prof['cpu']})")
    for role, p in prof["profile"].items():
        if "error" in p:
            print(f"  {role}: {p['error']}")
            continue
        idle = f", {p['idle_samples']} of them idle" if "idle_samples" in p else ""
        print(f"  {role}: {p['samples']} samples{idle}"
              + f" ({p['file']})")
        if "categories" in p:
            print("    categories: " + "; ".join(f"{c} {n}" for c, n in p["categories"]))
            print("    threads: " + "; ".join(f"{c} {n}" for c, n in p["threads"]))
        print("    self: " + "; ".join(f"{f} {n}" for f, n in p["self"][:12]))
        print("    inclusive: " + "; ".join(f"{f} {n}" for f, n in p["inclusive"][:20]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_budget", description=__doc__.splitlines()[0])
    ap.add_argument("--tuples", type=int, default=2_000_000)
    ap.add_argument("--small", type=int, default=20_000, help="also this size, for the marginal cost (0: none)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--queries", default="range,rows", help="range, rows or both")
    ap.add_argument("--profile", metavar="DIR", help="one more RANGE run under py-spy and JFR; profiles into DIR")
    ap.add_argument("--json", metavar="FILE", help="write every run's figures to FILE")
    args = ap.parse_args(argv)
    wls = [w for w in args.queries.split(",") if w]
    bad = [w for w in wls if w not in QUERIES]
    if bad:
        ap.error(f"unknown queries {bad}")
    res = measure(args.tuples, args.small, args.runs, wls, Path(args.profile) if args.profile else None)
    print_table(res["summary"])
    print_profile(res.get("profiled_run"))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
