"""Input chunk construction (dissertation Def. 13, Table 7.1; SEMANTICS §5-6) and its wire format."""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunking import (
    Chunk,
    Chunker,
    ChunkingError,
    ChunkResult,
    LegacyMode,
    QueryChunk,
    decode_chunk,
    decode_result,
    encode_chunk,
    encode_result,
    legacy_mode,
    stream_schema,
)
from strata.mlscql.analyze import compile_query

from .tables import counting, in_turn
from .tables import vitals as _vitals

LEVELS = ["U", "C", "S", "TS"]


# ---------------------------------------------------------------------------
# helpers

#: this module's Vitals tuples: level U, sids s0, s1, s2 in turn, bp numbering them (so tests can identify
#: rows), weight 2.0
vitals = partial(_vitals, level="U", sid=in_turn("s0", "s1", "s2"), weight=2.0)


def positions(ts, n, level="U"):
    return pa.table(
        {
            "ts": pa.array([ts] * n, pa.int64()),
            "level": [level] * n,
            "sid": ["p"] * n,
            "lat": [0.5] * n,
            "lon": ["x"] * n,
        }
    )


def by_ts(t: pa.Table, before: int | None = None) -> dict[int, int]:
    """Row counts per source instant (optionally only rows with ts < before)."""
    ts = t.column("ts").to_pylist()
    return dict(sorted(Counter(x for x in ts if before is None or x < before).items()))


def qchunk(chunks: list[Chunk], qid: str) -> dict[int, QueryChunk]:
    return {c.chunk_id: q for c in chunks for q in c.queries if q.query_id == qid}


def legacy_of(qc: QueryChunk, i: int) -> dict[int, int]:
    return by_ts(qc.items[i], before=qc.instants[0])


# ---------------------------------------------------------------------------
# (a) dissertation Table 7.1


@pytest.fixture
def table71(battlefield):
    qs = {
        "Qa": compile_query("SELECT AVG(bp) FROM Vitals[ROWS 100]", battlefield, "U"),
        "Qb": compile_query("SELECT RSTREAM bp FROM Vitals[RANGE 2 seconds]", battlefield, "U"),
        "Qb_i": compile_query("SELECT bp FROM Vitals[RANGE 2 seconds]", battlefield, "U"),
        "Qc": compile_query("SELECT * FROM Vitals[ROWS 80], Positions[ROWS 80]", battlefield, "U"),
    }
    ch = Chunker(battlefield, qs, chunk_instants=1)
    out = []
    for ts, nv, np_ in [(1, 200, 50), (2, 50, 30), (3, 40, 10), (4, 70, 80)]:
        ch.push("Vitals", vitals([ts] * nv))
        ch.push("Positions", positions(ts, np_))
        out += ch.close(ts)
    return ch, out


def test_table_7_1_chunks(table71):
    _, out = table71
    assert [c.chunk_id for c in out] == [1, 2, 3, 4]
    assert [(c.first_ts, c.last_ts) for c in out] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    for c in out:
        assert sorted(q.query_id for q in c.queries) == ["Qa", "Qb", "Qb_i", "Qc"]
        for q in c.queries:
            assert q.instants == [c.chunk_id]
            assert q.prev_instant == (None if c.chunk_id == 1 else c.chunk_id - 1)


def test_table_7_1_qa(table71):
    _, out = table71
    qa = qchunk(out, "Qa")
    assert [legacy_of(qa[t], 0) for t in (1, 2, 3, 4)] == [{}, {1: 100}, {1: 50, 2: 50}, {1: 10, 2: 50, 3: 40}]
    # I_V = legacy + new
    assert [qa[t].items[0].num_rows for t in (1, 2, 3, 4)] == [200, 150, 140, 170]
    # the legacy is the *last* N: V1(10) at ts=4 are tuples 190..199 of ts 1
    leg = qa[4].items[0].filter(pa.compute.equal(qa[4].items[0]["ts"], 1))
    assert leg["bp"].to_pylist() == [float(x) for x in range(190, 200)]


def test_table_7_1_qb(table71):
    _, out = table71
    qb = qchunk(out, "Qb")
    assert [legacy_of(qb[t], 0) for t in (1, 2, 3, 4)] == [{}, {1: 200}, {2: 50}, {3: 40}]
    assert [qb[t].items[0].num_rows for t in (1, 2, 3, 4)] == [200, 250, 90, 110]
    # ISTREAM form: the window at τ' (τ'-2 < ts ≤ τ') is in the legacy too
    qi = qchunk(out, "Qb_i")
    assert [legacy_of(qi[t], 0) for t in (1, 2, 3, 4)] == [{}, {1: 200}, {1: 200, 2: 50}, {2: 50, 3: 40}]


def test_table_7_1_qc(table71):
    _, out = table71
    qc = qchunk(out, "Qc")
    assert [legacy_of(qc[t], 0) for t in (1, 2, 3, 4)] == [{}, {1: 80}, {1: 30, 2: 50}, {2: 40, 3: 40}]
    # The printed Table 7.1 gives P1(50)+P2(30)+P3(10) at ts=4, i.e. 90 > 80 tuples: a misprint.
    # The last 80 Positions tuples before ts=4 are P1(40)+P2(30)+P3(10) (SEMANTICS §7).
    assert [legacy_of(qc[t], 1) for t in (1, 2, 3, 4)] == [{}, {1: 50}, {1: 50, 2: 30}, {1: 40, 2: 30, 3: 10}]
    assert [(qc[t].items[0].num_rows, qc[t].items[1].num_rows) for t in (1, 2, 3, 4)] == [
        (200, 50), (130, 80), (120, 90), (150, 160)
    ]


def test_item_columns_and_seq(table71, battlefield):
    _, out = table71
    q = qchunk(out, "Qc")[3]
    assert q.items[0].schema == stream_schema(battlefield.streams["Vitals"])
    assert q.items[0].column_names == ["_seq", "ts", "level", "sid", "bp", "pr", "weight"]
    assert q.items[1].column_names == ["_seq", "ts", "level", "sid", "lat", "lon"]
    seq = q.items[0]["_seq"].to_pylist()
    assert seq == sorted(seq) and seq[-1] == 200 + 50 + 40 - 1  # arrival index within Vitals
    assert q.items[1]["_seq"].to_pylist()[-1] == 50 + 30 + 10 - 1


def test_table_7_2_rows3_chunks(battlefield):
    """Dissertation Table 7.2: the chunk of ts 2 and ts 3 carry the legacy buffer of ROWS 3."""
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3]", battlefield, "U")
    ch = Chunker(battlefield, {"Qd": cq})
    ch.push("Vitals", pa.table({"ts": [1, 1, 1, 2, 3], "level": ["U"] * 5, "sid": ["AAA", "BBB", "CCC", "DDD", "EEE"],
                                "bp": [125.0, 100.0, 150.0, 110.0, 160.0], "pr": [0.0] * 5, "weight": [0.0] * 5}))
    out = ch.finish()
    q = qchunk(out, "Qd")
    assert q[2].items[0]["sid"].to_pylist() == ["AAA", "BBB", "CCC", "DDD"]
    assert q[3].items[0]["sid"].to_pylist() == ["BBB", "CCC", "DDD", "EEE"]


def test_chunk_length_k(battlefield):
    """K=3: chunk c covers [3c, 3c+2]; instants are the visible ts of the chunk; empty ranges skipped."""
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 2]", battlefield, "U")
    ch = Chunker(battlefield, {"q": cq}, chunk_instants=3)
    for ts in (1, 2, 4, 10, 11):
        ch.push("Vitals", vitals([ts] * 2, bp=counting(10 * ts)))
    assert ch.close(1) == []  # chunk 0 ends at 2
    out = ch.close(5)
    assert [(c.chunk_id, c.first_ts, c.last_ts) for c in out] == [(0, 0, 2), (1, 3, 5)]
    assert out[0].queries[0].instants == [1, 2] and out[0].queries[0].prev_instant is None
    assert out[1].queries[0].instants == [4] and out[1].queries[0].prev_instant == 2
    assert out[1].queries[0].items[0]["bp"].to_pylist() == [20.0, 21.0, 40.0, 41.0]
    out = ch.finish()
    assert [(c.chunk_id, c.first_ts, c.last_ts) for c in out] == [(3, 9, 11)]  # chunk 2 (6..8) is empty
    assert out[0].queries[0].instants == [10, 11] and out[0].queries[0].prev_instant == 4
    with pytest.raises(ChunkingError, match="late"):
        ch.push("Vitals", vitals([11]))


# ---------------------------------------------------------------------------
# (b) level filtering, and a property test against a brute-force reference


def test_invisible_instants_produce_no_chunk(battlefield):
    """SEMANTICS Table 4.2 input: the TS tuple at ts=3 is invisible at level U: no instant 3."""
    qu = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U", battlefield, "U")
    qts = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U", battlefield, "TS")
    ch = Chunker(battlefield, {"u": qu, "ts": qts})
    for ts, lv in [(1, "U"), (2, "U"), (3, "TS"), (4, "U")]:
        ch.push("Vitals", vitals([ts], level=lv))
    out = ch.finish()
    assert [c.chunk_id for c in out] == [1, 2, 3, 4]
    assert [q.query_id for q in out[2].queries] == ["ts"]
    u4 = qchunk(out, "u")[4]
    assert u4.prev_instant == 2 and u4.items[0]["level"].to_pylist() == ["U", "U", "U"]
    ts4 = qchunk(out, "ts")[4]
    assert ts4.items[0]["level"].to_pylist() == ["U", "U", "TS", "U"]


def test_chunk_seen_by_no_query_is_skipped(battlefield):
    cq = compile_query("SELECT bp FROM Vitals[ROWS 1]", battlefield, "U")
    ch = Chunker(battlefield, {"q": cq})
    ch.push("Vitals", vitals([1], level="S"))
    ch.push("Positions", positions(2, 1))
    assert ch.finish() == []
    assert ch.accepted == 2


WINDOWS = st.sampled_from(["ROWS", "RANGE", "NOW", "PARTITION", "UNBOUNDED"])


def _window_text(kind, n, levels):
    lv = "level in {" + ",".join(levels) + "}"
    return {
        "ROWS": f"[ROWS {n} {lv}]",
        "RANGE": f"[RANGE {n} seconds {lv}]",
        "NOW": f"[NOW {lv}]",
        "PARTITION": f"[PARTITION BY sid ROWS {n} {lv}]",
        "UNBOUNDED": f"[RANGE UNBOUNDED {lv}]",
    }[kind]


@st.composite
def scenarios(draw):
    level_sets = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=3, unique=True)
    queries = {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from(["one", "agg", "join"]))
        r2s = draw(st.sampled_from(["ISTREAM", "RSTREAM", "DSTREAM"]))
        w1 = _window_text(draw(WINDOWS), draw(st.integers(1, 4)), draw(level_sets))
        if shape == "one":
            text = f"SELECT {r2s} bp FROM Vitals{w1}"
        elif shape == "agg":
            text = f"SELECT COUNT(*) FROM Vitals{w1}"
        else:
            w2 = _window_text(draw(WINDOWS), draw(st.integers(1, 4)), draw(level_sets))
            other = draw(st.sampled_from(["Positions", "Vitals"]))
            text = f"SELECT {r2s} * FROM Vitals{w1} a, {other}{w2} b"
        queries[f"q{i}"] = text
    k = draw(st.integers(1, 3))
    steps = []
    for ts in range(draw(st.integers(1, 12))):
        for stream in ("Vitals", "Positions"):
            rows = draw(st.lists(st.tuples(st.sampled_from(LEVELS), st.sampled_from(["a", "b", "c"])), max_size=3))
            if rows:
                steps.append(("push", stream, ts, rows))
        if draw(st.booleans()):
            steps.append(("close", ts))
        if draw(st.integers(0, 4)) == 0:
            steps.append(("confirm",))
    return queries, k, steps


def _ref_legacy(v: pd.DataFrame, kind, n, part, r2s, mode, tau_a, prev, state_upto):
    """Reference legacy (Def. 13 / SEMANTICS §6) from the whole visible substream ``v``."""
    old = v[v.ts < tau_a]
    iod = r2s in ("ISTREAM", "DSTREAM") and prev is not None
    if kind == "rows":
        return old.tail(n) if n else old.iloc[:0]
    if kind == "partition":
        return old.groupby(part, sort=False).tail(n) if n else old.iloc[:0]
    if kind == "range":
        lo = (min(tau_a, prev) if iod else tau_a) - n
        return old[old.ts > lo]
    if kind == "now":
        return old[old.ts == prev] if iod else old.iloc[:0]
    if mode is LegacyMode.NONE:
        return old.iloc[:0]
    if mode is LegacyMode.STATE:
        return old if state_upto is None else old[old.ts > state_upto]
    return old


def _window_at(rows: pd.DataFrame, kind, n, part, tau):
    """Contents (set of _seq) of a window at instant tau over ts-sorted rows (SEMANTICS §3)."""
    upto = rows[rows.ts <= tau]
    if kind == "rows":
        w = upto.tail(n) if n else upto.iloc[:0]
    elif kind == "partition":
        w = upto.groupby(part, sort=False).tail(n) if n else upto.iloc[:0]
    elif kind == "range":
        w = upto[upto.ts > tau - n]
    elif kind == "now":
        w = upto[upto.ts == tau]
    else:
        w = upto
    return set(w._seq)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_chunks_match_reference(battlefield, scenario, rnd):
    """Every item holds only visible tuples, exactly the Def. 13 legacy plus the new tuples, and
    every window the worker evaluates (at each instant, and at τ' for ISTREAM/DSTREAM) has the
    same contents as over the whole visible substream."""
    queries, k, steps = scenario
    cqs = {qid: compile_query(text, battlefield, "TS") for qid, text in queries.items()}
    ch = Chunker(battlefield, cqs, chunk_instants=k)
    pushed = {"Vitals": [], "Positions": []}
    seq = {"Vitals": 0, "Positions": 0}
    chunks: list[Chunk] = []
    emitted: list[QueryChunk] = []
    snapshot = {qid: None for qid in cqs}  # what the chunker should hold after confirms

    def do_close(result):
        # the snapshot each query chunk carries is the one confirmed before it was cut
        for c in result:
            for q in c.queries:
                assert q.state_upto == snapshot[q.query_id]
                emitted.append(q)
        chunks.extend(result)

    for step in steps:
        if step[0] == "push":
            _, stream, ts, rows = step
            if stream == "Vitals":
                t = pa.table({"level": [r[0] for r in rows], "ts": [ts] * len(rows), "sid": [r[1] for r in rows],
                              "bp": [1.0] * len(rows), "pr": [1.0] * len(rows), "weight": [1.0] * len(rows)})
            else:
                t = pa.table({"ts": [ts] * len(rows), "level": [r[0] for r in rows], "sid": [r[1] for r in rows],
                              "lat": [1.0] * len(rows), "lon": ["x"] * len(rows)})
            if ts < ch.closed_until:
                with pytest.raises(ChunkingError):
                    ch.push(stream, t)
                continue
            assert ch.push(stream, t) == len(rows)
            for lv, sid in rows:
                pushed[stream].append((seq[stream], ts, lv, sid))
                seq[stream] += 1
        elif step[0] == "close":
            do_close(ch.close(step[1]))
        elif emitted:
            # confirm a random earlier STATE chunk (possibly out of order / stale)
            q = rnd.choice(emitted)
            if legacy_mode(cqs[q.query_id]) is LegacyMode.STATE:
                ok = ch.confirm(ChunkResult(q.query_id, q.chunk_id, pa.table({"x": [1]}),
                                            state=pa.table({"n": [1]}), state_upto=q.instants[-1]))
                newer = snapshot[q.query_id] is None or q.instants[-1] > snapshot[q.query_id]
                assert ok == newer
                if newer:
                    snapshot[q.query_id] = q.instants[-1]
    do_close(ch.finish())

    ids = [c.chunk_id for c in chunks]
    assert ids == sorted(set(ids))
    for qid, cq in cqs.items():
        mode = legacy_mode(cq)
        vis = []
        for f, info in zip(cq.query.from_, cq.items):
            df = pd.DataFrame(pushed[info.stream], columns=["_seq", "ts", "level", "sid"])
            vis.append(df[df.level.isin(f.window.levels)].reset_index(drop=True))
        all_instants = sorted(set().union(*[set(v.ts) for v in vis]))
        got_instants = [t for q in emitted if q.query_id == qid for t in q.instants]
        assert got_instants == all_instants
        for q in (q for q in emitted if q.query_id == qid):
            tau_a, tau_b = q.instants[0], q.instants[-1]
            assert q.chunk_id == tau_a // k == tau_b // k
            before = [t for t in all_instants if t < tau_a]
            assert q.prev_instant == (before[-1] if before else None)
            for i, (f, v) in enumerate(zip(cq.query.from_, vis)):
                w = f.window
                n = w.rows if w.kind in ("rows", "partition") else (int(w.range_amount) if w.kind == "range" else 0)
                item = q.items[i].to_pandas()
                # (b) nothing outside the window's level set
                assert set(item.level) <= set(w.levels)
                new = v[(v.ts >= tau_a) & (v.ts <= q.chunk_id * k + k - 1)]
                leg = _ref_legacy(v, w.kind, n, ["sid"], cq.r2s, mode, tau_a, q.prev_instant, q.state_upto)
                assert list(item._seq) == list(leg._seq) + list(new._seq)
                assert list(item.ts) == list(leg.ts) + list(new.ts)
                if mode in (LegacyMode.NONE, LegacyMode.STATE):
                    continue
                taus = list(q.instants)
                if cq.r2s != "RSTREAM" and q.prev_instant is not None:
                    taus.append(q.prev_instant)
                for tau in taus:
                    assert _window_at(item, w.kind, n, ["sid"], tau) == _window_at(v, w.kind, n, ["sid"], tau)


# ---------------------------------------------------------------------------
# (c) PARTITION BY, NOW, HISTORY, NONE, STATE


def test_partition_legacy(battlefield):
    cq = compile_query("SELECT bp FROM Vitals[PARTITION BY sid ROWS 2]", battlefield, "U")
    ch = Chunker(battlefield, {"q": cq})
    ch.push("Vitals", vitals([1] * 6, sid=["a", "b", "a", "a", "a", "c"]))  # bp 0..5
    ch.push("Vitals", vitals([2], sid=["b"], bp=counting(100)))
    ch.push("Vitals", vitals([3], sid=["c"], bp=counting(200)))
    out = ch.finish()
    q = qchunk(out, "q")
    # last 2 of a (bp 3, 4), of b (bp 1), of c (bp 5), in arrival order, then the new one
    assert q[2].items[0]["bp"].to_pylist() == [1.0, 3.0, 4.0, 5.0, 100.0]
    assert q[3].items[0]["bp"].to_pylist() == [1.0, 3.0, 4.0, 5.0, 100.0, 200.0]
    assert ch.retained("q") == [6]  # a: bp 3, 4; b: bp 1, 100; c: bp 5, 200


def test_partition_by_level(battlefield):
    cq = compile_query("SELECT bp FROM Vitals[PARTITION BY level ROWS 1 level in {U,C}]", battlefield, "S")
    ch = Chunker(battlefield, {"q": cq})
    ch.push("Vitals", vitals([1] * 4, level=["U", "C", "S", "U"]))
    ch.push("Vitals", vitals([2], level="S", bp=counting(10)))  # invisible
    ch.push("Vitals", vitals([3], level="C", bp=counting(20)))
    out = ch.finish()
    q = qchunk(out, "q")
    assert sorted(q) == [1, 3]
    assert q[3].prev_instant == 1
    assert q[3].items[0]["bp"].to_pylist() == [1.0, 3.0, 20.0]


def test_now_legacy(battlefield):
    qi = compile_query("SELECT bp FROM Vitals[NOW]", battlefield, "U")
    qr = compile_query("SELECT RSTREAM bp FROM Vitals[NOW]", battlefield, "U")
    ch = Chunker(battlefield, {"i": qi, "r": qr})
    for ts, n in [(1, 3), (2, 2), (5, 1)]:
        ch.push("Vitals", vitals([ts] * n, bp=counting(10 * ts)))
    out = ch.finish()
    i, r = qchunk(out, "i"), qchunk(out, "r")
    assert [legacy_of(i[t], 0) for t in (1, 2, 5)] == [{}, {1: 3}, {2: 2}]
    assert [legacy_of(r[t], 0) for t in (1, 2, 5)] == [{}, {}, {}]
    assert i[5].prev_instant == 2
    assert ch.retained("i") == [1] and ch.retained("r") == [0]


def test_range_units_and_instant_length(battlefield):
    cfg = dataclasses.replace(battlefield, instant_seconds=30.0)
    cq = compile_query("SELECT RSTREAM bp FROM Vitals[RANGE 1 minutes]", cfg, "U")  # 2 instants
    ch = Chunker(cfg, {"q": cq})
    for ts in (1, 2, 3):
        ch.push("Vitals", vitals([ts]))
    q = qchunk(ch.finish(), "q")
    assert legacy_of(q[3], 0) == {2: 1}
    cq = compile_query("SELECT RSTREAM bp FROM Vitals[RANGE 1500 milliseconds]", battlefield, "U")  # ceil(1.5)=2
    ch = Chunker(battlefield, {"q": cq})
    for ts in (1, 2, 3):
        ch.push("Vitals", vitals([ts]))
    assert legacy_of(qchunk(ch.finish(), "q")[3], 0) == {2: 1}


def test_history_and_none_modes(battlefield):
    qh = compile_query("SELECT RSTREAM bp FROM Vitals", battlefield, "U")
    qn = compile_query("SELECT bp FROM Vitals", battlefield, "U")
    qj = compile_query("SELECT * FROM Vitals v, Positions[ROWS 1] p", battlefield, "U")
    assert legacy_mode(qh) is LegacyMode.HISTORY
    assert legacy_mode(qn) is LegacyMode.NONE
    assert legacy_mode(qj) is LegacyMode.HISTORY
    ch = Chunker(battlefield, {"h": qh, "n": qn, "j": qj})
    for ts in (1, 2, 3):
        ch.push("Vitals", vitals([ts] * 2))
        ch.push("Positions", positions(ts, 2))
        ch.close(ts - 1)
    out = ch.finish()
    h, n, j = qchunk(out, "h"), qchunk(out, "n"), qchunk(out, "j")
    assert legacy_of(h[3], 0) == {1: 2, 2: 2}
    assert legacy_of(n[3], 0) == {} and n[3].items[0].num_rows == 2
    assert legacy_of(j[3], 0) == {1: 2, 2: 2} and legacy_of(j[3], 1) == {2: 1}
    assert ch.retained("n") == [0]
    assert ch.retained("h") == [6]


def _state_result(q: QueryChunk, upto=None, value=0):
    return ChunkResult(q.query_id, q.chunk_id, pa.table({"ts": [q.instants[-1]]}),
                       state=pa.table({"count": [value]}), state_upto=q.instants[-1] if upto is None else upto)


def test_state_mode(battlefield):
    cq = compile_query("SELECT COUNT(*) FROM Vitals", battlefield, "U")
    other = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 2]", battlefield, "U")
    assert legacy_mode(cq) is LegacyMode.STATE
    ch = Chunker(battlefield, {"s": cq, "w": other})
    got = {}
    for ts in (1, 2, 3, 4):
        ch.push("Vitals", vitals([ts] * ts))
        for c in ch.close(ts):
            got.update({q.chunk_id: q for q in c.queries if q.query_id == "s"})
    # no confirm yet: every chunk carries all visible tuples, no state
    assert got[3].state is None and got[3].state_upto is None
    assert by_ts(got[3].items[0]) == {1: 1, 2: 2, 3: 3}
    assert ch.retained("s") == [10]
    # out of order confirms: ts 3 first, then the older ts 2 is ignored
    assert ch.confirm(_state_result(got[3], value=6)) is True
    assert ch.retained("s") == [4]
    assert ch.confirm(_state_result(got[2], value=3)) is False
    assert ch.confirm(_state_result(got[3], value=99)) is False  # re-confirm of the same snapshot
    assert ch.snapshot_upto("s") == 3
    # results of other queries are ignored
    assert ch.confirm(ChunkResult("w", 4, pa.table({"x": [1]}), state=pa.table({"n": [1]}), state_upto=4)) is False
    ch.push("Vitals", vitals([5] * 5))
    q5 = qchunk(ch.close(5), "s")[5]
    assert q5.state_upto == 3 and q5.state.to_pydict() == {"count": [6]}
    assert by_ts(q5.items[0]) == {4: 4, 5: 5}  # ts > state_upto up to the chunk end
    assert q5.prev_instant == 4
    # newer confirm drops retained rows; a snapshot beyond what was emitted is an error
    assert ch.confirm(_state_result(q5, value=15)) is True
    assert ch.retained("s") == [0]
    with pytest.raises(ChunkingError):
        ch.confirm(_state_result(q5, upto=9))
    # K > 1: a state may claim its chunk's last_ts (nothing visible after its last instant)
    ck = Chunker(battlefield, {"s": cq}, chunk_instants=4)
    ck.push("Vitals", vitals([1] * 2))
    ck.push("Vitals", vitals([5]))
    (qa,) = qchunk(ck.close(3), "s").values()
    assert ck.confirm(_state_result(qa, upto=3)) is True
    (qb,) = qchunk(ck.finish(), "s").values()
    assert qb.state_upto == 3 and by_ts(qb.items[0]) == {5: 1}
    # unknown / removed queries are ignored
    ch.remove_query("s")
    assert ch.confirm(_state_result(q5, upto=5)) is False


def test_add_query_later(battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[ROWS 10]", battlefield, "U")
    ch = Chunker(battlefield, {"a": cq})
    ch.push("Vitals", vitals([1] * 3))
    ch.add_query("b", cq)
    ch.push("Vitals", vitals([1] * 2, bp=counting(3)))  # same instant, after b registered
    ch.push("Vitals", vitals([2], bp=counting(5)))
    with pytest.raises(ChunkingError, match="already registered"):
        ch.add_query("b", cq)
    out = ch.finish()
    a, b = qchunk(out, "a"), qchunk(out, "b")
    assert a[1].items[0]["bp"].to_pylist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert b[1].items[0]["bp"].to_pylist() == [3.0, 4.0]
    assert b[2].items[0]["bp"].to_pylist() == [3.0, 4.0, 5.0] and b[2].prev_instant == 1
    ch.remove_query("a")
    assert ch.query_ids == ["b"]


# ---------------------------------------------------------------------------
# (d) validation


def test_accepts_any_column_order_and_castable_types(battlefield):
    cq = compile_query("SELECT * FROM Vitals[ROWS 5]", battlefield, "U")
    ch = Chunker(battlefield, {"q": cq})
    t = pa.table({"bp": pa.array([1, 2], pa.int32()), "weight": ["3.5", "4"], "level": [" U ", "U"],
                  "pr": [1.0, 2.0], "TS": pa.array([3, 3], pa.int32()), "sid": ["a", None]})
    assert ch.push("vitals", t) == 2
    assert ch.accepted == 2
    (c,) = ch.finish()
    item = c.queries[0].items[0]
    assert item.schema == stream_schema(battlefield.streams["Vitals"])
    assert item.to_pydict() == {"_seq": [0, 1], "ts": [3, 3], "level": ["U", "U"], "sid": ["a", None],
                                "bp": [1.0, 2.0], "pr": [1.0, 2.0], "weight": [3.5, 4.0]}


def test_levels_are_canonicalized(chinese_wall):
    cq = compile_query("SELECT * FROM MessageLog[ROWS 3 level in {[0,B]}]", chinese_wall, "[1,B]")
    ch = Chunker(chinese_wall, {"q": cq})
    t = pa.table({"ts": [1, 1, 1], "level": ["[0,B]", "[⊥, B]", "[1,B]"], "serviceId": ["x"] * 3,
                  "msgType": ["m"] * 3, "sender": ["s"] * 3, "receiver": ["r"] * 3, "timestamp": [0, 0, 0],
                  "outcome": ["o"] * 3})
    assert ch.push("MessageLog", t) == 3
    (c,) = ch.finish()
    assert c.queries[0].items[0]["level"].to_pylist() == ["[⊥,B]", "[⊥,B]"]


@pytest.mark.parametrize(
    "stream,mutate,reason,message",
    [
        ("Nope", lambda t: t, "unknown_stream", "unknown stream"),
        ("Vitals", lambda t: t.drop_columns(["pr"]), "missing_columns", "missing columns pr"),
        ("Vitals", lambda t: t.append_column("extra", pa.array([1] * t.num_rows)), "extra_columns", "extra"),
        ("Vitals", lambda t: t.append_column("_seq", pa.array([1] * t.num_rows)), "extra_columns", "_seq"),
        ("Vitals", lambda t: t.set_column(3, "bp", pa.array(["x"] * t.num_rows)), "bad_type", "column bp"),
        ("Vitals", lambda t: t.set_column(1, "level", pa.array(["U", "SECRET", "U"])), "unknown_level", "SECRET"),
        ("Vitals", lambda t: t.set_column(0, "ts", pa.array([7, 6, 7], pa.int64())), "ts_decreasing", "decreases"),
        ("Vitals", lambda t: t.set_column(0, "ts", pa.array([5, 5, 5], pa.int64())), "ts_decreasing", "before"),
        ("Vitals", lambda t: t.set_column(0, "ts", pa.array([None, 7, 7], pa.int64())), "null_ts", "null"),
        ("Vitals", lambda t: t.set_column(1, "level", pa.array([None, "U", "U"])), "null_level", "null"),
        ("Positions", lambda t: t, "late_tuple", "late tuple"),
    ],
)
def test_validation_rejects_whole_batch(battlefield, stream, mutate, reason, message):
    cq = compile_query("SELECT * FROM Vitals[ROWS 5], Positions[ROWS 5]", battlefield, "U")
    ch = Chunker(battlefield, {"q": cq})
    ch.push("Vitals", vitals([6] * 2))
    ch.push("Positions", positions(2, 1))
    ch.close(3)  # closes chunks ≤ 3
    before = (ch.accepted, ch.retained_rows, ch.closed_until)
    good = vitals([7] * 3) if stream != "Positions" else positions(3, 3)
    bad = mutate(good)
    with pytest.raises(ChunkingError, match=message) as ei:
        ch.push(stream, bad)
    assert isinstance(ei.value, ValueError) and ei.value.reason == reason
    assert ch.rejected == {reason: 3}
    assert (ch.accepted, ch.retained_rows, ch.closed_until) == before
    # the stream continues as if the bad batch never came: seq numbers have no gap
    ch.push("Vitals", vitals([7]))
    c = ch.finish()[-1]
    assert c.chunk_id == 7 and c.queries[0].items[0]["_seq"].to_pylist() == [0, 1, 2]


def test_bad_chunk_length(battlefield):
    with pytest.raises(ValueError):
        Chunker(battlefield, {}, chunk_instants=0)


# ---------------------------------------------------------------------------
# (e) codec


_ARROW_VALUES = {
    pa.int64(): st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    pa.float64(): st.one_of(st.none(), st.floats(allow_nan=False)),
    pa.string(): st.one_of(st.none(), st.text(max_size=5)),
    pa.bool_(): st.one_of(st.none(), st.booleans()),
}


@st.composite
def tables(draw):
    ncols = draw(st.integers(0, 4))
    types = draw(st.lists(st.sampled_from(list(_ARROW_VALUES)), min_size=ncols, max_size=ncols))
    n = draw(st.integers(0, 5)) if ncols else 0
    cols = {f"c{i}": pa.array(draw(st.lists(_ARROW_VALUES[t], min_size=n, max_size=n)), t) for i, t in enumerate(types)}
    return pa.table(cols) if cols else pa.table({})


@st.composite
def chunks(draw):
    cid = draw(st.integers(0, 10**6))
    qs = []
    for i in range(draw(st.integers(0, 3))):
        instants = sorted(draw(st.sets(st.integers(0, 10**9), min_size=1, max_size=4)))
        has_state = draw(st.booleans())
        qs.append(QueryChunk(f"q{i}-é", cid, draw(st.lists(tables(), max_size=3)), instants,
                             draw(st.none() | st.integers(0, 10**9)),
                             draw(tables()) if has_state else None,
                             draw(st.integers(0, 10**9)) if has_state else None))
    return Chunk(cid, cid * 3, cid * 3 + 2, qs)


@settings(max_examples=60, deadline=None)
@given(chunks())
def test_chunk_codec_roundtrip(chunk):
    b = encode_chunk(chunk)
    back = decode_chunk(b)
    assert back == chunk
    for q1, q2 in zip(chunk.queries, back.queries):
        for t1, t2 in zip(q1.items, q2.items):
            assert t1.schema == t2.schema and t1.equals(t2)
    assert encode_chunk(back) == b


@settings(max_examples=40, deadline=None)
@given(tables(), st.none() | tables(), st.none() | st.integers(0, 10**9),
       st.dictionaries(st.text(max_size=3), st.integers() | st.floats(allow_nan=False) | st.text(max_size=3)))
def test_result_codec_roundtrip(rows, state, upto, stats):
    r = ChunkResult("q", 7, rows, state, upto, stats)
    back = decode_result(encode_result(r))
    assert back == r and back.rows.schema == rows.schema


def test_codec_real_chunk_and_errors(table71):
    _, out = table71
    for c in out:
        back = decode_chunk(encode_chunk(c))
        assert back == c
        assert [t.schema for q in back.queries for t in q.items] == [t.schema for q in c.queries for t in q.items]
    with pytest.raises(ValueError):
        decode_chunk(b"nope")
    with pytest.raises(ValueError):
        decode_chunk(encode_chunk(out[0])[:-3])
    with pytest.raises(ValueError):
        decode_result(encode_chunk(out[0]))


# ---------------------------------------------------------------------------
# (f) memory stays bounded


def test_memory_bound(battlefield):
    qs = {
        "rows": compile_query("SELECT AVG(bp) FROM Vitals[ROWS 5]", battlefield, "U"),
        "rows_i": compile_query("SELECT bp FROM Vitals[ROWS 5]", battlefield, "U"),
        "part": compile_query("SELECT bp FROM Vitals[PARTITION BY sid ROWS 5]", battlefield, "U"),
        "range": compile_query("SELECT bp FROM Vitals[RANGE 3 seconds]", battlefield, "U"),
        "now": compile_query("SELECT bp FROM Vitals[NOW]", battlefield, "U"),
        "none": compile_query("SELECT bp FROM Vitals", battlefield, "U"),
    }
    ch = Chunker(battlefield, qs)
    peak = 0
    for ts in range(1000):
        ch.push("Vitals", vitals([ts] * 3, level=["U", "S", "U"]))
        ch.close(ts)
        peak = max(peak, ch.retained_rows)
    assert ch.retained("rows") == [5] and ch.retained("rows_i") == [5]
    assert ch.retained("part") == [10]  # 2 visible sids (s0, s2) × 5
    assert ch.retained("range") == [6]  # 3 instants × 2 visible tuples
    assert ch.retained("now") == [2] and ch.retained("none") == [0]
    assert peak <= 5 + 5 + 10 + 6 + 2 + 6 * 2


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.none() | st.sampled_from(["a", "b"]), st.none() | st.sampled_from([1.0, 2.0])),
                max_size=30), st.integers(1, 4))
def test_partition_tail_matches_pandas(rows, n):
    from chunking.chunker import _partition_tail

    t = pa.table({"_seq": pa.array(range(len(rows)), pa.int64()), "k1": pa.array([r[0] for r in rows], pa.string()),
                  "k2": pa.array([r[1] for r in rows], pa.float64())})
    got = _partition_tail(t, ("k1", "k2"), n)["_seq"].to_pylist()
    df = t.to_pandas()
    want = df.groupby(["k1", "k2"], dropna=False, sort=False).tail(n)["_seq"].tolist()
    assert got == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.sampled_from(LEVELS), min_size=1, max_size=12), min_size=1, max_size=4),
       window_levels=st.sets(st.sampled_from(LEVELS), min_size=1))
def test_item_holds_exactly_its_window_levels(battlefield, batches, window_levels):
    """Batches whose levels are all in, partly in or all outside a window's level set: the
    item receives exactly the tuples of its levels, in arrival order (the whole-batch fast
    paths agree with a tuple-by-tuple filter)."""
    clause = ", ".join(sorted(window_levels))
    cq = compile_query(f"SELECT bp FROM Vitals[RANGE UNBOUNDED level in {{{clause}}}]", battlefield, "TS")
    ch = Chunker(battlefield, {"q": cq}, chunk_instants=len(batches))
    want, start = [], 0
    for ts, levels in enumerate(batches):
        ch.push("Vitals", vitals([ts] * len(levels), level=levels, bp=counting(start)))
        want += [float(start + i) for i, lv in enumerate(levels) if lv in window_levels]
        start += len(levels)
    got = [bp for c in ch.close(len(batches) - 1) for q in c.queries for bp in q.items[0].column("bp").to_pylist()]
    assert got == want


def test_queries_come_and_go_between_batches_of_an_open_instant(battlefield):
    """Tuples wait for their instant to close before the queries get them (their shields: punctuations
    and switches of the instant, chunking/shield.py); a query with a window condition registered, and
    another removed, between two batches of one open instant: each gets exactly the tuples pushed while
    it was registered, filtered by its own condition (a regression: the batches' window conditions
    differed and one was missing when the closed batches were fed together)."""
    early = compile_query("SELECT bp FROM Vitals [ROWS 5 WHERE bp > 1]", battlefield, "S")
    late = compile_query("SELECT bp FROM Vitals [ROWS 5 WHERE bp < 4]", battlefield, "S")
    ch = Chunker(battlefield, {"early": early}, chunk_instants=1)
    ch.push("Vitals", vitals([1, 1], bp=[1.0, 2.0]))
    ch.add_query("late", late)
    ch.push("Vitals", vitals([1, 1], bp=[3.0, 5.0]))
    ch.remove_query("early")
    ch.push("Vitals", vitals([1], bp=[0.5]))
    got = {qc.query_id: sorted(qc.items[0].column("bp").to_pylist()) for c in ch.finish() for qc in c.queries}
    assert got == {"late": [0.5, 3.0]}
