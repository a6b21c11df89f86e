"""The workers' partial aggregates (issue 35 item 2): a single-item aggregate pre-aggregated per
(ts, interval end, group) and its partials spread over the instants of their interval, forced on
(``Engine(partials="on")``) for small chunks, which the engine's thresholds would otherwise evaluate
the old way (rows exploded over the instants, then aggregated per instant).

Random RANGE (also SLIDE, NOW, ROWS, PARTITION BY, UNBOUNDED) GROUP BY queries over a lattice with
categories (incomparable levels: the output level is a true lub), NULLs, -0.0, decimals whose sums
round differently when reassociated, and 64-bit values near the limits (SUMs that overflow and come
back; overflow-prone arguments, keys, WHERE and HAVING), with WHERE before and HAVING after the
aggregation, DISTINCT aggregates and SELECT DISTINCT, RSTREAM/ISTREAM/DSTREAM:

* the partial path equals the independent reference (tests/reference/), the failing instant included;
* NaN and ±Infinity (where the reference's Python MIN/MAX and fsum are not SQL's): the partial path
  equals the old path on the same chunks;
* the general query strategy (tests/strategies.py) restricted to single-item aggregates, forced on.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from strata.config import parse_config
from strata.mlscql import QueryError, compile_query

from .distributed import assert_outcome, run_distributed
from .reference.evaluator import compare_results
from .strategies import BIG_LONGS, LONGS, example_settings, multistream, queries
from .tables import inputs_of

pytestmark = pytest.mark.spark

EXAMPLES, SETTINGS = example_settings("STRATA_PARTIALS_EXAMPLES", 6)

PARTIALS_TOML = """
[lattice]
classifications = ["U", "C", "S"]
categories = ["NATO", "CRYPTO"]

[streams.Obs]
k = "string"
g = "long"
x = "double"
n = "long"
"""

#: decimals (reassociated sums differ in the last bits), -0.0 and 0.0, a large-ish magnitude
DOUBLES = (0.1, 0.2, 0.3, 1e-3, -0.0, 0.0, 2.5, -7.25, 1e6 + 0.1, None)
#: ... and what the reference does not model as SQL does (compared with the old path only)
SPECIAL = (float("nan"), float("inf"), float("-inf"))


@pytest.fixture(scope="module")
def config():
    return parse_config(PARTIALS_TOML)


@pytest.fixture(scope="module")
def pair(spark, config):
    """Engines with the partial path forced on and off (two of each: two simulated workers)."""
    from strata.worker.engine import Engine

    return {mode: [Engine(spark, config, partials=mode) for _ in range(2)] for mode in ("on", "off")}


def _lvl(level: str) -> str:
    return level if level.isalnum() else f"'{level}'"


@st.composite
def obs_rows(draw, config, special: bool = False, extremes: bool = False) -> list[dict]:
    levels = list(config.lattice.levels)
    doubles = DOUBLES + (SPECIAL if special else ())
    longs = LONGS + (None,) + (BIG_LONGS + BIG_LONGS if extremes else ())
    rows, ts = [], 0
    for _ in range(draw(st.integers(1, 7), label="instants")):
        ts += draw(st.sampled_from((1, 1, 2, 3)))
        for _ in range(draw(st.integers(0, 5))):
            rows.append({"ts": ts, "level": draw(st.sampled_from(levels)), "k": draw(st.sampled_from(("a", "b", None))),
                         "g": draw(st.sampled_from((0, 1, None))), "x": draw(st.sampled_from(doubles)),
                         "n": draw(st.sampled_from(longs))})
    return rows


@st.composite
def partial_queries(draw, config, level: str, extremes: bool = False) -> str:
    """A single-item aggregate query: a window, WHERE, GROUP BY, aggregates, HAVING, DISTINCT, R2S."""
    lat = config.lattice
    seen = [lv for lv in lat.levels if lat.leq(lat.parse(lv), lat.parse(level))]
    window = draw(st.sampled_from(("RANGE 3 SECONDS", "RANGE 2 SECONDS", "RANGE 5 SECONDS", "RANGE 4 SECONDS SLIDE 2 SECONDS",
                                   "NOW", "RANGE UNBOUNDED", "ROWS 3", "PARTITION BY k ROWS 2", "RANGE 1 SECONDS")))
    if draw(st.booleans(), label="window level clause"):
        chosen = draw(st.lists(st.sampled_from(seen), min_size=1, unique=True))
        window += f" level in {{{', '.join(_lvl(x) for x in chosen)}}}"
    where = []
    if draw(st.booleans(), label="WHERE on values"):
        where.append(draw(st.sampled_from(("x > 0.15", "x IS NOT NULL", "n >= 0", "k = 'a'", "g = 1 OR x < 1",
                                           "n + 1 > 0", "n * 2 < 100"))))
    if draw(st.booleans(), label="WHERE on levels"):
        where.append(f"level DOMINATED BY {_lvl(draw(st.sampled_from(seen)))}")
    keys = draw(st.sampled_from(([], ["k"], ["k", "g"], ["g"], ["n % 3"], ["n + 1"] if extremes else ["g"])))
    aggs = draw(st.lists(st.sampled_from(
        ("COUNT(*)", "COUNT(x)", "SUM(x)", "AVG(x)", "MIN(x)", "MAX(x)", "SUM(n)", "AVG(n)", "MIN(n)", "MAX(n)",
         "COUNT(n)", "SUM(n * 2)", "AVG(n + 1)", "COUNT(DISTINCT x)", "SUM(DISTINCT n)", "AVG(DISTINCT x)",
         "MAX(x) - MIN(x)", "SUM(x) / COUNT(*)")), min_size=1, max_size=4, unique=True))
    select = [k for k in keys if draw(st.booleans())] + aggs
    text = "SELECT " + ("DISTINCT " if draw(st.integers(0, 5)) == 0 else "") + ", ".join(select)
    text += f" FROM Obs [{window}]"
    if where:
        text += " WHERE " + " AND ".join(where)
    if keys:
        text += " GROUP BY " + ", ".join(keys)
    if draw(st.integers(0, 2)) == 0:
        text += " HAVING " + draw(st.sampled_from(("COUNT(*) > 1", "SUM(n) > 0", "MAX(x) >= 0.2", "SUM(n) + 1 > 0")))
    r2s = draw(st.sampled_from(("", "", "ISTREAM", "DSTREAM")))
    if r2s:
        text = f"{r2s}({text})"
    try:
        compile_query(text, config, level)
    except QueryError:
        assume(False)
    return text


def _run(config, level, text, streams, engines, data):
    from strata.worker.shared import SharedExecutor

    k = data.draw(st.integers(1, 3), label="chunk_instants")
    n = data.draw(st.integers(1, 2), label="workers")
    executors = [SharedExecutor(e, config, enabled=False) for e in engines[:n]]
    seed = data.draw(st.integers(0, 2**32), label="seed")
    incremental = data.draw(st.booleans(), label="incremental")
    return run_distributed(config, level, [text], inputs_of(config, streams), executors, chunk_instants=k,
                           rnd=random.Random(seed), incremental=incremental)["q1"]


@SETTINGS
@given(data=st.data())
def test_partials_equal_reference(config, pair, data):
    extremes = data.draw(st.integers(0, 2), label="extremes") == 0
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    text = data.draw(partial_queries(config, level, extremes), label="query")
    streams = {"Obs": data.draw(obs_rows(config, extremes=extremes), label="rows")}
    actual = _run(config, level, text, streams, pair["on"], data)
    expected = assert_outcome(text, config, level, streams, actual)
    event("query fails" if expected.error else "query does not fail")


@SETTINGS
@given(data=st.data())
def test_partials_equal_old_path_with_nan_and_infinities(config, pair, data):
    """NaN and ±Infinity in sums, averages, MIN and MAX: the same results as the old path (Spark's
    semantics for both; the reference's Python min/max and fsum are not SQL's there)."""
    level = config.lattice.top
    text = data.draw(partial_queries(config, level, extremes=True), label="query")
    streams = {"Obs": data.draw(obs_rows(config, special=True, extremes=True), label="rows")}
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    out = {}
    for mode in ("on", "off"):
        from strata.worker.shared import SharedExecutor

        out[mode] = run_distributed(config, level, [text], inputs_of(config, streams),
                                    [SharedExecutor(pair[mode][0], config, enabled=False)], chunk_instants=k,
                                    rnd=random.Random(seed))["q1"]
    assert out["on"].error_ts == out["off"].error_ts, (text, out["on"].error, out["off"].error)
    compare_results(out["on"].rows, out["off"].rows)
    # the levels exactly (compare_results compares them as values too; this says it plainly)
    assert sorted((r[0], r[1]) for r in out["on"].rows) == sorted((r[0], r[1]) for r in out["off"].rows)


@pytest.mark.parametrize("which", ["battlefield", "logistics"])
@SETTINGS
@given(data=st.data())
def test_general_single_item_aggregates_forced_on(which, battlefield, logistics, spark, data):
    """tests/strategies.py's random queries (any window, level clauses and conditions, arithmetic,
    stored relations), those with one FROM item and aggregates, evaluated with the partial path forced on."""
    from strata.worker.engine import Engine

    config = battlefield if which == "battlefield" else logistics
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    text = data.draw(queries(config, level), label="query")
    cq = compile_query(text, config, level)
    assume(cq.is_aggregate and len(cq.items) == 1 and not cq.branches and not cq.subqueries)
    streams = data.draw(multistream(config), label="streams")
    engines = [Engine(spark, config, partials="on") for _ in range(2)]
    actual = _run(config, level, text, streams, engines, data)
    assert_outcome(text, config, level, streams, actual)


# ---- the switch itself -----------------------------------------------------------------------------
def test_switch_chooses_the_plan(config, pair):
    """``on`` plans the pre-aggregation (a ``pre`` CTE) even for a few rows, ``off`` and ``auto`` (5 rows:
    below its threshold) do not; a bad value is refused in one line."""
    from strata.chunking.model import legacy_mode
    from strata.master.local import cut_chunks
    from strata.worker.engine import Engine
    from strata.worker.evaluate import Deferred, SelectRun

    text = "SELECT k, SUM(n), AVG(x) FROM Obs [RANGE 3 SECONDS] GROUP BY k"
    rows = [{"ts": t, "level": "U", "k": "a", "g": 0, "x": 0.1 * t, "n": t} for t in range(1, 6)]
    _, ids, chunks = cut_chunks(config, "S", [text], inputs_of(config, {"Obs": rows}), 5)
    qc = next(q for q in chunks[0].queries if q.query_id == ids[0])
    cq = compile_query(text, config, "S")
    spark = pair["on"][0].spark
    plans = {}
    for mode in ("on", "off", "auto"):
        with pytest.raises(Deferred) as d:
            SelectRun(Engine(spark, config, partials=mode), cq, qc, legacy_mode(cq), defer=True).execute()
        plans[mode] = [name for name, _ in d.value.run.ctes]
    assert "pre" in plans["on"] and "pre" not in plans["off"] and "pre" not in plans["auto"]
    with pytest.raises(ValueError, match="partials must be one of auto, on, off"):
        Engine(spark, config, partials="sometimes")


def test_worker_switch_from_the_environment():
    from strata.errors import ConfigError
    from strata.worker.server import partials_switch

    assert partials_switch({}) == "auto"
    assert partials_switch({"STRATA_RANGE_PARTIALS": " OFF "}) == "off"
    assert partials_switch({"STRATA_RANGE_PARTIALS": "on"}) == "on"
    with pytest.raises(ConfigError) as e:
        partials_switch({"STRATA_RANGE_PARTIALS": "yes"})
    assert "\n" not in str(e.value) and "STRATA_RANGE_PARTIALS" in str(e.value)
