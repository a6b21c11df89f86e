"""Algorithm 5 (DSMS load distribution) as a plain state machine, with credits.

The master's view of its group (the ``ip_table``): each worker's last reported
CPU load and heartbeat time, its evaluation *slots* (how many chunks it
evaluates at once; its heartbeat says, 2 until it does) and the chunks it has in
flight.  Workers not heard from within ``timeout`` seconds are dropped and their
in-flight chunks handed back for re-dispatch.  No networking here.

Credits: a worker with a free slot may get a chunk, so the next chunk is already
on the worker when the current one ends; a worker with no free slot never does.
Its own chunks are what the slots account for.

Algorithm 5's CPU threshold (90 %) is kept for load the worker does *not* cause
itself: a chunk goes only to a worker whose *external* load is below it,
preferring the one with the most free slots, then the least loaded.  A reading
taken while the worker had none of this master's chunks in flight (and had none
for ``own_window`` seconds, the span a heartbeat's reading covers) is external
load: another tenant, another level's group on a shared CPU (``host`` reading),
or the worker's own leftovers (a previous master's chunk, garbage collection;
``process`` reading).  A reading taken while it worked for this master is mostly
its own work, already bounded by the slots; it is ignored, and the last external
reading stays in force.  So with the ``process`` reading a worker's own chunks
never make it look busy (that idled a free slot between chunks), and with the
``host`` reading on a dedicated host the threshold still keeps chunks away from a
host that something else loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Dispatcher", "WorkerEntry", "DEFAULT_SLOTS"]

#: evaluation slots of a worker whose heartbeat does not say
DEFAULT_SLOTS = 2


@dataclass
class WorkerEntry:
    sid: str
    cpu: float  # 0..100, the last reading (as reported)
    last_seen: float
    state: str = "ready"
    pid: int = 0
    in_flight: set[int] = field(default_factory=set)
    done: int = 0
    slots: int = DEFAULT_SLOTS
    external: float = 0.0  # the last reading taken while it had nothing of ours: Algorithm 5's load
    busy_until: float = float("-inf")  # the last moment it had a chunk of ours in flight
    seq: object = None  # identity of the last reading (heartbeat sequence number, or the value)

    @property
    def free(self) -> int:
        return max(0, self.slots - len(self.in_flight))


#: what a heartbeat's state may be (strata/groups/membership.py STATES)
WORKER_STATES = ("ready", "draining", "master")


def _check_heartbeat(sid: str, cpu, state, slots) -> None:
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0.0 <= cpu <= 100.0:
        raise ValueError(f"worker {sid}: CPU reading {cpu!r} is not a number in [0, 100]")
    if state not in WORKER_STATES:
        raise ValueError(f"worker {sid}: unknown state {state!r}")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise ValueError(f"worker {sid}: slots {slots!r} is not a non-negative integer")


class Dispatcher:
    def __init__(self, cpu_threshold: float = 90.0, max_in_flight: int = DEFAULT_SLOTS, timeout: float = 3.0,
                 own_window: float = 1.1):
        """``max_in_flight``: the slots of a worker whose heartbeat does not report them.
        ``own_window``: how long after its last chunk of ours a worker's reading still counts as
        its own work (about two heartbeat periods: a reading covers the period before it)."""
        self.cpu_threshold = cpu_threshold
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.own_window = own_window
        self.table: dict[str, WorkerEntry] = {}
        self._owner: dict[int, str] = {}
        self._rr = 0

    # -- group table --------------------------------------------------------------
    def heartbeat(self, sid: str, cpu: float, now: float, state: str = "ready", pid: int = 0,
                  slots: int | None = None, seq=None) -> None:
        """A worker's heartbeat (the master may pass the same one several times; ``seq`` tells a
        new reading from a repeated one, else a changed value does).  A CPU reading that is not
        a number in [0, 100] (NaN, ±inf), an unknown state or bad slots are refused
        (ValueError) and change nothing."""
        _check_heartbeat(sid, cpu, state, slots)
        e = self.table.get(sid)
        cpu = float(cpu)
        slots = self.max_in_flight if slots is None else max(0, int(slots))
        ident = seq if seq is not None else cpu
        if e is None or e.pid != pid:
            prev = e
            e = self.table[sid] = WorkerEntry(sid, cpu, now, state, pid, slots=slots, external=cpu, seq=ident)
            if prev is not None:  # a restarted worker on the same address: what was in flight is lost
                e.in_flight, e.done = prev.in_flight, prev.done
            return
        if ident != e.seq:  # a new reading
            e.seq = ident
            if not e.in_flight and now - e.busy_until > self.own_window:
                e.external = cpu
        if e.in_flight:
            e.busy_until = now
        e.cpu, e.last_seen, e.state, e.slots = cpu, now, state, slots

    def expire(self, now: float) -> list[int]:
        """Drop workers silent for longer than ``timeout``; return their chunks."""
        lost: list[int] = []
        for sid in [s for s, e in self.table.items() if now - e.last_seen > self.timeout]:
            lost.extend(self.remove(sid))
        return sorted(lost)

    def remove(self, sid: str) -> list[int]:
        e = self.table.pop(sid, None)
        if e is None:
            return []
        for cid in e.in_flight:
            self._owner.pop(cid, None)
        return sorted(e.in_flight)

    # -- Algorithm 5 ------------------------------------------------------------------
    def eligible(self) -> list[WorkerEntry]:
        return [e for e in self.table.values()
                if e.external < self.cpu_threshold and e.state == "ready" and e.free > 0]

    def _candidates(self, starving: bool) -> list[WorkerEntry]:
        cands = self.eligible()
        if not cands and starving and all(e.external >= self.cpu_threshold for e in self.table.values()):
            cands = [e for e in self.table.values() if e.state == "ready" and e.free > 0]
        return cands

    def free_slots(self, starving: bool = False) -> int:
        """Free slots among the workers a chunk may go to now."""
        return sum(e.free for e in self._candidates(starving))

    def total_slots(self) -> int:
        """Slots of the workers that take chunks at all (ready, external load below the threshold),
        busy or not: the shares a backlog is cut into."""
        live = [e for e in self.table.values() if e.state == "ready" and e.external < self.cpu_threshold]
        return sum(e.slots for e in (live or [e for e in self.table.values() if e.state == "ready"]))

    def pick(self, starving: bool = False) -> str | None:
        """A worker for the next chunk, or None if none may take one.

        ``starving``: every worker has reported external load >= threshold for a while (on a
        shared host the load may be the cluster's own); rather than stall, the least loaded
        worker with a free slot takes the chunk.  A busy worker still never gets a chunk while
        another is below the threshold.
        """
        cands = self._candidates(starving)
        if not cands:
            return None
        # most free slots (fewest in flight for equal slots), then load in 10 % buckets, then round robin
        self._rr += 1
        order = sorted(self.table)
        rot = {sid: (i - self._rr) % len(order) for i, sid in enumerate(order)}
        if starving:
            best = min(cands, key=lambda e: (-e.free, len(e.in_flight), e.external, rot[e.sid]))
        else:
            best = min(cands, key=lambda e: (-e.free, len(e.in_flight), int(e.external // 10), rot[e.sid]))
        return best.sid

    def assign(self, chunk_id: int, sid: str, now: float | None = None) -> None:
        prev = self._owner.get(chunk_id)
        if prev is not None and prev in self.table:
            self.table[prev].in_flight.discard(chunk_id)
        self._owner[chunk_id] = sid
        e = self.table[sid]
        e.in_flight.add(chunk_id)
        if now is not None:
            e.busy_until = max(e.busy_until, now)

    def complete(self, chunk_id: int, now: float | None = None, chunks: int = 1) -> str | None:
        """Unit ``chunk_id`` answered; ``chunks``: how many cut chunks it covered (counted as done)."""
        sid = self._owner.pop(chunk_id, None)
        if sid is not None and sid in self.table:
            e = self.table[sid]
            e.in_flight.discard(chunk_id)
            e.done += chunks
            if now is not None:
                e.busy_until = max(e.busy_until, now)
        return sid

    def unassign(self, chunk_id: int, now: float | None = None) -> str | None:
        """Take ``chunk_id`` back from its worker (a failed or overdue call): not counted as done."""
        sid = self._owner.pop(chunk_id, None)
        if sid is not None and sid in self.table:
            e = self.table[sid]
            e.in_flight.discard(chunk_id)
            if now is not None:
                e.busy_until = max(e.busy_until, now)
        return sid

    def owner(self, chunk_id: int) -> str | None:
        return self._owner.get(chunk_id)
