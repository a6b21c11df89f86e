"""Level groups: authenticated multicast heartbeats and the group table (``ip_table``).

Every worker (and master) of level L multicasts ``(sid, cpu, state, …)`` to
its level's multicast group every heartbeat and keeps a table of the peers it
hears.  A heartbeat is accepted only if its HMAC-SHA256 under the group's key
verifies, it names the receiver's level, it is fresh, and its sequence number
is newer than the last one from that sender; anything else (another level's
group, a forger, a replay, garbage) is counted and ignored.

:class:`GroupTable` and the codec are plain logic; :class:`GroupMember` adds
the sockets.  By default heartbeats go out on the loopback interface only
(``IP_MULTICAST_IF`` 127.0.0.1, TTL 0).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Heartbeat", "GroupTable", "GroupMember", "GroupSpec", "encode_heartbeat", "decode_heartbeat",
           "HeartbeatError"]

MAGIC = b"STRATA-HB1"
MAX_DATAGRAM = 1400
MAX_CLOCK_SKEW = 30.0


class HeartbeatError(ValueError):
    pass


@dataclass(frozen=True)
class Heartbeat:
    level: str
    sid: str  # the worker's gRPC address "host:port" (its server id)
    cpu: float
    state: str = "ready"  # ready | draining | master
    pid: int = 0
    seq: int = 0
    sent_at: float = 0.0
    chunks_done: int = 0
    role: str = "worker"


def encode_heartbeat(hb: Heartbeat, key: bytes) -> bytes:
    payload = json.dumps(hb.__dict__, separators=(",", ":"), sort_keys=True).encode()
    mac = hmac.new(key, MAGIC + payload, hashlib.sha256).digest()
    return MAGIC + mac + payload


def decode_heartbeat(data: bytes, key: bytes) -> Heartbeat:
    if len(data) > MAX_DATAGRAM or not data.startswith(MAGIC) or len(data) < len(MAGIC) + 32 + 2:
        raise HeartbeatError("not a Strata heartbeat")
    mac, payload = data[len(MAGIC): len(MAGIC) + 32], data[len(MAGIC) + 32:]
    want = hmac.new(key, MAGIC + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        raise HeartbeatError("bad HMAC (other group's key or forged)")
    try:
        d = json.loads(payload)
        hb = Heartbeat(**d)
    except (ValueError, TypeError) as e:
        raise HeartbeatError(f"malformed heartbeat: {e}") from None
    if not isinstance(hb.sid, str) or not isinstance(hb.cpu, (int, float)):
        raise HeartbeatError("malformed heartbeat fields")
    return hb


@dataclass
class PeerEntry:
    hb: Heartbeat
    received_at: float


@dataclass
class GroupTable:
    """The group's ``ip_table``: peers of *this* level heard recently."""

    level: str
    key: bytes
    timeout: float = 3.0
    peers: dict[str, PeerEntry] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)

    def receive(self, data: bytes, now: float) -> Heartbeat | None:
        try:
            hb = decode_heartbeat(data, self.key)
        except HeartbeatError as e:
            self.rejected["bad_hmac" if "HMAC" in str(e) else "garbage"] += 1
            return None
        if hb.level != self.level:
            self.rejected["other_level"] += 1
            return None
        if abs(hb.sent_at - time.time()) > MAX_CLOCK_SKEW:
            self.rejected["stale"] += 1
            return None
        prev = self.peers.get(hb.sid)
        if prev is not None and hb.pid == prev.hb.pid and hb.seq <= prev.hb.seq:
            self.rejected["replay"] += 1
            return None
        self.peers[hb.sid] = PeerEntry(hb, now)
        return hb

    def expire(self, now: float) -> list[str]:
        gone = [sid for sid, e in self.peers.items() if now - e.received_at > self.timeout]
        for sid in gone:
            del self.peers[sid]
        return gone

    def workers(self) -> dict[str, Heartbeat]:
        return {sid: e.hb for sid, e in self.peers.items() if e.hb.role == "worker"}


@dataclass(frozen=True)
class GroupSpec:
    """Where a level's group talks: multicast address/port, interface, TTL, key."""

    level: str
    address: str
    port: int
    key: bytes
    interface: str = "127.0.0.1"
    ttl: int = 0
    interval: float = 0.5


class GroupMember:
    """Sends this process's heartbeats and keeps the group table up to date."""

    def __init__(self, spec: GroupSpec, sid: str, role: str = "worker",
                 load: Callable[[], float] | None = None, stats: Callable[[], dict] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.sid = sid
        self.role = role
        self.table = GroupTable(spec.level, spec.key, timeout=max(3.0, 4 * spec.interval))
        self._load = load or _cpu_percent
        self._stats = stats or (lambda: {})
        self._clock = clock
        self._seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.state = "ready"
        self.cpu_override: float | None = None  # tests inject a load reading
        self._rx = _receiver(spec)
        self._tx = _sender(spec)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> "GroupMember":
        for target in (self._send_loop, self._recv_loop):
            t = threading.Thread(target=target, name=f"group-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for s in (self._rx, self._tx):
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2)

    # -- loops -----------------------------------------------------------------------
    def heartbeat_now(self) -> None:
        self._seq += 1
        stats = self._stats()
        hb = Heartbeat(
            level=self.spec.level, sid=self.sid,
            cpu=float(self.cpu_override if self.cpu_override is not None else self._load()),
            state=self.state, pid=_pid(), seq=self._seq, sent_at=time.time(),
            chunks_done=int(stats.get("chunks_done", 0)), role=self.role,
        )
        try:
            self._tx.sendto(encode_heartbeat(hb, self.spec.key), (self.spec.address, self.spec.port))
        except OSError:
            pass

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self.heartbeat_now()
            self._stop.wait(self.spec.interval)

    def _recv_loop(self) -> None:
        self._rx.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data, _ = self._rx.recvfrom(65535)
            except socket.timeout:
                with self._lock:
                    self.table.expire(self._clock())
                continue
            except OSError:
                return
            with self._lock:
                self.table.receive(data, self._clock())
                self.table.expire(self._clock())

    def snapshot(self) -> dict[str, Heartbeat]:
        with self._lock:
            self.table.expire(self._clock())
            return dict(self.table.workers())

    @property
    def rejected(self) -> Counter:
        with self._lock:
            return Counter(self.table.rejected)


def _pid() -> int:
    import os

    return os.getpid()


def _cpu_percent() -> float:
    """The default reading: the load of the CPUs this process may run on (worker/load.py)."""
    from .load import host_cpu_percent

    return host_cpu_percent()


def _receiver(spec: GroupSpec) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((spec.address, spec.port))
    mreq = struct.pack("4s4s", socket.inet_aton(spec.address), socket.inet_aton(spec.interface))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    return s


def _sender(spec: GroupSpec) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.bind((spec.interface, 0))  # never an implicit 0.0.0.0 source
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(spec.interface))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, int(spec.ttl))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    return s
