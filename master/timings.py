"""Where a chunk's time goes, for ``strata status`` and the benchmarks.

For the last ``keep`` chunks the master records

* ``wait``: closed (ready) → sent to a worker (Algorithm 5 waiting for a non-busy worker);
* ``rtt``: sent → result back (the Execute call: encode, TLS, decode, engine, encode);
* ``engine``: the seconds the worker's engine reported for the chunk's queries;
* ``transport`` = rtt − engine: everything on the wire and (de)serialization.

A re-dispatched chunk counts from its first ready time and its last send.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["ChunkTimings"]

PARTS = ("wait", "rtt", "engine", "transport")


class ChunkTimings:
    def __init__(self, keep: int = 1024):
        self._ready: dict[int, float] = {}
        self._sent: dict[int, float] = {}
        self._done: deque[tuple[float, float, float, float]] = deque(maxlen=keep)
        self.count = 0

    def ready(self, chunk_id: int, at: float) -> None:
        self._ready.setdefault(chunk_id, at)

    def sent(self, chunk_id: int, at: float) -> None:
        self._sent[chunk_id] = at

    def done(self, chunk_id: int, at: float, engine_seconds: float) -> None:
        ready, sent = self._ready.pop(chunk_id, None), self._sent.pop(chunk_id, None)
        if ready is None or sent is None:
            return  # a duplicate, or a chunk restored without timings
        rtt = max(0.0, at - sent)
        engine = max(0.0, float(engine_seconds))
        self._done.append((max(0.0, sent - ready), rtt, engine, max(0.0, rtt - engine)))
        self.count += 1

    def forget(self, chunk_id: int) -> None:
        """A chunk released without a worker's result (given up, or no live query left)."""
        self._ready.pop(chunk_id, None)
        self._sent.pop(chunk_id, None)

    def summary(self) -> dict[str, float]:
        """``<part>_p50_ms`` / ``<part>_p99_ms`` over the recorded chunks, and ``chunks``."""
        if not self._done:
            return {}
        a = np.array(self._done) * 1000.0
        out: dict[str, float] = {"chunks": float(len(a))}
        for i, part in enumerate(PARTS):
            p50, p99 = np.percentile(a[:, i], [50, 99])
            out[f"{part}_p50_ms"] = round(float(p50), 1)
            out[f"{part}_p99_ms"] = round(float(p99), 1)
        return out
