"""Where chunks' time goes (master/timings.py), as `strata status` reports it."""

from __future__ import annotations

import pytest

from strata.master.timings import ChunkTimings


def test_parts_of_a_chunk():
    t = ChunkTimings()
    assert t.summary() == {}
    t.ready(1, 10.0)
    t.sent(1, 10.5)       # waited 0.5 s for a non-busy worker
    t.done(1, 10.8, 0.2)  # 0.3 s round trip, of which the engine 0.2 s
    s = t.summary()
    assert s["chunks"] == 1
    assert s["wait_p50_ms"] == 500.0 and s["rtt_p50_ms"] == pytest.approx(300.0)
    assert s["engine_p50_ms"] == 200.0 and s["transport_p50_ms"] == pytest.approx(100.0)


def test_redispatch_duplicates_and_bounds():
    t = ChunkTimings(keep=3)
    t.ready(7, 0.0)
    t.sent(7, 1.0)
    t.sent(7, 5.0)  # re-dispatched: counts from the first ready and the last send
    t.done(7, 6.0, 2.0)  # engine longer than... the round trip it reports: transport is never negative
    t.done(7, 9.0, 0.1)  # the stalled worker's late duplicate: ignored
    s = t.summary()
    assert s["chunks"] == 1 and s["wait_p50_ms"] == 5000.0 and s["transport_p50_ms"] == 0.0
    for cid in range(10, 20):
        t.ready(cid, 0.0)
        t.sent(cid, 0.0)
        t.done(cid, 0.01 * cid, 0.0)
    assert t.summary()["chunks"] == 3 and t.count == 11  # only the last `keep` chunks are summarised
    t.done(99, 1.0, 0.0)  # never seen (a restored chunk): ignored
    assert t.count == 11
