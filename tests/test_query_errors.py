"""Issue 12: one failing query stalls a level; overflow is silent.

* Integer overflow is never a wrapped value: the query fails at the instant the
  contract says (SEMANTICS §8), in the engine and in the reference alike.
* A failing query is that query's problem: the worker returns an error result for
  it (one line, ``error_ts``, the rows before it, no state) and evaluates every
  other query of the chunk normally; shared groups fall back to their members.
* Only what concerns the whole call (level, undecodable bytes, tuples above the
  worker, a query without its text) still refuses the Execute call.
"""

from __future__ import annotations

import dataclasses
import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.chunking.codec import decode_result, encode_chunk, encode_result
from strata.chunking.model import Chunk, ChunkResult, QueryChunk
from strata.config import parse_config
from strata.master.local import cut_chunks
from strata.mlscql import compile_query, to_text

from .distributed import run_distributed
from .reference.evaluator import QueryFailed, compare_results, evaluate, evaluate_outcome
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, rows_of

pytestmark = pytest.mark.spark

_, SETTINGS = example_settings("STRATA_ERROR_EXAMPLES", 8)

TOML = """
[lattice]
levels = ["U", "C", "S"]

[streams.S]
sid = "string"
n = "long"
d = "double"
"""
BIG = 4 * 10**18  # 3 of them overflow a long (2**63 ≈ 9.22e18)


@pytest.fixture(scope="module")
def cfg():
    return parse_config(TOML)


@pytest.fixture(scope="module")
def engine(spark, cfg):
    from strata.worker.engine import Engine

    return Engine(spark, cfg)


@pytest.fixture(scope="module", params=["arrow", "spark"])
def any_engine(spark, cfg, request):
    """Both ways of computing window membership (NumPy with pruning, or Spark)."""
    from strata.worker.engine import Engine

    return Engine(spark, cfg, membership=request.param)


def stream(rows: list[tuple]) -> list[dict]:
    """(ts, level, sid, n[, d]) → tuples as the reference takes them."""
    return [{"ts": r[0], "level": r[1], "sid": r[2], "n": r[3], "d": r[4] if len(r) > 4 else 1.0} for r in rows]


def table(cfg, rows: list[tuple]) -> pa.Table:
    t = inputs_of(cfg, {"S": stream(rows)})["S"]
    return t.add_column(0, "_seq", pa.array(range(t.num_rows), pa.int64()))


def qchunk(qid, items, instants, prev=None, state=None, upto=None, chunk_id=0):
    return QueryChunk(qid, chunk_id, list(items), list(instants), prev, state, upto)


#: the issue's stream: 4e18 at instants 1..3, small values from 4 on
ISSUE = [(1, "U", "a", BIG), (2, "U", "a", BIG), (3, "U", "b", BIG), (4, "U", "a", 1), (5, "U", "b", 2),
         (6, "U", "a", 3), (7, "U", "a", 4), (8, "U", "b", 5), (9, "U", "a", 6)]


# ---- the issue's example -------------------------------------------------------------------------
def test_issue_sum_overflow_is_an_error_at_its_instant_and_count_is_unaffected(cfg, engine):
    """SUM over longs near 4e18: an error at instant 3 (not a wrapped number), while COUNT(*)
    in the same chunk is correct; the engine and the reference agree."""
    t = table(cfg, ISSUE)
    inst = list(range(1, 10))
    s = compile_query("SELECT SUM(n) FROM S [ROWS 5]", cfg, "U")
    c = compile_query("SELECT COUNT(*) FROM S [ROWS 5]", cfg, "U")
    rs = engine.run(s, qchunk("sum", [t], inst))
    rc = engine.run(c, qchunk("count", [t], inst))
    assert rs.error == "integer overflow: SUM(n) is outside the 64-bit range"
    assert rs.error_ts == 3 and rs.state is None
    assert rows_of(rs.rows) == [(1, "U", BIG), (2, "U", 2 * BIG)]
    assert rc.error is None and rows_of(rc.rows) == [(t, "U", min(t, 5)) for t in inst]
    # the reference: the same rows before instant 3, the same failing instant
    ref = evaluate_outcome("SELECT SUM(n) FROM S [ROWS 5]", cfg, "U", {"S": stream(ISSUE)})
    assert ref.error_ts == 3 and ref.rows == [(1, "U", BIG), (2, "U", 2 * BIG)]
    with pytest.raises(QueryFailed) as e:
        evaluate("SELECT SUM(n) FROM S [ROWS 5]", cfg, "U", {"S": stream(ISSUE)})
    assert e.value.outcome.error_ts == 3
    assert rows_of(rc.rows) == evaluate("SELECT COUNT(*) FROM S [ROWS 5]", cfg, "U", {"S": stream(ISSUE)})


def test_issue_through_the_worker_core(cfg, engine):
    """The Execute call is not refused: the failing query gets an error result (encoded on the
    wire), the other query its normal result."""
    from strata.worker.service import QuerySpecData, WorkerCore

    core = WorkerCore(cfg, "U", engine)
    texts = {"q1": "SELECT SUM(n) FROM S [ROWS 5]", "q2": "SELECT COUNT(*) FROM S [ROWS 5]"}
    p, ids, chunks = cut_chunks(cfg, "U", list(texts.values()), {"S": inputs_of(cfg, {"S": stream(ISSUE)})["S"]}, 4)
    got: dict[str, list] = {q: [] for q in ids}
    errors = {}
    for ch in chunks:
        specs = [QuerySpecData(q, texts[q], "U") for q in ids]
        for b in core.execute("U", specs, encode_chunk(ch)):
            r = decode_result(b)
            if r.query_id in errors:
                continue
            got[r.query_id] += rows_of(r.rows)
            if r.error:
                errors[r.query_id] = (r.error, r.error_ts)
    assert errors == {"q1": ("integer overflow: SUM(n) is outside the 64-bit range", 3)}
    assert got["q1"] == [(1, "U", BIG), (2, "U", 2 * BIG)]
    assert got["q2"] == [(t, "U", min(t, 5)) for t in range(1, 10)]
    # the chunk of instants 4..7 fails too (its window at 4 still holds three 4e18): its result is
    # one the master drops, having stopped q1 at 3
    assert core.stats()["failed_query_chunks"] == 2


# ---- the overflow rule, case by case (engine == reference) -----------------------------------------
CASES = [
    # (query, failing instant or None)
    ("SELECT n * 3 AS m FROM S [ROWS 2]", 1),
    ("SELECT sid FROM S [ROWS 2] WHERE n * 3 > 0", 1),
    ("SELECT sid FROM S [ROWS 2] WHERE sid = 'zz' AND n * 3 > 0", None),  # a FALSE conjunct drops the row
    ("SELECT sid FROM S [ROWS 2] WHERE (sid = 'zz' AND n * 3 > 0) OR sid = 'a'", 1),  # no short-circuit
    ("SELECT sid FROM S [ROWS 2] WHERE n + n > 0 AND d IS NULL", None),
    ("SELECT SUM(n) FROM S [ROWS 2]", None),  # 8e18 fits
    ("SELECT SUM(n) FROM S [ROWS 3]", 3),
    ("SELECT AVG(n), MAX(n) - MIN(n) FROM S [ROWS 5]", 5),  # AVG is exact; 4e18 - 2 fits, then BIG - (-BIG) not
    ("SELECT sid, SUM(n) FROM S [ROWS 4] GROUP BY sid", 6),  # group b: three -4e18
    ("SELECT sid, COUNT(*) FROM S [ROWS 4] GROUP BY sid HAVING SUM(n) > 0", 6),  # SUM before HAVING
    ("SELECT sid, COUNT(*) FROM S [ROWS 4] GROUP BY sid HAVING COUNT(*) > 5 AND MIN(n) * 2 > 0", None),
    ("SELECT COUNT(n * 3) FROM S [ROWS 1]", 1),  # an aggregate's argument
    ("SELECT COUNT(*) FROM S [ROWS 1] WHERE sid = 'q' GROUP BY n * 3", None),
    ("SELECT ISTREAM -n - 1 FROM S WHERE sid = 'c'", 5),  # unbounded, no history (NONE mode)
    ("SELECT DSTREAM n FROM S WHERE n * 3 > 0", 1),
    ("SELECT sid, SUM(n) FROM S GROUP BY sid", None),  # running state: 8e18 + 8, -8e18, -2**63 fit
    ("SELECT SUM(n) FROM S WHERE n > 0", 3),  # running state
    ("SELECT SUM(n) FROM S [RANGE 2 SECONDS]", 6),  # 4e18 + 2 - 2**63 fits at 5, -2**63 - 12e18 not at 6
]
OVER = [(1, "U", "a", BIG), (2, "U", "b", BIG), (3, "C", "a", BIG), (4, "U", "a", 2), (5, "U", "c", -(2**63)),
        (6, "U", "b", -BIG), (6, "U", "b", -BIG), (6, "U", "b", -BIG), (7, "U", "a", 5), (8, "U", "a", 1)]


@pytest.mark.parametrize("text,fails_at", CASES)
def test_overflow_rule_engine_equals_reference(cfg, any_engine, text, fails_at):
    ref = evaluate_outcome(text, cfg, "C", {"S": stream(OVER)})
    assert ref.error_ts == fails_at, ref
    for k in ((1, 3) if any_engine.membership == "arrow" else (2,)):  # chunking does not change the answer
        executors = [_executor(any_engine, cfg, sharing=True)]
        out = run_distributed(cfg, "C", [text], {"S": inputs_of(cfg, {"S": stream(OVER)})["S"]}, executors,
                              chunk_instants=k, incremental=True)["q1"]
        assert out.error_ts == fails_at, (k, out)
        assert (out.error is None) == (fails_at is None)
        assert out.error is None or out.error.startswith("integer overflow")
        compare_results(out.rows, ref.rows)


def test_sum_partials_are_exact_whatever_the_order(cfg, engine):
    """(2**63-1) + 1 - 1 in any order is 2**63-1: partial sums out of range are not failures."""
    rows = [(1, "U", "a", 2**63 - 1), (1, "U", "a", 1), (1, "U", "a", -1), (2, "U", "a", -(2**63)),
            (2, "U", "a", -(2**63)), (2, "U", "a", 2**63 - 1), (2, "U", "a", 2**63 - 1)]
    text = "SELECT SUM(n), AVG(n) FROM S"
    expected = evaluate(text, cfg, "U", {"S": stream(rows)})
    assert [r[2] for r in expected] == [2**63 - 1, 2**63 - 3]
    for perm in range(4):
        shuffled = rows[:3] if perm % 2 else list(reversed(rows[:3]))
        shuffled += rows[3:] if perm < 2 else list(reversed(rows[3:]))
        res = engine.run(compile_query(text, cfg, "U"), qchunk("q", [table(cfg, shuffled)], [1, 2]))
        assert res.error is None
        compare_results(rows_of(res.rows), expected)


def test_state_keeps_exact_sums_as_two_words(cfg, engine):
    """STATE schema: a{k}_shi / a{k}_slo with 0 <= slo < 2**32; sum = shi * 2**32 + slo; an old
    single-column a{k}_sum state is still read."""
    cq = compile_query("SELECT sid, SUM(n), AVG(n) FROM S GROUP BY sid", cfg, "U")
    rows = [(1, "U", "a", 2**62), (1, "U", "a", 2**62 - 1), (2, "U", "b", -5), (3, "U", "a", -7)]
    t = table(cfg, rows)
    r1 = engine.run(cq, qchunk("q", [t.slice(0, 3)], [1, 2]))
    st_ = {r["g0"]: r for r in r1.state.to_pylist()}
    assert set(r1.state.column_names) >= {"g0", "_rows", "_mask", "a0_cnt", "a0_shi", "a0_slo"}
    assert "a0_sum" not in r1.state.column_names
    for g, total in (("a", 2**63 - 1), ("b", -5)):
        assert 0 <= st_[g]["a0_slo"] < 2**32 and st_[g]["a0_shi"] * 2**32 + st_[g]["a0_slo"] == total
    r2 = engine.run(cq, qchunk("q", [t.slice(3)], [3], prev=2, state=r1.state, upto=2))
    assert rows_of(r2.rows) == [(3, "U", "a", 2**63 - 8, (2**63 - 8) / 3), (3, "U", "b", -5, -5.0)]
    # a state written by an older worker (one bigint sum column) is upgraded
    old = r1.state.drop_columns(["a0_shi", "a0_slo"]).append_column(
        "a0_sum", pa.array([st_[g]["a0_shi"] * 2**32 + st_[g]["a0_slo"] for g in r1.state.column("g0").to_pylist()],
                           pa.int64()))
    r3 = engine.run(cq, qchunk("q", [t.slice(3)], [3], prev=2, state=old, upto=2))
    assert rows_of(r3.rows) == rows_of(r2.rows)


# ---- other failures: isolated per query, rows before the failing instant -----------------------------
def _executor(engine, cfg, sharing=True):
    from strata.worker.shared import SharedExecutor

    return SharedExecutor(engine, cfg, enabled=sharing)


@pytest.fixture
def inject(monkeypatch, spark):
    """``inject({query ids}, from_instant)``: evaluating one of those query chunks (``__shared__``:
    a merged run) at an instant ≥ from_instant raises a real Spark error (Java stack and all)."""
    from strata.worker import engine as E

    original = E._Run.execute
    seen = []

    def arm(qids, from_instant):
        def execute(self):
            if self.chunk.query_id in qids and self.instants and self.instants[-1] >= from_instant:
                seen.append(self.chunk.query_id)
                spark.sql("SELECT raise_error('injected failure')").collect()
            return original(self)

        monkeypatch.setattr(E._Run, "execute", execute)
        return seen

    return arm


SMALL = [(t, "U", "abc"[t % 3], t, float(t)) for t in range(1, 9)]


@pytest.mark.parametrize("form", ["merged", "complete", "alone"])
def test_an_exception_in_one_query_of_a_shared_group_leaves_the_others_correct(cfg, engine, inject, form):
    texts = {
        "merged": ["SELECT sid FROM S [ROWS 3]", "SELECT sid, n + 1 AS m FROM S [ROWS 3]",
                   "SELECT n FROM S [ROWS 3] WHERE n > 2"],
        "complete": ["SELECT sid, n FROM S [ROWS 3]", "SELECT sid AS x, n AS y FROM S [ROWS 3]",
                     "SELECT sid FROM S [ROWS 2]"],
        "alone": ["SELECT AVG(d) FROM S [ROWS 2]", "SELECT sid, COUNT(*) FROM S [RANGE 2] GROUP BY sid",
                  "SELECT n FROM S [NOW]"],
    }[form]
    # q2 fails from instant 5 on; for a merged group the merged run fails too
    failing = {"q2", "__shared__"} if form == "merged" else ({"q1"} if form == "complete" else {"q2"})
    seen = inject(failing, 5)
    ex = _executor(engine, cfg)
    out = run_distributed(cfg, "U", texts, {"S": inputs_of(cfg, {"S": stream(SMALL)})["S"]}, [ex], chunk_instants=8)
    assert seen, "the injected failure never ran"
    bad = "q1" if form == "complete" else "q2"
    for i, text in enumerate(texts):
        qid = f"q{i + 1}"
        expected = evaluate(text, cfg, "U", {"S": stream(SMALL)})
        if qid == bad:
            assert out[qid].error == "evaluation failed: injected failure"  # one line, no Java stack
            assert out[qid].error_ts == 5
            compare_results(out[qid].rows, [r for r in expected if r[0] < 5])
        else:
            assert out[qid].error is None, out[qid]
            compare_results(out[qid].rows, expected)
    if form == "merged":
        assert ex.counters["merged_fallbacks"] >= 1
    if form == "complete":
        assert ex.counters["complete_fallbacks"] >= 1


def test_overflow_in_one_member_of_a_merged_group(cfg, engine):
    """A real overflow in one member: the merged run reports a failure, the members run alone."""
    texts = ["SELECT sid FROM S [ROWS 2]", "SELECT sid, n * 3 AS m FROM S [ROWS 2]", "SELECT n FROM S [ROWS 2]"]
    ex = _executor(engine, cfg)
    out = run_distributed(cfg, "C", texts, {"S": inputs_of(cfg, {"S": stream(OVER)})["S"]}, [ex], chunk_instants=3)
    assert ex.counters["merged_failures"] >= 1
    for i, text in enumerate(texts):
        ref = evaluate_outcome(text, cfg, "C", {"S": stream(OVER)})
        got = out[f"q{i + 1}"]
        assert got.error_ts == ref.error_ts and (got.error is None) == (ref.error is None)
        compare_results(got.rows, ref.rows)
    assert out["q2"].error_ts == 1 and out["q1"].error is None and out["q3"].error is None


def test_error_results_keep_the_rows_before_the_failing_instant(cfg, engine, inject):
    """Binary search over prefixes: the rows before the first failing instant, for every start."""
    cq = compile_query("SELECT ISTREAM sid, n FROM S [ROWS 2]", cfg, "U")
    t = table(cfg, SMALL)
    full = rows_of(engine.run(cq, qchunk("q", [t], range(1, 9))).rows)
    for fail_at in range(1, 9):
        inject({"q"}, fail_at)
        r = engine.run(cq, qchunk("q", [t], range(1, 9)))
        assert r.error == "evaluation failed: injected failure" and r.error_ts == fail_at
        assert rows_of(r.rows) == [x for x in full if x[0] < fail_at]


def test_infrastructure_failures_still_fail_the_call(cfg, engine, monkeypatch):
    from strata.worker import engine as E

    def broken(self):
        raise ConnectionError("Error while sending or receiving")

    monkeypatch.setattr(E._Run, "execute", broken)
    cq = compile_query("SELECT n FROM S [NOW]", cfg, "U")
    with pytest.raises(ConnectionError):
        engine.run(cq, qchunk("q", [table(cfg, SMALL)], [1]))


def test_describe_error_gives_one_line(spark):
    from strata.worker.engine import describe_error

    ansi = spark.newSession()
    ansi.conf.set("spark.sql.ansi.enabled", "true")
    with pytest.raises(Exception) as e:
        ansi.sql("SELECT CAST(9223372036854775807 AS BIGINT) + CAST(1 AS BIGINT)").collect()
    text = describe_error(e.value)
    assert text.startswith("integer overflow") and "\n" not in text and "spark.sql" not in text, text
    assert "SQLSTATE" not in text and "at org.apache" not in text
    with pytest.raises(Exception) as e:
        ansi.sql("SELECT CAST(1 AS BIGINT) / CAST(0 AS BIGINT)").collect()
    assert describe_error(e.value) == "division by zero"
    java = ("An error occurred while calling o57.collectToPython.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed\n"
            "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2898)\n"
            "Caused by: java.lang.ArithmeticException: long overflow\n"
            "\tat java.base/java.lang.Math.multiplyExact(Math.java:1032)\n")
    assert describe_error(RuntimeError(java)) == "integer overflow: long overflow"
    assert describe_error(KeyError("x")) == "evaluation failed: KeyError: 'x'"
    assert len(describe_error(ValueError("y" * 1000))) == 300


# ---- the worker: per-query failures vs whole-call refusals --------------------------------------------
def test_worker_rejects_one_query_not_the_call(cfg, engine):
    from strata.worker.service import QuerySpecData, WorkerCore, WorkerRefused

    core = WorkerCore(cfg, "C", engine)
    t = table(cfg, [(1, "U", "a", 1), (2, "C", "b", 2)])
    chunk = Chunk(0, 1, 2, [qchunk("good", [t], [1, 2], chunk_id=0), qchunk("bad", [t], [1, 2], chunk_id=0)])
    specs = [QuerySpecData("good", "SELECT n FROM S [NOW]", "C"), QuerySpecData("bad", "SELEKT n FROM S", "C")]
    res = {r.query_id: r for r in map(decode_result, core.execute("C", specs, encode_chunk(chunk)))}
    assert res["good"].error is None and rows_of(res["good"].rows) == [(1, "U", 1), (2, "C", 2)]
    assert res["bad"].error.startswith("query rejected on the worker:") and "\n" not in res["bad"].error
    assert res["bad"].error_ts == 1 and res["bad"].rows.num_rows == 0
    # whole-call refusals stay
    with pytest.raises(WorkerRefused):
        core.execute("U", specs, encode_chunk(chunk))  # another level's master
    with pytest.raises(WorkerRefused):
        core.execute("C", specs[:1], encode_chunk(chunk))  # a query without its text
    with pytest.raises(WorkerRefused):
        core.execute("C", [QuerySpecData("good", "SELECT n FROM S [NOW]", "U")], encode_chunk(chunk))
    high = Chunk(0, 1, 1, [qchunk("good", [table(cfg, [(1, "S", "a", 1)])], [1])])
    with pytest.raises(WorkerRefused):
        core.execute("C", specs[:1], encode_chunk(high))  # a tuple above the worker's level
    with pytest.raises(ValueError):
        core.execute("C", specs, b"not a chunk")


def test_error_results_travel_on_the_wire():
    rows = pa.table({"ts": pa.array([1], pa.int64()), "level": ["U"], "x": [1]})
    r = ChunkResult("q", 3, rows, stats={"error": "integer overflow: x"}, error="integer overflow: x", error_ts=2)
    back = decode_result(encode_result(r))
    assert (back.error, back.error_ts, back.state, rows_of(back.rows)) == ("integer overflow: x", 2, None, [(1, "U", 1)])
    ok = decode_result(encode_result(dataclasses.replace(r, error=None, error_ts=None)))
    assert ok.error is None and ok.error_ts is None


# ---- prefixes: evaluating a prefix of the instants gives exactly their output ------------------------
@SETTINGS
@given(data=st.data())
def test_a_prefix_of_the_instants_gives_exactly_their_output(cfg, engine, data):
    """What the binary search relies on: a chunk's items with a prefix of its instants evaluate
    to the chunk's output (and failure) restricted to those instants."""
    level = data.draw(st.sampled_from(cfg.lattice.levels), label="level")
    text = data.draw(queries(cfg, level, extremes=True), label="query")
    streams = data.draw(multistream(cfg, extremes=0.4), label="streams")
    k = data.draw(st.integers(2, 4), label="chunk_instants")
    _, _, chunks = cut_chunks(cfg, level, [text], inputs_of(cfg, streams), k)
    cq = compile_query(text, cfg, level)
    rnd = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    for ch in rnd.sample(chunks, min(2, len(chunks))):
        qc = ch.queries[0]
        full = engine.run(cq, qc)
        inst = sorted(qc.instants)
        for n in range(1, len(inst)):
            part = engine.run(cq, dataclasses.replace(qc, instants=inst[:n]))
            if full.error is not None and full.error_ts <= inst[n - 1]:
                assert (part.error, part.error_ts) == (full.error, full.error_ts)
            else:
                assert part.error is None
            compare_results(rows_of(part.rows), [r for r in rows_of(full.rows) if r[0] <= inst[n - 1]])
