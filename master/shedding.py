"""Load shedding at a level's master (issue 33): which input the master drops when its own backlog is
too large, as plain logic (no lock, no I/O; the core calls it under its lock).

``[limits] overload = "wait"`` (the default) keeps today's backpressure: a producer's next batch waits
while the backlog is at ``max_backlog_rows``.  With ``overload = "shed"`` no producer waits on the
backlog; instead, each time a batch with rows arrives (after the shepherd), the master reads its
backlog (rows of the chunks cut and not yet released, :attr:`DispatchState.backlog_rows
<strata.master.dispatch_state.DispatchState.backlog_rows>`) and decides, by this module's rule:

* **when** (hysteresis): the level starts shedding at a reading of ``high`` rows or more
  (``shed_backlog_rows``, default ``max_backlog_rows``) and stops at the first reading below ``low``
  (``shed_resume_rows``, default ``high // 2``);
* **what**: whole *instants*, for every stream of the level at once.  The master keeps a mark, the
  largest instant decided so far.  A batch whose largest instant ``top`` is above the mark decides
  the instants ``mark+1 .. top`` (those still open) together: shed while the level is shedding, kept
  otherwise, and the mark becomes ``top``.  A decided instant stays decided: every later row of a shed
  instant is shed, whatever its stream and whether or not the level still sheds; every later row of
  a kept instant is kept.  So an instant's tuples are all kept or all shed, and every query of the
  level sees the same kept input;
* **how long**: until a reading falls below ``low``; the instants decided meanwhile stay shed.

Rows of an instant that is already closed are never shed (the chunker refuses them as late, as
before).  The decision depends only on the sequence of batches (their streams and instants) and the
backlog readings: this master's own backlog, made of rows at or below its level, which its own
workers drain.  Nothing of another level enters it.

:meth:`Shedder.decide` computes a :class:`Decision` without changing anything; the core logs it
(:meth:`Decision.body`, event ``shed``) with the batch's kept rows and only then applies it
(:meth:`Shedder.commit`); a restart replays the logged decisions through the same
:meth:`Shedder.commit` (:meth:`Decision.of_body`) and the kept rows through :meth:`Shedder.kept`, so
a restarted master keeps exactly the rows it kept and sheds every later row of an instant it shed.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["MODES", "RECENT_RANGES", "ShedRule", "Decision", "Shedder", "instants_of"]

#: ``[limits] overload``: what a master does when its backlog passes its bound
MODES = ("wait", "shed")
#: the ranges of shed instants a status lists (the newest; ``ranges_total`` counts all of them)
RECENT_RANGES = 32


@dataclass(frozen=True)
class ShedRule:
    """When a level sheds: from a backlog reading of ``high`` rows or more until one below ``low``."""

    high: int
    low: int

    def __post_init__(self):
        if not 0 <= self.low < self.high:
            raise ValueError(f"shedding resumes below {self.low} rows: must be from 0 to below the bound {self.high}")

    @classmethod
    def of(cls, limits) -> "ShedRule | None":
        """The rule of ``[limits]`` (None: ``overload = "wait"``, or no bound at all)."""
        if getattr(limits, "overload", "wait") != "shed":
            return None
        high = int(limits.shed_backlog_rows or limits.max_backlog_rows)
        if high <= 0:
            return None
        low = int(limits.shed_resume_rows) if limits.shed_resume_rows else high // 2
        return cls(high, low)


@dataclass(frozen=True)
class Decision:
    """What one batch's rows get: made by :meth:`Shedder.decide`, logged (:meth:`body`), applied by
    :meth:`Shedder.commit`.  ``keep``: a mask of the batch's rows to keep (None after a replay)."""

    stream: str
    reading: int  # the backlog read for this batch
    active: bool  # the level sheds after this reading
    flipped: bool  # ... and did not before (or did and no longer does)
    mark: int  # the largest instant decided after this batch
    closed_until: int  # the first instant not closed when the batch arrived
    start: int | None  # the instants newly decided shed: start .. mark (None: none)
    extends: bool  # ... continuing the last range shed (no instant decided kept in between)
    rows: int  # rows of the batch shed
    instants: int  # instants of the stream with rows shed that were not counted for it before
    first: int | None  # the smallest and largest instant of a row shed (None: none)
    last: int | None
    keep: np.ndarray | None = None

    @property
    def logged(self) -> bool:
        """Whether it is written to the event log: it shed rows or turned shedding on or off."""
        return self.rows > 0 or self.flipped

    def body(self) -> dict:
        """The event log's body of this decision (JSON)."""
        out = asdict(self)
        out.pop("keep")
        return out

    @classmethod
    def of_body(cls, body: dict) -> "Decision":
        """A logged decision again (a restart)."""
        return cls(**{k: body.get(k) for k in cls.__dataclass_fields__ if k != "keep"})


class Shedder:
    """The shedding state of one level's master; ``rule`` None: never sheds (``overload = "wait"``),
    yet a log written under ``"shed"`` is still replayed and counted."""

    def __init__(self, rule: ShedRule | None):
        self.rule = rule
        self.active = False  # shedding now
        self.mark = -1  # the largest instant decided
        self.tail_shed = False  # the last instants decided (up to the mark) were shed
        self.open: list[list[int]] = []  # ranges of shed instants not yet all closed (looked up by decide)
        self.recent: deque[list[int]] = deque(maxlen=RECENT_RANGES)  # the newest ranges of shed instants
        self.ranges_total = 0
        self.rows: Counter = Counter()  # rows shed per stream
        self.instants: Counter = Counter()  # instants with rows shed per stream
        self.last_ts: dict[str, int] = {}  # per stream, the last instant with a row of it shed
        self.batches = 0  # batches with a row shed
        self.episodes = 0  # times the level started shedding
        self.last_shed: int | None = None  # the largest instant shed

    @property
    def enabled(self) -> bool:
        return self.rule is not None

    @property
    def seen(self) -> bool:
        """Whether there is anything to report: shedding is on, or something was shed."""
        return self.enabled or self.episodes > 0 or bool(self.rows)

    # -- deciding --------------------------------------------------------------------------------------
    def decide(self, stream: str, ts, reading: int, closed_until: int) -> Decision | None:
        """The decision for a batch of ``stream`` whose rows have the instants ``ts`` (in arrival order),
        at a backlog ``reading`` with the instants before ``closed_until`` closed; changes nothing.
        None: no rule, no rows, or instants that are not integers or decrease within the batch (the
        chunker refuses those)."""
        if self.rule is None:
            return None
        try:
            ts = np.asarray(ts, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
        if ts.ndim != 1 or not len(ts) or (len(ts) > 1 and bool((np.diff(ts) < 0).any())):
            return None  # no rows, or instants that decrease: the chunker refuses the whole batch
        reading = int(reading)
        active = self.active
        if not active and reading >= self.rule.high:
            active = True
        elif active and reading < self.rule.low:
            active = False
        flipped = active != self.active
        top, mark = int(ts.max()), self.mark
        start, extends = None, False
        if top > mark:
            if active:
                extends = self.tail_shed and self.ranges_total > 0
                start = max(mark + 1, int(closed_until))
                if start > top:  # all of it closed: late rows, refused by the chunker
                    start, extends = None, False
            mark = top
        ranges = [(a, b) for a, b in self.open if b >= closed_until]
        if start is not None:
            ranges.append((start, top))
        shed = np.zeros(len(ts), dtype=bool)
        for a, b in ranges:
            shed |= (ts >= a) & (ts <= b)
        shed &= ts >= closed_until
        n = int(shed.sum())
        first = last = None
        instants = 0
        if n:
            uniq = np.unique(ts[shed])
            first, last = int(uniq[0]), int(uniq[-1])
            instants = len(uniq) - (1 if self.last_ts.get(stream) == first else 0)
        return Decision(stream, reading, active, flipped, mark, int(closed_until), start, extends, n, instants,
                        first, last, ~shed)

    def commit(self, d: Decision) -> None:
        """Apply a decision (the live batch's, once it is logged; or a logged one on a restart)."""
        if d.flipped:
            self.episodes += d.active
        self.active = d.active
        if d.mark > self.mark:
            self.tail_shed = d.start is not None
            self.mark = d.mark
        self.open = [r for r in self.open if r[1] >= d.closed_until]
        if d.start is not None:
            if self.open and self.open[-1][1] + 1 >= d.start:
                self.open[-1][1] = d.mark
            else:
                self.open.append([d.start, d.mark])
            if d.extends and self.recent:  # the same range goes on: every instant in between was shed
                self.recent[-1][1] = d.mark
            else:
                self.recent.append([d.start, d.mark])
                self.ranges_total += 1
        if d.rows:
            self.rows[d.stream] += d.rows
            self.instants[d.stream] += d.instants
            self.last_ts[d.stream] = d.last
            self.batches += 1
            self.last_shed = d.last if self.last_shed is None else max(self.last_shed, d.last)

    def kept(self, top: int) -> None:
        """Rows up to instant ``top`` were kept (a replayed batch: its instants above the mark were
        decided kept; a live batch's decision did this already)."""
        if top is not None and top > self.mark:
            self.mark = int(top)
            self.tail_shed = False

    # -- reading -----------------------------------------------------------------------------------------
    def view(self) -> dict:
        """What every session of the level reads (``strata status``)."""
        rule = self.rule
        return {"mode": "shed" if rule else "wait", "active": self.active,
                "shed_backlog_rows": rule.high if rule else 0, "resume_backlog_rows": rule.low if rule else 0,
                "rows": dict(self.rows), "instants": dict(self.instants),
                "ranges": [list(r) for r in self.recent], "ranges_total": self.ranges_total,
                "batches": self.batches, "episodes": self.episodes}

    def counters(self) -> dict:
        """The operators' counters."""
        return {"shed_rows": sum(self.rows.values()), "shed_instants": sum(self.instants.values()),
                "shed_batches": self.batches, "shed_episodes": self.episodes, "shedding": int(self.active)}

    # -- checkpoints -------------------------------------------------------------------------------------
    def export(self) -> dict:
        """The state as JSON (a checkpoint's)."""
        return {"active": self.active, "mark": self.mark, "tail_shed": self.tail_shed,
                "open": [list(r) for r in self.open], "recent": [list(r) for r in self.recent],
                "ranges_total": self.ranges_total, "rows": dict(self.rows), "instants": dict(self.instants),
                "last_ts": dict(self.last_ts), "batches": self.batches, "episodes": self.episodes,
                "last_shed": self.last_shed}

    def load(self, state: dict | None) -> None:
        """Continue from :meth:`export` (None: a checkpoint written before shedding existed)."""
        if not state:
            return
        self.active, self.mark, self.tail_shed = bool(state["active"]), int(state["mark"]), bool(state["tail_shed"])
        self.recent = deque((list(r) for r in state["recent"]), maxlen=RECENT_RANGES)
        self.open = [list(r) for r in state["open"]]
        self.ranges_total = int(state["ranges_total"])
        self.rows, self.instants = Counter(state["rows"]), Counter(state["instants"])
        self.last_ts = {k: int(v) for k, v in state["last_ts"].items()}
        self.batches, self.episodes = int(state["batches"]), int(state["episodes"])
        self.last_shed = state["last_shed"]


def instants_of(table):
    """The ``ts`` column of an Arrow table as a numpy array of int64 (None: no such column, nulls, or not
    integers: the chunker refuses such a batch, and nothing is decided for it)."""
    names = {c.lower(): c for c in table.column_names}
    if "ts" not in names:
        return None
    col = table.column(names["ts"])
    if col.null_count:
        return None
    try:
        arr = col.to_numpy()
    except Exception:  # noqa: BLE001 - any column Arrow cannot hand over as numbers: no decision
        return None
    return arr.astype(np.int64) if arr.dtype.kind in "iu" else None
