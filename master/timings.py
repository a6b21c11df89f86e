"""Where a chunk's time goes, for ``strata status`` and the benchmarks.

For the last ``keep`` chunks the master records

* ``wait``: closed (ready) → sent to a worker (Algorithm 5 waiting for a non-busy worker);
* ``rtt``: sent → result back (the Execute call: encode, TLS, decode, engine, encode);
* ``engine``: the seconds the worker's engine reported for the chunk's queries;
* ``transport`` = rtt − engine: everything on the wire and (de)serialization;
* ``merged``: how many cut chunks travelled in the dispatch unit (adaptive chunking).

Times are per dispatch unit (one Execute call; one or several chunks merged):
its wait counts from the oldest of its chunks' ready times.  A re-dispatched
chunk counts from its first ready time and its last send.

Besides the last ``keep`` units (``strata status``'s p50/p99), every unit since the master started
is counted in cumulative histograms (:meth:`ChunkTimings.histograms`, the Prometheus exporter's
``strata_chunk_seconds``): per stage (``wait``, ``rtt``, ``engine``, ``transport``, and ``latency``
= wait + rtt, ready to result) the count of units at or under each bound of :data:`BOUNDS`, their
sum and their count.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["ChunkTimings"]

PARTS = ("wait", "rtt", "engine", "transport", "merged")
#: the histograms' stages and upper bounds (seconds; +Inf is the count)
STAGES = ("wait", "rtt", "engine", "transport", "latency")
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ChunkTimings:
    def __init__(self, keep: int = 1024):
        self._ready: dict[int, float] = {}  # chunk id -> when it was cut (ready)
        self._sent: dict[int, tuple[float, tuple[int, ...]]] = {}  # unit id -> (sent at, its chunk ids)
        self._done: deque[tuple[float, float, float, float, float]] = deque(maxlen=keep)
        self.count = 0
        # per stage: units at or under each bound (not cumulative here), their sum in seconds
        self._buckets = {s: np.zeros(len(BOUNDS) + 1, dtype=np.int64) for s in STAGES}
        self._sums = dict.fromkeys(STAGES, 0.0)

    def ready(self, chunk_id: int, at: float) -> None:
        self._ready.setdefault(chunk_id, at)

    def sent(self, unit: int, chunks, at: float | None = None) -> None:
        """Unit ``unit`` (the chunk ids ``chunks``) sent at ``at``; ``sent(cid, at)``: one chunk."""
        if at is None:
            chunks, at = (unit,), chunks
        self._sent[unit] = (at, tuple(chunks))

    def done(self, unit: int, at: float, engine_seconds: float) -> None:
        sent = self._sent.pop(unit, None)
        if sent is None:
            return  # a duplicate, or a unit restored without timings
        t_sent, chunks = sent
        readies = [r for r in (self._ready.pop(c, None) for c in chunks) if r is not None]
        if not readies:
            return
        rtt = max(0.0, at - t_sent)
        engine = max(0.0, float(engine_seconds))
        wait = max(0.0, t_sent - min(readies))
        self._done.append((wait, rtt, engine, max(0.0, rtt - engine), float(len(chunks))))
        self.count += 1
        for stage, x in zip(STAGES, (wait, rtt, engine, max(0.0, rtt - engine), wait + rtt)):
            self._buckets[stage][int(np.searchsorted(BOUNDS, x, side="left"))] += 1
            self._sums[stage] += x

    def unsent(self, unit: int) -> None:
        """Unit ``unit`` came back without a result (failed, or its worker was lost): its chunks
        wait again from their first ready time."""
        self._sent.pop(unit, None)

    def forget(self, chunk_id: int) -> None:
        """A chunk released without a worker's result (given up, or no live query left)."""
        self._ready.pop(chunk_id, None)
        self._sent.pop(chunk_id, None)

    def histograms(self) -> dict[str, float]:
        """Every unit since the start, per stage: ``<stage>_le_<bound>`` (cumulative counts, the
        Prometheus way; the last bound is ``+Inf``), ``<stage>_sum`` (seconds), ``<stage>_count``."""
        if not self.count:
            return {}
        out: dict[str, float] = {}
        for stage in STAGES:
            cum = np.cumsum(self._buckets[stage])
            for bound, n in zip((*BOUNDS, float("inf")), cum):
                out[f"{stage}_le_{'+Inf' if bound == float('inf') else repr(bound)}"] = float(n)
            out[f"{stage}_sum"] = round(self._sums[stage], 6)
            out[f"{stage}_count"] = float(cum[-1])
        return out

    def summary(self) -> dict[str, float]:
        """``<part>_p50_ms`` / ``<part>_p99_ms`` over the recorded units, ``chunks`` (units recorded),
        ``merged_p50`` / ``merged_max`` (chunks per unit)."""
        if not self._done:
            return {}
        a = np.array(self._done) * 1000.0
        out: dict[str, float] = {"chunks": float(len(a))}
        for i, part in enumerate(PARTS[:4]):
            p50, p99 = np.percentile(a[:, i], [50, 99])
            out[f"{part}_p50_ms"] = round(float(p50), 1)
            out[f"{part}_p99_ms"] = round(float(p99), 1)
        merged = a[:, 4] / 1000.0
        out["merged_p50"] = round(float(np.percentile(merged, 50)), 1)
        out["merged_max"] = float(merged.max())
        return out
