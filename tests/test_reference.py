"""The reference evaluator itself, against answers computed by hand from the papers."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.config import parse_config
from strata.mlscql import QueryError, compile_query
from tests.conftest import BATTLEFIELD_TOML
from tests.reference import compare_results, evaluate
from tests.reference.evaluator import range_instants
from tests.strategies import multistream, queries, query_levels, stream_rows

HSET = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def vit(ts, level, bp=None, sid="s", pr=None, weight=None):
    return {"ts": ts, "level": level, "sid": sid, "bp": bp, "pr": pr, "weight": weight}


def pos(ts, level, sid="s", lat=None, lon=None):
    return {"ts": ts, "level": level, "sid": sid, "lat": lat, "lon": lon}


def msg(ts, level, serviceId="svc", msgType="req", sender=None, receiver=None, timestamp=None, outcome=None):
    return {"ts": ts, "level": level, "serviceId": serviceId, "msgType": msgType, "sender": sender,
            "receiver": receiver, "timestamp": timestamp, "outcome": outcome}


def check(actual, expected):
    compare_results(actual, expected)
    assert len(actual) == len(expected)


# ---- (a) dissertation Table 4.2 ---------------------------------------------------------
TABLE_4_2 = {"Vitals": [vit(1, "U", 100), vit(2, "U", 100), vit(3, "TS", 140), vit(4, "U", 160)]}
Q_4_2 = "SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U"


def test_table_4_2_at_U(battlefield):
    out = evaluate(Q_4_2, battlefield, "U", TABLE_4_2)
    assert sorted(out) == [(1, "U", 100.0), (2, "U", 100.0), (4, "U", 120.0)]  # nothing at 3


def test_table_4_2_at_TS(battlefield):
    out = evaluate(Q_4_2, battlefield, "TS", TABLE_4_2)
    # at 3 and 4 the rows that passed WHERE are all U: the output level is U
    assert sorted(out) == [(1, "U", 100.0), (2, "U", 100.0), (3, "U", 100.0), (4, "U", 130.0)]


# ---- (b) dissertation Table 7.2 ---------------------------------------------------------
def test_table_7_2(battlefield):
    s = {"Vitals": [vit(1, "U", 125, "AAA"), vit(1, "U", 100, "BBB"), vit(1, "U", 150, "CCC"),
                    vit(2, "U", 110, "DDD"), vit(3, "U", 160, "EEE")]}
    out = evaluate("SELECT AVG(bp) FROM Vitals[ROWS 3]", battlefield, "U", s)
    assert sorted(out) == [(1, "U", 125.0), (2, "U", 120.0), (3, "U", 140.0)]


# ---- (c) Qx vs Qy: window level clause filters before, WHERE after ----------------------------
QXY_INPUT = {"Vitals": [vit(1, "U", 100), vit(2, "C", 110), vit(3, "S", 200), vit(4, "TS", 300), vit(5, "U", 120)]}


def test_qx_window_clause_filters_before_the_window(battlefield):
    out = evaluate("SELECT AVG(bp) FROM Vitals[ROWS 2 level in {C,U}]", battlefield, "TS", QXY_INPUT)
    # visible substream is U,C only: instants 1, 2, 5
    check(out, [(1, "U", 100.0), (2, "C", 105.0), (5, "C", 115.0)])


def test_qy_where_level_filters_after_the_window(battlefield):
    out = evaluate("SELECT AVG(bp) FROM Vitals[ROWS 2] WHERE level in {C,U}", battlefield, "TS", QXY_INPUT)
    # at 4 the window holds S,TS: nothing passes WHERE -> AVG NULL at bottom level
    check(out, [(1, "U", 100.0), (2, "C", 105.0), (3, "C", 110.0), (4, "U", None), (5, "U", 120.0)])


# ---- (d) R2S bag differences, levels as row identity, lub of joins and groups ------------------
ISTREAM_INPUT = {"Vitals": [vit(1, "U", sid="a"), vit(1, "U", sid="a"), vit(2, "U", sid="a"), vit(3, "U", sid="b")]}


def test_istream_is_a_bag_difference(battlefield):
    out = evaluate("SELECT sid FROM Vitals[ROWS 2]", battlefield, "U", ISTREAM_INPUT)
    # R(1)={a,a}; R(2)={a,a}: nothing new; R(3)={a,b}
    check(out, [(1, "U", "a"), (1, "U", "a"), (3, "U", "b")])
    out = evaluate("SELECT ISTREAM sid FROM Vitals[ROWS 2]", battlefield, "U", ISTREAM_INPUT)
    check(out, [(1, "U", "a"), (1, "U", "a"), (3, "U", "b")])


def test_dstream_and_rstream(battlefield):
    out = evaluate("SELECT DSTREAM sid FROM Vitals[ROWS 2]", battlefield, "U", ISTREAM_INPUT)
    check(out, [(3, "U", "a")])  # one of the two a's left
    out = evaluate("DSTREAM(SELECT sid FROM Vitals[ROWS 2])", battlefield, "U", ISTREAM_INPUT)
    check(out, [(3, "U", "a")])
    out = evaluate("RSTREAM(SELECT sid FROM Vitals[ROWS 2])", battlefield, "U", ISTREAM_INPUT)
    check(out, [(1, "U", "a"), (1, "U", "a"), (2, "U", "a"), (2, "U", "a"), (3, "U", "a"), (3, "U", "b")])


def test_level_is_part_of_row_identity(battlefield):
    s = {"Vitals": [vit(1, "U", sid="a"), vit(2, "C", sid="a")]}
    check(evaluate("SELECT ISTREAM sid FROM Vitals[ROWS 1]", battlefield, "S", s), [(1, "U", "a"), (2, "C", "a")])
    check(evaluate("SELECT DSTREAM sid FROM Vitals[ROWS 1]", battlefield, "S", s), [(2, "U", "a")])


def test_default_r2s_is_rstream_for_aggregates(battlefield):
    s = {"Vitals": [vit(1, "U", 10), vit(2, "U", 20)]}
    out = evaluate("SELECT COUNT(*) FROM Vitals", battlefield, "U", s)
    check(out, [(1, "U", 1), (2, "U", 2)])
    out = evaluate("SELECT ISTREAM MAX(bp) FROM Vitals[RANGE UNBOUNDED]", battlefield, "U",
                   {"Vitals": [vit(1, "U", 10), vit(2, "U", 5), vit(3, "U", 30)]})
    check(out, [(1, "U", 10.0), (3, "U", 30.0)])


def test_chinese_wall_join_level_is_the_lub(chinese_wall):
    s = {"MessageLog": [msg(1, "[1,⊥]", sender="alice", receiver="bob"),
                        msg(1, "[⊥,B]", sender="bob", receiver="alice")]}
    q = ("SELECT m1.sender, m2.sender FROM MessageLog[NOW] m1, MessageLog[NOW] m2 "
         "WHERE m1.receiver = m2.sender AND m1.level = [1,0] AND m2.level = [0,B]")
    check(evaluate(q, chinese_wall, "[1,B]", s), [(1, "[1,B]", "alice", "bob")])
    q2 = "SELECT m1.sender, m2.sender FROM MessageLog[NOW] m1, MessageLog[NOW] m2 WHERE m1.receiver = m2.sender"
    check(evaluate(q2, chinese_wall, "[1,B]", s), [(1, "[1,B]", "alice", "bob"), (1, "[1,B]", "bob", "alice")])
    # at [1,⊥] the [⊥,B] tuple is invisible: no partner
    assert evaluate(q2, chinese_wall, "[1,⊥]", s) == []


def test_chinese_wall_group_lub_is_top_component(chinese_wall):
    s = {"MessageLog": [msg(1, "[⊥,A]", timestamp=1), msg(1, "[⊥,B]", timestamp=2), msg(1, "[⊥,C]", timestamp=3)]}
    q = "SELECT serviceId, MAX(timestamp) FROM MessageLog GROUP BY serviceId"
    check(evaluate(q, chinese_wall, "[⊥,T]", s), [(1, "[⊥,T]", "svc", 3)])
    check(evaluate(q, chinese_wall, "[T,T]", s), [(1, "[⊥,T]", "svc", 3)])
    check(evaluate(q, chinese_wall, "[⊥,B]", s), [(1, "[⊥,B]", "svc", 2)])


# ---- windows ---------------------------------------------------------------------------------
WIN_INPUT = {"Vitals": [vit(1, "U", 1, "a"), vit(1, "C", 2, "b"), vit(2, "U", 3, "a"), vit(4, "S", 4, "a"),
                        vit(5, "U", 5, "b"), vit(5, "U", 6, "a")]}


@pytest.mark.parametrize("window, expected", [
    ("[ROWS 2]", [(1, 3.0), (2, 5.0), (4, 7.0), (5, 11.0)]),
    ("[RANGE 2 SECONDS]", [(1, 3.0), (2, 6.0), (4, 4.0), (5, 15.0)]),
    ("[RANGE 1]", [(1, 3.0), (2, 3.0), (4, 4.0), (5, 11.0)]),
    ("[RANGE 1500 MILLISECONDS]", [(1, 3.0), (2, 6.0), (4, 4.0), (5, 15.0)]),  # ceil(1.5) = 2 instants
    ("[RANGE 0.5 seconds]", [(1, 3.0), (2, 3.0), (4, 4.0), (5, 11.0)]),
    ("[RANGE UNBOUNDED]", [(1, 3.0), (2, 6.0), (4, 10.0), (5, 21.0)]),
    ("", [(1, 3.0), (2, 6.0), (4, 10.0), (5, 21.0)]),
    ("[NOW]", [(1, 3.0), (2, 3.0), (4, 4.0), (5, 11.0)]),
    ("[PARTITION BY sid ROWS 1]", [(1, 3.0), (2, 5.0), (4, 6.0), (5, 11.0)]),
    ("[PARTITION BY level ROWS 1]", [(1, 3.0), (2, 5.0), (4, 9.0), (5, 12.0)]),
    ("[PARTITION BY sid, level ROWS 1]", [(1, 3.0), (2, 5.0), (4, 9.0), (5, 17.0)]),
    ("[ROWS 2 level in {U}]", [(1, 1.0), (2, 4.0), (5, 11.0)]),
    ("[ROWS 2 level = C]", [(1, 2.0)]),
    ("[ROWS 2 level DOMINATED BY C]", [(1, 3.0), (2, 5.0), (5, 11.0)]),
    ("[PARTITION BY level in {U,S} ROWS 1]", [(1, 1.0), (2, 3.0), (4, 7.0), (5, 10.0)]),
])
def test_window_contents(battlefield, window, expected):
    out = evaluate(f"SELECT SUM(bp) FROM Vitals{window}", battlefield, "S", WIN_INPUT)
    compare_results([(ts, v) for ts, _lvl, v in out], expected)
    assert len(out) == len(expected)


def test_window_clause_is_intersected_with_the_query_level(battlefield):
    # naming TS at C is rejected; DOMINATED BY C at C sees U and C only
    with pytest.raises(QueryError):
        evaluate("SELECT SUM(bp) FROM Vitals[ROWS 2 level DOMINATED BY TS]", battlefield, "C", WIN_INPUT)
    out = evaluate("SELECT SUM(bp) FROM Vitals[ROWS 9 level DOMINATED BY C]", battlefield, "C", WIN_INPUT)
    compare_results(out, [(1, "C", 3.0), (2, "C", 6.0), (5, "C", 17.0)])


def test_range_respects_instant_length():
    cfg = parse_config(BATTLEFIELD_TOML + "\n[time]\ninstant_seconds = 0.5\n")
    assert range_instants(1, "seconds", 0.5) == 2
    assert range_instants(3, "minutes", 1) == 180
    assert range_instants(100, "milliseconds", 0.1) == 1
    s = {"Vitals": [vit(1, "U", 1), vit(2, "U", 2), vit(3, "U", 4)]}
    out = evaluate("SELECT SUM(bp) FROM Vitals[RANGE 1 SECOND]", cfg, "U", s)
    check(out, [(1, "U", 1.0), (2, "U", 3.0), (3, "U", 6.0)])


# ---- expressions, NULLs, aggregates ------------------------------------------------------------
def test_arithmetic_semantics(battlefield):
    s = {"Vitals": [vit(1, "U", -7.0, pr=2.0), vit(1, "U", 5.0, pr=0.0), vit(1, "U", None, pr=1.0)]}
    out = evaluate("SELECT bp / pr, bp % 2, (ts - 8) % 3, (ts - 8) / 2, ts * 2 + 1 FROM Vitals", battlefield, "U", s)
    check(out, [
        (1, "U", -3.5, -1.0, -1, -3.5, 3),  # % truncates toward zero, like Java
        (1, "U", None, 1.0, -1, -3.5, 3),  # x / 0 = NULL
        (1, "U", None, None, -1, -3.5, 3),  # NULL propagates
    ])
    row = out[0]
    assert isinstance(row[4], int) and isinstance(row[5], float) and isinstance(row[6], int)


def test_three_valued_where(battlefield):
    s = {"Vitals": [vit(1, "U", None, "a"), vit(1, "U", 5.0, "b"), vit(1, "U", None, None)]}
    q = "SELECT sid FROM Vitals WHERE {}"
    assert [r[2] for r in evaluate(q.format("bp > 1 OR sid = 'a'"), battlefield, "U", s)] == ["a", "b"]
    assert [r[2] for r in evaluate(q.format("NOT (bp > 1)"), battlefield, "U", s)] == []
    assert [r[2] for r in evaluate(q.format("bp IS NULL"), battlefield, "U", s)] == ["a", None]
    assert [r[2] for r in evaluate(q.format("sid NOT IN ('b', NULL)"), battlefield, "U", s)] == []
    assert [r[2] for r in evaluate(q.format("sid IN ('b', NULL)"), battlefield, "U", s)] == ["b"]
    assert [r[2] for r in evaluate(q.format("sid < 'b'"), battlefield, "U", s)] == ["a"]


def test_aggregates_ignore_nulls_and_empty_input(battlefield):
    s = {"Vitals": [vit(1, "U", None), vit(1, "C", 4.0), vit(2, "C", None)]}
    q = "SELECT COUNT(*), COUNT(bp), SUM(bp), AVG(bp), MIN(bp), MAX(bp), SUM(ts) FROM Vitals[NOW]"
    check(evaluate(q, battlefield, "C", s), [(1, "C", 2, 1, 4.0, 4.0, 4.0, 4.0, 2), (2, "C", 1, 0, None, None, None, None, 2)])
    # an aggregate without GROUP BY yields one row per instant even over empty input, at the bottom level
    q2 = "SELECT COUNT(*), MAX(bp) FROM Vitals[NOW] WHERE bp > 100"
    check(evaluate(q2, battlefield, "C", s), [(1, "U", 0, None), (2, "U", 0, None)])
    # ... which HAVING can still remove
    check(evaluate(q2 + " HAVING COUNT(*) > 0", battlefield, "C", s), [])


def test_group_by_with_having_and_levels(battlefield):
    s = {"Vitals": [vit(1, "U", 1, "a"), vit(1, "S", 2, "a"), vit(1, "C", 3, "b"), vit(1, "U", 4, None)]}
    q = "SELECT sid, SUM(bp), MAX(bp) - MIN(bp) AS spread FROM Vitals GROUP BY sid HAVING COUNT(*) >= 1"
    check(evaluate(q, battlefield, "S", s), [(1, "S", "a", 3.0, 1.0), (1, "C", "b", 3.0, 0.0), (1, "U", None, 4.0, 0.0)])
    q2 = "SELECT level, COUNT(*) FROM Vitals GROUP BY level HAVING level != U"
    check(evaluate(q2, battlefield, "S", s), [(1, "S", "S", 1), (1, "C", "C", 1)])


def test_where_level_conditions(battlefield):
    s = {"Vitals": [vit(1, lv, i) for i, lv in enumerate(("U", "C", "S", "TS"))]}
    q = "SELECT bp FROM Vitals WHERE {}"
    cases = {
        "level = C": [1.0], "level != C": [0.0, 2.0, 3.0], "level IN {U, S}": [0.0, 2.0],
        "level NOT IN {U, S}": [1.0, 3.0], "level DOMINATED BY C": [0.0, 1.0], "\"S\" = level": [2.0],
        "level IN (U, 'TS')": [0.0, 3.0], "NOT (level = U) AND level DOMINATED BY S": [1.0, 2.0],
    }
    for cond, expected in cases.items():
        assert sorted(r[2] for r in evaluate(q.format(cond), battlefield, "TS", s)) == expected, cond


def test_select_star_over_a_join(battlefield):
    s = {"Vitals": [vit(1, "U", 1.0, "a", 2.0, 3.0)], "Positions": [pos(1, "C", "a", 9.0, "e")]}
    out = evaluate("SELECT * FROM Vitals[NOW] v, Positions[NOW] p WHERE v.sid = p.sid", battlefield, "C", s)
    check(out, [(1, "C", "a", 1.0, 2.0, 3.0, "a", 9.0, "e")])
    assert evaluate("SELECT * FROM Vitals[NOW] v, Positions[NOW] p WHERE v.sid = p.sid", battlefield, "U", s) == []


def test_instants_come_from_visible_tuples_of_all_items(battlefield):
    s = {"Vitals": [vit(1, "U", 1.0)], "Positions": [pos(3, "U", lat=1.0), pos(4, "S", lat=2.0)]}
    q = "SELECT RSTREAM v.bp FROM Vitals v, Positions p"
    check(evaluate(q, battlefield, "U", s), [(3, "U", 1.0)])
    check(evaluate(q, battlefield, "S", s), [(3, "U", 1.0), (4, "S", 1.0), (4, "U", 1.0)])


def test_rejected_queries_raise_query_error(battlefield):
    with pytest.raises(QueryError):
        evaluate("SELECT AVG(bp) FROM Vitals[ROWS 3 level in {TS}]", battlefield, "S", {})
    with pytest.raises(QueryError):  # never outputs: window admits U, WHERE wants C
        evaluate("SELECT AVG(bp) FROM Vitals[ROWS 3 level = U] WHERE level = C", battlefield, "TS", {})
    with pytest.raises(QueryError):
        evaluate("SELEC bp FROM Vitals", battlefield, "U", {})


def test_decreasing_ts_is_rejected(battlefield):
    with pytest.raises(ValueError):
        evaluate("SELECT bp FROM Vitals", battlefield, "U", {"Vitals": [vit(2, "U", 1.0), vit(1, "U", 1.0)]})


# ---- compare_results -------------------------------------------------------------------------
def test_compare_results_tolerance_and_bags():
    compare_results([(1, "U", 0.1 + 0.2), (1, "U", None), (2, "C", "x")],
                    [(2, "C", "x"), (1, "U", None), (1, "U", 0.3)])
    compare_results([(1, "U", 1e-12)], [(1, "U", 0.0)])
    with pytest.raises(AssertionError, match="ts=1"):
        compare_results([(1, "U", 1.0)], [(1, "U", 1.0), (1, "U", 1.0)])
    with pytest.raises(AssertionError, match="ts=2"):
        compare_results([(1, "U", 1.0), (2, "U", None)], [(1, "U", 1.0), (2, "U", 0.0)])
    with pytest.raises(AssertionError) as e:
        compare_results([(3, "U", 1.0)], [(3, "C", 1.0)])
    assert "missing" in str(e.value) and "unexpected" in str(e.value)


# ---- (e) non-interference ----------------------------------------------------------------------
def test_invisible_tuples_change_nothing(battlefield):
    base = {"Vitals": [vit(1, "U", 100), vit(2, "S", 100), vit(4, "C", 160)]}
    noisy = {"Vitals": [vit(1, "U", 100), vit(1, "TS", 999), vit(2, "S", 100), vit(3, "TS", 1),
                        vit(4, "C", 160), vit(6, "TS", 5)]}
    for q in ("SELECT AVG(bp) FROM Vitals[ROWS 2]", "SELECT COUNT(*) FROM Vitals[RANGE 2]",
              "SELECT ISTREAM bp FROM Vitals[NOW]", "SELECT DSTREAM bp FROM Vitals[ROWS 1]"):
        assert evaluate(q, battlefield, "S", noisy) == evaluate(q, battlefield, "S", base), q


def _add_invisible(data, streams, config, invisible):
    """Insert tuples at ``invisible`` levels: copies after existing tuples and new trailing instants."""
    out = {}
    for name, rows in streams.items():
        new = []
        for r in rows:
            new.append(r)
            if data.draw(st.booleans()):
                new.append({**r, "level": data.draw(st.sampled_from(invisible))})
        last = rows[-1]["ts"] if rows else 0
        tail = data.draw(stream_rows(config, name, levels=invisible, max_instants=2, start=last))
        out[name] = new + tail
    return out


@HSET
@given(data=st.data())
def test_non_interference_generated_battlefield(battlefield, data):
    q = data.draw(queries(battlefield, "S"))
    s = data.draw(multistream(battlefield, levels=["U", "C", "S"]))
    noisy = _add_invisible(data, s, battlefield, ["TS"])
    compare_results(evaluate(q, battlefield, "S", noisy), evaluate(q, battlefield, "S", s))


@HSET
@given(data=st.data())
def test_non_interference_generated_chinese_wall(chinese_wall, data):
    lat = chinese_wall.lattice
    level = data.draw(st.sampled_from(["[1,A]", "[1,T]", "[T,B]", "[⊥,T]"]))
    dom = sorted(lat.dominated(level))
    invisible = sorted(set(lat.levels) - set(dom))
    q = data.draw(queries(chinese_wall, level))
    s = data.draw(multistream(chinese_wall, levels=dom))
    noisy = _add_invisible(data, s, chinese_wall, invisible)
    compare_results(evaluate(q, chinese_wall, level, noisy), evaluate(q, chinese_wall, level, s))


# ---- (f) generated queries evaluate ----------------------------------------------------------------
def _run_generated(config, data):
    level = data.draw(query_levels(config))
    q = data.draw(queries(config, level))
    s = data.draw(multistream(config))
    out = evaluate(q, config, level, s)
    width = len(compile_query(q, config, level).outputs) + 2
    dom = config.lattice.dominated(level)
    for row in out:
        assert len(row) == width
        assert row[1] in dom  # an output level never exceeds the query level
    compare_results(out, list(reversed(out)))


@HSET
@given(data=st.data())
def test_generated_queries_battlefield(battlefield, data):
    _run_generated(battlefield, data)


@HSET
@given(data=st.data())
def test_generated_queries_chinese_wall(chinese_wall, data):
    _run_generated(chinese_wall, data)


def test_optimization_never_changes_the_instants(battlefield):
    """SEMANTICS §5 (issue 16): the instants are the arrivals of the visible substreams as Alg. 3
    rewrote them, before Alg. 4 moves a WHERE level condition into a RANGE/UNBOUNDED/NOW/PARTITION
    BY level window: an instant where only tuples the condition filters out arrived still counts."""
    streams = {"Vitals": [
        {"ts": 1, "level": "U", "sid": "a", "bp": 5.0, "pr": 1.0, "weight": 1.0},
        {"ts": 2, "level": "TS", "sid": "a", "bp": 7.0, "pr": 1.0, "weight": 1.0},
        {"ts": 3, "level": "U", "sid": "a", "bp": 5.0, "pr": 1.0, "weight": 1.0},
    ]}
    got = evaluate("SELECT COUNT(*) FROM Vitals[RANGE 5 seconds] WHERE level = U", battlefield, "TS", streams)
    assert sorted(got) == [(1, "U", 1), (2, "U", 1), (3, "U", 2)]
    # ISTREAM: R(2) is empty (the NOW window's TS tuple fails WHERE), so the U tuple at 3 is new again
    got = evaluate("SELECT bp FROM Vitals[NOW] WHERE level = U", battlefield, "TS", streams)
    assert sorted(got) == [(1, "U", 5.0), (3, "U", 5.0)]
    got = evaluate("SELECT COUNT(*) FROM Vitals[ROWS 5] WHERE level = U", battlefield, "TS", streams)
    assert sorted(got) == [(1, "U", 1), (2, "U", 1), (3, "U", 2)]


ISSUE_16_ROWS = [(1, "C", "s3", 139.0, 71.0), (1, "S", "s1", 51.0, 96.0), (2, "C", "s1", 109.0, 103.0),
                 (3, "U", "s2", 100.0, 94.0), (3, "C", "s3", 144.0, 145.0), (4, "S", "s5", 55.0, 106.0),
                 (4, "C", "s4", 184.0, 170.0), (5, "S", "s5", 60.0, 100.0)]
ISSUE_16_QUERY = "SELECT sid, SUM(bp) FROM Vitals [RANGE 3 SECONDS] WHERE level in {U} GROUP BY sid"


def test_issue_16_example_in_the_reference(battlefield):
    streams = {"Vitals": [{"ts": t, "level": lv, "sid": s, "bp": b, "pr": p, "weight": 1.0}
                          for t, lv, s, b, p in ISSUE_16_ROWS]}
    assert sorted(evaluate(ISSUE_16_QUERY, battlefield, "S", streams)) == [(3, "U", "s2", 100.0),
                                                                           (4, "U", "s2", 100.0),
                                                                           (5, "U", "s2", 100.0)]


# ---- integer overflow (SEMANTICS §8 "Integer overflow fails the query") ---------------------------
def _log(*stamps):
    """MessageLog tuples (ts, timestamp) at level [1,A] of the Chinese Wall config."""
    return {"MessageLog": [msg(ts, "[1,A]", timestamp=v) for ts, v in stamps]}


MAX, MIN = 2**63 - 1, -(2**63)


@pytest.mark.parametrize("expr,value", [
    ("timestamp + 0", MAX), ("timestamp - 1", MAX - 1), ("timestamp % -1", 0), ("timestamp / 2", MAX / 2),
    ("timestamp * 1.5", MAX * 1.5), ("-timestamp - 1", MIN), ("-(timestamp - 1) - 1", MIN + 1),
])
def test_64_bit_arithmetic_in_range(chinese_wall, expr, value):
    got = evaluate(f"SELECT {expr} AS v FROM MessageLog [NOW]", chinese_wall, "[1,A]", _log((1, MAX)))
    assert got == [(1, "[1,A]", value)]


@pytest.mark.parametrize("expr", ["timestamp + 1", "timestamp * 2", "-timestamp - 2", "timestamp - -1",
                                  "(timestamp + 1) - 1", "timestamp * 2 / 2"])
def test_64_bit_overflow_fails_at_its_instant(chinese_wall, expr):
    from tests.reference.evaluator import QueryFailed, evaluate_outcome

    s = _log((1, 5), (2, MAX), (3, 5))
    out = evaluate_outcome(f"SELECT {expr} AS v FROM MessageLog [NOW]", chinese_wall, "[1,A]", s)
    assert out.error_ts == 2 and out.error.startswith("integer overflow")
    assert [r[0] for r in out.rows] == [1]
    with pytest.raises(QueryFailed):
        evaluate(f"SELECT {expr} AS v FROM MessageLog [NOW]", chinese_wall, "[1,A]", s)


def test_where_conjuncts_and_no_short_circuit(chinese_wall):
    from tests.reference.evaluator import evaluate_outcome

    s = _log((1, MAX), (2, 1))
    q = "SELECT ts FROM MessageLog [NOW] WHERE {}"
    # a FALSE or NULL top-level conjunct drops the row: its other conjuncts cannot fail it
    assert evaluate_outcome(q.format("timestamp < 0 AND timestamp + 1 > 0"), chinese_wall, "[1,A]", s).error_ts is None
    assert evaluate_outcome(q.format("sender = 'x' AND timestamp + 1 > 0"), chinese_wall, "[1,A]", s).error_ts is None
    # inside a conjunct, both operands of AND/OR are evaluated
    assert evaluate_outcome(q.format("(timestamp < 0 AND timestamp + 1 > 0) OR ts > 0"), chinese_wall, "[1,A]",
                            s).error_ts == 1
    assert evaluate_outcome(q.format("timestamp > 0 OR timestamp * 2 > 0"), chinese_wall, "[1,A]", s).error_ts == 1


def test_sums_are_exact_and_fail_out_of_range(chinese_wall):
    from tests.reference.evaluator import evaluate_outcome

    s = _log((1, MAX), (1, 1), (2, -5), (3, MAX), (4, MIN), (4, MIN))
    # the window [ROWS 2] at 1 holds MAX and 1: MAX + 1 is out of range; AVG is exact and never fails
    out = evaluate_outcome("SELECT SUM(timestamp) FROM MessageLog [ROWS 2]", chinese_wall, "[1,A]", s)
    assert out.error_ts == 1 and out.rows == []
    avg = evaluate("SELECT AVG(timestamp) FROM MessageLog [ROWS 2]", chinese_wall, "[1,A]", s)
    assert [r[2] for r in avg] == [(MAX + 1) / 2, -4 / 2, (MAX - 5) / 2, MIN]
    # MAX + 1 - 5: a partial sum out of range is no failure, only the total counts
    s = _log((1, MAX), (1, 1), (1, -5), (2, MAX), (3, 10))
    out = evaluate_outcome("SELECT SUM(timestamp) FROM MessageLog [ROWS 3]", chinese_wall, "[1,A]", s)
    assert out.rows == [(1, "[1,A]", MAX - 4), (2, "[1,A]", MAX - 4)] and out.error_ts == 3  # -5 + MAX + 10
    # a long compared with a double is compared as a double (2**63 - 1 rounds to 2**63)
    got = evaluate("SELECT ts FROM MessageLog [NOW] WHERE timestamp = 9223372036854775807.0", chinese_wall,
                   "[1,A]", _log((1, MAX)))
    assert got == [(1, "[1,A]", 1)]
