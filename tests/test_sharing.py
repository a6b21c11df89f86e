"""Sharing analysis (dissertation §5.3, §6.3): operator trees, equivalence and
subsumption of nodes (Def. 2-3, 9, 11-12), the classifier (Def. 4-8), merged
trees (Alg. 1) with reference counts, and ``strata explain`` with several queries.

Every example of §5.3 (Table 5.1, Fig. 5.2, 5.3) and §6.3 (Fig. 6.2, Qa-Qj) is
copied here as test data; the expected decision is the one the text states,
except where Strata's corrected rewriting (docs/semantics.md §4) changes the
rewritten queries themselves (Qi/Qj, see below).
"""

from __future__ import annotations

import json

import pytest

from strata.cli import main
from strata.config import parse_config
from strata.mlscql import compile_query
from strata.sharing import SharedPlan, build_tree, classify, describe, subsumed_by
from strata.sharing.optree import Node

# §5.3: two levels, high (H) and low (L); all of Table 5.1 is issued at H
HL_TOML = """
[lattice]
levels = ["L", "H"]
[streams.Vitals]
sid = "string"
bp = "double"
pr = "double"
[streams.Position]
sid = "string"
lat = "double"
lon = "string"
"""
# §6.3: the battlefield levels U < C < S < TS, streams named as in the text
UCST_TOML = HL_TOML.replace('levels = ["L", "H"]', 'levels = ["U", "C", "S", "TS"]')

# Table 5.1 (level H), as printed (`WHERE` moved after `FROM` in Q2's spelling is the same query)
TABLE_5_1 = {
    "Q1": "SELECT AVG(bp) FROM Vitals [PARTITIONED BY LEVEL ROWS 20]",
    "Q1'": "SELECT AVG(bp) FROM Vitals [PARTITIONED BY LEVEL ROWS 20]",
    "Q2": 'SELECT AVG(bp) FROM Vitals [ROWS 20] WHERE LEVEL = "L"',
    "Q3": "SELECT AVG(bp) FROM Vitals [PARTITIONED BY LEVEL ROWS 5] WHERE bp > 50",
    "Q4": 'SELECT AVG(pr) FROM Vitals [ROWS 10] V, Position [ROWS 10] P WHERE V.sid = P.sid AND bp > 120 AND lon = "4E"',
    "Q5": 'SELECT V.sid, pr FROM Vitals [ROWS 10] V, Position [ROWS 10] P WHERE V.sid = P.sid AND bp > 120 AND lon = "4E"',
    "Q6": "SELECT sid, bp FROM Vitals WHERE bp > 120",
    "Q7": 'SELECT sid, bp, pr FROM Vitals WHERE LEVEL = "L" AND bp > 120',
    "Q8": "SELECT sid FROM Vitals WHERE pr > 100",
}

# §6.3 (query level, text).  Adaptations to MLS-CQL as Strata parses it, nothing else:
# Qc's "Partition By level in {..} Rows 100" is written [PARTITION BY level ROWS 100 level in {..}];
# Qg/Qh's unqualified `level` in a join is qualified for both items (V.level, P.level), and
# Qh's "Position[Range 2 Minutes in {C,U}]" gets its missing `level` keyword.
SECTION_6_3 = {
    "Qx": ("S", "SELECT COUNT(sid) FROM Vitals[Rows 100 level in {S,C,U}] WHERE bp > 100 and level in {S}"),
    "Qy": ("TS", "SELECT sid FROM Vitals[Rows 100 level in {S,C,U}] WHERE bp > 100"),
    "Qa": ("TS", "SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {TS,C,U}] WHERE level in {S,C,U}"),
    "Qb": ("TS", "SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {S,C,U}] WHERE level in {C,U}"),
    "Qc": ("TS", "SELECT AVG(bp) FROM Vitals[Partition By level Rows 100 level in {TS,S,C,U}] WHERE level in {C}"),
    "Qd": ("C", "SELECT AVG(bp) FROM Vitals[Rows 100 level in {C}] WHERE level in {C,U}"),
    "Qe": ("TS", "SELECT AVG(bp) FROM Vitals[Rows 200 level in {TS,S,C,U}] WHERE level in {C,U}"),
    "Qf": ("TS", "SELECT AVG(pr) FROM Vitals[Rows 200 level in {C,U}] WHERE level in {TS,S,C,U}"),
    "Qg": ("S", "SELECT V.sid, bp, pr FROM Vitals[Range 2 Minutes level in {S,U}] V, "
                "Position[Range 2 Minutes level in {S,U}] P WHERE V.sid = P.sid AND V.level in {C,U} AND P.level in {C,U}"),
    "Qh": ("S", "SELECT V.sid, lat, lon FROM Vitals[Range 2 Minutes level in {C,U}] V, "
                "Position[Range 2 Minutes level in {C,U}] P WHERE V.sid = P.sid AND V.level in {S,U} AND P.level in {S,U}"),
    "Qi": ("S", "SELECT sid, bp FROM Vitals[Rows 100 level in {C,U}] WHERE bp > 120 AND level in {C,S}"),
    "Qj": ("TS", "SELECT sid, pr FROM Vitals[Rows 100 level in {S,C,U}] Where bp > 120 AND bp < 180 AND level in {C}"),
    # the rewritten forms as printed in §6.3
    "Qi'": ("S", "SELECT sid, bp FROM Vitals[Rows 100 level in {C}] WHERE bp > 120"),
    "Qj'": ("TS", "SELECT sid, pr FROM Vitals[Rows 100 level in {C}] WHERE bp > 120 AND bp < 180"),
}


@pytest.fixture(scope="module")
def hl():
    return parse_config(HL_TOML)


@pytest.fixture(scope="module")
def ucst():
    return parse_config(UCST_TOML)


def t51(cfg, name):
    return compile_query(TABLE_5_1[name], cfg, "H")


def s63(cfg, name):
    level, text = SECTION_6_3[name]
    return compile_query(text, cfg, level)


def decide(cfg, new, old, mode, table):
    get = t51 if table == "5.1" else s63
    return classify(get(cfg, new), get(cfg, old), mode, cfg.instant_seconds, cfg.lattice, names=(new, old))


def ops(nodes):
    return sorted(n.op for n in nodes)


# ---- §5.3: replicated MLS-DSMS, one query processor at H -------------------------------------
def test_q1_q1prime_complete_sharing(hl):
    d = decide(hl, "Q1'", "Q1", "replicated", "5.1")
    assert d.kind == "complete"
    assert build_tree(t51(hl, "Q1")) == build_tree(t51(hl, "Q1'"))  # Def. 4


def test_q4_q5_strict_partial_sharing_of_select_and_join(hl):
    """Fig. 5.3: select and join shared; project and aggregate are not."""
    d = decide(hl, "Q5", "Q4", "replicated", "5.1")
    assert d.kind == "strict_partial"
    assert ops(d.shared) == ["join", "select", "select", "tuple_win", "tuple_win"]
    assert not d.subsumed
    plan = SharedPlan("replicated", lattice=hl.lattice)
    plan.add("Q4", t51(hl, "Q4"))
    plan.add("Q5", t51(hl, "Q5"))
    # merged tree: 2 windows, 2 selects, join, then aggregate+project+RSTREAM and project+ISTREAM
    assert plan.node_count == 10 and plan.unshared_node_count() == 15
    join = next(n for n in plan.users if n.op == "join")
    assert plan.users[join] == {"Q4", "Q5"}


def test_q6_q7_loose_partial_sharing(hl):
    """Fig. 5.2(c): Q7's selection is split into bp > 120 (shared with Q6) and level = L."""
    d = decide(hl, "Q7", "Q6", "replicated", "5.1")
    assert d.kind == "loose_partial"
    shared_select = next(n for n in d.shared if n.op == "select")
    assert describe(shared_select) == "select($0.bp > 120)"
    plan = SharedPlan("replicated", lattice=hl.lattice)
    plan.add("Q6", t51(hl, "Q6"))
    plan.add("Q7", t51(hl, "Q7"))
    residual = [n for n, users in plan.users.items() if n.op == "select" and users == {"Q7"}]
    assert len(residual) == 1 and residual[0].inputs == (shared_select,)
    assert describe(residual[0]) == "select($0.level = L)"
    # OPT(Q67): window, bp > 120, level = L, and a project + ISTREAM per query
    assert plan.node_count == 7


def test_q8_shares_only_the_window_with_q6(hl):
    d = decide(hl, "Q8", "Q6", "replicated", "5.1")
    assert d.kind == "strict_partial" and ops(d.shared) == ["time_win"]


def test_q2_and_q1_not_shared(hl):
    # ROWS 20 over L and H followed by level = L is not the last 20 L tuples: windows differ
    d = decide(hl, "Q2", "Q1", "replicated", "5.1")
    assert d.kind == "none" and "windows differ" in d.reason


# ---- §6.3: trusted MLS-DSMS ------------------------------------------------------------------------
def test_qx_qy_figure_6_2(ucst):
    """OP1 ≡ OP4 (the window), OP2 ⊆_T OP5 (select), decomposed into OP5 and OP7 — across S and TS."""
    assert decide(ucst, "Qx", "Qy", "replicated", "6.3").kind == "none"
    d = decide(ucst, "Qx", "Qy", "trusted", "6.3")
    assert d.kind == "loose_partial"
    assert ops(d.shared) == ["select", "tuple_win"]
    (sub, by), = d.subsumed
    assert describe(sub) == "select($0.bp > 100 AND $0.level IN (S))" and describe(by) == "select($0.bp > 100)"
    plan = SharedPlan("trusted", lattice=ucst.lattice)
    plan.add("Qy", s63(ucst, "Qy"))
    plan.add("Qx", s63(ucst, "Qx"))
    op7 = [n for n, u in plan.users.items() if n.op == "select" and u == {"Qx"}]
    assert len(op7) == 1 and describe(op7[0]) == "select($0.level IN (S))" and op7[0].inputs == (by,)


def test_qa_qb_are_not_shared_since_their_instants_differ(ucst):
    """The dissertation optimizes Qa and Qb into the same Qab (RANGE 3 minutes level in {U, C}) and
    shares them completely.  Under the contract's instants rule (SEMANTICS §5, issue 16) the move
    keeps each query's instants: Qa's are the arrivals of {U, C, TS}, Qb's of {U, C, S}, so AVG is
    output at different instants and the two are not the same query."""
    qa, qb = s63(ucst, "Qa"), s63(ucst, "Qb")
    assert qa.query.from_[0].window.clause == qb.query.from_[0].window.clause  # Qab's window contents
    assert qa.query.from_[0].window.instants == ("U", "C", "TS") and qb.query.from_[0].window.instants == ("U", "C", "S")
    for mode in ("replicated", "trusted"):
        d = decide(ucst, "Qb", "Qa", mode, "6.3")
        assert d.kind == "none" and "instants of {U, C, S}" in d.reason


def test_qc_qd_across_levels(ucst):
    """Qc' (PARTITION BY level ROWS 100 level in {C}) keeps the instants of all four levels (issue 16);
    Qd's are the C arrivals: not the same query any more, in either mode."""
    qc = s63(ucst, "Qc")
    assert qc.query.from_[0].window.levels == {"C"} and qc.query.where is None
    assert qc.query.from_[0].window.instants == ("U", "C", "S", "TS")
    assert s63(ucst, "Qd").rewritten == "SELECT AVG(bp) FROM Vitals [ROWS 100 level in {C}]"
    assert decide(ucst, "Qd", "Qc", "trusted", "6.3").kind == "none"
    d = decide(ucst, "Qd", "Qc", "replicated", "6.3")  # TS and C: different query processors
    assert d.kind == "none" and "within a level" in d.reason


def test_qe_qf_not_shared(ucst):
    for mode in ("replicated", "trusted"):
        d = decide(ucst, "Qf", "Qe", mode, "6.3")
        assert d.kind == "none" and "tuple-based window over other levels" in d.reason


def test_qg_qh_share_no_window_since_their_instants_differ(ucst):
    """Qg' and Qh' window the U tuples of both streams, but Qg's instants are the {U, S} arrivals and
    Qh's the {U, C} ones (issue 16): the dissertation's strict partial sharing of the join is not
    result-preserving under the contract, so Strata shares nothing."""
    qg, qh = s63(ucst, "Qg"), s63(ucst, "Qh")
    assert [f.window.levels for f in qg.query.from_] == [{"U"}, {"U"}] == [f.window.levels for f in qh.query.from_]
    assert decide(ucst, "Qh", "Qg", "trusted", "6.3").kind == "none"


def test_qi_qj_loose_partial_as_printed_rewritten(ucst):
    """Qi'/Qj' as the text prints them: S_Qj' ⊆_T S_Qi' (bp > 120 shared, bp < 180 residual)."""
    d = decide(ucst, "Qj'", "Qi'", "trusted", "6.3")
    assert d.kind == "loose_partial"
    (sub, by), = d.subsumed
    assert describe(by) == "select($0.bp > 120)"
    assert decide(ucst, "Qj'", "Qi'", "replicated", "6.3").kind == "none"


def test_qi_qj_as_written_are_not_shared_in_strata(ucst):
    """The text rewrites Qi/Qj into Qi'/Qj' by moving `level in {..}` into a ROWS window.  That
    changes results (the last 100 C/U tuples filtered to C are not the last 100 C tuples),
    so Strata keeps the condition after the window (semantics §4) and the windows differ."""
    qi, qj = s63(ucst, "Qi"), s63(ucst, "Qj")
    assert qi.rewritten == "SELECT sid, bp FROM Vitals [ROWS 100 level in {U, C}] WHERE bp > 120 AND level IN {C, S}"
    assert sorted(qj.query.from_[0].window.levels) == ["C", "S", "U"]
    d = decide(ucst, "Qj", "Qi", "trusted", "6.3")
    assert d.kind == "none" and "windows differ" in d.reason


# ---- nodes ----------------------------------------------------------------------------------------
def _win(op, levels, **p):
    parm = {"levels": frozenset(levels), **p}
    return Node(op, tuple(sorted(parm.items())), (), "Vitals")


def test_window_subsumption_rules():
    assert subsumed_by(_win("tuple_win", "C", rows=5), _win("tuple_win", "CU", rows=5)) is None  # Qe/Qf
    # a narrowed window is the wider one followed by a level selection when it keeps the wider one's
    # instants (what Alg. 4 leaves: SEMANTICS §5, issue 16), not when its own arrivals are its instants
    cu = frozenset("CU")
    assert subsumed_by(_win("time_win", "C", kind="range", range=3, instants=cu),
                       _win("time_win", "CU", kind="range", range=3))["kind"] == "sel_win"
    assert subsumed_by(_win("time_win", "C", kind="range", range=3), _win("time_win", "CU", kind="range", range=3)) is None
    assert subsumed_by(_win("time_win", "C", kind="range", range=3, instants=cu),
                       _win("time_win", "CU", kind="range", range=4)) is None
    part = _win("part_win", "CUS", rows=5, by=frozenset({"level"}))
    cus = frozenset("CUS")
    assert subsumed_by(_win("tuple_win", "C", rows=5, instants=cus), part)["kind"] == "part_win"  # Def. 11 case 4
    assert subsumed_by(_win("tuple_win", "C", rows=5), part) is None  # the C arrivals alone: other instants
    assert subsumed_by(_win("tuple_win", "CU", rows=5, instants=cus), part) is None  # case 4 needs a single level
    assert subsumed_by(_win("part_win", "CU", rows=5, by=frozenset({"level"}), instants=cus), part)["kind"] == "sel_win"
    sid = _win("part_win", "CUS", rows=5, by=frozenset({"sid"}))
    assert subsumed_by(_win("part_win", "CU", rows=5, by=frozenset({"sid"})), sid) is None


def test_equivalence_ignores_aliases_and_operand_order(ucst):
    a = compile_query("SELECT V.sid FROM Vitals [ROWS 3] V, Position [ROWS 3] P WHERE V.sid = P.sid AND V.bp > 1", ucst, "S")
    b = compile_query("SELECT X.sid FROM Vitals [ROWS 3] X, Position [ROWS 3] Y WHERE Y.sid = X.sid AND 1 < X.bp", ucst, "S")
    assert build_tree(a) == build_tree(b)
    assert build_tree(a, "replicated") != build_tree(compile_query(a.text, ucst, "TS"), "replicated")


def test_shared_plan_stays_while_any_query_uses_it(hl):
    plan = SharedPlan("replicated", lattice=hl.lattice)
    plan.add("Q4", t51(hl, "Q4"))
    plan.add("Q5", t51(hl, "Q5"))
    plan.add("Q5b", t51(hl, "Q5"))
    gone = plan.remove("Q4")
    assert ops(gone) == ["aggregate", "project", "r2s"]
    assert any(n.op == "join" for n in plan.users)
    assert plan.remove("Q5") == []  # Q5b is Q5: every node stays
    assert plan.node_count == 7  # Q5: 2 windows, 2 selects, join, project, ISTREAM
    plan.remove("Q5b")
    assert plan.node_count == 0 and not plan.queries


def test_pipeline_keeps_the_plan(hl):
    from strata.master.pipeline import QueryPipeline

    p = QueryPipeline(hl, "H")
    q6, _ = p.add_query(TABLE_5_1["Q6"])
    q7, _ = p.add_query(TABLE_5_1["Q7"])
    rep = p.sharing_report()
    assert rep["enabled"] is True and rep["decisions"][0]["kind"] == "loose_partial"
    p.remove_query(q6)
    assert any(n.op == "time_win" and u == {q7} for n, u in p.sharing.users.items())
    p.remove_query(q7)
    assert p.sharing.node_count == 0


# ---- strata explain -------------------------------------------------------------------------------
@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "ucst.toml"
    p.write_text(UCST_TOML)
    return p


def test_explain_several_queries_text(cfg_file, capsys):
    same_as_qa = "SELECT AVG(bp) FROM Vitals[Range 180 seconds level in {U,C,TS}] WHERE level in {U,S,C}"
    rc = main(["explain", "--config", str(cfg_file), "--level", "TS", "--query", SECTION_6_3["Qa"][1],
               "--query", same_as_qa, "--query", SECTION_6_3["Qe"][1], "--query", SECTION_6_3["Qb"][1]])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Q2 with Q1: complete sharing" in out
    assert "Q3 with Q1: not shared" in out
    assert "Q4 with Q1: not shared" in out and "instants of {U, C, S}" in out  # Qb: other instants (issue 16)
    assert "Q1, Q2 (TS): complete" in out


def test_explain_trusted_json_across_levels(cfg_file, capsys):
    rc = main(["explain", "--config", str(cfg_file), "--mode", "trusted", "--json",
               "--query-at", *SECTION_6_3["Qc"], "--query-at", *SECTION_6_3["Qd"]])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [q["level"] for q in out["queries"]] == ["TS", "C"]
    (d,) = out["decisions"]  # Qc' keeps the instants of all levels, Qd's are the C arrivals (issue 16)
    assert (d["query"], d["with"], d["kind"]) == ("Q2", "Q1", "none") and "instants of {U, C, S, TS}" in d["reason"]
    # the cluster runs each level on its own master: nothing is executed shared across levels
    assert sorted(e["form"] for e in out["execution"]) == ["alone", "alone"]


def test_explain_file_and_replicated_reasons(cfg_file, tmp_path, capsys):
    f = tmp_path / "q.txt"
    f.write_text("# Fig. 6.2\n@S " + SECTION_6_3["Qx"][1] + "\n@TS " + SECTION_6_3["Qy"][1] + "\n")
    assert main(["explain", "--config", str(cfg_file), "--file", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (d,) = out["decisions"]
    assert d["kind"] == "none" and "replicated mode shares only within a level" in d["reason"]
    assert main(["explain", "--config", str(cfg_file), "--file", str(f), "--mode", "trusted"]) == 0
    assert "Q2 with Q1: loose partial sharing" in capsys.readouterr().out


def test_explain_single_query_unchanged(cfg_file, capsys):
    assert main(["explain", "--config", str(cfg_file), "--level", "S", "SELECT bp FROM Vitals"]) == 0
    assert capsys.readouterr().out.strip() == "SELECT bp FROM Vitals [RANGE UNBOUNDED level in {U, C, S}]"


# ---- R2S of a merged relation (worker/shared.py, no Spark) ------------------------------------------
def test_bag_difference_of_merged_relation():
    import pyarrow as pa

    from strata.worker.shared import _difference

    # R at instants 1 (previous), 2, 3: rows (level, x) with duplicates, a NULL and -0.0
    t = pa.table({
        "ts": [1, 1, 1, 2, 2, 2, 2, 3],
        "level": ["U", "U", "C", "U", "C", "C", "U", "U"],
        "x": [1.0, 1.0, None, 1.0, None, None, -0.0, 0.0],
    })
    ins = sorted((tuple(r.values()) for r in _difference(t, [1, 2, 3], [2, 3], "ISTREAM").to_pylist()), key=repr)
    # at 2: {U 1, C NULL, C NULL, U -0.0} - {U 1, U 1, C NULL} = {C NULL, U 0.0}; at 3: {U 0.0} - R(2) = {}
    assert [(ts, lv) for ts, lv, _ in ins] == [(2, "C"), (2, "U")]
    dels = [tuple(r.values()) for r in _difference(t, [1, 2, 3], [2, 3], "DSTREAM").to_pylist()]
    # at 2: R(1) - R(2) = {U 1}; at 3: R(2) - R(3) = {U 1, C NULL, C NULL}
    assert sorted(dels, key=repr) == sorted([(2, "U", 1.0), (3, "U", 1.0), (3, "C", None), (3, "C", None)], key=repr)
    # without a previous instant the first instant's rows are all new
    first = _difference(t.slice(3), [2, 3], [2, 3], "ISTREAM")
    assert first.num_rows == 4
