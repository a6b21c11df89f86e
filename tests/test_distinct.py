"""SELECT DISTINCT and COUNT(DISTINCT x) (issue 16).  SELECT DISTINCT: one row per distinct value tuple of
R(τ), at the lub of the levels of the rows it stands for (docs/semantics.md).  COUNT(DISTINCT x): the
number of distinct non-NULL values of x in the group, whose row keeps the group's level.

* the front end: parsed, authorized, rewritten and optimized like the query without DISTINCT (Alg. 2-4),
  grouped by the select list, printed back as SELECT DISTINCT (the rewritten text round-trips);
  combined with GROUP BY, HAVING or aggregates it is refused with one line;
* the levels: a value seen at U and at S is one row at S for an S session and one at U for a U session
  (a U session learns nothing of the S duplicate: its row is the same with or without it);
* differential: random non-aggregate queries made DISTINCT, through chunked, multi-worker evaluation
  with random chunk lengths, sharing and running states, equal the independent reference.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql.printer import to_text

from .distributed import assert_reference, drawn_run, executors_of, run_distributed
from .reference.evaluator import compare_results, evaluate, evaluate_outcome
from .strategies import example_settings, multistream, queries
from .tables import inputs_of

EXAMPLES, SETTINGS = example_settings("STRATA_DISTINCT_EXAMPLES", 20)


def test_distinct_compiles_to_a_grouping_and_prints_back(battlefield):
    cq = compile_query("select distinct sid, bp > 100 as hi from Vitals [ROWS 5] where level in {U, C}",
                       battlefield, "S")
    assert cq.query.distinct and cq.is_aggregate and len(cq.query.group_by) == 2
    assert cq.r2s == "ISTREAM"  # no aggregate in the select list: the default stays ISTREAM
    assert cq.rewritten.startswith("SELECT DISTINCT sid, bp > 100 AS hi FROM Vitals [ROWS 5 level in {")
    assert "GROUP BY" not in cq.rewritten
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert compile_query(cq.rewritten, battlefield, "S").rewritten == cq.rewritten
    star = compile_query("SELECT DISTINCT * FROM Vitals [NOW]", battlefield, "C")
    assert star.rewritten.startswith("SELECT DISTINCT sid, bp, pr, weight FROM Vitals [NOW level in {U, C}]")


@pytest.mark.parametrize("text", ["SELECT DISTINCT COUNT(*) FROM Vitals [ROWS 3]",
                                  "SELECT DISTINCT sid FROM Vitals [ROWS 3] GROUP BY sid, pr",
                                  "SELECT DISTINCT sid FROM Vitals [ROWS 3] GROUP BY sid HAVING COUNT(*) > 1"])
def test_distinct_over_groups_compiles_and_prints_back(battlefield, text):
    cq = compile_query(text, battlefield, "S")
    assert cq.query.distinct_rows and cq.rewritten.startswith("SELECT DISTINCT ")
    assert ("GROUP BY" in cq.rewritten) == ("GROUP BY" in text)
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert compile_query(cq.rewritten, battlefield, "S").rewritten == cq.rewritten
    # grouping by exactly the select list is the plain DISTINCT
    assert not compile_query("SELECT DISTINCT sid FROM Vitals GROUP BY sid", battlefield, "S").query.distinct_rows


def test_distinct_over_groups_keeps_one_row_per_value_at_the_lub(battlefield):
    q = "RSTREAM(SELECT DISTINCT COUNT(*) AS n FROM Vitals [RANGE 2 SECONDS] GROUP BY sid)"
    # at 3: a has its U row of instant 2, b its C and S rows; at 4: b (S) and c (U) have one row each
    rows = ROWS[:3] + [{"ts": 2, "level": "U", "sid": "a", "bp": 100.0, "pr": 1.0, "weight": 1.0}] + ROWS[3:]
    got = evaluate(q, battlefield, "S", {"Vitals": rows})
    assert sorted(r for r in got if r[0] == 3) == [(3, "S", 2), (3, "U", 1)]
    assert [r for r in got if r[0] == 4] == [(4, "S", 1)]  # b's S row and c's U row: one value, lub S


def test_distinct_is_still_authorized(battlefield):
    with pytest.raises(QueryError):
        compile_query("SELECT DISTINCT sid FROM Vitals [ROWS 3 level in {TS}]", battlefield, "S")


ROWS = [
    {"ts": 1, "level": "U", "sid": "a", "bp": 100.0, "pr": 1.0, "weight": 1.0},
    {"ts": 1, "level": "S", "sid": "a", "bp": 120.0, "pr": 1.0, "weight": 1.0},
    {"ts": 2, "level": "C", "sid": "b", "bp": 90.0, "pr": 1.0, "weight": 1.0},
    {"ts": 3, "level": "S", "sid": "b", "bp": 95.0, "pr": 1.0, "weight": 1.0},
    {"ts": 4, "level": "U", "sid": "c", "bp": 80.0, "pr": 1.0, "weight": 1.0},
]


def test_the_level_of_a_distinct_row_is_the_lub_of_its_rows(battlefield):
    q = "RSTREAM(SELECT DISTINCT sid FROM Vitals [RANGE 2 SECONDS])"
    assert evaluate(q, battlefield, "S", {"Vitals": ROWS}) == [
        (1, "S", "a"), (2, "S", "a"), (2, "C", "b"), (3, "S", "b"), (4, "S", "b"), (4, "U", "c")]
    # a U session: the S duplicates are not there, and its rows do not depend on them
    u = evaluate(q, battlefield, "U", {"Vitals": ROWS})
    assert u == evaluate(q, battlefield, "U", {"Vitals": [r for r in ROWS if r["level"] == "U"]})
    assert u == [(1, "U", "a"), (4, "U", "c")]  # its instants are the ts of U tuples only


@pytest.mark.spark
def test_the_example_through_chunks_and_two_workers(battlefield, engines):
    texts = ["RSTREAM(SELECT DISTINCT sid FROM Vitals [RANGE 2 SECONDS])", "SELECT DISTINCT sid FROM Vitals",
             "DSTREAM(SELECT DISTINCT sid FROM Vitals [ROWS 2])",
             # an ISTREAM aggregate over the unbounded window (hypothesis found it classified monotone)
             "SELECT ISTREAM sid, COUNT(*), COUNT(DISTINCT sid) FROM Vitals GROUP BY sid"]
    executors = executors_of(engines, battlefield)
    for level in ("U", "S"):
        out = run_distributed(battlefield, level, texts, inputs_of(battlefield, {"Vitals": ROWS}), executors,
                              chunk_instants=1, rnd=random.Random(3))
        for i, text in enumerate(texts):
            compare_results(out[f"q{i + 1}"].rows, evaluate(text, battlefield, level, {"Vitals": ROWS}))


_SELECT = re.compile(r"\b(select)(\s+(?:istream|rstream|dstream)\b)?", re.I)


@st.composite
def _made_distinct(draw, config, level, over_groups: bool):
    """A random query made SELECT DISTINCT: one without aggregates or grouping (``over_groups``
    False), or an aggregate one, whose groups' rows are made distinct."""
    text = draw(queries(config, level))
    if re.search(r"\bdistinct\b", text, re.I) is None:
        text = _SELECT.sub(lambda m: m.group(0) + " DISTINCT", text, count=1)
    try:
        cq = compile_query(text, config, config.lattice.parse(level))
    except QueryError:
        assume(False)
    assume(cq.query.distinct and cq.query.distinct_rows == over_groups)
    return text


def distinct_queries(config, level):
    return _made_distinct(config, level, over_groups=False)


def distinct_grouped_queries(config, level):
    return _made_distinct(config, level, over_groups=True)


_AGG = {f: re.compile(rf"\b({f})\s*\((?!\s*\*)(?!\s*distinct\b)", re.I) for f in ("count", "sum", "avg")}


@st.composite
def count_distinct_queries(draw, config, level):
    """A random aggregate query with one of its COUNT(x), SUM(x) or AVG(x) made DISTINCT."""
    text = draw(queries(config, level))
    if re.search(r"(count|sum|avg)\s*\(\s*distinct\b", text, re.I) is None:
        funcs = [f for f, rx in _AGG.items() if rx.search(text)]
        assume(funcs)
        f = draw(st.sampled_from(funcs), label="made distinct")
        text, n = _AGG[f].subn(lambda m: m.group(0) + "DISTINCT ", text, count=1)
        assume(n == 1)
    try:
        compile_query(text, config, config.lattice.parse(level))
    except QueryError:
        assume(False)
    return text


def test_count_distinct_compiles_prints_back_and_has_no_running_state(battlefield):
    cq = compile_query("SELECT sid, count(distinct bp * 2) FROM Vitals GROUP BY sid", battlefield, "S")
    assert "COUNT(DISTINCT bp * 2)" in cq.rewritten and to_text(parse(cq.rewritten)) == cq.rewritten
    assert cq.legacy_mode.value == "history"  # no running state for a set: the history travels
    # ISTREAM of an aggregate is not monotone: the history travels too (it was NONE, a failing chunk)
    istream = "SELECT ISTREAM sid, COUNT(DISTINCT sid) FROM Vitals GROUP BY sid"
    assert compile_query(istream, battlefield, "S").legacy_mode.value == "history"
    assert compile_query("SELECT sid, COUNT(bp) FROM Vitals GROUP BY sid", battlefield, "S").legacy_mode.value == "state"
    # MIN/MAX(DISTINCT x) is MIN/MAX(x); SUM/AVG(DISTINCT x) print back and carry the history
    assert "MIN(bp)" in compile_query("SELECT MIN(DISTINCT bp) FROM Vitals", battlefield, "S").rewritten
    s = compile_query("SELECT SUM(DISTINCT bp), AVG(DISTINCT bp) FROM Vitals", battlefield, "S")
    assert "SUM(DISTINCT bp), AVG(DISTINCT bp)" in s.rewritten and s.legacy_mode.value == "history"
    q = "SELECT sid, COUNT(DISTINCT bp) AS n FROM Vitals [RANGE 2 SECONDS] GROUP BY sid"
    rows = ROWS[:3] + [{"ts": 2, "level": "U", "sid": "a", "bp": 100.0, "pr": 1.0, "weight": 1.0}] + ROWS[3:]
    assert sorted(evaluate(q, battlefield, "S", {"Vitals": rows})) == sorted([
        (1, "S", "a", 2), (2, "S", "a", 2), (2, "C", "b", 1), (3, "U", "a", 1), (3, "S", "b", 2), (4, "S", "b", 1),
        (4, "U", "c", 1)])  # at 3 the window holds a's U 100 of instant 2 only


def test_sum_and_avg_distinct_add_each_value_once(battlefield):
    q = "RSTREAM(SELECT sid, SUM(DISTINCT bp) AS s, AVG(DISTINCT bp) AS a FROM Vitals [RANGE 2 SECONDS] GROUP BY sid)"
    rows = ROWS[:3] + [{"ts": 2, "level": "U", "sid": "a", "bp": 100.0, "pr": 1.0, "weight": 1.0}] + ROWS[3:]
    got = {(t, sid): (lv, s, a) for t, lv, sid, s, a in evaluate(q, battlefield, "S", {"Vitals": rows})}
    assert got[(2, "a")] == ("S", 220.0, 110.0)  # 100 (twice) and 120
    assert got[(3, "a")] == ("U", 100.0, 100.0) and got[(3, "b")] == ("S", 185.0, 92.5)


@pytest.mark.spark
def test_distinct_sums_of_longs_through_chunks(chinese_wall, engines):
    """SUM(DISTINCT) of a 64-bit attribute is exact, and fails at the instant its sum leaves the range."""
    base = {"serviceId": "s", "msgType": "m", "sender": "x", "receiver": "y", "outcome": "ok"}
    big = 2**62
    log = [{"ts": 1, "level": "[1,A]", **base, "timestamp": big}, {"ts": 1, "level": "[1,A]", **base, "timestamp": big},
           {"ts": 2, "level": "[1,A]", **base, "timestamp": 3}, {"ts": 3, "level": "[1,A]", **base, "timestamp": 2**63 - 2}]
    texts = ["SELECT SUM(DISTINCT timestamp), AVG(DISTINCT timestamp), COUNT(DISTINCT timestamp) "
             "FROM MessageLog [RANGE 2 SECONDS]"]
    level = "[1,A]"
    executors = executors_of(engines, chinese_wall)
    out = run_distributed(chinese_wall, level, texts, inputs_of(chinese_wall, {"MessageLog": log}), executors,
                          chunk_instants=1, rnd=random.Random(1))
    expected = evaluate_outcome(texts[0], chinese_wall, level, {"MessageLog": log})
    assert expected.error_ts == 3 and out["q1"].error_ts == 3  # 2**62 + 3 fits; 3 + 2**63 - 2 does not
    compare_results(out["q1"].rows, expected.rows)
    assert [r[2] for r in expected.rows] == [big, big + 3]


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_distinct_queries_equal_reference(battlefield, chinese_wall, engines, data):
    config = data.draw(st.sampled_from([battlefield, chinese_wall]), label="config")
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    form = data.draw(st.sampled_from([distinct_queries, count_distinct_queries, distinct_grouped_queries]), label="form")
    texts = [data.draw(form(config, level), label=f"query{i}") for i in range(data.draw(st.integers(1, 2)))]
    streams = data.draw(multistream(config), label="streams")
    assert_reference(config, level, texts, streams, drawn_run(data, config, level, texts, streams, engines[id(config)]))
