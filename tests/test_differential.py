"""Distribution does not change the answer (SEMANTICS §6), failures included (§8).

Random multilevel streams and random queries run through the real master
pipeline (shepherd, chunker with legacy windows, ROWS pruning) on 1-3 simulated
workers (a Spark engine behind the worker's shared executor, sharing on or off),
with random chunk lengths, random chunk-to-worker assignment, out-of-order
completion or incremental cutting with running states.  Per query the chunk
results are assembled as the master does (in chunk order; a query stops at its
first error result and keeps the rows before ``error_ts``), and must equal the
independent reference evaluator: the same rows instant by instant before the
failing instant, and the same failing instant (the reasons' wording may differ).

In a fraction of the examples the 64-bit attributes take values near ±2**62 and
±2**63 and the queries carry overflow-prone arithmetic, so queries fail at
various instants, SUMs overflow and come back into range, and a failing query
shares its chunks with others that do not fail.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata.mlscql import compile_query

from .distributed import assert_outcome, draw_case, executors_of, run_distributed
from .reference.evaluator import compare_results
from .strategies import example_settings, multistream, queries
from .tables import inputs_of

pytestmark = pytest.mark.spark

EXAMPLES, SETTINGS = example_settings("STRATA_DIFF_EXAMPLES", 25)
#: fraction of examples whose 64-bit values are drawn near the limits
EXTREMES = 0.4


def _check(config, engines, data, n_queries, extremes: bool = True):
    level, texts, streams = draw_case(data, config, n_queries, EXTREMES if extremes else 0.0)
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    n = data.draw(st.integers(1, 3), label="workers")
    sharing = data.draw(st.booleans(), label="sharing")
    incremental = data.draw(st.booleans(), label="cut incrementally (running states between chunks)")
    rnd = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    prune = data.draw(st.booleans(), label="prune ROWS windows as on the wire")
    out = run_distributed(config, level, texts, inputs_of(config, streams), executors_of(engines, config, n, sharing),
                          chunk_instants=k, rnd=rnd, prune=prune, incremental=incremental)
    for i, text in enumerate(texts):
        actual = out[f"q{i + 1}"]
        expected = assert_outcome(text, config, level, streams, actual)
        event("query fails" if expected.error else "query does not fail")
        assert (actual.error is None) == (expected.error is None)


@SETTINGS
@given(data=st.data())
def test_battlefield_random_queries_equal_reference(battlefield, engines, data):
    _check(battlefield, engines, data, n_queries=data.draw(st.integers(1, 2), label="n_queries"))


@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_chinese_wall_random_queries_equal_reference(chinese_wall, engines, data):
    _check(chinese_wall, engines, data, n_queries=1)


@SETTINGS
@given(data=st.data())
def test_64_bit_arithmetic_and_failures_equal_reference(ledger, engines, data):
    """Longs near the limits: overflowing expressions and SUMs fail their query at the
    reference's instant, whatever the chunking; the other queries are unaffected."""
    _check(ledger, engines, data, n_queries=data.draw(st.integers(1, 3), label="n_queries"))


# ---- non-interference --------------------------------------------------------------
@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_invisible_tuples_change_nothing(ledger, engines, data):
    """Changing, adding or removing tuples a query cannot see changes none of its
    outputs, their levels or their instants (not even when output appears), nor
    whether and when the query fails (invisible values near the limits included)."""
    level = data.draw(st.sampled_from(ledger.lattice.levels[:-1]), label="level")
    text = data.draw(queries(ledger, level, extremes=True), label="query")
    cq = compile_query(text, ledger, level)
    visible = {}
    for item, f in zip(cq.items, cq.query.from_):  # what the query sees: its windows and their instants
        visible.setdefault(item.stream, set()).update(f.window.instants or f.window.levels)
    streams = data.draw(multistream(ledger, extremes=EXTREMES), label="streams")
    noise = data.draw(multistream(ledger, extremes=1.0), label="noise")
    mutated = {}
    for s, rows in streams.items():
        seen = visible.get(s, set())
        hidden_levels = [lv for lv in ledger.lattice.levels if lv not in seen]
        keep = [r for r in rows if r["level"] in seen or data.draw(st.booleans(), label="keep hidden")]
        extra = [dict(r, level=data.draw(st.sampled_from(hidden_levels))) for r in noise.get(s, [])] if hidden_levels else []
        merged = sorted(keep + extra, key=lambda r: r["ts"])  # stable: visible order kept
        mutated[s] = merged
    executors = executors_of(engines, ledger)
    a = run_distributed(ledger, level, [text], inputs_of(ledger, streams), executors)["q1"]
    b = run_distributed(ledger, level, [text], inputs_of(ledger, mutated), executors)["q1"]
    assert (a.error_ts, a.error) == (b.error_ts, b.error)
    assert sorted({r[0] for r in a.rows}) == sorted({r[0] for r in b.rows})  # same output instants
    compare_results(b.rows, a.rows)
    assert sorted((r[0], r[1]) for r in a.rows) == sorted((r[0], r[1]) for r in b.rows)  # same levels
