"""UNION, UNION ALL, EXCEPT and INTERSECT of SELECTs (issue 16), with parentheses, e.g.
``SELECT sid FROM Vitals [ROWS 2] UNION SELECT sid FROM Positions [NOW]``.

Each SELECT is authorized, rewritten and optimized on its own; the query's instants are the
arrivals of every SELECT's visible substreams; at each instant the SELECTs' relations are
combined left to right and the stream operator applies to the result.  Levels: UNION ALL keeps
each row's level; UNION gives a row the lub of the rows (of either side) it stands for; EXCEPT
the lub of the left rows it stands for; INTERSECT the lub of the rows of both sides it stands for
(docs/semantics.md §3).  INTERSECT binds tighter than UNION and EXCEPT, as in SQL."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql.printer import to_text

from .distributed import assert_reference, check_examples, drawn_run, executors_of, run_distributed
from .reference.evaluator import compare_results, evaluate, evaluate_outcome
from .strategies import compound_queries, example_settings, multistream
from .tables import inputs_of, vital

EXAMPLES, SETTINGS = example_settings("STRATA_SETOPS_EXAMPLES", 25)


def _p(ts, level, sid):
    return {"ts": ts, "level": level, "sid": sid, "lat": 1.0, "lon": "x"}


VITALS = [vital(1, "U", "a", 10), vital(2, "C", "b", 20), vital(3, "U", "a", 30), vital(4, "S", "c", 40)]
POSITIONS = [_p(2, "U", "a"), _p(3, "S", "b")]
#: what a U session must not notice: tuples above U in both streams
ABOVE = {"Vitals": [vital(2, "TS", "a", 99), vital(5, "S", "z", 1)], "Positions": [_p(1, "C", "a"), _p(6, "TS", "q")]}

UNION = "SELECT sid FROM Vitals [ROWS 2] UNION SELECT sid FROM Positions [ROWS 1]"
ALL = "RSTREAM(SELECT sid FROM Vitals [ROWS 2] UNION ALL SELECT sid FROM Positions [ROWS 1])"
EXCEPT = "RSTREAM(SELECT sid FROM Vitals [RANGE 3] EXCEPT SELECT sid FROM Positions [NOW])"
MIXED = "SELECT sid, COUNT(*) FROM Vitals [RANGE 2] GROUP BY sid UNION SELECT sid, 7.5 FROM Positions"
INTERSECT = "RSTREAM(SELECT sid FROM Vitals [RANGE 3] INTERSECT SELECT sid FROM Positions [ROWS 1])"
TEXTS = [UNION, ALL, EXCEPT, MIXED,
         "SELECT DSTREAM sid FROM Vitals [ROWS 1] EXCEPT SELECT sid FROM Vitals [NOW WHERE bp > 25] "
         "UNION ALL SELECT sid FROM Positions [ROWS 1 WHERE level = U]",
         INTERSECT,
         # INTERSECT binds tighter; parentheses group
         "SELECT RSTREAM sid FROM Positions [NOW] UNION SELECT sid FROM Vitals [RANGE 2] INTERSECT "
         "SELECT sid FROM Positions [ROWS 2]",
         "RSTREAM(SELECT sid FROM Vitals [RANGE 3] EXCEPT (SELECT sid FROM Positions [NOW] UNION ALL "
         "SELECT sid FROM Vitals [NOW WHERE bp > 35]))"]


def test_compound_queries_parse_print_back_and_explain(battlefield):
    cq = compile_query("select istream sid from Vitals [rows 2] union all select sid from Positions p where p.lat > 0 "
                       "except select sid from Vitals [now]", battlefield, "S")
    assert cq.set_ops == ("UNION ALL", "EXCEPT") and cq.r2s == "ISTREAM" and len(cq.branches) == 3
    assert cq.rewritten == ("SELECT ISTREAM sid FROM Vitals [ROWS 2 level in {U, C, S}] UNION ALL SELECT sid FROM "
                            "Positions [RANGE UNBOUNDED level in {U, C, S}] p WHERE lat > 0 EXCEPT SELECT sid FROM "
                            "Vitals [NOW level in {U, C, S}]")
    again = compile_query(cq.rewritten, battlefield, "S")
    assert [b.query for b in again.branches] == [b.query for b in cq.branches] and again.query == cq.query
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    j = cq.to_json()
    assert j["set_ops"] == ["UNION ALL", "EXCEPT"] and len(j["branches"]) == 3 and len(j["windows"]) == 3
    # the stream operator around the whole query; the default: RSTREAM when a SELECT aggregates
    w = compile_query("DSTREAM(SELECT sid FROM Vitals UNION SELECT sid FROM Positions)", battlefield, "S")
    assert w.r2s == "DSTREAM" and w.rewritten.startswith("DSTREAM(SELECT sid FROM Vitals")
    m = compile_query(MIXED, battlefield, "S")
    assert m.r2s == "RSTREAM" and [o.type for o in m.outputs] == ["string", "double"]


def test_ctes_read_once_are_written_in_place():
    """worker/engine.py inline_ctes: a CTE read exactly once as a FROM or JOIN item becomes a derived table
    of the same name; one read twice, one followed by an alias (EXCEPT's ``d l``), one named in a qualifier
    or only inside a string literal or a quoted identifier stays a CTE."""
    from strata.worker.engine import inline_ctes

    ctes = [("w0", "SELECT a FROM \x00t\x00"), ("r", "SELECT a FROM w0 WHERE b = 'FROM w0'"),
            ("c", "SELECT * FROM r UNION ALL SELECT * FROM r"), ("lv", "SELECT * FROM c")]
    kept, final = inline_ctes(ctes, "(SELECT * FROM lv) EXCEPT ALL (SELECT * FROM lv WHERE FALSE)")
    assert kept == [("r", "SELECT a FROM (SELECT a FROM \x00t\x00) AS w0 WHERE b = 'FROM w0'"),
                    ("lv", "SELECT * FROM (SELECT * FROM r UNION ALL SELECT * FROM r) AS c")]
    assert final == "(SELECT * FROM lv) EXCEPT ALL (SELECT * FROM lv WHERE FALSE)"
    aliased = [("d", "SELECT 1 AS x"), ("e", "SELECT 2 AS x")]
    assert inline_ctes(aliased, "SELECT * FROM d l JOIN e ON l.x = e.x") == (
        aliased, "SELECT * FROM d l JOIN e ON l.x = e.x")
    quoted = [("d", "SELECT 'it\\'s FROM e' AS `x``FROM e`"), ("e", "SELECT * FROM d")]
    assert inline_ctes(quoted, "SELECT * FROM e") == (
        [], "SELECT * FROM (SELECT * FROM (SELECT 'it\\'s FROM e' AS `x``FROM e`) AS d) AS e")
    unread = [("e", "SELECT 1 AS x")]
    assert inline_ctes(unread, "SELECT 'FROM e' AS y") == (unread, "SELECT 'FROM e' AS y")


@pytest.mark.parametrize("text,msg", [
    ("SELECT sid FROM Vitals UNION SELECT sid, bp FROM Vitals", "UNION: the SELECTs have 1 and 2 columns"),
    ("SELECT sid FROM Vitals EXCEPT SELECT bp FROM Vitals", "EXCEPT: column 1 is string in one SELECT and double"),
    ("SELECT sid FROM Vitals UNION SELECT ISTREAM sid FROM Vitals", "put the stream operator on the first SELECT"),
    ("SELECT sid FROM Vitals UNION SELECT sid FROM Vitals [ROWS 1 level = TS]", "does not dominate"),
    ("SELECT sid FROM Vitals UNION SELECT sid FROM Nowhere", "unknown stream 'Nowhere'"),
    ("SELECT sid FROM Vitals UNION", "unexpected end of query"),
    ("(SELECT ISTREAM sid FROM Vitals) UNION SELECT sid FROM Vitals", "ISTREAM inside parentheses"),
    ("SELECT sid FROM Vitals INTERSECT SELECT sid, bp FROM Vitals", "INTERSECT: the SELECTs have 1 and 2"),
])
def test_bad_compound_queries_are_refused_in_one_line(battlefield, text, msg):
    with pytest.raises(QueryError, match=msg) as e:
        compile_query(text, battlefield, "S")
    assert "\n" not in str(e.value)


def test_the_reference_combines_relations_at_every_instant(battlefield):
    streams = {"Vitals": VITALS, "Positions": POSITIONS}
    # τ3: Vitals holds a (U) and b (C), Positions b (S): b stands for a C and an S row, so it is S
    assert evaluate(UNION, battlefield, "S", streams) == [(1, "U", "a"), (2, "C", "b"), (3, "S", "b"), (4, "S", "c")]
    assert sorted(evaluate(EXCEPT, battlefield, "S", streams)) == [
        (1, "U", "a"), (2, "C", "b"), (3, "U", "a"), (4, "C", "b"), (4, "S", "c"), (4, "U", "a")]
    assert sorted(r for r in evaluate(ALL, battlefield, "S", streams) if r[0] == 2) == [
        (2, "C", "b"), (2, "U", "a"), (2, "U", "a")]
    # a U session: instants 1, 2, 3 (the U arrivals of either stream), U rows only
    assert evaluate(UNION, battlefield, "U", streams) == [(1, "U", "a")]
    # (at 3 Vitals' ROWS 2 holds both U tuples of a, Positions' ROWS 1 the one of 2)
    assert evaluate(ALL, battlefield, "U", streams) == [(1, "U", "a")] + [(2, "U", "a")] * 2 + [(3, "U", "a")] * 3
    # INTERSECT: at 3 b stands for Vitals' C row and Positions' S row: S
    assert evaluate(INTERSECT, battlefield, "S", streams) == [(2, "U", "a"), (3, "S", "b"), (4, "S", "b")]
    assert evaluate(INTERSECT, battlefield, "U", streams) == [(2, "U", "a"), (3, "U", "a")]


def test_intersect_binds_tighter_and_parentheses_group(battlefield):
    a, b, c = ("SELECT sid FROM Vitals [ROWS 2]", "SELECT sid FROM Positions [NOW]", "SELECT sid FROM Vitals [NOW]")
    tight = compile_query(f"{a} UNION {b} INTERSECT {c}", battlefield, "S")
    assert tight.set_ops == ("UNION",) and tight.branches[1].set_ops == ("INTERSECT",)
    assert tight.rewritten.count("(") == 1 and " UNION (SELECT sid FROM Positions" in tight.rewritten
    left = compile_query(f"({a} UNION {b}) INTERSECT {c}", battlefield, "S")
    assert left.set_ops == ("UNION", "INTERSECT") and len(left.branches) == 3
    for cq in (tight, left):
        again = compile_query(cq.rewritten, battlefield, "S")
        assert again.rewritten == cq.rewritten and again.query == cq.query
    # a stream operator with the first SELECTs in parentheses goes around the whole query
    r = compile_query(f"SELECT RSTREAM sid FROM Vitals [ROWS 2] UNION {b} INTERSECT {c}", battlefield, "S")
    assert r.r2s == "RSTREAM" and compile_query(r.rewritten, battlefield, "S").rewritten == r.rewritten
    w = compile_query(f"RSTREAM(({a} UNION {b}) INTERSECT {c})", battlefield, "S")
    assert w.rewritten.startswith("RSTREAM((SELECT sid FROM Vitals [ROWS 2")
    streams = {"Vitals": VITALS, "Positions": POSITIONS}
    # (a UNION b) INTERSECT c differs from a UNION (b INTERSECT c): at 2, c (Vitals [NOW]) holds b only
    assert evaluate(f"RSTREAM(({a} UNION {b}) INTERSECT {c})", battlefield, "S", streams)[1] == (2, "C", "b")
    assert (2, "U", "a") in evaluate(f"RSTREAM({a} UNION {b} INTERSECT {c})", battlefield, "S", streams)


@pytest.mark.spark
def test_the_examples_through_chunks_and_two_workers(battlefield, engines):
    """Every example at U and S through chunks of 1-3 instants on two workers equals the reference,
    and a U session's output is the same with and without the tuples above U."""
    executors = executors_of(engines, battlefield)
    check_examples(battlefield, TEXTS, {"Vitals": VITALS, "Positions": POSITIONS}, ABOVE, executors, incremental=(2,))


def test_a_failing_select_fails_the_compound_query_at_its_instant(battlefield):
    rows = [vital(1, "U", "a", 1), vital(2, "U", "b", 2)]
    text = "SELECT sid FROM Vitals [NOW] UNION SELECT sid FROM Vitals [NOW] WHERE ts * 4611686018427387904 > 0"
    out = evaluate_outcome(text, battlefield, "S", {"Vitals": rows})
    assert out.error_ts == 2 and out.rows == [(1, "U", "a")]


@pytest.mark.spark
def test_a_failing_select_fails_the_distributed_query_too(battlefield, engines):
    rows = [vital(1, "U", "a", 1), vital(2, "U", "b", 2), vital(3, "U", "c", 3)]
    text = "SELECT sid FROM Vitals [NOW] EXCEPT SELECT sid FROM Vitals [NOW] WHERE ts * 4611686018427387904 > 0"
    exp = evaluate_outcome(text, battlefield, "S", {"Vitals": rows})
    assert exp.error_ts == 2
    executors = executors_of(engines, battlefield)
    for k in (1, 3):
        out = run_distributed(battlefield, "S", [text], inputs_of(battlefield, {"Vitals": rows}), executors,
                              chunk_instants=k)
        assert out["q1"].error_ts == 2 and "integer overflow" in out["q1"].error
        compare_results(out["q1"].rows, exp.rows)


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_compound_queries_equal_reference(battlefield, chinese_wall, engines, data):
    """Random UNION / UNION ALL / EXCEPT queries through chunks of random length, several workers,
    sharing on or off, states carried between chunks or not, against the reference."""
    config = data.draw(st.sampled_from([battlefield, chinese_wall]), label="config")
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    texts = [data.draw(compound_queries(config, config.lattice.parse(level)), label="query")]
    if data.draw(st.booleans(), label="two"):  # a second query: shared evaluation on the workers
        texts.append(data.draw(st.sampled_from([texts[0], data.draw(compound_queries(config, level))]), label="q2"))
    streams = data.draw(multistream(config), label="streams")
    assert_reference(config, level, texts, streams, drawn_run(data, config, level, texts, streams, engines[id(config)]))
