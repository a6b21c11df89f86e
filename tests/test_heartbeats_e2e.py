"""Hardened heartbeats with real processes on loopback (a master and two Spark workers of level S,
mutual TLS): a forger inside the level (it has the level's group key) speaks for the real
workers' addresses, replays their heartbeats and sends NaN and garbage, all the time; none of it
changes where chunks go.  A worker that left cannot be impersonated; restarted on its address
(a new identity key), it is listed again once the master has proven it."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import replace

import pyarrow as pa
import pytest

from strata.deploy.local import restart_process, start_cluster, stop_cluster
from strata.config import load_config
from strata.groups import group_spec
from strata.groups.membership import Heartbeat, Identity, receiver, encode_heartbeat, encode_payload, seal

from .conftest import BATTLEFIELD_TOML
from .helpers import login, write_config
from .polling import poll, wait_for

pytestmark = pytest.mark.slow
QUERY = "SELECT AVG(bp) FROM Vitals [ROWS 2]"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("hb-cluster")
    cfg = write_config(d, BATTLEFIELD_TOML, {"sam": "S"})
    config = load_config(cfg)
    state = d / "state"
    # injected readings: worker 0 idle, worker 1 saturated; Algorithm 5 sends worker 1 nothing
    out = start_cluster(str(cfg), ["S"], 2, state,
                        worker_env={0: {"STRATA_CPU_OVERRIDE": "5"}, 1: {"STRATA_CPU_OVERRIDE": "95"}})
    record = json.loads((state / "cluster.json").read_text())
    spec = replace(group_spec(config, "S", state), port=record["multicast_port"])
    yield {"state": state, "master": out["masters"]["S"], "tls": out["tls_dir"], "record": record,
           "dest": (spec.address, record["multicast_port"]), "spec": spec}
    stop_cluster(state)


def worker(cluster, i):
    return next(p for p in cluster["record"]["processes"] if p["name"] == f"worker-S-{i}")


def listed(c):
    return {w.sid: w for w in c.status().workers}


class Forger:
    """Sends, every few ms until stopped: heartbeats for other workers' addresses under its own
    identities (it has the group key), replays of captured real heartbeats, NaN and garbage."""

    def __init__(self, cluster, captured: list[bytes]):
        self.key = cluster["spec"].key
        self.dest = cluster["dest"]
        self.captured = captured
        self.claims: list[tuple[str, float, str]] = []  # (address, cpu, state) to speak for
        self.ids = [Identity() for _ in range(3)]
        self.seq = 0
        self.sent = 0
        self._stop = threading.Event()
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.tx.bind(("127.0.0.1", 0))
        self.tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        self.tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def datagrams(self):
        self.seq += 1
        now = time.time()
        for i, (sid, cpu, state) in enumerate(self.claims):
            yield encode_heartbeat(Heartbeat("S", sid, cpu, state=state, pid=os.getpid(), seq=self.seq, sent_at=now),
                                   self.key, self.ids[i % len(self.ids)])
        me = self.ids[0]
        good = {"level": "S", "sid": "127.0.0.1:1", "cpu": 0.0, "state": "ready", "pid": 1, "seq": self.seq,
                "sent_at": now, "chunks_done": 0, "role": "worker", "slots": 2, "identity": me.hex}
        yield encode_payload({**good, "cpu": float("nan")}, self.key, me)  # NaN (JSON NaN): bad_json
        yield encode_payload(json.dumps(good).replace('"cpu": 0.0', '"cpu": -1e999').encode(), self.key, me)
        yield encode_payload({**good, "cpu": -5.0}, self.key, me)
        yield encode_payload({**good, "sent_at": "now"}, self.key, me)
        yield encode_payload({**good, "slots": 0}, self.key, me)
        yield seal(os.urandom(120), self.key)  # valid tag, garbage inside
        yield os.urandom(200)
        yield b"STRATA-HB1" + os.urandom(32) + b'{"level":"S"}'  # the old format
        yield encode_heartbeat(Heartbeat("S", "127.0.0.1:2", 0.0, seq=1, sent_at=now), os.urandom(32))  # no key
        yield from self.captured  # replays

    def _run(self):
        while not self._stop.is_set():
            for data in self.datagrams():
                self.tx.sendto(data, self.dest)
                self.sent += 1
            self._stop.wait(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(5)
        self.tx.close()


def capture(cluster, n: int, seconds: float = 10.0) -> list[bytes]:
    """Real heartbeats off the group, as any local process can read (and later replay) them."""
    rx = receiver(cluster["spec"])
    rx.settimeout(0.2)
    out, deadline = [], time.monotonic() + seconds
    try:
        while len(out) < n and time.monotonic() < deadline:
            try:
                out.append(rx.recvfrom(65535)[0])
            except OSError:
                pass
    finally:
        rx.close()
    return out


def rows_of(c, qid, n, after=-1, timeout=120.0):
    """The instants of the first ``n`` result rows of ``qid`` after instant ``after``."""
    got, deadline = [], time.monotonic() + timeout
    for q, table in c.subscribe([qid], resume_after_ts=after):
        if table is not None:
            got.extend(table.column("ts").to_pylist())
        if len(got) >= n or table is None or time.monotonic() > deadline:
            break
    return got


def batch(first, last):
    ts = list(range(first, last + 1))
    return pa.table({"ts": ts, "level": ["S"] * len(ts), "sid": ["a"] * len(ts), "bp": [float(t) for t in ts],
                     "pr": [1.0] * len(ts), "weight": [1.0] * len(ts)})


def test_forgers_replays_and_garbage_change_nothing_in_dispatch(cluster):
    w0, w1 = worker(cluster, 0)["address"], worker(cluster, 1)["address"]
    with login(cluster, "sam") as c:
        wait_for(lambda: set(listed(c)) == {w0, w1}, 60, "both workers listed")
        captured = capture(cluster, 12)
        assert len(captured) >= 4
        with Forger(cluster, captured) as f:
            f.claims = [(w0, 100.0, "ready"), (w0, 0.0, "draining"), (w1, 0.0, "ready"),
                        ("127.0.0.1:9", 0.0, "ready")]  # nobody answers there
            wait_for(lambda: c.status().rejected.get("multicast:unbound_key", 0) >= 20, 30, "forgeries refused")
            qid = c.register([QUERY])[0].query_id
            c.ingest([("Vitals", batch(1, 8))], labelled=True)
            c.advance(upto_ts=8)
            assert rows_of(c, qid, 8) == list(range(1, 9))
            st = c.status()
            ws = {w.sid: w for w in st.workers}
            assert set(ws) == {w0, w1}  # the forged address is never listed
            assert (ws[w0].cpu, ws[w0].state, ws[w0].pid) == (5.0, "ready", worker(cluster, 0)["pid"])
            assert (ws[w1].cpu, ws[w1].state, ws[w1].pid) == (95.0, "ready", worker(cluster, 1)["pid"])
            assert ws[w0].chunks_done >= 1 and ws[w1].chunks_done == 0  # chunks went by the real readings
            rej = st.rejected
            for reason in ("unbound_key", "replay", "bad_json", "bad_cpu", "bad_sent_at", "bad_slots", "bad_key",
                           "garbage", "old_format"):
                assert rej.get(f"multicast:{reason}", 0) >= 1, (reason, dict(rej))
            assert rej.get("multicast:internal", 0) == 0
            assert f.sent > 100


def test_a_worker_that_left_is_not_impersonated_and_a_restarted_one_is_proven(cluster):
    w0, w1 = worker(cluster, 0)["address"], worker(cluster, 1)["address"]
    with login(cluster, "sam") as c:
        wait_for(lambda: set(listed(c)) == {w0, w1}, 60, "both workers listed")
        captured = [d for d in capture(cluster, 12)]
        os.killpg(worker(cluster, 1)["pid"], signal.SIGKILL)
        wait_for(lambda: set(listed(c)) == {w0}, 30, "worker 1 dropped")
        with Forger(cluster, captured) as f:  # speaks for the dead worker, replays its heartbeats
            f.claims = [(w1, 0.0, "ready"), (w0, 100.0, "draining")]
            n = c.status().rejected.get("multicast:unbound_key", 0)
            wait_for(lambda: c.status().rejected.get("multicast:unbound_key", 0) >= n + 100, 30, "forgeries")
            assert set(listed(c)) == {w0}
            qid = c.register([QUERY])[0].query_id
            c.ingest([("Vitals", batch(9, 12))], labelled=True)
            c.advance(upto_ts=12)
            assert rows_of(c, qid, 4) == [9, 10, 11, 12]
            # the real worker comes back on its address with a new identity key: proven, listed
            p = restart_process(cluster["state"], "worker-S-1")
            got = poll(lambda: (w := listed(c).get(w1)) is not None and w.pid == p["pid"] and w, 60)
            assert got and got.cpu == 95.0 and got.state == "ready"
            c.ingest([("Vitals", batch(13, 16))], labelled=True)
            c.advance(finish=True)
            assert rows_of(c, qid, 4, after=12) == [13, 14, 15, 16]
            ws = listed(c)
            assert ws[w0].cpu == 5.0 and ws[w0].state == "ready" and ws[w1].chunks_done == 0
            assert c.status().rejected.get("multicast:replay", 0) >= 1 and f.sent > 100
