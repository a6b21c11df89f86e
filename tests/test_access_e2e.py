"""Privacy switches and security punctuations through the CLI against a running cluster (the session's
warm S cluster, conftest.py ``warm_s``): ``strata access revoke`` then ``grant`` on one of three
queries, two of which are the same query (their operators shared on the worker); the revoked query's
output stops at the revocation instant and resumes at the re-grant instant, the others' output is
unchanged, everything equals the reference (tests/reference/access.py); a non-operator is refused in
one line; punctuations sent as a CSV file with ``strata ingest`` govern a fourth query; the switch and
its counters are in the operator's ``strata status``."""

from __future__ import annotations

import json

import pytest

from strata.api import connect
from strata.config import load_config

from .helpers import PASSWORD, login, strata, write_csv
from .polling import wait_for
from .reference.access import evaluate_access
from .reference.evaluator import compare_results
from .tables import collect_in_background

pytestmark = pytest.mark.slow

USERS = {"jane": ("S", "producer,analyst"), "op": ("S", "operator"), "ana": ("S", "analyst")}
QUERIES = ["SELECT sid, bp FROM Vitals [ROWS 3]",            # q1: revoked, then granted again
           "SELECT sid, bp FROM Vitals [ROWS 3]",            # q2: the same query (shared), never switched
           "SELECT sid, COUNT(*) FROM Vitals [RANGE 2] GROUP BY sid",  # q3: another query on the stream
           "SELECT sid, lat FROM Positions [NOW]"]           # q4: under a security punctuation


def vitals(ts: range) -> list[dict]:
    return [{"ts": t, "level": "S", "sid": f"s{t % 2}", "bp": 100.0 + t, "pr": 1.0, "weight": 1.0} for t in ts]


def positions(ts: range) -> list[dict]:
    return [{"ts": t, "level": "S", "sid": s, "lat": float(t), "lon": "x"} for t in ts for s in ("a", "b")]


def test_revoke_and_grant_through_the_cli(warm_s, tmp_path):
    cl = warm_s.renew(USERS)
    common = ["--config", str(cl["config"]), "--master", cl["master"], "--tls-dir", str(cl["tls"])]
    jane = login(cl, "jane")
    ids = [r.query_id for r in jane.register(QUERIES)]
    got, ended = collect_in_background(jane, ids)

    def ingest(name: str, stream: str, rows: list[dict], *extra):
        path = tmp_path / f"{name}.csv"
        cols = list(rows[0])
        write_csv(path, cols, [tuple(r[c] for c in cols) for r in rows])
        r = strata("ingest", *common, "--user", "jane", "--input", f"{stream}={path}", "--labelled", *extra)
        assert r.returncode == 0, r.stderr

    def access(action: str, who: str = "op") -> tuple[int, str]:
        r = strata("access", action, *common, "--operator", who, "--user", "jane", "--query", ids[0],
                   "--stream", "Vitals")
        return r.returncode, r.stderr.strip()

    punct = [{"ts": 0, "level": "S", "stream": "Positions", "tuples": "sid=a", "attributes": "*", "roles": "analyst",
              "users": "", "sign": "+", "immutable": ""}]
    ingest("punct", "_punctuations", punct)
    ingest("v1", "Vitals", vitals(range(0, 5)))
    ingest("p1", "Positions", positions(range(0, 5)))
    assert strata("advance", *common, "--user", "jane", "--upto", "4").returncode == 0

    rc, err = access("revoke", who="ana")  # an analyst is no operator: one line, exit 5
    assert rc == 5 and "\n" not in err and "Access needs the operator role" in err, err
    rc, err = access("revoke")
    assert rc == 0 and "revoked from instant 5" in err, err
    ingest("v2", "Vitals", vitals(range(5, 10)))
    assert strata("advance", *common, "--user", "jane", "--upto", "9").returncode == 0
    rc, err = access("grant")
    assert rc == 0 and "granted from instant 10" in err and "tuples blocked 5" in err, err
    # the Python API: the same switch, already on (nothing changes); an ended query has no switch
    with connect(cl["master"], "op", "S", tls_dir=str(cl["tls"]), password=PASSWORD) as s:
        assert s.access("jane", ids[0], "Vitals", grant=True) == {
            "instant": 10, "changed": False, "state": "on", "access_counter": 1, "blocked": 5, "passed": 0}
    ingest("v3", "Vitals", vitals(range(10, 15)), "--finish")
    wait_for(ended.is_set, 120, "every query ended")

    cfg = load_config(cl["config"])
    streams = {"Vitals": vitals(range(0, 15)), "Positions": positions(range(0, 5))}
    switch = [("Vitals", 5, 10)]
    principal = ("jane", {"producer", "analyst"})
    expected = [evaluate_access(QUERIES[0], cfg, "S", streams, punct, principal, switch),
                *(evaluate_access(q, cfg, "S", streams, punct, principal) for q in QUERIES[1:])]
    for qid, want in zip(ids, expected):
        compare_results(got[qid], want.rows)
    # the revoked query: nothing at instants 5-9, then again from 10 on (its window without instants 5-9)
    assert sorted({r[0] for r in got[ids[0]]}) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert [r[3] for r in got[ids[0]] if r[0] == 10] == [110.0]  # ISTREAM: new against its window at 4
    assert sorted({r[0] for r in got[ids[1]]}) == list(range(15))  # the shared twin: unchanged
    assert {r[2] for r in got[ids[3]]} == {"a"}  # the punctuation: Positions tuples of sid a only

    r = strata("status", *common, "--user", "op", "--json")
    assert r.returncode == 0, r.stderr
    sw = json.loads(r.stdout)["switches"]
    assert [(s["query_id"], s["user"], s["stream"], s["state"], s["access_counter"], s["blocked"]) for s in sw] == [
        (ids[0], "jane", "Vitals", "on", 1, 5)]
    assert json.loads(r.stdout)["counters"]["punctuations"] == 1
    jane.close()
