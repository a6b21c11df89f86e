"""Distribution does not change the answer (SEMANTICS §6).

Random multilevel streams and random queries run through the real master
pipeline (shepherd, chunker with legacy windows, ordered merge) on 1-3 Spark
engine instances, with random chunk lengths, random chunk-to-engine assignment
and out-of-order completion; the output must equal the independent reference
evaluator instant by instant.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.master.local import run_local
from strata.mlscql import compile_query

from .reference.evaluator import compare_results, evaluate
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, rows_of

pytestmark = pytest.mark.spark

EXAMPLES, SETTINGS = example_settings("STRATA_DIFF_EXAMPLES", 25)


@pytest.fixture(scope="module")
def engines(spark, battlefield, chinese_wall):
    from strata.worker.engine import Engine

    return {
        "battlefield": [Engine(spark, battlefield) for _ in range(3)],
        "chinese_wall": [Engine(spark, chinese_wall) for _ in range(3)],
    }


def _check(config, engines, data, n_queries):
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    texts = [data.draw(queries(config, level), label=f"query{i}") for i in range(n_queries)]
    streams = data.draw(multistream(config), label="streams")
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    n = data.draw(st.integers(1, 3), label="engines")
    rnd = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    prune = data.draw(st.booleans(), label="prune ROWS windows as on the wire")
    out = run_local(
        config, level, texts, inputs_of(config, streams), engines[:n], chunk_instants=k,
        assign=lambda c, m: rnd.randrange(m), shuffle=rnd, batch=rnd.choice([0, 1, 2]), prune=prune,
    )
    for i, text in enumerate(texts):
        expected = evaluate(text, config, level, streams)
        actual = rows_of(out[f"q{i + 1}"])
        compare_results(actual, expected)


@SETTINGS
@given(data=st.data())
def test_battlefield_random_queries_equal_reference(battlefield, engines, data):
    _check(battlefield, engines["battlefield"], data, n_queries=data.draw(st.integers(1, 2), label="n_queries"))


@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_chinese_wall_random_queries_equal_reference(chinese_wall, engines, data):
    _check(chinese_wall, engines["chinese_wall"], data, n_queries=1)


# ---- non-interference --------------------------------------------------------------
@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_invisible_tuples_change_nothing(battlefield, engines, data):
    """Changing, adding or removing tuples a query cannot see changes none of its
    outputs, their levels or their instants (not even when output appears)."""
    level = data.draw(st.sampled_from(battlefield.lattice.levels[:-1]), label="level")
    text = data.draw(queries(battlefield, level), label="query")
    cq = compile_query(text, battlefield, level)
    visible = {}
    for item, f in zip(cq.items, cq.query.from_):
        visible.setdefault(item.stream, set()).update(f.window.levels)
    streams = data.draw(multistream(battlefield), label="streams")
    noise = data.draw(multistream(battlefield), label="noise")
    mutated = {}
    for s, rows in streams.items():
        seen = visible.get(s, set())
        hidden_levels = [lv for lv in battlefield.lattice.levels if lv not in seen]
        keep = [r for r in rows if r["level"] in seen or data.draw(st.booleans(), label="keep hidden")]
        extra = [dict(r, level=data.draw(st.sampled_from(hidden_levels))) for r in noise.get(s, [])] if hidden_levels else []
        merged = sorted(keep + extra, key=lambda r: r["ts"])  # stable: visible order kept
        mutated[s] = merged
    engs = engines["battlefield"][:2]
    a = rows_of(run_local(battlefield, level, [text], inputs_of(battlefield, streams), engs)["q1"])
    b = rows_of(run_local(battlefield, level, [text], inputs_of(battlefield, mutated), engs)["q1"])
    assert sorted({r[0] for r in a}) == sorted({r[0] for r in b})  # same output instants
    compare_results(b, a)
    assert sorted((r[0], r[1]) for r in a) == sorted((r[0], r[1]) for r in b)  # same levels
