"""The trusted master in one process (docs/trusted.md): one address serves the sessions of several levels,
each call routed to the pipeline of its caller's level; the link's certificate binds the session's
level; each level's queries, input, status and counters are its own.  Plus the trusted worker core's
refusals, the levels' parsing and the group view each level's dispatch gets.  No Spark: the quick tier
(the results: tests/test_trusted_differential.py; a cluster of processes: tests/test_trusted_e2e.py).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import grpc
import pyarrow as pa
import pytest

from strata.chunking.codec import encode_chunk
from strata.client import Client, LoginFailed, SessionEnded
from strata.config import load_config, parse_config
from strata.deploy.local import start_cluster
from strata.errors import CliError
from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML
from strata.master.pipeline import QueryPipeline
from strata.master import trusted as trusted_mod
from strata.master.trusted import LevelView, serve_trusted_master
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import free_udp_port, group_spec_of
from strata.tls import create_deployment
from strata.trusted import top_of, trusted_levels
from strata.users import UserStore
from strata.worker.service import QuerySpecData, WorkerCore, WorkerRefused

from .helpers import PASSWORD, write_config
from .polling import wait_for

LEVELS = ("TS", "S")  # the top first, as strata master --trusted-levels gives them


def vitals(rows) -> pa.Table:
    n = len(rows)
    return pa.table({"ts": pa.array([t for t, _ in rows], pa.int64()), "level": [lv for _, lv in rows],
                     "sid": ["a"] * n, "bp": [100.0] * n, "pr": [1.0] * n, "weight": [1.0] * n})


def serve(tmp, tls: bool, persist: bool = False, extra_toml: str = "") -> dict:
    """A trusted master of S and TS in this process (no workers), TLS or not; with ``persist``, a state file
    per level in ``tmp`` (a second call on the same ``tmp`` restores them); ``extra_toml``: more settings."""
    cfg_path = tmp / "strata.toml"
    if not cfg_path.exists():
        write_config(tmp, BATTLEFIELD_TOML + extra_toml, {"sam": "S", "tess": "TS", "cora": "C"})
    cfg = load_config(cfg_path)
    tls_dir = tmp / "tls" if tls else None
    if tls:
        create_deployment(tls_dir, ["C", "S", "TS"])
    paths = {lv: tmp / f"master-{lv}.sqlite" for lv in LEVELS} if persist else None
    spec = group_spec_of(cfg, "TS", tmp / "state", free_udp_port(), create_key=True)
    stop, box = threading.Event(), {}
    ready = threading.Event()

    def on_ready(address, core, member):
        box["address"] = address
        ready.set()

    th = threading.Thread(target=serve_trusted_master, daemon=True,
                          args=(cfg, LEVELS, "127.0.0.1:0", spec, UserStore(cfg.users_path, cfg.lattice)),
                          kwargs={"ready": on_ready, "stop_event": stop, "tls_dir": tls_dir, "state_paths": paths})
    th.start()
    assert ready.wait(60), "the trusted master did not start"
    return {"address": box["address"], "tls": tls_dir, "stop": stop, "thread": th}


@pytest.fixture(scope="module")
def tls_master(tmp_path_factory):
    m = serve(tmp_path_factory.mktemp("trusted-tls"), tls=True)
    yield m
    m["stop"].set()
    m["thread"].join(15)


@pytest.fixture(scope="module")
def plain_master(tmp_path_factory):
    m = serve(tmp_path_factory.mktemp("trusted-plain"), tls=False)
    yield m
    m["stop"].set()
    m["thread"].join(15)


def client(m, user: str, level: str, link: str | None = None) -> Client:
    """A session of ``user`` at ``level`` over a link of level ``link`` (default ``level``)."""
    c = Client(m["address"], tls_dir=m["tls"], level=link or level)
    c.login(user, PASSWORD, level)
    return c


def test_one_address_serves_each_level_with_its_own_pipeline(tls_master):
    text = "SELECT sid, COUNT(*) FROM Vitals [ROWS 3] GROUP BY sid"
    with client(tls_master, "sam", "S") as s, client(tls_master, "tess", "TS") as t:
        assert (s.level, t.level) == ("S", "TS")
        rs, rt = s.register([text]), t.register([text, text])
        assert [r.query_id for r in rs] == ["q1"] and [r.query_id for r in rt] == ["q1", "q2"]  # ids per level
        assert "level in {U, C, S}]" in rs[0].rewritten and "level in {U, C, S, TS}]" in rt[0].rewritten
        ss, st = s.status(), t.status()
        assert (ss.level, st.level) == ("S", "TS")
        assert [q.query_id for q in ss.queries] == ["q1"] and [q.query_id for q in st.queries] == ["q1", "q2"]
        # each level's shepherd: the same labelled batch, kept up to each session's level
        both = vitals([(1, "S"), (1, "TS"), (2, "U")])
        r1, r2 = s.ingest([("Vitals", both)], labelled=True), t.ingest([("Vitals", both)], labelled=True)
        assert (r1.accepted, r1.dropped_by_shepherd, r2.accepted, r2.dropped_by_shepherd) == (2, 1, 3, 0)
        assert (s.status().counters["accepted"], t.status().counters["accepted"]) == (2, 3)
        # a cancel stops the caller's level's q1 only
        assert [q.state for q in s.cancel(["q1"])] == ["cancelled"]
        assert [q.state for q in t.status().queries] == ["running", "running"]
        # the workers table of each level: no worker here, and no CPU reading ever (LevelView)
        assert list(s.status().workers) == [] and list(t.status().workers) == []


def test_the_link_binds_the_session_level(tls_master):
    # a client of level S (its certificate) cannot log in at TS on the same address, nor the reverse
    with pytest.raises(LoginFailed, match="serves level S"):
        client(tls_master, "tess", "TS", link="S")
    with pytest.raises(LoginFailed, match="serves level TS"):
        client(tls_master, "sam", "S", link="TS")
    # a session's token over a link of another level is no session there
    with client(tls_master, "tess", "S") as s, Client(tls_master["address"], tls_dir=tls_master["tls"], level="TS") as t:
        t.token = s.token
        with pytest.raises(SessionEnded, match="invalid or expired session token"):
            t.status()
        assert s.status().level == "S"  # and it still is one on its own level's link


def test_a_certificate_of_a_level_not_served_is_refused_and_counted_at_the_top_only(tls_master):
    # a client of level C pins master.C.strata: this master holds no such certificate, the handshake fails
    with pytest.raises(Exception, match="UNAVAILABLE"):
        Client(tls_master["address"], tls_dir=tls_master["tls"], level="C", timeout=10).login("cora", PASSWORD, "C")
    # one that presents client-C but pins master.S.strata reaches the master, which refuses it
    d = tls_master["tls"]
    creds = grpc.ssl_channel_credentials((d / "ca.pem").read_bytes(), (d / "client-C.key").read_bytes(),
                                         (d / "client-C.pem").read_bytes())
    with grpc.secure_channel(tls_master["address"], creds, [("grpc.ssl_target_name_override", "master.s.strata")]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            rpc.MasterStub(ch).Login(pb.LoginRequest(user="cora", password=PASSWORD, level="C"), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.value.details() == "certificate of level C; this server is of levels TS, S"
    with client(tls_master, "tess", "TS") as t, client(tls_master, "tess", "S") as s:
        assert t.status().rejected["transport:tls_wrong_level"] >= 1
        assert not any(k.startswith("transport:") for k in s.status().rejected)


def test_without_tls_a_login_goes_to_its_level_and_a_call_to_its_token_level(plain_master):
    with client(plain_master, "tess", "S") as s, client(plain_master, "tess", "TS") as t:
        assert (s.status().level, t.status().level) == ("S", "TS")
        s.register(["SELECT bp FROM Vitals [NOW]"])
        assert len(s.status().queries) == 1 and len(t.status().queries) == 0
    for level in ("C", "", "nope"):
        with pytest.raises(LoginFailed, match="this master serves levels TS, S; log in at one of them"):
            client(plain_master, "tess", level)
    with Client(plain_master["address"]) as c:
        c.token = "not a session"
        with pytest.raises(SessionEnded, match="invalid or expired"):
            c.status()


def test_a_restarted_trusted_master_restores_each_level_from_its_own_state_file(tmp_path):
    m = serve(tmp_path, tls=False, persist=True)
    try:
        with client(m, "tess", "S") as s, client(m, "tess", "TS") as t:
            s.register(["SELECT bp FROM Vitals [NOW]"])
            t.register(["SELECT bp FROM Vitals [ROWS 1]", "SELECT sid FROM Vitals [NOW]"])
            t.ingest([("Vitals", vitals([(1, "TS"), (2, "S")]))], labelled=True)
            tokens = (s.token, t.token)
    finally:
        m["stop"].set()
        m["thread"].join(15)
    m = serve(tmp_path, tls=False, persist=True)
    try:
        with Client(m["address"]) as s, Client(m["address"]) as t:
            s.token, t.token = tokens  # the sessions came back, each on its level
            assert [q.text for q in s.status().queries] == ["SELECT bp FROM Vitals [NOW level in {U, C, S}]"]
            st = t.status()
            assert len(st.queries) == 2 and st.counters["accepted"] == 2 and s.status().counters["accepted"] == 0
    finally:
        m["stop"].set()
        m["thread"].join(15)


def test_a_lowered_clearance_ends_the_sessions_and_queries_of_the_levels_above_it_only(tmp_path):
    m = serve(tmp_path, tls=False)
    try:
        with client(m, "tess", "S") as s, client(m, "tess", "TS") as t:
            s.register(["SELECT bp FROM Vitals [NOW]"])
            t.register(["SELECT bp FROM Vitals [NOW]"])
            cfg = load_config(tmp_path / "strata.toml")
            UserStore(cfg.users_path, cfg.lattice).set_clearance("tess", "S")  # the users-file watch of each level
            wait_for(lambda: _ended(t), 15, "the TS session to end")
            assert [q.state for q in s.status().queries] == ["running"]  # S: still cleared
    finally:
        m["stop"].set()
        m["thread"].join(15)


def _ended(c) -> bool:
    try:
        c.status()
    except SessionEnded:
        return True
    return False


def test_under_fixed_slots_each_levels_calls_and_dispatch_run_in_its_own_slots(tmp_path, monkeypatch):
    """The trusted master takes turns (strata/turns.py): every call of a level's front, its dispatch steps and
    checkpoints wait for the level's slot; the rounds lie on the epoch's grid (as in the trusted workers).
    An S call made at the start of TS's slot returns only once S's next slot has opened."""
    made = []
    real = trusted_mod.make_turns

    def capture(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(trusted_mod, "make_turns", capture)
    slot = 0.1
    m = serve(tmp_path, tls=False, persist=True,
              extra_toml=f'\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = {slot}\n')
    try:
        turns = made[0]
        assert turns.levels == ("S", "TS") and turns.period == 2 * slot
        with client(m, "sam", "S") as s, client(m, "tess", "TS") as t:
            s.register(["SELECT sid, COUNT(*) FROM Vitals [ROWS 3] GROUP BY sid"])
            for i in range(3):
                s.ingest([("Vitals", vitals([(i, "S")]))], labelled=True)
                t.ingest([("Vitals", vitals([(i, "TS")]))], labelled=True)
            late = []
            for _ in range(5):  # an S call at the start of TS's slot (the round's second half) waits for S's
                now = time.time()
                ts_start = math.floor(now / turns.period) * turns.period + slot
                if ts_start < now:
                    ts_start += turns.period
                time.sleep(ts_start + 0.01 - now)  # the test's own phase, not a synchronisation
                s.status()
                late.append(time.time() - (ts_start + slot))  # S's next slot opens at ts_start + slot
            assert min(late) >= -0.005, late
            # each level's operators read its own turn figures (volatile: the status's timings)
            tim_s, tim_t = s.status().timings, t.status().timings
            assert tim_s["turns_calls"] > 5 and tim_t["turns_calls"] > 2 and tim_s["turns_waited_ms"] > 0
            assert tim_s["turns_calls"] != tim_t["turns_calls"]
        # every admission of a level was in a slot of that level; the dispatch loops took turns too
        # more than the clients' calls (S: login, register, 3 ingests, 5 + 1 status; TS: login, 3 ingests, 1
        # status): the dispatch steps took turns too
        assert turns.stats("S")["calls"] > 11 and turns.stats("TS")["calls"] > 5
        # and only when there was something to do: an idle dispatch loop takes a turn about once a second, not
        # in a loop (the changes its own steps make are not news to it)
        assert turns.stats("S")["calls"] < 150 and turns.stats("TS")["calls"] < 150, (turns.stats("S"), turns.stats("TS"))
        for lv in ("S", "TS"):
            assert all(lv in runs for runs, _start, _end, _t0 in turns.admissions[lv])
        wall_less_mono = time.time() - time.monotonic()
        starts = [start + wall_less_mono for _runs, start, _end, _t0 in turns.admissions["S"]]
        assert all(abs(x / turns.period - round(x / turns.period)) * turns.period < 0.005 for x in starts)
    finally:
        m["stop"].set()
        m["thread"].join(15)


def test_standby_calls_are_refused(plain_master):
    with grpc.insecure_channel(plain_master["address"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            rpc.MasterStub(ch).Probe(pb.ProbeRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- the trusted worker core: each level's chunk checked as that level's worker would -------------------
@pytest.fixture(scope="module")
def battlefield_cfg():
    return parse_config(BATTLEFIELD_TOML)


def ts_chunk(cfg) -> bytes:
    """An encoded chunk of a TS pipeline holding a TS tuple, for ``SELECT bp FROM Vitals [NOW]``."""
    p = QueryPipeline(cfg, "TS")
    p.add_query("SELECT bp FROM Vitals [NOW]")
    p.ingest("Vitals", vitals([(1, "TS"), (1, "S")]))
    return encode_chunk(p.finish()[0])


def test_trusted_worker_core_refusals(battlefield_cfg):
    w = WorkerCore(battlefield_cfg, "TS", engine=None, levels=("S", "TS"))
    assert w.levels == ("S", "TS")
    body = ts_chunk(battlefield_cfg)
    spec = QuerySpecData("q1", "SELECT bp FROM Vitals [NOW]", "S")
    with pytest.raises(WorkerRefused, match="this worker serves levels S, TS, not C"):
        w.execute("C", [QuerySpecData("q1", spec.text, "C")], body)
    with pytest.raises(WorkerRefused, match="query q1 runs at TS; this worker serves S"):
        w.execute("S", [QuerySpecData("q1", spec.text, "TS")], body)
    # a chunk sent as level S holding a TS tuple: refused although the worker's top dominates TS
    with pytest.raises(WorkerRefused, match="level S does not dominate"):
        w.execute("S", [spec], body)
    assert w.refused == {"wrong_level": 2, "level_above_worker": 1}
    with pytest.raises(ValueError, match="cannot serve TS"):
        WorkerCore(battlefield_cfg, "S", engine=None, levels=("S", "TS"))
    # a worker of one level: as before
    one = WorkerCore(battlefield_cfg, "S", engine=None)
    with pytest.raises(WorkerRefused, match="this worker serves level S, not TS"):
        one.execute("TS", [], body)


# ---- levels, the group view, the cluster's refusals ------------------------------------------------------
def test_trusted_levels(battlefield_cfg):
    assert trusted_levels(battlefield_cfg, "TS", "S,U") == ("TS", "U", "S")
    assert trusted_levels(battlefield_cfg, "TS", "TS,S") == ("TS", "S")
    assert trusted_levels(battlefield_cfg, "S", "") == ()
    with pytest.raises(CliError, match="TS not dominated by --level S"):
        trusted_levels(battlefield_cfg, "S", "C,TS")
    with pytest.raises(CliError, match="--trusted-levels"):
        trusted_levels(battlefield_cfg, "TS", "S,Q")
    assert top_of(battlefield_cfg.lattice, ["C", "S", "U"]) == "S"
    wall = parse_config(AUDIT_TOML)
    assert top_of(wall.lattice, ["[1,A]", "[2,B]"]) is None  # incomparable: no top
    assert top_of(wall.lattice, ["[1,A]", "[1,⊥]"]) == "[1,A]"


@dataclass(frozen=True)
class _Beat:
    cpu: float
    state: str = "ready"


class _Member:
    def snapshot(self):
        return {"w1": _Beat(97.0), "w2": _Beat(3.0)}

    def claimed(self):
        return ["w1"]


def test_each_level_sees_the_workers_without_their_cpu_and_only_the_top_proves_addresses():
    low, top = LevelView(_Member()), LevelView(_Member(), prove=True)
    assert {s: hb.cpu for s, hb in low.snapshot().items()} == {"w1": 0.0, "w2": 0.0}
    assert not hasattr(low, "claimed") and top.claimed() == ["w1"]


def test_the_cluster_refuses_what_a_trusted_group_cannot_do(tmp_path):
    cfg = write_config(tmp_path, BATTLEFIELD_TOML, {})
    with pytest.raises(CliError, match="no standbys yet"):
        start_cluster(str(cfg), ["S", "TS"], 1, tmp_path / "state2", mode="trusted", standby=True)
    wall = write_config(tmp_path, AUDIT_TOML, {})
    with pytest.raises(CliError, match="no level of .* dominates the others"):
        start_cluster(str(wall), ["[1,A]", "[2,B]"], 1, tmp_path / "state3", mode="trusted")

