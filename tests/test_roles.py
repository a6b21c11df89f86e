"""Roles within a level, limits, revocation everywhere, cancel and failing queries: each through the
real CLI (``python -m strata``) against one running S cluster (a master and one Spark worker), started
once for the module.  The master's input timeline is shared, so every test takes fresh instants.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial

import pyarrow as pa
import pytest

from strata.client import PermissionDenied, SessionEnded
from strata.deploy.local import restart_process, start_cluster, stop_cluster
from strata.config import load_config

from . import tables
from .conftest import BATTLEFIELD_TOML
from .polling import poll, wait_for
from .reference.evaluator import compare_results, evaluate
from .tables import rows_of
from .helpers import PASSWORD, gone, login, strata, write_config, write_csv

pytestmark = pytest.mark.slow

CONFIG = BATTLEFIELD_TOML + '\n[streams.Counts]\nsid = "string"\nn = "long"\n'
USERS = {"ana": ("S", "analyst"), "carl": ("S", "analyst"), "pete": ("S", "producer"), "olga": ("S", "operator"),
         "vic": ("TS", "producer"), "bea": ("S", "analyst"), "dan": ("S", "analyst"), "rob": ("S", "producer")}
VITALS = ["ts", "level", "sid", "bp", "pr", "weight"]
MAXLONG = 2**63 - 1


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    d = tmp_path_factory.mktemp("roles")
    cfg = write_config(d, CONFIG, USERS)
    state = d / "state"
    started = start_cluster(str(cfg), ["S"], 1, state)
    yield {"config": cfg, "state": state, "dir": d, "master": started["masters"]["S"], "tls": started["tls_dir"],
           "clock": itertools.count(1, 10)}
    stop_cluster(state)


def fresh(cl, n: int) -> list[int]:
    """``n`` instants nobody has used (the master's timeline is shared by the module's tests)."""
    start = next(cl["clock"])
    assert n <= 10
    return list(range(start, start + n))


def cli(cl, user: str, *args: str, env_extra=None):
    cmd, rest = args[0], list(args[1:])
    if cmd == "query" and rest and rest[0] in ("list", "cancel"):
        cmd, rest = f"{cmd} {rest[0]}", rest[1:]
    return strata(*cmd.split(), "--config", str(cl["config"]), "--master", cl["master"], "--user", user,
                  "--tls-dir", cl["tls"], "--level", "S", *rest, env_extra=env_extra)


def users_cli(cl, *args: str):
    return strata("users", args[0], "--config", str(cl["config"]), *args[1:])


def one_error_line(r, fragment: str) -> str:
    """The command failed with exactly one error line (``strata: ...``) holding ``fragment``."""
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("strata:")]
    assert len(errors) == 1 and fragment in errors[0], r.stderr
    return errors[0]


#: this module's Vitals tuples: level S, sid "a", bp 100 + the instant
vitals = partial(tables.vitals, bp=lambda i, t: 100.0 + t)


def operator_status(cl) -> dict:
    r = cli(cl, "olga", "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- roles ---------------------------------------------------------------------------------------------
def test_analyst_cannot_advance_finish_or_ingest_producer_cannot_query(cl, tmp_path):
    before = operator_status(cl)
    r = cli(cl, "ana", "advance", "--upto", "3")
    assert r.returncode == 5
    one_error_line(r, "permission denied: Advance needs the producer role; ana.S has analyst")
    r = cli(cl, "ana", "advance", "--finish")
    assert r.returncode == 5
    one_error_line(r, "permission denied: Advance(finish) needs the producer or operator role")
    f = tmp_path / "v.csv"
    write_csv(f, VITALS, [(t, "S", "a", 1.0, 1.0, 1.0) for t in fresh(cl, 2)])
    r = cli(cl, "ana", "ingest", "--input", f"Vitals={f}")
    assert r.returncode == 5
    one_error_line(r, "Ingest needs the producer role")
    r = cli(cl, "pete", "query", "--query", "SELECT bp FROM Vitals [NOW]")
    assert r.returncode == 5
    one_error_line(r, "Register needs the analyst role; pete.S has producer")
    after = operator_status(cl)  # refused calls are counted, and operators see the counts
    for call in ("Advance", "Advance(finish)", "Ingest", "Register"):
        assert after["rejected"][f"role:{call}"] == before["rejected"].get(f"role:{call}", 0) + 1, call
    assert after["counters"]["permission_denied"] == before["counters"].get("permission_denied", 0) + 4
    assert after["counters"].get("accepted", 0) == before["counters"].get("accepted", 0)  # nothing applied
    r = cli(cl, "pete", "ingest", "--input", f"Vitals={f}")  # the input is not finished
    assert r.returncode == 0 and "accepted 2" in r.stderr, r.stderr


def test_status_shows_own_queries_to_everyone_and_the_cluster_to_operators(cl):
    with login(cl, "ana") as ana, login(cl, "carl") as carl:
        mine = ana.register(["SELECT COUNT(*) FROM Vitals [ROWS 3]"])[0]
        theirs = carl.register(["SELECT bp FROM Vitals [NOW]"])[0]
        r = cli(cl, "ana", "status", "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert set(st) == {"level", "user", "roles", "queries"}
        assert (st["level"], st["user"], st["roles"]) == ("S", "ana", ["analyst"])
        assert mine.query_id in [q["query"] for q in st["queries"]]
        assert theirs.query_id not in [q["query"] for q in st["queries"]]
        q = next(q for q in st["queries"] if q["query"] == mine.query_id)
        assert (q["state"], q["text"], q["error"]) == ("running", mine.rewritten, "")
        r = cli(cl, "ana", "status")
        assert r.returncode == 0 and mine.query_id in r.stdout and "cluster" not in r.stdout, r.stdout
        r = cli(cl, "pete", "status", "--json")  # a producer: its (no) queries, no cluster
        assert set(json.loads(r.stdout)) == {"level", "user", "roles", "queries"}
        op = operator_status(cl)
        assert len(op["workers"]) == 1 and op["queries"] == [] and op["counters"]["queries"] >= 2
        assert {"backlog", "lag", "rejected", "counters", "timings", "last_chunk_error"} <= set(op)
        r = cli(cl, "olga", "status")
        assert r.returncode == 0 and "cluster: 1 workers" in r.stdout, r.stdout
        carl.cancel([theirs.query_id])


def test_role_changes_apply_to_an_open_session_within_a_second(cl):
    with login(cl, "rob") as rob:
        t = fresh(cl, 1)
        assert rob.ingest([("Vitals", vitals(t))]).accepted == 1
        r = users_cli(cl, "set-roles", "--name", "rob", "--roles", "analyst")
        assert r.returncode == 0, r.stderr
        t0 = time.monotonic()

        def refused():
            try:
                rob.advance(upto_ts=t[0])
            except PermissionDenied as e:
                return str(e)
            return None

        msg = poll(refused, timeout=10, interval=0.05)
        assert msg and "Advance needs the producer role; rob.S has analyst" in msg
        assert time.monotonic() - t0 < 1.0 + 1.5  # the watcher reads the file every 0.5 s; slack for CI
        assert rob.register(["SELECT bp FROM Vitals [NOW]"])  # now an analyst, same session
        assert users_cli(cl, "set-roles", "--name", "rob", "--roles", "producer").returncode == 0


# ---- revocation everywhere -----------------------------------------------------------------------------
def test_revoked_producers_open_ingest_stream_is_cut_at_its_next_batch(cl):
    vic, other = login(cl, "vic"), login(cl, "vic")
    batches: queue.Queue = queue.Queue()
    outcome = {}

    def gen():
        while (item := batches.get()) is not None:
            yield item

    def send():
        try:
            outcome["reply"] = vic.ingest(gen(), labelled=True)
        except Exception as e:  # noqa: BLE001 - examined below
            outcome["error"] = e

    accepted = lambda: operator_status(cl)["counters"].get("accepted", 0)  # noqa: E731
    base = accepted()
    th = threading.Thread(target=send, daemon=True)
    th.start()
    first, second = fresh(cl, 3), fresh(cl, 2)
    batches.put(("Vitals", vitals(first)))
    wait_for(lambda: accepted() == base + 3, 30, "the first batch to be applied")
    r = users_cli(cl, "set-clearance", "--name", "vic", "--clearance", "C")  # no longer dominates S
    assert r.returncode == 0, r.stderr

    def revoked():
        try:
            other.status()
        except SessionEnded:
            return True
        return False

    wait_for(revoked, 10, "vic's sessions to end")
    batches.put(("Vitals", vitals(second)))
    batches.put(None)
    th.join(30)
    assert isinstance(outcome.get("error"), SessionEnded), outcome
    assert "UNAUTHENTICATED: session ended" in str(outcome["error"])
    assert accepted() == base + 3  # nothing of the second batch was applied
    vic.close()
    other.close()


def test_bad_users_file_entry_leaves_revocation_working(cl):
    bea, dan = login(cl, "bea"), login(cl, "dan")
    qid = bea.register(["SELECT bp FROM Vitals [NOW]"])[0].query_id
    ended, errors = threading.Event(), []

    def follow():
        try:
            for _ in bea.subscribe([qid]):
                pass
        except Exception as e:  # noqa: BLE001 - examined below
            errors.append(e)
        ended.set()

    threading.Thread(target=follow, daemon=True).start()
    users = load_config(cl["config"]).users_path
    doc = json.loads(users.read_text())
    doc["users"]["bea"]["clearance"] = "Secret"  # hand-edited: a level the lattice does not know
    users.write_text(json.dumps(doc))
    assert ended.wait(10), "bea's stream did not end"
    assert errors and "session ended" in str(errors[0]), errors
    r = users_cli(cl, "remove", "--name", "dan")  # the next switch still works: the watcher is alive
    assert r.returncode == 0, r.stderr

    def cut():
        try:
            dan.status()
        except SessionEnded:
            return True
        return False

    wait_for(cut, 10, "dan's session to end after his removal")
    assert operator_status(cl)["level"] == "S"  # everyone else is served as before
    r = cli(cl, "bea", "status")
    assert r.returncode == 3 and "login failed" in one_error_line(r, "login failed")
    bea.close()
    dan.close()


# ---- limits ----------------------------------------------------------------------------------------------
def test_advance_beyond_the_horizon_and_ts_beyond_max_ts_are_refused(cl, tmp_path):
    r = cli(cl, "pete", "advance", "--upto", str(MAXLONG))
    assert r.returncode == 2
    one_error_line(r, f"advance to {MAXLONG} refused: at most 3600 instants ([limits] advance_horizon) past "
                      f"the latest instant ingested")
    t = fresh(cl, 1)
    f = tmp_path / "big.csv"
    write_csv(f, VITALS, [(t[0], "S", "a", 1.0, 1.0, 1.0), (MAXLONG, "S", "a", 1.0, 1.0, 1.0)])
    before = operator_status(cl)
    r = cli(cl, "pete", "ingest", "--labelled", "--input", f"Vitals={f}")
    assert r.returncode == 2
    one_error_line(r, f"stream Vitals: ts {MAXLONG} is beyond the largest instant accepted (9007199254740991")
    after = operator_status(cl)
    assert after["rejected"]["ts_out_of_range"] == before["rejected"].get("ts_out_of_range", 0) + 1
    assert after["counters"].get("accepted", 0) == before["counters"].get("accepted", 0)  # refused whole
    write_csv(f, VITALS, [(t[0], "S", "a", 1.0, 1.0, 1.0), (MAXLONG, "TS", "a", 1.0, 1.0, 1.0)])
    r = cli(cl, "pete", "ingest", "--labelled", "--input", f"Vitals={f}")  # a TS row is none of S's business
    assert r.returncode == 0 and "sent 1/2 tuples in 1 batches: accepted 1, dropped above level S 1" in r.stderr, r.stderr
    r = cli(cl, "pete", "advance", "--upto", str(t[0]))
    assert r.returncode == 0, r.stderr


# ---- a failing query is that query's problem --------------------------------------------------------------
def test_overflowing_query_fails_alone(cl):
    """SUM of longs near 2**62 over ROWS 5 overflows at its second instant: its owner's `strata query` prints
    one line and exits 4; an ordinary query over the same chunks equals the reference on every instant."""
    cfg = load_config(cl["config"])
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD}
    failing = subprocess.Popen(
        [sys.executable, "-m", "strata", "query", "--config", str(cl["config"]), "--master", cl["master"],
         "--user", "carl", "--tls-dir", cl["tls"], "--level", "S", "--query", "SELECT SUM(n) FROM Counts [ROWS 5]"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        with login(cl, "carl") as carl:
            wait_for(lambda: [q for q in carl.status().queries if "Counts" in q.text and q.state == "running"], 60,
                     "carl's query to be registered")
        ts = fresh(cl, 6)
        rows = [{"ts": t, "level": "S", "sid": f"s{i % 2}", "n": 2**62 + i} for i, t in enumerate(ts)]
        ordinary = ["SELECT sid, n FROM Counts [ROWS 3]", "SELECT COUNT(*) FROM Counts [ROWS 5]"]
        with login(cl, "ana") as ana, login(cl, "pete") as pete:
            regs = ana.register(ordinary)
            got = {r.query_id: [] for r in regs}

            def collect():
                for qid, table in ana.subscribe([r.query_id for r in regs]):
                    if table is not None:
                        got[qid].extend(rows_of(table))

            th = threading.Thread(target=collect, daemon=True)
            th.start()
            pete.ingest([("Counts", pa.Table.from_pylist(rows))], labelled=True)
            pete.advance(upto_ts=ts[-1])
            out, err = failing.communicate(timeout=180)
            assert failing.returncode == 4, err
            assert "Traceback" not in err
            failed = [ln for ln in err.splitlines() if ln.startswith("strata:")]
            assert len(failed) == 1 and re.fullmatch(r"strata: query q\d+ failed: .+", failed[0]), err
            assert [ln.split(",")[1] for ln in out.splitlines()[1:]] == [str(ts[0])]  # the instant before it
            with login(cl, "carl") as carl:
                [q] = [q for q in carl.status().queries if "Counts" in q.text]
                assert q.state == "failed" and q.error and q.stopped_after == ts[0]
            wait_for(lambda: all(g and max(r[0] for r in g) == ts[-1] for g in got.values()), 120,
                     "the ordinary queries' results")
            ana.cancel([r.query_id for r in regs])
            th.join(30)
        for r, q in zip(regs, ordinary):
            compare_results(got[r.query_id], evaluate(q, cfg, "S", {"Counts": rows}))
    finally:
        if failing.poll() is None:
            failing.kill()
            failing.communicate()


# ---- cancel, through the CLI, across a master restart (last: it restarts the master) ------------------------
def test_cancel_through_the_cli_survives_a_master_restart(cl):
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD}
    follower = subprocess.Popen(
        [sys.executable, "-m", "strata", "query", "--config", str(cl["config"]), "--master", cl["master"],
         "--user", "ana", "--tls-dir", cl["tls"], "--level", "S", "--query", "SELECT COUNT(*) FROM Vitals [ROWS 2]"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = {"out": [], "err": []}
    for name, pipe in (("out", follower.stdout), ("err", follower.stderr)):
        threading.Thread(target=lambda n=name, p=pipe: [lines[n].append(x.rstrip("\n")) for x in p],
                         daemon=True).start()
    try:
        reg = poll(lambda: next((m.group(1) for ln in lines["err"] if (m := re.match(r"\[strata\] (q\d+): ", ln))),
                                None), timeout=60)
        assert reg, lines
        with login(cl, "ana") as ana, login(cl, "pete") as pete:
            keep = ana.register(["SELECT COUNT(*) FROM Vitals [ROWS 3]"])[0].query_id
            before, after = fresh(cl, 3), fresh(cl, 3)
            pete.ingest([("Vitals", vitals(before))])
            pete.advance(upto_ts=before[-1])
            wait_for(lambda: any(ln.startswith(f"{reg},{before[-1]},") for ln in lines["out"]), 120,
                     "results before the cancel")
            r = cli(cl, "carl", "query", "cancel", reg)  # not carl's
            assert r.returncode == 5
            one_error_line(r, f"query {reg} is not one of this user's queries")
            r = cli(cl, "ana", "query", "cancel", reg)
            assert r.returncode == 0, r.stderr
            assert f"{reg},cancelled,{before[-1]}," in r.stdout, r.stdout
            assert follower.wait(30) == 0  # its stream ended: the cancelled query stops
            wait_for(lambda: f"[strata] {reg} cancelled" in lines["err"], 5, "the follower's note")
            pete.ingest([("Vitals", vitals(after))])
            pete.advance(upto_ts=after[-1])
            wait_for(lambda: {q.query_id: q.last_ts for q in ana.status().queries}.get(keep) == after[-1], 120,
                     "the other query to go on")
            views = {q.query_id: q for q in ana.status().queries}
            assert (views[reg].state, views[reg].last_ts, views[reg].stopped_after) == \
                ("cancelled", before[-1], before[-1])
        master = next(p for p in json.loads((cl["state"] / "cluster.json").read_text())["processes"]
                      if p["role"] == "master")
        os.kill(master["pid"], signal.SIGKILL)
        wait_for(lambda: gone(master["pid"]), 10, "the master to die")
        restart_process(cl["state"], master["name"])
        r = cli(cl, "ana", "query", "list", "--format", "json")
        assert r.returncode == 0, r.stderr
        views = {v["query"]: v for v in map(json.loads, r.stdout.splitlines())}
        assert (views[reg]["state"], views[reg]["stopped_after"]) == ("cancelled", before[-1])
        assert views[keep]["state"] == "running"
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
