"""Algorithm 5 (DSMS load distribution) as a plain state machine.

The master's view of its group (the ``ip_table``): each worker's last reported
CPU load and heartbeat time, and the chunks it has in flight.  A chunk goes to
a worker whose CPU load is below the threshold (90 %), preferring the least
loaded; workers not heard from within ``timeout`` seconds are dropped and
their in-flight chunks handed back for re-dispatch.  No networking here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Dispatcher", "WorkerEntry"]


@dataclass
class WorkerEntry:
    sid: str
    cpu: float  # 0..100
    last_seen: float
    state: str = "ready"
    pid: int = 0
    in_flight: set[int] = field(default_factory=set)
    done: int = 0


class Dispatcher:
    def __init__(self, cpu_threshold: float = 90.0, max_in_flight: int = 2, timeout: float = 3.0):
        self.cpu_threshold = cpu_threshold
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.table: dict[str, WorkerEntry] = {}
        self._owner: dict[int, str] = {}
        self._rr = 0

    # -- group table --------------------------------------------------------------
    def heartbeat(self, sid: str, cpu: float, now: float, state: str = "ready", pid: int = 0) -> None:
        e = self.table.get(sid)
        if e is None:
            self.table[sid] = WorkerEntry(sid, float(cpu), now, state, pid)
        else:
            e.cpu, e.last_seen, e.state, e.pid = float(cpu), now, state, pid

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
        return [
            e for e in self.table.values()
            if e.cpu < self.cpu_threshold and e.state == "ready" and len(e.in_flight) < self.max_in_flight
        ]

    def pick(self, starving: bool = False) -> str | None:
        """A non-busy worker for the next chunk, or None if all are busy.

        ``starving``: every worker has reported CPU >= threshold for a while (on
        a shared host the load may be the cluster's own); rather than stall,
        the least loaded worker with room takes the chunk.  A busy worker
        still never gets a chunk while another is below the threshold.
        """
        cands = self.eligible()
        all_busy = all(e.cpu >= self.cpu_threshold for e in self.table.values())
        if not cands and starving and all_busy:
            cands = [e for e in self.table.values() if e.state == "ready" and len(e.in_flight) < self.max_in_flight]
        if not cands:
            return None
        # fewest chunks in flight, then CPU in 10 % buckets, then round robin
        self._rr += 1
        order = sorted(self.table)
        rot = {sid: (i - self._rr) % len(order) for i, sid in enumerate(order)}
        if starving:
            best = min(cands, key=lambda e: (len(e.in_flight), e.cpu, rot[e.sid]))
        else:
            best = min(cands, key=lambda e: (len(e.in_flight), int(e.cpu // 10), rot[e.sid]))
        return best.sid

    def assign(self, chunk_id: int, sid: str) -> None:
        prev = self._owner.get(chunk_id)
        if prev is not None and prev in self.table:
            self.table[prev].in_flight.discard(chunk_id)
        self._owner[chunk_id] = sid
        self.table[sid].in_flight.add(chunk_id)

    def complete(self, chunk_id: int) -> str | None:
        sid = self._owner.pop(chunk_id, None)
        if sid is not None and sid in self.table:
            e = self.table[sid]
            e.in_flight.discard(chunk_id)
            e.done += 1
        return sid

    def unassign(self, chunk_id: int) -> str | None:
        """Take ``chunk_id`` back from its worker (a failed or overdue call): not counted as done."""
        sid = self._owner.pop(chunk_id, None)
        if sid is not None and sid in self.table:
            self.table[sid].in_flight.discard(chunk_id)
        return sid

    def owner(self, chunk_id: int) -> str | None:
        return self._owner.get(chunk_id)
