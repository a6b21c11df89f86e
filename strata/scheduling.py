"""Taking turns: how level groups that share a host divide its CPUs between them (issue 33).

Dissertation §5.4, §6.4 and §9.1.5.  In the replicated mode every level has its own master and
workers (``strata up --levels S,TS``); on one host they compete for the same CPUs, and whatever a
lower level's results' timing depends on is a channel from every level it depends on.  A trusted
gate of the host (``strata slots``, deploy/slots.py) stops and continues each level's processes
(SIGSTOP, SIGCONT) by the plan this module makes.  This module is the plan only: plain logic over
a clock the caller passes in, no I/O, no signals.

**The plan.**  At the start of a round the gate hands :meth:`Scheduler.next_round` the time and,
per level, a :class:`Reading` (its processes' CPU seconds in the last round, and whether input
waits for it unread); the scheduler answers a :class:`Plan`: :class:`Slot` s in order, each naming
the levels that run during it (the others are stopped) and for how long.  The levels come lowest
first in the lattice's order; for a partial order (categories, a Chinese Wall) that order is a
*linear extension* (:attr:`strata.lattice.Lattice.levels`: each level after every level it
dominates), and the dominance checks below use the lattice's own ``leq``, never the position.

**The policies, and what a lower level's timing can depend on under each.**  "Timing" is when a
level's processes run: a level *L*'s results come out only while *L* runs, so the times *L* runs
are what an *L* user can observe (besides *L*'s own work, which is *L*'s to see).

``shared``
    No gate: the operating system shares the CPUs.  *L* runs whenever the kernel gives it a CPU,
    and that depends on how many runnable threads every other level has.  A higher level that
    saturates the host slows *L*'s results: **the channel is open** (tests/test_slot_timing.py
    measures it).  The baseline, and the default.
``round_robin``
    Each level with work gets a quantum (``slot_seconds``) in turn, lowest first; a level without
    work is skipped (operator round robin, §5.4, by levels).  The time between two of *L*'s quanta
    is the sum of the other levels' quanta in that round, so it is longer when a higher level has
    work than when it is idle: **the channel is open, by design** (one bit a round; it is the
    channel the slot policies close, and the test shows it).
``fixed_slot``
    Each level gets ``slot_seconds`` per round whether it has work or not; an idle slot stays idle
    (the fixed time slot algorithm: 250 ms per level per one-second heartbeat in §9.1.5).  *L*'s
    slot starts at ``round start + its position x slot_seconds`` and the round's length is the
    number of levels times ``slot_seconds``: both are constants, and during *L*'s slot no other
    level runs.  So when *L* runs depends on the clock alone, and what it achieves while it runs on
    *L*'s own work: **the channel from the higher levels is closed** (the plan does not even read
    the readings; a test checks it is the same whatever they say).
``revised_fixed_slot``
    Fixed slots, but a level that has no work at the start of a round lends its slot, for that
    round, to a level that dominates it (the revised algorithm, §5.4: decided at the round's start,
    never the other way round).  *L*'s own slot is taken from it only when *L* itself had no work
    (its own reading) and is not due (its own last run, below); *L* may receive the slots of levels
    it dominates.  Which level receives an idle slot is decided by :func:`receiver`: the first level
    with work, in the linear extension, among the levels strictly above the lender, that dominates
    every candidate before it.  The receiver's decision thus depends only on levels it dominates, and
    no level's slot ever depends on a level above it: **the channel from the higher levels stays
    closed**; information flows only upward (a higher level may notice that a lower one was idle,
    which it may know anyway).  In a total order the idle slot goes to the next level up that has
    work.
``dynamic_threshold``
    Round robin with a threshold (§6.4): a level that used more than ``penalty_threshold`` of a
    round's CPU time while another level also had work is penalised for β rounds (drawn from
    ``penalty_rounds``): its quantum is α x ``slot_seconds`` (α drawn from ``penalty_share``), by
    a seeded random generator.  This caps a higher level's share and adds noise to the channel, but
    *L*'s waits still depend on whether a higher level has work (it is skipped when idle, as in
    round robin) and on its penalty: **the channel is narrowed, not closed**.  The dissertation
    offers it for performance (no idle slots), not as a closed channel.

**Work.**  A level's "work" at a round's start is its own reading only: input waiting for it, or
CPU use of at least :data:`BUSY_FRACTION` of the time it ran in the last round (:func:`has_work`).
A level that did not run has no CPU reading; only waiting input or :meth:`Scheduler.due` bring it
back.

**Liveness.**  A stopped worker sends no heartbeats, and a master drops a worker it has not heard
from for :data:`WORKER_TIMEOUT_SECONDS`.  So a level that was skipped (round robin, dynamic
threshold) or lent its slot (revised) runs again, with work or not, before its pause could exceed
``max_pause`` (:meth:`Scheduler.due`: the level's own last run and the clock, nothing else); under
round robin and dynamic threshold such a level without work runs a probe of :data:`PROBE_SECONDS`
instead of a whole quantum.  :func:`round_problem` refuses, in one line, a configuration whose
rounds are too long for that.

**What no plan closes.**  A plan decides only when each level's *processes* run.  Whatever the
levels share besides CPU time is outside it: the disk (a higher level's writes and syncs delay a
lower level's syncs: its master syncs its event log for every batch), memory bandwidth and caches,
the kernel's own threads, processes of a level the gate does not know (its users' clients on this
host, ``strata scale``'s Ray workers), and the gate's own timer (its slot edges are late by well
under a millisecond under fixed slots).  docs/scheduling.md has the measurements.

**Costs.**  Under the slot policies a level runs only in its slot: its latency grows by up to a
round (the other levels' slots), and its throughput is at most its share of the host.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

__all__ = ["POLICIES", "SLOT_POLICIES", "Slot", "Plan", "Reading", "Scheduler", "has_work", "receiver",
           "longest_round", "longest_pause", "pause_budget", "round_problem", "BUSY_FRACTION",
           "WORKER_TIMEOUT_SECONDS", "HEARTBEAT_MARGIN_SECONDS", "PROBE_SECONDS", "linear_levels"]

#: every policy, ``[cluster] scheduler`` (strata/config.py declares the same names)
POLICIES = ("shared", "round_robin", "fixed_slot", "revised_fixed_slot", "dynamic_threshold")
#: the policies whose rounds are made of one slot per level, whatever the levels' work
SLOT_POLICIES = ("fixed_slot", "revised_fixed_slot")
#: a level that ran had work if its processes used at least this share of one CPU for the time it
#: ran (measured with deploy/slots.py's readings: an idle level, its master and a Spark worker, uses
#: 1-4.5 % of one CPU over a 0.25 s quantum: heartbeats, the JVM's housekeeping)
BUSY_FRACTION = 0.1
#: how long a level without work that is due (:meth:`Scheduler.due`) runs under round robin and dynamic
#: threshold, when shorter than its quantum: its workers' heartbeat timers expired while it was
#: stopped, so they send at once when continued, and its master reads them within milliseconds
PROBE_SECONDS = 0.125
#: how long a master waits for a worker's heartbeat before it drops the worker: master/core.py's
#: ``worker_timeout`` (master/dispatch.py ``Dispatcher.timeout``) and the group table's
#: ``max(3.0, 4 x heartbeat_seconds)`` (strata/groups/membership.py); tests/test_scheduling.py checks
#: this copy against them
WORKER_TIMEOUT_SECONDS = 3.0
#: what a heartbeat needs besides its interval to count: its datagram, the master's receive loop
#: (a 0.2 s socket timeout) and the gate's own timer
HEARTBEAT_MARGIN_SECONDS = 0.5


@dataclass(frozen=True)
class Slot:
    """``seconds`` during which the levels of ``runs`` run and every other level is stopped;
    ``owner``: the level whose slot or quantum it is (None: everyone's, or an idle slot's nobody)."""

    runs: tuple[str, ...]
    seconds: float
    owner: str | None = None


@dataclass(frozen=True)
class Plan:
    """One round: its ``slots`` in order from ``start`` (the clock's time)."""

    start: float
    slots: tuple[Slot, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.slots)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def ran(self, level: str) -> float:
        """Seconds ``level`` runs in this round."""
        return sum(s.seconds for s in self.slots if level in s.runs)

    def last_end(self, level: str) -> float | None:
        """When ``level``'s last run in this round ends (None: it does not run)."""
        t, end = self.start, None
        for s in self.slots:
            t += s.seconds
            if level in s.runs:
                end = t
        return end

    def timeline(self) -> list[tuple[float, float, tuple[str, ...]]]:
        """(from, to, levels running) of each slot, in the clock's time."""
        out, t = [], self.start
        for s in self.slots:
            out.append((t, t + s.seconds, s.runs))
            t += s.seconds
        return out


@dataclass(frozen=True)
class Reading:
    """A level at the start of a round: its processes' CPU seconds in the last round, and whether
    input waits for it unread (bytes in its sockets' receive queues)."""

    cpu_seconds: float = 0.0
    pending: bool = False


def has_work(reading: Reading | None, ran_seconds: float) -> bool:
    """Whether a level has work: input waits for it, or it kept at least :data:`BUSY_FRACTION` of a
    CPU busy for the ``ran_seconds`` it ran in the last round."""
    if reading is None:
        return False
    if reading.pending:
        return True
    return ran_seconds > 0 and reading.cpu_seconds >= BUSY_FRACTION * ran_seconds


def receiver(lender: str, levels: tuple[str, ...], leq: Callable[[str, str], bool],
             busy: Callable[[str], bool]) -> str | None:
    """The level that gets ``lender``'s idle slot (revised fixed slot), or None (the slot stays idle).

    Candidates: the levels strictly above ``lender``, in ``levels``' order (a linear extension).  The
    slot goes to the first candidate with work that dominates every candidate before it.  So whether
    a level receives depends only on the lender, the candidates before it (all of which it
    dominates) and itself: never on a level it does not dominate."""
    cands = [lv for lv in levels if lv != lender and leq(lender, lv)]
    for i, c in enumerate(cands):
        if busy(c) and all(leq(d, c) for d in cands[:i]):
            return c
    return None


def longest_round(policy: str, n_levels: int, slot_seconds: float) -> float:
    """The longest round ``policy`` makes for ``n_levels`` levels."""
    return 0.0 if policy == "shared" else n_levels * slot_seconds


def longest_pause(policy: str, n_levels: int, slot_seconds: float) -> float:
    """The longest a level's processes stay stopped: the other levels' slots under fixed slots; a
    skipped or lending level runs again within two rounds (:meth:`Scheduler.due`)."""
    if policy == "shared" or n_levels <= 1:
        return 0.0
    if policy == "fixed_slot":
        return (n_levels - 1) * slot_seconds
    return 2 * longest_round(policy, n_levels, slot_seconds) - (slot_seconds if policy == "revised_fixed_slot" else 0)


def pause_budget(heartbeat_seconds: float) -> float:
    """The longest pause a level's workers survive: the master's worker timeout less a heartbeat's
    interval and margin (a worker stopped just before its next heartbeat)."""
    return WORKER_TIMEOUT_SECONDS - heartbeat_seconds - HEARTBEAT_MARGIN_SECONDS


def round_problem(policy: str, n_levels: int, slot_seconds: float, heartbeat_seconds: float) -> str | None:
    """Why ``policy`` cannot gate ``n_levels`` levels with ``slot_seconds`` slots (one line), or None."""
    pause = longest_pause(policy, n_levels, slot_seconds)
    budget = pause_budget(heartbeat_seconds)
    if pause <= budget:
        return None
    fits = slot_seconds * budget / pause
    return (f"[cluster] slot_seconds = {slot_seconds:g}: {policy} with {n_levels} levels stops a level for up to "
            f"{pause:.2f} s, longer than its workers' heartbeats survive ({WORKER_TIMEOUT_SECONDS:g} s less "
            f"heartbeat_seconds {heartbeat_seconds:g} and {HEARTBEAT_MARGIN_SECONDS:g} s margin = {budget:.2f} s); "
            f"use slot_seconds <= {math.floor(fits * 1000) / 1000:g}")


@dataclass
class _Penalty:
    share: float  # alpha: the share of its quantum a penalised level runs
    rounds: int  # beta: the rounds it still lasts


@dataclass
class Scheduler:
    """The state machine of one host's rounds.

    ``levels``: lowest first (a linear extension of the lattice); ``leq(a, b)``: ``b`` dominates
    ``a``.  ``max_pause``: a level that would otherwise stay stopped longer than this runs
    (:meth:`due`; default: as long as the levels' workers survive, :func:`pause_budget` of
    ``heartbeat_seconds``).  ``threshold``, ``share`` (α's range) and ``rounds`` (β's range):
    dynamic threshold's penalties, drawn with ``seed``."""

    policy: str
    levels: tuple[str, ...]
    leq: Callable[[str, str], bool]
    slot_seconds: float = 0.25
    heartbeat_seconds: float = 0.5
    max_pause: float | None = None
    threshold: float = 0.8
    share: tuple[float, float] = (0.3, 0.8)
    rounds: tuple[int, int] = (1, 10)
    seed: int | None = None
    last: Plan | None = field(default=None, init=False)
    penalties: dict[str, _Penalty] = field(default_factory=dict, init=False)
    _last_end: dict[str, float] = field(default_factory=dict, init=False)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduler {self.policy!r} (one of {', '.join(POLICIES)})")
        if not self.levels or len(set(self.levels)) != len(self.levels):
            raise ValueError("levels: at least one, each once")
        if not self.slot_seconds > 0:
            raise ValueError("slot_seconds must be positive")
        self.levels = tuple(self.levels)
        if self.max_pause is None:
            self.max_pause = pause_budget(self.heartbeat_seconds)
        self._rng = random.Random(self.seed)

    @property
    def longest_round(self) -> float:
        return longest_round(self.policy, len(self.levels), self.slot_seconds)

    def due(self, level: str, now: float) -> bool:
        """Whether ``level`` must run in the round starting ``now`` whatever its work: if it did not,
        the next round could start it only after its pause exceeded ``max_pause`` (rounds last at
        most :attr:`longest_round`).  Depends on the level's own last run and the clock only."""
        end = self._last_end.get(level)
        return end is None or now + 2 * self.longest_round - end > self.max_pause

    def next_round(self, now: float, readings: Mapping[str, Reading] | None = None) -> Plan:
        """The plan of the round starting ``now``, given each level's :class:`Reading` of the last
        round (a level missing: no reading, no work)."""
        readings = readings or {}
        ran = (lambda lv: self.last.ran(lv)) if self.last is not None else (lambda lv: 0.0)
        work = {lv: has_work(readings.get(lv), ran(lv)) for lv in self.levels}
        wants = {lv: work[lv] or self.due(lv, now) for lv in self.levels}
        slot = self.slot_seconds
        if self.policy == "shared":
            slots = (Slot(self.levels, self.longest_round or slot),)
        elif self.policy == "fixed_slot":
            slots = tuple(Slot((lv,), slot, lv) for lv in self.levels)
        elif self.policy == "revised_fixed_slot":
            lent = {lv: receiver(lv, self.levels, self.leq, wants.__getitem__) for lv in self.levels if not wants[lv]}
            slots = tuple(Slot((lv,), slot, lv) if wants[lv] else Slot((lent[lv],) if lent[lv] else (), slot, lv)
                          for lv in self.levels)
        else:  # round_robin, dynamic_threshold
            if self.policy == "dynamic_threshold":
                self._penalise(readings, work)
            # a level without work that is due runs a probe: long enough for its heartbeats, no longer
            quanta = [Slot((lv,), slot * (self.penalties[lv].share if lv in self.penalties else 1.0)
                           if work[lv] else min(slot, PROBE_SECONDS), lv) for lv in self.levels if wants[lv]]
            # nobody has work: everyone runs one quantum together (nothing to keep apart; they notice new work)
            slots = tuple(quanta) or (Slot(self.levels, slot),)
            for lv in list(self.penalties):  # a penalty lasts beta rounds, whatever the level does meanwhile
                self.penalties[lv].rounds -= 1
                if self.penalties[lv].rounds <= 0:
                    del self.penalties[lv]
        plan = Plan(now, slots)
        for lv in self.levels:
            end = plan.last_end(lv)
            if end is not None:
                self._last_end[lv] = end
        self.last = plan
        return plan

    def _penalise(self, readings: Mapping[str, Reading], work: Mapping[str, bool]) -> None:
        """§6.4: a level that took more than ``threshold`` of the last round's CPU time while another
        level had work too is penalised, unless it is already: α and β are drawn now, and the penalty
        lasts β of its rounds even if its use drops meanwhile."""
        cpu = {lv: max(0.0, readings[lv].cpu_seconds) for lv in self.levels if lv in readings}
        total = sum(cpu.values())
        if total <= 0 or sum(1 for lv in self.levels if work[lv]) < 2:
            return
        for lv, used in cpu.items():
            if lv not in self.penalties and used / total > self.threshold:
                self.penalties[lv] = _Penalty(self._rng.uniform(*self.share), self._rng.randint(*self.rounds))


def linear_levels(lattice, levels: Iterable[str]) -> tuple[str, ...]:
    """``levels`` lowest first in ``lattice``'s linear extension (each after every level it dominates)."""
    return tuple(lattice.sort(levels))
