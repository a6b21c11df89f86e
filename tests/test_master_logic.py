"""Plain master logic: stream shepherd, ordered merge, Algorithm 5 dispatch."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.master.dispatch import Dispatcher
from strata.master.merge import OrderedMerger
from strata.master.shepherd import Shepherd, ShepherdError


# ---- shepherd -------------------------------------------------------------------------
def test_s_master_never_holds_ts_tuples(battlefield):
    sh = Shepherd(battlefield.lattice, "S")
    t = pa.table({"ts": [1, 1, 2, 3], "level": ["U", "TS", "S", "TS"], "bp": [1.0, 2.0, 3.0, 4.0]})
    kept = sh.admit("Vitals", t)
    assert kept.column("level").to_pylist() == ["U", "S"]
    assert kept.column("bp").to_pylist() == [1.0, 3.0]
    assert sh.dropped["Vitals"] == 2


def test_chinese_wall_shepherd(chinese_wall):
    sh = Shepherd(chinese_wall.lattice, "[⊥,B]")
    t = pa.table({"ts": [1, 1, 1], "level": ["[⊥,B]", "[1,⊥]", "[⊥,⊥]"]})
    assert sh.admit("MessageLog", t).column("level").to_pylist() == ["[⊥,B]", "[⊥,⊥]"]


def test_source_writes_only_its_level(battlefield):
    sh = Shepherd(battlefield.lattice, "TS")
    stamped = sh.check_source("C", pa.table({"ts": [1, 2], "bp": [1.0, 2.0]}))
    assert stamped.column("level").to_pylist() == ["C", "C"]
    with pytest.raises(ShepherdError, match="may only write level C"):
        sh.check_source("C", pa.table({"ts": [1], "level": ["S"]}))


# ---- merge ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=15, unique=True).map(sorted), st.randoms())
def test_merge_releases_each_chunk_once_in_order(ids, rnd):
    m = OrderedMerger()
    for cid in ids:
        m.expect(cid)
    arrivals = ids + [rnd.choice(ids) for _ in range(5)]  # duplicates from slow workers
    rnd.shuffle(arrivals)
    released = []
    for cid in arrivals:
        released.extend(m.add(cid, f"r{cid}"))
    assert [c for c, _ in released] == ids
    assert m.waiting == 0 and m.duplicates == 5


def test_merge_rejects_out_of_order_registration():
    m = OrderedMerger()
    m.expect(3)
    with pytest.raises(ValueError):
        m.expect(2)


# ---- Algorithm 5 --------------------------------------------------------------------------
def test_busy_worker_gets_no_chunk_while_others_are_free():
    d = Dispatcher()
    d.heartbeat("w1", cpu=95.0, now=0)
    d.heartbeat("w2", cpu=10.0, now=0)
    d.heartbeat("w3", cpu=12.0, now=0)
    d.heartbeat("w4", cpu=89.9, now=0)
    picks = set()
    for cid in range(4):
        sid = d.pick()
        picks.add(sid)
        d.assign(cid, sid)
        d.complete(cid)
    assert "w1" not in picks
    assert picks == {"w2", "w3"}  # similarly loaded free workers share the chunks


def test_all_busy_means_wait_then_least_loaded():
    d = Dispatcher()
    d.heartbeat("w1", cpu=90.0, now=0)
    d.heartbeat("w2", cpu=99.0, now=0)
    assert d.pick() is None
    assert d.pick(starving=True) == "w1"
    d.heartbeat("w3", cpu=20.0, now=0)
    assert d.pick(starving=True) == "w3"  # a free worker always wins
    for cid in range(d.max_in_flight):
        d.assign(cid, "w3")
    assert d.pick(starving=True) is None  # w3 is merely at its in-flight limit: wait for it


def test_in_flight_limit_and_least_loaded():
    d = Dispatcher(max_in_flight=1)
    d.heartbeat("a", 5, 0)
    d.heartbeat("b", 50, 0)
    first = d.pick()
    d.assign(0, first)
    second = d.pick()
    assert {first, second} == {"a", "b"}
    d.assign(1, second)
    assert d.pick() is None
    d.complete(0)
    assert d.pick() == first


def test_silent_worker_dropped_and_chunks_returned():
    d = Dispatcher(timeout=3.0)
    d.heartbeat("a", 5, now=0)
    d.heartbeat("b", 5, now=0)
    d.assign(7, "a")
    d.assign(8, "a")
    d.heartbeat("b", 5, now=2.5)
    assert d.expire(now=3.5) == [7, 8]
    assert set(d.table) == {"b"}
    d.assign(7, "b")
    assert d.complete(7) == "b"
    assert d.complete(8) is None  # the lost worker's late answer is not attributed


def test_shepherd_canonicalizes_before_filtering(chinese_wall):
    sh = Shepherd(chinese_wall.lattice, "[⊥,B]")
    t = pa.table({"ts": [1, 1], "level": ["[0,B]", "[ 0 , 0 ]"]})  # valid levels, non-canonical spellings
    assert sh.admit("MessageLog", t).column("level").to_pylist() == ["[⊥,B]", "[⊥,⊥]"]
    assert not sh.dropped


@pytest.mark.parametrize("table, fragment", [
    (pa.table({"ts": [1]}), "needs a 'level' column"),
    (pa.table({"ts": [1], "level": [3]}), "must hold level names"),
    (pa.table({"ts": [1, 2], "level": ["U", None]}), "have no level"),
    (pa.table({"ts": [1], "level": ["SECRET"]}), "unknown level"),
])
def test_shepherd_rejects_bad_levels_whole(battlefield, table, fragment):
    sh = Shepherd(battlefield.lattice, "S")
    with pytest.raises(ShepherdError, match=fragment):
        sh.admit("Vitals", table)
    assert not sh.dropped


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.sampled_from(["U", "C", "S", "TS"]), min_size=1, max_size=30),
       at=st.sampled_from(["U", "C", "S", "TS"]))
def test_shepherd_fast_paths_equal_brute_force(battlefield, levels, at):
    """All-visible batches pass as they are and all-invisible ones are dropped whole: the
    kept rows and the drop count equal a tuple-by-tuple check whatever the mix."""
    sh = Shepherd(battlefield.lattice, at)
    t = pa.table({"ts": list(range(len(levels))), "level": levels})
    kept = sh.admit("Vitals", t)
    want = [i for i, lv in enumerate(levels) if battlefield.lattice.leq(lv, at)]
    assert kept.column("ts").to_pylist() == want
    assert sh.dropped["Vitals"] == len(levels) - len(want)


# ---- level safety of the core (issue 12): metadata is data ------------------------------------------
import json
import threading

from strata.chunking.chunker import ChunkingError
from strata.chunking.model import ChunkResult
from strata.master.core import MasterCore, NotYours, Refused
from strata.master.pipeline import QueryPipeline
from strata.master.sessions import RoleError, Sessions
from strata.users import AuthError, ROLES, UserStore

from .tables import vitals

MAXLONG = 2**63 - 1


def _answer(core, cid, error_for=None, error_ts=None, chunk=None):
    """A worker's answer for chunk ``cid`` (or the unit ``chunk`` as sent: several chunks merged):
    one row per instant for every query; ``error_for`` fails at ``error_ts`` (with its rows before it)."""
    chunk = chunk if chunk is not None else core.pipeline.chunks[cid]
    out = []
    for qc in chunk.queries:
        if qc.query_id == error_for:
            before = [t for t in qc.instants if t < error_ts]
            out.append(ChunkResult(qc.query_id, cid, pa.table({"ts": pa.array(before, pa.int64())}),
                                   error="integer overflow in SUM(n)", error_ts=error_ts))
        else:
            out.append(ChunkResult(qc.query_id, cid, pa.table({"ts": pa.array(qc.instants, pa.int64())})))
    return out


def _drain(core, sid="w1", **fail):
    """Answer every ready chunk (in order) as worker ``sid``; returns the chunk ids answered."""
    done = []
    while True:
        got = core.assignments()
        if not got:
            return done
        for chunk, s in got:
            core.on_result(chunk.chunk_id, s, _answer(core, chunk.chunk_id, chunk=chunk, **fail),
                           span=(chunk.first_ts, chunk.last_ts))
            done.append(chunk.chunk_id)


def _scenario(battlefield, with_ts: bool):
    """The same producer input with and without above-level rows, and what S sessions see of it."""
    core = MasterCore(battlefield, "S", chunk_instants=2)
    core.heartbeat("w1", 5.0)
    seen = {}
    q = core.register("ana", ["SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]"])[0].query_id

    def keep(ts, lv):
        pairs = [(t, x) for t, x in zip(ts, lv) if with_ts or x != "TS"]
        return [t for t, _ in pairs], [x for _, x in pairs]

    replies = []
    batches = [
        ([1, 2, 3, 500000], ["S", "TS", "TS", "TS"]),   # the report: a TS row far ahead
        ([4, 2, 5], ["U", "TS", "C"]),                  # a TS row going backwards: ts order is checked on kept rows
        ([6, MAXLONG], ["S", "TS"]),                    # a TS row beyond [limits] max_ts
        ([7, 8], ["TS", "TS"]),                         # all above the level
    ]
    for ts, lv in batches:
        t, x = keep(ts, lv)
        replies.append(core.ingest("Vitals", vitals(t, level=x), None)[0])  # [0]: accepted (dropped is the producer's)
    for stream, (ts, lv) in (("Nope", ([9], ["TS"])), ("Vitals", ([3], ["TS"]))):
        t, x = keep(ts, lv)
        try:
            core.ingest(stream, vitals(t, level=x), None)
            replies.append("accepted")
        except (ValueError, ChunkingError) as e:  # an unknown stream; a late TS row is not late for S
            replies.append(str(e))
    for upto in (500000, 5000, 20):
        try:
            replies.append(core.advance(upto_ts=upto))
        except Refused as e:
            replies.append(str(e))
    _drain(core)
    core.advance(finish=True)
    _drain(core)
    seen["replies"] = replies
    seen["analyst"] = core.status("ana", cluster=False)
    full = core.status("op", cluster=True)
    full.pop("timings")
    full.pop("histograms")
    for w in full["workers"]:
        w.pop("cpu")
    seen["operator"] = full
    seen["results"] = [(r.first_ts, r.last_ts, r.rows.column("ts").to_pylist()) for r in core.queries[q].results]
    return seen


def test_nothing_an_s_session_sees_depends_on_ts_rows(battlefield):
    with_ts, without = _scenario(battlefield, True), _scenario(battlefield, False)
    assert json.dumps(with_ts, sort_keys=True, default=str) == json.dumps(without, sort_keys=True, default=str)
    op = with_ts["operator"]
    assert op["lag_instants"] == 0.0 and "dropped_by_shepherd" not in op["counters"]
    assert not any("shepherd" in k for k in op["rejected"]) and op["rejected"]["unknown_stream"] == 1
    assert op["rejected"]["advance_beyond_horizon"] == 2  # 500000 and 5000: the TS row at 500000 moved nothing
    assert with_ts["replies"][4].startswith("unknown stream 'Nope'")
    assert with_ts["replies"][5] == "accepted"  # a late TS row is dropped, never "late"
    assert "up to 3606" in with_ts["replies"][6]  # latest kept instant 6 + horizon 3600


def test_unknown_stream_is_checked_before_the_shepherd(battlefield):
    core = MasterCore(battlefield, "S")
    with pytest.raises(ChunkingError, match="unknown stream 'Nope'"):
        core.ingest("Nope", vitals([1, 2], level=["TS", "TS"]), None)
    assert core.status()["rejected"] == {"unknown_stream": 1}


def test_producer_reply_alone_counts_its_dropped_rows(battlefield):
    core = MasterCore(battlefield, "S")
    assert core.ingest("Vitals", vitals([1, 2, 3], level=["S", "TS", "U"]), None) == (2, 1)
    st = core.status()
    assert st["counters"]["accepted"] == 2 and "dropped_by_shepherd" not in st["counters"]
    assert st["rejected"] == {} and st["lag_instants"] == 4.0  # latest kept instant 3, nothing released (-1)


def test_shepherd_runs_outside_the_core_lock(battlefield):
    """Another session's call never waits for a batch's above-level rows to be filtered."""
    core = MasterCore(battlefield, "S")
    free = []
    real = core.pipeline.shepherd.filter

    def filter_and_probe(table):
        t = threading.Thread(target=lambda: core.cond.acquire(timeout=5) and (free.append(True), core.cond.release()))
        t.start()
        t.join(10)
        return real(table)

    core.pipeline.shepherd.filter = filter_and_probe
    core.ingest("Vitals", vitals([1, 2], level=["S", "TS"]), None)
    assert free == [True]


def test_limits_look_at_kept_rows_only(battlefield):
    core = MasterCore(battlefield, "S")
    core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])
    with pytest.raises(Refused, match=r"ts 9223372036854775807 is beyond the largest instant accepted \(9007199254740991"):
        core.ingest("Vitals", vitals([1, MAXLONG], level=["S", "S"]), None)
    assert core.status()["counters"].get("accepted", 0) == 0  # refused whole
    assert core.ingest("Vitals", vitals([1, MAXLONG], level=["S", "TS"]), None) == (1, 1)
    with pytest.raises(Refused, match="advance to 9223372036854775807 refused: at most 3600 instants"):
        core.advance(upto_ts=MAXLONG)
    assert core.advance(upto_ts=3601) == 1  # 1 + 3600
    st = core.status()
    assert st["rejected"] == {"ts_out_of_range": 1, "advance_beyond_horizon": 1}
    with pytest.raises(ChunkingError, match="late tuple"):
        core.ingest("Vitals", vitals([5], level=["S"]), None)


def test_kept_rows_are_checked_for_types_and_order(battlefield):
    core = MasterCore(battlefield, "S")
    bad = pa.table({"ts": [1, 2], "level": ["TS", "S"], "sid": ["a", "b"], "bp": ["high", "1.5"],
                    "pr": [1.0, 1.0], "weight": [1.0, 1.0]})
    assert core.ingest("Vitals", bad, None) == (1, 1)  # the TS row's "high" is nobody's business here
    with pytest.raises(ChunkingError, match="missing columns weight"):  # columns: a property of the batch
        core.ingest("Vitals", vitals([3], level=["TS"]).drop_columns(["weight"]), None)


# ---- failing queries, retry cap, cancel -------------------------------------------------------------
def _results_ts(core, qid):
    return [t for r in core.queries[qid].results for t in r.rows.column("ts").to_pylist()]


def test_failed_query_stops_in_chunk_order_others_flow(battlefield, tmp_path):
    """Results arrive out of order; the error of chunk 3 takes effect when chunk 3 is released:
    the failing query keeps its rows of 1-2, loses those of 4-5 that arrived earlier; the other
    query of the same chunks gets everything; the stop is logged and survives a restart."""
    from strata.master.store import MasterStore, config_fingerprint

    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield))
    core = MasterCore(battlefield, "S", store=store, max_in_flight=10, adaptive=False)  # one job per chunk
    core.heartbeat("w1", 5.0)
    bad, good = (i.query_id for i in core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 5]",
                                                            "SELECT COUNT(*) FROM Vitals [ROWS 2]"]))
    core.ingest("Vitals", vitals([1, 2, 3, 4, 5], level=["S"] * 5), None)
    core.advance(upto_ts=5)
    sent = {c.chunk_id: c for c, _ in core.assignments()}
    assert sorted(sent) == [1, 2, 3, 4, 5]
    for cid in (5, 4, 3, 2):
        core.on_result(cid, "w1", _answer(core, cid, error_for=bad, error_ts=3))
        assert _results_ts(core, good) == [] and core.queries[bad].state == "running"  # nothing before chunk 1
    core.on_result(1, "w1", _answer(core, 1, error_for=bad, error_ts=3))
    assert _results_ts(core, good) == [1, 2, 3, 4, 5]
    assert _results_ts(core, bad) == [1, 2]
    info = core.queries[bad]
    assert (info.state, info.error, info.revoked_after, info.last_ts, info.ended) == \
        ("failed", "integer overflow in SUM(n)", 2, 2, True)
    released, ended = core.wait_results([bad], {}, timeout=0)
    assert len(released) == 2 and ended == [bad] and core.end_of(bad) == ("failed", "integer overflow in SUM(n)")
    assert [q["state"] for q in core.status("ana", cluster=False)["queries"]] == ["failed", "running"]
    assert core.status()["counters"]["failed_queries"] == 1
    core.ingest("Vitals", vitals([6], level=["S"]), None)
    core.advance(upto_ts=6)
    assert [qc.query_id for qc in core.pipeline.chunks[6].queries] == [good]  # its branch is not computed
    store.close()
    again = MasterCore(battlefield, "S", store=MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield)))
    again.restore()
    v = again.query_view(bad)
    assert (v["state"], v["error"], v["stopped_after"]) == ("failed", "integer overflow in SUM(n)", 2)
    assert [qc.query_id for qc in again.pipeline.chunks[6].queries] == [good]


def test_chunk_retries_are_capped_then_later_chunks_flow(battlefield):
    now = [100.0]
    core = MasterCore(battlefield, "S", clock=lambda: now[0], max_in_flight=10, chunk_retries=3,
                      adaptive=False)  # one job per chunk
    core.heartbeat("w1", 5.0)
    a = core.register("ana", ["SELECT COUNT(*) FROM Vitals [NOW]"])[0].query_id
    b = core.register("bob", ["SELECT COUNT(*) FROM Vitals [NOW level in {U}]"])[0].query_id
    core.ingest("Vitals", vitals([1, 2, 3], level=["S", "U", "U"]), None)
    core.advance(upto_ts=3)
    assert sorted(c.chunk_id for c, _ in core.assignments()) == [1, 2, 3]
    for cid in (2, 3):
        core.on_result(cid, "w1", _answer(core, cid))
    core.on_failure(1, "w1", reason="Exception calling application: boom one", kind="UNKNOWN")  # attempt 1
    assert [c.chunk_id for c, _ in core.assignments()] == [1]
    core.on_failure(1, "w1", drop_worker=True)  # the worker vanished: not the chunk's fault
    core.heartbeat("w1", 5.0)
    assert [c.chunk_id for c, _ in core.assignments()] == [1]
    now[0] += core.chunk_deadline + 1
    core.heartbeat("w1", 5.0)
    assert core.expire() == [1]  # a deadline overrun: attempt 2
    assert [c.chunk_id for c, _ in core.assignments()] == [1]
    assert core.queries[a].state == "running" and core.failed_chunks == 0
    core.on_failure(1, "w1", reason="Exception calling application: secret detail", kind="INTERNAL")  # 3: cap
    info = core.queries[a]
    assert info.state == "failed" and info.ended
    assert info.error == "the chunk of instants 1 failed 3 times on the workers (last failure: INTERNAL); query stopped"
    assert "secret detail" not in info.error
    assert _results_ts(core, b) == [2, 3]  # the chunk was released: later chunks flowed
    st = core.status()
    assert st["counters"]["failed_chunks"] == 1 and st["backlog_chunks"] == 0
    assert "instants 1" in st["last_chunk_error"] and "secret detail" in st["last_chunk_error"]
    assert core.redispatched >= 3


def test_cancel_own_queries_only_from_the_next_instant_and_after_restart(battlefield, tmp_path):
    from strata.master.store import MasterStore, config_fingerprint

    def fresh():
        return MasterCore(battlefield, "S", max_in_flight=10,
                          store=MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield)))

    core = fresh()
    core.heartbeat("w1", 5.0)
    q = core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])[0].query_id
    other = core.register("bob", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])[0].query_id
    core.ingest("Vitals", vitals([1, 2], level=["S", "S"]), None)
    core.advance(upto_ts=2)
    with pytest.raises(NotYours, match=f"query {other} is not one of this user's queries"):
        core.cancel("ana", [q, other])
    assert core.queries[q].state == "running"  # nothing stopped
    with pytest.raises(NotYours, match="query q99 is not"):  # the same answer for ids that do not exist
        core.cancel("ana", ["q99"])
    [v] = core.cancel("ana", [q])
    assert (v["state"], v["stopped_after"]) == ("cancelled", 2)
    assert not core.queries[q].ended  # instants 1-2 were closed before the cancel: they still deliver
    _drain(core)
    assert _results_ts(core, q) == [1, 2] and core.queries[q].ended
    assert core.cancel("ana", [q])[0]["state"] == "cancelled"  # again: nothing changes
    core.ingest("Vitals", vitals([3], level=["S"]), None)
    core.advance(upto_ts=3)
    assert [qc.query_id for qc in core.pipeline.chunks[3].queries] == [other]
    assert core.status()["counters"]["cancelled"] == 1
    core.store.close()
    again = fresh()
    again.restore()
    assert again.query_view(q) | {"last_ts": None} == {"query_id": q, "text": v["text"], "state": "cancelled",
                                                       "last_ts": None, "error": "", "stopped_after": 2}
    assert [qc.query_id for qc in again.pipeline.chunks[3].queries] == [other]
    again.store.close()


def test_analyst_status_holds_own_queries_only(battlefield):
    core = MasterCore(battlefield, "S")
    core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])
    core.register("bob", ["SELECT bp FROM Vitals [NOW]"])
    st = core.status("ana", cluster=False)
    assert set(st) == {"level", "queries"} and [q["query_id"] for q in st["queries"]] == ["q1"]
    assert st["queries"][0]["text"].startswith("SELECT COUNT(*) FROM Vitals [ROWS 3 level in")


# ---- sessions: roles, live role changes, bad users-file entries ----------------------------------------
def _users(tmp_path, battlefield, **people):
    users = UserStore(tmp_path / "users.json", battlefield.lattice)
    for name, (clearance, roles) in people.items():
        users.add(name, clearance, "pw", roles=roles)
    return users


def test_calls_outside_the_roles_are_refused_with_the_role_named(battlefield, tmp_path):
    users = _users(tmp_path, battlefield, ann=("TS", "analyst"), pete=("S", "producer"))
    sessions = Sessions(users, "S")
    ann = sessions.login("ann", "pw", "S").token
    pete = sessions.login("pete", "pw", "S").token
    with pytest.raises(RoleError) as e:
        sessions.require(ann, ("producer",), "Advance")
    assert str(e.value) == ("permission denied: Advance needs the producer role; ann.S has analyst "
                            "(strata users set-roles)")
    with pytest.raises(RoleError, match="needs the producer or operator role"):
        sessions.require(ann, ("producer", "operator"), "Advance(finish)")
    assert sessions.require(pete, ("producer", "operator"), "Advance(finish)").principal.user == "pete"
    assert dict(sessions.denied) == {"Advance": 1, "Advance(finish)": 1}
    with pytest.raises(AuthError):
        sessions.require("forged", ("analyst",), "Register")


def test_owner_of_a_private_master_has_every_role(battlefield, tmp_path):
    users = _users(tmp_path, battlefield, ann=("TS", "analyst"), bob=("S", "analyst"))
    sessions = Sessions(users, "S", owner="ann")
    assert sessions.login("ann", "pw", "S").principal.roles == frozenset(ROLES)
    assert sessions.login("bob", "pw", "S").principal.roles == frozenset({"analyst"})


def test_role_changes_apply_to_open_sessions(battlefield, tmp_path):
    from strata.master.users_watch import UsersWatch

    users = _users(tmp_path, battlefield, ann=("TS", "analyst"))
    sessions = Sessions(users, "S")
    watch = UsersWatch(MasterCore(battlefield, "S"), sessions, users)
    token = sessions.login("ann", "pw", "S").token
    watch.check()
    with pytest.raises(RoleError):
        sessions.require(token, ("producer",), "Ingest")
    users.set_roles("ann", "producer,operator")
    watch.check()
    assert sessions.require(token, ("producer",), "Ingest").principal.roles == {"producer", "operator"}
    with pytest.raises(RoleError):
        sessions.require(token, ("analyst",), "Subscribe")


def test_bad_users_file_entry_means_no_access_and_revocation_keeps_working(battlefield, tmp_path):
    from strata.master.users_watch import UsersWatch

    users = _users(tmp_path, battlefield, ann=("TS", "analyst"), bob=("S", "analyst"), cid=("S", "analyst"))
    core = MasterCore(battlefield, "S")
    sessions = Sessions(users, "S")
    watch = UsersWatch(core, sessions, users)
    tokens = {u: sessions.login(u, "pw", "S").token for u in ("ann", "bob", "cid")}
    qids = {u: core.register(u, ["SELECT bp FROM Vitals [NOW]"])[0].query_id for u in ("ann", "bob", "cid")}
    watch.check()
    doc = json.loads(users.path.read_text())
    doc["users"]["bob"]["clearance"] = "Secret"  # hand-edited: a level the lattice does not know
    users.path.write_text(json.dumps(doc))
    assert watch.check() == ["bob"]  # a bad entry: no access
    with pytest.raises(AuthError):
        sessions.check(tokens["bob"])
    assert core.queries[qids["bob"]].state == "revoked"
    with pytest.raises(AuthError):  # and no new login either
        sessions.login("bob", "pw", "S")
    users.set_clearance("ann", "C")  # the next switch still works
    assert watch.check() == ["ann"]
    with pytest.raises(AuthError):
        sessions.check(tokens["ann"])
    assert sessions.check(tokens["cid"]).principal.user == "cid"
    assert core.queries[qids["cid"]].state == "running"


def test_users_watcher_thread_never_dies(battlefield, tmp_path):
    from strata.master.users_watch import UsersWatch

    from .polling import wait_for

    users = _users(tmp_path, battlefield, ann=("TS", "analyst"))
    watch = UsersWatch(MasterCore(battlefield, "S"), Sessions(users, "S"), users, interval=0.01)
    calls = []
    real = watch.check

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("Secret")  # what killed the thread before
        return real()

    watch.check = flaky
    watch.start()
    try:
        wait_for(lambda: len(calls) >= 3, 10, "the watcher to keep checking after an error")
        assert watch._thread.is_alive()
    finally:
        watch.stop()


def test_results_are_kept_up_to_the_retention_and_a_gap_is_an_error(battlefield):
    """[limits] result_retention_rows bounds what a master keeps per query: the oldest results go
    first; a subscriber resuming before them, or reading slower than the retention, gets
    ResultsGone (one line), never a silent gap; one within the retention resumes as before."""
    from dataclasses import replace as dc_replace

    from strata.master.core import ResultsGone

    cfg = dc_replace(battlefield, limits=dc_replace(battlefield.limits, result_retention_rows=3))
    core = MasterCore(cfg, "S", max_in_flight=10)
    core.heartbeat("w1", 5.0)
    q = core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 5]"])[0].query_id
    slow: dict[str, int] = {}
    first, _ = core.wait_results([q], slow, timeout=0)  # a live subscriber that then stops reading
    assert first == []
    core.ingest("Vitals", vitals(list(range(1, 9)), level=["S"] * 8), None)
    core.advance(upto_ts=8)
    _drain(core)
    kept = core.queries[q].results
    assert [r.last_ts for r in kept] == [6, 7, 8] and core.queries[q].base == 5  # one row per instant
    core.check_resume([q], 5)  # has everything up to 5: resumes with 6, 7, 8
    released, _ = core.wait_results([q], {}, timeout=0)
    assert [r.last_ts for r in released] == [6, 7, 8]
    with pytest.raises(ResultsGone, match=r"results up to instant 5 are no longer kept"):
        core.check_resume([q], 4)
    with pytest.raises(ResultsGone, match="dropped before this subscriber read them"):
        core.wait_results([q], slow, timeout=0)
    assert "\n" not in str(ResultsGone("x"))


def test_results_are_kept_up_to_a_number_of_results_too(battlefield):
    """[limits] result_retention_results bounds the results a query keeps whatever their rows: a query
    of one row per instant holds one small result per chunk, each with its own overhead."""
    from dataclasses import replace as dc_replace

    from strata.master.core import ResultsGone

    cfg = dc_replace(battlefield, limits=dc_replace(battlefield.limits, result_retention_results=2))
    core = MasterCore(cfg, "S", max_in_flight=10)
    core.heartbeat("w1", 5.0)
    q = core.register("ana", ["SELECT COUNT(*) FROM Vitals [ROWS 5]"])[0].query_id
    core.ingest("Vitals", vitals(list(range(1, 9)), level=["S"] * 8), None)
    core.advance(upto_ts=8)
    _drain(core)
    assert [r.last_ts for r in core.queries[q].results] == [7, 8] and core.queries[q].kept_rows == 2
    with pytest.raises(ResultsGone, match=r"results up to instant 6 are no longer kept"):
        core.check_resume([q], 5)
