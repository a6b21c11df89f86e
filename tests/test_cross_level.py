"""Cross-level operator reuse in a trusted worker (worker/cross_level.py, docs/trusted.md): plain Python,
no Spark.  Queries are compiled for real; chunks are hand-made Arrow tables; the engine is a fake that
records the residual runs it is asked for."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from strata.chunking.model import ChunkResult, QueryChunk
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.mlscql import compile_query
from strata.worker.assemble import result_schema
from strata.worker.cross_level import CrossLevelCache, reuse_shape
from strata.worker.shared import SharedExecutor

CFG = parse_config(BATTLEFIELD_TOML)
LEVELS = ("U", "C", "S", "TS")


def cq(text: str, level: str):
    return compile_query(text, CFG, level)


def items(rows, seq0: int = 0) -> pa.Table:
    """Vitals rows (ts, level, sid, bp) with arrival numbers from ``seq0``."""
    schema = pa.schema([("_seq", pa.int64()), ("ts", pa.int64()), ("level", pa.string()),
                        ("sid", pa.string()), ("bp", pa.float64())])
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    return pa.table([pa.array(range(seq0, seq0 + len(rows)), pa.int64()), *[pa.array(c) for c in cols]],
                    schema=schema) if rows else schema.empty_table()


def chunk(qid: str, rows, instants, prev=None, seq0: int = 0) -> QueryChunk:
    return QueryChunk(qid, 1, [items(rows, seq0)], list(instants), prev)


def result(q, qid: str, out_rows) -> ChunkResult:
    """A result of ``q`` with rows (ts, level, values...)."""
    schema = result_schema(q)
    cols = list(zip(*out_rows)) if out_rows else [[] for _ in schema]
    return ChunkResult(qid, 1, pa.table([pa.array(c, f.type) for c, f in zip(cols, schema)], schema=schema))


class FakeEngine:
    config = CFG

    def __init__(self):
        self.runs: list[QueryChunk] = []

    def run(self, q, qc, isolate=True):
        """The residual of a selection of ``sid, bp`` over RANGE windows: every tuple at each instant
        within 3 seconds (good enough for the hand-made chunks below)."""
        self.runs.append(qc)
        t = qc.items[0].to_pylist()
        out = [(tau, r["level"], r["sid"], r["bp"]) for tau in qc.instants for r in t if tau - 3 < r["ts"] <= tau]
        return result(q, qc.query_id, out)


RANGE = "RSTREAM(SELECT sid, bp FROM Vitals [RANGE 3 seconds])"
ROWS_U = "SELECT bp FROM Vitals [ROWS 3 level in {U}]"


def cache(**kw) -> CrossLevelCache:
    c = CrossLevelCache(CFG.lattice, LEVELS, CFG.instant_seconds, **kw)
    c.residual_min_rows = 0  # N'' evaluated whatever the chunk's size
    return c


def test_shapes():
    assert reuse_shape(cq(RANGE, "S")).split is not None
    assert reuse_shape(cq(RANGE, "S")).levels == {"U", "C", "S"}
    # the same text at two levels: different nodes, the same split key (its level set aside)
    s, ts = reuse_shape(cq(RANGE, "S")), reuse_shape(cq(RANGE, "TS"))
    assert s.whole != ts.whole and s.split == ts.split
    # ROWS over several levels or an aggregate: only whole (the levels interact)
    assert reuse_shape(cq("SELECT bp FROM Vitals [ROWS 3]", "S")).split is None
    assert reuse_shape(cq("SELECT AVG(bp) FROM Vitals [RANGE 3 seconds]", "S")).split is None
    assert reuse_shape(cq("SELECT DISTINCT sid FROM Vitals [RANGE 3 seconds]", "S")).split is None
    # ROWS over one level is PARTITION BY level ROWS over it: split like a level-partitioned window
    one = reuse_shape(cq(ROWS_U, "S"))
    part = reuse_shape(cq("SELECT bp FROM Vitals [PARTITION BY level ROWS 3 level in {U, C}]", "S"))
    assert one.split == part.split and one.levels == {"U"} and part.levels == {"U", "C"}
    # compound queries are never reused
    assert reuse_shape(cq("SELECT sid FROM Vitals [ROWS 2] UNION SELECT sid FROM Positions [NOW]", "S")) is None


def test_whole_reuse_only_upwards_and_counted_per_level():
    c = cache()
    eng = FakeEngine()
    lo, hi = cq(ROWS_U, "C"), cq(ROWS_U, "S")
    rows = [(1, "U", "a", 1.0), (2, "U", "b", 2.0)]
    stored = result(lo, "q1", [(2, "U", 2.0)])
    c.store("C", lo, chunk("q1", rows, [2], prev=1), stored)
    # S's chunk of the same query: other arrival numbers, an S tuple the window does not hold
    got = c.lookup("S", hi, chunk("q7", rows + [(2, "S", "c", 9.0)], [2], prev=1, seq0=40), eng)
    assert got is not None and got.query_id == "q7" and got.rows.equals(stored.rows)
    assert got.stats["shared"] == "cross_level" and not eng.runs
    assert c.stats("S") == {"hits": 1, "hits_whole": 1}
    assert c.stats("C") == {} and c.stats("TS") == {}  # a level sees its own counters only
    # never the reverse: S's output is not C's to read, nor U's
    c.store("S", hi, chunk("q7", rows, [2], prev=1), stored)
    assert c.lookup("U", cq(ROWS_U, "U"), chunk("q1", rows, [2], prev=1), eng) is None
    c2 = cache()
    c2.store("S", hi, chunk("q7", rows, [2], prev=1), stored)
    assert c2.lookup("C", lo, chunk("q1", rows, [2], prev=1), eng) is None
    assert c2.stats("C") == {"misses": 1, "misses_absent": 1}


@pytest.mark.parametrize("change", ["tuple", "instants", "prev", "value", "order"])
def test_whole_reuse_needs_the_same_input(change):
    c = cache()
    lo, hi = cq(ROWS_U, "C"), cq(ROWS_U, "S")
    rows = [(1, "U", "a", 1.0), (2, "U", "b", 2.0)]
    c.store("C", lo, chunk("q1", rows, [2], prev=1), result(lo, "q1", [(2, "U", 2.0)]))
    other = {"tuple": (rows + [(2, "U", "c", 3.0)], [2], 1), "instants": (rows, [1, 2], None),
             "prev": (rows, [2], 0), "value": ([rows[0], (2, "U", "b", 2.5)], [2], 1),
             "order": (rows[::-1], [2], 1)}[change]
    assert c.lookup("S", hi, chunk("q7", other[0], other[1], prev=other[2]), FakeEngine()) is None
    why = "misses_other_input" if change in ("tuple", "value", "order") else "misses_absent"
    assert c.stats("S") == {"misses": 1, why: 1}


def test_split_reuse_level_sets_differ():
    """The same text at S and TS: TS's window holds TS too.  N' = S's rows, N'' = TS's query over its
    TS tuples alone; a reuse that ignored the level sets would lose the TS rows."""
    c = cache()
    eng = FakeEngine()
    lo, hi = cq(RANGE, "S"), cq(RANGE, "TS")
    rows = [(1, "U", "a", 1.0), (2, "S", "b", 2.0)]
    stored = eng.run(lo, chunk("q1", rows, [1, 2]))
    c.store("S", lo, chunk("q1", rows, [1, 2]), stored)
    eng.runs.clear()
    # no TS tuple: S's rows are TS's, nothing evaluated
    got = c.lookup("TS", hi, chunk("q2", rows, [1, 2], seq0=9), eng)
    assert got is not None and got.rows.to_pylist() == stored.rows.to_pylist() and not eng.runs
    # a TS tuple: the residual runs over it alone, and the rows are the whole query's
    with_ts = rows + [(2, "TS", "z", 7.0)]
    got = c.lookup("TS", hi, chunk("q2", with_ts, [1, 2]), eng)
    assert [r.items[0].column("level").to_pylist() for r in eng.runs] == [["TS"]]
    full = FakeEngine().run(hi, chunk("q2", with_ts, [1, 2]))
    assert sorted(got.rows.to_pylist(), key=repr) == sorted(full.rows.to_pylist(), key=repr)
    assert c.stats("TS") == {"hits": 2, "hits_split": 2, "residual_empty": 1, "residual_run": 1}
    # a narrower level set above (Def. 11 case 3): S's rows of U only
    narrow = cq("RSTREAM(SELECT sid, bp FROM Vitals [RANGE 3 seconds level in {U}])", "TS")
    eng.runs.clear()
    got = c.lookup("TS", narrow, chunk("q3", [rows[0]], [1, 2]), eng)
    assert got is not None and got.rows.column("level").to_pylist() == ["U", "U"] and not eng.runs


def test_split_needs_the_same_tuples_of_the_common_levels():
    c = cache()
    lo, hi = cq(RANGE, "S"), cq(RANGE, "TS")
    rows = [(1, "U", "a", 1.0), (2, "S", "b", 2.0)]
    c.store("S", lo, chunk("q1", rows, [1, 2]), FakeEngine().run(lo, chunk("q1", rows, [1, 2])))
    # TS's pipeline holds an S tuple S's chunk did not: TS computes its own
    assert c.lookup("TS", hi, chunk("q2", rows + [(2, "S", "x", 3.0)], [1, 2]), FakeEngine()) is None


def test_no_split_when_levels_interact():
    c = cache()
    eng = FakeEngine()
    for text in ("SELECT bp FROM Vitals [ROWS 2]", "SELECT AVG(bp) FROM Vitals [RANGE 3 seconds]"):
        lo, hi = cq(text, "S"), cq(text, "TS")
        rows = [(1, "U", "a", 1.0)]
        c.store("S", lo, chunk("q1", rows, [1]), result(lo, "q1", []))
        assert c.lookup("TS", hi, chunk("q2", rows, [1]), eng) is None


def test_what_is_stored():
    c = cache()
    q = cq(ROWS_U, "TS")
    rows = [(1, "U", "a", 1.0)]
    # the top level stores nothing (no level above it reads); a failed result is never stored
    c.store("TS", q, chunk("q1", rows, [1]), result(q, "q1", []))
    assert c.size("TS") == (0, 0)
    failed = dataclasses.replace(result(cq(ROWS_U, "C"), "q1", []), error="boom", error_ts=1)
    c.store("C", cq(ROWS_U, "C"), chunk("q1", rows, [1]), failed)
    assert c.size("C") == (0, 0)
    assert c.stores("U") and c.stores("S") and not c.stores("TS")
    assert c.reads("TS") and not c.reads("U")


def test_bounds_per_storing_level():
    c = cache(max_entries=3)
    eng = FakeEngine()
    lo, hi = cq(ROWS_U, "U"), cq(ROWS_U, "C")
    rows = [(1, "U", "a", 1.0)]
    for t in range(1, 6):
        c.store("U", lo, chunk("q1", rows, [t], prev=t - 1), result(lo, "q1", []))
    assert c.size("U")[0] == 3
    # the oldest instants are gone, the newest are there
    assert c.lookup("C", hi, chunk("q2", rows, [1], prev=0), eng) is None
    assert c.lookup("C", hi, chunk("q2", rows, [5], prev=4), eng) is not None
    # another level's stores never evict U's entries
    s = cq(ROWS_U, "S")
    for t in range(1, 10):
        c.store("S", s, chunk("q9", rows, [t], prev=t - 1), result(s, "q9", []))
    assert c.size("U")[0] == 3 and c.size("S")[0] == 3
    assert c.lookup("C", hi, chunk("q2", rows, [5], prev=4), eng) is not None
    # rows are bounded too
    small = cache(max_rows=5)
    many = [(1, "U", str(i), 1.0) for i in range(3)]
    for t in range(1, 4):
        small.store("U", lo, chunk("q1", many, [t], prev=t - 1), result(lo, "q1", []))
    assert small.size("U") == (1, 3)


def test_incomparable_levels_never_read_each_other():
    class Diamond:  # bottom < A, B < top; A and B incomparable
        order = {("lo", "A"), ("lo", "B"), ("lo", "hi"), ("A", "hi"), ("B", "hi")}

        def leq(self, a, b):
            return a == b or (a, b) in self.order

    c = CrossLevelCache(Diamond(), ("lo", "A", "B", "hi"))
    assert not c._may_read("A", "B") and not c._may_read("B", "A")
    assert c._may_read("hi", "A") and c._may_read("A", "lo") and not c._may_read("lo", "A")
    assert not c._may_read("A", "A")


def test_shared_executor_hook():
    """SharedExecutor: lookups before the level's own evaluation, stores after it; off by switch."""
    eng = FakeEngine()
    ex = SharedExecutor(eng, CFG, enabled=False, levels=("S", "TS"), across_levels=True)
    rows = [(1, "U", "a", 1.0)]
    lo, hi = cq(RANGE, "S"), cq(RANGE, "TS")
    (r1,) = ex.run({"q1": lo}, [chunk("q1", rows, [1])])
    assert len(eng.runs) == 1
    (r2,) = ex.run({"q5": hi}, [chunk("q5", rows, [1], seq0=3)])
    assert len(eng.runs) == 1 and r2.query_id == "q5" and r2.rows.to_pylist() == r1.rows.to_pylist()
    assert ex.cross_level_stats("TS") == {"hits": 1, "hits_split": 1, "residual_empty": 1}
    assert ex.cross_level_stats("S") == {}
    off = SharedExecutor(FakeEngine(), CFG, enabled=False, levels=("S", "TS"), across_levels=False)
    assert off.cross is None and off.cross_level_stats("TS") == {}
    one = SharedExecutor(FakeEngine(), CFG, enabled=False, levels=("S",))
    assert one.cross is None
    assert CFG.sharing.across_levels is True
    assert parse_config(BATTLEFIELD_TOML + "\n[sharing]\nacross_levels = false\n").sharing.across_levels is False


def test_shared_executor_batches_the_residual():
    """A split reuse's N'' (TS's query over its TS tuples alone) is evaluated in the chunk's one batch with
    the chunk's other queries, then joined to S's stored rows."""

    class Batching(FakeEngine):
        def __init__(self):
            super().__init__()
            self.batches: list[int] = []

        def run_many(self, pairs):
            self.batches.append(len(pairs))
            return [self.run(q, qc) for q, qc in pairs]

    eng = Batching()
    ex = SharedExecutor(eng, CFG, enabled=True, levels=("S", "TS"), across_levels=True)
    ex.cross.residual_min_rows = 0
    rows = [(1, "U", "a", 1.0), (2, "S", "b", 2.0)]
    lo, hi = cq(RANGE, "S"), cq(RANGE, "TS")
    other = cq("RSTREAM(SELECT sid, bp FROM Vitals [RANGE 3 seconds level in {TS}])", "TS")
    ex.run({"q1": lo}, [chunk("q1", rows, [1, 2])])
    with_ts = rows + [(2, "TS", "z", 7.0)]
    eng.batches.clear()
    eng.runs.clear()
    got = ex.run({"q5": hi, "q6": other}, [chunk("q5", with_ts, [1, 2]), chunk("q6", [with_ts[2]], [1, 2])])
    assert eng.batches == [2]  # q6 and q5's residual, one batch
    assert [r.items[0].column("level").to_pylist() for r in eng.runs] == [["TS"], ["TS"]]
    full = FakeEngine().run(hi, chunk("q5", with_ts, [1, 2]))
    assert sorted(got[0].rows.to_pylist(), key=repr) == sorted(full.rows.to_pylist(), key=repr)
    assert ex.cross_level_stats("TS") == {"hits": 1, "hits_split": 1, "residual_run": 1, "misses": 1,
                                          "misses_absent": 1}  # q6: nothing of it stored below

    # a residual that fails: the query is evaluated whole, as without reuse
    class Failing(Batching):
        def run(self, q, qc, isolate=True):
            r = super().run(q, qc)
            if qc.items[0].num_rows == 1:  # the residual (one TS tuple)
                return dataclasses.replace(r, error="boom", error_ts=1)
            return r

    eng2 = Failing()
    ex2 = SharedExecutor(eng2, CFG, enabled=False, levels=("S", "TS"), across_levels=True)
    ex2.cross.residual_min_rows = 0
    ex2.run({"q1": lo}, [chunk("q1", rows, [1, 2])])
    (got,) = ex2.run({"q5": hi}, [chunk("q5", with_ts, [1, 2])])
    assert got.error is None and sorted(got.rows.to_pylist(), key=repr) == sorted(full.rows.to_pylist(), key=repr)
    assert ex2.cross_level_stats("TS") == {"residual_failures": 1, "misses": 1, "misses_residual_failed": 1}


def test_no_residual_run_below_the_threshold():
    """With ``residual_min_rows`` a split reuse whose N'' is not empty is taken only for larger chunks (the
    query is then evaluated whole in the chunk's batch); an empty N'' is always taken."""
    c = CrossLevelCache(CFG.lattice, LEVELS, CFG.instant_seconds)
    assert c.residual_min_rows == CrossLevelCache.RESIDUAL_MIN_ROWS == 0
    c.residual_min_rows = 20_000
    eng = FakeEngine()
    lo, hi = cq(RANGE, "S"), cq(RANGE, "TS")
    rows = [(1, "U", "a", 1.0), (2, "S", "b", 2.0)]
    c.store("S", lo, chunk("q1", rows, [1, 2]), eng.run(lo, chunk("q1", rows, [1, 2])))
    assert c.lookup("TS", hi, chunk("q2", rows + [(2, "TS", "z", 7.0)], [1, 2])) is None
    assert c.lookup("TS", hi, chunk("q2", rows, [1, 2])) is not None
    assert c.stats("TS") == {"misses": 1, "misses_residual_small": 1, "hits": 1, "hits_split": 1,
                             "residual_empty": 1}
