"""``[RANGE T SLIDE S]`` windows (issue 16): evaluated at slide boundaries.

The window at instant τ is the RANGE T window at the last slide boundary ``b = ⌊τ/S⌋·S``: the
tuples with ``b - T < ts ≤ b``. The instants stay the distinct ``ts`` of the visible substreams
(SEMANTICS §5); between two boundaries R(τ) does not change, so ISTREAM reports at boundaries.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql.printer import to_text

from .distributed import assert_reference, drawn_run, executors_of, run_distributed
from .reference.evaluator import evaluate
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, vital

EXAMPLES, SETTINGS = example_settings("STRATA_SLIDE_EXAMPLES", 25)


ROWS = [vital(1, "U", "a", 10), vital(2, "C", "a", 20), vital(3, "U", "b", 30), vital(4, "S", "a", 40),
        vital(5, "U", "a", 50), vital(6, "U", "b", 60), vital(7, "C", "a", 70)]


def test_slide_parses_prints_back_and_explains(battlefield):
    cq = compile_query("select sid, sum(bp) from Vitals [range 4 seconds slide 2 seconds] group by sid", battlefield, "S")
    assert "[RANGE 4 seconds SLIDE 2 seconds level in {" in cq.rewritten
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert cq.to_json()["windows"][0]["slide"] == {"amount": 2.0, "unit": "seconds"}
    assert "SLIDE 1500 milliseconds" in compile_query("SELECT bp FROM Vitals [RANGE 3 SLIDE 1500 ms]",
                                                      battlefield, "S").rewritten


@pytest.mark.parametrize("text,msg", [
    ("SELECT bp FROM Vitals [RANGE 3 SLIDE 0]", "SLIDE 0 seconds must be positive"),
    ("SELECT bp FROM Vitals [RANGE 3 SLIDE 1e300 days]", "longer than any limit"),
    ("SELECT bp FROM Vitals [ROWS 3 SLIDE 1]", "SLIDE"),
])
def test_bad_slides_are_refused_in_one_line(battlefield, text, msg):
    with pytest.raises(QueryError, match=msg) as e:
        compile_query(text, battlefield, "S")
    assert "\n" not in str(e.value)


def test_the_window_is_the_range_window_at_the_last_boundary(battlefield):
    q = "RSTREAM(SELECT SUM(bp) AS s FROM Vitals [RANGE 4 SECONDS SLIDE 2 SECONDS])"
    # boundaries 0, 2, 4, 6: at τ = 1 the window ends at 0 (empty), at 2 and 3 at 2 (ts 1, 2), at 4
    # and 5 at 4 (ts 1-4), at 6 and 7 at 6 (ts 3-6)
    got = [(t, s) for t, _, s in evaluate(q, battlefield, "S", {"Vitals": ROWS})]
    assert got == [(1, None), (2, 30.0), (3, 30.0), (4, 100.0), (5, 100.0), (6, 180.0), (7, 180.0)]
    # ISTREAM: a row appears when the window moves
    i = "SELECT ISTREAM SUM(bp) AS s FROM Vitals [RANGE 4 SECONDS SLIDE 2 SECONDS]"
    assert [(t, s) for t, _, s in evaluate(i, battlefield, "S", {"Vitals": ROWS})] == \
        [(1, None), (2, 30.0), (4, 100.0), (6, 180.0)]
    # a U session: its instants are the U tuples' ts, its windows hold U tuples only
    assert [(t, s) for t, _, s in evaluate(q, battlefield, "U", {"Vitals": ROWS})] == \
        [(1, None), (3, 10.0), (5, 40.0), (6, 140.0)]


@pytest.mark.spark
def test_the_example_through_chunks_and_two_workers(battlefield, engines):
    texts = ["RSTREAM(SELECT SUM(bp) AS s FROM Vitals [RANGE 4 SECONDS SLIDE 2 SECONDS])",
             "SELECT ISTREAM sid, COUNT(*) FROM Vitals [RANGE 3 SLIDE 2] GROUP BY sid",
             "SELECT DSTREAM sid, bp FROM Vitals [RANGE 2 SLIDE 3]",
             "SELECT sid, MAX(bp) FROM Vitals [RANGE 5 SECONDS SLIDE 2 SECONDS level in {U}] GROUP BY sid"]
    executors = executors_of(engines, battlefield)
    for level in ("U", "S"):
        for k in (1, 2, 3):
            out = run_distributed(battlefield, level, texts, inputs_of(battlefield, {"Vitals": ROWS}), executors,
                                  chunk_instants=k, rnd=random.Random(k))
            assert_reference(battlefield, level, texts, {"Vitals": ROWS}, out)


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_slide_queries_equal_reference(battlefield, chinese_wall, engines, data):
    """Random queries with a SLIDE window through chunks of random length, several workers, sharing
    on or off, states carried between chunks or not, against the reference."""
    config = data.draw(st.sampled_from([battlefield, chinese_wall]), label="config")
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    text = data.draw(queries(config, level), label="query")
    assume("slide" in text.lower())
    try:
        compile_query(text, config, config.lattice.parse(level))
    except QueryError:
        assume(False)
    streams = data.draw(multistream(config), label="streams")
    assert_reference(config, level, [text], streams, drawn_run(data, config, level, [text], streams,
                                                               engines[id(config)], prune=False))
