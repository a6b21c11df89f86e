"""A master that serves many clients (issue 14, item 2), through a real gRPC server on 127.0.0.1:0.

The master's client front is ``grpc.aio`` (master/server.py ``MasterServer``): an open stream holds
no thread.  One user opening the maximum of streams plus one gets RESOURCE_EXHAUSTED for the extra
one (counted), and another user's Login and Status still answer within 1 s; 200 subscribers over
25 sessions, a producer and a subscriber that never reads are all served while Status stays under 1 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from functools import partial

import grpc
import pyarrow as pa
import pytest

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.model import ChunkResult
from strata.master.core import MasterCore
from strata.master.aio_server import MasterServer
from strata.master.server import MasterServicer
from strata.master.sessions import StreamLimits
from strata.master.sessions import Sessions
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.users import UserStore

from . import helpers, tables
from .polling import wait_for

PW = "pw-streams"
QUERY = "SELECT COUNT(*) FROM Vitals"


#: this module's Vitals tuples: level S, sid "a", bp 100.0
vitals = partial(tables.vitals, bp=100.0)


class FakeWorker:
    """Answers every ready chunk with one row per instant and query (no engine), like a worker would."""

    def __init__(self, core: MasterCore, padded: set[str] = frozenset(), pad: int = 0):
        self.core = core
        self.padded, self.pad = padded, pad  # queries whose rows carry ``pad`` bytes each (large results)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def _run(self):
        core = self.core
        while not self._stop.is_set():
            core.heartbeat("w1", 10.0, slots=4)
            for chunk, sid in core.assignments():
                out = []
                for qc in chunk.queries:
                    n = len(qc.instants)
                    cols = {"ts": pa.array(qc.instants, pa.int64()), "level": pa.array(["S"] * n, pa.string())}
                    if qc.query_id in self.padded:
                        cols["pad"] = pa.array(["x" * self.pad] * n, pa.string())
                    out.append(ChunkResult(qc.query_id, chunk.chunk_id, pa.table(cols)))
                core.on_result(chunk.chunk_id, sid, out, span=(chunk.first_ts, chunk.last_ts))
            with core.cond:
                core.cond.wait(0.02)


@contextmanager
def master(tmp_path, cfg, users: dict[str, str], limits: StreamLimits | None = None):
    store = UserStore(tmp_path / "users.json", cfg.lattice)
    for name, roles in users.items():
        store.add(name, "S", PW, roles=roles.split(","))
    core = MasterCore(cfg, "S", chunk_instants=1)
    servicer = MasterServicer(core, Sessions(store, "S"), limits)
    server = MasterServer(servicer, "127.0.0.1:0").start()
    try:
        yield server, core, servicer
    finally:
        server.stop(0)


#: a plaintext session at level S on the in-process master at ``address``
login = partial(helpers.login, password=PW, timeout=10)


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def at_once(dt: float, idle: float) -> bool:
    """Whether a call took no longer than "at once": 1 s, or 5x the same call on the idle master just before
    (a login is an argon2 hash: on a loaded 2-core machine it alone can take most of a second)."""
    return dt < max(1.0, 5 * idle)


def test_one_user_cannot_hold_the_master(tmp_path, battlefield):
    limits = StreamLimits(per_session=8, per_user=10)
    with master(tmp_path, battlefield, {"ann": "analyst", "olga": "analyst,operator"}, limits) as (server, core, sv):
        limits._count = core.count_rejected
        first, idle_login = timed(lambda: login(server.address, "olga"))  # the same calls on the idle master
        _, idle_status = timed(first.status)
        first.close()
        ann = login(server.address, "ann")
        qid = ann.register([QUERY])[0].query_id
        md = (("authorization", f"Bearer {ann.token}"),)
        streams = [ann.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid], resume_after_ts=-1), metadata=md)
                   for _ in range(8)]
        wait_for(lambda: limits.open_streams() == 8, 10, "8 open streams")
        extra = ann.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid]), metadata=md)
        with pytest.raises(grpc.RpcError) as e:
            next(iter(extra))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = e.value.details()
        assert "\n" not in details and "max_streams_per_session" in details and "limit 8" in details

        # another user is served at once: Login and Status as on the idle master
        olga, dt = timed(lambda: login(server.address, "olga"))
        assert at_once(dt, idle_login), (dt, idle_login)
        st, dt = timed(olga.status)
        assert at_once(dt, idle_status), (dt, idle_status)
        assert st.rejected["too_many_streams"] == 1

        # the same user's second session: the per-user limit (10) stops it after 2 more
        ann2 = login(server.address, "ann")
        md2 = (("authorization", f"Bearer {ann2.token}"),)
        more = [ann2.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid]), metadata=md2) for _ in range(2)]
        wait_for(lambda: limits.open_streams() == 10, 10, "10 open streams")
        with pytest.raises(grpc.RpcError) as e:
            next(iter(ann2.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid]), metadata=md2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_user" in e.value.details()
        # an ingest stream counts too (and needs the producer role first: checked before the limit)
        with pytest.raises(grpc.RpcError) as e:
            ann2.stub.Ingest(iter([]), metadata=md2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # closing streams gives their slots back
        for s in streams + more:
            s.cancel()
        wait_for(lambda: limits.open_streams() == 0, 10, "the streams to close")
        again = ann.stub.Subscribe(pb.SubscribeRequest(query_ids=[qid]), metadata=md)
        wait_for(lambda: limits.open_streams() == 1, 10, "a new stream")
        again.cancel()
        assert olga.status().rejected["too_many_streams"] == 2
        for c in (ann, ann2, olga):
            c.close()


def test_200_subscribers_a_producer_and_a_stalled_reader(tmp_path, battlefield):
    users = {f"u{i}": "analyst" for i in range(5)} | {"pete": "producer", "olga": "operator", "sly": "analyst"}
    instants = 30
    padded: set[str] = set()
    with master(tmp_path, battlefield, users) as (server, core, sv), FakeWorker(core, padded, 1 << 20):
        sessions = []  # (token, query id): 5 sessions of 8 streams per user
        for i in range(5):
            first = login(server.address, f"u{i}")
            qid = first.register([QUERY])[0].query_id
            sessions.append((first, qid))
            for _ in range(4):
                sessions.append((login(server.address, f"u{i}"), qid))
        # a subscriber that never reads a query with large results (1 MiB per instant): its stream fills
        # its flow-control window and waits there; nobody else waits for it
        sly = login(server.address, "sly")
        padded.add(sly.register(["SELECT sid FROM Vitals"])[0].query_id)
        stalled = sly.stub.Subscribe(pb.SubscribeRequest(query_ids=sorted(padded)), metadata=sly._md)
        olga = login(server.address, "olga")
        pete = login(server.address, "pete")
        latencies = []

        async def run():
            got: dict[int, list[int]] = {}
            channels = [grpc.aio.insecure_channel(server.address) for _ in range(4)]

            async def subscribe(k: int, token: str, qid: str):
                stub = rpc.MasterStub(channels[k % len(channels)])
                got[k] = []
                call = stub.Subscribe(pb.SubscribeRequest(query_ids=[qid], resume_after_ts=-1),
                                      metadata=(("authorization", f"Bearer {token}"),))
                async for batch in call:
                    if batch.end:
                        return batch.state
                    got[k].extend(from_ipc(batch.arrow).column("ts").to_pylist())
                    await asyncio.sleep(0)

            tasks = []
            for j, (c, qid) in enumerate(sessions):
                for n in range(8 if j else 7):  # the stalled stream is the 200th
                    tasks.append(asyncio.create_task(subscribe(len(tasks), c.token, qid)))
            assert len(tasks) == 199
            deadline = time.monotonic() + 30
            while sv.limits.open_streams() < 200:
                assert time.monotonic() < deadline, sv.limits.open_streams()
                await asyncio.sleep(0.05)

            def produce():
                for lo in range(1, instants + 1, 3):
                    pete.ingest([("Vitals", vitals([lo, lo + 1, lo + 2]), lo + 2)], labelled=True)
                pete.advance(finish=True)

            producer = asyncio.get_running_loop().run_in_executor(None, produce)
            while not producer.done() or len(latencies) < 10:
                _, dt = await asyncio.get_running_loop().run_in_executor(None, timed, olga.status)
                latencies.append(dt)
            await producer
            states = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for ch in channels:
                await ch.close()
            return got, states

        got, states = asyncio.run(run())
        assert set(states) == {"ended"}
        want = list(range(1, instants + 1))
        assert all(sorted(v) == want for v in got.values()), {k: v for k, v in got.items() if sorted(v) != want}
        print(f"200 subscribers: {len(latencies)} status calls, max {max(latencies) * 1000:.0f} ms, "
              f"median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")  # shown with -rP
        assert max(latencies) < 1.0, latencies
        st = olga.status()
        assert st.counters["accepted"] == instants
        stalled.cancel()
        wait_for(lambda: sv.limits.open_streams() == 0, 10, "every stream to close")
        for c, _ in sessions:
            c.close()
        sly.close()


def test_ingest_stream_acknowledges_each_batch_once(tmp_path, battlefield):
    with master(tmp_path, battlefield, {"pete": "producer"}) as (server, core, sv):
        pete = login(server.address, "pete")

        def batch(seq, ts, producer="p1", **kw):
            return pb.IngestBatch(stream="Vitals", arrow=to_ipc(vitals(ts)), labelled=True, producer_id=producer,
                                  seq=seq, **kw)

        acks = list(pete.stub.IngestStream(iter([batch(1, [1, 1]), batch(2, [2]), batch(2, [2]),
                                                 batch(3, [3], advance_upto=2)]), metadata=pete._md))
        assert [(a.seq, a.accepted, a.duplicate, a.error) for a in acks] == \
            [(1, 2, False, ""), (2, 1, False, ""), (2, 1, True, ""), (3, 1, False, "")]
        assert acks[-1].chunks == 0 and core.pipeline.counters["accepted"] == 4  # no query: nothing to cut
        # a re-sent stream (a client that lost its acknowledgements) applies nothing twice
        acks = list(pete.stub.IngestStream(iter([batch(1, [1, 1]), batch(3, [3]), batch(4, [4])]), metadata=pete._md))
        assert [(a.seq, a.duplicate) for a in acks] == [(1, True), (3, True), (4, False)]
        assert core.pipeline.counters["accepted"] == 5 and core.producers == {"pete/p1": 4}
        # another producer id of the same user has its own numbering; a refusal ends the stream
        acks = list(pete.stub.IngestStream(iter([batch(1, [4], "p2"), batch(2, [0], "p2"), batch(3, [5], "p2")]),
                                           metadata=pete._md))
        assert [a.seq for a in acks] == [1, 2] and acks[1].error.startswith("stream Vitals: ts 0 is before")
        assert core.producers["pete/p2"] == 1
        pete.close()


def test_a_full_backlog_holds_the_producer_not_the_master(tmp_path, battlefield):
    """[limits] max_backlog_rows: once the chunks cut and not yet computed hold that many rows, a
    producer's next batch waits (its stream is not read: gRPC flow control holds the producer) while
    Status and other calls are served; when the workers catch up the batch is applied, nothing lost."""
    from dataclasses import replace as dc_replace

    cfg = dc_replace(battlefield, limits=dc_replace(battlefield.limits, max_backlog_rows=5))
    with master(tmp_path, cfg, {"pete": "producer", "olga": "operator,analyst"}) as (server, core, sv):
        olga = login(server.address, "olga")
        olga.register([QUERY])
        pete = login(server.address, "pete")
        acks: list = []

        def batches():
            for k in range(3):  # 4 rows each, closed at once: 8 rows cut after the second batch
                yield pb.IngestBatch(stream="Vitals", arrow=to_ipc(vitals([k + 1] * 4)), labelled=True,
                                     producer_id="p1", seq=k + 1, advance_upto=k + 1)

        def produce():
            acks.extend(pete.stub.IngestStream(batches(), metadata=pete._md))

        th = threading.Thread(target=produce, daemon=True)
        th.start()
        wait_for(lambda: len(acks) == 2, 10, "two batches acknowledged")
        assert core.backlog_rows() == 8 and core.backlog_full()
        st, dt = timed(olga.status)  # the master answers others meanwhile
        assert dt < 1.0 and st.counters["accepted"] == 8
        th.join(0.5)
        assert th.is_alive() and len(acks) == 2  # the third batch waits: no worker has drained anything
        with FakeWorker(core):  # a worker computes the backlog: the third batch goes in
            th.join(10)
        assert not th.is_alive() and [a.seq for a in acks] == [1, 2, 3] and not any(a.error for a in acks)
        assert core.pipeline.counters["accepted"] == 12 and core.backlog_rows() == 0
        pete.close()
        olga.close()


def test_the_aio_front_checks_client_certificates(tmp_path, battlefield):
    """Mutual TLS on the aio server: a client certificate of another level reaches no servicer
    (PERMISSION_DENIED, counted like the thread server's PeerCheck did); the right one logs in."""
    from strata.tls import PeerCheck, create_deployment, secure_channel, server_credentials

    tls = tmp_path / "tls"
    create_deployment(tls, ["S", "TS"], hosts=["127.0.0.1"])
    users = UserStore(tmp_path / "users.json", battlefield.lattice)
    users.add("ann", "S", PW, roles=["analyst"])
    core = MasterCore(battlefield, "S")
    sv = MasterServicer(core, Sessions(users, "S"))
    server = MasterServer(sv, "127.0.0.1:0", credentials=server_credentials(tls, "master", "S"),
                          peer_check=PeerCheck("S", ("client",), refused=core.refused)).start()
    try:
        wrong = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(
            (tls / "ca.pem").read_bytes(), (tls / "client-TS.key").read_bytes(), (tls / "client-TS.pem").read_bytes()),
            [("grpc.ssl_target_name_override", "master.s.strata")])
        for call in (lambda s: s.Login(pb.LoginRequest(user="ann", password=PW, level="S"), timeout=10),
                     lambda s: next(iter(s.Subscribe(pb.SubscribeRequest(), timeout=10)))):
            with pytest.raises(grpc.RpcError) as e:
                call(rpc.MasterStub(wrong))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert e.value.details() == "certificate of level TS; this server is of level S"
        assert core.refused == {"tls_wrong_level": 2}
        wrong.close()
        good = rpc.MasterStub(secure_channel(server.address, tls, "client", "S", "master"))
        assert good.Login(pb.LoginRequest(user="ann", password=PW, level="S"), timeout=10).token
    finally:
        server.stop(0)
