"""Bad input against a running master: every kind is refused with a clear message and counted in
`strata status`; what was accepted before and after stays accepted."""

from __future__ import annotations

import json
import os
import socket
from functools import partial

import pyarrow as pa
import pytest

from strata.arrowio import to_ipc
from strata.client import Client, QueryRejected
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.tls import secure_channel
from strata.deploy.local import start_cluster, stop_cluster
from strata.config import load_config
from strata.groups import group_spec

from .conftest import BATTLEFIELD_TOML
from .helpers import PASSWORD, strata, write_config
from .polling import poll
from . import tables

pytestmark = pytest.mark.slow

#: level U, every number 1.0, the columns as Arrow infers them (some cases send a wrong type on purpose)
vitals = partial(tables.vitals, level="U", bp=1.0, typed=False)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("badinput")
    cfg = write_config(d, BATTLEFIELD_TOML, {"sam": "S"})
    state = d / "state"
    started = start_cluster(str(cfg), ["S"], 0, state)  # a master alone: nothing here needs a worker
    yield {"config": cfg, "state": state, "address": started["masters"]["S"], "tls": started["tls_dir"]}
    stop_cluster(state)


def test_every_kind_of_bad_input_is_refused_and_counted(master):
    c = Client(master["address"], tls_dir=master["tls"], level="S")
    c.login("sam", PASSWORD, "S")
    good = c.ingest([("Vitals", vitals([1, 1, 2]))], labelled=True)
    assert (good.accepted, good.error) == (3, "")
    cases = [
        (("Nope", vitals([2])), True, "unknown stream 'Nope'"),
        (("Vitals", vitals([2]).drop_columns(["weight"])), True, "missing columns weight"),
        (("Vitals", vitals([2], bp=["high"])), True, "cannot be read as double"),
        (("Vitals", vitals([2], level="Q")), True, "unknown level"),
        (("Vitals", vitals([2], level="TS")), False, "may only write level S"),  # a source writes its level
        (("Vitals", vitals([2, 2]).set_column(1, "level", pa.array(["U", None]))), True, "have no level"),
        (("Vitals", vitals([1])), True, "before the stream's last ts"),
    ]
    for batch, labelled, message in cases:
        reply = c.ingest([batch], labelled=labelled)
        assert reply.accepted == 0 and reply.rejected == 1 and message in reply.error, (message, reply)
    c.advance(upto_ts=5)
    late = c.ingest([("Positions", pa.table({"ts": [3], "level": ["U"], "sid": ["a"], "lat": [1.0],
                                              "lon": ["E"]}))], labelled=True)
    assert "late tuple" in late.error
    big = vitals(list(range(6, 6 + 70_000)), sid=["x" * 1000] * 70_000)  # ~70 MB in one batch
    # a client that ignores the limit (ours refuses to send it): the master refuses and counts it
    raw = rpc.MasterStub(secure_channel(master["address"], master["tls"], "client", "S", "master",
                                        [("grpc.max_send_message_length", 256 * 1024 * 1024)]))
    reply = raw.Ingest(iter([pb.IngestBatch(stream="Vitals", arrow=to_ipc(big), labelled=True)]),
                       metadata=(("authorization", f"Bearer {c.token}"),), timeout=60)
    assert reply.accepted == 0 and "exceeds" in reply.error
    with pytest.raises(QueryRejected):
        c.register(["SELEC bp FROM Vitals"])
    spec = group_spec(load_config(master["config"]), "S", master["state"])
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
    port = json.loads((master["state"] / "cluster.json").read_text())["multicast_port"]
    for _ in range(3):
        tx.sendto(os.urandom(200), (spec.address, port))
    tx.close()
    after = c.ingest([("Vitals", vitals([6, 7]))], labelled=True)
    assert after.accepted == 2  # nothing before broke the stream

    def counted():
        st = c.status()
        return dict(st.rejected) if st.rejected.get("multicast:garbage", 0) >= 3 else None

    rejected = poll(counted, timeout=10)
    assert rejected, c.status().rejected
    for reason in ("unknown_stream", "missing_columns", "bad_type", "bad_level", "ts_decreasing",
                   "late_tuple", "oversized", "query"):
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    assert c.status().counters["accepted"] == 5
    c.close()
    r = strata("status", "--config", str(master["config"]), "--master", master["address"], "--user", "sam",
               "--tls-dir", master["tls"], "--level", "S")
    assert r.returncode == 0 and "late_tuple=1" in r.stdout and "multicast:garbage" in r.stdout, r.stdout
