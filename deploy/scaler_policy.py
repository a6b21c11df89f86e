"""When to add or remove workers of one level group: pure logic, no I/O.

The elastic scaler (:mod:`strata.deploy.scaler`) feeds :class:`ScalingPolicy`
one :class:`Observation` per tick, built from the master's ``Status`` (backlog,
per-worker CPU and chunks in flight) plus what the scaler itself knows
(workers it is still starting or already draining).  The policy answers with a
:class:`Decision`: ``+k`` (start k workers), ``-k`` (drain the named workers)
or ``0``, always with a reason for the log.

Rules (all thresholds in :class:`PolicySettings`):

* **bounds first**: below ``min_workers`` start the missing workers at once;
  above ``max_workers`` drain the surplus at once (idle ones first).  Bounds
  count the group's live workers (the master's table, without the ones being
  drained) plus the workers still starting.
* **scale up** when the group is *behind* -- more than ``up_backlog`` chunks
  wait for a worker, or more than ``up_backlog`` chunks per live worker are in the
  backlog (waiting or in flight: with adaptive chunking a busy worker takes every
  waiting chunk into its next merged job, so the queue empties while the backlog
  stays), or chunks wait and every worker reports CPU at or above
  ``cpu_threshold`` (90 %: Algorithm 5 sends nothing to such a worker) --
  continuously for ``up_sustain`` seconds, no worker is still starting, and the
  last scale-up is at least ``up_cooldown`` seconds ago.  ``k`` grows with the
  queue (one worker per ``up_backlog`` waiting chunks), at most ``max_step_up``
  and never beyond ``max_workers``.
* **scale down** one worker when the group has been *idle* -- at most
  ``down_backlog`` chunks in the backlog (waiting or in flight) and mean CPU below
  ``down_cpu`` -- continuously for ``down_idle`` seconds, and the last scaling
  action is at least ``down_cooldown`` seconds ago.  The worker to drain is
  one the scaler owns, preferring one with nothing in flight, then the least
  loaded.

Hysteresis: the up and down conditions are far apart (``down_backlog`` <
``up_backlog``, ``down_cpu`` < ``cpu_threshold``), both must hold for a
while, and the cooldowns space actions out, so a load that hovers near a
threshold does not make the group flap.  Whatever the input, the policy never
takes the group outside ``[min_workers, max_workers]`` and never removes a
worker while the backlog is above ``down_backlog`` (unless the group is above
``max_workers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["PolicySettings", "WorkerObs", "Observation", "Decision", "ScalingPolicy"]


@dataclass(frozen=True)
class PolicySettings:
    min_workers: int = 1
    max_workers: int = 4
    up_backlog: int = 4          # waiting chunks above which the group is behind
    cpu_threshold: float = 90.0  # Algorithm 5: a worker at or above this gets no chunk
    up_sustain: float = 2.0      # seconds the group must stay behind before a scale-up
    up_cooldown: float = 10.0    # seconds between scale-ups
    max_step_up: int = 2         # workers started by one decision (beyond the minimum)
    down_backlog: int = 0        # backlog (waiting + in flight) at or below which the group may be idle
    down_cpu: float = 50.0       # mean CPU below which the group may be idle
    down_idle: float = 30.0      # seconds the group must stay idle before a scale-down
    down_cooldown: float = 30.0  # seconds after any action before a scale-down

    def __post_init__(self):
        if self.min_workers < 0 or self.max_workers < max(1, self.min_workers):
            raise ValueError(f"need 0 <= min ({self.min_workers}) <= max ({self.max_workers}) and max >= 1")
        if self.up_backlog < 1 or self.down_backlog < 0 or self.down_backlog >= self.up_backlog:
            raise ValueError(f"need 0 <= down_backlog ({self.down_backlog}) < up_backlog ({self.up_backlog})")
        if not 0 < self.cpu_threshold <= 100 or not 0 <= self.down_cpu < self.cpu_threshold:
            raise ValueError(f"need 0 <= down_cpu ({self.down_cpu}) < cpu_threshold ({self.cpu_threshold}) <= 100")
        if min(self.up_sustain, self.up_cooldown, self.down_idle, self.down_cooldown) < 0 or self.max_step_up < 1:
            raise ValueError("durations must be >= 0 and max_step_up >= 1")


@dataclass(frozen=True)
class WorkerObs:
    sid: str
    cpu: float = 0.0
    in_flight: int = 0
    chunks_done: int = 0
    state: str = "ready"
    drainable: bool = False  # started by this scaler (only those can be stopped)


@dataclass(frozen=True)
class Observation:
    now: float                      # seconds, monotonic
    backlog_chunks: int             # chunks not yet completed (waiting + in flight)
    workers: tuple[WorkerObs, ...] = ()
    ready_chunks: int | None = None  # chunks waiting for a worker (default: backlog - in flight)
    starting: int = 0               # workers started but not yet in the master's table
    draining: tuple[str, ...] = ()  # sids being drained (not counted)

    @property
    def waiting(self) -> int:
        if self.ready_chunks is not None:
            return max(0, int(self.ready_chunks))
        return max(0, int(self.backlog_chunks) - sum(max(0, w.in_flight) for w in self.workers))

    @property
    def live(self) -> list[WorkerObs]:
        return [w for w in self.workers if w.sid not in self.draining]

    @property
    def size(self) -> int:
        return len(self.live) + max(0, self.starting)


@dataclass(frozen=True)
class Decision:
    delta: int                      # +k start k workers, -k drain the workers in ``drain``
    reason: str
    drain: tuple[str, ...] = ()

    def __str__(self) -> str:
        what = f"+{self.delta}" if self.delta > 0 else (f"{self.delta} ({', '.join(self.drain)})" if self.delta else "0")
        return f"{what}: {self.reason}"


@dataclass
class ScalingPolicy:
    settings: PolicySettings = field(default_factory=PolicySettings)
    behind_since: float | None = None
    idle_since: float | None = None
    last_up: float | None = None
    last_action: float | None = None

    def decide(self, obs: Observation) -> Decision:
        s = self.settings
        now = obs.now
        live = obs.live
        n = obs.size
        waiting = obs.waiting
        busy = bool(live) and all(w.cpu >= s.cpu_threshold for w in live)
        per_worker = obs.backlog_chunks / len(live) if live else 0.0
        behind = waiting > s.up_backlog or per_worker > s.up_backlog or (waiting > 0 and (busy or not live))
        mean_cpu = sum(w.cpu for w in live) / len(live) if live else 0.0
        idle = obs.backlog_chunks <= s.down_backlog and waiting == 0 and mean_cpu < s.down_cpu
        # while workers are starting the group is not judged: the sustained period starts once they joined
        self.behind_since = ((self.behind_since if self.behind_since is not None else now)
                             if behind and obs.starting <= 0 else None)
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None

        # -- bounds ------------------------------------------------------------------------
        if n < s.min_workers:
            k = s.min_workers - n
            return self._up(now, k, f"{n} workers, below the minimum {s.min_workers}")
        if n > s.max_workers:
            victims = self._victims(live, n - s.max_workers)
            if victims:
                return self._down(now, victims, f"{n} workers, above the maximum {s.max_workers}")
            return Decision(0, f"{n} workers, above the maximum {s.max_workers}, but none of them is ours to drain")

        # -- scale up -----------------------------------------------------------------------
        if behind:
            why = (f"{waiting} chunks waiting (threshold {s.up_backlog})" if waiting > s.up_backlog
                   else f"{obs.backlog_chunks} chunks in the backlog of {len(live)} worker(s) (threshold "
                        f"{s.up_backlog} per worker)" if per_worker > s.up_backlog
                   else f"{waiting} chunks waiting and " + ("no worker" if not live else
                                                             f"every worker at CPU >= {s.cpu_threshold:g} %"))
            if n >= s.max_workers:
                return Decision(0, f"behind ({why}) but at the maximum {s.max_workers}")
            if obs.starting > 0:
                return Decision(0, f"behind ({why}); {obs.starting} worker(s) still starting")
            held = now - (self.behind_since if self.behind_since is not None else now)
            if held < s.up_sustain:
                return Decision(0, f"behind ({why}) for {held:.1f} s of {s.up_sustain:g} s")
            if self.last_up is not None and now - self.last_up < s.up_cooldown:
                return Decision(0, f"behind ({why}); scale-up cooldown {s.up_cooldown - (now - self.last_up):.1f} s")
            k = min(max(1, min(s.max_step_up, math.ceil(waiting / s.up_backlog))), s.max_workers - n)
            return self._up(now, k, f"behind for {held:.1f} s: {why}")

        # -- scale down ---------------------------------------------------------------------
        if idle and n > s.min_workers:
            held = now - self.idle_since
            if held < s.down_idle:
                return Decision(0, f"idle for {held:.1f} s of {s.down_idle:g} s")
            if self.last_action is not None and now - self.last_action < s.down_cooldown:
                return Decision(0, f"idle; cooldown {s.down_cooldown - (now - self.last_action):.1f} s")
            victims = self._victims(live, 1)
            if not victims:
                return Decision(0, f"idle for {held:.1f} s, but no worker of ours to drain")
            return self._down(now, victims, f"idle for {held:.1f} s (backlog {obs.backlog_chunks}, "
                                            f"mean CPU {mean_cpu:.0f} %)")
        return Decision(0, f"steady: {n} workers, {waiting} waiting, backlog {obs.backlog_chunks}, "
                           f"mean CPU {mean_cpu:.0f} %")

    # -- helpers ------------------------------------------------------------------------------
    def _up(self, now: float, k: int, reason: str) -> Decision:
        self.last_up = self.last_action = now
        self.behind_since = None
        return Decision(k, reason)

    def _down(self, now: float, victims: list[str], reason: str) -> Decision:
        self.last_action = now
        self.idle_since = None
        return Decision(-len(victims), reason, tuple(victims))

    @staticmethod
    def _victims(live: list[WorkerObs], k: int) -> list[str]:
        """Up to ``k`` workers we own, idle ones first, then the least loaded."""
        cands = [w for w in live if w.drainable and w.state == "ready"]
        cands.sort(key=lambda w: (w.in_flight > 0, w.in_flight, w.cpu, w.chunks_done, w.sid))
        return [w.sid for w in cands[:k]]
