"""Load shedding with MLS semantics at a level's master (issue 33; docs/semantics.md §10).

Plain logic first (master/shedding.py): the hysteresis, whole instants (every stream, and later rows of
a decided instant), determinism and the counters.  Then a MasterCore of level S overloaded with a
tiny bound, its chunks computed by a Spark engine in this process: every query's output equals the
reference over the kept tuples, the counters and every session's status say what was shed, and a
restart from the event log keeps exactly the same rows.  Then (slow) ``strata up --levels S,TS``: TS
overloaded with shedding on; S's results and status are the same with and without the TS overload,
TS's output equals the reference over the tuples it kept, and ``strata ingest`` says what was shed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.config import Limits, parse_config
from strata.master.core import MasterCore
from strata.master.server import MasterServicer
from strata.master.sessions import Sessions
from strata.master.shedding import Decision, Shedder, ShedRule
from strata.master.store import MasterStore, config_fingerprint
from strata.rpc import strata_pb2 as pb
from strata.arrowio import from_ipc, to_ipc
from strata.users import UserStore

from .conftest import BATTLEFIELD_TOML
from .distributed import assert_reference, released
from .fakes import Context
from .helpers import stable
from .reference.evaluator import compare_results, evaluate
from .tables import rows_of, to_table, vital

#: the workers this module starts warm up (conftest.py: the suite's default skips it): what TS sheds depends on
#: how fast its worker computes: it starts warm, as users' do
WORKER_WARM_UP = True

SHED_TOML = BATTLEFIELD_TOML + '\n[limits]\noverload = "shed"\nshed_backlog_rows = 6\n'


def rule(high=10, low=5) -> Shedder:
    return Shedder(ShedRule(high, low))


def decide(sh: Shedder, stream, ts, reading, closed_until=0) -> Decision:
    d = sh.decide(stream, np.array(ts, dtype=np.int64), reading, closed_until)
    sh.commit(d)
    return d


# ---- the rule ------------------------------------------------------------------------------------------
def test_the_rule_of_the_settings():
    assert ShedRule.of(Limits()) is None  # overload = "wait": today's backpressure
    assert ShedRule.of(Limits(overload="shed")) == ShedRule(4_000_000, 2_000_000)
    assert ShedRule.of(Limits(overload="shed", shed_backlog_rows=100, shed_resume_rows=10)) == ShedRule(100, 10)
    assert ShedRule.of(Limits(overload="shed", max_backlog_rows=0)) is None  # no bound: never sheds
    with pytest.raises(ValueError):
        ShedRule(10, 10)
    cfg = parse_config(SHED_TOML)
    assert ShedRule.of(cfg.limits) == ShedRule(6, 3)
    # with "shed" no producer waits on the backlog: the level sheds instead
    core = MasterCore(cfg, "S")
    core.dispatch.backlog_rows = 10**9
    assert not core.backlog_full()


def test_hysteresis_whole_batches_of_new_instants():
    sh = rule(10, 5)
    assert decide(sh, "Vitals", [1, 1, 2], reading=0).rows == 0
    d = decide(sh, "Vitals", [3, 4], reading=10)  # at the bound: shedding starts, 3..4 are shed
    assert (d.active, d.flipped, d.rows, d.first, d.last) == (True, True, 2, 3, 4)
    d = decide(sh, "Vitals", [5], reading=7)  # below the bound, not below the low-water mark: still shedding
    assert (d.active, d.flipped, d.rows) == (True, False, 1)
    d = decide(sh, "Vitals", [6, 7], reading=4)  # below it: resumes; the new instants are kept
    assert (d.active, d.flipped, d.rows) == (False, True, 0)
    assert d.keep.all()
    assert sh.view()["ranges"] == [[3, 5]] and sh.ranges_total == 1 and sh.episodes == 1


def test_decided_instants_stay_decided_for_every_stream():
    sh = rule(10, 5)
    decide(sh, "Vitals", [1, 2], reading=0)  # 1..2 kept
    d = decide(sh, "Vitals", [3, 4, 5], reading=50)  # 3..5 shed
    assert d.rows == 3
    # another stream, later: rows of kept instants are kept while shedding, rows of shed ones are shed
    d = decide(sh, "Positions", [2, 2, 3, 5], reading=60)
    assert d.keep.tolist() == [True, True, False, False] and d.instants == 2
    # the level no longer sheds: instants 3..5 are shed all the same, 6 is new and kept
    d = decide(sh, "Positions", [5, 6], reading=0)
    assert d.keep.tolist() == [False, True] and not d.active
    assert d.instants == 0  # instant 5 of Positions was counted already
    assert sh.view()["rows"] == {"Vitals": 3, "Positions": 3}
    assert sh.view()["instants"] == {"Vitals": 3, "Positions": 2}
    # closed instants are never shed (the chunker refuses them as late), nor is a batch whose instants
    # decrease decided (the chunker refuses it whole)
    d = sh.decide("Positions", np.array([4, 7]), 0, closed_until=5)
    assert d.keep.tolist() == [True, True]
    assert sh.decide("Positions", np.array([9, 8]), 100, closed_until=0) is None


def test_ranges_merge_and_are_bounded():
    sh = rule(10, 5)
    for i in range(100):  # shed 3 instants, keep 1, in turn: 50 episodes
        decide(sh, "Vitals", [4 * i, 4 * i + 1, 4 * i + 2], reading=50, closed_until=4 * i)
        decide(sh, "Vitals", [4 * i + 3], reading=0, closed_until=4 * i)
    v = sh.view()
    assert v["ranges_total"] == 100 and len(v["ranges"]) == 32 and v["ranges"][-1] == [396, 398]
    assert v["episodes"] == 100 and v["batches"] == 100 and v["rows"] == {"Vitals": 300}
    assert len(sh.open) <= 2  # ranges wholly closed are no longer looked up


batches = st.lists(st.tuples(st.sampled_from(["Vitals", "Positions"]), st.integers(0, 6), st.integers(0, 3),
                             st.integers(0, 30)), min_size=1, max_size=40)


def _run(seq):
    """Decisions of ``seq`` ((stream, first instant offset, instants, backlog reading)), per stream in
    non-decreasing instant order, with their batches' instants; the instants of every row kept and shed."""
    sh, last = rule(12, 4), {}
    kept, shed, decisions = [], [], []
    for stream, off, n, reading in seq:
        a = last.get(stream, 0) + off
        ts = [a + k // 2 for k in range(2 * n + 1)]
        last[stream] = ts[-1]
        d = sh.decide(stream, np.array(ts), reading, closed_until=0)
        sh.commit(d)
        decisions.append((ts, d))
        kept += [t for t, k in zip(ts, d.keep) if k]
        shed += [t for t, k in zip(ts, d.keep) if not k]
    return sh, kept, shed, decisions


@settings(max_examples=200, deadline=None)
@given(batches)
def test_whole_instants_determinism_and_replay(seq):
    sh, kept, shed, decisions = _run(seq)
    assert not set(kept) & set(shed)  # every instant kept whole or shed whole, over all streams
    again = _run(seq)
    assert again[1:3] == (kept, shed) and again[0].view() == sh.view()  # deterministic
    # a restart: the logged decisions (as JSON) and the kept rows (their largest instant) give the same state
    re = rule(12, 4)
    for ts, d in decisions:
        if d.logged:
            re.commit(Decision.of_body(json.loads(json.dumps(d.body()))))
        if d.keep.any():
            re.kept(max(t for t, k in zip(ts, d.keep) if k))
    assert (re.view(), re.mark, re.active, re.last_shed, re.tail_shed) == \
        (sh.view(), sh.mark, sh.active, sh.last_shed, sh.tail_shed)
    # ... and a checkpoint's copy
    ck = rule(12, 4)
    ck.load(json.loads(json.dumps(sh.export())))
    assert ck.export() == sh.export()
    assert sum(sh.rows.values()) == sum(d.rows for _, d in decisions) == len(shed)


# ---- one master of level S, in process, its chunks computed by Spark -----------------------------------
QUERIES = ["SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]",
           "SELECT sid, SUM(bp) FROM Vitals [ROWS 4] GROUP BY sid",
           "SELECT v.sid, p.lat FROM Vitals [NOW] v, Positions [NOW] p WHERE v.sid = p.sid"]
LEVELS = ["U", "C", "S", "TS"]


def _input(t: int) -> dict[str, list[dict]]:
    """Instant ``t``'s tuples: three Vitals (one of them TS: the shepherd drops it), a Position at even
    instants."""
    vit = [vital(t, LEVELS[(t + k) % 4], f"s{(t + k) % 3}", 100 + (7 * t + k) % 40) for k in range(3)]
    pos = [{"ts": t, "level": LEVELS[t % 3], "sid": f"s{t % 3}", "lat": float(t), "lon": "e"}] if t % 2 == 0 else []
    return {"Vitals": vit, "Positions": pos}


def _drive(core, cfg, executor, instants, answer_every: int, outcomes: list) -> None:
    """Ingest ``instants`` one batch per stream and instant, each Vitals batch closing the instant
    before it; the worker (``executor``) computes what is ready only every ``answer_every`` instants,
    so the backlog builds up in between."""
    for t in instants:
        for stream, rows in _input(t).items():
            if not rows:
                continue
            o = core.ingest_batch(stream, to_table(cfg, stream, rows), None, advance_upto=t - 1 if stream == "Vitals"
                                  else None, producer=f"p/{stream}", seq=t + 1)
            outcomes.append((stream, t, o))
        if t % answer_every == 0:
            _compute(core, executor)


def _compute(core, executor) -> None:
    while True:
        got = core.assignments()
        if not got:
            return
        for chunk, sid in got:
            core.on_result(chunk.chunk_id, sid, executor.run(core.pipeline.queries, chunk.queries),
                           span=(chunk.first_ts, chunk.last_ts))


def _kept(instants, shed_ranges) -> dict[str, list[dict]]:
    def shed(t):
        return any(a <= t <= b for a, b in shed_ranges)

    out = {"Vitals": [], "Positions": []}
    for t in instants:
        if not shed(t):
            for s, rows in _input(t).items():
                out[s] += [r for r in rows if r["level"] != "TS"]
    return out


@pytest.fixture(scope="module")
def overloaded(spark, tmp_path_factory):
    """An S master overloaded with a bound of 6 rows (input of 40 instants), then finished and drained;
    its store is closed so a restart can open it."""
    from strata.worker.engine import Engine
    from strata.worker.shared import SharedExecutor

    cfg = parse_config(SHED_TOML)
    executor = SharedExecutor(Engine(spark, cfg), cfg)
    path = tmp_path_factory.mktemp("shed") / "m.sqlite"
    store = MasterStore(path, "S", config_fingerprint(cfg))
    core = MasterCore(cfg, "S", store=store, max_in_flight=4)
    core.heartbeat("w1", 5.0)
    regs = core.register("ana", QUERIES)
    outcomes: list = []
    instants = list(range(1, 41))
    _drive(core, cfg, executor, instants, answer_every=5, outcomes=outcomes)
    core.advance(finish=True)
    _compute(core, executor)
    out = released(core, regs)
    store.close()
    return {"cfg": cfg, "core": core, "regs": regs, "out": out, "outcomes": outcomes, "instants": instants,
            "path": path, "executor": executor}


@pytest.mark.spark
def test_outputs_equal_the_reference_over_the_kept_tuples(overloaded):
    core, cfg = overloaded["core"], overloaded["cfg"]
    view = core.status("ana", cluster=False)["shedding"]
    assert view["ranges_total"] <= 32 and view["episodes"] >= 2, view  # shed, resumed and shed again
    kept = _kept(overloaded["instants"], view["ranges"])
    assert 0 < len(kept["Vitals"]) < 2 * 40
    assert_reference(cfg, "S", QUERIES, kept, overloaded["out"])
    # what each producer was told agrees with the ranges: a shed batch's rows lie in them, a kept one's not
    for stream, t, o in overloaded["outcomes"]:
        in_range = any(a <= t <= b for a, b in view["ranges"])
        visible = sum(r["level"] != "TS" for r in _input(t)[stream])
        assert (o.shed, o.accepted) == ((visible, 0) if in_range else (0, visible)), (stream, t, o)
        assert o.dropped == len(_input(t)[stream]) - visible  # the shepherd's, told to this producer only


@pytest.mark.spark
def test_counters_and_every_sessions_status(overloaded):
    core, outcomes = overloaded["core"], overloaded["outcomes"]
    shed = {s: sum(o.shed for st_, _, o in outcomes if st_ == s) for s in ("Vitals", "Positions")}
    instants = {s: len({t for st_, t, o in outcomes if st_ == s and o.shed}) for s in ("Vitals", "Positions")}
    analyst = core.status("ana", cluster=False)
    assert set(analyst) == {"level", "queries", "shedding"}
    view = analyst["shedding"]
    assert view["rows"] == shed and view["instants"] == instants and view["mode"] == "shed"
    assert view["batches"] == sum(1 for *_, o in outcomes if o.shed)
    assert (view["shed_backlog_rows"], view["resume_backlog_rows"]) == (6, 3)
    counters = core.status("op")["counters"]
    assert counters["shed_rows"] == sum(shed.values()) and counters["shed_batches"] == view["batches"]
    assert counters["shed_episodes"] == view["episodes"] and counters["accepted"] == sum(o.accepted for *_, o in
                                                                                          outcomes)
    # the servicer's reply: one session of the level, not an operator, reads the same
    users = UserStore(overloaded["path"].parent / "users.json", core.config.lattice)
    users.add("ana", "S", "pw", roles=("analyst",))
    sessions = Sessions(users, "S")
    reply = MasterServicer(core, sessions).Status(pb.Empty(), Context(sessions.login("ana", "pw", "S").token))
    assert not reply.cluster and dict(reply.shedding.rows) == shed
    assert [[r.first, r.last] for r in reply.shedding.ranges] == view["ranges"]


@pytest.mark.spark
def test_a_restart_keeps_the_same_rows(overloaded):
    cfg, core = overloaded["cfg"], overloaded["core"]
    store = MasterStore(overloaded["path"], "S", config_fingerprint(cfg))
    try:
        logged = [(e.kind, e.body) for e in store.events()]
        kept_rows = {s: [] for s in ("Vitals", "Positions")}
        for e in store.events():
            if e.kind == "ingest":
                kept_rows[e.body["stream"]] += rows_of(from_ipc(e.data))
        assert any(k == "shed" for k, _ in logged)
        expected = _kept(overloaded["instants"], core.shedder.view()["ranges"])
        for s, rows in expected.items():  # the log holds exactly the kept rows: nothing shed reaches the disk
            assert sorted(r[0] for r in kept_rows[s]) == sorted(r["ts"] for r in rows)
        again = MasterCore(cfg, "S", store=store, max_in_flight=4)
        again.restore()
        assert again.shedder.view() == core.shedder.view()
        assert again.pipeline.counters["accepted"] == core.pipeline.counters["accepted"]
        again.heartbeat("w1", 5.0)
        _compute(again, overloaded["executor"])  # the restored chunks computed again: the same output
        regs = overloaded["regs"]
        out = released(again, regs)
        for r in regs:
            compare_results(out[r.query_id].rows, overloaded["out"][r.query_id].rows)
    finally:
        store.close()


def test_a_restart_sheds_the_rest_of_a_shed_instant(tmp_path, battlefield):
    """A shed instant still open when the master stops: after the restart a row of it (another stream,
    another producer) is shed all the same, a re-sent shed batch is a duplicate, and the horizon of an
    advance counts the shed instants."""
    cfg = parse_config(SHED_TOML)
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    core = MasterCore(cfg, "S", store=store)
    core.register("ana", ["SELECT COUNT(*) FROM Vitals"])
    vit = lambda ts: to_table(cfg, "Vitals", [vital(t, "S", "a", 1) for t in ts])  # noqa: E731
    assert core.ingest_batch("Vitals", vit([1, 1, 2, 2, 3, 3, 4]), None, advance_upto=3, producer="p/v", seq=1).shed == 0
    o = core.ingest_batch("Vitals", vit([5, 6, 7]), None, producer="p/v", seq=2)  # backlog 6: shed
    assert (o.shed, o.shed_first, o.shed_last, o.accepted) == (3, 5, 7, 0)
    before = core.shedder.export()
    store.close()

    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    again = MasterCore(cfg, "S", store=store)
    again.restore()
    assert again.shedder.export() == before and again.shedder.active
    assert again.ingest_batch("Vitals", vit([5, 6, 7]), None, producer="p/v", seq=2).duplicate
    pos = to_table(cfg, "Positions", [{"ts": t, "level": "S", "sid": "a", "lat": 1.0, "lon": "x"} for t in (4, 6, 8)])
    again.dispatch.backlog_rows = 0  # the workers drained meanwhile: the level resumes, 8 is new and kept
    o = again.ingest_batch("Positions", pos, None, producer="p/p", seq=1)
    assert (o.accepted, o.shed, o.shed_first, o.shed_last) == (2, 1, 6, 6)
    assert not again.shedder.active
    assert again.advance(upto_ts=7 + cfg.limits.advance_horizon) >= 0  # the horizon runs from the shed 7 too
    store.close()


def test_the_replies_say_what_was_shed(tmp_path, battlefield):
    """``IngestAck`` and ``IngestReply`` carry the shed rows and their instants; a wait-mode master's
    replies and status are as before (no shedding section)."""
    from strata.master.server import _ack, _add_batch

    cfg = parse_config(SHED_TOML)
    core = MasterCore(cfg, "S")
    core.register("ana", ["SELECT COUNT(*) FROM Vitals"])
    vit = lambda ts: to_table(cfg, "Vitals", [vital(t, "S", "a", 1) for t in ts])  # noqa: E731
    core.ingest_batch("Vitals", vit(range(8)), None, advance_upto=7)
    batch = pb.IngestBatch(stream="Vitals", arrow=to_ipc(vit([8, 9])))
    ack = _ack(batch, 2, lambda: core.ingest_batch("Vitals", vit([8, 9]), None))
    assert (ack.accepted, ack.shed, ack.shed_first_ts, ack.shed_last_ts) == (0, 2, 8, 9)
    reply = pb.IngestReply()
    assert _add_batch(reply, lambda: core.ingest_batch("Vitals", vit([10]), None))
    assert _add_batch(reply, lambda: core.ingest_batch("Vitals", vit([11, 12]), None))
    assert (reply.shed, reply.shed_first_ts, reply.shed_last_ts) == (3, 10, 12)
    plain = MasterCore(battlefield, "S")
    plain.ingest_batch("Vitals", vit(range(8)), None, advance_upto=7)
    assert "shedding" not in plain.status("ana") and "shed_rows" not in plain.status("op")["counters"]
    assert plain.ingest_batch("Vitals", vit([8, 9]), None).shed == 0


# ---- end to end: strata up --levels S,TS, TS overloaded ------------------------------------------------
# (the trusted mode's counterpart, one master process and one worker for S and TS: tests/test_trusted_e2e.py,
# whose cluster sheds and whose S-with-and-without-TS runs overload TS)
#: both levels shed at a backlog of 60 rows (a tuple counts once per query reading it); S's whole input is 24
#: tuples read by 2 queries (48 rows), so S can never reach the bound, whatever its worker's speed
E2E_TOML = BATTLEFIELD_TOML + '\n[limits]\noverload = "shed"\nshed_backlog_rows = 60\n'
E2E_USERS = {"sam": "S", "sue": ("S", "analyst"), "ann": "TS"}
S_QUERIES = ["SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]", "SELECT sid, bp FROM Vitals [ROWS 2]"]
TS_QUERIES = ["SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]",
              "SELECT sid, MAX(bp) FROM Vitals [ROWS 6] GROUP BY sid",
              "SELECT v.sid, p.lat FROM Vitals [NOW] v, Positions [NOW] p WHERE v.sid = p.sid"]
S_INSTANTS = range(1, 13)
TS_BATCHES = (600, 2400)  # TS's batches of 3 instants of 2 tuples each: at least, and at most


def _s_rows(t: int) -> list[dict]:
    return [vital(t, LEVELS[(t + k) % 3], f"s{(t + k) % 3}", 100 + (5 * t + k) % 30) for k in range(2)]


def _ts_rows(i: int) -> list[dict]:
    return [vital(t, LEVELS[(t + k) % 4], f"s{(t + k) % 3}", 90 + (11 * t + k) % 70)
            for t in range(3 * i + 1, 3 * i + 4) for k in range(2)]


def _status(cl, user: str, level: str) -> dict:
    from .helpers import strata

    r = strata("status", "--json", "--config", str(cl["config"]), "--master", cl["masters"][level], "--user", user,
               "--tls-dir", cl["tls"], "--level", level)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _collect(client, qids):
    got = {q: [] for q in qids}
    arrived: dict[str, float] = {}

    def run():
        for qid, t in client.subscribe(qids):
            if t is not None:
                got[qid].extend(rows_of(t))
                arrived[qid] = time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return got, arrived, th


def _run_s(cl, renew: bool) -> tuple[dict, dict]:
    """S from an empty master (``renew``: a new one on the same address): its queries over its 24
    tuples; what its sessions read, and when the results arrived after the input was finished."""
    from strata.deploy.local import renew_master

    from .helpers import login
    from .polling import wait_for

    if renew:
        renew_master(cl["state"], "S")
    sam, sue = login(cl, "sam", "S"), login(cl, "sue", "S")
    wait_for(lambda: len(sam.status().workers) == 1, 60, "S's worker to join its new master")
    regs = sue.register(S_QUERIES)
    got, arrived, th = _collect(sue, [r.query_id for r in regs])
    cfg = parse_config(E2E_TOML)
    replies = [sam.ingest([("Vitals", to_table(cfg, "Vitals", _s_rows(t)), t - 1)], labelled=True)
               for t in S_INSTANTS]
    finished = time.monotonic()
    sam.advance(finish=True)
    th.join(120)
    assert not th.is_alive(), "S's result streams did not end"
    seen = {"results": {q: sorted(rows, key=repr) for q, rows in got.items()},
            "replies": [(r.accepted, r.shed, r.rejected, r.error) for r in replies],
            "status_sam": stable(_status(cl, "sam", "S")), "status_sue": _status(cl, "sue", "S")}
    for c in (sam, sue):
        c.close()
    return seen, {q: arrived.get(q, finished) - finished for q in got}


@pytest.fixture(scope="module")
def two_levels(tmp_path_factory):
    from strata.deploy.local import stop_cluster

    from .helpers import write_config

    d = tmp_path_factory.mktemp("shed-e2e")
    cfg = write_config(d, E2E_TOML, E2E_USERS)
    state = d / "state"
    up = subprocess.run([sys.executable, "-m", "strata", "up", "--config", str(cfg), "--levels", "S,TS", "--workers",
                         "1", "--state-dir", str(state)], capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        started = json.loads(up.stdout)
        yield {"config": cfg, "state": state, "dir": d, "masters": started["masters"], "tls": started["tls_dir"]}
    finally:
        stop_cluster(state)


@pytest.mark.slow
def test_an_overloaded_level_sheds_and_the_other_level_sees_no_difference(two_levels):
    from .helpers import PASSWORD, login
    from .polling import wait_for

    cl = two_levels
    cfg = parse_config(E2E_TOML)
    quiet, quiet_times = _run_s(cl, renew=False)  # TS idle

    ann = login(cl, "ann", "TS")
    wait_for(lambda: len(ann.status().workers) == 1, 60, "TS's worker")
    regs = ann.register(TS_QUERIES)
    got, _, th = _collect(ann, [r.query_id for r in regs])
    sent: list[tuple[int, object]] = []
    s_done = threading.Event()

    def overload():  # TS: batches as fast as one producer sends them, each closing the instants before it
        shed = 0
        for i in range(TS_BATCHES[1]):  # on while S runs, then up to the next batch shed
            r = ann.ingest([("Vitals", to_table(cfg, "Vitals", _ts_rows(i)), 3 * i)], labelled=True)
            sent.append((i, r))
            shed += r.shed > 0
            if s_done.is_set() and i >= TS_BATCHES[0] and r.shed and shed >= 10:
                return  # the last batch shed: its instants are still open

    ts = threading.Thread(target=overload, daemon=True)
    ts.start()
    wait_for(lambda: any(r.shed for _, r in sent) or not ts.is_alive(), 60, "TS to shed")
    loaded, loaded_times = _run_s(cl, renew=True)  # S while TS sheds
    s_done.set()
    ts.join(120)
    assert not ts.is_alive()

    # S: the same results, replies and status with and without the TS overload, and equal to the reference
    for key in quiet:
        assert loaded[key] == quiet[key], key
    assert loaded["status_sue"]["shedding"]["rows"] == {} and loaded["status_sam"]["counters"]["shed_rows"] == 0
    s_input = {"Vitals": [r for t in S_INSTANTS for r in _s_rows(t)]}
    for (qid, rows), q in zip(sorted(loaded["results"].items()), S_QUERIES):
        compare_results(rows, evaluate(q, cfg, "S", s_input))
    # S's timing: its worker shares the host's 2 cores with TS's (no CPU pinning), so only a generous bound
    for q in quiet_times:
        a, b = loaded_times[q], quiet_times[q]
        assert abs(a - b) <= 5.0 + 1.0 * max(a, b), (q, a, b)

    # TS: a Positions file at the last (shed, still open) batch's instants: shed too, said in one line, exit 0
    last = sent[-1][0]
    assert sent[-1][1].shed == 6, "TS did not end on a shed batch"
    pos = cl["dir"] / "positions.csv"
    pos.write_text("ts,level,sid,lat,lon\n" + "".join(f"{t},TS,s{t % 3},{t}.5,e\n" for t in range(3 * last + 1,
                                                                                                     3 * last + 4)))
    r = subprocess.run([sys.executable, "-m", "strata", "ingest", "--config", str(cl["config"]), "--master",
                        cl["masters"]["TS"], "--user", "ann", "--level", "TS", "--tls-dir", cl["tls"], "--labelled",
                        "--finish", "--input", f"Positions={pos}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "STRATA_PASSWORD": PASSWORD})
    assert r.returncode == 0, r.stderr
    lines = [x.removeprefix("[strata] ") for x in r.stderr.splitlines() if x.startswith("[strata] shed ")]
    assert lines == [f"shed 3 tuples at instants {3 * last + 1}-{3 * last + 3}: level TS was overloaded "
                     f"([limits] overload = \"shed\"); `strata status` lists the instants shed"], r.stderr
    th.join(120)
    assert not th.is_alive(), "TS's result streams did not end"

    # TS's output equals the reference over the tuples it kept: whole batches here (each decides new instants)
    kept = []
    for i, rep in sent:
        assert (rep.shed, rep.accepted) in ((6, 0), (0, 6)) and rep.error == ""
        if not rep.shed:
            kept += _ts_rows(i)
    shed_batches = [i for i, rep in sent if rep.shed]
    assert kept and len(shed_batches) >= 10
    status = _status(cl, "ann", "TS")["shedding"]
    assert status["rows"] == {"Vitals": 6 * len(shed_batches), "Positions": 3}
    assert status["batches"] == len(shed_batches) + 1 and status["episodes"] >= 1
    if status["ranges_total"] <= len(status["ranges"]):  # every range listed: they say the same
        assert [t for a, b in status["ranges"] for t in range(a, b + 1)] == \
            [t for i in shed_batches for t in range(3 * i + 1, 3 * i + 4)]
    streams = {"Vitals": kept, "Positions": []}
    for r_, q in zip(regs, TS_QUERIES):
        compare_results(got[r_.query_id], evaluate(q, cfg, "TS", streams))
    ann.close()
