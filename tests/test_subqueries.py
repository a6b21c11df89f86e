"""Subqueries in FROM (issue 16): ``SELECT … FROM (SELECT …) x …``, derived tables.

The subquery is a relation: at each of its instants x holds its rows R(τ), each with ``ts`` = τ,
its level, and the subquery's columns; the outer query reads x through ``[NOW]``, is evaluated at
the subquery's instants, and its rows get the lub of the x rows they derive from, i.e. of the
input tuples below them (docs/semantics.md §3).  Recursively: a subquery may itself read one.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql import ast as A
from strata.mlscql.printer import to_text

from .distributed import assert_reference, check_examples, drawn_run, executors_of, run_distributed
from .reference.evaluator import compare_results, evaluate, evaluate_outcome
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, vital

EXAMPLES, SETTINGS = example_settings("STRATA_SUBQUERY_EXAMPLES", 25)


VITALS = [vital(1, "U", "a", 10), vital(2, "C", "b", 120), vital(3, "U", "a", 130), vital(4, "S", "c", 40), vital(5, "U", "b", 150)]
POSITIONS = [{"ts": 2, "level": "U", "sid": "a", "lat": 1.0, "lon": "x"},
             {"ts": 3, "level": "S", "sid": "b", "lat": 1.0, "lon": "y"}]
ABOVE = {"Vitals": [vital(2, "TS", "a", 999), vital(6, "S", "z", 1)],
         "Positions": [{"ts": 1, "level": "C", "sid": "a", "lat": 2.0, "lon": "z"}]}

HOT = "SELECT x.sid FROM (SELECT sid, AVG(bp) AS a FROM Vitals [RANGE 3] GROUP BY sid) x WHERE x.a > 100"
TEXTS = [
    HOT,
    "SELECT COUNT(*) AS n FROM (SELECT sid FROM Vitals [ROWS 2] UNION SELECT sid FROM Positions [ROWS 1]) AS y",
    "SELECT DSTREAM * FROM (SELECT * FROM (SELECT bp FROM Vitals [ROWS 2]) a WHERE level = U) b",
    "SELECT m, COUNT(*) AS k FROM (SELECT sid, MAX(bp) AS m FROM Vitals GROUP BY sid) t GROUP BY m",
    "SELECT ISTREAM DISTINCT s FROM (SELECT sid AS s, bp FROM Vitals [NOW WHERE bp > 50]) q WHERE q.bp < 140",
    # a subquery joined with a stream, and two subqueries joined
    "SELECT v.sid, v.bp, x.a FROM Vitals [ROWS 1] v, (SELECT sid, MAX(bp) AS a FROM Vitals [RANGE 2] GROUP BY sid) x "
    "WHERE v.sid = x.sid",
    "SELECT RSTREAM x.sid, y.n FROM (SELECT sid FROM Positions [ROWS 1]) x, "
    "(SELECT sid, COUNT(*) AS n FROM Vitals GROUP BY sid) y WHERE x.sid = y.sid",
    # a SELECT of a compound query over a subquery
    "SELECT x.sid FROM (SELECT sid, COUNT(*) AS n FROM Vitals [RANGE 3] GROUP BY sid) x WHERE x.n > 1 "
    "UNION SELECT sid FROM Positions [ROWS 1]",
]


def test_subqueries_parse_print_back_and_explain(battlefield):
    cq = compile_query(HOT, battlefield, "S")
    assert cq.rewritten == ("SELECT sid FROM (SELECT sid, AVG(bp) AS a FROM Vitals [RANGE 3 seconds level in "
                            "{U, C, S}] GROUP BY sid) x WHERE a > 100")
    again = compile_query(cq.rewritten, battlefield, "S")
    assert again.rewritten == cq.rewritten and again.query == cq.query and again.outer.query == cq.outer.query
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert cq.to_json()["subqueries"] == [{"name": "x", "query": cq.subqueries[0].rewritten}]
    assert [o.name for o in cq.outputs] == ["sid"] and cq.r2s == "ISTREAM" and cq.subqueries[0].r2s == "RSTREAM"
    # the chunks carry the subquery's FROM items
    assert [f.stream for f in cq.query.from_] == ["Vitals"] and cq.items[0].stream == "Vitals"
    nested = compile_query(TEXTS[2], battlefield, "S")
    assert nested.subqueries[0].subqueries[0] is not None and nested.r2s == "DSTREAM"
    # joined with a stream: chunks carry the stream item, then the subquery's items
    j = compile_query(TEXTS[5], battlefield, "S")
    assert [f.window.kind for f in j.query.from_] == ["rows", "range"] and j.subqueries[0] is None
    assert compile_query(j.rewritten, battlefield, "S").rewritten == j.rewritten


@pytest.mark.parametrize("text,msg", [
    ("SELECT * FROM (SELECT COUNT(*) FROM Vitals) x", r"name its column 1 \(COUNT\(\*\)\) with AS"),
    ("SELECT * FROM (SELECT sid FROM Vitals) Positions", "is already a stream's"),
    ("SELECT * FROM (SELECT sid FROM Vitals) x, (SELECT sid FROM Vitals) X", "or another subquery's"),
    ("SELECT * FROM (SELECT ISTREAM sid FROM Vitals) x", "a subquery in FROM is a relation"),
    ("SELECT x.bp FROM (SELECT sid FROM Vitals) x", "x has no attribute 'bp'"),
    ("SELECT * FROM (SELECT sid FROM Vitals [ROWS 1 level = TS]) x", "does not dominate"),
    ("SELECT * FROM (SELECT sid AS a, bp AS a FROM Vitals) x", "output column name 'a' is used twice"),
    ("SELECT * FROM (SELECT sid FROM Vitals) x WHERE level = TS", "does not dominate"),
    ("SELECT * FROM (SELECT sid FROM Vitals)", "expected"),
])
def test_bad_subqueries_are_refused_in_one_line(battlefield, text, msg):
    with pytest.raises(QueryError, match=msg) as e:
        compile_query(text, battlefield, "S")
    assert "\n" not in str(e.value)


def test_the_outer_query_reads_the_relation_at_each_instant(battlefield):
    streams = {"Vitals": VITALS, "Positions": POSITIONS}
    # AVG over RANGE 3 per sid: b's average passes 100 at 2 (120, C); a's at 4 (130 alone, U); b again at 5
    assert evaluate(HOT, battlefield, "S", streams) == [(2, "C", "b"), (4, "U", "a"), (5, "U", "b")]
    # the count of distinct sids in either window, at every instant of both streams
    assert evaluate(TEXTS[1], battlefield, "S", streams) == [(1, "U", 1), (2, "C", 2), (3, "S", 2), (4, "S", 3),
                                                             (5, "S", 2)]
    # a COUNT over an empty relation is 0 at the bottom level: at U the window at 1 holds nothing above 50
    assert evaluate("SELECT COUNT(*) AS n FROM (SELECT bp FROM Vitals [NOW WHERE bp > 50]) q", battlefield, "U",
                    streams) == [(1, "U", 0), (3, "U", 1), (5, "U", 1)]


HELD = "SELECT v.sid FROM Vitals [ROWS 1] v, (SELECT sid FROM Positions [ROWS 1]) x WHERE v.sid = x.sid"


@pytest.mark.spark
def test_the_relation_is_held_at_outer_instants_that_are_not_its_own(battlefield, engines):
    """docs/semantics.md §3: x holds R(τ) at every instant of the outer query.  Positions arrive at 2
    and 3 only; at 5 Vitals brings b, and the subquery's window still holds b (S, from 3): the join
    outputs at 5, at the lub of the two."""
    streams = {"Vitals": VITALS, "Positions": POSITIONS}
    assert evaluate(HELD, battlefield, "S", streams) == [(5, "S", "b")]
    # at U: Positions hold a from 2, when Vitals' last visible tuple is still a (from 1): the join
    # outputs at 2, an instant of the subquery's, and not again at 3 (ISTREAM)
    assert evaluate(HELD, battlefield, "U", streams) == [(2, "U", "a")]
    check_examples(battlefield, [HELD], streams, ABOVE, executors_of(engines, battlefield), incremental=(1, 3))


@pytest.mark.spark
def test_the_examples_through_chunks_and_two_workers(battlefield, engines):
    """Every example at U and S through chunks of 1-3 instants on two workers equals the reference,
    and a U session's output is the same with and without the tuples above U."""
    executors = executors_of(engines, battlefield)
    check_examples(battlefield, TEXTS, {"Vitals": VITALS, "Positions": POSITIONS}, ABOVE, executors,
                   incremental=(1, 3))


@pytest.mark.spark
def test_a_failing_subquery_fails_the_query_at_its_instant(battlefield, engines):
    rows = [vital(1, "U", "a", 1), vital(2, "U", "b", 2), vital(3, "U", "c", 3)]
    text = "SELECT COUNT(*) AS n FROM (SELECT ts * 4611686018427387904 AS big FROM Vitals [NOW]) x WHERE x.big > 0"
    exp = evaluate_outcome(text, battlefield, "S", {"Vitals": rows})
    assert exp.error_ts == 2 and [r[2] for r in exp.rows] == [1]
    # the same subquery in a SELECT of a compound query fails the compound query at 2
    compound = text + " UNION ALL SELECT COUNT(*) AS n FROM Vitals [NOW]"
    cexp = evaluate_outcome(compound, battlefield, "S", {"Vitals": rows})
    assert cexp.error_ts == 2 and sorted(r[2] for r in cexp.rows) == [1, 1]
    executors = executors_of(engines, battlefield)
    for k in (1, 3):
        out = run_distributed(battlefield, "S", [text, compound], inputs_of(battlefield, {"Vitals": rows}), executors,
                              chunk_instants=k)
        for q, e in (("q1", exp), ("q2", cexp)):
            assert out[q].error_ts == 2 and "integer overflow" in out[q].error
            compare_results(out[q].rows, e.rows)


def _named(text: str) -> str | None:
    """``text`` as a subquery: its select items named c0, c1, … and no stream operator."""
    q = parse(text)
    if isinstance(q, A.Compound) or q.select is None:
        return None
    sel = tuple(A.SelectItem(s.expr, f"c{k}") for k, s in enumerate(q.select))
    return to_text(A.Query(sel, q.from_, q.where, q.group_by, q.having, None, False, q.distinct))


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_queries_over_subqueries_equal_reference(battlefield, chinese_wall, engines, data):
    """Random outer queries (projection, selection, aggregates, DISTINCT, stream operators) over
    random subqueries, through chunks of random length on several workers, against the reference."""
    config = data.draw(st.sampled_from([battlefield, chinese_wall]), label="config")
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    inner = _named(data.draw(queries(config, level), label="subquery"))
    assume(inner is not None)
    try:
        cols = [o for o in compile_query(inner, config, config.lattice.parse(level)).outputs]
    except QueryError:
        assume(False)
    c = data.draw(st.sampled_from(cols), label="column").name
    stream = data.draw(st.sampled_from(sorted(config.streams)), label="stream")
    r2s = data.draw(st.sampled_from(["", "ISTREAM ", "RSTREAM ", "DSTREAM "]), label="r2s")
    shape = data.draw(st.sampled_from([
        f"SELECT {r2s}* FROM ({inner}) x",
        f"SELECT {r2s}COUNT(*) AS n FROM ({inner}) x",
        f"SELECT {r2s}x.{c}, COUNT(*) AS n FROM ({inner}) x GROUP BY x.{c}",
        f"SELECT {r2s}DISTINCT {c} FROM ({inner}) x",
        f"SELECT {r2s}{c} FROM ({inner}) AS x WHERE {c} IS NOT NULL",
        f"SELECT {r2s}COUNT(*) AS n FROM (SELECT * FROM ({inner}) y) x",
        f"SELECT {r2s}x.{c}, s.level FROM ({inner}) x, {stream} [ROWS 1] s",
        f"SELECT {r2s}COUNT(*) AS n FROM {stream} [NOW] s, ({inner}) x WHERE x.{c} IS NOT NULL",
        f"SELECT {r2s}x.{c} FROM ({inner}) x EXCEPT SELECT y.{c} FROM ({inner}) y WHERE y.{c} IS NULL",
    ]), label="outer")
    try:
        compile_query(shape, config, config.lattice.parse(level))
    except QueryError:
        assume(False)
    streams = data.draw(multistream(config), label="streams")
    assert_reference(config, level, [shape], streams, drawn_run(data, config, level, [shape], streams,
                                                                engines[id(config)]))
