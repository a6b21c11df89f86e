"""Privacy switches (paper 004, docs/semantics.md §12) without a network: Algorithm 2's placement on
the paper's Fig. 2 network (Fig. 6) and on Strata's shared plans, and the master's switch logic
(who may switch what, the instant it takes effect, counters, the event log across a restart)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from strata.cli import main
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.admission import Refused
from strata.master.core import MasterCore
from strata.master.store import MasterStore, config_fingerprint
from strata.mlscql import compile_query
from strata.sharing import SharedPlan
from strata.sharing.switches import place_switches, plan_switches

# ---- Fig. 2 -> Fig. 6 -------------------------------------------------------------------------------------------
#: The shared-operator network of Fig. 2 for CQ1 (Stream1 ⋈ Stream2) and CQ2 (Stream1 ⋈ Stream2 ⋈ Stream3),
#: as the text of §2 and §5.3 describes it (the figure itself is a picture; windows left out as there): the
#: common-prefix zone is the selection on Stream1's timestamps and the location join of Stream1 and Stream2,
#: whose output feeds one operator of each query; above it each query has its own operators.  Ten operators.
FIG2 = {  # operator -> its inputs (streams are leaves)
    "sigma_ts": ["Stream1"],                       # s1.timestamp < 7:00pm            (common prefix)
    "join_12": ["sigma_ts", "Stream2"],            # s1.location = s2.location        (common prefix)
    "sigma_q1": ["join_12"],                       # CQ1: s1.timestamp > 6:00am AND s2.speed < 30
    "pi_q1": ["sigma_q1"],                         # CQ1: s1.streamid, s1.heartRate
    "sigma_q2": ["join_12"],                       # CQ2: s1.timestamp > 8:00am
    "sigma_speed": ["sigma_q2"],                   # CQ2: s2.speed < 0
    "sigma_screen": ["Stream3"],                   # CQ2: s3.screentime > 5h
    "join_23": ["sigma_speed", "sigma_screen"],    # CQ2: s2.location = s3.location
    "sigma_q2b": ["join_23"],                      # CQ2: s1.timestamp < 7:00pm of the result
    "pi_q2": ["sigma_q2b"],                        # CQ2: s1.streamid, s1.heartRate
}
OUTPUTS = {"CQ1": "pi_q1", "CQ2": "pi_q2"}


def _users() -> dict[str, set[str]]:
    users: dict[str, set[str]] = {}
    for q, root in OUTPUTS.items():
        stack = [root]
        while stack:
            v = stack.pop()
            users.setdefault(v, set()).add(q)
            stack.extend(FIG2.get(v, []))
    return users


def test_fig6_placement_of_the_papers_network():
    users = _users()
    placed = place_switches(OUTPUTS, lambda v: FIG2.get(v, []), lambda v: len(users[v]) > 1)
    got = {(p.kind, p.query, p.at, p.to) for p in placed}
    assert got == {
        ("terminal", "CQ1", "pi_q1", None), ("terminal", "CQ2", "pi_q2", None),   # at every query output
        ("in-network", "CQ1", "join_12", "sigma_q1"),                             # on the edges leaving the last
        ("in-network", "CQ2", "join_12", "sigma_q2"),                             # common-prefix operator
        ("initial", "CQ2", "Stream3", None),                                      # an input only CQ2 reads
    }
    assert len(placed) == len(got)  # each once
    # a total loss of CQ2 (its in-network and initial switches off) stops the operators behind them
    behind, stack = set(), ["pi_q2"]
    while stack:
        v = stack.pop()
        if v in FIG2 and users[v] == {"CQ2"}:
            behind.add(v)
            stack.extend(FIG2[v])
    assert behind == {"sigma_q2", "sigma_speed", "sigma_screen", "join_23", "sigma_q2b", "pi_q2"}
    assert len(behind) == 6 and len(FIG2) == 10  # "six out of the ten operators" (§5.3)


def test_unshared_queries_get_initial_switches_on_every_stream():
    net = {"a": ["S1"], "b": ["S2"]}
    placed = place_switches({"Q1": "a", "Q2": "b"}, lambda v: net.get(v, []), lambda v: False)
    assert {(p.kind, p.query, p.at) for p in placed} == {
        ("terminal", "Q1", "a"), ("initial", "Q1", "S1"), ("terminal", "Q2", "b"), ("initial", "Q2", "S2")}


def test_complete_sharing_puts_the_in_network_switch_at_the_shared_root():
    placed = place_switches({"Q1": "r", "Q2": "r"}, lambda v: {"r": ["S"]}.get(v, []), lambda v: v == "r")
    assert {(p.kind, p.query, p.at, p.to) for p in placed} == {
        ("terminal", "Q1", "r", None), ("in-network", "Q1", "r", None),
        ("terminal", "Q2", "r", None), ("in-network", "Q2", "r", None)}


@pytest.fixture(scope="module")
def battlefield():
    return parse_config(BATTLEFIELD_TOML)


def test_placement_on_a_strata_shared_plan(battlefield):
    plan = SharedPlan("replicated", 1.0, battlefield.lattice)
    plan.add("q1", compile_query("SELECT sid, bp FROM Vitals [RANGE 5] WHERE bp > 100", battlefield, "S"))
    plan.add("q2", compile_query("SELECT sid FROM Vitals [RANGE 5] WHERE bp > 100 AND pr > 3", battlefield, "S"))
    plan.add("q3", compile_query("SELECT lat FROM Positions [NOW]", battlefield, "S"))
    rows = plan_switches(plan)
    kinds = {(r["query"], r["kind"]) for r in rows}
    assert kinds == {("q1", "terminal"), ("q1", "in-network"), ("q2", "terminal"), ("q2", "in-network"),
                     ("q3", "terminal"), ("q3", "initial")}
    assert {r["at"] for r in rows if r["kind"] == "initial"} == {"stream Positions"}
    assert all(r["at"].startswith("select($0.bp > 100) -> ") for r in rows if r["kind"] == "in-network")


# ---- the master's switch logic -----------------------------------------------------------------------------------
def vitals(ts: list[int], level="S") -> pa.Table:
    n = len(ts)
    return pa.table({"ts": pa.array(ts, pa.int64()), "level": [level] * n, "sid": ["a"] * n,
                     "bp": [100.0 + t for t in ts], "pr": [1.0] * n, "weight": [1.0] * n})


def core_of(cfg, tmp_path, k=1):
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    return MasterCore(cfg, "S", chunk_instants=k, store=store), store


def test_switch_checks_are_one_line_refusals_counted(battlefield, tmp_path):
    core, store = core_of(battlefield, tmp_path)
    [q] = core.register("jane", ["SELECT sid, bp FROM Vitals [ROWS 3]"], roles={"analyst"})
    for args, msg in ((("bob", q.query_id, "Vitals"), "user bob is not the user of query q1"),
                      (("jane", "q9", "Vitals"), "no query q9 at this level"),
                      (("jane", q.query_id, "Positions"), "does not read stream 'Positions' (it reads Vitals)")):
        with pytest.raises(Refused) as e:
            core.access("op", *args, on=False)
        assert msg in str(e.value) and "\n" not in str(e.value)
    assert core.input_rejected["bad_switch"] == 3
    store.close()


def test_revocation_takes_effect_at_the_first_open_instant_and_survives_a_restart(battlefield, tmp_path):
    core, store = core_of(battlefield, tmp_path)
    [q] = core.register("jane", ["SELECT sid, bp FROM Vitals [ROWS 3]"], roles={"analyst"})
    core.ingest_batch("Vitals", vitals([0, 1, 2]), None, advance_upto=1)
    v = core.access("op", "jane", "q1", "vitals", on=False)  # stream names are case-insensitive
    assert (v["instant"], v["changed"], v["state"], v["access_counter"]) == (2, True, "off", 0)
    assert core.access("op", "jane", "q1", "Vitals", on=False)["changed"] is False
    core.ingest_batch("Vitals", vitals([3, 4, 5]), None, advance_upto=4)
    g = core.access("op", "jane", "q1", "Vitals", on=True)
    assert (g["instant"], g["state"], g["access_counter"]) == (5, "on", 1)
    core.advance(finish=True)
    sw = core.status()["switches"]
    assert [(s["query_id"], s["user"], s["stream"], s["state"], s["blocked"], s["passed"]) for s in sw] == [
        ("q1", "jane", "Vitals", "on", 3, 1)]  # instants 2, 3, 4 blocked; 5 passed (0, 1 before the switch)
    store.close()
    again = MasterCore(battlefield, "S", chunk_instants=1,
                       store=MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield)))
    again.restore()
    assert again.status()["switches"] == sw
    assert again.queries["q1"].roles == ("analyst",)
    again.store.close()


def test_a_grant_of_a_switch_never_revoked_changes_and_logs_nothing(battlefield, tmp_path):
    core, store = core_of(battlefield, tmp_path)
    core.register("jane", ["SELECT sid, bp FROM Vitals [ROWS 3]"], roles={"analyst"})
    before = store.last_seq()
    v = core.access("op", "jane", "q1", "Vitals", on=True)
    assert (v["changed"], v["state"], v["access_counter"]) == (False, "on", 1)
    assert store.last_seq() == before and core.status()["switches"] == []
    store.close()


def test_explain_shows_the_shields_and_the_switch_placement(tmp_path, capsys):
    cfg = tmp_path / "b.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    q = "SELECT v.sid, AVG(bp) FROM Vitals v [ROWS 10], Positions p [NOW] WHERE v.sid = p.sid GROUP BY v.sid"
    assert main(["explain", "--config", str(cfg), "--level", "C", "--access", q]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "-- shield: Vitals before its windows (the security punctuations of levels U, C in force at each tuple's "
        "instant, for the query's user and roles, attributes sid, bp; then the query's privacy switch for Vitals)",
        "-- shield: Positions before its windows (the security punctuations of levels U, C in force at each "
        "tuple's instant, for the query's user and roles, attributes sid; then the query's privacy switch for "
        "Positions)"]
    assert main(["explain", "--config", str(cfg), "--level", "S", "--query", "SELECT bp FROM Vitals [ROWS 5]",
                 "--query", "SELECT bp FROM Vitals [ROWS 5] WHERE bp > 1"]) == 0
    text = capsys.readouterr().out
    assert "privacy switches (paper 004, Algorithm 2" in text and "Q2: in-network at " in text


def test_a_query_with_every_stream_off_is_not_dispatched(battlefield):
    """The in-network switch's run-time effect (docs/semantics.md §12): while all of q1's streams are off
    it has no instants, so no chunk carries it (its branch is not computed); q2, the same query, is
    carried by every chunk."""
    from strata.master.pipeline import QueryPipeline

    p = QueryPipeline(battlefield, "S")
    for _ in range(2):
        p.add_query("SELECT sid, bp FROM Vitals [ROWS 3]", principal=("jane", frozenset({"analyst"})))
    p.switch("q1", "jane", "Vitals", False, 2)
    p.switch("q1", "jane", "Vitals", True, 5)
    p.ingest("Vitals", vitals(list(range(8))))
    carried = {c.chunk_id: sorted(qc.query_id for qc in c.queries) for c in p.finish()}
    assert carried == {t: (["q2"] if 2 <= t < 5 else ["q1", "q2"]) for t in range(8)}
    assert p.chunker.shields.switches[("q1", "Vitals")].view(8) | {"changes": None} == {
        "query_id": "q1", "user": "jane", "stream": "Vitals", "state": "on", "since": 5, "access_counter": 1,
        "blocked": 3, "passed": 5, "changes": None}
