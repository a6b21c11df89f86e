"""Stored relations (issue 16): tables with a level per row, updated by a producer, joined with streams.

A relation's input rows say ``op = insert`` or ``op = delete``; a delete removes the oldest live
row of its level with equal values.  A query reads, at each instant, the live rows its level (and
the item's level clause) admits; its visible updates are instants (docs/semantics.md §3a).
"""

from __future__ import annotations

import random

import numpy as np
import pyarrow.csv as pcsv
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from strata.chunking.chunker import Chunker, ChunkingError
from strata.chunking.relations import intervals
from strata.config import ConfigError, parse_config
from strata.mlscql import QueryError, compile_query, parse
from strata.mlscql.printer import to_text

from .conftest import LOGISTICS_TOML
from .distributed import assert_reference, check_examples, drawn_run
from .reference.evaluator import compare_results, evaluate
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, rows_of
from .test_checkpoint import _case, restarted_equals_reference

EXAMPLES, SETTINGS = example_settings("STRATA_RELATION_EXAMPLES", 25)


@pytest.fixture(scope="module")
def rel_engines(spark, logistics):
    from strata.worker.engine import Engine

    return [Engine(spark, logistics) for _ in range(3)]


def _v(ts, level, sid, bp):
    return {"ts": ts, "level": level, "sid": sid, "bp": float(bp)}


def _u(ts, level, sid, unit, strength, op="insert"):
    return {"ts": ts, "level": level, "sid": sid, "unit": unit, "strength": strength, "op": op}


VITALS = [_v(1, "U", "a", 110), _v(2, "U", "b", 90), _v(3, "C", "a", 130), _v(4, "U", "a", 140),
          _v(5, "S", "b", 150), _v(6, "U", "b", 60), _v(7, "C", "c", 120)]
UNITS = [_u(0, "U", "a", "alpha", 10), _u(0, "C", "b", "bravo", 20), _u(0, "U", "c", "charlie", 5),
         _u(3, "U", "a", "alpha", 10, "delete"), _u(3, "U", "a", "delta", 12),
         _u(5, "C", "b", "bravo", 20, "delete"), _u(6, "U", "c", "charlie", 5),  # c twice now
         _u(7, "U", "c", "charlie", 5, "delete")]
ABOVE = {"Vitals": [_v(2, "S", "a", 999), _v(8, "TS", "c", 1)],
         "Units": [_u(1, "S", "a", "secret", 99), _u(2, "TS", "b", "tango", 1), _u(4, "S", "a", "secret", 99, "delete")]}

TEXTS = [
    "SELECT v.sid, v.bp, u.unit FROM Vitals [NOW] v, Units u WHERE v.sid = u.sid",
    "SELECT COUNT(*) AS n, SUM(strength) AS s FROM Units",
    "SELECT * FROM Units",
    "SELECT DSTREAM unit FROM Units [level in {U}]",
    "SELECT RSTREAM u.unit, u.ts FROM Units u WHERE u.level = U",
    "SELECT u.unit, AVG(v.bp) AS a FROM Vitals [RANGE 3 SECONDS] v, Units u WHERE v.sid = u.sid GROUP BY u.unit",
    "SELECT sid FROM Units UNION SELECT sid FROM Vitals [ROWS 1]",
    "SELECT x.unit FROM (SELECT unit, COUNT(*) AS k FROM Units GROUP BY unit) x WHERE x.k > 1",
]


# ---- configuration and front end ----------------------------------------------------------------


def test_a_relation_is_declared_like_a_stream(logistics):
    s = logistics.stream("units")
    assert s.relation and s.kind == "relation" and s.columns[0] == ("sid", "string")
    assert not logistics.stream("Vitals").relation
    with pytest.raises(ConfigError, match="op.*cannot declare it"):
        parse_config('[lattice]\nlevels = ["U"]\n[relations.R]\nop = "string"\n')
    with pytest.raises(ConfigError, match="declared twice"):
        parse_config('[lattice]\nlevels = ["U"]\n[streams.R]\na = "string"\n[relations.r]\nb = "long"\n')


def test_relation_queries_print_back_and_explain(logistics):
    cq = compile_query(TEXTS[0], logistics, "S")
    assert cq.rewritten == ("SELECT v.sid, v.bp, u.unit FROM Vitals [NOW level in {U, C, S}] v, "
                            "Units [level in {U, C, S}] u WHERE v.sid = u.sid")
    assert compile_query(cq.rewritten, logistics, "S").query == cq.query
    assert to_text(parse(cq.rewritten)) == cq.rewritten
    assert cq.to_json()["windows"][1]["kind"] == "relation"
    # a WHERE level condition moves into the relation's level clause; the instants stay all levels'
    moved = compile_query("SELECT unit FROM Units WHERE level = C", logistics, "S")
    w = moved.query.from_[0].window
    assert w.levels == {"C"} and set(w.instants) == {"U", "C", "S"}


@pytest.mark.parametrize("text,msg", [
    ("SELECT unit FROM Units [ROWS 2]", "stored relation: it takes no window"),
    ("SELECT unit FROM Units [RANGE UNBOUNDED]", "stored relation: it takes no window"),
    ("SELECT bp FROM Vitals [level in {U}]", "Vitals is a stream: its window needs"),
    ("SELECT unit FROM Units [level = TS]", "does not dominate"),
    ("SELECT unit FROM Units [WHERE strength > 1]", "expected|unexpected"),
])
def test_bad_relation_queries_are_refused_in_one_line(logistics, text, msg):
    with pytest.raises(QueryError, match=msg) as e:
        compile_query(text, logistics, "S")
    assert "\n" not in str(e.value)


# ---- the master's chunker ---------------------------------------------------------------------------


def _table(config, name, rows):
    return inputs_of(config, {name: rows})[name]


def test_a_delete_of_a_row_that_is_not_live_refuses_its_batch(logistics):
    ch = Chunker(logistics, {"q": compile_query("SELECT * FROM Units", logistics, "S")})
    ch.push("Units", _table(logistics, "Units", UNITS[:3]))
    # b is live at C, not at U: the delete names the level, and nothing of its batch is applied
    bad = [_u(1, "U", "c", "charlie", 5, "delete"), _u(1, "U", "b", "bravo", 20, "delete")]
    with pytest.raises(ChunkingError, match=r"row 2 \(ts 1\) deletes a row that is not in the relation: level U"
                       ) as e:
        ch.push("Units", _table(logistics, "Units", bad))
    assert e.value.reason == "no_such_row" and "\n" not in str(e.value) and ch.rejected == {"no_such_row": 2}
    # the first delete of the refused batch was not applied: c can be deleted once, then not again
    ch.push("Units", _table(logistics, "Units", bad[:1]))
    with pytest.raises(ChunkingError, match="not in the relation"):
        ch.push("Units", _table(logistics, "Units", bad[:1]))
    with pytest.raises(ChunkingError, match="op must be insert or delete, not 'update'") as e:
        ch.push("Units", _table(logistics, "Units", [_u(2, "U", "a", "x", 1, "update")]))
    assert e.value.reason == "bad_op"
    # a relation's input without op is refused too
    with pytest.raises(ChunkingError, match="missing columns op"):
        ch.push("Units", _table(logistics, "Units", [_u(2, "U", "a", "x", 1)]).drop_columns(["op"]))
    # and input going back in time, named as the relation's
    with pytest.raises(ChunkingError, match=r"^relation Units: ts 0 is before the relation's last ts 1$") as e:
        ch.push("Units", _table(logistics, "Units", [_u(0, "U", "z", "zulu", 1, "insert")]))
    assert e.value.reason == "ts_decreasing"


def test_a_query_registered_later_reads_the_live_rows(logistics):
    early = compile_query("SELECT RSTREAM unit FROM Units", logistics, "S")
    ch = Chunker(logistics, {"early": early})
    ch.push("Units", _table(logistics, "Units", UNITS[:6]))
    ch.close(4)
    ch.add_query("late", early)
    cut = ch.finish()
    late = [qc for c in cut for qc in c.queries if qc.query_id == "late"]
    # the late query's first chunk: the rows live before its first instant (5), then the delete at 5
    assert late[0].instants == [5]
    units = late[0].items[0]
    assert sorted(units.column("unit").to_pylist()) == ["bravo", "bravo", "charlie", "delta"]
    assert units.column("_del").null_count == 3


def test_a_checkpointed_chunker_continues_exactly(logistics):
    cqs = {f"q{i}": compile_query(t, logistics, "S") for i, t in enumerate(TEXTS[:6])}
    a = Chunker(logistics, dict(cqs), chunk_instants=2)
    a.push("Vitals", _table(logistics, "Vitals", VITALS[:3]))
    a.push("Units", _table(logistics, "Units", UNITS[:5]))
    a.close(1)
    meta, tables = a.export_state()
    b = Chunker(logistics, dict(cqs), chunk_instants=2)
    b.import_state(meta, tables)
    for ch in (a, b):
        ch.push("Units", _table(logistics, "Units", UNITS[5:]))
        ch.push("Vitals", _table(logistics, "Vitals", VITALS[3:]))
    ca, cb = a.finish(), b.finish()
    assert [c.chunk_id for c in ca] == [c.chunk_id for c in cb]
    for x, y in zip(ca, cb):
        for qx, qy in zip(x.queries, y.queries):
            assert qx.instants == qy.instants and qx.prev_instant == qy.prev_instant
            assert all(tx.equals(ty) for tx, ty in zip(qx.items, qy.items))
    # deletes in the restored chunker still match rows inserted before the checkpoint
    with pytest.raises(ChunkingError, match="not in the relation"):
        b.push("Units", _table(logistics, "Units", [_u(9, "U", "a", "alpha", 10, "delete")]))


def test_intervals_end_at_the_delete_that_names_the_row():
    seq = np.array([4, 7, 9, 12, 13])
    ts = np.array([0, 2, 3, 5, 5])
    deleted = np.array([-1, -1, 4, -1, 7])
    is_del = deleted >= 0
    end = intervals(seq, ts, deleted, is_del)
    big = np.iinfo(np.int64).max
    assert end.tolist() == [3, 5, 3, big, 5]


# ---- evaluation: examples and random queries against the reference ----------------------------------


def test_the_examples_by_hand(logistics):
    streams = {"Vitals": VITALS, "Units": UNITS}
    # a at 1 is alpha; at 3 the C reading of a meets delta (inserted at 3, same instant); b's unit is C
    # b's unit is deleted at 5; one of the two charlie rows is live at 7
    assert evaluate(TEXTS[0], logistics, "S", streams) == [
        (1, "U", "a", 110.0, "alpha"), (2, "C", "b", 90.0, "bravo"), (3, "C", "a", 130.0, "delta"),
        (4, "U", "a", 140.0, "delta"), (7, "C", "c", 120.0, "charlie")]
    got = evaluate(TEXTS[0], logistics, "U", streams)
    assert got == [(1, "U", "a", 110.0, "alpha"), (4, "U", "a", 140.0, "delta")]
    # the count moves at the updates only (the query reads no stream)
    assert evaluate(TEXTS[1], logistics, "U", streams) == [(0, "U", 2, 15), (3, "U", 2, 17), (6, "U", 3, 22),
                                                           (7, "U", 2, 17)]
    # the oldest of two equal rows goes: charlie inserted at 0 is deleted at 7, the one of 6 stays
    rows = evaluate(TEXTS[4], logistics, "U", streams)
    assert (7, "U", "charlie", 6) in rows and (7, "U", "charlie", 0) not in rows


@pytest.mark.spark
def test_the_examples_through_chunks_and_two_workers(logistics, rel_engines):
    """Every example at U and S through chunks of 1-3 instants on two workers equals the reference,
    and a U session's output is the same with and without the rows and updates above U."""
    from strata.worker.shared import SharedExecutor

    executors = [SharedExecutor(e, logistics) for e in rel_engines[:2]]
    check_examples(logistics, TEXTS, {"Vitals": VITALS, "Units": UNITS}, ABOVE, executors, incremental=(1, 3))


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_random_queries_over_relations_equal_reference(logistics, rel_engines, data):
    """Random queries over a stream and a stored relation (alone, joined, self-joined; aggregates,
    DISTINCT, stream operators, level clauses) on random updates (deletes of live rows, equal rows),
    through chunks of random length on several workers, against the reference."""
    level = data.draw(st.sampled_from(logistics.lattice.levels), label="level")
    text = data.draw(queries(logistics, level), label="query")
    assume("Units" in text or "units" in text)
    try:
        compile_query(text, logistics, logistics.lattice.parse(level))
    except QueryError:
        assume(False)
    streams = data.draw(multistream(logistics), label="streams")
    assert_reference(logistics, level, [text], streams,
                     drawn_run(data, logistics, level, [text], streams, rel_engines))


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_relations_through_master_restarts_equal_reference(logistics, rel_engines, data):
    """Random queries over the stream and the relation through a master with a store, restarted at
    random points from a checkpoint (the relation's live rows and pending updates in it) or from
    its whole log, chunks merged at random and some failing: equal to the reference."""
    from strata.worker.shared import SharedExecutor

    level, texts, streams, k, rnd = _case(data, logistics, max_instants=8)
    try:
        for t in texts:
            compile_query(t, logistics, level)
    except QueryError:
        assume(False)
    executors = [SharedExecutor(e, logistics, enabled=True) for e in rel_engines[:2]]
    restarted_equals_reference(logistics, level, texts, streams, executors, k, rnd)


# ---- through the CLI --------------------------------------------------------------------------------


@pytest.mark.slow
def test_replay_with_a_relation_equals_the_reference(tmp_path, logistics):
    from .helpers import strata, write_config, write_csv

    cfg_path = write_config(tmp_path, LOGISTICS_TOML, {"ann": "TS"})
    rnd = random.Random(3)
    vitals = sorted(VITALS + ABOVE["Vitals"] + [_v(ts, rnd.choice("UCS"), rnd.choice("abc"), rnd.randrange(50, 200))
                                                for ts in range(8, 14)], key=lambda r: r["ts"])
    units = sorted(UNITS + ABOVE["Units"] + [_u(10, "U", "a", "echo", 3), _u(12, "U", "a", "echo", 3, "delete")],
                   key=lambda r: r["ts"])
    write_csv(tmp_path / "v.csv", ["ts", "level", "sid", "bp"], [(r["ts"], r["level"], r["sid"], r["bp"]) for r in vitals])
    write_csv(tmp_path / "u.csv", ["ts", "level", "sid", "unit", "strength", "op"],
              [(r["ts"], r["level"], r["sid"], r["unit"], r["strength"], r["op"].upper()) for r in units])
    out = tmp_path / "out"
    args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", "S", "--workers", "1",
            "--input", f"Vitals={tmp_path / 'v.csv'}", "--input", f"Units={tmp_path / 'u.csv'}", "--output", str(out)]
    for q in TEXTS:
        args += ["--query", q]
    r = strata(*args)
    assert r.returncode == 0, r.stderr
    for i, q in enumerate(TEXTS):
        got = rows_of(pcsv.read_csv(out / f"q{i + 1}.csv")) if (out / f"q{i + 1}.csv").stat().st_size else []
        expected = evaluate(q, logistics, "S", {"Vitals": vitals, "Units": units})
        assert expected, q
        compare_results(got, expected)
    # a delete of a row that is not live: one line, nothing started
    write_csv(tmp_path / "bad.csv", ["ts", "level", "sid", "unit", "strength", "op"], [(1, "U", "a", "x", 1, "delete")])
    r = strata("replay", "--config", str(cfg_path), "--user", "ann", "--level", "S", "--workers", "1",
               "--input", f"Units={tmp_path / 'bad.csv'}", "--output", str(tmp_path / "out2"),
               "--query", "SELECT * FROM Units")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "deletes a row that is not in the relation" in last and "Traceback" not in r.stderr, r.stderr
