"""Window conditions on attributes (issue 16): ``[ROWS 10 WHERE bp > 100]``.

A window condition filters the stream *before* the window, like the level clause (the formal
semantics paper's filtered windows), so ``[ROWS 2 WHERE bp > 100]`` holds the last two tuples
with ``bp > 100``, where ``[ROWS 2] … WHERE bp > 100`` filters the last two tuples.  Unlike the
level clause it does not change the instants: a tuple it drops is still an arrival of the
visible substream (docs/semantics.md §2).  The master evaluates it in Arrow to cut ROWS legacy
(chunking/filters.py), so its Arrow evaluation must equal Spark's.
"""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql.printer import to_text

from .distributed import Evaluated, assert_reference, drawn_run, executors_of, run_distributed
from .reference.evaluator import evaluate
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, vital

EXAMPLES, SETTINGS = example_settings("STRATA_WINDOW_FILTER_EXAMPLES", 25)


ROWS = [vital(1, "U", "a", 10), vital(2, "C", "a", 120), vital(3, "U", "b", 130), vital(4, "S", "a", 40),
        vital(5, "U", "a", 150), vital(6, "C", "b", 60)]

FILTERED = "SELECT SUM(bp) AS s FROM Vitals [ROWS 2 WHERE bp > 100]"
ISTREAM = "SELECT ISTREAM sid, bp FROM Vitals [ROWS 1 WHERE sid = 'a' AND level in {U, C}]"


def test_window_conditions_parse_print_back_and_explain(battlefield):
    cq = compile_query("SELECT v.sid FROM Vitals [ROWS 10 WHERE v.bp > 100 AND level in {U, C} "
                       "AND (pr < 3 OR sid = 'a')] v", battlefield, "S")
    assert cq.rewritten == ("SELECT sid FROM Vitals [ROWS 10 WHERE level in {U, C} AND bp > 100 "
                            "AND (pr < 3 OR sid = 'a')] v")
    assert compile_query(cq.rewritten, battlefield, "S").query == cq.query
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert cq.to_json()["windows"][0]["filter"] == "bp > 100 AND (pr < 3 OR sid = 'a')"
    # the level conjunct is the level clause, as `[ROWS 10 level in {U}]` and `[ROWS 10 WHERE level in {U}]`
    assert parse("SELECT bp FROM Vitals [ROWS 10 WHERE level in {U}]") == \
        parse("SELECT bp FROM Vitals [ROWS 10 level in {U}]")
    # in a join a window condition reads its own item only
    j = compile_query("SELECT v.sid, p.lat FROM Vitals [ROWS 3 WHERE bp > 1] v, Positions [NOW WHERE lat > 0] p "
                      "WHERE v.sid = p.sid", battlefield, "S")
    assert "[ROWS 3 WHERE level in {U, C, S} AND v.bp > 1] v" in j.rewritten
    assert "[NOW WHERE level in {U, C, S} AND p.lat > 0] p" in j.rewritten


@pytest.mark.parametrize("text,msg", [
    ("SELECT bp FROM Vitals [ROWS 3 WHERE level = U OR bp > 1]", "must be a conjunct of its own"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE level = U AND level = C]", "two level conditions"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE COUNT(*) > 1]", "aggregates"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE ts + 1 > 3]", r"\+ of integers is not supported in a window condition"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE bp % 2 = 1]", "% of numbers is not supported"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE -ts < 0]", "unary minus of an integer"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE lat > 0]", "window condition of Vitals: unknown attribute 'lat'"),
    ("SELECT v.bp FROM Vitals [ROWS 3 WHERE p.lat > 0] v, Positions p", "unknown stream or alias 'p'"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE bp]", "must be a condition"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE level = TS AND bp > 1]", "does not dominate"),
    ("SELECT bp FROM Vitals [ROWS 3 WHERE bp > 1e999]", "beyond the range of a double"),
])
def test_bad_window_conditions_are_refused_in_one_line(battlefield, text, msg):
    with pytest.raises(QueryError, match=msg) as e:
        compile_query(text, battlefield, "S")
    assert "\n" not in str(e.value)


def test_the_condition_filters_before_the_window_and_keeps_the_instants(battlefield):
    got = [(t, lv, s) for t, lv, s in evaluate(FILTERED, battlefield, "S", {"Vitals": ROWS})]
    # held: the tuples with bp > 100 (ts 2, 3, 5); instant 4 (bp 40) and 6 (bp 60) are still instants
    assert got == [(1, "U", None), (2, "C", 120.0), (3, "C", 250.0), (4, "C", 250.0), (5, "U", 280.0),
                   (6, "U", 280.0)]
    # the same condition after the window (WHERE) filters the last two tuples instead
    after = evaluate("SELECT SUM(bp) AS s FROM Vitals [ROWS 2] WHERE bp > 100", battlefield, "S", {"Vitals": ROWS})
    assert [s for _, _, s in after] == [None, 120.0, 250.0, 130.0, 150.0, 150.0]
    # a U session sees the U tuples only: instants 1, 3, 5
    assert evaluate(FILTERED, battlefield, "U", {"Vitals": ROWS}) == [(1, "U", None), (3, "U", 130.0),
                                                                    (5, "U", 280.0)]
    # with a level conjunct: the level clause decides the instants (not 4), the condition what is held
    assert evaluate(ISTREAM, battlefield, "S", {"Vitals": ROWS}) == [(1, "U", "a", 10.0), (2, "C", "a", 120.0),
                                                                   (5, "U", "a", 150.0)]


@pytest.mark.spark
def test_the_examples_through_chunks_and_two_workers(battlefield, engines):
    texts = [FILTERED, ISTREAM,
             "SELECT DSTREAM sid, bp FROM Vitals [RANGE 2 WHERE sid != 'b']",
             "SELECT sid, COUNT(*) FROM Vitals [PARTITION BY sid ROWS 1 WHERE bp / 2 >= 50] GROUP BY sid",
             "SELECT COUNT(*) FROM Vitals [WHERE bp > 100]".replace("[WHERE", "[RANGE UNBOUNDED WHERE"),
             "SELECT v.sid, w.bp FROM Vitals [ROWS 2 WHERE bp > 100] v, Vitals [NOW WHERE bp < 100] w "
             "WHERE v.sid = w.sid"]
    executors = executors_of(engines, battlefield)
    for level in ("U", "S"):
        mine = [t for t in texts if level == "S" or "level in" not in t]  # a U session cannot name C
        for k in (1, 2, 3):
            # a unit the incremental cut makes exactly as the all-at-once cut did (the first, before any
            # result is confirmed) is not evaluated twice (distributed.Evaluated); every other unit is
            memo = Evaluated()
            for incremental in (False, True):
                out = run_distributed(battlefield, level, mine, inputs_of(battlefield, {"Vitals": ROWS}),
                                      memo.wrap(executors), chunk_instants=k, rnd=random.Random(k),
                                      incremental=incremental)
                assert_reference(battlefield, level, mine, {"Vitals": ROWS}, out)


# ---------------------------------------------------------------------------- Arrow = Spark

_DOUBLES = st.one_of(st.none(), st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, 100.0, math.nan, math.inf]))
_LONGS = st.one_of(st.none(), st.sampled_from([0, 1, -1, 2, 100, 2**62, -(2**63)]))
_STRS = st.one_of(st.none(), st.sampled_from(["a", "b", "", "é"]))
_BOOLS = st.one_of(st.none(), st.booleans())


@st.composite
def _condition(draw, depth=0):
    r = draw(st.integers(0, 9 if depth < 2 else 5))
    if r == 6:
        return f"({draw(_condition(depth + 1))} OR {draw(_condition(depth + 1))})"
    if r == 7:
        return f"({draw(_condition(depth + 1))} AND {draw(_condition(depth + 1))})"
    if r == 8:
        return f"NOT ({draw(_condition(depth + 1))})"
    if r == 9:
        return f"{draw(st.sampled_from(['d', 'n', 's', 'b']))} IS {draw(st.sampled_from(['', 'NOT ']))}NULL"
    num = draw(st.sampled_from(["d", "n", "d * 2.0", "d + 1.5", "d - n / 2", "n / 0", "d / d", "-d", "d * d"]))
    lit = draw(st.sampled_from(["0", "1", "-1", "2.5", "100", "NULL", "n", "d", "1e308"]))
    op = draw(st.sampled_from(["=", "!=", "<", "<=", ">", ">="]))
    if r <= 2:
        return f"{num} {op} {lit}"
    if r == 3:
        items = ", ".join(draw(st.lists(st.sampled_from(["0", "1", "2.5", "NULL", "-1"]), min_size=1, max_size=3)))
        return f"{draw(st.sampled_from(['d', 'n']))} {draw(st.sampled_from(['IN', 'NOT IN']))} ({items})"
    if r == 4:
        return f"s {op} {draw(st.sampled_from(['s', repr('a'), repr(''), 'NULL']))}"
    return f"b {draw(st.sampled_from(['=', '<', '!=']))} {draw(st.sampled_from(['TRUE', 'FALSE', 'b']))}"


_SCHEMA_TOML = """
[lattice]
levels = ["U", "S"]
[streams.T]
d = "double"
n = "long"
s = "string"
b = "boolean"
"""


@pytest.mark.spark
@SETTINGS
@given(cond=_condition(), rows=st.lists(st.tuples(_DOUBLES, _LONGS, _STRS, _BOOLS), min_size=1, max_size=12))
def test_arrow_evaluation_of_window_conditions_equals_spark(spark, cond, rows):
    """The master's Arrow evaluation of a window condition keeps exactly the rows on which Spark's SQL
    (the engine's compiler, worker/expr.py) says TRUE: NULLs, NaN, -0.0, x / 0, IN with NULL."""
    from strata.chunking.filters import passes
    from strata.config import parse_config
    from strata.worker.expr import SqlCompiler

    config = parse_config(_SCHEMA_TOML)
    try:
        cq = compile_query(f"SELECT d FROM T [ROWS 5 WHERE {cond}]", config, "S")
    except QueryError:
        assume(False)
    e = cq.query.from_[0].window.filter
    types_ = (("d", pa.float64()), ("n", pa.int64()), ("s", pa.string()), ("b", pa.bool_()))
    table = pa.table({c: pa.array([r[k] for r in rows], t) for k, (c, t) in enumerate(types_)})
    arrow = passes(e, table).to_pylist()
    types = {"d": "double", "n": "long", "s": "string", "b": "boolean"}
    comp = SqlCompiler(config.lattice, lambda c: f"`{c.name}`", column_type=lambda c: types[c.name])
    sql = comp.compile(e)
    df = spark.createDataFrame(table.append_column("_k", pa.array(range(len(rows)), pa.int64())))
    got = {r["_k"]: r["ok"] for r in df.selectExpr("_k", f"coalesce(({sql}), false) AS ok").collect()}
    assert arrow == [got[k] for k in range(len(rows))], (cond, sql)


# ----------------------------------------------------------------------------- differential

@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_window_condition_queries_equal_reference(battlefield, chinese_wall, engines, data):
    """Random queries with a window condition through chunks of random length, several workers,
    sharing on or off, states carried between chunks or not, against the reference."""
    config = data.draw(st.sampled_from([battlefield, chinese_wall]), label="config")
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    text = data.draw(queries(config, level), label="query")
    try:
        cq = compile_query(text, config, config.lattice.parse(level))
    except QueryError:
        assume(False)
    assume(any(f.window.filter is not None for f in cq.query.from_))
    streams = data.draw(multistream(config), label="streams")
    assert_reference(config, level, [text], streams, drawn_run(data, config, level, [text], streams,
                                                               engines[id(config)]))
