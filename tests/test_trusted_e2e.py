"""The trusted architecture end to end (docs/trusted.md, issue 33): ``strata up --mode trusted`` starts ONE
master process and ONE worker (Spark) serving the sessions of S and TS on one address; an S session
receives the same with and without TS sessions registering queries and TS data arriving.

The S side is tests/test_level_safety.py's scenario (an analyst's queries and refused calls, a labelled
producer whose batches do or do not carry TS rows, a second producer's batches, advances and refusals,
an operator's finish, the analyst's, operator's and producer's status JSON through the CLI, the result
streams).  In the run *with TS* a TS analyst's queries run and a TS producer's input arrives on the same
master and worker all along the S scenario; everything the S sessions receive must be identical to the
run without (status compared as tests/helpers.py ``stable``), the S results equal the reference, and so
do the TS results over the TS input TS kept.  Arrival times, under ``fixed_slot`` (the trusted master and
worker take turns on one grid of the wall clock, strata/turns.py): every S result message of every run
arrives in one of S's slots, and the operator's finish is made at the same phase of the round in every
run (in TS's slot), after which each S query's last result arrives within one round (``ROUND``, 1 s) of
its arrival without TS (arrivals step by whole rounds: the same slot when S's work fits in it, a round
later when S's call ends past the slot's edge in one run only; test_level_safety.py
``assert_arrivals_within_rounds`` has the measurements).  The slots are 0.5 s, sized to S's finishing
chunk (docs/trusted.md "Choosing the slot").  Each run starts from an empty master (its state files
removed, ``renew_master``) on the warm worker.

The same runs are the trusted mode's load-shedding test (docs/semantics.md §10): the cluster runs with
``[limits] overload = "shed"`` and a backlog bound S's scenario can never reach (its 7 kept tuples, read by
4 queries, are at most 28 rows), while the TS producer's 200-row batches (each about 450 rows of TS's
backlog) overload TS's pipeline: TS sheds before the S scenario starts and while it runs.  So S's results,
status, errors and arrival times are compared with and without an overloaded, shedding TS on the same
master process and worker; TS's output equals the reference over the tuples TS kept; TS's sessions read
what was shed (status, ``strata ingest``) and S's sessions nothing of it.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pyarrow as pa
import pytest

from strata.api import status_view
from strata.config import load_config
from strata.deploy.local import stop_cluster
from strata.examples import BATTLEFIELD_TOML

from .helpers import login, strata, write_config
from .polling import wait_for
from .reference.evaluator import compare_results, evaluate
from .tables import rows_of
from . import test_level_safety as safety
from .test_level_safety import QUERIES

#: the workers this module starts warm up (conftest.py: the suite's default skips it): arrival times are
#: compared across runs: the workers start warm, as users' do
WORKER_WARM_UP = True

pytestmark = pytest.mark.slow

USERS = {"p1": ("TS", "producer"), "p2": ("S", "producer"), "ana": ("S", "analyst"), "op": ("S", "operator"),
         "tess": "TS", "tia": ("TS", "analyst")}
#: load shedding for every level of the trusted master (each level's shedder reads its own backlog): S's whole
#: scenario gives at most 7 tuples x 4 queries = 28 rows of backlog, so S never sheds; a TS batch gives about 450,
#: so TS keeps 3 batches, then sheds until fewer than 500 rows are left (one batch or none): TS's work never runs out
SHED = 1000
TS_QUERIES = [
    "SELECT sid, AVG(bp) FROM Vitals [RANGE 3 seconds] GROUP BY sid",
    "SELECT level, COUNT(*) FROM Vitals [ROWS 50] GROUP BY level",
    "SELECT bp FROM Vitals [NOW] WHERE level = TS",
]
LEVELS = ("U", "C", "S", "TS")
#: the turns' slot and round (S's slot, then TS's), on the wall clock's grid: a slot S's finishing chunk fits in
#: (0.4-0.8 s of Spark on the loaded 2-core machine; docs/trusted.md "Choosing the slot")
SLOT = 0.5
ROUND = 2 * SLOT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("trusted")
    # the levels take turns in the trusted worker (strata/turns.py): S's slots are S's whatever TS does
    cfg = write_config(d, BATTLEFIELD_TOML + f'\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = {SLOT}\n'
                       f'\n[limits]\noverload = "shed"\nshed_backlog_rows = {SHED}\n', USERS)
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
    assert f"levels S, TS take turns: fixed_slot, {SLOT:g} s slots" in log
    assert f"master: levels S, TS take turns: fixed_slot, {SLOT:g} s slots" in (
        cluster["state"] / "logs" / "master-trusted.log").read_text()  # the master takes the same turns
    assert not (cluster["state"] / "run" / "slots.json").exists()  # no host gate: the worker schedules inside


def ts_batch(i: int) -> pa.Table:
    """The TS producer's i-th batch: 5 instants of 40 rows at every level."""
    ts = [5 * i + j // 40 for j in range(200)]
    return pa.table({"ts": pa.array(ts, pa.int64()), "level": [LEVELS[j % 4] for j in range(200)],
                     "sid": [f"s{j % 7}" for j in range(200)], "bp": [float(90 + (j * 7) % 60) for j in range(200)],
                     "pr": [1.0] * 200, "weight": [1.0] * 200})


class TsLoad:
    """A TS analyst's queries and a TS producer's input on the trusted master while the S scenario runs.

    The producer sends as fast as it can, so TS's pipeline is overloaded and sheds (``SHED``): it starts
    shedding before the S scenario and sheds all along it.  Each batch is 5 new instants closed after it,
    so each is kept or shed whole.  Once the S scenario is done it goes on up to the next batch shed and
    leaves that batch's instants open; :meth:`finish` then sends a Positions file at them through
    ``strata ingest --finish`` (shed too, said in one line) and reads what TS's sessions see."""

    def __init__(self, cl):
        self.cl = cl
        self.ana, self.prod = login(cl, "tia", "TS"), login(cl, "tess", "TS")  # an analyst; every role
        wait_for(lambda: len(self.prod.status().workers) == 1, 30, "the worker in the TS pipeline's table")
        self.regs = self.ana.register(TS_QUERIES)
        self.got = {r.query_id: [] for r in self.regs}
        self.sent: list[tuple[pa.Table, object]] = []  # each batch and its IngestReply
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._collect, daemon=True),
                        threading.Thread(target=self._produce, daemon=True)]
        for t in self.threads:
            t.start()
        wait_for(lambda: len(self.sent) >= 3 and any(r.shed for _, r in self.sent), 60,
                 "TS input flowing and TS shedding before the S scenario")
        self.s_from = len(self.sent)  # the batches sent while the S scenario runs: from here ...

    def _collect(self):
        for qid, t in self.ana.subscribe([r.query_id for r in self.regs]):
            if t is not None:
                self.got[qid].extend(rows_of(t))

    def _produce(self):
        i, after = 0, 0
        while True:
            b = ts_batch(i)
            r = self.prod.ingest([("Vitals", b)], labelled=True)
            self.sent.append((b, r))
            if self.stop.is_set():
                after += 1
                if r.shed or after > 2000:  # the last batch shed (its instants left open), or give up
                    return
            self.prod.advance(upto_ts=5 * i + 4)
            i += 1

    def finish(self, config) -> None:
        self.s_to = len(self.sent)  # ... to here
        self.stop.set()
        self.threads[1].join(180)
        assert not self.threads[1].is_alive(), "the TS load did not end"
        last = len(self.sent) - 1
        pos = self.cl["state"].parent / "positions.csv"
        pos.write_text("ts,level,sid,lat,lon\n" + "".join(f"{t},TS,s{t % 3},{t}.5,e\n"
                                                           for t in range(5 * last, 5 * last + 5)))
        self.cli = strata("ingest", "--config", str(self.cl["config"]), "--master", self.cl["masters"]["TS"], "--user",
                          "tess", "--level", "TS", "--tls-dir", self.cl["tls"], "--labelled", "--finish", "--input",
                          f"Positions={pos}", timeout=120)
        assert self.cli.returncode == 0, self.cli.stderr  # else TS's input never finishes
        self.threads[0].join(180)
        assert not self.threads[0].is_alive(), "the TS result streams did not end"
        self.status = {"analyst": status_view(self.ana.status(), []), "operator": status_view(self.prod.status(), [])}
        self.ana.close()
        self.prod.close()


def run_scenario(cl, with_ts: bool, loads: list | None = None) -> tuple[dict, dict]:
    """tests/test_level_safety.py's scenario on the trusted master (its renewal removes every level's state),
    with a TS session's queries and input all along when ``with_ts`` (the :class:`TsLoad` appended to
    ``loads``)."""
    def load(c):
        loads.append(TsLoad(c))
        return loads[-1]

    return safety.run_scenario(cl, with_ts, load=load if with_ts else None, worker_cpu=True,
                               before_close=in_ts_slot)




def in_ts_slot() -> None:
    """Until 50 ms into TS's next slot (the finish at the same phase of the round in every run): a position
    in time for the measurement, not a synchronisation."""
    now = time.time()
    at = math.floor(now / ROUND) * ROUND + SLOT + 0.05
    time.sleep(at - now if at >= now else at + ROUND - now)


@pytest.fixture(scope="module")
def runs(cluster):
    loads: list[TsLoad] = []
    return {"first": run_scenario(cluster, False), "with_ts": run_scenario(cluster, True, loads),
            "without": run_scenario(cluster, False), "config": load_config(cluster["config"]), "ts": loads[0]}


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


def test_the_worker_runs_each_levels_jobs_in_its_declared_pool(cluster, runs):
    """worker/pools.py: the session read the allocation file (Spark warns of a pool it creates on the fly)."""
    log = (cluster["state"] / "logs" / "worker-trusted-0.log").read_text()
    assert "has not been configured" not in log, [x for x in log.splitlines() if "has not been configured" in x]


def test_s_results_arrive_in_s_slots_and_within_rounds_of_the_run_without_ts(runs):
    safety.assert_arrivals_in_slots(runs, ROUND, 0.0, SLOT, late=0.1)
    safety.assert_arrivals_within_rounds(runs, ROUND, 1)


def test_ts_sheds_and_its_output_equals_the_reference_over_the_tuples_it_kept(runs):
    """TS overloaded on the trusted master: it shed before and while the S scenario ran, its output equals
    the reference over the batches it kept, and its producer, analyst and operator are told what was shed."""
    ts, config = runs["ts"], runs["config"]
    n = 200  # rows per batch
    for _, r in ts.sent:  # 5 new instants each: kept or shed whole
        assert (r.shed, r.accepted) in ((n, 0), (0, n)) and r.error == "", r
    shed = [i for i, (_, r) in enumerate(ts.sent) if r.shed]
    assert any(i < ts.s_from for i in shed) and any(ts.s_from <= i < ts.s_to for i in shed), \
        (shed, ts.s_from, ts.s_to)  # TS shed before the S scenario and while it ran
    kept = [b for b, r in ts.sent if not r.shed]
    assert kept and shed[-1] == len(ts.sent) - 1, "TS did not end on a shed batch (its instants left open)"
    rows = pa.concat_tables(kept).to_pylist()
    for r, q in zip(ts.regs, TS_QUERIES):
        compare_results(ts.got[r.query_id], evaluate(q, config, "TS", {"Vitals": rows}))

    # `strata ingest`: the Positions rows at the last batch's (shed, still open) instants are shed too
    last = 5 * shed[-1]
    assert ts.cli.returncode == 0, ts.cli.stderr
    lines = [x.removeprefix("[strata] ") for x in ts.cli.stderr.splitlines() if x.startswith("[strata] shed ")]
    assert lines == [f"shed 5 tuples at instants {last}-{last + 4}: level TS was overloaded "
                     f"([limits] overload = \"shed\"); `strata status` lists the instants shed"], ts.cli.stderr

    # every TS session reads the level's shedding; its operator also the counters
    view = ts.status["analyst"]["shedding"]
    assert ts.status["operator"]["shedding"] == view and "counters" not in ts.status["analyst"]
    assert (view["mode"], view["shed_backlog_rows"], view["resume_backlog_rows"]) == ("shed", SHED, SHED // 2)
    assert view["rows"] == {"Vitals": n * len(shed), "Positions": 5}
    assert view["instants"] == {"Vitals": 5 * len(shed), "Positions": 5}
    assert view["batches"] == len(shed) + 1 and view["episodes"] >= 2  # shed, resumed and shed again
    if view["ranges_total"] <= len(view["ranges"]):  # every range listed: they say the same
        assert [t for a, b in view["ranges"] for t in range(a, b + 1)] == \
            [t for i in shed for t in range(5 * i, 5 * i + 5)]
    counters = ts.status["operator"]["counters"]
    assert counters["shed_rows"] == n * len(shed) + 5 and counters["shed_batches"] == view["batches"]
    assert counters["shed_episodes"] == view["episodes"] and counters["accepted"] == n * len(kept)


def test_nothing_of_ts_shedding_reaches_the_s_sessions(runs):
    """S's sessions read S's own shedding (never: its bound is out of its reach), the same with and without
    the overloaded TS (the equality above), and nothing of TS's."""
    for run in ("with_ts", "without"):
        seen = runs[run][0]
        for user in ("ana", "op", "p2"):
            assert seen[f"status_{user}"]["shedding"] == {
                "mode": "shed", "active": False, "shed_backlog_rows": SHED, "resume_backlog_rows": SHED // 2,
                "rows": {}, "instants": {}, "ranges": [], "ranges_total": 0, "batches": 0, "episodes": 0}, (run, user)
        counters = seen["status_op"]["counters"]
        assert {k: v for k, v in counters.items() if k.startswith("shed")} == {
            "shed_rows": 0, "shed_instants": 0, "shed_batches": 0, "shed_episodes": 0, "shedding": 0}, run
        assert not any("shed" in k for k in seen["status_op"]["rejected"])
