"""Standby masters (issue 31): a second master per level follows the active one's event log over the
level's mutual TLS and takes over when it dies; fencing keeps a replaced master from driving the
workers; clients know the level's masters.

Plain logic first (no network): the store's shipped writes and copies rebuild exactly the active's
state; the shipper's synchronous confirmations and its bounded wait; the decisions (start, takeover,
epoch); the workers' fencing; the client's address list.  Then two masters in this process on
loopback (no Spark): follow, refuse, take over, resume, a returning master follows.  Then (slow)
``strata up --standby``: ``strata query`` and ``strata ingest`` with ``--master a,b`` through a
kill -9 of the active master, the output equal to the reference; the old master restarted is a
standby that refuses a producer, and the worker refuses its old epoch.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pyarrow as pa
import pytest

from strata.client import Client, ClientError, master_addresses
from strata.groups import AUTH_HEADER, execute_digest, sign_request
from strata.master.core import MasterCore
from strata.master.log_shipping import LogShipper
from strata.master.standby import PeerView, next_epoch, standby_refusal, start_decision, takeover_decision
from strata.master.store import MasterStore, StateMismatch, config_fingerprint
from strata.rpc import strata_pb2 as pb

from .polling import wait_for
from .tables import counting
from .test_exactly_once import BATCHES, QUERIES, snapshot, vitals

P = "pete/run-1"


# ---- the store: shipped writes and copies ---------------------------------------------------------------
def _shipping(store: MasterStore) -> list:
    """Capture what ``store`` ships, through JSON as on the wire."""
    shipped = []
    store.listener = lambda kind, body, data: shipped.append((kind, json.loads(json.dumps(body)), data))
    return shipped


def _same_files(a: MasterStore, b: MasterStore) -> None:
    assert list(a.events()) == list(b.events())
    assert a.last_seq() == b.last_seq()
    assert a.producers() == b.producers()
    assert sorted(a.sessions()) == sorted(b.sessions())
    assert a.read_checkpoint() == b.read_checkpoint()
    assert a.epoch() == b.epoch()


def _restored(store: MasterStore, cfg) -> MasterCore:
    core = MasterCore(cfg, "S", chunk_instants=2, store=store)
    core.restore()
    return core


def _feed(core: MasterCore, seqs, producer=P, offset=0):
    """Batches ``BATCHES[0..]`` under the producer's ``seqs``, their instants moved by ``offset``."""
    for k, seq in enumerate(seqs):
        ts, upto = BATCHES[k]
        ts = [t + offset for t in ts]
        core.ingest_batch("Vitals", vitals(ts, bp=counting(10.0 * seq)), None, advance_upto=None if upto is None else upto + offset,
                          producer=producer, seq=seq)


@pytest.mark.parametrize("copy_at", ["start", "after-batches", "inside-a-checkpoint"])
def test_a_copy_plus_the_shipped_writes_rebuild_the_active_state(tmp_path, battlefield, copy_at):
    """Whatever the point where a standby attaches, its file (the copy, then every record shipped after it)
    holds the active's events under the same seq numbers, its producers' marks (also of a batch that
    logged no event), sessions, checkpoint and epoch, and restores to the same state."""
    fp = config_fingerprint(battlefield)
    a = MasterStore(tmp_path / "a.sqlite", "S", fp)
    shipped = _shipping(a)
    core = MasterCore(battlefield, "S", chunk_instants=2, store=a)
    copy, start = tmp_path / "copy.sqlite", []

    def attach():
        a.snapshot_to(copy, then=lambda: start.append(len(shipped)))

    if copy_at == "start":
        attach()
    a.save_session("token-1", "ann", "S", time.time())
    core.register("ann", QUERIES)
    _feed(core, [1, 2, 3])
    if copy_at == "after-batches":
        attach()
    a.save_session("token-2", "bob", "S", time.time())
    ts_only = pa.table({"ts": pa.array([9], pa.int64()), "level": ["TS"], "sid": ["x"], "bp": [1.0], "pr": [1.0],
                        "weight": [1.0]})
    core.ingest_batch("Vitals", ts_only, None, producer="pete/other", seq=4)  # no event: a mark only
    a.drop_session(__import__("strata.master.store", fromlist=["token_digest"]).token_digest("token-1"))
    if copy_at == "inside-a-checkpoint":  # the copy is taken between two transactions of a checkpoint
        a.CHECKPOINT_BATCH_BYTES = 1
        real = a.write_checkpoint

        def write_checkpoint(upto, parts):
            def spy():
                for k, part in enumerate(parts):
                    if k == 1:
                        attach()
                    yield part
            return real(upto, spy())

        a.write_checkpoint = write_checkpoint
    core.checkpoint()
    _feed(core, [5, 6, 7], offset=10)
    a.drop_user_sessions("bob")
    a.set_epoch(3, "127.0.0.1:1")
    assert start, "no copy taken"

    b = MasterStore(tmp_path / "b.sqlite", "S", fp)
    b.append("register", {"query_id": "q9", "owner": "x", "text": "a tail of its own"})  # a diverged tail
    b.install_snapshot(copy)
    for kind, body, data in shipped[start[0]:]:
        b.apply_shipped(kind, body, data)
    _same_files(a, b)
    assert any(k == "ckpt_swap" for k, _, _ in shipped) and b.read_checkpoint()
    ra, rb = _restored(a, battlefield), _restored(b, battlefield)
    assert snapshot(ra) == snapshot(rb)
    assert ra.producers == rb.producers == {P: 7, "pete/other": 4}
    assert sorted(ra.queries) == sorted(rb.queries) == ["q1", "q2"]
    a.close()
    b.close()


def test_a_copy_of_another_level_is_refused_and_changes_nothing(tmp_path, battlefield):
    fp = config_fingerprint(battlefield)
    other = MasterStore(tmp_path / "ts.sqlite", "TS", fp)
    other.snapshot_to(tmp_path / "copy.sqlite")
    mine = MasterStore(tmp_path / "s.sqlite", "S", fp)
    mine.append("register", {"query_id": "q1", "owner": "ann", "text": "x"})
    with pytest.raises(StateMismatch, match="of level TS"):
        mine.install_snapshot(tmp_path / "copy.sqlite")
    assert [e.seq for e in mine.events()] == [1]
    with pytest.raises(ValueError, match="unknown shipped record 'nonsense'"):
        mine.apply_shipped("nonsense", {}, None)
    other.close()
    mine.close()


# ---- the shipper: synchronous confirmations, bounded -------------------------------------------------------
def test_writes_wait_for_a_standby_in_sync_and_a_silent_one_is_detached(tmp_path, battlefield):
    store = MasterStore(tmp_path / "a.sqlite", "S", config_fingerprint(battlefield))
    sh = LogShipper(store, ack_seconds=0.3)
    store.append("register", {"query_id": "q1"})  # before any standby: shipped to nobody
    f = sh.attach("standby-1", tmp_path / "copy.sqlite")
    assert f.base == 1 and (tmp_path / "copy.sqlite").stat().st_size > 0
    store.append("register", {"query_id": "q2"})
    [(lsn, kind, body, _)] = sh.take(f, 0)
    assert (lsn, kind) == (2, "batch") and body["events"][0][:2] == [2, "register"]
    t0 = time.monotonic()
    assert sh.wait() and time.monotonic() - t0 < 0.1  # not in sync yet (its copy is not confirmed): no wait
    sh.confirm(f, 2)
    assert f.synced and sh.in_sync() == 1
    store.append("register", {"query_id": "q3"})
    threading.Timer(0.1, lambda: (sh.take(f, 0), sh.confirm(f, 3))).start()
    t0 = time.monotonic()
    assert sh.wait()  # acknowledged once the standby confirmed it
    assert 0.05 < time.monotonic() - t0 < 0.3
    store.append("register", {"query_id": "q4"})
    t0 = time.monotonic()
    assert not sh.wait()  # it never confirms: detached after ack_seconds, the active goes on alone
    assert 0.25 < time.monotonic() - t0 < 1.0
    assert f.detached and sh.detached == 1 and sh.in_sync() == 0
    store.append("register", {"query_id": "q5"})
    assert sh.take(f, 0) == [] and sh.wait()
    sh.drop(f)
    sh.pool.shutdown()
    store.close()


def test_a_standby_too_far_behind_is_detached(tmp_path, battlefield):
    store = MasterStore(tmp_path / "a.sqlite", "S", config_fingerprint(battlefield))
    sh = LogShipper(store, max_queue_bytes=1000)
    f = sh.attach("slow", tmp_path / "copy.sqlite")
    store.append("ingest", {"stream": "Vitals"}, b"x" * 2000)
    assert f.detached and "bytes of records waiting" in f.detached and not f.queue
    sh.pool.shutdown()
    store.close()


# ---- decisions ----------------------------------------------------------------------------------------
def V(role, epoch=1, seq=10, address="m", synced=False, owner="o"):
    return PeerView(role, epoch, seq, address, synced, owner)


def test_a_starting_master_follows_an_active_one_and_goes_active_only_alone_or_newest():
    me = V("starting", 1, 10, "a")
    assert start_decision(me, {"b": V("active", 2, 5, "b")}, 0) == ("follow", "b")
    # the highest epoch among several actives (a partition healed): the other one is fenced at the workers
    assert start_decision(me, {"b": V("active", 2, address="b"), "c": V("active", 3, address="c")}, 0) == \
        ("follow", "c")
    assert start_decision(me, {"b": None}, 0) == ("active", None)  # nobody answers
    assert start_decision(me, {}, 0) == ("active", None)  # no peers at all
    # a standby that may take over (it has a whole copy) is let to; one that may not does not count
    assert start_decision(me, {"b": V("standby", synced=True, address="b")}, 30) == ("wait", None)
    assert start_decision(me, {"b": V("standby", synced=False, address="b")}, 0) == ("active", None)
    # masters starting together: wait a moment, then the newest history goes active, the other waits
    assert start_decision(me, {"b": V("starting", 1, 5, "b")}, 0.1) == ("wait", None)
    assert start_decision(me, {"b": V("starting", 1, 5, "b")}, 2) == ("active", None)
    assert start_decision(me, {"b": V("starting", 1, 50, "b")}, 2) == ("wait", None)
    assert start_decision(me, {"b": V("starting", 2, 1, "b")}, 2) == ("wait", None)
    assert start_decision(V("starting", 1, 10, "b"), {"a": V("starting", 1, 10, "a")}, 2) == ("active", None)


def test_a_standby_takes_over_only_with_a_whole_copy_after_the_silence():
    me = V("standby", 1, 10, "b", synced=True)
    assert takeover_decision(me, {"a": None}, 0.5, 2.0) == ("wait", None)
    assert takeover_decision(me, {"a": None}, 2.0, 2.0) == ("takeover", None)
    assert takeover_decision(me, {"a": V("starting", 1, 12, "a")}, 3.0, 2.0) == ("takeover", None)  # restarting
    assert takeover_decision(me, {"a": V("active", 1, 12, "a")}, 9.0, 2.0) == ("follow", "a")  # it answers
    assert takeover_decision(V("standby", 1, 10, "b"), {"a": None}, 60, 2.0) == ("wait", None)  # never synced
    # two standbys in sync (three masters): the one with the newer history takes over
    assert takeover_decision(me, {"a": None, "c": V("standby", 1, 11, "c", True)}, 5, 2.0) == ("wait", None)
    assert takeover_decision(me, {"a": None, "c": V("standby", 1, 9, "c", True)}, 5, 2.0) == ("takeover", None)


def test_the_epoch_of_a_new_active_master_is_above_every_one_it_knows():
    assert next_epoch(0, {}) == 1
    assert next_epoch(4, {"a": None}) == 5
    assert next_epoch(1, {"a": V("starting", 7), "b": V("standby", 2)}) == 8


def test_the_refusal_line():
    assert standby_refusal("S", "10.0.0.1:7000") == \
        "this master of level S is a standby; the active one is 10.0.0.1:7000"
    assert standby_refusal("S", "").endswith("the active one is unknown")


# ---- fencing at the workers --------------------------------------------------------------------------------
class _Ctx:
    def __init__(self, md=()):
        self.md = list(md)

    def invocation_metadata(self):
        return self.md

    def abort(self, code, message):
        raise AssertionError(f"aborted: {code.name} {message}")


def test_the_epoch_is_signed_and_absent_from_the_digest_of_a_master_without_standbys():
    head = pb.ExecuteRequest(level="S", queries=[pb.QuerySpec(query_id="q1", text="SELECT 1", level="S")])
    assert execute_digest(head, b"chunk") == execute_digest(pb.ExecuteRequest(level="S", queries=head.queries,
                                                                              epoch=0), b"chunk")
    with_epoch = pb.ExecuteRequest(level="S", queries=head.queries, epoch=2)
    assert execute_digest(with_epoch, b"chunk") != execute_digest(head, b"chunk")
    assert execute_digest(with_epoch, b"chunk") != execute_digest(pb.ExecuteRequest(level="S", queries=head.queries,
                                                                                    epoch=3), b"chunk")


def test_a_worker_refuses_an_execute_of_an_older_epoch(battlefield):
    from strata.worker.server import WorkerServicer
    from strata.worker.service import WorkerCore, WorkerFenced

    core = WorkerCore(battlefield, "S", engine=None)
    core.fence(0)  # a master without standbys: never fenced, never remembered
    core.fence(2)
    core.fence(2)
    with pytest.raises(WorkerFenced, match="^fenced: epoch 1 is older than epoch 2 this worker has seen"):
        core.fence(1)
    core.fence(0)
    core.fence(3)
    assert core.epoch == 3 and core.refused["stale_epoch"] == 1

    key = os.urandom(32)
    sv = WorkerServicer(core, key)

    def execute(epoch, signed_epoch=None):
        req = pb.ExecuteRequest(level="S", chunk=b"", epoch=epoch)
        signed = pb.ExecuteRequest(level="S", chunk=b"", epoch=epoch if signed_epoch is None else signed_epoch)
        return sv.Execute(req, _Ctx([(AUTH_HEADER, sign_request(key, "S", execute_digest(signed)))]))

    with pytest.raises(AssertionError, match="aborted: FAILED_PRECONDITION fenced: epoch 2 is older than epoch 3"):
        execute(2)
    with pytest.raises(AssertionError, match="aborted: UNAUTHENTICATED"):  # the epoch is signed: no raising it
        execute(9, signed_epoch=2)
    assert core.refused["stale_epoch"] == 2 and core.refused["unauthenticated"] == 1 and core.epoch == 3


def test_a_master_signs_its_epoch_and_steps_down_when_a_worker_fences_it(tmp_path, battlefield):
    """The dispatch loop signs its epoch into each Execute; a worker's ``fenced`` refusal is not a failed
    attempt of the chunk: the master steps down (stops serving clients, the process stops)."""
    from strata.groups import verify_request
    from strata.master.dispatch_loop import DispatchLoop
    from strata.master.standby import Fenced, Node

    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield))
    node = Node("S", store, [], os.urandom(32))
    node.role = "active"
    assert node.gate() is None
    core = MasterCore(battlefield, "S", chunk_instants=2)
    core.register("ann", ["SELECT COUNT(*) FROM Vitals"])
    core.ingest("Vitals", vitals([1, 2, 3, 4]), None)
    core.advance(upto_ts=4)
    core.heartbeat("w:1", 0.0)
    [(chunk, sid)] = core.assignments()
    key, sent = os.urandom(32), []

    class Future:
        def add_done_callback(self, fn):
            fn(self)

        def result(self):
            raise _Rpc(grpc.StatusCode.FAILED_PRECONDITION, "fenced: epoch 4 is older than epoch 5 this worker has seen")

    class Execute:
        def future(self, wire, timeout=None, metadata=None):
            sent.append((pb.ExecuteRequest.FromString(wire), dict(metadata)[AUTH_HEADER]))
            return Future()

    loop = DispatchLoop(core, key, None, epoch=4, on_fenced=node.fenced)
    loop._executes[sid] = Execute()
    loop._send(chunk, sid)
    [(req, header)] = sent
    assert req.epoch == 4 and verify_request(key, "S", execute_digest(req), header)
    assert isinstance(node.failure, Fenced) and str(node.failure).startswith("fenced: worker w:1: fenced: epoch 4")
    assert node.stop.is_set() and node.gate()[0] == grpc.StatusCode.UNAVAILABLE
    assert core.dispatcher.owner(chunk.chunk_id) == sid and not core.failed_chunks  # not counted against the chunk
    node.role = "standby"
    node.active = "10.0.0.2:7000"
    assert node.gate() == (grpc.StatusCode.FAILED_PRECONDITION, standby_refusal("S", "10.0.0.2:7000"))
    store.close()


# ---- the client: the level's masters -------------------------------------------------------------------
class _Rpc(grpc.RpcError):
    def __init__(self, code, details=""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _Stub:
    def __init__(self, login=None, streams=None):
        self.login, self.streams_ = login, streams
        self.calls = 0

    def _answer(self, what):
        self.calls += 1
        if isinstance(what, Exception):
            raise what
        return what

    def Login(self, req, timeout=None, **kw):
        return self._answer(self.login)

    def Streams(self, req, metadata=None, timeout=None):
        return self._answer(self.streams_)


def _client(monkeypatch, stubs: dict, address=None):
    def use(self, address):
        self.address, self.channel, self.stub = address, None, stubs[address]

    monkeypatch.setattr(Client, "_use", use)
    return Client(address or ",".join(stubs))


def _standby_of(active):
    return _Rpc(grpc.StatusCode.FAILED_PRECONDITION, standby_refusal("S", active))


OK = pb.LoginReply(token="t", level="S", master_level="S", roles=["producer"])


def test_the_client_logs_in_at_whichever_master_is_active(monkeypatch):
    assert master_addresses("a:1, b:2,a:1") == ["a:1", "b:2"] and master_addresses(["x:1"]) == ["x:1"]
    with pytest.raises(ValueError):
        master_addresses(" , ")
    down = _Rpc(grpc.StatusCode.UNAVAILABLE, "connection refused")
    stubs = {"a:1": _Stub(down), "b:2": _Stub(_standby_of("c:3")), "c:3": _Stub(OK)}
    c = _client(monkeypatch, stubs)
    assert c.login("ann", "pw", "S") == "S" and c.address == "c:3" and c.token == "t"
    # a refusal that is not about where the active master is ends the login
    stubs = {"a:1": _Stub(_Rpc(grpc.StatusCode.UNAUTHENTICATED, "login failed")), "b:2": _Stub(OK)}
    with pytest.raises(ClientError, match="login failed"):
        _client(monkeypatch, stubs).login("ann", "bad", "S")
    # none active: the standby's refusal (it names the active one), not the last unreachable one
    stubs = {"a:1": _Stub(_standby_of("b:2")), "b:2": _Stub(down)}
    with pytest.raises(ClientError) as e:
        _client(monkeypatch, stubs).login("ann", "pw", "S")
    assert e.value.code == "FAILED_PRECONDITION" and e.value.details.endswith("the active one is b:2")
    # one address (as before): a standby's refusal is not a reason to move on
    c = _client(monkeypatch, {"a:1": _Stub(_standby_of("b:2"))})
    assert not c.several and not c.moves_on(_standby_of("b:2")) and c.moves_on(down)
    with pytest.raises(ClientError, match="is a standby"):
        c.login("ann", "pw", "S")


def test_after_a_lost_connection_the_client_keeps_its_session_on_the_new_active_master(monkeypatch):
    standby = _standby_of("a:1")
    b = _Stub(OK, streams=pb.StreamsReply())
    stubs = {"a:1": _Stub(OK, streams=_Rpc(grpc.StatusCode.UNAVAILABLE)), "b:2": b}
    c = _client(monkeypatch, stubs)
    c.login("ann", "pw", "S")
    assert c.address == "a:1"
    b.streams_ = standby  # the standby has not taken over yet ...
    threading.Timer(0.5, lambda: setattr(b, "streams_", pb.StreamsReply())).start()  # ... now it has
    c._find_active(time.monotonic() + 10, keep_session=True)
    assert c.address == "b:2" and b.login is OK and stubs["b:2"].calls >= 2
    # a session the new active master does not hold: logged in again there
    b.streams_ = _Rpc(grpc.StatusCode.UNAUTHENTICATED, "invalid or expired session token")
    b.login = pb.LoginReply(token="t2", level="S", master_level="S")
    c._use("a:1")
    c._find_active(time.monotonic() + 10, keep_session=True)
    assert (c.address, c.token) == ("b:2", "t2")
    stubs["a:1"].streams_ = stubs["a:1"].login = b.login = b.streams_ = _Rpc(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(ClientError, match="no active master among a:1, b:2 in time"):
        c._find_active(time.monotonic() + 0.5, keep_session=True)


def test_the_masters_come_from_the_option_or_the_configuration(tmp_path):
    import argparse

    from strata.commands import master_of
    from strata.errors import CliError

    from .conftest import BATTLEFIELD_TOML

    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + '\n[groups."TS"]\nmasters = ["10.0.0.1:7000", "10.0.0.2:7000"]\n')
    ns = lambda **kw: argparse.Namespace(**({"config": str(cfg), "master": None, "level": None} | kw))  # noqa: E731
    assert master_of(ns(master="h:1,h:2")) == "h:1,h:2"
    assert master_of(ns(level="TS")) == "10.0.0.1:7000,10.0.0.2:7000"
    assert master_of(ns()) == "10.0.0.1:7000,10.0.0.2:7000"  # the only level listing masters
    with pytest.raises(CliError, match=r"give --master HOST:PORT"):
        master_of(ns(level="S"))


def test_strata_up_names_the_standby_for_restart(tmp_path):
    from strata.deploy.local import process_name

    (tmp_path / "cluster.json").write_text(json.dumps({"processes": [
        {"name": n} for n in ("master-S", "master-S-standby", "worker-S-0")]}))
    assert process_name(tmp_path, "master:S:standby") == "master-S-standby"
    assert process_name(tmp_path, "master:S") == "master-S"


# ---- two masters in this process, on loopback (no workers) ------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Masters:
    """Masters of level S with peers, each in a thread (insecure: the group key signs their calls)."""

    def __init__(self, tmp_path, n=2):
        from strata.config import load_config
        from strata.examples import BATTLEFIELD_TOML
        from strata.groups.membership import GroupSpec
        from strata.serving import free_udp_port
        from strata.users import ROLES, UserStore

        (tmp_path / "strata.toml").write_text(BATTLEFIELD_TOML)
        self.cfg = load_config(tmp_path / "strata.toml")
        self.users = UserStore(self.cfg.users_path, self.cfg.lattice)
        self.users.add("ann", "TS", "pw", replace=True, roles=ROLES)
        self.spec = GroupSpec("S", "239.255.79.3", free_udp_port(), os.urandom(32), interval=0.1)
        self.dir = tmp_path
        self.addresses = [f"127.0.0.1:{_port()}" for _ in range(n)]
        self.runs: dict[str, tuple] = {}

    def start(self, i: int) -> threading.Event:
        from strata.master.standby import serve_replicated

        me = self.addresses[i]
        stop, ready, box = threading.Event(), threading.Event(), {}

        def run():
            try:
                serve_replicated(self.cfg, "S", me, self.spec, self.users, self.addresses, self.dir / f"m{i}.sqlite",
                                 stop_event=stop, ready=lambda *a: ready.set())
            except BaseException as e:  # noqa: BLE001 - the test looks
                box["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.runs[me] = (stop, t, box)
        return ready

    def stop(self, i: int) -> None:
        stop, t, _ = self.runs[self.addresses[i]]
        stop.set()
        t.join(30)

    def close(self) -> None:
        for stop, t, _ in self.runs.values():
            stop.set()
        for stop, t, _ in self.runs.values():
            t.join(30)


def _probe(address: str, spec) -> pb.ProbeReply:
    from strata.master.standby import peer_digest
    from strata.rpc import strata_pb2_grpc as rpc

    req = pb.ProbeRequest(asker="test")
    md = ((AUTH_HEADER, sign_request(spec.key, "S", peer_digest("probe", req.SerializeToString()))),)
    with grpc.insecure_channel(address) as ch:
        return rpc.MasterStub(ch).Probe(req, metadata=md, timeout=5)


def test_two_masters_follow_refuse_take_over_and_a_returning_one_follows(tmp_path):
    m = _Masters(tmp_path)
    a, b = m.addresses
    try:
        assert m.start(0).wait(30)
        assert m.start(1).wait(30)
        assert _probe(a, m.spec).role == "active" and _probe(b, m.spec).role == "standby"
        with pytest.raises(ClientError, match=f"this master of level S is a standby; the active one is {a}"):
            Client(b).login("ann", "pw", "S")
        # unsigned master-to-master calls are refused
        from strata.rpc import strata_pb2_grpc as rpc

        with grpc.insecure_channel(a) as ch, pytest.raises(grpc.RpcError) as e:
            rpc.MasterStub(ch).Probe(pb.ProbeRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        c = Client(f"{b},{a}")  # the standby first: the client moves on
        c.login("ann", "pw", "S")
        assert c.address == a
        c.register(["SELECT COUNT(*) FROM Vitals"])
        batches = [("Vitals", vitals([t, t]), t) for t in range(1, 41)]
        r = c.ingest_stream(batches[:20], "p")
        assert (r.batches, r.accepted, r.error) == (20, 40, "")
        st = c.status().counters
        assert (st["epoch"], st["standbys_in_sync"], st["standby_detached"]) == (1, 1, 0)

        m.stop(0)  # the active master goes away: the standby takes over within ~2 s
        t0 = time.monotonic()
        wait_for(lambda: _probe(b, m.spec).role == "active", 30, "the standby to take over")
        took = time.monotonic() - t0
        assert took < 10, took
        r = c.ingest_stream(batches, "p")  # resumes: what the active had logged is there, applied once
        assert (r.duplicates, r.reconnects, r.error) == (20, 1, "") and c.address == b
        st = c.status()
        assert st.counters["accepted"] == 80 and st.counters["epoch"] == 2
        assert st.counters["duplicate_batches"] == 20 and [q.query_id for q in st.queries] == ["q1"]

        assert m.start(0).wait(30)  # the old master returns: a standby of the new active one
        assert _probe(a, m.spec).role == "standby" and _probe(a, m.spec).active == b

        def refusal():  # (this process's channels to a may still be in their reconnect back-off)
            try:
                Client(a).login("ann", "pw", "S")
            except ClientError as e:
                return e.code == "FAILED_PRECONDITION" and e.details == standby_refusal("S", b)
            return False

        wait_for(refusal, 10, "the returning master's refusal")
        wait_for(lambda: c.status().counters["standbys_in_sync"] == 1, 10, "the old master in sync")
        c.close()
    finally:
        m.close()
    assert not [box for _, _, box in m.runs.values() if box], [box for _, _, box in m.runs.values()]


# ---- through real processes: strata up --standby, kill -9 of the active master ------------------------------
@pytest.mark.slow
def test_strata_up_standby_takes_over_a_killed_master_and_the_old_one_cannot_write(tmp_path):
    """``strata up --standby`` (one worker), ``strata query`` and ``strata ingest`` (``--master a,b``, paced)
    as subprocesses; the active master is killed with SIGKILL mid-stream; the standby takes over, the
    ingest resumes (one line) and the query output equals the reference, nothing lost or twice.  The old
    master restarted with ``strata up --restart`` is a standby: its refusal says so, a producer pointed
    only at it is refused, and the worker refuses an Execute signed with its old epoch."""
    from strata.config import load_config, parse_config
    from strata.deploy.local import stop_cluster
    from strata.groups import group_spec
    from strata.rpc import strata_pb2_grpc as rpc
    from strata.tls import secure_channel

    from .conftest import BATTLEFIELD_TOML
    from .reference.evaluator import compare_results, evaluate
    from .helpers import PASSWORD, alive, write_config
    from .tables import mixed_vitals, rows_of

    queries = ["SELECT sid, AVG(bp) FROM Vitals [ROWS 5] GROUP BY sid", "SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]"]
    # the level's own disk: the active master's and the standby's state files both go there
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML + '\n[groups."TS"]\ndata_dir = "disk-ts"\n', {"ann": "TS"})
    rows = mixed_vitals(1, 401, 4)  # 1600 tuples at 400 tuples/s: 4 batches of 100 instants, one a second
    data = tmp_path / "vitals.csv"
    with open(data, "w", newline="") as f:
        w = csv.DictWriter(f, ["ts", "level", "sid", "bp", "pr", "weight"])
        w.writeheader()
        w.writerows(rows)
    state = tmp_path / "state"
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD}

    def strata(*args, timeout=300):
        return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)

    up = strata("up", "--config", str(cfg_path), "--levels", "TS", "--workers", "1", "--state-dir", str(state),
                "--standby")
    assert up.returncode == 0, up.stderr
    started = json.loads(up.stdout)
    a, b, tls = started["masters"]["TS"], started["standbys"]["TS"], started["tls_dir"]
    client_args = ["--config", str(cfg_path), "--user", "ann", "--level", "TS", "--tls-dir", tls]
    procs = []
    try:
        record = json.loads((state / "cluster.json").read_text())["processes"]
        active = next(p for p in record if p["role"] == "master")
        assert next(p for p in record if p["role"] == "standby")["address"] == b
        op = Client(f"{a},{b}", tls_dir=tls, level="TS")
        op.login("ann", PASSWORD, "TS")
        wait_for(lambda: op.status().counters.get("standbys_in_sync") == 1, 60, "the standby in sync")
        assert sorted(f.name for f in (tmp_path / "disk-ts").glob("*.sqlite")) == ["master-TS-standby.sqlite",
                                                                                 "master-TS.sqlite"]
        assert not list(state.glob("*.sqlite"))
        query = subprocess.Popen([sys.executable, "-m", "strata", "query", *client_args, "--master", f"{a},{b}",
                                  "--format", "json", *[x for q in queries for x in ("--query", q)]],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(query)
        wait_for(lambda: op.status().counters["queries"] == 2, 60, "the queries registered")
        ingest = subprocess.Popen([sys.executable, "-m", "strata", "ingest", *client_args, "--master", f"{a},{b}",
                                   "--labelled", "--finish", "--rate", "400", "--input", f"Vitals={data}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(ingest)
        wait_for(lambda: op.status().counters["accepted"] >= 800 or ingest.poll() is not None, 120, "800 tuples in")
        assert ingest.poll() is None, ingest.communicate()
        t_kill = time.monotonic()
        os.kill(active["pid"], signal.SIGKILL)  # no chance to flush anything
        wait_for(lambda: not alive(active["pid"]), 10, "the master to die")
        probe = Client(b, tls_dir=tls, level="TS")

        def serving():
            try:
                probe.login("ann", PASSWORD, "TS")
                return True
            except ClientError:
                return False

        wait_for(serving, 60, "the standby to take over", interval=0.02)
        takeover = time.monotonic() - t_kill
        print(f"takeover: the standby served a login {takeover:.2f} s after the kill -9")
        probe.close()
        out, err = ingest.communicate(timeout=300)
        print(err)
        assert ingest.returncode == 0 and "Traceback" not in err, err
        assert sum("connection to master lost" in ln for ln in err.splitlines()) == 1, err
        assert "sent 1600/1600 tuples in 4 batches: accepted 1600, dropped above level TS 0" in err, err
        qout, qerr = query.communicate(timeout=300)
        assert query.returncode == 0 and "Traceback" not in qerr, qerr
        got: dict[str, list[dict]] = {}
        for line in qout.splitlines():
            d = json.loads(line)
            got.setdefault(d.pop("query"), []).append(d)
        cfg = parse_config(BATTLEFIELD_TOML)
        for qid, q in zip(sorted(got, key=lambda x: int(x[1:])), queries):
            compare_results(rows_of(pa.Table.from_pylist(got[qid])), evaluate(q, cfg, "TS", {"Vitals": rows}))
        op.reconnect(time.monotonic() + 30)  # a one-shot call does not move on: reconnect finds the active one
        st = op.status()
        assert op.address == b and st.counters["accepted"] == len(rows) and st.counters["epoch"] == 2

        # the old master comes back: a standby of the new active one, it writes nothing
        again = strata("up", "--state-dir", str(state), "--restart", "master:TS")
        assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
        assert json.loads(again.stdout)["restarted"][0]["address"] == a
        refusal = f"this master of level TS is a standby; the active one is {b}"
        status = strata("status", *client_args, "--master", a)
        assert status.returncode == 2 and status.stderr.strip() == f"strata: {refusal}", status.stderr
        refused = strata("ingest", *client_args, "--master", a, "--input", f"Vitals={data}", "--labelled")
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr
        wait_for(lambda: op.status().counters.get("standbys_in_sync") == 1, 60, "the old master following")
        assert op.status().counters["accepted"] == len(rows)

        # fencing: the worker has seen epoch 2; an Execute signed with the old master's epoch 1 is refused
        worker = next(p for p in json.loads((state / "cluster.json").read_text())["processes"]
                      if p["role"] == "worker")
        key = group_spec(load_config(cfg_path), "TS", state).key
        stub = rpc.WorkerStub(secure_channel(worker["address"], tls, "master", "TS", "worker"))
        req = pb.ExecuteRequest(level="TS", chunk=b"", epoch=1)
        with pytest.raises(grpc.RpcError) as e:
            stub.Execute(req, metadata=((AUTH_HEADER, sign_request(key, "TS", execute_digest(req))),), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith("fenced: epoch 1 is older than epoch 2"), e.value.details()
        info = stub.Info(pb.Empty(), metadata=((AUTH_HEADER, sign_request(key, "TS", b"info")),), timeout=10)
        assert info.refused["stale_epoch"] >= 1
        wlog = state / "logs" / f"{worker['name']}.log"  # written by the worker's log pump: a moment later
        wait_for(lambda: "refused an Execute: fenced: epoch 1 is older than epoch 2" in wlog.read_text(errors="replace"),
                 10, "the worker's log line of the refusal")
        op.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        stop_cluster(state)
