"""A running cluster: stop (kill -9) and restart the master mid-stream, and revoke a user mid-stream.

Both compare what clients received with the reference evaluator.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pyarrow as pa
import pytest

from strata.deploy.local import restart_process, start_cluster, stop_cluster
from strata.config import load_config
from strata.users import UserStore

from .conftest import BATTLEFIELD_TOML
from .helpers import alive, login, write_config
from .polling import wait_for
from .reference.evaluator import compare_results, evaluate
from .tables import mixed_vitals, rows_of

pytestmark = pytest.mark.slow

QUERIES = [
    "SELECT sid, AVG(bp) FROM Vitals [ROWS 5] GROUP BY sid",
    "SELECT ISTREAM sid, bp FROM Vitals [RANGE 2 seconds] WHERE bp > 120",
]


def test_master_restart_mid_stream_resumes_exactly_once(tmp_path):
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML, {"ann": "TS"})
    state = tmp_path / "state"
    started = start_cluster(str(cfg_path), ["TS"], 2, state)
    try:
        master = next(p for p in json.loads((state / "cluster.json").read_text())["processes"]
                      if p["role"] == "master")
        c = login(started, "ann", "TS")
        regs = c.register(QUERIES)
        got = {r.query_id: [] for r in regs}
        reconnects = []
        done, failed = threading.Event(), []

        def collect():
            try:
                for qid, table in c.follow([r.query_id for r in regs], reconnect_seconds=180,
                                           on_reconnect=reconnects.append):
                    if table is not None:
                        got[qid].extend(rows_of(table))
            except Exception as e:  # surfaced below
                failed.append(e)
            done.set()

        threading.Thread(target=collect, daemon=True).start()
        first, second = mixed_vitals(1, 21, 3), mixed_vitals(21, 41, 3)
        c.ingest([("Vitals", pa.Table.from_pylist(first))], labelled=True)
        c.advance(upto_ts=20)
        wait_for(lambda: sum(map(len, got.values())) > 0, 120, "results before the restart")
        os.kill(master["pid"], signal.SIGKILL)  # no chance to flush anything
        wait_for(lambda: not alive(master["pid"]), 10, "the master to die")
        restart_process(state, master["name"])
        c.wait_ready(30)
        # the same session token still works: the master persisted (its digest)
        c.ingest([("Vitals", pa.Table.from_pylist(second))], labelled=True)
        c.advance(finish=True)
        assert done.wait(240), "results did not complete after the restart"
        assert not failed, failed
        assert reconnects, "the client never noticed the restart"
        cfg = load_config(cfg_path)
        streams = {"Vitals": first + second}
        for r, q in zip(regs, QUERIES):
            compare_results(got[r.query_id], evaluate(q, cfg, "TS", streams))
        c.close()
    finally:
        stop_cluster(state)


def test_revoking_one_of_two_users_of_a_shared_query(warm_s):
    """ann and bob run the same query; ann's clearance drops below S mid-stream: bob's output still
    equals the reference, ann receives nothing after the revocation and her stream ends with an error.
    (A fresh master of the session's warm S cluster.)"""
    started = warm_s.renew({"ann": "TS", "bob": "S"})
    cfg = load_config(started["config"])
    try:
        clients, got, errors, ended = {}, {}, {}, {}
        q = QUERIES[0]
        for user in ("ann", "bob"):
            c = login(started, user)
            qid = c.register([q])[0].query_id
            clients[user], got[user], ended[user] = c, [], threading.Event()

            def collect(user=user, c=c, qid=qid):
                try:
                    for _, table in c.subscribe([qid]):
                        if table is not None:
                            got[user].extend(rows_of(table))
                except Exception as e:
                    errors[user] = e
                ended[user].set()

            threading.Thread(target=collect, daemon=True).start()
        bob = clients["bob"]
        first, second = mixed_vitals(1, 16, 3), mixed_vitals(16, 31, 3)
        bob.ingest([("Vitals", pa.Table.from_pylist(first))], labelled=True)
        bob.advance(upto_ts=15)
        wait_for(lambda: got["ann"] and max(r[0] for r in got["ann"]) == 15, 120, "ann's results up to 15")
        UserStore(cfg.users_path, cfg.lattice).set_clearance("ann", "C")  # the administrator's switch
        assert ended["ann"].wait(30), "ann's stream did not end after the revocation"
        assert "session ended" in str(errors.get("ann")), errors
        revoked_at = 15  # every instant up to 15 was closed before the switch
        bob.ingest([("Vitals", pa.Table.from_pylist(second))], labelled=True)
        bob.advance(finish=True)
        assert ended["bob"].wait(180)
        assert "bob" not in errors, errors
        ref = evaluate(q, cfg, "S", {"Vitals": first + second})
        compare_results(got["bob"], ref)
        assert all(r[0] <= revoked_at for r in got["ann"])
        compare_results(got["ann"], [r for r in ref if r[0] <= revoked_at])
        st = bob.status()
        assert st.counters["revocations"] == 1 and st.counters["queries"] == 1
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            clients["ann"].register([q])  # her token is gone
    finally:
        for c in clients.values():
            c.close()
