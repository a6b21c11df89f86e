"""Metadata is data (issue 12), in the style of PostgreSQL's row-security regression suite: the same
scenario runs against an S master with and without above-level (TS) rows in one producer's labelled
input, and everything the S sessions receive must be identical apart from the fields
docs/semantics.md §9 lists as volatile: an analyst's, an operator's and a second producer's status
JSON (through the CLI), every error text, the second producer's ingest and advance replies, the
first producer's replies apart from its own dropped count, and the result streams.  The time at which
results arrive is compared within a generous tolerance.

The session's warm S cluster (a master and one Spark worker, conftest.py ``warm_s``) serves the module;
before each run the master is stopped, its state file removed and the master started again on the same
address (``renew_master``), so every run starts from an empty level.  The first run's answers must also
equal the others'.
"""

from __future__ import annotations

import json
import threading
import time

import pyarrow as pa
import pytest

from strata.client import ClientError
from strata.deploy.local import renew_master
from strata.config import load_config

from .helpers import login, stable, strata
from .polling import wait_for
from .reference.evaluator import compare_results, evaluate
from .tables import rows_of

pytestmark = pytest.mark.slow

MAXLONG = 2**63 - 1
USERS = {"p1": ("TS", "producer"), "p2": ("S", "producer"), "ana": ("S", "analyst"), "op": ("S", "operator")}
QUERIES = [
    "SELECT COUNT(*) FROM Vitals [RANGE 3 seconds]",
    "SELECT sid, bp FROM Vitals [ROWS 2]",
    "SELECT level, COUNT(*) FROM Vitals GROUP BY level",
    "SELECT bp FROM Vitals [NOW]",
]
# the first producer's labelled batches (ts, level): the TS rows are what the two runs differ in
P1 = [
    ("Vitals", [(1, "S"), (2, "TS"), (3, "TS"), (500000, "TS")]),  # the report: a TS row far ahead
    ("Vitals", [(4, "U"), (2, "TS"), (5, "C")]),                   # a TS row going backwards
    ("Vitals", [(6, "S"), (MAXLONG, "TS")]),                       # a TS row beyond [limits] max_ts
    ("Vitals", [(7, "TS"), (8, "TS")]),                            # nothing at or below S
    ("Nope", [(9, "TS")]),                                          # an unknown stream, all above S
]
LATE_TS = ("Vitals", [(3, "TS")])  # sent after instant 9 is closed: late for S only if it were kept


def table(rows, labelled=True) -> pa.Table:
    cols = {"ts": pa.array([t for t, _ in rows], pa.int64())}
    if labelled:
        cols["level"] = pa.array([lv for _, lv in rows], pa.string())
    n = len(rows)
    cols |= {"sid": pa.array([f"s{t % 3}" for t, _ in rows], pa.string()),
             "bp": pa.array([float(100 + t % 50) for t, _ in rows], pa.float64()),
             "pr": pa.array([1.0] * n, pa.float64()), "weight": pa.array([1.0] * n, pa.float64())}
    return pa.table(cols)


def attempt(call):
    try:
        out = call()
        return out if isinstance(out, (int, str, type(None))) else "ok"
    except ClientError as e:
        return f"{type(e).__name__}: {e}"


def reply(r) -> dict:
    return {"accepted": r.accepted, "dropped_by_shepherd": r.dropped_by_shepherd, "rejected": r.rejected,
            "error": r.error}


def run_scenario(cl, with_ts: bool, load=None, worker_cpu: bool = False, before_close=None) -> tuple[dict, dict]:
    """Everything the S sessions receive (``seen``), and when results arrived (``times``).

    ``load(cl)``: other work started once the S sessions are in, running all along the scenario and
    finished (``.finish(config)``) at its end (tests/test_trusted_e2e.py: a TS session's queries and input
    on the same trusted master); ``worker_cpu``: the workers' CPU readings in the operators' status are
    compared too (a trusted master shows every level 0; elsewhere they are volatile); ``before_close()``:
    called just before the operator's finish (tests/test_trusted_e2e.py: waits for a fixed phase of the
    levels' turns).  ``times``: each query's last arrival after the finish (``arrival``, seconds) and the
    wall-clock time of every result message (``walls``)."""
    renew_master(cl["state"], "S")  # an empty level on the same address
    p1, p2, ana, op = (login(cl, u) for u in ("p1", "p2", "ana", "op"))
    wait_for(lambda: len(op.status().workers) == 1, 30, "the worker to join the restarted master")
    background = load(cl) if load is not None else None
    seen: dict = {}
    regs = ana.register(QUERIES)
    seen["register"] = [(r.query_id, r.rewritten, r.r2s, list(r.columns)) for r in regs]
    seen["errors"] = {
        "query_above_level": attempt(lambda: ana.register(["SELECT bp FROM Vitals [ROWS 2 level in {TS}]"])),
        "query_unknown_stream": attempt(lambda: ana.register(["SELECT x FROM Nope"])),
        "analyst_advance": attempt(lambda: ana.advance(upto_ts=3)),
        "analyst_finish": attempt(lambda: ana.advance(finish=True)),
        "analyst_ingest": attempt(lambda: ana.ingest([("Vitals", table([(1, "S")]))], labelled=True)),
        "producer_register": attempt(lambda: p2.register(["SELECT bp FROM Vitals [NOW]"])),
        "cancel_unknown": attempt(lambda: ana.cancel(["q99"])),
    }
    got = {r.query_id: [] for r in regs}
    arrived: dict[str, float] = {}
    walls: list[float] = []

    def collect():
        for qid, t in ana.subscribe([r.query_id for r in regs]):
            if t is not None:
                walls.append(time.time())
                got[qid].extend(rows_of(t))
                arrived[qid] = time.monotonic()

    th = threading.Thread(target=collect, daemon=True)
    th.start()
    keep = (lambda rows: rows) if with_ts else (lambda rows: [r for r in rows if r[1] != "TS"])
    p1_replies, dropped = [], []
    for stream, rows in P1:
        r = reply(p1.ingest([(stream, table(keep(rows)))], labelled=True))
        dropped.append(r.pop("dropped_by_shepherd"))
        p1_replies.append(r)
    p2_seen = {"advance_9": attempt(lambda: p2.advance(upto_ts=9))}
    r = reply(p1.ingest([(LATE_TS[0], table(keep(LATE_TS[1])))], labelled=True))
    dropped.append(r.pop("dropped_by_shepherd"))
    p1_replies.append(r)
    p2_seen["ingest"] = reply(p2.ingest([("Vitals", table([(10, "S"), (11, "S"), (12, "S")], labelled=False))]))
    p2_seen["ingest_late"] = reply(p2.ingest([("Vitals", table([(9, "S")], labelled=False))]))
    p2_seen["advance_far"] = attempt(lambda: p2.advance(upto_ts=500000))
    p2_seen["advance_max"] = attempt(lambda: p2.advance(upto_ts=MAXLONG))
    p2_seen["advance_12"] = attempt(lambda: p2.advance(upto_ts=12))
    if before_close is not None:
        before_close()
    closed = time.monotonic()
    seen["op_finish"] = attempt(lambda: op.advance(finish=True))
    th.join(180)
    assert not th.is_alive(), "the result streams did not end"
    seen["p1"], seen["p2"] = p1_replies, p2_seen
    seen["ended"] = dict(ana.ended)
    seen["results"] = {q: sorted(rows, key=repr) for q, rows in got.items()}
    for user in ("ana", "op", "p2"):
        r = strata("status", "--json", "--config", str(cl["config"]), "--master", cl["master"], "--user", user,
                   "--tls-dir", cl["tls"], "--level", "S")
        assert r.returncode == 0, r.stderr
        raw = json.loads(r.stdout)
        if worker_cpu and "workers" in raw:
            seen[f"cpu_{user}"] = [w["cpu"] for w in raw["workers"]]
        seen[f"status_{user}"] = stable(raw)
    if background is not None:
        background.finish(load_config(cl["config"]))
    for c in (p1, p2, ana, op):
        c.close()
    times = {"dropped": dropped, "arrival": {q: arrived.get(q, closed) - closed for q in got}, "walls": walls}
    return seen, times


@pytest.fixture(scope="module")
def runs(warm_s):
    cl = warm_s.renew(USERS)
    out = {"warm": run_scenario(cl, False), "with_ts": run_scenario(cl, True), "without": run_scenario(cl, False)}
    out["config"] = load_config(cl["config"])
    return out


def test_s_sessions_receive_the_same_with_and_without_ts_input(runs):
    with_ts, without = runs["with_ts"][0], runs["without"][0]
    for key in without:  # one key at a time, for a readable failure
        assert with_ts[key] == without[key], key
    assert runs["warm"][0] == without  # and the same again on a warm worker


def test_the_rules_behind_the_equality(runs):
    """What the equal answers are (so that they are equal for the right reason)."""
    seen = runs["with_ts"][0]
    op = seen["status_op"]
    assert not any("shepherd" in k for k in op["rejected"]) and "dropped_by_shepherd" not in op["counters"]
    assert op["lag"] == 0.0 and op["backlog"] == 0 and op["counters"]["accepted"] == 7  # 1, 4, 5, 6, 10, 11, 12
    assert op["rejected"]["unknown_stream"] == 1 and op["rejected"]["advance_beyond_horizon"] == 2
    assert op["rejected"]["role:Advance"] == 1 and op["rejected"]["role:Advance(finish)"] == 1
    assert seen["p1"][4]["error"].startswith("unknown stream 'Nope'")
    assert seen["p1"][5] == {"accepted": 0, "rejected": 0, "error": ""}  # a late TS row is no concern of S
    assert seen["p2"]["ingest_late"]["error"] == "stream Vitals: ts 9 is before the stream's last ts 12"  # not 500000
    assert "i.e. up to 3612" in seen["p2"]["advance_far"]  # 12 + 3600: the TS row at 500000 moved nothing
    assert seen["errors"]["analyst_advance"].startswith("PermissionDenied: permission denied: Advance needs")
    assert set(seen["status_ana"]) == {"level", "user", "roles", "queries"}
    assert [q["state"] for q in seen["status_ana"]["queries"]] == ["ended"] * len(QUERIES)
    assert seen["status_p2"]["queries"] == [] and "workers" not in seen["status_p2"]
    # told to p1, in its own replies only; the unknown stream is refused before the shepherd looks at it
    assert runs["with_ts"][1]["dropped"] == [3, 1, 1, 2, 0, 1]
    assert runs["without"][1]["dropped"] == [0] * 6


def assert_results_equal_the_reference(seen: dict, config) -> None:
    """The scenario's S results (``seen``: one run's) equal the reference over the tuples S keeps."""
    kept = [{"ts": t, "level": lv, "sid": f"s{t % 3}", "bp": float(100 + t % 50), "pr": 1.0, "weight": 1.0}
            for t, lv in [(1, "S"), (4, "U"), (5, "C"), (6, "S"), (10, "S"), (11, "S"), (12, "S")]]
    for (qid, *_), q in zip(seen["register"], QUERIES):
        compare_results(seen["results"][qid], evaluate(q, config, "S", {"Vitals": kept}))


def assert_arrivals_within_a_generous_tolerance(runs: dict) -> None:
    """Each query's last result arrived (after the input closed) at about the same time with and without TS."""
    a, b = runs["with_ts"][1]["arrival"], runs["without"][1]["arrival"]
    for q in b:
        assert abs(a[q] - b[q]) <= 5.0 + 1.0 * max(a[q], b[q]), (q, a[q], b[q])


def assert_arrivals_in_slots(runs: dict, period: float, start: float, end: float, late: float) -> None:
    """Under fixed slots on the epoch's grid (a trusted master, strata/turns.py): every S result message of
    every run arrived in S's slot ``[start, end)`` of each ``period`` of the wall clock, give or take ``late``
    (the reply's way from the master's turn to the client's thread)."""
    for name in ("first", "with_ts", "without"):
        phases = [w % period for w in runs[name][1]["walls"]]
        assert phases, name
        outside = [round(x, 3) for x in phases if not start <= x < end + late]
        assert not outside, (name, outside, sorted(round(x, 3) for x in phases))


def assert_arrivals_within_rounds(runs: dict, period: float, rounds: int) -> None:
    """Each query's last result arrived (after the finish, made at the same phase of the round in each run)
    within ``rounds`` rounds of its arrival without TS.  Under fixed slots S's last chunk is computed and
    merged in S's slots only, so arrivals step by whole rounds: the same slot when S's work fits in it in
    both runs, a round apart when S's call ends just past its slot's edge in one run only (its duration
    varies with the machine's other load, and a TS call that overran its deadline shares the worker with
    it: calls are not pre-empted, strata/turns.py).  Measured with tests/test_trusted_e2e.py's 0.5 s slots
    on the 2-core VM with two CPU-bound processes beside it: 0.51-0.64 s apart in 4 runs of 4, S's call
    ending just past its slot in the run with TS and just inside in the run after it, mostly because S's
    chunks get faster run after run on the same worker (0.72, 0.58, 0.55 with TS, 0.40 s: docs/trusted.md
    "Choosing the slot").  Under the default 0.25 s slots: 0.07-0.54 s apart (before the worker's pools
    and the turns' rules kept TS's calls from S's, up to 0.63 s locally and 1.07 s on CI)."""
    a, b = runs["with_ts"][1]["arrival"], runs["without"][1]["arrival"]
    print("last arrivals after the finish, with TS:", {q: round(x, 3) for q, x in a.items()},
          "without:", {q: round(x, 3) for q, x in b.items()})
    for q in b:
        assert abs(a[q] - b[q]) <= rounds * period + 0.1, (q, a[q], b[q])


def test_results_equal_the_reference(runs):
    assert_results_equal_the_reference(runs["without"][0], runs["config"])


def test_results_arrive_at_the_same_time_within_a_generous_tolerance(runs):
    assert_arrivals_within_a_generous_tolerance(runs)
