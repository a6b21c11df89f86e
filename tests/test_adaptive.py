"""Adaptive chunking (issue 13): merging ready chunks into one dispatch unit never changes the answer.

The master cuts chunks of ``chunk_instants`` as instants close and, when several
wait for a worker, sends consecutive ones as one merged chunk
(``chunking.chunker.merge_chunks``), then splits the reply back per chunk
(``split_result``).  Here the merge decisions are random: random unit sizes at
every dispatch, input closed at random instants between dispatches (so chunks
are cut while others are in flight and running states travel between them),
units answered in a random order by 1-3 Spark engines (sharing on or off, ROWS
pruning as on the wire or not), some failing and retried, some taken back from
a worker that "vanished" and answered late anyway.  What the master releases
per query must equal the reference evaluator on every instant, failures
included (the same failing instant).

Plus plain checks of the pieces: merged chunks carry the first chunk's legacy,
``prev_instant`` and state; split results put rows, states and failures in the
right chunk; the dispatcher's credits and its reading of external load.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata.chunking.chunker import Chunker, merge_chunks, split_result
from strata.chunking.model import ChunkResult
from strata.config import parse_config
from strata.master.core import MasterCore
from strata.master.dispatch import Dispatcher
from strata.mlscql import compile_query

from .distributed import assert_outcome, draw_case, executors_of, released
from .strategies import example_settings
from .tables import inputs_of, vitals

EXAMPLES, SETTINGS = example_settings("STRATA_ADAPTIVE_EXAMPLES", 25)

#: this module's ledger config (the ``ledger`` fixture of conftest.py): Trades only
LEDGER_TOML = """
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.Trades]
acct = "string"
qty = "long"
px = "double"
at = "timestamp"
"""


# ---- the differential property ------------------------------------------------------------------
class _Harness:
    """Drives a MasterCore as the dispatch loop and the workers would, with random decisions."""

    def __init__(self, core: MasterCore, executors, compiled: dict, rnd: random.Random, prune: bool,
                 fail: float, vanish: float):
        self.core, self.executors, self.compiled, self.rnd = core, executors, compiled, rnd
        self.prune, self.fail, self.vanish = prune, fail, vanish
        self.in_flight: list = []  # (unit chunk, sid)
        self.stale: list = []  # units taken back from a vanished worker, answered late
        self.units = self.merged = 0

    def dispatch(self) -> None:
        for chunk, sid in self.core.assignments():
            self.units += 1
            self.merged += len(self.core._units.get(chunk.chunk_id, ())) > 1
            self.in_flight.append((chunk, sid))

    def answer(self, chunk, sid, late: bool = False) -> None:
        sent = chunk
        if self.prune:
            from strata.chunking.prune import prune_chunk

            sent = prune_chunk(chunk, self.compiled)
        ex = self.executors[self.rnd.randrange(len(self.executors))]
        results = ex.run(self.compiled, sent.queries)
        for qc, r in zip(sent.queries, results):
            assert r.query_id == qc.query_id and r.chunk_id == chunk.chunk_id
        span = (chunk.first_ts, chunk.last_ts)
        # the real dispatch loop always names the span; without it a late reply must fit one chunk
        self.core.on_result(chunk.chunk_id, sid, results, span=span if late or self.rnd.random() < 0.8 else None)

    def step(self) -> None:
        self.dispatch()
        self.rnd.shuffle(self.in_flight)
        n = self.rnd.randint(0, len(self.in_flight))
        for chunk, sid in self.in_flight[:n]:
            roll = self.rnd.random()
            if roll < self.fail:  # an error reply: one failed attempt, the chunks go back
                self.core.on_failure(chunk.chunk_id, sid, reason="boom", kind="UNKNOWN")
            elif roll < self.fail + self.vanish:  # the worker vanished: all its units go back
                self.core.on_failure(chunk.chunk_id, sid, drop_worker=True)
                gone = [x for x in self.in_flight[n:] if x[1] == sid]
                self.stale += [(chunk, sid)] + gone
                self.in_flight[n:] = [x for x in self.in_flight[n:] if x[1] != sid]
                self.core.heartbeat(sid, 0.0)
            else:
                self.answer(chunk, sid)
        del self.in_flight[:n]
        if self.stale and self.rnd.random() < 0.5:
            chunk, sid = self.stale.pop(self.rnd.randrange(len(self.stale)))
            self.answer(chunk, sid, late=True)

    def drain(self) -> None:
        for _ in range(10_000):
            self.dispatch()
            if not self.in_flight and not self.core._ready and not self.core.pipeline.chunks:
                return
            self.step()
        raise AssertionError("the master never drained")


def _run(config, level, texts, streams, executors, k, rnd, prune, fail, vanish):
    core = MasterCore(config, level, chunk_instants=k, max_in_flight=rnd.randint(1, 3), chunk_retries=10**6)
    sizes = []
    greedy = rnd.random() < 0.5  # half the examples merge everything that is ready

    def random_size(ready: int, free: int) -> int:
        n = ready if greedy else rnd.choice([1, ready, ready, rnd.randint(1, max(1, ready)), -(-ready // max(1, free))])
        sizes.append(n)
        return n

    core._unit_size = random_size  # the decision under test: any merge must give the same answer
    core.max_unit_rows = rnd.choice([10**9, 10**9, 10**9, 5])
    for w in range(rnd.randint(1, 3)):
        core.heartbeat(f"w{w}", 0.0)
    regs = core.register("ana", texts)
    compiled = dict(core.pipeline.queries)
    h = _Harness(core, executors, compiled, rnd, prune, fail, vanish)
    tables = inputs_of(config, streams)
    instants = sorted({r["ts"] for rows in streams.values() for r in rows})
    sent = {s: 0 for s in tables}
    for tau in instants:
        if rnd.random() < 0.7 and tau != instants[-1]:
            continue
        for s, t in tables.items():  # everything up to tau, in one or two batches
            ts = t.column("ts").to_pylist()
            end = sum(1 for x in ts if x <= tau)
            if end > sent[s]:
                cut = rnd.randint(sent[s], end)
                for a, b in ((sent[s], cut), (cut, end)):
                    if b > a:
                        core.ingest(s, t.slice(a, b - a), None)
                sent[s] = end
        core.advance(upto_ts=tau)
        for _ in range(rnd.choice([0, 0, 1, 2])):
            h.step()
    core.advance(finish=True)
    h.drain()
    while h.stale:  # late replies after everything was released: ignored
        h.answer(*h.stale.pop(), late=True)
    event(f"units merged: {'some' if h.merged else 'none'}")
    return released(core, regs)


def _check(config, engines, data, n_queries, extremes: float = 0.0):
    level, texts, streams = draw_case(data, config, n_queries, extremes, max_instants=10)
    k = data.draw(st.sampled_from([1, 1, 2, 3]), label="chunk_instants")
    n = data.draw(st.integers(1, 3), label="engines")
    sharing = data.draw(st.booleans(), label="sharing")
    prune = data.draw(st.booleans(), label="prune ROWS windows as on the wire")
    fail = data.draw(st.sampled_from([0.0, 0.0, 0.15]), label="error replies")
    vanish = data.draw(st.sampled_from([0.0, 0.0, 0.1]), label="vanishing workers")
    rnd = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    out = _run(config, level, texts, streams, executors_of(engines, config, n, sharing), k, rnd, prune, fail, vanish)
    for i, text in enumerate(texts):
        expected = assert_outcome(text, config, level, streams, out[f"q{i + 1}"])
        event("query fails" if expected.error else "query does not fail")


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_battlefield_random_merges_equal_reference(battlefield, engines, data):
    _check(battlefield, engines, data, n_queries=data.draw(st.integers(1, 3), label="n_queries"))


@pytest.mark.spark
@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_chinese_wall_random_merges_equal_reference(chinese_wall, engines, data):
    _check(chinese_wall, engines, data, n_queries=data.draw(st.integers(1, 2), label="n_queries"))


@pytest.mark.spark
@settings(SETTINGS, max_examples=max(5, EXAMPLES // 2))
@given(data=st.data())
def test_failing_queries_fail_at_the_same_instant_whatever_the_merges(ledger, engines, data):
    """64-bit values near the limits: queries fail at various instants, inside merged units too."""
    _check(ledger, engines, data, n_queries=data.draw(st.integers(1, 3), label="n_queries"), extremes=0.6)


# ---- the pieces, plainly --------------------------------------------------------------------------
def test_merged_chunk_is_the_first_legacy_then_every_new_tuple(battlefield):
    texts = {"q1": "SELECT COUNT(*) FROM Vitals [ROWS 2]",
             "q2": "ISTREAM(SELECT bp FROM Vitals [RANGE 2 seconds])",
             "q3": "SELECT SUM(bp) FROM Vitals"}
    ch = Chunker(battlefield, {q: compile_query(t, battlefield, "S") for q, t in texts.items()})
    ch.push("Vitals", vitals([1, 1, 2, 3, 3, 5], bp=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    first = ch.close(1)
    rest = ch.close(5)
    assert [c.chunk_id for c in rest] == [2, 3, 5]  # no visible instant at 4: nothing cut
    m = merge_chunks(rest)
    assert (m.chunk_id, m.first_ts, m.last_ts) == (2, 2, 5)
    for qc in m.queries:
        head = rest[0].queries[[q.query_id for q in rest[0].queries].index(qc.query_id)]
        assert qc.instants == [2, 3, 5] and qc.prev_instant == head.prev_instant == 1
        assert (qc.state, qc.state_upto) == (head.state, head.state_upto)
        bp = qc.items[0].column("bp").to_pylist()
        legacy = head.items[0].column("bp").to_pylist()[:-1]  # chunk 2's legacy, then its new tuple 3.0
        assert bp == legacy + [3.0, 4.0, 5.0, 6.0]
    assert [c.chunk_id for c in first] == [1] and merge_chunks(first) is first[0]


def test_split_result_routes_rows_states_and_failures(battlefield):
    ch = Chunker(battlefield, {"q1": compile_query("SELECT SUM(bp) FROM Vitals", battlefield, "S"),
                               "q2": compile_query("SELECT bp FROM Vitals [NOW level in {U}]", battlefield, "S")})
    ch.push("Vitals", vitals([1, 2, 2, 4], level=["S", "U", "S", "S"]))
    parts = ch.close(4)
    assert [c.chunk_id for c in parts] == [1, 2, 4]
    rows = pa.table({"ts": pa.array([1, 2, 4], pa.int64()), "level": ["S", "S", "S"], "s": [1.0, 3.0, 6.0]})
    state = pa.table({"s": [6.0]})
    got = split_result(ChunkResult("q1", 1, rows, state, 5), parts)  # a state claiming the unit's end
    assert sorted(got) == [1, 2, 4]
    assert [got[c].rows.column("ts").to_pylist() for c in (1, 2, 4)] == [[1], [2], [4]]
    assert got[4].state is state and got[4].state_upto == 4 and got[1].state is None
    # q2 is only in chunk 2: one result, and a failure inside the unit stops the query there
    only = split_result(ChunkResult("q2", 1, rows.slice(1, 1), None, None), parts)
    assert list(only) == [2]
    failed = split_result(ChunkResult("q1", 1, rows.slice(0, 1), error="integer overflow", error_ts=2), parts)
    assert sorted(failed) == [1, 2] and failed[2].error_ts == 2 and failed[2].rows.num_rows == 0
    assert failed[1].error is None and failed[1].rows.column("ts").to_pylist() == [1]
    assert split_result(ChunkResult("q1", 1, rows.slice(0, 0), error="x", error_ts=1), parts[1:]) == {}


def test_backlog_is_spread_over_workers_and_paced_chunks_go_alone(battlefield):
    core = MasterCore(battlefield, "S", split_rows=0)  # every backlog worth splitting (see the next test)
    core.heartbeat("w1", 0.0, slots=2)
    core.heartbeat("w2", 0.0, slots=2)
    core.register("ana", ["SELECT AVG(bp) FROM Vitals [ROWS 100]"])
    core.ingest("Vitals", vitals(list(range(1, 11))), None)
    core.advance(upto_ts=10)  # ten ready chunks, two workers: one job of 5 instants each
    sent = core.assignments()
    assert [(c.first_ts, c.last_ts) for c, _ in sent] == [(1, 5), (6, 10)]
    assert sorted(s for _, s in sent) == ["w1", "w2"]
    assert core.assignments() == []  # nothing left
    c, sid = sent[0]
    res = [ChunkResult(qc.query_id, c.chunk_id, pa.table({"ts": pa.array(qc.instants, pa.int64())}))
           for qc in c.queries]
    released = core.on_result(c.chunk_id, sid, res, span=(c.first_ts, c.last_ts))
    assert [(r.chunk_id, r.rows.column("ts").to_pylist()) for r in released] == [(k, [k]) for k in range(1, 6)]
    core.ingest("Vitals", vitals([11]), None)
    core.advance(upto_ts=11)  # paced: one new chunk, a free slot: it goes at once, alone
    assert [(c.first_ts, c.last_ts, s) for c, s in core.assignments()] == [(11, 11, sid)]
    assert core.timings.summary().get("merged_max") == 5.0
    core.ingest("Vitals", vitals(list(range(12, 20))), None)
    core.advance(upto_ts=19)  # a backlog of 8, a free slot on each worker: one share (8 / 2) each
    assert [(c.first_ts, c.last_ts) for c, _ in core.assignments()] == [(12, 15), (16, 19)]
    core.ingest("Vitals", vitals(list(range(20, 28))), None)
    core.advance(upto_ts=27)  # a backlog of 8 while every slot is busy
    assert core.assignments() == []
    c, sid = sent[1]
    core.on_result(c.chunk_id, sid, [], span=(c.first_ts, c.last_ts))
    # the freed slot takes its worker's share of the backlog, not all of it
    assert [(c.first_ts, c.last_ts) for c, _ in core.assignments()] == [(20, 23)]


@pytest.mark.parametrize("per_instant,split_rows,units", [(3, 100_000, 1), (3, 4, 2), (200, 150, 2), (200, 10_000, 1)])
def test_a_backlog_is_split_only_when_its_pruned_rows_outweigh_a_job(battlefield, per_instant, split_rows, units):
    """ROWS 2 keeps two rows per instant once pruned: ten instants of a 3-row-per-instant backlog are
    20 rows, one job on one worker unless a share of 4 rows is worth a job; RANGE keeps every row."""
    core = MasterCore(battlefield, "S", split_rows=split_rows)
    core.heartbeat("w1", 0.0, slots=2)
    core.heartbeat("w2", 0.0, slots=2)
    q = "SELECT AVG(bp) FROM Vitals [ROWS 2]" if per_instant == 3 else "SELECT AVG(bp) FROM Vitals [RANGE 2 SECONDS]"
    core.register("ana", [q])
    core.ingest("Vitals", vitals([t for t in range(1, 11) for _ in range(per_instant)]), None)
    core.advance(upto_ts=10)
    sent = core.assignments()
    assert len(sent) == units
    assert [(c.first_ts, c.last_ts) for c, _ in sent] == ([(1, 10)] if units == 1 else [(1, 5), (6, 10)])


def test_the_unit_row_cap_counts_the_legacy_once(battlefield):
    """A merged unit carries the first chunk's legacy and every chunk's new tuples: RANGE chunks of 10
    new tuples and up to 20 legacy ones make a 10-instant unit of 100 rows, within a cap of 120 (the
    sum of the chunks' own rows, ~270, would have cut it after four)."""
    core = MasterCore(battlefield, "S", max_unit_rows=120)
    core.heartbeat("w1", 0.0, slots=1)
    core.register("ana", ["SELECT COUNT(*) FROM Vitals [RANGE 3 SECONDS]"])
    core.ingest("Vitals", vitals([t for t in range(1, 11) for _ in range(10)]), None)
    core.advance(upto_ts=10)
    [(c, _)] = core.assignments()
    assert (c.first_ts, c.last_ts) == (1, 10) and c.num_rows == 100
    core2 = MasterCore(battlefield, "S", max_unit_rows=60)  # the cap still holds: 60 rows at most
    core2.heartbeat("w1", 0.0, slots=1)
    core2.register("ana", ["SELECT COUNT(*) FROM Vitals [RANGE 3 SECONDS]"])
    core2.ingest("Vitals", vitals([t for t in range(1, 11) for _ in range(10)]), None)
    core2.advance(upto_ts=10)
    [(c, _)] = core2.assignments()
    assert (c.first_ts, c.last_ts) == (1, 6) and c.num_rows <= 60


def test_chunks_travel_with_the_columns_their_queries_read(battlefield):
    """``prune_chunk`` cuts every table to ts, level and the attributes some query of the chunk reads
    (the same columns for all, so equal tables stay equal for sharing), plus the arrival order
    ``_seq`` only when a query of the chunk has a ROWS window (the engine orders by it in Spark)."""
    from strata.chunking.prune import prune_chunk, used_columns

    texts = {"q1": "SELECT sid, AVG(bp) FROM Vitals [RANGE 2 SECONDS] GROUP BY sid",
             "q2": "SELECT COUNT(*) FROM Vitals [PARTITION BY sid ROWS 2] WHERE pr > 0"}
    cqs = {q: compile_query(t, battlefield, "S") for q, t in texts.items()}
    assert used_columns(cqs["q1"].query) == {"sid", "bp"}
    assert used_columns(cqs["q2"].query) == {"sid", "pr"}
    star = compile_query("SELECT * FROM Vitals [ROWS 2]", battlefield, "S")
    assert used_columns(star.query) == {"sid", "bp", "pr", "weight"}  # the compiler spells * out
    for qs, want in ((["q1"], {"ts", "level", "sid", "bp"}),
                     (["q1", "q2"], {"ts", "level", "sid", "bp", "pr", "_seq"})):
        ch = Chunker(battlefield, {q: cqs[q] for q in qs})
        ch.push("Vitals", vitals([1, 1, 2, 3]))
        chunks = ch.close(3)
        for c in chunks:
            sent = prune_chunk(c, cqs)
            for qc in sent.queries:
                for t in qc.items:
                    assert {n.lower() for n in t.column_names} == want
                    assert "weight" not in t.column_names
                    if "_seq" not in want:  # rows stay in arrival order without it
                        assert t.column("ts").to_pylist() == sorted(t.column("ts").to_pylist())


def test_a_failed_chunk_travels_alone_and_is_given_up_alone(battlefield):
    core = MasterCore(battlefield, "S", chunk_retries=2)
    core.heartbeat("w1", 0.0, slots=1)
    q = core.register("ana", ["SELECT COUNT(*) FROM Vitals [NOW]"])[0].query_id
    core.ingest("Vitals", vitals([1, 2, 3]), None)
    core.advance(upto_ts=3)
    [(c, sid)] = core.assignments()
    assert (c.first_ts, c.last_ts) == (1, 3)
    core.on_failure(c.chunk_id, sid, reason="boom", kind="INTERNAL")  # every chunk of it: attempt 1
    for want in (1, 2):  # each alone now: chunk 1 delivers, chunk 2 fails again and is given up
        [(c, sid)] = core.assignments()
        assert (c.first_ts, c.last_ts) == (want, want)
        if want == 2:
            core.on_failure(c.chunk_id, sid, reason="boom", kind="INTERNAL")
        else:
            core.on_result(c.chunk_id, sid, [ChunkResult(q, c.chunk_id, pa.table({"ts": pa.array([want], pa.int64())}))],
                           span=(c.first_ts, c.last_ts))
    info = core.queries[q]
    assert info.state == "failed" and "instants 2 failed 2 times" in info.error
    assert [t for r in info.results for t in r.rows.column("ts").to_pylist()] == [1]
    assert core.failed_chunks == 1
    assert core.assignments() == [] and not core.pipeline.chunks  # chunk 3 had only the stopped query


def test_credits_and_external_load():
    d = Dispatcher(own_window=1.0)
    d.heartbeat("a", 0.0, now=0.0, slots=2)
    d.assign(1, "a", now=0.0)
    d.heartbeat("a", 100.0, now=0.5, slots=2)  # its own chunk keeps it busy: not Algorithm 5's business
    assert d.pick() == "a" and d.free_slots() == 1
    d.assign(2, "a", now=0.5)
    assert d.pick() is None  # no credit left
    d.complete(1, now=0.6)
    d.complete(2, now=0.7)
    d.heartbeat("a", 100.0, now=0.8, slots=2)  # the same reading again: still its own work
    d.heartbeat("a", 95.0, now=1.2, slots=2)  # covers the time it worked for us: still its own
    assert d.pick() == "a"
    d.heartbeat("a", 97.0, now=2.0, slots=2)  # idle for us for a while and still loaded: something else
    assert d.pick() is None and d.pick(starving=True) == "a"
    d.heartbeat("b", 10.0, now=2.0, slots=1)
    assert d.pick(starving=True) == "b"  # a worker below the threshold always wins
    d.heartbeat("a", 5.0, now=2.5, slots=3)
    assert d.free_slots() == 4 and d.pick() == "a"  # most free slots first
    d.heartbeat("a", 5.0, now=3.0, slots=0)  # a worker that takes nothing now
    assert d.pick() == "b"


def test_a_merged_unit_that_runs_out_of_time_goes_back_uncounted_in_halves(battlefield):
    now = [0.0]
    core = MasterCore(battlefield, "S", clock=lambda: now[0], chunk_deadline=10.0)
    core.heartbeat("w1", 0.0, slots=1)
    core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 2]"])
    core.ingest("Vitals", vitals(list(range(1, 9))), None)
    core.advance(upto_ts=8)
    [(c, sid)] = core.assignments()
    assert (c.first_ts, c.last_ts) == (1, 8) and core.deadline(c.chunk_id) == 10.0 * (1 + 0.25 * 7)
    now[0] += 20.0
    core.heartbeat("w1", 0.0, slots=1)
    assert core.expire() == []  # one chunk would be overdue by now, eight merged are not
    now[0] += 10.0
    core.heartbeat("w1", 0.0, slots=1)
    assert core.expire() == [1]
    assert core._attempts == {} and core.failed_chunks == 0  # a timeout of a merged unit blames no chunk
    [(c, sid)] = core.assignments()
    assert (c.first_ts, c.last_ts) == (1, 4)  # half as large


# ---- the user's path: replay/ingest close instants as they complete ----------------------------------
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 7), min_size=1, max_size=12), gaps=st.lists(st.integers(1, 4000), max_size=12),
       other=st.integers(0, 3), rows=st.integers(1, 9), hidden=st.integers(0, 12))
def test_instant_batches_close_only_complete_instants(battlefield, sizes, gaps, other, rows, hidden):
    """The batches are the input in order; every advance closes only instants whose tuples were all
    sent (across both streams), never more than the horizon past the latest kept instant."""
    from strata.commands import instant_batches

    ts, t = [], 0
    for i, n in enumerate(sizes):
        t += gaps[i] if i < len(gaps) else 1
        ts += [t] * n
    if not ts:
        ts = [1]
    levels = ["TS" if i < hidden else "U" for i in range(len(ts))]  # the first rows invisible at S
    vit = vitals(ts, level=levels)
    pos_ts = ts[::max(1, len(ts) // max(1, other))] if other else []
    pos = pa.table({"ts": pa.array(pos_ts, pa.int64()), "level": ["C"] * len(pos_ts), "sid": ["a"] * len(pos_ts),
                    "lat": [1.0] * len(pos_ts), "lon": ["E"] * len(pos_ts)})
    inputs = [("Vitals", vit), ("Positions", pos)]
    out = list(instant_batches(battlefield, inputs, "S", rows=rows))
    for name, table in inputs:
        got = [b for s, b, _ in out if s == name and b is not None]
        assert (pa.concat_tables(got).column("ts").to_pylist() if got else []) == table.column("ts").to_pylist()
    sent_max, kept_max, last_adv = {}, -1, None
    for k, (s, b, upto) in enumerate(out):
        assert b is None or b.num_rows <= rows
        if b is not None and b.num_rows:
            sent_max[s] = max(b.column("ts").to_pylist())
            vis = [x for x, lv in zip(b.column("ts").to_pylist(), b.column("level").to_pylist()) if lv != "TS"]
            kept_max = max([kept_max] + vis)
        if upto is None:
            continue
        later = [x for s2, b2, _ in out[k + 1:] if b2 is not None for x in b2.column("ts").to_pylist()]
        assert not later or upto < min(later)  # nothing sent later is in a closed instant
        assert upto <= max(kept_max, 0) + battlefield.limits.advance_horizon
        assert last_adv is None or upto > last_adv
        last_adv = upto


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.sampled_from(["U", "C", "S", "TS", " S ", "bogus", None]), max_size=30),
       at=st.sampled_from(["U", "C", "S", "TS"]))
def test_drop_above_leaves_out_exactly_what_the_shepherd_drops(battlefield, levels, at):
    """Replay and labelled ingest leave out the rows the master's shepherd would drop on arrival, and
    only those: every other row (an unknown or missing level too: the master names it) is sent, in
    order; the count is what the producer is told."""
    from strata.commands import drop_above
    from strata.master.shepherd import Shepherd

    vit = vitals(list(range(len(levels))), level=levels)
    vit = vit.set_column(1, "level", pa.array(levels, pa.string()))
    (stream, kept), = drop_above(battlefield, [("Vitals", vit)], at)[0]
    n = drop_above(battlefield, [("Vitals", vit)], at)[1]
    lat = battlefield.lattice

    def above(x):
        try:
            return x is not None and not lat.leq(lat.parse(x), at)
        except ValueError:
            return False

    assert stream == "Vitals" and n == sum(map(above, levels))
    assert kept.column("ts").to_pylist() == [i for i, x in enumerate(levels) if not above(x)]
    if all(x is not None and not above(x) and x != "bogus" for x in levels) and levels:
        assert Shepherd(lat, at).filter(kept)[1] == 0  # nothing left for the shepherd to drop


def test_embedded_clusters_honour_the_configured_load_reading():
    from strata.deploy.local import embedded_load_reading
    from strata.examples import BATTLEFIELD_TOML

    assert embedded_load_reading(parse_config(BATTLEFIELD_TOML)) == "process"
    assert embedded_load_reading(parse_config(BATTLEFIELD_TOML + '\n[cluster]\nload_reading = "host"\n')) == "host"


def test_embedded_workers_start_one_after_the_other_only_on_few_cores(monkeypatch):
    from strata.deploy.local import embedded_start

    monkeypatch.delenv("STRATA_WORKERS_START", raising=False)
    staggered = {"wait": "first", "stagger": True, "lazy": True}
    together = {"wait": "all", "stagger": False, "lazy": False}
    assert embedded_start(2, cores=2) == staggered  # two JVMs starting at once fight for 2 cores
    assert embedded_start(2, cores=3) == staggered
    assert embedded_start(2, cores=4) == together
    assert embedded_start(3, cores=8) == together
    assert embedded_start(1, cores=1) == together  # nothing to stagger


def test_the_embedded_start_can_be_chosen(monkeypatch):
    from strata.deploy.local import embedded_start

    monkeypatch.setenv("STRATA_WORKERS_START", "together")
    assert embedded_start(2, cores=2) == {"wait": "all", "stagger": False, "lazy": False}
    monkeypatch.setenv("STRATA_WORKERS_START", "staggered")
    assert embedded_start(2, cores=2) == {"wait": "first", "stagger": True, "lazy": False}
    monkeypatch.setenv("STRATA_WORKERS_START", "")
    assert embedded_start(2, cores=2)["lazy"]


def test_a_lazy_worker_starts_once_the_run_has_lasted_as_long_as_the_start_up_before_it():
    from strata.worker.main import lazy_wait

    # processes started at 100; the previous worker was ready at 109 (a 9 s start-up): start at 118
    assert lazy_wait(109.0, 100.0, now=109.2) == pytest.approx(8.8)
    assert lazy_wait(109.0, 100.0, now=118.0) == 0.0
    assert lazy_wait(109.0, 100.0, now=130.0) == 0.0  # noticed late: at once
    assert lazy_wait(99.0, 100.0, now=100.0) == 0.0  # a ready file older than this process: no wait


def test_workers_ready_after_reads_the_ready_files(tmp_path):
    import os

    from strata.deploy.local import workers_ready_after

    ready, later = tmp_path / "w0.json", tmp_path / "w1.json"
    ready.write_text("{}")
    os.utime(ready, (1000.0 + 9.5, 1000.0 + 9.5))
    started = {"worker_ready_files": [str(ready), str(later)], "started_at": 1000.0}
    assert workers_ready_after(started) == [9.5, None]  # the second one was not ready (yet)
    assert workers_ready_after({}) == []


def test_fast_input_gathers_for_one_job_time_paced_input_goes_after_a_probe(battlefield):
    now = [0.0]
    core = MasterCore(battlefield, "S", clock=lambda: now[0], linger=True)  # chunk period 1 s
    probe = core.PROBE_SECONDS
    core.heartbeat("w1", 0.0, slots=2)
    core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 2]"])
    core.ingest("Vitals", vitals([1]), None)
    core.advance(upto_ts=1)
    assert core.assignments() == []  # a lone advance: held for the probe, in case more follows
    now[0] += probe * 1.01
    assert [(c.first_ts, c.last_ts) for c, _ in core.assignments()] == [(1, 1)]  # none did: it goes
    now[0] += 1.0
    core.on_result(1, "w1", [], span=(1, 1))
    assert core.job_seconds == pytest.approx(1.0) and core.linger_seconds() == 1.0
    for t in range(2, 8):  # an advance every 0.1 s: input arrives faster than a job takes
        now[0] += 0.1
        core.ingest("Vitals", vitals([t]), None)
        core.advance(upto_ts=t)
        assert core.assignments() == []  # the first after a pause: the probe; then gathering
    now[0] += 0.35
    assert core.assignments() == []  # chunk 2 has waited 0.85 s, the input may still be flowing
    now[0] += 0.2  # ... now it has waited one job's time: its share of the backlog goes
    sent = core.assignments()
    assert [(c.first_ts, c.last_ts) for c, _ in sent] == [(2, 7)]  # one worker: the backlog is its share
    assert core.assignments() == []  # a free slot, nothing ready
    now[0] += 2.0
    for c, sid in sent:
        core.on_result(c.chunk_id, sid, [], span=(c.first_ts, c.last_ts))
    core.ingest("Vitals", vitals([8]), None)
    core.advance(upto_ts=8)  # paced: long after the previous advance, it waits for the probe only
    assert core.assignments() == []
    now[0] += probe * 1.01
    sent = core.assignments()
    assert [(c.first_ts, c.last_ts) for c, _ in sent] == [(8, 8)]
    for c, sid in sent:
        core.on_result(c.chunk_id, sid, [], span=(c.first_ts, c.last_ts))
    now[0] += 0.1
    core.ingest("Vitals", vitals([9]), None)
    core.advance(finish=True)  # quick, but a finished input is never held
    assert [(c.first_ts, c.last_ts) for c, _ in core.assignments()] == [(9, 9)]
