"""Plain master logic: stream shepherd, ordered merge, Algorithm 5 dispatch."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.master.dispatch import Dispatcher
from strata.master.merge import OrderedMerger
from strata.master.shepherd import Shepherd, ShepherdError


# ---- shepherd -------------------------------------------------------------------------
def test_s_master_never_holds_ts_tuples(battlefield):
    sh = Shepherd(battlefield.lattice, "S")
    t = pa.table({"ts": [1, 1, 2, 3], "level": ["U", "TS", "S", "TS"], "bp": [1.0, 2.0, 3.0, 4.0]})
    kept = sh.admit("Vitals", t)
    assert kept.column("level").to_pylist() == ["U", "S"]
    assert kept.column("bp").to_pylist() == [1.0, 3.0]
    assert sh.dropped["Vitals"] == 2


def test_chinese_wall_shepherd(chinese_wall):
    sh = Shepherd(chinese_wall.lattice, "[⊥,B]")
    t = pa.table({"ts": [1, 1, 1], "level": ["[⊥,B]", "[1,⊥]", "[⊥,⊥]"]})
    assert sh.admit("MessageLog", t).column("level").to_pylist() == ["[⊥,B]", "[⊥,⊥]"]


def test_source_writes_only_its_level(battlefield):
    sh = Shepherd(battlefield.lattice, "TS")
    stamped = sh.check_source("C", pa.table({"ts": [1, 2], "bp": [1.0, 2.0]}))
    assert stamped.column("level").to_pylist() == ["C", "C"]
    with pytest.raises(ShepherdError, match="may only write level C"):
        sh.check_source("C", pa.table({"ts": [1], "level": ["S"]}))


# ---- merge ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=15, unique=True).map(sorted), st.randoms())
def test_merge_releases_each_chunk_once_in_order(ids, rnd):
    m = OrderedMerger()
    for cid in ids:
        m.expect(cid)
    arrivals = ids + [rnd.choice(ids) for _ in range(5)]  # duplicates from slow workers
    rnd.shuffle(arrivals)
    released = []
    for cid in arrivals:
        released.extend(m.add(cid, f"r{cid}"))
    assert [c for c, _ in released] == ids
    assert m.waiting == 0 and m.duplicates == 5


def test_merge_rejects_out_of_order_registration():
    m = OrderedMerger()
    m.expect(3)
    with pytest.raises(ValueError):
        m.expect(2)


# ---- Algorithm 5 --------------------------------------------------------------------------
def test_busy_worker_gets_no_chunk_while_others_are_free():
    d = Dispatcher()
    d.heartbeat("w1", cpu=95.0, now=0)
    d.heartbeat("w2", cpu=10.0, now=0)
    d.heartbeat("w3", cpu=12.0, now=0)
    d.heartbeat("w4", cpu=89.9, now=0)
    picks = set()
    for cid in range(4):
        sid = d.pick()
        picks.add(sid)
        d.assign(cid, sid)
        d.complete(cid)
    assert "w1" not in picks
    assert picks == {"w2", "w3"}  # similarly loaded free workers share the chunks


def test_all_busy_means_wait_then_least_loaded():
    d = Dispatcher()
    d.heartbeat("w1", cpu=90.0, now=0)
    d.heartbeat("w2", cpu=99.0, now=0)
    assert d.pick() is None
    assert d.pick(starving=True) == "w1"
    d.heartbeat("w3", cpu=20.0, now=0)
    assert d.pick(starving=True) == "w3"  # a free worker always wins
    for cid in range(d.max_in_flight):
        d.assign(cid, "w3")
    assert d.pick(starving=True) is None  # w3 is merely at its in-flight limit: wait for it


def test_in_flight_limit_and_least_loaded():
    d = Dispatcher(max_in_flight=1)
    d.heartbeat("a", 5, 0)
    d.heartbeat("b", 50, 0)
    first = d.pick()
    d.assign(0, first)
    second = d.pick()
    assert {first, second} == {"a", "b"}
    d.assign(1, second)
    assert d.pick() is None
    d.complete(0)
    assert d.pick() == first


def test_silent_worker_dropped_and_chunks_returned():
    d = Dispatcher(timeout=3.0)
    d.heartbeat("a", 5, now=0)
    d.heartbeat("b", 5, now=0)
    d.assign(7, "a")
    d.assign(8, "a")
    d.heartbeat("b", 5, now=2.5)
    assert d.expire(now=3.5) == [7, 8]
    assert set(d.table) == {"b"}
    d.assign(7, "b")
    assert d.complete(7) == "b"
    assert d.complete(8) is None  # the lost worker's late answer is not attributed


def test_shepherd_canonicalizes_before_filtering(chinese_wall):
    sh = Shepherd(chinese_wall.lattice, "[⊥,B]")
    t = pa.table({"ts": [1, 1], "level": ["[0,B]", "[ 0 , 0 ]"]})  # valid levels, non-canonical spellings
    assert sh.admit("MessageLog", t).column("level").to_pylist() == ["[⊥,B]", "[⊥,⊥]"]
    assert not sh.dropped


@pytest.mark.parametrize("table, fragment", [
    (pa.table({"ts": [1]}), "needs a 'level' column"),
    (pa.table({"ts": [1], "level": [3]}), "must hold level names"),
    (pa.table({"ts": [1, 2], "level": ["U", None]}), "have no level"),
    (pa.table({"ts": [1], "level": ["SECRET"]}), "unknown level"),
])
def test_shepherd_rejects_bad_levels_whole(battlefield, table, fragment):
    sh = Shepherd(battlefield.lattice, "S")
    with pytest.raises(ShepherdError, match=fragment):
        sh.admit("Vitals", table)
    assert not sh.dropped


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.sampled_from(["U", "C", "S", "TS"]), min_size=1, max_size=30),
       at=st.sampled_from(["U", "C", "S", "TS"]))
def test_shepherd_fast_paths_equal_brute_force(battlefield, levels, at):
    """All-visible batches pass as they are and all-invisible ones are dropped whole: the
    kept rows and the drop count equal a tuple-by-tuple check whatever the mix."""
    sh = Shepherd(battlefield.lattice, at)
    t = pa.table({"ts": list(range(len(levels))), "level": levels})
    kept = sh.admit("Vitals", t)
    want = [i for i, lv in enumerate(levels) if battlefield.lattice.leq(lv, at)]
    assert kept.column("ts").to_pylist() == want
    assert sh.dropped["Vitals"] == len(levels) - len(want)
