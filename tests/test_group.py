"""Level groups over real UDP multicast on loopback: isolation and authentication."""

from __future__ import annotations

import os
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.groups.membership import GroupMember, GroupSpec, GroupTable, Heartbeat, encode_heartbeat
from strata.serving import free_udp_port

from .polling import poll



SIDS = {"S": ["127.0.0.1:101", "127.0.0.1:102"], "TS": ["127.0.0.1:201", "127.0.0.1:202"]}


@pytest.fixture
def groups():
    port = free_udp_port()  # both levels on one port: only address, key and level keep them apart
    specs = {
        "S": GroupSpec("S", "239.255.77.1", port, os.urandom(32), interval=0.1),
        "TS": GroupSpec("TS", "239.255.77.2", port, os.urandom(32), interval=0.1),
    }
    members = []
    for level, spec in specs.items():
        for sid in SIDS[level]:
            members.append(GroupMember(spec, sid=sid, load=lambda: 12.5).start())
    yield specs, members
    for m in members:
        m.stop()


def test_group_tables_hold_only_their_level(groups):
    specs, members = groups
    s_members = [m for m in members if m.spec.level == "S"]
    ts_members = [m for m in members if m.spec.level == "TS"]
    assert poll(lambda: all(set(m.snapshot()) == set(SIDS["S"]) for m in s_members), 5.0, 0.05)
    assert poll(lambda: all(set(m.snapshot()) == set(SIDS["TS"]) for m in ts_members), 5.0, 0.05)
    hb = s_members[0].snapshot()[SIDS["S"][1]]
    assert hb.cpu == 12.5 and hb.level == "S" and hb.pid == os.getpid() and hb.slots == 2
    assert hb.identity == s_members[1].identity.hex  # signed by that member's own key


def _send(spec: GroupSpec, data: bytes) -> None:
    t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    t.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
    t.sendto(data, (spec.address, spec.port))
    t.close()


def test_forged_wrong_key_and_garbage_are_ignored(groups):
    specs, members = groups
    s = specs["S"]
    target = next(m for m in members if m.spec.level == "S")
    assert poll(lambda: len(target.snapshot()) == 2, 5.0, 0.05)
    forged = Heartbeat("S", "127.0.0.1:666", 0.0, seq=1, sent_at=time.time(), pid=1)
    _send(s, encode_heartbeat(forged, os.urandom(32)))  # forger without the key
    _send(s, encode_heartbeat(Heartbeat("TS", "127.0.0.1:667", 0.0, seq=1, sent_at=time.time()), specs["TS"].key))
    _send(s, encode_heartbeat(Heartbeat("TS", "127.0.0.1:668", 0.0, seq=1, sent_at=time.time()), s.key))  # level
    _send(s, b"\x00garbage" * 10)
    assert poll(lambda: sum(target.rejected.values()) >= 4, 5.0, 0.05)
    assert set(target.snapshot()) == set(SIDS["S"])
    assert target.rejected["bad_key"] >= 2 and target.rejected["other_level"] >= 1
    assert target.rejected["garbage"] >= 1


def test_table_replay_and_expiry_logic():
    key = b"k" * 32
    t = GroupTable("S", key, timeout=3.0)
    hb = Heartbeat("S", "a:1", 50.0, pid=9, seq=5, sent_at=time.time())
    data = encode_heartbeat(hb, key)
    assert t.receive(data, now=0.0) is not None
    assert t.receive(data, now=1.0) is None  # replayed
    assert t.rejected["replay"] == 1
    old = Heartbeat("S", "b:1", 5.0, pid=9, seq=1, sent_at=time.time() - 3600)
    assert t.receive(encode_heartbeat(old, key), now=1.0) is None
    assert t.rejected["stale"] == 1
    assert t.expire(now=3.5) == ["a:1"]
    assert t.receive(data, now=4.0) is None  # expired from the table, still a replay
    assert t.rejected["replay"] == 2


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 127, 128, 300, 16383, 16384, 2_100_000]), queries=st.integers(0, 3),
       level=st.sampled_from(["U", "TS", "[A,B]"]))
def test_execute_wire_is_the_serialized_request_and_the_digest_needs_no_copy(size, queries, level):
    """The master sends Execute requests serialized by hand (master/server.py ``_send``): the bytes
    are exactly the message's own serialization, the worker parses them into the same request, and
    the digest over the chunk bytes given apart equals the digest over the parsed request."""
    from strata.groups import execute_digest, execute_wire
    from strata.rpc import strata_pb2 as pb

    chunk = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    specs = [pb.QuerySpec(query_id=f"q{i}", text=f"SELECT {i}", level=level) for i in range(queries)]
    head = pb.ExecuteRequest(level=level, queries=specs)
    wire = execute_wire(head, chunk)
    whole = pb.ExecuteRequest(level=level, queries=specs, chunk=chunk)
    assert wire == whole.SerializeToString()
    assert pb.ExecuteRequest.FromString(wire) == whole
    assert execute_digest(head, chunk) == execute_digest(whole) == execute_digest(pb.ExecuteRequest.FromString(wire))
