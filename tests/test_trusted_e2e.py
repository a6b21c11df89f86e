"""The trusted architecture end to end (docs/trusted.md, issue 33): ``strata up --mode trusted`` starts ONE
master process and ONE worker (Spark) serving the sessions of S and TS on one address; an S session
receives the same with and without TS sessions registering queries and TS data arriving.

The S side is tests/test_level_safety.py's scenario (an analyst's queries and refused calls, a labelled
producer whose batches do or do not carry TS rows, a second producer's batches, advances and refusals,
an operator's finish, the analyst's, operator's and producer's status JSON through the CLI, the result
streams).  In the run *with TS* a TS analyst's queries run and a TS producer's input arrives on the same
master and worker all along the S scenario; everything the S sessions receive must be identical to the
run without (status compared as tests/helpers.py ``stable``), the S results equal the reference, and so
do the TS results over the TS input.  Arrival times: within a generous tolerance (the CPU is shared;
docs/trusted.md says what timing coupling remains).  Each run starts from an empty master (its state
files removed, ``renew_master``) on the warm worker.
"""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest

from strata.config import load_config
from strata.deploy.local import stop_cluster
from strata.examples import BATTLEFIELD_TOML

from .helpers import login, strata, write_config
from .polling import wait_for
from .reference.evaluator import compare_results, evaluate
from .tables import rows_of
from . import test_level_safety as safety
from .test_level_safety import QUERIES

pytestmark = pytest.mark.slow

USERS = {"p1": ("TS", "producer"), "p2": ("S", "producer"), "ana": ("S", "analyst"), "op": ("S", "operator"),
         "tess": "TS"}
TS_QUERIES = [
    "SELECT sid, AVG(bp) FROM Vitals [RANGE 3 seconds] GROUP BY sid",
    "SELECT level, COUNT(*) FROM Vitals [ROWS 50] GROUP BY level",
    "SELECT bp FROM Vitals [NOW] WHERE level = TS",
]
LEVELS = ("U", "C", "S", "TS")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("trusted")
    # the levels take turns in the trusted worker (worker/turns.py): S's slots are S's whatever TS does
    cfg = write_config(d, BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "fixed_slot"\n', USERS)
    state = d / "state"
    r = strata("up", "--config", str(cfg), "--levels", "S,TS", "--workers", "1", "--state-dir", str(state),
               "--mode", "trusted", timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    try:
        record = json.loads((state / "cluster.json").read_text())
        yield {"config": cfg, "state": state, "masters": out["masters"], "tls": out["tls_dir"],
               "master": out["masters"]["S"], "record": record}
    finally:
        stop_cluster(state)


def test_one_master_and_one_worker_serve_both_levels(cluster):
    procs = cluster["record"]["processes"]
    assert sorted((p["role"], p["name"]) for p in procs) == [("master", "master-trusted"), ("worker", "worker-trusted-0")]
    assert cluster["masters"]["S"] == cluster["masters"]["TS"]
    assert all(p["level"] == "TS" and p["serves"] == ["S", "TS"] for p in procs)
    log = (cluster["state"] / "logs" / "worker-trusted-0.log").read_text()
    assert "levels S, TS take turns: fixed_slot, 0.25 s slots" in log
    assert not (cluster["state"] / "run" / "slots.json").exists()  # no host gate: the worker schedules inside


def ts_batch(i: int) -> pa.Table:
    """The TS producer's i-th batch: 5 instants of 40 rows at every level."""
    ts = [5 * i + j // 40 for j in range(200)]
    return pa.table({"ts": pa.array(ts, pa.int64()), "level": [LEVELS[j % 4] for j in range(200)],
                     "sid": [f"s{j % 7}" for j in range(200)], "bp": [float(90 + (j * 7) % 60) for j in range(200)],
                     "pr": [1.0] * 200, "weight": [1.0] * 200})


class TsLoad:
    """A TS analyst's queries and a TS producer's input on the trusted master while the S scenario runs."""

    def __init__(self, cl):
        self.ana, self.prod = login(cl, "tess", "TS"), login(cl, "tess", "TS")
        wait_for(lambda: len(self.ana.status().workers) == 1, 30, "the worker in the TS pipeline's table")
        self.regs = self.ana.register(TS_QUERIES)
        self.got = {r.query_id: [] for r in self.regs}
        self.sent: list[pa.Table] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._collect, daemon=True),
                        threading.Thread(target=self._produce, daemon=True)]
        for t in self.threads:
            t.start()
        wait_for(lambda: len(self.sent) >= 3, 60, "TS input flowing before the S scenario")

    def _collect(self):
        for qid, t in self.ana.subscribe([r.query_id for r in self.regs]):
            if t is not None:
                self.got[qid].extend(rows_of(t))

    def _produce(self):
        i = 0
        while not self.stop.is_set():
            b = ts_batch(i)
            self.prod.ingest([("Vitals", b)], labelled=True)
            self.prod.advance(upto_ts=5 * i + 4)
            self.sent.append(b)
            i += 1
        self.prod.advance(finish=True)

    def finish(self, config) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)
            assert not t.is_alive(), "the TS load did not end"
        rows = pa.concat_tables(self.sent).to_pylist()
        for r, q in zip(self.regs, TS_QUERIES):
            compare_results(self.got[r.query_id], evaluate(q, config, "TS", {"Vitals": rows}))
        self.ana.close()
        self.prod.close()


def run_scenario(cl, with_ts: bool) -> tuple[dict, dict]:
    """tests/test_level_safety.py's scenario on the trusted master (its renewal removes every level's state),
    with a TS session's queries and input all along when ``with_ts``."""
    return safety.run_scenario(cl, with_ts, load=TsLoad if with_ts else None, worker_cpu=True)


@pytest.fixture(scope="module")
def runs(cluster):
    return {"first": run_scenario(cluster, False), "with_ts": run_scenario(cluster, True),
            "without": run_scenario(cluster, False), "config": load_config(cluster["config"])}


def test_s_sessions_receive_the_same_with_and_without_ts_sessions_and_data(runs):
    with_ts, without = runs["with_ts"][0], runs["without"][0]
    for key in without:  # one key at a time, for a readable failure
        assert with_ts[key] == without[key], key
    assert runs["first"][0] == without


def test_what_the_s_sessions_received(runs):
    seen = runs["with_ts"][0]
    op = seen["status_op"]
    assert op["level"] == "S" and op["workers"] == 1 and op["counters"]["accepted"] == 7
    assert seen["cpu_op"] == [0.0]
    assert [q["state"] for q in seen["status_ana"]["queries"]] == ["ended"] * len(QUERIES)
    assert not any(k.startswith(("transport:", "multicast:")) for k in op["rejected"])
    safety.assert_results_equal_the_reference(seen, runs["config"])


def test_results_arrive_at_the_same_time_within_a_generous_tolerance(runs):
    safety.assert_arrivals_within_a_generous_tolerance(runs)
