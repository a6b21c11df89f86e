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
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["ChunkTimings"]

PARTS = ("wait", "rtt", "engine", "transport", "merged")


class ChunkTimings:
    def __init__(self, keep: int = 1024):
        self._ready: dict[int, float] = {}  # chunk id -> when it was cut (ready)
        self._sent: dict[int, tuple[float, tuple[int, ...]]] = {}  # unit id -> (sent at, its chunk ids)
        self._done: deque[tuple[float, float, float, float, float]] = deque(maxlen=keep)
        self.count = 0

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
        self._done.append((max(0.0, t_sent - min(readies)), rtt, engine, max(0.0, rtt - engine), float(len(chunks))))
        self.count += 1

    def unsent(self, unit: int) -> None:
        """Unit ``unit`` came back without a result (failed, or its worker was lost): its chunks
        wait again from their first ready time."""
        self._sent.pop(unit, None)

    def forget(self, chunk_id: int) -> None:
        """A chunk released without a worker's result (given up, or no live query left)."""
        self._ready.pop(chunk_id, None)
        self._sent.pop(chunk_id, None)

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
