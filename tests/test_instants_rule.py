"""Optimization never changes the instants (SEMANTICS §5, issue 16): a WHERE level condition that Alg. 4
moves into a RANGE / UNBOUNDED / NOW / PARTITION BY level window narrows what the window holds, and the
query's instants stay the arrivals of the window's level set as Alg. 3 rewrote it."""

from __future__ import annotations

import random

import pytest

from strata.chunking.chunker import Chunker
from strata.mlscql import compile_query

from .distributed import run_distributed
from .reference.evaluator import compare_results, evaluate
from .tables import inputs_of
from .test_reference import ISSUE_16_QUERY, ISSUE_16_ROWS

STREAMS = {"Vitals": [{"ts": t, "level": lv, "sid": s, "bp": b, "pr": p, "weight": 1.0}
                      for t, lv, s, b, p in ISSUE_16_ROWS]}


def test_the_chunker_keeps_the_instants_of_the_rewritten_window(battlefield):
    cq = compile_query(ISSUE_16_QUERY, battlefield, "S")
    w = cq.query.from_[0].window
    assert w.levels == {"U"} and w.instants == ("U", "C", "S") and cq.query.where is None
    ch = Chunker(battlefield, {"q": cq})
    ch.push("Vitals", inputs_of(battlefield, STREAMS)["Vitals"])
    chunks = ch.close(5)
    got = [(qc.instants, [t.num_rows for t in qc.items]) for c in chunks for qc in c.queries]
    # every arrival at U, C or S is an instant; only the U tuple travels (with its legacy after it)
    assert [i for i, _ in got] == [[1], [2], [3], [4], [5]]
    assert [n for _, n in got] == [[0], [0], [1], [1], [1]]


@pytest.mark.parametrize("chunk_instants", [1, 2, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_issue_16_example_through_chunks_and_workers(battlefield, spark, chunk_instants, seed):
    """The issue's example: replayed with 2 workers and random completion order, `s2 = 100` at 3, 4, 5."""
    from strata.worker.engine import Engine
    from strata.worker.shared import SharedExecutor

    executors = [SharedExecutor(Engine(spark, battlefield), battlefield) for _ in range(2)]
    out = run_distributed(battlefield, "S", [ISSUE_16_QUERY], inputs_of(battlefield, STREAMS), executors,
                          chunk_instants=chunk_instants, rnd=random.Random(seed))["q1"]
    assert out.error is None
    assert sorted(out.rows) == [(3, "U", "s2", 100.0), (4, "U", "s2", 100.0), (5, "U", "s2", 100.0)]
    compare_results(out.rows, evaluate(ISSUE_16_QUERY, battlefield, "S", STREAMS))


@pytest.mark.parametrize("text", [
    "SELECT COUNT(*) FROM Vitals [RANGE 2 SECONDS] WHERE level = C",
    "ISTREAM(SELECT sid, bp FROM Vitals [NOW] WHERE level in {U, C})",
    "SELECT sid, MAX(bp) FROM Vitals [RANGE UNBOUNDED] WHERE level = S GROUP BY sid",
    "SELECT COUNT(*) FROM Vitals [PARTITION BY level ROWS 1] WHERE level = C",
])
def test_moved_conditions_through_chunks_equal_the_reference(battlefield, spark, text):
    from strata.worker.engine import Engine
    from strata.worker.shared import SharedExecutor

    cq = compile_query(text, battlefield, "S")
    assert cq.query.from_[0].window.instants is not None  # Alg. 4 moved it, keeping the instants
    executors = [SharedExecutor(Engine(spark, battlefield), battlefield) for _ in range(2)]
    for k in (1, 3):
        out = run_distributed(battlefield, "S", [text], inputs_of(battlefield, STREAMS), executors, chunk_instants=k,
                              rnd=random.Random(k))["q1"]
        compare_results(out.rows, evaluate(text, battlefield, "S", STREAMS))
