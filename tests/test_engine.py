"""Spark chunk engine (worker/engine.py) against hand-computed results (SEMANTICS §5, §7)."""

from __future__ import annotations

import math
from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from strata.chunking.model import LegacyMode, QueryChunk, legacy_mode
from strata.config import parse_config
from strata.mlscql import compile_query
from strata.worker.engine import Engine, EngineError

from . import tables

pytestmark = pytest.mark.spark

VITALS_EXTRA = ("pr", "weight")


# -- helpers -------------------------------------------------------------------------


#: Vitals tuples from (ts, level, sid, bp[, pr]) rows as a chunk carries them: ``_seq`` counting from 1, pr
#: NULL unless given, weight NULL
vitals = partial(tables.vitals, pr=None, weight=None, seq=tables.counting(1))


def positions(rows, seq0: int = 1) -> pa.Table:
    """Positions tuples from (ts, level, sid, lat, lon) rows."""
    return pa.table({
        "_seq": pa.array(range(seq0, seq0 + len(rows)), pa.int64()),
        "ts": pa.array([r[0] for r in rows], pa.int64()),
        "level": pa.array([r[1] for r in rows], pa.string()),
        "sid": pa.array([r[2] for r in rows], pa.string()),
        "lat": pa.array([float(r[3]) for r in rows], pa.float64()),
        "lon": pa.array([r[4] for r in rows], pa.string()),
    })


def rows_of(result) -> list[tuple]:
    """Result rows as sorted tuples (rows of one instant form a bag)."""
    t = result.rows if hasattr(result, "rows") else result
    cols = [t.column(i).to_pylist() for i in range(t.num_columns)]
    return sorted(zip(*cols), key=lambda r: tuple((x is None, str(x)) for x in r))


def chunk(items, instants, prev=None, chunk_id=0, state=None, state_upto=None) -> QueryChunk:
    return QueryChunk("q", chunk_id, list(items), list(instants), prev, state, state_upto)


def prefix_chunks(table: pa.Table, instants: list[int], groups: list[list[int]], prev_first=None):
    """Chunks over ``groups`` of instants, each with every earlier tuple as legacy (a superset
    of any window's legacy) and prev_instant = the instant before the group."""
    out = []
    prev = prev_first
    for g in groups:
        mask = pc.less_equal(table.column("ts"), max(g))
        out.append((table.filter(mask), g, prev))
        prev = g[-1]
    return out


@pytest.fixture(scope="module")
def engine(spark, battlefield):
    return Engine(spark, battlefield)


@pytest.fixture(scope="module", params=["arrow", "spark"])
def any_engine(request, spark, battlefield):
    """Both ways of computing window membership: NumPy on the chunk, or Spark lead()."""
    return Engine(spark, battlefield, membership=request.param)


# -- dissertation examples ----------------------------------------------------------


def test_table_7_2_chunks_on_two_engines(spark, battlefield):
    """SELECT AVG(bp) FROM Vitals[ROWS 3]: ts 1 and 3 on engine A, ts 2 on engine B."""
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3]", battlefield, "U")
    a, b = Engine(spark, battlefield), Engine(spark, battlefield)
    t = [(1, "U", "AAA", 125), (1, "U", "BBB", 100), (1, "U", "CCC", 150), (2, "U", "DDD", 110), (3, "U", "EEE", 160)]
    r1 = a.run(cq, chunk([vitals(t[:3])], [1], chunk_id=1))
    r2 = b.run(cq, chunk([vitals(t[:4])], [2], prev=1, chunk_id=2))  # legacy AAA, BBB, CCC
    r3 = a.run(cq, chunk([vitals(t[1:5], seq=tables.counting(2))], [3], prev=2, chunk_id=3))  # legacy BBB, CCC, DDD
    assert rows_of(r1) == [(1, "U", 125.0)]
    assert rows_of(r2) == [(2, "U", 120.0)]
    assert rows_of(r3) == [(3, "U", 140.0)]
    assert r1.rows.schema.names == ["ts", "level", "AVG(bp)"]
    assert r1.rows.schema.field("AVG(bp)").type == pa.float64()
    assert (r2.query_id, r2.chunk_id) == ("q", 2)


def test_table_4_2_at_U_ignores_the_TS_tuple(engine, battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U", battlefield, "U")
    assert cq.query.from_[0].window.levels == {"U"}
    # visible substream: the TS tuple is never in a chunk; instant 3 has no visible tuple
    vis = vitals([(1, "U", "x", 100), (2, "U", "x", 100), (4, "U", "x", 160)], seq=[1, 2, 4])
    assert rows_of(engine.run(cq, chunk([vis], [1, 2, 4]))) == [(1, "U", 100.0), (2, "U", 100.0), (4, "U", 120.0)]
    # the same split over two chunks
    r1 = engine.run(cq, chunk([vis.slice(0, 1)], [1]))
    r2 = engine.run(cq, chunk([vis], [2, 4], prev=1))
    assert rows_of(r1) + rows_of(r2) == [(1, "U", 100.0), (2, "U", 100.0), (4, "U", 120.0)]


def test_table_4_2_at_TS_filters_after_the_window(engine, battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U", battlefield, "TS")
    assert cq.query.where is not None  # a ROWS window cannot take the WHERE level set
    t = vitals([(1, "U", "x", 100), (2, "U", "x", 100), (3, "TS", "x", 140), (4, "U", "x", 160)])
    expected = [(1, "U", 100.0), (2, "U", 100.0), (3, "U", 100.0), (4, "U", 130.0)]
    assert rows_of(engine.run(cq, chunk([t], [1, 2, 3, 4]))) == expected
    r1 = engine.run(cq, chunk([t.slice(0, 2)], [1, 2]))
    r2 = engine.run(cq, chunk([t], [3, 4], prev=2))
    assert rows_of(r1) + rows_of(r2) == expected


# -- joins and levels ------------------------------------------------------------------


def test_chinese_wall_join_level_is_the_lub(spark, chinese_wall):
    cq = compile_query(
        "SELECT a.serviceId, b.serviceId AS other, a.level AS la, b.level AS lb "
        "FROM MessageLog[NOW] a, MessageLog[NOW] b WHERE a.sender = b.receiver",
        chinese_wall, "[1,B]",
    )
    assert [o.name for o in cq.outputs] == ["serviceId", "other", "la", "lb"]
    log = pa.table({
        "_seq": pa.array([1, 2, 3], pa.int64()),
        "ts": pa.array([5, 5, 5], pa.int64()),
        "level": ["[1,⊥]", "[⊥,B]", "[⊥,⊥]"],
        "serviceId": ["s1", "s2", "s3"],
        "msgType": ["m", "m", "m"],
        "sender": ["alice", "bob", "carol"],
        "receiver": ["zed", "alice", "nobody"],
        "timestamp": pa.array([100, 101, 102], pa.int64()),
        "outcome": ["ok", "ok", "ok"],
    })
    res = Engine(spark, chinese_wall).run(cq, chunk([log, log], [5]))
    assert rows_of(res) == [(5, "[1,B]", "s1", "s2", "[1,⊥]", "[⊥,B]")]


def test_two_stream_join_on_sid(engine, battlefield):
    cq = compile_query(
        "SELECT RSTREAM v.sid, v.bp, p.lat FROM Vitals[ROWS 2] v, Positions[NOW] p WHERE v.sid = p.sid",
        battlefield, "TS",
    )
    v = vitals([(1, "U", "A", 100), (1, "C", "B", 120), (2, "S", "A", 130)])
    p = positions([(1, "U", "A", 1.0, "e"), (2, "U", "A", 2.0, "e"), (2, "TS", "B", 3.0, "w")])
    res = engine.run(cq, chunk([v, p], [1, 2]))
    # at 2 the ROWS 2 window of v holds (B,120,C) and (A,130,S)
    assert rows_of(res) == [(1, "U", "A", 100.0, 1.0), (2, "S", "A", 130.0, 2.0), (2, "TS", "B", 120.0, 3.0)]


def test_window_intervals_match_the_definition():
    """end_array + useful_rows against a brute-force reading of SEMANTICS §3 for ROWS/PARTITION."""
    import numpy as np

    from strata.mlscql.ast import Window
    from strata.worker.windows import end_array, useful_rows

    rng = np.random.default_rng(3)
    ts = np.sort(rng.integers(0, 8, 60)).astype(np.int64)
    part = pa.chunked_array([pa.array(rng.choice(["a", "b", None], 60).tolist())])
    for w in (Window("rows", rows=4), Window("partition", rows=2, partition_by=("p",)), Window("rows", rows=0)):
        end = end_array(w, ts, [part] if w.partition_by else [], 1.0)
        for tau in range(9):
            got = {i for i in range(60) if ts[i] <= tau < end[i]}
            keys = part.to_pylist() if w.partition_by else [0] * 60
            want = set()
            for k in set(keys):
                idx = [i for i in range(60) if keys[i] == k and ts[i] <= tau]
                want |= set(idx[len(idx) - w.rows:]) if w.rows else set()
            assert got == want, (w, tau)
        assert useful_rows(ts, end, [3, 5]).tolist() == [any(ts[i] <= t < end[i] for t in (3, 5)) for i in range(60)]


def test_level_decoding_matches_the_lattice(spark, battlefield, chinese_wall):
    from strata.worker.expr import level_of_mask

    for cfg in (battlefield, chinese_wall):
        lat = cfg.lattice
        masks = sorted({0} | {lat.encode(a) | lat.encode(b) for a in lat.levels for b in lat.levels})
        df = spark.createDataFrame(pa.table({"m": pa.array(masks, pa.int64())}))
        got = df.selectExpr(f"{level_of_mask(lat, 'm')} AS l").toArrow().column("l").to_pylist()
        assert got == [lat.decode(m) for m in masks]


# -- aggregates -----------------------------------------------------------------------


def test_group_by_having_with_group_levels(engine, battlefield):
    cq = compile_query(
        "SELECT sid, COUNT(*) AS n, AVG(bp) AS a, MAX(bp) + 1 AS m FROM Vitals[RANGE 2 SECONDS] "
        "WHERE bp > 50 GROUP BY sid HAVING COUNT(*) >= 2",
        battlefield, "TS",
    )
    t = vitals([
        (1, "U", "A", 100), (1, "C", "B", 120),
        (2, "S", "A", 110), (2, "U", "B", 90), (2, "TS", "A", 10),  # the TS tuple fails WHERE
        (3, "U", "A", 130),
    ])
    assert rows_of(engine.run(cq, chunk([t], [1, 2, 3]))) == [
        (2, "C", "B", 2, 105.0, 121.0),
        (2, "S", "A", 2, 105.0, 111.0),
        (3, "S", "A", 2, 120.0, 131.0),
    ]


def test_all_aggregates_and_the_empty_instant_row(engine, battlefield):
    cq = compile_query(
        "SELECT COUNT(*), COUNT(pr), SUM(bp), AVG(bp), MIN(sid), MAX(bp) FROM Vitals[NOW] WHERE bp > 100",
        battlefield, "TS",
    )
    t = vitals([
        (1, "U", "B", 110, 60.0), (1, "C", "A", 130), (1, "S", "Z", 90),
        (2, "TS", "A", 100),  # fails WHERE: the instant still gets its row, at the bottom level
        (3, "U", "Q", 101),
    ])
    res = engine.run(cq, chunk([t], [1, 2, 3]))
    assert res.rows.schema.names == ["ts", "level", "COUNT(*)", "COUNT(pr)", "SUM(bp)", "AVG(bp)", "MIN(sid)", "MAX(bp)"]
    assert [f.type for f in res.rows.schema][2:] == [pa.int64(), pa.int64(), pa.float64(), pa.float64(), pa.string(), pa.float64()]
    assert rows_of(res) == [
        (1, "C", 2, 1, 240.0, 120.0, "A", 130.0),
        (2, "U", 0, 0, None, None, None, None),
        (3, "U", 1, 0, 101.0, 101.0, "Q", 101.0),
    ]


def test_aggregate_of_empty_input_table(engine, battlefield):
    cq = compile_query("SELECT COUNT(*), MAX(bp) FROM Vitals[ROWS 5] WHERE bp > 1000", battlefield, "U")
    t = vitals([(4, "U", "A", 1)])
    assert rows_of(engine.run(cq, chunk([t], [4]))) == [(4, "U", 0, None)]


def test_partition_by_rows(any_engine, battlefield):
    t = vitals([(1, "U", "A", 1), (1, "C", "B", 10), (2, "U", "A", 2), (3, "U", "A", 4), (3, "U", "B", 20)])
    cq = compile_query("SELECT SUM(bp) FROM Vitals[PARTITION BY sid ROWS 2]", battlefield, "TS")
    assert rows_of(any_engine.run(cq, chunk([t], [1, 2, 3]))) == [(1, "C", 11.0), (2, "C", 13.0), (3, "C", 36.0)]
    cq = compile_query("SELECT RSTREAM sid, bp FROM Vitals[PARTITION BY sid ROWS 1]", battlefield, "TS")
    r = any_engine.run(cq, chunk([t], [2, 3], prev=1))
    assert rows_of(r) == [(2, "C", "B", 10.0), (2, "U", "A", 2.0), (3, "U", "A", 4.0), (3, "U", "B", 20.0)]


def test_now_and_range_windows(any_engine, battlefield):
    t = vitals([(1, "U", "A", 1), (2, "U", "B", 2), (2, "C", "C", 3), (4, "U", "D", 4), (7, "U", "E", 5)])
    now = compile_query("SELECT RSTREAM sid FROM Vitals[NOW]", battlefield, "TS")
    assert rows_of(any_engine.run(now, chunk([t], [2, 4, 7], prev=1))) == [
        (2, "C", "C"), (2, "U", "B"), (4, "U", "D"), (7, "U", "E")]
    rng = compile_query("SELECT COUNT(*), SUM(bp) FROM Vitals[RANGE 3 SECONDS]", battlefield, "TS")
    # at 4: ts in (1, 4]; at 7: ts in (4, 7]
    assert rows_of(any_engine.run(rng, chunk([t], [1, 2, 4, 7]))) == [
        (1, "U", 1, 1.0), (2, "C", 3, 6.0), (4, "C", 3, 9.0), (7, "U", 1, 5.0)]


def test_range_uses_the_configured_instant_length(spark):
    cfg = parse_config('[lattice]\nlevels = ["L", "H"]\n[time]\ninstant_seconds = 30\n[streams.S]\nx = "long"\n')
    cq = compile_query("SELECT SUM(x) FROM S[RANGE 1 MINUTE]", cfg, "H")  # 2 instants
    t = pa.table({"_seq": pa.array([1, 2, 3], pa.int64()), "ts": pa.array([1, 2, 3], pa.int64()),
                  "level": ["L", "H", "L"], "x": pa.array([1, 10, 100], pa.int64())})
    res = Engine(spark, cfg).run(cq, chunk([t], [1, 2, 3]))
    assert rows_of(res) == [(1, "L", 1), (2, "H", 11), (3, "H", 110)]
    assert res.rows.schema.field("SUM(x)").type == pa.int64()


# -- relation to stream ------------------------------------------------------------------


ISTREAM_DATA = [(1, "U", "A", 0), (1, "U", "A", 0), (2, "U", "B", 0), (3, "C", "A", 0)]


@pytest.mark.parametrize("r2s, expected", [
    ("ISTREAM", [(1, "U", "A"), (1, "U", "A"), (2, "U", "B"), (3, "C", "A")]),
    ("DSTREAM", [(2, "U", "A"), (3, "U", "A")]),
])
def test_istream_dstream_bag_difference_across_chunks(engine, battlefield, r2s, expected):
    """Windows (ROWS 2): {A,A}@1, {A,B}@2, {B,A/C}@3: the level is part of the row."""
    cq = compile_query(f"SELECT {r2s} sid FROM Vitals[ROWS 2]", battlefield, "TS")
    t = vitals(ISTREAM_DATA)
    whole = engine.run(cq, chunk([t], [1, 2, 3]))
    assert rows_of(whole) == expected
    # chunk boundary between 1 and 2: the second chunk's legacy is the window at prev_instant 1
    r1 = engine.run(cq, chunk([t.slice(0, 2)], [1]))
    r2 = engine.run(cq, chunk([t], [2, 3], prev=1))
    assert rows_of(r1) + rows_of(r2) == expected
    # one chunk per instant with minimal legacy
    r3 = engine.run(cq, chunk([t.slice(1, 3)], [3], prev=2))  # legacy (1,A) (2,B): window at 2
    assert rows_of(r1) + rows_of(engine.run(cq, chunk([t.slice(0, 3)], [2], prev=1))) + rows_of(r3) == expected


def test_istream_without_prev_instant_compares_with_empty(engine, battlefield):
    cq = compile_query("SELECT ISTREAM sid FROM Vitals[ROWS 2]", battlefield, "TS")
    t = vitals(ISTREAM_DATA)
    # prev_instant None: R(prev) is empty, so the whole window at 2 is new
    assert rows_of(engine.run(cq, chunk([t.slice(0, 3)], [2]))) == [(2, "U", "A"), (2, "U", "B")]


def test_istream_of_an_aggregate(engine, battlefield):
    cq = compile_query("SELECT ISTREAM COUNT(*) AS n FROM Vitals[RANGE 2 SECONDS]", battlefield, "TS")
    t = vitals([(1, "U", "A", 1), (2, "U", "B", 1), (3, "U", "C", 1), (4, "U", "D", 1), (4, "U", "E", 1)])
    # counts 1, 2, 2, 3: the unchanged count at 3 is not re-inserted
    assert rows_of(engine.run(cq, chunk([t], [2, 3, 4], prev=1))) == [(2, "U", 2), (4, "U", 3)]


# -- unbounded windows: NONE, HISTORY, STATE ------------------------------------------------


def test_none_mode_istream_of_new_tuples(engine, battlefield):
    cq = compile_query("SELECT sid, bp * 2 AS b2 FROM Vitals WHERE bp > 100", battlefield, "S")
    assert legacy_mode(cq) is LegacyMode.NONE
    t = vitals([(3, "S", "A", 150), (3, "U", "B", 50), (4, "C", "C", 101)])
    assert rows_of(engine.run(cq, chunk([t], [3, 4], prev=2))) == [(3, "S", "A", 300.0), (4, "C", "C", 202.0)]
    d = compile_query("SELECT DSTREAM sid FROM Vitals", battlefield, "S")
    res = engine.run(d, chunk([t], [3, 4], prev=2))
    assert res.rows.num_rows == 0 and res.rows.schema.names == ["ts", "level", "sid"]


def test_history_mode_rstream_selection(engine, battlefield):
    cq = compile_query("SELECT RSTREAM sid FROM Vitals", battlefield, "TS")
    assert legacy_mode(cq) is LegacyMode.HISTORY
    t = vitals([(1, "U", "A", 1), (2, "C", "B", 1), (3, "U", "C", 1)])
    assert rows_of(engine.run(cq, chunk([t], [2, 3], prev=1))) == [
        (2, "C", "B"), (2, "U", "A"), (3, "C", "B"), (3, "U", "A"), (3, "U", "C")]


STATE_ROWS = [
    (1, "U", "A", 10), (1, "C", "B", 20), (2, "U", "A", 30), (3, "S", "C", None),
    (3, "U", "B", 5), (4, "U", "A", 1), (5, "TS", "B", 100), (5, "U", "C", 7), (6, "U", "A", 2),
]


@pytest.mark.parametrize("text", [
    "SELECT sid, COUNT(*) AS n, COUNT(bp) AS nb, SUM(bp) AS s, AVG(bp) AS a, MIN(bp) AS lo, MAX(sid) AS hi "
    "FROM Vitals WHERE sid != 'Z' GROUP BY sid",
    "SELECT COUNT(*), AVG(bp) FROM Vitals WHERE bp > 6",
    "SELECT ISTREAM sid, MAX(bp) FROM Vitals GROUP BY sid HAVING COUNT(*) > 1",
])
def test_state_mode_over_three_chunks_equals_one_chunk(engine, battlefield, text):
    cq = compile_query(text, battlefield, "TS")
    assert legacy_mode(cq) is LegacyMode.STATE
    t = vitals(STATE_ROWS)
    whole = engine.run(cq, chunk([t], [1, 2, 3, 4, 5, 6]))
    assert whole.state_upto == 6
    got, state, upto, prev = [], None, None, None
    for g in ([1, 2], [3], [4, 5, 6]):
        ts = t.column("ts").to_pylist()
        idx = [i for i, x in enumerate(ts) if (upto is None or x > upto) and x <= g[-1]]
        res = engine.run(cq, chunk([t.take(idx)], g, prev=prev, state=state, state_upto=upto))
        assert res.state_upto == g[-1]
        got += rows_of(res)
        state, upto, prev = res.state, res.state_upto, g[-1]
    assert got == rows_of(whole)
    assert rows_of(state) == rows_of(whole.state)


def test_state_mode_values(engine, battlefield):
    cq = compile_query("SELECT sid, COUNT(*), SUM(bp), MIN(bp) FROM Vitals GROUP BY sid", battlefield, "TS")
    t = vitals(STATE_ROWS)
    r1 = engine.run(cq, chunk([t.slice(0, 3)], [1, 2]))
    assert rows_of(r1) == [(1, "C", "B", 1, 20.0, 20.0), (1, "U", "A", 1, 10.0, 10.0),
                          (2, "C", "B", 1, 20.0, 20.0), (2, "U", "A", 2, 40.0, 10.0)]
    assert r1.state.num_rows == 2 and r1.state_upto == 2
    r2 = engine.run(cq, chunk([t.slice(3, 2)], [3], prev=2, state=r1.state, state_upto=2))
    assert rows_of(r2) == [(3, "C", "B", 2, 25.0, 5.0), (3, "S", "C", 1, None, None), (3, "U", "A", 2, 40.0, 10.0)]


# -- expressions -----------------------------------------------------------------------------


def test_expression_semantics(engine, battlefield):
    cq = compile_query(
        "SELECT RSTREAM sid, bp / 0 AS z, -7 % 3 AS m, 7 / 2 AS h, bp > pr AS g FROM Vitals[ROWS 10] "
        "WHERE (NOT (pr > 1) OR level DOMINATED BY C) AND level IN {U, C, TS}",
        battlefield, "TS",
    )
    t = vitals([(1, "U", "A", 1, 5.0), (1, "U", "B", 1), (1, "S", "C", 1, 0.0), (1, "TS", "D", 9, 0.0)])
    # A: pr > 1 true, but U is dominated by C → kept; B: NOT NULL unknown, U ≤ C → kept;
    # C: S not in the IN list (a ROWS window keeps the condition in WHERE); D: NOT (0 > 1) → kept
    res = rows_of(engine.run(cq, chunk([t], [1])))
    assert res == [(1, "TS", "D", None, -1, 3.5, True), (1, "U", "A", None, -1, 3.5, False),
                   (1, "U", "B", None, -1, 3.5, None)]
    assert math.isclose(3.5, res[0][5])


def test_string_literals_with_quotes_and_braces(engine, battlefield):
    cq = compile_query("SELECT RSTREAM sid FROM Vitals[NOW] WHERE sid = 'it''s {x}\\'", battlefield, "U")
    t = vitals([(1, "U", "it's {x}\\", 1), (1, "U", "other", 1)])
    assert rows_of(engine.run(cq, chunk([t], [1]))) == [(1, "U", "it's {x}\\")]


def test_rejects_inconsistent_chunks(engine, battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3]", battlefield, "U")
    # the query's own problem: an error result for it (first instant, no rows), not an exception
    bad = engine.run(cq, chunk([vitals([(1, "U", "A", 1), (2, "U", "A", 1)]), vitals([])], [1, 2]))
    assert bad.error == "evaluation failed: chunk has 2 item tables; the query has 1 FROM items"
    assert bad.error_ts == 1 and bad.rows.num_rows == 0 and bad.state is None
    unknown = engine.run(cq, chunk([vitals([(1, "X", "A", 1)])], [1]))
    assert unknown.error.startswith("evaluation failed: chunk holds a level the lattice does not contain")
    assert unknown.error_ts == 1
    # isolate=False (the shared executor's merged runs): the exception itself
    with pytest.raises(EngineError):
        engine.run(cq, chunk([vitals([(1, "U", "A", 1)]), vitals([])], [1]), isolate=False)
    with pytest.raises(EngineError):
        engine.run(cq, chunk([vitals([(1, "X", "A", 1)])], [1]), isolate=False)
    empty = engine.run(cq, chunk([vitals([])], []))
    assert empty.rows.num_rows == 0 and empty.rows.schema.names == ["ts", "level", "AVG(bp)"]


# -- chunking invariance ------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "SELECT sid, bp FROM Vitals[ROWS 3] WHERE bp > 2",
    "SELECT DSTREAM sid FROM Vitals[RANGE 2 SECONDS]",
    "SELECT sid, AVG(bp) FROM Vitals[PARTITION BY sid ROWS 2] GROUP BY sid",
])
def test_chunking_does_not_change_the_answer(any_engine, battlefield, text):
    cq = compile_query(text, battlefield, "TS")
    t = vitals([(1, "U", "A", 1), (1, "C", "B", 3), (2, "U", "A", 4), (3, "S", "B", 5), (3, "U", "A", 6),
                (4, "U", "C", 2), (5, "U", "A", 7), (5, "TS", "B", 9)])
    whole = rows_of(any_engine.run(cq, chunk([t], [1, 2, 3, 4, 5])))
    got = []
    for table, inst, prev in prefix_chunks(t, [1, 2, 3, 4, 5], [[1, 2], [3], [4, 5]]):
        got += rows_of(any_engine.run(cq, chunk([table], inst, prev=prev)))
    assert sorted(got, key=str) == sorted(whole, key=str)


# -- string GROUP BY keys as dictionary codes --------------------------------------------------------
@pytest.mark.parametrize("text, coded", [
    ("SELECT sid, AVG(bp) FROM Vitals [RANGE 3 SECONDS] GROUP BY sid", [(0, "sid")]),
    ("ISTREAM(SELECT sid AS s, COUNT(*) FROM Vitals [ROWS 4] GROUP BY sid)", [(0, "sid")]),
    ("SELECT DISTINCT sid FROM Vitals [NOW]", [(0, "sid")]),
    ("SELECT sid, COUNT(*) FROM Vitals [ROWS 4] WHERE sid != 'A' GROUP BY sid", []),  # compared: kept a string
    ("SELECT sid, MAX(sid) FROM Vitals [ROWS 4] GROUP BY sid", []),  # aggregated: ordered as strings
    ("SELECT sid, COUNT(*) FROM Vitals [ROWS 4] GROUP BY sid HAVING sid > 'A'", []),
    ("SELECT bp, COUNT(*) FROM Vitals [ROWS 4] GROUP BY bp", []),  # not a string
    ("SELECT sid, COUNT(*) FROM Vitals [PARTITION BY sid ROWS 2] GROUP BY sid", []),  # partitions by it
    ("SELECT sid, COUNT(*) FROM Vitals GROUP BY sid", []),  # a running state keeps the keys across chunks
])
def test_string_group_keys_travel_as_codes_where_that_cannot_change_the_answer(spark, battlefield, text, coded):
    t = vitals([(1, "U", "A", 100), (1, "C", None, 120), (2, "S", "B", 110), (2, "U", "A", 90), (3, "U", None, 130),
                (3, "C", "B", 70)])
    cq = compile_query(text, battlefield, "TS")
    plain, coding = Engine(spark, battlefield, code_keys=False), Engine(spark, battlefield)
    from strata.worker.engine import _Run

    assert list(_Run(coding, cq, chunk([t], [1, 2, 3]), legacy_mode(cq)).coded) == coded
    assert list(_Run(plain, cq, chunk([t], [1, 2, 3]), legacy_mode(cq)).coded) == []
    got = coding.run(cq, chunk([t], [1, 2, 3]))
    assert got.error is None and rows_of(got) == rows_of(plain.run(cq, chunk([t], [1, 2, 3])))
    assert got.rows.schema == plain.run(cq, chunk([t], [1, 2, 3])).rows.schema  # strings again, NULL kept


def test_warm_up_runs_what_prepare_made_while_the_jvm_started(spark, battlefield):
    """A worker compiles the warm-up's queries and builds its first chunk while its JVM starts
    (worker/server.py); the warm-up then runs that chunk first.  A configuration without a
    stream to warm has nothing to prepare, and a negative budget warms nothing."""
    from strata.worker.warmup import prepare, warm_up

    prepared = prepare(battlefield, "S")
    assert prepared is not None and prepared["first"].num_rows == 100 + 3 * 300
    assert {kind for kind, _ in prepared["queries"]} == {"small", "range", "state"}
    done = warm_up(Engine(spark, battlefield), battlefield, "S", budget=0, prepared=prepared)
    assert done["steps"] == 1 and done["first_step"] is not None
    assert prepare(parse_config('[lattice]\nlevels = ["U"]\n[relations.R]\na = "double"\n'), "U") is None
    assert warm_up(Engine(spark, battlefield), battlefield, "S", budget=-1)["steps"] == 0


def test_warm_up_runs_the_runs_own_queries_when_it_knows_them(spark, battlefield, monkeypatch):
    """An embedded run passes the texts it will register (``strata worker --warm-queries``): the warm-up
    then evaluates those shapes, each without an error, instead of the generic ones: the RANGE one
    alone, the unbounded one alone, the others together.  A text that does not compile is left out
    (its registration names the error)."""
    from strata.worker import warmup

    monkeypatch.setattr(warmup, "_OWN_RANGE_PER_INSTANT", 40)  # the shape, not the JIT, in a test
    own = ["SELECT sid, AVG(bp) FROM Vitals [RANGE 10 SECONDS] GROUP BY sid",
           "SELECT AVG(bp) FROM Vitals [ROWS 100]",
           "SELECT V.sid, P.lat FROM Vitals [ROWS 10] V, Positions [ROWS 10] P WHERE V.sid = P.sid",
           "SELECT sid, COUNT(*) FROM Vitals GROUP BY sid",
           "SELECT nosuch FROM Vitals [ROWS 1]"]
    prepared = warmup.prepare(battlefield, "S", own)
    assert len(prepared["own"]) == 4
    seen = []

    class Recording(Engine):
        def run(self, cq, chunk, isolate=True):
            r = super().run(cq, chunk, isolate)
            seen.append((chunk.query_id, r.error))
            return r

    done = warmup.warm_up(Recording(spark, battlefield), battlefield, "S", budget=float("inf"), rounds=1,
                          prepared=prepared)
    assert done["steps"] == 3 and done["rounds"] == 1  # together, the RANGE one, the unbounded one
    assert {q for q, _ in seen} >= {"own0", "own3"} and not any(e for _, e in seen)
    assert not any(q.startswith("w") for q, _ in seen)  # no generic shape
