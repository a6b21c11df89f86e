"""The master's chunks between cut and released: ready queue, units in flight, retries, adaptive units.

Beside :mod:`strata.master.dispatch` (Algorithm 5's table of workers, slots and credits) this is
the other half of dispatch, as plain state with no I/O and no lock of its own (the core calls it
under its lock):

* the **ready queue**: ids of chunks cut and waiting for a worker, ascending (:meth:`admit`);
* **units in flight**: a unit is one chunk or several consecutive ones merged
  (:func:`~strata.chunking.chunker.merge_chunks`), named by its first chunk's id, with the
  instants it covered when sent and when it was sent (:meth:`assignments`);
* **replies** (:meth:`on_result`): split per cut chunk and handed to the core's merge;
  **failures** (:meth:`on_failure`, :meth:`expire`): a lost worker's units go back uncounted, an
  error reply or an overrun deadline is one failed attempt of each chunk; a chunk that fails
  ``chunk_retries`` times is given up (its queries stop with an error, later chunks flow);
* **adaptive chunking**: when chunks wait for a worker, the next unit takes the oldest
  ``ceil(ready / shares)`` consecutive ones (:meth:`unit_size`; ``shares``: the workers that
  take chunks, busy or not, :meth:`shares`, and no more than one per ``split_rows`` rows the
  backlog gives Spark once pruned, :meth:`split`), at most ``max_unit_rows`` tuples and never a
  chunk that already failed; while input arrives faster than a job takes, ready chunks gather
  for up to one job's time (:meth:`holding`).  The answer does not depend on these decisions
  (tests/test_adaptive.py);
* the **backlog**: new rows of the chunks cut and not yet released (:attr:`backlog_rows`).

The core gives it three things of its own: ``live_view(chunk)`` (the chunk without its stopped
queries), ``release(chunk_id, results)`` (merge a chunk's results in chunk order) and ``notify()``
(the core's change signal, :mod:`strata.master.notify`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.chunker import ChunkingError, merge_chunks, split_result
from strata.chunking.model import Chunk, ChunkResult
from strata.chunking.prune import new_rows, work_rows
from strata.errors import one_line

from .dispatch import Dispatcher
from .pipeline import QueryPipeline, Released
from .timings import ChunkTimings

__all__ = ["DispatchState", "MAX_UNIT_ROWS", "SPLIT_ROWS"]

#: at most this many tuples (before pruning) in a merged dispatch unit; a single chunk may be larger
MAX_UNIT_ROWS = 1_000_000
#: rows (after pruning) a share of a backlog must give Spark before the backlog is split over another
#: worker (:meth:`DispatchState.split`): a job's fixed cost (~0.15-0.2 s of planning and scheduling,
#: warm) is what ~100-200 k rows of evaluation cost, and on a small host two jobs at once also
#: take each other's cores
SPLIT_ROWS = 100_000


def _fits(chunk: Chunk, results: list[ChunkResult]) -> bool:
    """Whether ``results`` can be ``chunk``'s alone: no row or state beyond its instants."""
    for r in results:
        if r.state_upto is not None and int(r.state_upto) > chunk.last_ts:
            return False
        if r.error_ts is not None and int(r.error_ts) > chunk.last_ts:
            return False
        rows = r.rows
        if rows is not None and rows.num_rows and "ts" in rows.column_names:
            top = pc.max(rows.column("ts")).as_py()
            if top is not None and top > chunk.last_ts:
                return False
    return True


class DispatchState:
    #: how long a lone advance's chunks wait for a next advance (:meth:`holding`): a bulk sender's
    #: batches come a few tens of ms apart; paced input pays this once per chunk period
    PROBE_SECONDS = 0.1

    def __init__(self, pipeline: QueryPipeline, dispatcher: Dispatcher, timings: ChunkTimings, clock,
                 live_view: Callable[[Chunk], Chunk], release: Callable[[int, list[ChunkResult]], list[Released]],
                 notify: Callable[[], None], chunk_deadline: float = 60.0, chunk_retries: int = 3,
                 adaptive: bool = True, max_unit_rows: int = MAX_UNIT_ROWS, split_rows: int = SPLIT_ROWS,
                 linger: bool = False, chunk_period: float = 1.0):
        """``chunk_retries``: failed attempts (error replies, deadline overruns) after which a chunk is
        given up.  ``adaptive``: merge consecutive ready chunks under a backlog (off: one chunk per
        unit).  ``linger``: while input arrives faster than a job takes, gather ready chunks for up to
        one job's time (at most one ``chunk_period``) before sending them (:meth:`holding`).
        ``split_rows``: a backlog is spread over another worker only for every this many rows it gives
        Spark once pruned (0: always one share per worker; :meth:`split`)."""
        self.pipeline = pipeline
        self.dispatcher = dispatcher
        self.timings = timings
        self._clock = clock
        self._live_view = live_view
        self._release = release
        self._notify = notify
        self.chunk_deadline = chunk_deadline
        self.chunk_retries = max(1, int(chunk_retries))
        self.adaptive = adaptive
        self.max_unit_rows = int(max_unit_rows)
        self.split_rows = max(0, int(split_rows))
        self.linger = linger
        self.chunk_period = float(chunk_period)
        self.starvation_seconds = 1.0
        self.ready: deque[int] = deque()  # chunk ids waiting for a worker, ascending
        #: dispatch units in flight: unit id (its first chunk's id) -> the chunk ids it covers
        self.units: dict[int, tuple[int, ...]] = {}
        self.spans: dict[int, tuple[int, int]] = {}  # unit id -> (first_ts, last_ts) as sent
        self.sent_at: dict[int, float] = {}  # unit id -> when it was sent
        self.cap: dict[int, int] = {}  # chunk id -> at most this many chunks per unit (after a timeout)
        self.share = 0  # the share of the current backlog a freed slot takes (0: no backlog)
        self.attempts: dict[int, int] = {}  # chunk id -> failed attempts so far
        self.last_failure: dict[int, tuple[str, str]] = {}  # chunk id -> (kind, detail) of its last failure
        self.work: dict[int, int] = {}  # chunk id -> rows it gives Spark once pruned (ready chunks)
        self.chunk_rows: dict[int, int] = {}  # chunk id -> its new rows, while cut and not released
        self.backlog_rows = 0  # their sum
        self.advanced: deque[float] = deque(maxlen=2)  # when the last two advances cut chunks
        self.cut_at: dict[int, float] = {}  # chunk id -> when it was cut (ready)
        self.job_seconds: float | None = None  # moving average of a unit's round trip
        self.blocked_since: float | None = None  # no worker could take the head of the queue since
        self.redispatched = 0
        self.failed_chunks = 0
        self.last_chunk_error = ""

    # -- chunks in and out -----------------------------------------------------------------------
    def admit(self, chunks: list[Chunk], now: float) -> None:
        """Chunks the pipeline cut (or a checkpoint held) join the ready queue and the backlog."""
        for c in chunks:
            self._ready_add(c.chunk_id)
            n = new_rows(c)  # its legacy is an earlier chunk's (or history's) rows: counted there
            self.chunk_rows[c.chunk_id] = n
            self.backlog_rows += n
        if chunks:
            self.advanced.append(now)
            for c in chunks:
                self.cut_at[c.chunk_id] = now
        for c in chunks:
            self.timings.ready(c.chunk_id, now)

    def released(self, chunk_ids) -> None:
        """Forget what was kept for chunks that are released now (no longer in the pipeline)."""
        for cid in chunk_ids:
            if cid not in self.pipeline.chunks:
                self.backlog_rows -= self.chunk_rows.pop(cid, 0)
                self.cut_at.pop(cid, None)
                self.work.pop(cid, None)
                self.attempts.pop(cid, None)
                self.last_failure.pop(cid, None)
                self.cap.pop(cid, None)

    def deadline_factor(self, unit: int) -> float:
        """How much longer than one chunk unit ``unit`` may take: 1 + 1/4 per extra chunk (at most 10)."""
        return min(10.0, 1.0 + 0.25 * (len(self.units.get(unit, (unit,))) - 1))

    def deadline(self, unit: int) -> float:
        """Seconds after which unit ``unit`` counts as overdue (``chunk_deadline`` for one chunk)."""
        return self.chunk_deadline * self.deadline_factor(unit)

    def _ready_add(self, cid: int) -> bool:
        """Put ``cid`` in the ready queue in id order (new chunks go last); False if it is there."""
        q = self.ready
        if not q or cid > q[-1]:
            q.append(cid)
            return True
        for i, x in enumerate(q):
            if x == cid:
                return False
            if x > cid:
                q.insert(i, cid)
                return True
        return False  # not reached

    # -- replies and failures --------------------------------------------------------------------------
    def _parts(self, lo: int, hi: int, first: int) -> list[Chunk]:
        """The unreleased cut chunks inside instants ``lo..hi`` (a unit's chunks), in order."""
        chunks = self.pipeline.chunks
        if first in chunks:  # the usual case: follow the cut order from the unit's first chunk
            out, cid = [], first
            while cid is not None and cid in chunks and chunks[cid].last_ts <= hi:
                out.append(chunks[cid])
                cid = self.pipeline.after.get(cid)
            return out
        return [c for c in chunks.values() if lo <= c.first_ts and c.last_ts <= hi]

    def on_result(self, chunk_id: int, sid: str, results: list[ChunkResult],
                  span: tuple[int, int] | None = None) -> list[Released]:
        """A worker's results for unit ``chunk_id``, split per cut chunk and released in order.

        ``span``: the instants (first_ts, last_ts) the unit covered when it was sent; it names
        the unit's chunks also when the reply comes late and they travel in other units now.
        Without it (callers that send single chunks) a reply that is not for the unit in
        flight must fit the one chunk ``chunk_id`` or it is ignored."""
        now = self._clock()
        unit = self.units.get(chunk_id)
        # the same id may have been re-sent with other chunks: the span tells the calls apart
        mine = self.dispatcher.owner(chunk_id) == sid and unit is not None and \
            (span is None or self.spans.get(chunk_id) == (int(span[0]), int(span[1])))
        if span is not None:
            parts = self._parts(int(span[0]), int(span[1]), chunk_id)
        elif mine:
            parts = [self.pipeline.chunks[c] for c in unit if c in self.pipeline.chunks]
        else:
            parts = [self.pipeline.chunks[chunk_id]] if chunk_id in self.pipeline.chunks else []
            if parts and not _fits(parts[0], results):
                self.pipeline.merger.duplicates += 1  # a late reply of a unit no longer known
                return []
        released: list[Released] = []
        try:
            if not parts or len(parts) == 1 and parts[0].chunk_id == chunk_id:
                released += self._release(chunk_id, results)
            else:
                per: dict[int, list[ChunkResult]] = {c.chunk_id: [] for c in parts}
                for r in results:
                    for cid, part in split_result(r, parts).items():
                        per[cid].append(part)
                for c in parts:
                    if not self.pipeline.recorded(c.chunk_id):
                        released += self._release(c.chunk_id, per[c.chunk_id])
        except ChunkingError as e:  # an inconsistent reply (e.g. a state snapshot beyond its chunk)
            if mine:
                self.dispatcher.unassign(chunk_id, now)
                self._failed_attempt(chunk_id, "BAD_REPLY", str(e))
            return released
        if mine:
            sent = self.sent_at.get(chunk_id)
            if sent is not None:
                rtt = max(0.0, now - sent)
                self.job_seconds = rtt if self.job_seconds is None else 0.7 * self.job_seconds + 0.3 * rtt
            self.dispatcher.complete(chunk_id, now, chunks=len(unit))
            self.units.pop(chunk_id, None)
            self.spans.pop(chunk_id, None)
            self.sent_at.pop(chunk_id, None)
        elif sid in self.dispatcher.table:
            self.dispatcher.table[sid].done += max(1, len(parts))
        self.timings.done(chunk_id, now, sum(float((r.stats or {}).get("seconds", 0.0)) for r in results))
        return released

    def on_failure(self, chunk_id: int, sid: str, drop_worker: bool = False, reason: str = "",
                   kind: str = "ERROR") -> None:
        """A worker's call for ``chunk_id`` failed.  ``drop_worker`` (the worker is unreachable):
        drop it and requeue its chunks, not counted against them; otherwise one failed attempt."""
        if drop_worker:
            self._requeue(self.dispatcher.remove(sid))
        elif self.dispatcher.owner(chunk_id) == sid:
            self.dispatcher.unassign(chunk_id, self._clock())
            self._failed_attempt(chunk_id, kind, reason)

    def expire(self, now: float) -> list[int]:
        """Drop silent workers and units past their deadline; requeue their chunks.

        A deadline overrun counts as a failed attempt of its chunks; a lost worker does not.
        Returns the ids of the units taken back."""
        lost = self.dispatcher.expire(now)
        late = [u for u, t in self.sent_at.items() if now - t > self.deadline(u) and u not in lost]
        self._requeue(lost)
        for u in late:
            self.dispatcher.unassign(u, now)
            self._failed_attempt(u, "DEADLINE", f"no result within {self.chunk_deadline:g} s")
        return lost + late

    def _requeue(self, units: list[int]) -> None:
        """Put the chunks of ``units`` whose results are not in back in the ready queue (not counted
        as failures)."""
        for u in units:
            self.sent_at.pop(u, None)
            self.timings.unsent(u)
            self.spans.pop(u, None)
            for cid in self.units.pop(u, (u,)):
                if cid in self.pipeline.chunks and not self.pipeline.recorded(cid) and self._ready_add(cid):
                    self.redispatched += 1
        if units:
            self._notify()

    def _failed_attempt(self, unit: int, kind: str, detail: str) -> None:
        """One more failed attempt of every chunk of ``unit`` still unanswered: requeue them, or give
        up those that reached the cap.  A chunk that failed once travels alone from then on, so
        the failures of a bad chunk are its own.  A merged unit that only ran out of time says
        nothing against any of its chunks: they go back uncounted, in units half as large."""
        self.spans.pop(unit, None)
        chunks = [c for c in self.units.pop(unit, (unit,))
                  if c in self.pipeline.chunks and not self.pipeline.recorded(c)]
        self.sent_at.pop(unit, None)
        self.timings.unsent(unit)
        if len(chunks) > 1 and kind in ("DEADLINE", "DEADLINE_EXCEEDED"):
            for cid in chunks:
                self.cap[cid] = max(1, min(self.cap.get(cid, len(chunks)), len(chunks) // 2))
            self._requeue(chunks)
            return
        again = []
        for cid in chunks:
            self.attempts[cid] = self.attempts.get(cid, 0) + 1
            self.last_failure[cid] = (kind, one_line(detail))
            if self.attempts[cid] >= self.chunk_retries:
                self._give_up(cid)
            else:
                again.append(cid)
        self._requeue(again)

    def _give_up(self, cid: int) -> None:
        """Stop every live query of chunk ``cid`` with an error naming its instants and the last
        failure, and release the chunk so that later chunks flow."""
        chunk = self.pipeline.chunks[cid]
        kind, detail = self.last_failure.get(cid, ("ERROR", ""))
        n = self.attempts.get(cid, 0)
        span = f"{chunk.first_ts}-{chunk.last_ts}" if chunk.first_ts != chunk.last_ts else f"{chunk.first_ts}"
        # the owners see the kind of failure only: a worker's text may name another user's query
        msg = f"the chunk of instants {span} failed {n} times on the workers (last failure: {kind}); query stopped"
        self.failed_chunks += 1
        self.last_chunk_error = f"chunk {cid} (instants {span}) given up after {n} failed attempts; last: " \
                                f"{kind}: {detail}".rstrip(": ")
        try:
            self.ready.remove(cid)
        except ValueError:
            pass
        self.timings.forget(cid)
        results = [ChunkResult(qc.query_id, cid, pa.table({}), error=msg,
                               error_ts=qc.instants[0] if qc.instants else chunk.first_ts)
                   for qc in self._live_view(chunk).queries]
        self._release(cid, results)

    # -- Algorithm 5 with adaptive units ----------------------------------------------------------------
    def assignments(self, now: float, finished: bool) -> list[tuple[Chunk, str]]:
        """Units to send now (without stopped queries), each with the worker chosen for it.

        A unit is one ready chunk or, when several wait, the oldest ``ceil(ready / workers)``
        consecutive ones merged (:func:`~strata.chunking.chunker.merge_chunks`; its id is its first
        chunk's).  A chunk left with no live query is released here without a worker.  ``finished``:
        the input is finished (nothing is held back then)."""
        out = []
        if self.holding(now, finished):
            return out
        floor = self.share if self.ready else 0
        issued = 0
        while self.ready:
            cid = self.ready[0]
            if cid not in self.pipeline.chunks or self.pipeline.recorded(cid):
                self.ready.popleft()
                continue
            view = self._live_view(self.pipeline.chunks[cid])
            if not view.queries:
                self.ready.popleft()
                self.timings.forget(cid)
                self._release(cid, [])
                continue
            starving = self.blocked_since is not None and now - self.blocked_since > self.starvation_seconds
            sid = self.dispatcher.pick(starving=starving)
            if sid is None:
                if self.blocked_since is None:
                    self.blocked_since = now
                break
            self.blocked_since = None
            # the workers busy before this call and those still free share what is ready; a
            # slot that frees later takes no smaller a share of the same backlog (else the
            # shares would shrink geometrically: many small jobs)
            want = max(floor, self.unit_size(len(self.ready), self.split(self.shares() - len(out))))
            issued = max(issued, want)
            views = self._take(view, want)
            unit = views[0].chunk_id
            ids = tuple(v.chunk_id for v in views)
            self.units[unit] = ids
            self.spans[unit] = (views[0].first_ts, views[-1].last_ts)
            self.dispatcher.assign(unit, sid, now)
            self.sent_at[unit] = now
            self.timings.sent(unit, ids, now)
            out.append((merge_chunks(views), sid))
        self.share = max(floor, issued) if self.ready and self.adaptive else 0
        return out

    def linger_seconds(self) -> float:
        """How long ready chunks may gather: one job's round trip as measured (none yet: a chunk
        period, the first jobs being the slow ones), between 50 ms and one chunk period."""
        est = self.job_seconds if self.job_seconds is not None else self.chunk_period
        return min(self.chunk_period, max(0.05, est))

    def holding(self, now: float, finished: bool) -> bool:
        """Whether to keep ready chunks back a little: input is arriving faster than a job takes
        (the last two advances, and the last one, within :meth:`linger_seconds`), the input is not
        finished, and the oldest ready chunk has waited less than that.  Then sending what is
        ready now would start jobs of a few instants each while many more instants arrive within
        one job's time; waiting that long makes fewer, larger jobs.  A lone advance (the first, or
        one long after the previous: paced input, or the start of a burst) is held for
        :data:`PROBE_SECONDS` only, to see whether another follows: a bulk replay's first
        advance otherwise went out as small jobs whose fixed cost (and CPU taken from the sender
        on a small host) made a 1 M-tuple replay run 6 jobs for 1.2 s of the JVMs' CPU (2 jobs,
        0.4 s with the probe; processing 1.3 s → 0.9 s).  A finished input is never held."""
        if not self.linger or finished or not self.ready or not self.advanced:
            return False
        wait = self.linger_seconds()
        last = self.advanced[-1]
        if len(self.advanced) < 2 or last - self.advanced[0] >= wait:
            return now - last < min(wait, self.PROBE_SECONDS)  # a lone advance: is more coming?
        if now - last >= wait:
            return False
        oldest = self.cut_at.get(self.ready[0])
        return oldest is not None and now - oldest < wait

    def shares(self) -> int:
        """How many units a backlog is cut into: one per worker that takes chunks (ready, external
        load below the threshold; busy or not), not one per slot.  A unit is one Spark job whose
        fixed cost (planning, scheduling: ~0.1 s of CPU) dwarfs a pruned instant's rows, and a
        worker's slots share its Spark cores: per slot, a 1 M-tuple replay on 2 workers ran 7-10
        jobs for 2.0-2.5 s of the JVMs' CPU; per worker, 4-6 jobs for 1.2-1.8 s.  The slots still
        keep the next unit on a worker when its current one ends."""
        table = self.dispatcher.table.values()
        live = [e for e in table if e.state == "ready" and e.external < self.dispatcher.cpu_threshold]
        return len(live or [e for e in table if e.state == "ready"])

    def split(self, shares: int) -> int:
        """How many of ``shares`` the ready backlog is cut into: one per :attr:`split_rows` rows it
        gives Spark once pruned, at least one, at most ``shares``.  A backlog of pruned ROWS-window
        chunks (a few thousand rows however many tuples arrived) is one job on one worker: two jobs
        of half of it each cost two jobs' fixed cost, at the same time on a 2-core host (a 1 M-tuple
        replay: two 25-instant jobs ~0.37 s each side by side, one 50-instant job ~0.2 s).  A backlog
        of RANGE windows, whose rows all count, is spread over every worker."""
        if not self.split_rows or shares <= 1:
            return shares
        work = 0
        for cid in self.ready:
            w = self.work.get(cid)
            if w is None:
                chunk = self.pipeline.chunks.get(cid)
                try:
                    w = 0 if chunk is None else work_rows(chunk, self.pipeline.queries)
                except Exception:  # noqa: BLE001 - an estimate only: count every row
                    w = chunk.num_rows
                self.work[cid] = w
            work += w
            if work >= shares * self.split_rows:
                return shares
        return max(1, min(shares, math.ceil(work / self.split_rows)))

    def unit_size(self, ready: int, shares: int) -> int:
        """How many ready chunks the next unit takes: an equal share of the backlog per worker of
        the group (:meth:`shares`), busy ones included.  A worker that frees while others are
        still busy takes its share, not the whole backlog (which would leave one worker with all
        of it while the others finish their units and idle)."""
        if not self.adaptive:
            return 1
        return max(1, math.ceil(ready / max(1, shares)))

    def _take(self, head: Chunk, want: int) -> list[Chunk]:
        """Pop the head of the ready queue (``head``: its live view) and up to ``want - 1`` chunks
        cut right after it, stopping at a chunk that failed before or at the row cap."""
        self.ready.popleft()
        views = [head]
        want = min(want, self.cap.get(head.chunk_id, want))
        if want <= 1 or self.attempts.get(head.chunk_id):
            return views
        rows = head.num_rows
        last = head.chunk_id
        while len(views) < want and self.ready:
            nxt = self.pipeline.after.get(last)
            if nxt is None or self.ready[0] != nxt or self.attempts.get(nxt):
                break
            want = min(want, self.cap.get(nxt, want))
            if len(views) >= want:
                break
            view = self._live_view(self.pipeline.chunks[nxt])
            if not view.queries:  # nothing to compute: release it here and look past it
                self.ready.popleft()
                self.timings.forget(nxt)
                self._release(nxt, [])
                last = nxt
                continue
            # a merged unit carries the first chunk's legacy only: the others add their new rows (counted
            # when the chunk was cut; a view without its stopped queries is counted again)
            added = self.chunk_rows.get(nxt) if view is self.pipeline.chunks[nxt] else None
            if added is None:
                try:
                    added = new_rows(view)
                except Exception:  # noqa: BLE001 - an estimate only: count every row
                    added = view.num_rows
            if rows + added > self.max_unit_rows:
                break
            self.ready.popleft()
            views.append(view)
            rows += added
            last = nxt
        return views
