"""Security punctuations (paper 003, docs/semantics.md §11) on the master's data path, without Spark:
the paper's sp examples of §4.1 (stream, tuple [120,133] and attribute level), the Security Shield's
behaviour of Fig. 10 (a newer policy replaces the older one wholesale; denial by default once a
policy is in force; no policy ever: the lattice alone), SCJoin as per-side shields, the input
checks (one line, counted, nothing applied), checkpoints, and the reference's filter agreeing with
the chunker's on every example.

The examples' data are the paper's Fig. 6 streams (HeartRate, BodyTemperature, BreathingRate with
patient ids); the paper's medical roles (C, GP, D, ND) are user names here (Strata's roles are
producer, analyst, operator)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from bench import access
from strata import punctuations
from strata.config import parse_config
from strata.master.pipeline import QueryPipeline

from .reference.access import shield_streams

HEALTH_TOML = """
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.HeartRate]
pid = "long"
beats = "long"

[streams.BodyTemperature]
pid = "long"
temperature = "double"

[streams.BreathingRate]
pid = "long"
frequency = "double"
"""

COLUMNS = ["ts", "level", "stream", "tuples", "attributes", "roles", "users", "sign", "immutable"]


@pytest.fixture(scope="module")
def health():
    return parse_config(HEALTH_TOML)


def sp(ts, stream, tuples="*", attributes="*", users="", roles="", sign="+", level="U", immutable=None) -> dict:
    return {"ts": ts, "level": level, "stream": stream, "tuples": tuples, "attributes": attributes, "roles": roles,
            "users": users, "sign": sign, "immutable": immutable}


def sp_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema(
        [("ts", pa.int64()), ("level", pa.string())] + [(c, pa.string()) for c in COLUMNS[2:-1]]
        + [("immutable", pa.bool_())]))


def data_table(config, stream: str, rows: list[dict]) -> pa.Table:
    from strata.arrowio import ARROW_TYPES

    s = config.streams[stream]
    return pa.Table.from_pylist(rows, schema=pa.schema(
        [("ts", pa.int64()), ("level", pa.string())] + [(c, ARROW_TYPES[t]) for c, t in s.columns]))


#: the paper's Fig. 6 tuples: patients 100, 120, 125, 133, 140 at instants 0-4 on each stream (level U)
def fig6(ts_list=range(5)) -> dict[str, list[dict]]:
    pids = [100, 120, 125, 133, 140]
    return {
        "HeartRate": [{"ts": t, "level": "U", "pid": p, "beats": 60 + p % 40} for t in ts_list for p in pids],
        "BodyTemperature": [{"ts": t, "level": "U", "pid": p, "temperature": 36.5 + (p % 7) / 10} for t in ts_list
                            for p in pids],
        "BreathingRate": [{"ts": t, "level": "U", "pid": p, "frequency": 12.0 + p % 5} for t in ts_list for p in pids],
    }


def seen(config, text: str, principal, sps: list[dict], streams: dict[str, list[dict]], level="U", k=1,
         punct_first=False) -> dict[str, list[tuple]]:
    """Per stream the (ts, pid) tuples the query's chunks carry as new input (what its windows hold)."""
    p = QueryPipeline(config, level, chunk_instants=k)
    qid, cq = p.add_query(text, principal=principal)
    order = [(punctuations.STREAM, sp_table(sps))] if sps else []
    data = [(s, data_table(config, s, rows)) for s, rows in streams.items() if rows]
    for stream, table in (order + data if punct_first else data + order):  # punctuations after data: still in force
        p.ingest(stream, table)
    out: dict[str, list[tuple]] = {}
    names = [it.stream for it in cq.items]
    for chunk in p.finish():
        for qc in chunk.queries:
            for name, t in zip(names, qc.items):
                first = qc.instants[0]
                out.setdefault(name, []).extend((r["ts"], r["pid"]) for r in t.to_pylist() if r["ts"] >= first)
    return {n: sorted(set(v)) for n, v in out.items()}


def reference_seen(config, text, principal, sps, streams) -> dict[str, list[tuple]]:
    canon = [dict(x, level=config.lattice.parse(x["level"])) for x in sps]
    shielded = shield_streams(config, text, streams, canon, (principal[0], set(principal[1])))
    return {n: sorted({(r["ts"], r["pid"]) for r in rows}) for n, rows in shielded.items() if rows}


def check(config, text, principal, sps, streams, expected: dict):
    got = seen(config, text, principal, sps, streams)
    assert got == expected
    assert got == reference_seen(config, text, principal, sps, {s: streams[s] for s in expected} | {
        s: r for s, r in streams.items() if s not in expected and s in _streams_of(config, text)})
    assert seen(config, text, principal, sps, streams, k=2, punct_first=True) == expected


def _streams_of(config, text):
    from strata.mlscql import compile_query

    return {it.stream for it in compile_query(text, config, "U").items}


ALL = [(t, p) for t in range(5) for p in (100, 120, 125, 133, 140)]
ANALYST = frozenset({"analyst"})


# ---- §4.1: stream-level restriction  <s1, *, * | C | +> --------------------------------------------------
def test_stream_level_sp_only_the_cardiologist_reads_heart_rate(health):
    sps = [sp(0, "HeartRate", users="cardiologist")]
    q = "SELECT pid, beats FROM HeartRate [ROWS 100]"
    check(health, q, ("cardiologist", ANALYST), sps, fig6(), {"HeartRate": ALL})
    check(health, q, ("gp", ANALYST), sps, fig6(), {})  # denial by default: no tuple, no instant
    # the other streams have no policy: the lattice alone decides
    check(health, "SELECT pid FROM BodyTemperature [ROWS 100]", ("gp", ANALYST), sps, fig6(), {"BodyTemperature": ALL})


# ---- §4.1: tuple-level restriction  <*, [120,133], * | GP | +> -----------------------------------------------
def test_tuple_level_sp_patients_120_to_133_for_the_gp(health):
    sps = [sp(0, "*", tuples="pid=120..133", users="gp")]
    mid = [(t, p) for t, p in ALL if 120 <= p <= 133]
    for stream, attr in (("HeartRate", "beats"), ("BodyTemperature", "temperature"), ("BreathingRate", "frequency")):
        q = f"SELECT pid, {attr} FROM {stream} [ROWS 100]"
        check(health, q, ("gp", ANALYST), sps, fig6(), {stream: mid})
        check(health, q, ("cardiologist", ANALYST), sps, fig6(), {})


# ---- §4.1: attribute-level restriction  <{s1, s2}, *, {Temperature, Beats_per_min} | {D, ND} | +> ---------------
def test_attribute_level_sp_temperature_and_beats_for_doctor_and_nurse(health):
    sps = [sp(0, "HeartRate", attributes="beats", users="doctor|nurse"),
           sp(0, "BodyTemperature", attributes="temperature", users="doctor|nurse")]
    for user in ("doctor", "nurse"):
        check(health, "SELECT AVG(beats) FROM HeartRate [RANGE 2]", (user, ANALYST), sps, fig6(), {"HeartRate": ALL})
        check(health, "SELECT MAX(temperature) FROM BodyTemperature [ROWS 3]", (user, ANALYST), sps, fig6(),
              {"BodyTemperature": ALL})
        # a query naming an attribute the policy does not grant (pid) sees nothing of the stream
        check(health, "SELECT pid, beats FROM HeartRate [ROWS 3]", (user, ANALYST), sps, fig6(), {})
    check(health, "SELECT AVG(beats) FROM HeartRate [RANGE 2]", ("gp", ANALYST), sps, fig6(), {})


# ---- Fig. 10: the SS algorithm's behaviours ---------------------------------------------------------------------------
def test_a_newer_policy_replaces_the_older_one_wholesale(health):
    sps = [sp(0, "HeartRate", users="cardiologist"), sp(0, "HeartRate", users="gp"),
           sp(2, "HeartRate", tuples="pid=100|140", users="gp")]  # from instant 2 on: gp, patients 100 and 140 only
    q = "SELECT pid, beats FROM HeartRate [ROWS 100]"
    check(health, q, ("cardiologist", ANALYST), sps, fig6(), {"HeartRate": [x for x in ALL if x[0] < 2]})
    check(health, q, ("gp", ANALYST), sps, fig6(),
          {"HeartRate": [x for x in ALL if x[0] < 2 or x[1] in (100, 140)]})


def test_negative_sps_deny_and_roles_grant(health):
    sps = [sp(1, "*", roles="analyst"), sp(1, "*", tuples="pid=133", users="jane", sign="-"),
           sp(1, "BreathingRate", attributes="frequency", users="jane", sign="-")]
    q = "SELECT pid, beats FROM HeartRate [ROWS 100]"
    check(health, q, ("jane", ANALYST), sps, fig6(), {"HeartRate": [x for x in ALL if x[0] < 1 or x[1] != 133]})
    check(health, q, ("bob", ANALYST), sps, fig6(), {"HeartRate": ALL})
    check(health, q, ("bob", frozenset({"producer"})), sps, fig6(), {"HeartRate": [x for x in ALL if x[0] < 1]})
    # a deny of one attribute hides the tuple only from queries that read it
    check(health, "SELECT pid FROM BreathingRate [ROWS 100]", ("jane", ANALYST), sps, fig6(),
          {"BreathingRate": [x for x in ALL if x[0] < 1 or x[1] != 133]})
    check(health, "SELECT frequency FROM BreathingRate [ROWS 100]", ("jane", ANALYST), sps, fig6(),
          {"BreathingRate": [x for x in ALL if x[0] < 1]})


def test_a_policy_governs_only_tuples_of_its_own_level(health):
    streams = fig6()
    streams["HeartRate"] += [{"ts": 4, "level": "C", "pid": 999, "beats": 1}]
    sps = [sp(0, "HeartRate", users="cardiologist", level="C")]  # a C policy: U tuples stay as the lattice says
    q = "SELECT pid, beats FROM HeartRate [ROWS 100]"
    assert seen(health, q, ("gp", ANALYST), sps, streams, level="C") == {"HeartRate": ALL}
    assert seen(health, q, ("cardiologist", ANALYST), sps, streams, level="C") == {"HeartRate": ALL + [(4, 999)]}


# ---- SCJoin (§5.4) = a join of per-side shielded inputs --------------------------------------------------------------
def test_scjoin_joins_only_tuples_visible_on_both_sides(health):
    """SCJoin's filter-and-probe joins a and b only if their policies share the query's role on the
    join attribute; with the query's own principal that is: a row exists iff both tuples are visible."""
    sps = [sp(0, "HeartRate", tuples="pid=120..133", users="gp"),
           sp(0, "BodyTemperature", tuples="pid=125..140", users="gp")]
    q = ("SELECT h.pid, h.beats, b.temperature FROM HeartRate h [ROWS 5], BodyTemperature b [ROWS 5] "
         "WHERE h.pid = b.pid")
    got = seen(health, q, ("gp", ANALYST), sps, fig6())
    assert got == {"HeartRate": [x for x in ALL if 120 <= x[1] <= 133],
                   "BodyTemperature": [x for x in ALL if 125 <= x[1] <= 140]}
    assert got == reference_seen(health, q, ("gp", ANALYST), sps, {s: fig6()[s] for s in ("HeartRate", "BodyTemperature")})


# ---- input checks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    (dict(stream="Nope"), "stream must be a stream name or *"),
    (dict(tuples="pid=9..1"), "empty range"),
    (dict(tuples="nope=1"), "no attribute 'nope'"),
    (dict(tuples="pid=abc"), "is not a long value"),
    (dict(attributes="beats|nope"), "no attribute 'nope'"),
    (dict(users="", roles=""), "name at least one role or user"),
    (dict(roles="doctor"), "unknown role(s) doctor"),
    (dict(sign="*"), "sign must be + or -"),
])
def test_bad_punctuations_are_refused_in_one_line_nothing_applied(health, bad, message):
    from strata.chunking.chunker import ChunkingError

    p = QueryPipeline(health, "U")
    row = sp(0, "HeartRate", users="gp") | bad
    with pytest.raises(ChunkingError) as e:
        p.ingest(punctuations.STREAM, sp_table([sp(0, "HeartRate", users="gp"), row]))
    assert message in str(e.value) and "\n" not in str(e.value) and "row 2" in str(e.value)
    assert p.chunker.rejected == {"bad_punctuation": 2} and p.chunker.shields.punctuations == 0


def test_late_and_decreasing_punctuations_are_refused(health):
    from strata.chunking.chunker import ChunkingError

    p = QueryPipeline(health, "U")
    p.ingest(punctuations.STREAM, sp_table([sp(3, "HeartRate", users="gp")]))
    with pytest.raises(ChunkingError, match="before the punctuations' last ts 3"):
        p.ingest(punctuations.STREAM, sp_table([sp(2, "HeartRate", users="gp")]))
    p.advance(5)
    with pytest.raises(ChunkingError, match="late tuple"):
        p.ingest(punctuations.STREAM, sp_table([sp(4, "HeartRate", users="gp")]))


def test_punctuations_above_the_master_are_dropped_by_the_shepherd(health):
    p = QueryPipeline(health, "C")
    accepted, dropped = p.ingest(punctuations.STREAM, sp_table([sp(0, "HeartRate", users="gp", level="S"),
                                                                sp(0, "HeartRate", users="gp", level="C")]))
    assert (accepted, dropped) == (1, 1) and p.chunker.shields.punctuations == 1


def test_a_query_sees_nothing_pushed_before_it_was_registered(health):
    p = QueryPipeline(health, "U")
    p.ingest("HeartRate", data_table(health, "HeartRate", fig6()["HeartRate"][:5]))
    p.add_query("SELECT pid FROM HeartRate [ROWS 100]", principal=("gp", ANALYST))
    p.ingest("HeartRate", data_table(health, "HeartRate", fig6()["HeartRate"][5:]))
    rows = [r for c in p.finish() for qc in c.queries for r in qc.items[0].to_pylist()]
    assert len({r["_seq"] for r in rows}) == 20 and min(r["ts"] for r in rows) == 1  # (legacies repeat rows)


def test_policies_switches_and_unfed_tuples_survive_a_checkpoint(health):
    def run(split: bool):
        p = QueryPipeline(health, "U")
        q = "SELECT pid, beats FROM HeartRate [ROWS 100]"
        p.add_query(q, query_id="q1", principal=("gp", ANALYST))
        p.ingest(punctuations.STREAM, sp_table([sp(0, "HeartRate", tuples="pid=120..133", users="gp")]))
        rows = fig6()["HeartRate"]
        p.ingest("HeartRate", data_table(health, "HeartRate", rows[:12]))
        p.switch("q1", "gp", "HeartRate", False, 3)
        out = p.advance(0)
        if split:
            meta, tables, chunks = p.export_state()
            p = QueryPipeline(health, "U")
            p.add_query(q, query_id="q1", principal=("gp", ANALYST))
            p.import_state(meta, tables, chunks)
        p.ingest("HeartRate", data_table(health, "HeartRate", rows[12:]))
        out += p.finish()
        return [(c.chunk_id, [r["pid"] for qc in c.queries for r in qc.items[0].to_pylist()]) for c in out], \
            p.chunker.shields.export()

    assert run(True) == run(False)
    chunks, shields = run(False)
    assert [c for c, _ in chunks] == [0, 1, 2] and shields["switches"][0]["blocked"] == 6


# ---- a lower level learns nothing of higher punctuations ------------------------------------------------------------
def _core_run(config, level, texts, streams, sps):
    """A master of ``level`` (no workers): the chunks it cuts and what its operators and analysts read."""
    from strata.master.core import MasterCore

    core = MasterCore(config, level, chunk_instants=2)
    core.register("jane", texts, roles={"analyst"})
    replies = []
    for stream, table in [(punctuations.STREAM, sp_table(sps))] + [(s, data_table(config, s, r))
                                                                   for s, r in streams.items() if r]:
        try:
            o = core.ingest_batch(stream, table, None)
            replies.append((o.accepted, o.duplicate))
        except Exception as e:  # noqa: BLE001 - the refusal's text is part of what is compared
            replies.append(str(e))
    core.advance(finish=True)
    chunks = [(c.chunk_id, [(qc.query_id, qc.instants, [t.to_pylist() for t in qc.items]) for qc in c.queries])
              for c in (core.pipeline.chunks[k] for k in sorted(core.pipeline.chunks))]
    status = {k: v for k, v in core.status("jane", cluster=True).items() if k not in ("timings", "histograms")}
    return chunks, status, replies


def test_higher_punctuations_change_nothing_a_lower_master_does(health):
    """The C master with and without S and TS punctuations (valid ones, and ones it would refuse) in
    the same labelled batches: the same chunks (so the same results on any worker), the same status
    for operators and analysts, the same replies but for the producer's own dropped count."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    texts = ["SELECT pid, beats FROM HeartRate [ROWS 3]", "SELECT AVG(temperature) FROM BodyTemperature [RANGE 2]"]
    own = st.fixed_dictionaries({"ts": st.integers(0, 4), "level": st.sampled_from(["U", "C"]),
                                 "stream": st.sampled_from(["*", "HeartRate", "BodyTemperature"]),
                                 "tuples": st.sampled_from(["*", "pid=120..133", "pid=100|140"]),
                                 "users": st.sampled_from(["jane", "bob", ""]), "roles": st.just("analyst"),
                                 "sign": st.sampled_from("+-")})
    above = st.fixed_dictionaries({"ts": st.integers(0, 4), "level": st.sampled_from(["S", "TS"]),
                                   "stream": st.sampled_from(["*", "HeartRate", "Nope"]),
                                   "tuples": st.sampled_from(["*", "pid=9..1", "nope=1"]),
                                   "users": st.sampled_from(["jane", ""]), "roles": st.sampled_from(["", "nurse"]),
                                   "sign": st.sampled_from("+-*")})

    @settings(max_examples=25, deadline=None)
    @given(mine=st.lists(own, max_size=4), theirs=st.lists(above, min_size=1, max_size=4),
           levels=st.lists(st.sampled_from(["U", "C", "S"]), min_size=5, max_size=5))
    def run(mine, theirs, levels):
        streams = fig6()
        for rows in streams.values():
            for i, r in enumerate(rows):
                r["level"] = levels[i % 5]
        mine = [sp(**(m | {"immutable": None})) for m in sorted(mine, key=lambda x: x["ts"])]
        mixed = sorted(mine + [sp(**(t | {"immutable": None})) for t in theirs], key=lambda x: x["ts"])
        a = _core_run(health, "C", texts, streams, mine)
        b = _core_run(health, "C", texts, streams, mixed)
        assert a[0] == b[0] and a[1] == b[1]
        assert [x if isinstance(x, str) else x[0] for x in a[2]] == [x if isinstance(x, str) else x[0] for x in b[2]]

    run()


def test_the_overhead_benchmark_runs_its_variants():
    """bench/access.py (docs/benchmarks/access.md) on a small input: each variant hides what it says."""
    r = access.measure(tuples=8000, per_instant=800, reps=1)
    plain = r["plain"]["rows_in_chunks"]
    assert 0.35 * plain < r["policy"]["rows_in_chunks"] < 0.65 * plain  # half the sids granted
    assert r["policy/instant"]["rows_in_chunks"] == r["policy"]["rows_in_chunks"]
    assert r["switch"]["rows_in_chunks"] < plain and r["plain"]["shield_ns"] < r["policy"]["shield_ns"]
    assert "| policy |" in access.render(r)
