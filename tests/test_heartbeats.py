"""Hardened heartbeats: strict fields, one high-water mark per identity, addresses bound to
identities (proof by Info), encrypted payloads, and loops that survive any datagram.

Plain logic is tested without sockets; the rest over real UDP multicast on loopback and a
real gRPC worker server (insecure transport: the group-key request MAC)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from itertools import count
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.groups.membership import (
    MAGIC, MARK_KEEP, MAX_CLAIMED_SIDS, MAX_CLAIMS_PER_SID, AddressProofs, AddressProver, GroupMember, GroupSpec,
    GroupTable, Heartbeat, HeartbeatError, Identity, receiver, decode_heartbeat, encode_heartbeat, encode_payload,
    info_probe, seal, validate_fields,
)
from strata.serving import free_udp_port

from .polling import poll, wait_for

KEY = bytes(range(32))
SID = "127.0.0.1:4100"


class Wall:
    """An injectable wall clock."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def hb(sid=SID, cpu=10.0, seq=1, wall=None, **kw) -> Heartbeat:
    return Heartbeat("S", sid, cpu, seq=seq, sent_at=(wall() if wall else time.time()), pid=kw.pop("pid", 42), **kw)


def fields(**over) -> dict:
    d = asdict(replace(hb(), identity="ab" * 32))
    d.update(over)
    return d


# ---- strict fields -----------------------------------------------------------------------------------
BAD_VALUES = [
    ("cpu", [float("nan"), float("inf"), float("-inf"), -0.5, 100.5, "5", True, None, [1]]),
    ("state", ["busy", "", 1, None]),
    ("pid", [-1, 2**31, 1.5, True, "7"]),
    ("seq", [0, -1, 2**63, 2.0, "1"]),
    ("sent_at", ["now", float("nan"), float("inf"), 0, -5.0, 1e300, None]),
    ("sid", ["", "host", "h:0", "h:65536", "a" * 300 + ":1", "h:1\n", "h :1", "é:1", 5, "h:1:2"]),
    ("level", ["", "x" * 200, 3]),
    ("role", ["client", ""]),
    ("slots", [0, -1, 1025, 2.0, True]),
    ("chunks_done", [-1, 2**63, 0.5]),
    ("identity", ["zz" * 32, "ab", "", None, "AB" * 32]),
]


@pytest.mark.parametrize("name, bad", [(n, v) for n, vs in BAD_VALUES for v in vs])
def test_every_field_is_checked(name, bad):
    with pytest.raises(HeartbeatError) as e:
        validate_fields(fields(**{name: bad}))
    assert e.value.reason == f"bad_{name}"


def test_good_fields_pass_and_missing_or_extra_fields_do_not():
    got = validate_fields(fields(cpu=0, sent_at=1_700_000_000))
    assert got.cpu == 0.0 and isinstance(got.cpu, float) and got.slots == 2
    for sid in ("127.0.0.1:1", "worker-3.example.org:65535", "[::1]:50051"):
        assert validate_fields(fields(sid=sid)).sid == sid
    d = fields()
    del d["slots"]
    for bad in (d, fields(extra=1), [1, 2], "x", None):
        with pytest.raises(HeartbeatError) as e:
            validate_fields(bad)
        assert e.value.reason in ("bad_fields", "bad_json")


def _decode_reason(data: bytes, key: bytes = KEY) -> str:
    with pytest.raises(HeartbeatError) as e:
        decode_heartbeat(data, key)
    return e.value.reason


def test_bad_values_on_the_wire_are_refused_by_reason():
    me = Identity()
    good = fields(identity=me.hex, sent_at=time.time())
    assert decode_heartbeat(encode_payload(good, KEY, me), KEY).sid == SID
    assert _decode_reason(encode_payload({**good, "cpu": float("inf")}, KEY, me)) == "bad_json"  # JSON Infinity
    body = json.dumps(good).replace('"cpu": 10.0', '"cpu": -Infinity').encode()
    assert _decode_reason(encode_payload(body, KEY, me)) == "bad_json"
    body = json.dumps(good).replace('"cpu": 10.0', '"cpu": 1e999').encode()  # parses as inf
    assert _decode_reason(encode_payload(body, KEY, me)) == "bad_cpu"
    assert _decode_reason(encode_payload({**good, "sent_at": "now"}, KEY, me)) == "bad_sent_at"
    assert _decode_reason(encode_payload(b"\xff\xfe not utf-8", KEY, me)) == "bad_json"
    assert _decode_reason(encode_payload(b"[" * 5000 + b"]" * 5000, KEY, me)) in ("bad_json", "oversized")
    assert _decode_reason(encode_payload(b"[" * 600 + b"]" * 600, KEY, me)) == "bad_json"
    other = Identity()  # signed by one identity, claiming another
    assert _decode_reason(encode_payload(good, KEY, other)) == "bad_signature"
    assert _decode_reason(seal(b"\x00" * 64 + b"{}", KEY)) == "bad_fields"
    assert _decode_reason(seal(b"short", KEY)) == "garbage"  # shorter than a signature: not even decrypted


def test_versions_and_framing():
    data = encode_heartbeat(hb(), KEY)
    assert data.startswith(MAGIC) and len(data) <= 1400
    assert _decode_reason(data, os.urandom(32)) == "bad_key"
    assert _decode_reason(data[:-1]) == "bad_key"  # truncated: the tag fails
    assert _decode_reason(data[:20]) == "garbage"
    assert _decode_reason(b"STRATA-HB9" + data[10:]) == "unknown_version"
    assert _decode_reason(b"x" * 2000) == "oversized"
    # the old format: plaintext JSON and an HMAC under the group key
    payload = json.dumps({"level": "S", "sid": SID, "cpu": 1.0}).encode()
    v1 = b"STRATA-HB1" + hmac.new(KEY, b"STRATA-HB1" + payload, hashlib.sha256).digest() + payload
    assert _decode_reason(v1) == "old_format"
    t = GroupTable("S", KEY)
    assert t.receive(v1, 0.0) is None and t.rejected == Counter({"old_format": 1})


def test_payload_is_encrypted():
    """A process without the level key learns nothing from a heartbeat: no address, pid, load or key."""
    me = Identity()
    h = Heartbeat("S", "127.0.0.1:45123", 37.25, pid=31337, seq=77, sent_at=time.time(), slots=3)
    a, b = encode_heartbeat(h, KEY, me), encode_heartbeat(h, KEY, me)
    assert a != b and a[10:22] != b[10:22]  # a random nonce per datagram
    for data in (a, b):
        for secret in (b"127.0.0.1", b"45123", b"31337", b"37.25", b"cpu", b"sid", me.public, me.hex.encode()):
            assert secret not in data
    assert decode_heartbeat(a, KEY) == replace(h, identity=me.hex)


def test_encode_refuses_a_bad_heartbeat():
    with pytest.raises(HeartbeatError, match="cpu"):
        encode_heartbeat(hb(cpu=float("nan")), KEY)


# ---- one high-water mark per identity ---------------------------------------------------------------------
def test_replays_are_refused_whatever_they_claim_and_however_long_ago():
    wall = Wall()
    t = GroupTable("S", KEY, timeout=3.0, wall=wall)
    me = Identity()
    first = encode_heartbeat(hb(seq=5, pid=1, wall=wall), KEY, me)
    assert t.receive(first, 0.0) is not None
    # the same identity with another pid or address and an older seq: refused
    assert t.receive(encode_heartbeat(hb(seq=4, pid=2, wall=wall), KEY, me), 0.1) is None
    assert t.receive(encode_heartbeat(hb(seq=5, sid="127.0.0.1:9", wall=wall), KEY, me), 0.1) is None
    assert t.rejected["replay"] == 2
    # alternating with another identity changes nothing
    assert t.receive(encode_heartbeat(hb(seq=1, pid=3, wall=wall), KEY), 0.2) is not None
    assert t.receive(first, 0.3) is None
    # the entry expires; the mark does not
    assert SID in t.expire(10.0) or SID not in t.peers
    assert t.receive(first, 11.0) is None and t.rejected["replay"] == 4
    newer = encode_heartbeat(hb(seq=6, pid=1, wall=wall), KEY, me)
    assert t.receive(newer, 11.0) is not None
    # long after: the mark of an unlisted identity goes, but every copy is stale by then
    wall.t += MARK_KEEP + 10
    t.expire(11.0 + MARK_KEEP + 10)
    assert me.hex not in t.marks
    assert t.receive(first, 11.0 + MARK_KEEP + 10) is None and t.receive(newer, 11.0 + MARK_KEEP + 10) is None
    assert t.rejected["stale"] == 2


def test_a_listed_identity_keeps_its_mark():
    wall = Wall()
    t = GroupTable("S", KEY, timeout=3.0, wall=wall)
    me = Identity()
    assert t.receive(encode_heartbeat(hb(seq=1, wall=wall), KEY, me), 0.0)
    t.marks[me.hex][1] = -1e9  # heard "long ago", but still listed
    t.expire(1.0)
    assert me.hex in t.marks


# ---- addresses bound to identities -------------------------------------------------------------------------
def proof_table(wall=None):
    return GroupTable("S", KEY, timeout=3.0, require_proof=True, wall=wall or Wall())


def test_an_address_is_listed_only_for_its_proven_identity():
    t = proof_table()
    real, forger = Identity(), Identity()
    seq = iter(range(1, 1000))
    send = lambda ident, now, **kw: t.receive(encode_heartbeat(hb(seq=next(seq), wall=t.wall, **kw), KEY, ident), now)
    send(real, 0.0, cpu=5.0)
    assert t.workers() == {} and t.claimed() == [SID]  # a claim until proven
    assert t.prove(SID, real.hex, 0.1) is True and t.workers()[SID].cpu == 5.0 and t.claimed() == []
    for kw in ({"state": "draining"}, {"cpu": 100.0}, {"cpu": 0.0}):  # the forger speaks for the real worker
        assert send(forger, 0.2, **kw) is None
        assert t.workers()[SID].cpu == 5.0 and t.workers()[SID].state == "ready"
        assert t.workers()[SID].identity == real.hex
    assert t.rejected["unbound_key"] == 3
    assert t.prove(SID, real.hex, 0.3) is False  # the probe found the real one again: nothing changes
    assert t.workers()[SID].identity == real.hex
    send(real, 0.4, cpu=7.0)
    assert t.workers()[SID].cpu == 7.0


def test_restart_on_the_same_address_is_listed_after_proof():
    t = proof_table()
    old, new = Identity(), Identity()
    t.receive(encode_heartbeat(hb(seq=1, wall=t.wall), KEY, old), 0.0)
    t.prove(SID, old.hex, 0.0)
    assert t.receive(encode_heartbeat(hb(seq=1, cpu=33.0, wall=t.wall), KEY, new), 1.0) is None  # not yet
    assert t.workers()[SID].identity == old.hex and t.claimed() == [SID]
    assert t.prove(SID, new.hex, 1.1) is True
    assert t.workers()[SID].identity == new.hex and t.workers()[SID].cpu == 33.0
    assert t.receive(encode_heartbeat(hb(seq=2, wall=t.wall), KEY, old), 1.2) is None  # the old key no longer
    assert t.workers()[SID].identity == new.hex


def test_a_worker_that_left_cannot_be_impersonated():
    t = proof_table()
    real, forger = Identity(), Identity()
    t.receive(encode_heartbeat(hb(seq=1, wall=t.wall), KEY, real), 0.0)
    t.prove(SID, real.hex, 0.0)
    assert t.expire(10.0) == [SID] and t.workers() == {}
    for i in range(5):
        t.receive(encode_heartbeat(hb(seq=i + 1, cpu=0.0, wall=t.wall), KEY, forger), 10.0 + i)
    assert t.workers() == {} and t.rejected["unbound_key"] == 5
    # a probe finds nobody there (or someone else): the forger is never listed
    assert t.workers() == {}


def test_masters_are_heard_but_never_listed_or_probed():
    t = proof_table()
    t.receive(encode_heartbeat(hb(seq=1, role="master", state="master", wall=t.wall), KEY), 0.0)
    assert t.workers() == {} and t.claimed() == [] and not t.rejected


def test_claims_are_bounded():
    t = proof_table()
    ident = Identity()
    for i in range(MAX_CLAIMED_SIDS + 40):
        t.receive(encode_heartbeat(hb(sid=f"127.0.0.1:{1000 + i}", seq=i + 1, wall=t.wall), KEY, ident), i * 0.001)
    assert len(t.claims) == MAX_CLAIMED_SIDS
    for i in range(MAX_CLAIMS_PER_SID + 5):
        t.receive(encode_heartbeat(hb(sid="127.0.0.1:7", seq=1, wall=t.wall), KEY), 1.0 + i * 0.001)
    assert len(t.claims["127.0.0.1:7"]) == MAX_CLAIMS_PER_SID
    t.expire(100.0)
    assert t.claims == {}


# ---- when to probe --------------------------------------------------------------------------------------
def test_address_proofs_schedule():
    p = AddressProofs(retry=0.5, max_retry=4.0, max_in_flight=2, give_up=10.0)
    assert p.due(["a", "b", "c"], 0.0) == ["a", "b"]  # at most two at once
    assert p.due(["a", "b", "c"], 0.1) == []
    p.finished("a", False, 0.2)
    assert p.due(["a", "b", "c"], 0.2) == ["c"]  # a waits 0.5 s
    p.finished("c", True, 0.3)
    assert p.due(["a"], 0.6) == []  # a waits until 0.7
    p.finished("b", False, 0.6)
    assert p.due(["a"], 0.7) == ["a"]
    waits = []
    for i in range(6):  # no new binding: the wait doubles up to max_retry
        now = 10.0 * (i + 1)
        p.finished("a", False, now)
        waits.append(p.next_at["a"] - now)
        assert p.due(["a"], now + waits[-1] - 0.01) == [] and p.due(["a"], now + waits[-1]) == ["a"]
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert p.due([], 200.0) == [] and "a" not in p.in_flight  # an unanswered probe is given up
    assert p.due(["x"], 200.0) == ["x"]


class FakeMember:
    """The member interface AddressProver uses, over a plain table."""

    def __init__(self, table):
        self.table = table
        self.now = 0.0

    def claimed(self):
        self.table.expire(self.now)
        return self.table.claimed()

    def prove(self, sid, identity):
        return self.table.prove(sid, identity, self.now)


def test_prover_with_a_fake_probe():
    t = proof_table()
    member = FakeMember(t)
    real, forger = Identity(), Identity()
    at_address = {SID: real.hex}  # who really answers Info at each address
    probes = []

    def probe(sid, answer):
        probes.append(sid)
        answer(sid, at_address.get(sid), "" if sid in at_address else "UNAVAILABLE")

    clock = Wall(0.0)
    prover = AddressProver(member, probe, clock=clock)
    seq = iter(range(1, 10000))
    t.receive(encode_heartbeat(hb(seq=next(seq), cpu=100.0, state="draining", wall=t.wall), KEY, forger), 0.0)
    t.receive(encode_heartbeat(hb(seq=next(seq), cpu=5.0, wall=t.wall), KEY, real), 0.0)
    t.receive(encode_heartbeat(hb(sid="127.0.0.1:1", seq=next(seq), wall=t.wall), KEY, forger), 0.0)  # nobody there
    prover.step()  # probes start
    prover.step()  # answers applied
    assert t.workers() == {SID: t.workers()[SID]} and t.workers()[SID].identity == real.hex
    assert t.workers()[SID].cpu == 5.0
    # the forger keeps claiming both addresses for 60 s: a bounded number of probes, nothing listed
    n0 = len(probes)
    for i in range(600):
        clock.t = member.now = 0.1 * (i + 1)
        t.receive(encode_heartbeat(hb(seq=next(seq), cpu=0.0, wall=t.wall), KEY, forger), member.now)
        t.receive(encode_heartbeat(hb(seq=next(seq), cpu=5.0, wall=t.wall), KEY, real), member.now)
        t.receive(encode_heartbeat(hb(sid="127.0.0.1:1", seq=next(seq), wall=t.wall), KEY, forger), member.now)
        prover.step()
        assert set(t.workers()) == {SID} and t.workers()[SID].identity == real.hex
    assert len(probes) - n0 <= 2 * (60 / 10 + 6)  # backoff up to 10 s per address
    assert prover.failures["probe_failed"] >= 1


def test_prover_survives_a_probe_that_raises():
    t = proof_table()
    member = FakeMember(t)
    t.receive(encode_heartbeat(hb(wall=t.wall), KEY), 0.0)

    def probe(sid, answer):
        raise RuntimeError("cannot make a channel\nto there")

    prover = AddressProver(member, probe, clock=Wall(0.0))
    prover.step()
    prover.step()
    assert prover.failures["probe_failed"] == 1 and t.workers() == {}


# ---- the dispatcher and the master's loop survive any value ---------------------------------------------
def test_dispatcher_refuses_non_finite_and_out_of_range_readings():
    from strata.master.dispatch import Dispatcher

    d = Dispatcher()
    d.heartbeat("w1", 5.0, now=0)
    for cpu in (float("nan"), float("inf"), float("-inf"), -1.0, 100.5, "5", True):
        with pytest.raises(ValueError):
            d.heartbeat("w1", cpu, now=1)
        with pytest.raises(ValueError):
            d.heartbeat("w2", cpu, now=1)
    with pytest.raises(ValueError):
        d.heartbeat("w1", 5.0, now=1, state="sleeping")
    assert set(d.table) == {"w1"} and d.table["w1"].cpu == 5.0 and d.pick() == "w1"


def test_dispatch_loop_skips_a_bad_snapshot_entry(battlefield):
    from strata.master.core import MasterCore
    from strata.master.dispatch_loop import DispatchLoop

    class Snap:
        def snapshot(self):  # a value no decoded heartbeat can have, as a buggy member might hand over
            bad = SimpleNamespace(**{**asdict(hb(cpu=0.0)), "cpu": float("nan")})
            return {"127.0.0.1:1": bad, "127.0.0.1:2": hb(sid="127.0.0.1:2", cpu=20.0)}

    core = MasterCore(battlefield, "S")
    loop = DispatchLoop(core, KEY, Snap())
    loop._sync_group()
    loop._sync_group()
    assert set(core.dispatcher.table) == {"127.0.0.1:2"} and core.dispatcher.pick() == "127.0.0.1:2"


# ---- hypothesis: the table and the live receiver take anything --------------------------------------------
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=10,
)
field_dicts = st.fixed_dictionaries({k: json_values for k in fields()})
FUZZ_ID = Identity()


def datagrams():
    return st.one_of(
        st.binary(max_size=1500),  # random bytes
        st.binary(max_size=200).map(lambda b: MAGIC + b),  # random bytes behind the magic
        st.binary(max_size=300).map(lambda b: seal(b, KEY)),  # valid tag, garbage inside
        json_values.map(lambda v: encode_payload(json.dumps(v).encode(), KEY, FUZZ_ID)),  # signed random JSON
        field_dicts.map(lambda d: encode_payload(json.dumps(d).encode(), KEY, FUZZ_ID)),  # right keys, any values
        field_dicts.map(lambda d: encode_payload(json.dumps({**d, "identity": FUZZ_ID.hex}).encode(), KEY, FUZZ_ID)),
    )


@FUZZ
@given(datagrams())
def test_table_refuses_garbage_with_exactly_one_count(data):
    t = GroupTable("S", KEY, require_proof=True)
    got = t.receive(data, 0.0)
    if got is None:
        assert sum(t.rejected.values()) == 1 and not t.peers
    else:  # a random heartbeat that happens to be valid: every field in range
        assert math.isfinite(got.cpu) and 0 <= got.cpu <= 100 and got.state in ("ready", "draining", "master")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field_dicts)
def test_validate_fields_either_refuses_or_returns_sane_values(d):
    try:
        h = validate_fields(d)
    except HeartbeatError as e:
        assert e.reason.startswith("bad_")
        return
    assert math.isfinite(h.cpu) and math.isfinite(h.sent_at) and 1 <= h.slots <= 1024



def sender():
    t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t.bind(("127.0.0.1", 0))
    t.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    t.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
    return t


@pytest.fixture(scope="module")
def live():
    """A listening member (a worker's table) and a socket to send to its group."""
    spec = GroupSpec("S", "239.255.78.9", free_udp_port(), KEY, interval=0.1)
    m = GroupMember(spec, sid="127.0.0.1:5999", load=lambda: 1.0).start()
    tx = sender()
    yield spec, m, tx
    tx.close()
    m.stop()


MARKERS = count(6000)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(datagrams(), min_size=1, max_size=8))
def test_live_receiver_survives_any_datagram(live, batch):
    spec, m, tx = live
    before = sum(m.rejected.values())
    for data in batch:
        tx.sendto(data, (spec.address, spec.port))
    # a marker heartbeat after the batch: once it is listed, every datagram before it was handled
    marker = f"127.0.0.1:{next(MARKERS)}"
    tx.sendto(encode_heartbeat(hb(sid=marker, seq=1), KEY), (spec.address, spec.port))
    wait_for(lambda: marker in m.snapshot(), 10.0, "the marker heartbeat", interval=0.005)
    assert all(t.is_alive() for t in m._threads)
    assert sum(m.rejected.values()) >= before and m.rejected["internal"] == 0


def test_sender_survives_a_failing_or_nan_load_reading():
    spec = GroupSpec("S", "239.255.78.10", free_udp_port(), KEY, interval=0.05)
    readings = iter([float("nan"), float("-inf")] + [RuntimeError("psutil gone")] * 1000)

    def load():
        v = next(readings)
        if isinstance(v, Exception):
            raise v
        return v

    listener = GroupMember(spec, sid="127.0.0.1:5998", load=lambda: 1.0).start()
    broken = GroupMember(spec, sid="127.0.0.1:5997", load=load).start()
    try:
        wait_for(lambda: broken.send_errors["load"] >= 4 and "127.0.0.1:5997" in listener.snapshot(), 10.0,
                 "heartbeats of the broken reading")
        assert listener.snapshot()["127.0.0.1:5997"].cpu == 100.0  # unknown load reads as busy
        assert all(t.is_alive() for t in broken._threads)
    finally:
        broken.stop()
        listener.stop()


def test_datagrams_on_the_wire_reveal_nothing():
    """Captured from the group as any local process could: no address, pid or load in the bytes."""
    spec = GroupSpec("S", "239.255.78.11", free_udp_port(), KEY, interval=0.05)
    rx = receiver(spec)
    rx.settimeout(5.0)
    m = GroupMember(spec, sid="127.0.0.1:45678", load=lambda: 42.75).start()
    try:
        data, _ = rx.recvfrom(65535)
    finally:
        m.stop()
        rx.close()
    assert data.startswith(MAGIC)
    for secret in (b"45678", b"127.0.0.1", str(os.getpid()).encode(), b"42.75", m.identity.public):
        assert secret not in data
    assert decode_heartbeat(data, KEY).cpu == 42.75


# ---- proof over a real gRPC Info call (no TLS: the group key's request MAC) ----------------------------------
class FakeCore:
    level = "S"

    def __init__(self):
        self.refused = Counter()

    def stats(self):
        return {"chunks_done": 0, "seen_levels": {}, "refused": dict(self.refused)}


def start_worker_server(member_factory, key=KEY):
    """A real worker gRPC server (its Info RPC) without Spark; returns (server, address, member)."""
    from strata.rpc import strata_pb2_grpc as rpc
    from strata.serving import build_server
    from strata.worker.server import WorkerServicer

    servicer = WorkerServicer(FakeCore(), key)
    server, address = build_server(rpc.add_WorkerServicer_to_server, servicer, "127.0.0.1:0", max_workers=2)
    servicer.sid = address
    servicer.member = member_factory(address)
    server.start()
    return server, address, servicer.member


def test_info_probe_returns_the_workers_identity():
    spec = GroupSpec("S", "239.255.78.12", free_udp_port(), KEY, interval=0.1)
    server, address, wm = start_worker_server(lambda a: GroupMember(spec, sid=a, load=lambda: 3.0))
    try:
        answers, channels = [], []
        done = threading.Event()

        def answer(sid, identity, error, channel=None):
            answers.append((sid, identity, error))
            channels.append(channel)  # closed below, not on the channel's own callback thread
            done.set()

        info_probe(grpc.insecure_channel, KEY, "S")(address, answer)
        assert done.wait(10)
        assert answers == [(address, wm.identity.hex, "")]
        done.clear()
        info_probe(grpc.insecure_channel, os.urandom(32), "S")(address, answer)  # not this level's key
        assert done.wait(10) and answers[-1][1] is None and "UNAUTHENTICATED" in answers[-1][2]
        done.clear()
        info_probe(grpc.insecure_channel, KEY, "S", deadline=1.0)(f"127.0.0.1:{free_udp_port()}", answer)
        assert done.wait(10) and answers[-1][1] is None
        for ch in channels:
            ch.close()
    finally:
        server.stop(0).wait()
        wm.stop()


def test_master_member_lists_a_worker_only_after_proof_and_ignores_forgers():
    """Real multicast, a real worker server answering Info, a master member with its prover,
    and a forger of the same level (it has the group key) speaking for the worker's address."""
    spec = GroupSpec("S", "239.255.78.13", free_udp_port(), KEY, interval=0.05)
    master = GroupMember(spec, sid="127.0.0.1:5990", role="master")
    master.state = "master"
    server, address, wm = start_worker_server(lambda a: GroupMember(spec, sid=a, load=lambda: 5.0))
    prover = AddressProver(master, info_probe(grpc.insecure_channel, KEY, "S"))
    forgers = []
    try:
        master.start()
        wm.start()

        def listed():
            prover.step()
            return master.snapshot().get(address)

        got = poll(listed, 10.0, 0.02)
        assert got and got.identity == wm.identity.hex and got.cpu == 5.0
        # forgers: same group key, their own identities, the worker's address
        for cpu, state in ((100.0, "ready"), (0.0, "draining"), (0.0, "ready")):
            f = GroupMember(spec, sid=address, load=lambda c=cpu: c)
            f.state = state
            forgers.append(f.start())
        wait_for(lambda: (prover.step(), master.rejected["unbound_key"] >= 30)[1], 10.0, "forged heartbeats")
        for _ in range(20):
            prover.step()
            hb_now = master.snapshot()[address]
            assert hb_now.identity == wm.identity.hex and hb_now.cpu == 5.0 and hb_now.state == "ready"
        # the worker leaves; the forgers stay: the address is never theirs
        server.stop(0).wait()
        wm.stop()
        wait_for(lambda: (prover.step(), address not in master.snapshot())[1], 10.0, "the worker to expire")
        n = master.rejected["unbound_key"]
        wait_for(lambda: (prover.step(), master.rejected["unbound_key"] >= n + 30)[1], 10.0, "more forgeries")
        assert address not in master.snapshot()
        assert all(t.is_alive() for t in master._threads)
    finally:
        for f in forgers:
            f.stop()
        wm.stop()
        master.stop()
        server.stop(0)
