"""The host's gate (``strata slots``): level groups sharing this host take turns by ``[cluster] scheduler``.

A trusted process of the host.  It reads the embedded cluster's record (``STATE_DIR/cluster.json``,
written by deploy/local.py: each process with its level and pid; each is its own process group, so
a worker's Spark JVM and its Python workers go with it) and, round after round, asks the plan of
:class:`strata.scheduling.Scheduler` which levels run now: it continues (SIGCONT) their process
groups and stops (SIGSTOP) every other level's.  The plan's logic is in strata/scheduling.py (which
policy closes which channel, and why); this module is its thin I/O: the record, the signals, the
readings and the clock.

**Readings** (round robin, revised fixed slot, dynamic threshold; fixed slot reads nothing, its
plan must not depend on anything but the clock): per level, its processes' CPU seconds in the last
round (psutil, the process groups' trees) and whether input waits for it unread (a byte in the
receive queue of one of its TCP sockets: /proc/net/tcp, looked up only when some socket of the host
has one).  The gate is trusted: it reads every level.

**Always leaves everything running.**  Whatever way the gate ends, every level's processes run
again: on SIGTERM, SIGINT or SIGHUP, on an error, when the record is gone (``strata down``), it
continues all of them before it exits; and should it die without a word (SIGKILL, the OOM killer),
its **watchdog** does: a child in its own session, forked before the first signal is sent, that
holds the read end of a pipe only the gate writes to.  The gate's death closes the pipe; the
watchdog then continues every process the record names and exits.  ``strata down`` stops the gate
first and continues every process before it stops them (:func:`release`).

``strata up`` starts the gate (:func:`start_gate`) once the levels' processes run when ``[cluster]
scheduler`` is not ``shared``, and records it in ``cluster.json`` as process ``slots`` (role
``gate``, level ``host``); ``strata up --restart slots`` starts it again.  A configuration whose
rounds are longer than a stopped worker's heartbeats survive is refused in one line before anything
starts (:func:`check_round`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from strata.config import ConfigError, load_config
from strata.errors import EXIT_OK, EXIT_REJECTED, CliError
from strata.private import open_private_log, write_private
from strata.scheduling import POLICIES, Reading, Scheduler, linear_levels, longest_pause, round_problem
from strata.serving import pid_alive, progress

__all__ = ["Gate", "Record", "check_round", "start_gate", "release", "continue_all", "start_watchdog",
           "pending_inodes", "cpu_seconds", "run_gate", "add_parsers", "GATE_NAME", "GATE_ROLE", "GATE_LEVEL"]

#: how the gate appears in ``cluster.json``
GATE_NAME, GATE_ROLE, GATE_LEVEL = "slots", "gate", "host"


def check_round(cfg, n_levels: int, scheduler: str | None = None) -> None:
    """Refuse (ConfigError, one line) a scheduler whose rounds are longer than a stopped level's
    workers survive (strata/scheduling.py :func:`~strata.scheduling.round_problem`)."""
    c = cfg.cluster
    policy = scheduler or c.scheduler
    problem = round_problem(policy, n_levels, c.slot_seconds, c.heartbeat_seconds)
    if problem:
        where = f"{cfg.path}: " if cfg.path is not None else ""
        raise ConfigError(where + problem)


# ---- the cluster's record ------------------------------------------------------------------------------
class Record:
    """``cluster.json``: the process groups of each level (the gate left out), read again whenever
    the file changes (``strata up --restart`` gives a process a new pid)."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "cluster.json"
        self._stamp = None
        self.data: dict | None = None
        self.groups: dict[str, list[int]] = {}

    def load(self) -> bool:
        """Read the record if it changed; False once it is gone (the cluster was stopped)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        if stamp != self._stamp:
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                return self.data is not None  # written right now: keep the last one
            self._stamp, self.data = stamp, data
            groups: dict[str, list[int]] = {}
            for p in data.get("processes", []):
                if p.get("role") != GATE_ROLE and isinstance(p.get("pid"), int):
                    groups.setdefault(p["level"], []).append(p["pid"])
            self.groups = groups
        return True


def _killpg(pgid: int, sig: int) -> None:
    os.killpg(pgid, sig)


def continue_all(state_dir: Path, kill: Callable[[int, int], None] = _killpg) -> int:
    """SIGCONT every process group ``cluster.json`` names (the gate's watchdog, and :func:`release`)."""
    rec = Record(state_dir)
    if not rec.load():
        return 0
    n = 0
    for pids in rec.groups.values():
        for pid in pids:
            try:
                kill(pid, signal.SIGCONT)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
    return n


# ---- readings --------------------------------------------------------------------------------------------
def pending_inodes() -> set[int]:
    """Inodes of this host's TCP sockets with unread bytes in their receive queue (/proc/net/tcp, tcp6)."""
    out: set[int] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and int(parts[4].rsplit(":", 1)[1], 16) > 0:
                        out.add(int(parts[9]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    except OSError:
        pass
    return out


#: how often a process tree's members are looked up again (a scan of /proc; a worker's JVM starts once)
TREE_SECONDS = 5.0


def _tree(pid: int, cache: dict, now: float | None = None) -> list:
    """The psutil processes of ``pid``'s tree (the process and its descendants: a worker's JVM), looked
    up again every :data:`TREE_SECONDS` (``cache``: pid -> (when, processes))."""
    import psutil  # deferred: a few ms, only the gate reads processes

    now = time.monotonic() if now is None else now
    hit = cache.get(pid)
    if hit is not None and now - hit[0] < TREE_SECONDS and hit[1] and hit[1][0].is_running():
        return hit[1]
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        procs = []
    cache[pid] = (now, procs)
    return procs


def _run_seconds(pid: int) -> float:
    """Seconds the threads of process ``pid`` have run so far, to the nanosecond (/proc/PID/task/*/schedstat;
    /proc/PID/stat counts in clock ticks, 10 ms, too coarse for a 0.25 s slot).  A thread that ended is
    no longer counted: a reading goes down then (callers keep no negative difference)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def cpu_seconds(pids: list[int], cache: dict) -> float:
    """CPU seconds the process trees of ``pids`` (each process with its descendants) used so far."""
    return sum(_run_seconds(p.pid) for pid in pids for p in _tree(pid, cache))


class Readings:
    """Each level's :class:`~strata.scheduling.Reading` since the last call: the CPU seconds of its
    process trees, and, for the levels in ``stopped`` (those that did not run in the last round: the
    others' CPU tells), whether input waits in one of its sockets (reading /proc/net/tcp costs ~7 ms)."""

    def __init__(self):
        self._cache: dict = {}
        self._cpu: dict[str, float] = {}

    def __call__(self, groups: dict[str, list[int]], stopped=()) -> dict[str, Reading]:
        waiting = pending_inodes() if any(lv in groups for lv in stopped) else set()
        out = {}
        for level, pids in groups.items():
            now = cpu_seconds(pids, self._cache)
            used = max(0.0, now - self._cpu.get(level, now))
            self._cpu[level] = now
            pending = False
            if waiting and level in stopped:
                pending = any(_socket_inodes(p.pid) & waiting for pid in pids for p in _tree(pid, self._cache))
            out[level] = Reading(used, pending)
        return out


# ---- the gate --------------------------------------------------------------------------------------------
class Gate:
    """Follows a :class:`~strata.scheduling.Scheduler`'s plans over the process groups of
    :class:`Record`: ``kill(pgid, signal)`` (os.killpg), ``clock`` (time.monotonic), ``sleep``,
    ``readings(groups, stopped) -> {level: Reading}`` (``stopped``: the levels that did not run in the
    last round; None: the plan takes no readings, fixed slot)."""

    def __init__(self, record: Record, scheduler: Scheduler, kill: Callable[[int, int], None] = _killpg,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 readings: Callable[..., dict] | None = None):
        self.record, self.scheduler = record, scheduler
        self.kill, self.clock, self.sleep, self.readings = kill, clock, sleep, readings
        self.stopped: set[int] = set()  # process groups this gate has stopped
        self.known: set[int] = set()  # every process group it has seen
        self.running: tuple[str, ...] | None = None
        self.rounds = 0
        self.stopping = False
        #: how late the slots' edges were (seconds after the plan's time): count, sum, max
        self.late = [0, 0.0, 0.0]

    def _signal(self, pgid: int, sig: int) -> bool:
        try:
            self.kill(pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def apply(self, runs: tuple[str, ...]) -> None:
        """Let the levels of ``runs`` run, stop every other level: stops first, then continues (two
        levels never run at once at a slot's edge); only groups whose state changes get a signal."""
        groups = self.record.groups
        self.known.update(p for pids in groups.values() for p in pids)
        for level, pids in groups.items():
            if level not in runs:
                for p in pids:
                    if p not in self.stopped and self._signal(p, signal.SIGSTOP):
                        self.stopped.add(p)
        for level in runs:
            for p in groups.get(level, ()):
                if p in self.stopped:
                    self._signal(p, signal.SIGCONT)
                    self.stopped.discard(p)
        self.running = tuple(runs)

    def release(self) -> None:
        """Continue every process group seen (and still recorded): everything runs again."""
        self.record.load()
        for p in sorted(self.known | {p for pids in self.record.groups.values() for p in pids}):
            self._signal(p, signal.SIGCONT)
        self.stopped.clear()
        self.running = None

    def round(self, start: float) -> float | None:
        """Plan and follow one round from ``start``; its end (None: the record is gone)."""
        if not self.record.load():
            return None
        last = self.scheduler.last
        stopped = tuple(lv for lv in self.record.groups if last is None or not last.ran(lv))
        readings = self.readings(self.record.groups, stopped) if self.readings is not None else None
        plan = self.scheduler.next_round(start, readings)
        for begin, end, runs in plan.timeline():
            if self.stopping:
                break
            late = self.clock() - begin
            self.late[0] += 1
            self.late[1] += max(0.0, late)
            self.late[2] = max(self.late[2], late)
            self.apply(runs)
            left = end - self.clock()
            if left > 0:
                self.sleep(left)
        self.rounds += 1
        return plan.end

    def run(self, rounds: int | None = None) -> None:
        """Rounds back to back, on the clock's schedule (a late start does not shift the next round's
        slots), until :attr:`stopping`, the record is gone or ``rounds`` rounds are done; then
        :meth:`release`."""
        try:
            start = self.clock()
            while not self.stopping and (rounds is None or self.rounds < rounds):
                end = self.round(start)
                if end is None:
                    break
                now = self.clock()
                # held up for longer than a round (the gate itself stopped or starved): start afresh now
                start = end if now - end <= self.scheduler.longest_round else now
        finally:
            self.release()


def start_watchdog(state_dir: Path) -> int:
    """Fork the gate's watchdog (its own session): when the gate is gone, however it went, it continues
    every process the record names.  Returns the write end of its pipe, which the gate keeps open
    (and never writes to) for as long as it lives."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the watchdog
        try:
            os.close(w)
            os.setsid()  # not in the gate's process group: a signal to the gate's group does not reach it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            while True:
                try:
                    if not os.read(r, 1):
                        break
                except InterruptedError:
                    continue
            continue_all(state_dir)
        finally:
            os._exit(0)
    os.close(r)
    return w


def release(procs: list[dict], timeout: float = 5.0) -> None:
    """What ``strata down`` does first: stop the gate (it continues every process as it goes) and
    continue every process group of ``procs`` (a gate that died, or an old record's)."""
    gates = [p for p in procs if p.get("role") == GATE_ROLE]
    for g in gates:
        try:
            os.killpg(g["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    while gates and any(pid_alive(g["pid"]) for g in gates) and time.monotonic() < deadline:
        time.sleep(0.02)
    for g in gates:
        if pid_alive(g["pid"]):
            try:
                os.killpg(g["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        if p.get("role") != GATE_ROLE:
            try:
                os.killpg(p["pid"], signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass


def start_gate(state_dir: Path, record: dict, scheduler: str, timeout: float = 30.0) -> dict | None:
    """Start the host's gate for the cluster of ``record`` (``strata up``, once the levels' processes
    run) unless ``scheduler`` is ``shared`` or the record holds one level only; record it in ``cluster.json`` and wait until it gates.
    Raises CliError (its log's tail) if it exits instead."""
    if scheduler == "shared":
        return None
    levels = {p.get("level") for p in record.get("processes", []) if p.get("role") != GATE_ROLE}
    if len(levels) < 2:  # one level runs in every slot: a gate would only read and signal
        progress(f"one level on this host: no slot gate ({scheduler} schedules between levels)")
        return None
    state_dir = Path(state_dir)
    ready = state_dir / "run" / f"{GATE_NAME}.json"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "strata", "slots", "--state-dir", str(state_dir.resolve()), "--ready-file",
           str(ready.resolve())]
    log_path = state_dir / "logs" / f"{GATE_NAME}.log"
    log = open_private_log(log_path)
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    entry = {"name": GATE_NAME, "role": GATE_ROLE, "level": GATE_LEVEL, "pid": p.pid, "ready": str(ready),
             "cmd": cmd, "env": {}}
    record["processes"].append(entry)
    write_private(state_dir / "cluster.json", json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-1000:].strip()
            what = "exited" if p.poll() is not None else f"did not start within {timeout:.0f} s"
            raise CliError(f"the slot gate {what}: {tail.splitlines()[-1] if tail else 'no output'}")
        time.sleep(0.02)
    progress(f"slot gate running ({scheduler}, pid {p.pid})")
    return entry


# ---- strata slots -------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _stop(signum, frame):
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # once: nothing may interrupt the release
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop()


def run_gate(state_dir: Path, scheduler: str | None = None, ready_file: str | None = None,
             seed: int | None = None) -> int:
    """``strata slots``: gate the cluster of ``state_dir`` until it is stopped or its record is gone."""
    state_dir = Path(state_dir)
    rec = Record(state_dir)
    if not rec.load():
        raise CliError(f"no cluster in {state_dir} (no cluster.json; start one with `strata up`)")
    try:
        cfg = load_config(rec.data["config"])
    except ConfigError as e:
        raise CliError(str(e)) from None
    policy = scheduler or cfg.cluster.scheduler
    if policy == "shared":
        raise CliError("[cluster] scheduler is \"shared\": the operating system shares the CPUs and there is "
                       "nothing to gate (set another scheduler in the configuration, or pass --scheduler)",
                       EXIT_REJECTED)
    levels = linear_levels(cfg.lattice, rec.groups)
    check_round(cfg, len(levels), policy)
    c = cfg.cluster
    sched = Scheduler(policy, levels, cfg.lattice.leq, slot_seconds=c.slot_seconds,
                      heartbeat_seconds=c.heartbeat_seconds, threshold=c.penalty_threshold, share=c.penalty_share,
                      rounds=c.penalty_rounds, seed=seed if seed is not None else int.from_bytes(os.urandom(8), "big"))
    keep = start_watchdog(state_dir)  # before the first signal the gate sends
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    gate = Gate(rec, sched, readings=None if policy == "fixed_slot" else Readings())
    try:
        if ready_file:
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(json.dumps({"role": GATE_ROLE, "pid": os.getpid(), "scheduler": policy,
                                       "levels": list(levels)}))
            tmp.replace(ready_file)
        progress(f"gating {', '.join(levels)} ({policy}, {c.slot_seconds:g} s slots; a level stops for at most "
                 f"{longest_pause(policy, len(levels), c.slot_seconds):.2f} s)")
        gate.run()
    except _Stop:
        gate.stopping = True
    finally:
        gate.release()  # run() did too; a signal may have come after it
        os.close(keep)
    n, total, worst = gate.late
    progress(f"gate stopped after {gate.rounds} rounds; every level's processes run (slot edges late by "
             f"{1000 * total / max(1, n):.1f} ms on average, {1000 * worst:.1f} ms at most)")
    return EXIT_OK


def cmd_slots(args) -> int:
    return run_gate(Path(args.state_dir), args.scheduler, args.ready_file, args.seed)


def add_parsers(sub) -> None:
    p = sub.add_parser("slots", help="the host's gate: level groups sharing this host take turns by [cluster] "
                                     "scheduler (strata up starts it; docs/scheduling.md)")
    p.add_argument("--state-dir", required=True, help="the cluster's state directory (its cluster.json)")
    p.add_argument("--scheduler", choices=[x for x in POLICIES if x != "shared"],
                   help="instead of the configuration's [cluster] scheduler")
    p.add_argument("--seed", type=int, help="dynamic_threshold's random penalties (default: from the OS)")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_slots)
