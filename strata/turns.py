"""Turns: how the levels served by one trusted process take turns in it (issue 33; dissertation §5.4,
§6.4, §9.1.5).  Used by the trusted worker (worker/server.py: each level's ``Execute`` calls) and the
trusted master (master/trusted.py: each level's dispatch steps, result merges and ingest batches).

A trusted worker (docs/trusted.md) executes the chunks of every level it serves in one process and
one Spark session.  Without a scheduler (``[cluster] scheduler = "shared"``) the levels' calls run
concurrently: a higher level's heavy chunk slows a lower level's chunk running beside it, so *when* a
lower level's results come out depends on the higher level's load, a timing channel.  This module
makes the levels take turns inside the process, by the plans of :mod:`strata.scheduling` (the same
policies the host gate, ``strata slots``, applies to whole processes in the replicated mode):

* a round is a :class:`~strata.scheduling.Plan` made at its start from each level's own reading of
  the last round (:class:`~strata.scheduling.Reading`: the seconds its calls ran, whether a call of it
  waited or ran), by :meth:`~strata.scheduling.Scheduler.next_round`; its slots follow one another on
  the monotonic clock, whatever the calls do;
* a call of level *L* (:meth:`Turns.turn`, around the whole of ``WorkerCore.execute``: decoding,
  Spark jobs, encoding) starts only while *L* runs in the current slot, and only if it is likely to
  end before its **deadline**: the start of the next slot in which a level runs that does not
  dominate *L* (or the round's end; none for the bottom level, which every level dominates).  A call may thus run on into the slots of levels that dominate
  its own (they may depend on *L* anyway), never on purpose into a lower or incomparable level's.
  "Likely": the time left is at least :data:`ESTIMATE_MARGIN` x *L*'s own estimate, the longest of
  its last :data:`ESTIMATE_CALLS` calls; a call expected to be longer than that whole stretch starts
  only in the first :data:`OVERLONG_START` of its slot, and so does a level's first call of a kind (no
  estimate yet: it may be as long as any);
* a call of *L* does not start while a call of a level *L* strictly dominates is running (one that ran
  on into *L*'s slot, as it may), during the first :data:`LOWER_GRACE` of *L*'s slot: *L* waits for it
  to end instead of sharing the cores with it, so the lower level's call is not slowed by *L*'s work,
  and *L*'s waiting depends only on a level it dominates.  After the grace *L* starts beside it (a long
  or endless lower call does not stop *L*'s work), and the "first share of its slot" above counts
  from when the slot opened for *L* (the lower calls' end, or the grace's);
* calls are never pre-empted (a Spark job cannot be stopped and resumed): a call that outlives its
  deadline *overruns* it, and the next slot starts on time anyway, beside it.  Overruns are counted and
  timed per level (:meth:`Turns.stats`: a level's own figures only).  In a trusted worker the least
  level's Spark jobs take free task slots before an overrunning call's (worker/pools.py).

**What a lower level's timing can depend on** is then what :mod:`strata.scheduling` says of each
policy (``fixed_slot``: the clock only; ``revised_fixed_slot``: its own work and the levels it
dominates; ``round_robin``: whether higher levels have work, the channel left open by design;
``dynamic_threshold``: narrowed), plus the overruns of the calls of the level whose slot came before
(bounded by the estimates: a level's call starts only if its own past says it fits), plus what the
levels still share inside the process (the interpreter's lock while a call's Python runs, memory, the
JVM's garbage collector).  tests/test_turns.py measures it: with a real Spark session, a lower level's
waits for its turn with and without a higher level's load under each policy.

**One grid for master and workers.**  :func:`make_turns` starts the first round on a grid of the
round's length anchored at the epoch (``time.time()``; the turns then run on the monotonic clock), so
under ``fixed_slot`` a trusted master and its workers (one host, or hosts whose clocks NTP keeps
within a few milliseconds) open each level's slot at the same moments: a level's chunk sent at the
start of its slot is computed in the same slot and its result merged there, instead of waiting for
the worker's and then the master's next slot.  The other policies' plans follow each process's own
readings, so only their first round is aligned.

The module is plain logic over a clock and a condition variable: no Spark, no gRPC.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from strata.scheduling import Reading, Scheduler, linear_levels

__all__ = ["Turns", "ESTIMATE_CALLS", "ESTIMATE_MARGIN", "LOWER_GRACE", "OVERLONG_START", "grid_start", "make_turns"]

#: a level's estimate of its next call: the longest of its last this many calls
ESTIMATE_CALLS = 8
#: a call starts only if its deadline is at least this many times its level's estimate away
ESTIMATE_MARGIN = 1.25
#: a call expected to outlast all the time to its deadline starts only in this first share of its slot
OVERLONG_START = 0.1
#: a call waits for the calls of the levels below it that ran on into its slot only this first share of the
#: slot: then it starts beside them (a long lower call must not stop a higher level's work)
LOWER_GRACE = 0.5


def grid_start(now: float, period: float, wall_minus_clock: float) -> float:
    """The first time at or after ``now`` (the turns' clock) that falls on a grid of ``period`` seconds
    anchored at the epoch; ``wall_minus_clock``: the wall clock's reading less the turns' clock's."""
    wall = now + wall_minus_clock
    return math.ceil(wall / period - 1e-9) * period - wall_minus_clock


@dataclass
class _Current:
    runs: tuple[str, ...] = ()
    start: float = 0.0
    end: float = 0.0
    #: the round's slots after this one: (from, to, levels running)
    after: tuple = ()
    round_end: float = 0.0


class Turns:
    """When each level's calls may run in one trusted worker (module docstring).

    ``scheduler``: the plan maker (its policy is not ``shared``); ``clock``: monotonic seconds;
    ``wall``: when given (``time.time``), the rounds start on a grid of the round's length anchored at
    the epoch of that clock (:func:`grid_start`; module docstring).  :meth:`start` runs the rounds in a
    thread; :meth:`turn` is what a call waits in."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] | None = None):
        if scheduler.policy == "shared":
            raise ValueError("the shared policy has no turns: the levels' calls run concurrently")
        self.scheduler = scheduler
        self.clock = clock
        self.wall = wall
        #: the grid's period: a fixed-slot round (each level's slot once)
        self.period = len(scheduler.levels) * scheduler.slot_seconds
        self.levels = scheduler.levels
        self._cond = threading.Condition()
        self._current = _Current()
        self._waiting: Counter = Counter()  # calls waiting for a turn, per level
        self._running: Counter = Counter()
        self._busy: dict[str, float] = {lv: 0.0 for lv in self.levels}  # seconds its calls ran this round
        self._run_from: dict[str, float] = {}  # a level with calls running: since when (this round)
        self._ended: dict[str, float] = {}  # when each level's last call ended (its calls all done)
        #: the levels each level strictly dominates (whose calls it waits for within the grace)
        self._lower = {lv: tuple(lo for lo in self.levels if lo != lv and scheduler.leq(lo, lv)) for lv in self.levels}
        self._recent: dict[str, deque] = {lv: deque(maxlen=ESTIMATE_CALLS) for lv in self.levels}
        #: the recent calls of other kinds of a level's work ((level, kind) -> durations): each kind is
        #: estimated from its own past (a trusted master's checkpoints are longer than its ingest batches)
        self._kinds: dict[tuple[str, str], deque] = {}
        self._stats: dict[str, Counter] = {lv: Counter() for lv in self.levels}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.late_edges: deque = deque(maxlen=256)  # how late the round thread opened each slot (s)
        #: per level, its last calls' admissions: (the slot's levels, its start, its end, when the call started)
        self.admissions: dict[str, deque] = {lv: deque(maxlen=256) for lv in self.levels}

    # ---- the rounds -------------------------------------------------------------------------
    def readings(self, now: float) -> dict[str, Reading]:
        """Each level's reading of the round ending ``now`` (its own calls only), and a new round's
        accounts.  Called with the condition held."""
        out = {}
        for lv in self.levels:
            busy = self._busy[lv]
            if lv in self._run_from:  # calls still running: their time so far counts in this round
                busy += now - self._run_from[lv]
                self._run_from[lv] = now
            out[lv] = Reading(cpu_seconds=busy, pending=bool(self._waiting[lv] or self._running[lv]))
            self._busy[lv] = 0.0
        return out

    def plan_round(self, now: float):
        """The plan of the round starting ``now`` (:class:`~strata.scheduling.Plan`)."""
        with self._cond:
            readings = self.readings(now)
        self.rounds += 1
        return self.scheduler.next_round(now, readings)

    def open_slot(self, runs: tuple[str, ...], start: float, end: float, after=(), round_end: float | None = None) -> None:
        """From now until ``end`` the levels of ``runs`` may start calls; ``after``: the round's later
        slots (from, to, levels running), ending at ``round_end``."""
        with self._cond:
            self._current = _Current(tuple(runs), start, end, tuple(after), end if round_end is None else round_end)
            self._cond.notify_all()

    def first_start(self) -> float:
        """When the next round may start: now, or with a wall clock the next point of the grid."""
        now = self.clock()
        if self.wall is None:
            return now
        return grid_start(now, self.period, self.wall() - now)

    def _loop(self) -> None:
        next_start = self.first_start()
        while not self._stop.is_set():
            plan = self.plan_round(next_start)
            timeline = plan.timeline()
            for i, (start, end, runs) in enumerate(timeline):
                while not self._stop.is_set() and start - self.clock() > 0:  # a round on the grid: not yet
                    self._stop.wait(start - self.clock())
                self.late_edges.append(max(0.0, self.clock() - start))
                self.open_slot(runs, start, end, timeline[i + 1:], plan.end)
                while not self._stop.is_set():
                    left = end - self.clock()
                    if left <= 0:
                        break
                    self._stop.wait(left)
                if self._stop.is_set():
                    break
            next_start = plan.end
            behind = self.clock() - next_start
            if behind > self.scheduler.slot_seconds:  # far behind (a stall): restart now
                self.late_edges.append(behind)  # the next round's first slot, as late as this
                next_start = self.first_start()

    def start(self) -> "Turns":
        self._thread = threading.Thread(target=self._loop, name="level-turns", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more turns: every waiting and later call runs at once."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # ---- a call -----------------------------------------------------------------------------
    def _past(self, level: str, kind: str) -> deque:
        if kind == "call":
            return self._recent[level]
        return self._kinds.setdefault((level, kind), deque(maxlen=ESTIMATE_CALLS))

    def estimate(self, level: str, kind: str = "call") -> float:
        """The level's estimate of its next call of ``kind``: the longest of its last calls of that kind
        (0: none yet)."""
        recent = self._past(level, kind)
        return max(recent) if recent else 0.0

    def deadline(self, level: str) -> float:
        """When a call of ``level`` starting now must end: the start of the round's next slot in which a
        level runs that does not dominate ``level``; else the round's end (the next round's plan is not
        made yet), or never if every level served dominates ``level`` (a call of the bottom level may run
        on into any other level's slot).  The condition held."""
        leq = self.scheduler.leq
        cur = self._current
        for start, _end, runs in cur.after:
            if any(not leq(level, other) for other in runs):
                return start
        if all(leq(level, other) for other in self.levels):
            return float("inf")
        return cur.round_end

    def may_start(self, level: str, now: float, kind: str = "call") -> bool:
        """Whether a call of ``level`` (of ``kind``) may start at ``now`` (the condition held)."""
        cur = self._current
        if level not in cur.runs or now >= cur.end:
            return False
        opened = self._opened(level, now)
        if opened is None:  # a lower level's call ran on into this slot: it ends first (within the grace)
            return False
        stretch = self.deadline(level) - cur.start
        if not self._past(level, kind) and stretch != math.inf:  # nothing known yet: as if too long for it
            return now - opened <= OVERLONG_START * (cur.end - cur.start)
        need = ESTIMATE_MARGIN * self.estimate(level, kind)
        if need <= stretch:
            return self.deadline(level) - now >= need
        return now - opened <= OVERLONG_START * (cur.end - cur.start)  # too long for it: only as its slot opens

    def _below_running(self, level: str) -> bool:
        """Whether a call of a level ``level`` strictly dominates is running (the condition held)."""
        return any(self._running[lo] for lo in self._lower[level])

    def _grace_end(self) -> float:
        cur = self._current
        return cur.start + LOWER_GRACE * (cur.end - cur.start)

    def _opened(self, level: str, now: float) -> float | None:
        """When the current slot opened for ``level``'s calls: its start, or when the calls of the levels
        below that ran on into it ended, at the latest :data:`LOWER_GRACE` into it; None while such a call
        still runs within the grace.  The condition held."""
        cur, grace_end = self._current, self._grace_end()
        if self._below_running(level):
            return None if now < grace_end else grace_end
        ended = max((self._ended.get(lo, -math.inf) for lo in self._lower[level]), default=-math.inf)
        return max(cur.start, min(ended, grace_end))

    @contextmanager
    def turn(self, level: str, kind: str = "call"):
        """Wait for ``level``'s turn, then run the body as its call (timed for the estimate of its ``kind``
        and for the level's reading).  Once :meth:`stop` ped, calls run at once."""
        if level not in self._recent:
            raise ValueError(f"no turns for level {level}")
        t_wait = now = self.clock()
        with self._cond:
            self._waiting[level] += 1
            try:
                while not self._stop.is_set():
                    now = self.clock()
                    if self.may_start(level, now, kind):
                        break
                    cur = self._current
                    # wake at the slot's edge, or at the grace's end while a lower level's call runs, or when a
                    # slot opens or a call ends (notify)
                    wake = cur.end
                    if self._below_running(level) and now < self._grace_end():
                        wake = self._grace_end()
                    self._cond.wait(max(0.001, wake - now) if level in cur.runs and now < cur.end else None)
            finally:
                self._waiting[level] -= 1
            t0 = now  # the call starts when it was let in (the condition still held)
            slot_end = self.deadline(level)
            cur = self._current
            self.admissions[level].append((cur.runs, cur.start, cur.end, t0))
            if not self._running[level]:
                self._run_from[level] = t0
            self._running[level] += 1
            st = self._stats[level]
            st["calls"] += 1
            st["waited_ms"] += round((t0 - t_wait) * 1000)
        try:
            yield
        finally:
            t1 = self.clock()
            with self._cond:
                self._running[level] -= 1
                if not self._running[level]:
                    self._busy[level] += t1 - self._run_from.pop(level, t1)
                    self._ended[level] = t1
                    self._cond.notify_all()  # calls of the levels above may be waiting for it to end
                self._past(level, kind).append(t1 - t0)
                if t1 > slot_end and not self._stop.is_set():  # (never for the bottom level: no deadline)
                    st["overruns"] += 1
                    st["overrun_ms"] += round((t1 - slot_end) * 1000)

    def stats(self, level: str) -> dict:
        """``level``'s own figures: its calls, their waits and overruns (nothing of another level)."""
        with self._cond:
            return {"policy": self.scheduler.policy, **dict(self._stats[level])}


def make_turns(cluster, lattice, levels, seed: int | None = None) -> Turns | None:
    """The turns of a trusted process (worker or master) serving ``levels`` by ``[cluster]`` (``cluster``:
    the settings' section: scheduler, slot_seconds, the penalties), on the epoch's grid, started; None
    under ``shared`` or for one level."""
    if cluster.scheduler == "shared" or len(levels) < 2:
        return None
    sched = Scheduler(cluster.scheduler, linear_levels(lattice, levels), lattice.leq,
                      slot_seconds=cluster.slot_seconds, heartbeat_seconds=cluster.heartbeat_seconds,
                      # the levels' processes are never stopped here (heartbeats go on): no level is due
                      max_pause=float("inf"), threshold=cluster.penalty_threshold,
                      share=cluster.penalty_share, rounds=cluster.penalty_rounds, seed=seed)
    return Turns(sched, wall=time.time).start()
