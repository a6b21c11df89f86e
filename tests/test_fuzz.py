"""Fuzzing the trust boundaries: bad input gets a clear error, never a crash, and loses nothing."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.chunking.chunker import ChunkingError
from strata.chunking.codec import decode_chunk, decode_result
from strata.master.pipeline import QueryPipeline
from strata.master.shepherd import ShepherdError
from strata.mlscql import QueryError, compile_query
from strata.groups.membership import GroupTable

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENS = ["SELECT", "FROM", "WHERE", "GROUP", "BY", "HAVING", "AND", "OR", "NOT", "IN", "level", "Vitals",
          "Positions", "bp", "sid", "V", "[", "]", "(", ")", "{", "}", ",", ".", "*", "=", "<", ">=", "+", "-",
          "/", "ROWS", "RANGE", "NOW", "UNBOUNDED", "PARTITION", "DOMINATED", "AVG", "COUNT", "MAX", "ISTREAM",
          "DSTREAM", "U", "C", "S", "TS", "[1,B]", "'x'", '"y"', "3", "2.5", "-1", "minutes", "AS", "IS", "NULL",
          "⊥", ";", "0"]


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=25).map(" ".join))
def test_query_token_soup_only_raises_query_errors(battlefield, text):
    try:
        cq = compile_query(text, battlefield, "S")
    except QueryError as e:
        assert "\n" not in str(e)
        return
    # accepted: the window levels are within what S may read
    for f in cq.query.from_:
        assert f.window.levels <= battlefield.lattice.dominated("S")


@FUZZ
@given(st.text(max_size=200))
def test_query_arbitrary_text_only_raises_query_errors(battlefield, text):
    try:
        compile_query(text, battlefield, "TS")
    except QueryError:
        pass


values = st.one_of(st.none(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3), st.booleans())


@FUZZ
@given(
    st.sampled_from(["Vitals", "Positions", "Nope", "vitals"]),
    st.dictionaries(st.sampled_from(["ts", "level", "sid", "bp", "pr", "weight", "lat", "lon", "extra"]),
                    st.lists(values, min_size=3, max_size=3), min_size=1),
    st.sampled_from([None, "U", "S", "TS"]),
)
def test_ingest_fuzz_rejects_cleanly_and_loses_nothing(battlefield, stream, cols, source):
    p = QueryPipeline(battlefield, "S")
    p.add_query("SELECT sid, bp FROM Vitals [ROWS 5]")
    good = pa.table({"ts": [1], "level": ["U"], "sid": ["a"], "bp": [1.0], "pr": [1.0], "weight": [1.0]})
    assert p.ingest("Vitals", good) == (1, 0)
    try:
        table = pa.table({k: pa.array(v, from_pandas=True) if len({type(x) for x in v if x is not None}) <= 1
                          else pa.array([str(x) for x in v]) for k, v in cols.items()})
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return
    before = p.chunker.accepted
    try:
        p.ingest(stream, table, source)
    except (ChunkingError, ShepherdError, ValueError) as e:
        assert str(e) and "\n" not in str(e).strip()
        assert p.chunker.accepted == before  # a rejected batch is rejected whole
    # nothing accepted is lost: the good tuple still comes out
    chunks = p.finish()
    seen = [r for c in chunks for qc in c.queries for t in qc.items for r in t.column("sid").to_pylist()]
    assert "a" in seen


@FUZZ
@given(st.binary(max_size=300))
def test_heartbeat_garbage_never_raises(data):
    t = GroupTable("S", b"k" * 32)
    assert t.receive(data, now=0.0) is None
    assert sum(t.rejected.values()) == 1 and not t.peers


@FUZZ
@given(st.binary(max_size=300))
def test_chunk_codec_garbage_is_a_value_error(data):
    for decode in (decode_chunk, decode_result):
        with pytest.raises(ValueError):
            decode(data)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_login_fuzz(tmp_path_factory, battlefield, user, password):
    from strata.users import AuthError, UserStore

    store = UserStore(tmp_path_factory.getbasetemp() / "fuzz.users.json", battlefield.lattice)
    if not store.path.exists():
        store.add("ann", "S", "pw")
    with pytest.raises(AuthError):
        store.authenticate(user, password + "\x00", "S")


# ---- non-interference of the master's own replies (issue 12) -------------------------------------------
_TS_VALUES = st.one_of(st.integers(-2, 12), st.sampled_from([2**53 - 1, 2**53, 2**63 - 1]))
_BATCH = st.tuples(
    st.sampled_from(["Vitals", "vitals", "Nope"]),
    st.lists(st.tuples(_TS_VALUES, st.sampled_from(["U", "C", "S", "TS"]), st.booleans()), max_size=6),
)


def _core_answer(core, call):
    try:
        return ("ok", call())
    except (ValueError, ChunkingError, ShepherdError) as e:
        return (type(e).__name__, str(e))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(_BATCH, min_size=1, max_size=5), upto=st.integers(-1, 4000))
def test_master_replies_do_not_depend_on_above_level_rows(battlefield, batches, upto):
    """A master of level S fed random labelled batches, and one fed the same batches without their TS
    rows: every answer an S session can get (accepted counts, error texts, advance refusals, the
    operator's status but for timings) is the same.  A TS row may carry a value of another type."""
    from strata.master.core import MasterCore

    cores = [MasterCore(battlefield, "S"), MasterCore(battlefield, "S")]
    for core in cores:
        core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 2]"])
    answers: list[list] = [[], []]
    for stream, rows in batches:
        for i, core in enumerate(cores):
            mine = rows if i == 0 else [r for r in rows if r[1] != "TS"]
            junk = any(r[1] == "TS" and r[2] for r in mine)  # a TS row whose bp is not a number
            bp = [("junk" if r[2] else "1.5") if r[1] == "TS" else "2.5" for r in mine] if junk else \
                [2.5 if r[1] != "TS" else 1.5 for r in mine]
            t = pa.table({"ts": pa.array([r[0] for r in mine], pa.int64()),
                          "level": pa.array([r[1] for r in mine], pa.string()),
                          "sid": ["a"] * len(mine), "bp": bp, "pr": [1.0] * len(mine), "weight": [1.0] * len(mine)})
            out = _core_answer(core, lambda: core.ingest(stream, t, None)[0])  # [1] is the producer's own
            answers[i].append(out)
    for i, core in enumerate(cores):
        answers[i].append(_core_answer(core, lambda: core.advance(upto_ts=upto)))
        st_ = core.status()
        st_.pop("timings")
        st_.pop("histograms", None)
        answers[i].append(st_)
    assert answers[0] == answers[1]
