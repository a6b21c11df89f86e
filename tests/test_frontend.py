"""MLS-CQL front end: the dissertation's §6.2 examples, spellings, rejections, round trips."""

from __future__ import annotations

import pytest

from strata.mlscql import (
    AuthorizationError,
    LimitError,
    OptimizationError,
    ParseError,
    QueryError,
    SemanticError,
    analyze,
    compile_query,
    parse,
    to_text,
)


def win(cq, i=0):
    w = cq.query.from_[i].window
    return w.kind, sorted(w.levels)


# ---- dissertation §6.2 -------------------------------------------------------------
def test_q4_rejected_at_S(battlefield):
    with pytest.raises(AuthorizationError) as e:
        compile_query("SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {TS,C,U}];", battlefield, "S")
    assert "window clause of Vitals" in e.value.message and "TS" in e.value.message


def test_q5_rejected_at_S(battlefield):
    with pytest.raises(AuthorizationError) as e:
        compile_query("SELECT bp FROM Vitals Where level in {C,U,TS};", battlefield, "S")
    assert "WHERE" in e.value.message


def test_q6_accepted_at_S(battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {S,C,U}];", battlefield, "S")
    assert win(cq) == ("range", ["C", "S", "U"])


def test_q7_rewritten(battlefield):
    cq = compile_query("SELECT bp FROM Vitals;", battlefield, "S")
    assert cq.rewritten == "SELECT bp FROM Vitals [RANGE UNBOUNDED level in {U, C, S}]"
    assert cq.r2s == "ISTREAM"


def test_q3_user_clause_intersected(battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[Rows 100 level in {U,C,TS}];", battlefield, "TS")
    assert win(cq) == ("rows", ["C", "TS", "U"])


def test_q8_never_output(battlefield):
    with pytest.raises(OptimizationError) as e:
        compile_query(
            "SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {TS,C,U}] WHERE level in {S};", battlefield, "TS"
        )
    assert "never output" in e.value.message


def test_q9_moved_into_range_window(battlefield):
    # printed with a misprinted level "UC"; U is meant (an unknown level is rejected, below)
    cq = compile_query(
        "SELECT AVG(bp) FROM Vitals[Range 3 minutes level in {TS,C,U}] WHERE level in {S,C,U};", battlefield, "TS"
    )
    # Q9': the window evaluates only U and C tuples, as the dissertation prints it ...
    assert win(cq) == ("range", ["C", "U"]) and cq.query.where is None
    # ... but its instants stay the arrivals of {U, C, TS} (SEMANTICS §5, issue 16), which Q9''s text
    # cannot say: the text shown is the rewritten query before the move, and it compiles to Q9' again
    assert cq.query.from_[0].window.instants == ("U", "C", "TS")
    assert cq.rewritten == "SELECT AVG(bp) FROM Vitals [RANGE 3 minutes level in {U, C, TS}] WHERE level IN {S, C, U}"
    assert compile_query(cq.rewritten, battlefield, "TS").query == cq.query
    with pytest.raises(SemanticError, match="UC"):
        compile_query("SELECT AVG(bp) FROM Vitals[Range 3 minutes] WHERE level in {S,C,UC};", battlefield, "TS")


def test_q10_dropped_for_rows(battlefield):
    cq = compile_query("SELECT AVG(bp) FROM Vitals[Rows 100 level in {C}] WHERE level in {C,U};", battlefield, "TS")
    assert cq.rewritten == "SELECT AVG(bp) FROM Vitals [ROWS 100 level in {C}]"


def test_q10_kept_when_rows_window_is_wider(battlefield):
    # Qy: filtering after a ROWS window is not filtering before it (§4.3)
    cq = compile_query("SELECT AVG(bp) FROM Vitals[Rows 100] WHERE level in {C,U};", battlefield, "TS")
    assert win(cq) == ("rows", ["C", "S", "TS", "U"])
    assert cq.query.where is not None


def test_q11_partition_by_level(battlefield):
    cq = compile_query(
        "SELECT AVG(bp) FROM Vitals[Partition By level in {TS,S,C,U} Rows 100] WHERE level in {C};", battlefield, "TS"
    )
    assert win(cq) == ("partition", ["C"])
    assert cq.query.where is None
    assert cq.query.from_[0].window.partition_by == ("level",)


def test_partition_by_other_attribute_keeps_where(battlefield):
    # Alg. 4 as printed would move it; that changes results (SEMANTICS §4)
    cq = compile_query("SELECT AVG(bp) FROM Vitals[Partition By sid Rows 3] WHERE level in {C};", battlefield, "TS")
    assert win(cq) == ("partition", ["C", "S", "TS", "U"])
    assert cq.query.where is not None


def test_now_and_unbounded_move(battlefield):
    cq = compile_query("SELECT bp FROM Vitals[NOW] WHERE level = C AND bp > 1", battlefield, "TS")
    assert win(cq) == ("now", ["C"])
    assert to_text(cq.query).endswith("WHERE Vitals.bp > 1")
    cq = compile_query("SELECT bp FROM Vitals WHERE level != C", battlefield, "S")
    assert win(cq) == ("unbounded", ["S", "U"])


def test_qx_qy_differ(battlefield):
    qx = compile_query("Select AVG(bp) From Vitals[Rows 100 level in {C,U}];", battlefield, "TS")
    qy = compile_query("Select AVG(bp) From Vitals[Rows 100] Where level in {C,U};", battlefield, "TS")
    assert qx.query != qy.query


# ---- Chinese Wall (dissertation §8.3) ------------------------------------------------
def test_dominated_by_window_clause(chinese_wall):
    cq = compile_query(
        'SELECT MIN(timestamp), MAX(timestamp) FROM MessageLog [ROWS 100 WHERE level DOMINATED BY [1,B]] '
        'WHERE outcome = "success" AND serviceId = "5"',
        chinese_wall,
        "[T,T]",
    )
    assert win(cq) == ("rows", sorted(["[⊥,⊥]", "[1,⊥]", "[⊥,B]", "[1,B]"]))
    assert [c.name for c in cq.outputs] == ["MIN(timestamp)", "MAX(timestamp)"]


def test_audit_queries_accept_at_their_levels(chinese_wall):
    q6 = (
        "SELECT R.timestamp - S.timestamp AS delay FROM MessageLog R[Rows 100], MessageLog S[Rows 100] "
        'WHERE S.msgType = "send" AND S.outcome = "success" AND R.msgType = "receive" AND R.outcome = "success" '
        'AND R.receiver = "Company1" AND R.sender = "CompanyB" AND S.receiver = "CompanyB" '
        'AND S.sender = "Company1" AND S.serviceId = R.serviceId'
    )
    cq = compile_query(q6, chinese_wall, "[1,B]")
    assert [w.window.levels for w in cq.query.from_] == [frozenset({"[⊥,⊥]", "[1,⊥]", "[⊥,B]", "[1,B]"})] * 2
    cq = compile_query(
        'SELECT timestamp FROM MessageLog WHERE msgType = "send" AND outcome = "failure" '
        'AND receiver = "CompanyB" OR receiver = "CompanyA" OR receiver = "CompanyC"',
        chinese_wall,
        "[⊥,T]",
    )
    assert win(cq) == ("unbounded", sorted(["[⊥,⊥]", "[⊥,A]", "[⊥,B]", "[⊥,C]", "[⊥,T]"]))
    with pytest.raises(AuthorizationError):
        compile_query("SELECT timestamp FROM MessageLog WHERE level = [0,B]", chinese_wall, "[1,⊥]")
    cq = compile_query("SELECT timestamp FROM MessageLog WHERE level = [0,B]", chinese_wall, "[⊥,T]")
    assert win(cq) == ("unbounded", ["[⊥,B]"])


# ---- spellings ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "SELECT AVG(bp) FROM Vitals [Rows 100 level in {U,C}]",
        "SELECT AVG(bp) FROM Vitals [Range 3 minutes]",
        "SELECT AVG(bp) FROM Vitals [RANGE 2 Seconds]",
        "SELECT AVG(bp) FROM Vitals [Partition By level Rows 100]",
        "SELECT AVG(bp) FROM Vitals [PARTITIONED BY LEVEL ROWS 20]",
        "SELECT AVG(bp) FROM Vitals [ROWS 100 LEVEL = \"S\"]",
        "SELECT AVG(bp) FROM Vitals [ROWS 100 WHERE level DOMINATED BY S]",
        "ISTREAM(SELECT bp FROM Vitals)",
        "SELECT RSTREAM bp FROM Vitals [NOW]",
        "SELECT AVG(pr) FROM Vitals [ROWS 10] V, Positions [ROWS 10] P WHERE V.sid = P.sid AND bp > 120 AND lon = \"4E\"",
        "SELECT V.sid, pr FROM Vitals V [ROWS 10], Positions AS P [ROWS 10] WHERE V.sid = P.sid",
        "SELECT sid, AVG(bp) AS avg_bp FROM Vitals [RANGE UNBOUNDED] GROUP BY sid HAVING COUNT(*) > 2",
        "select sid, bp * 2 + 1 as x from vitals where not (bp < 3 or pr >= 4.5) and sid in ('a', 'b')",
        "SELECT sid FROM Vitals WHERE pr > 100;",
        "SELECT COUNT(*), SUM(bp), MIN(sid), MAX(pr), AVG(weight), COUNT(bp) FROM Vitals [ROWS 5]",
        "SELECT bp FROM Vitals WHERE bp IS NOT NULL AND level NOT IN {TS}",
    ],
)
def test_paper_spellings_accepted(battlefield, text):
    cq = compile_query(text, battlefield, "TS")
    assert cq.rewritten


@pytest.mark.parametrize(
    "text, err, fragment",
    [
        ("SELECT bp FROM Nope", SemanticError, "unknown stream"),
        ("SELECT nope FROM Vitals", SemanticError, "unknown attribute"),
        ("SELECT sid FROM Vitals V, Positions P", SemanticError, "ambiguous"),
        ("SELECT bp FROM Vitals, Vitals", SemanticError, "used twice"),
        ("SELECT sid + 1 FROM Vitals", SemanticError, "needs numbers"),
        ("SELECT bp FROM Vitals WHERE sid = 3", SemanticError, "cannot compare"),
        ("SELECT bp FROM Vitals WHERE bp", SemanticError, "condition"),
        ("SELECT bp FROM Vitals WHERE AVG(bp) > 1", SemanticError, "aggregate"),
        ("SELECT sid, AVG(bp) FROM Vitals", SemanticError, "GROUP BY"),
        ("SELECT SUM(sid) FROM Vitals", SemanticError, "numeric"),
        ("SELECT * FROM Vitals GROUP BY sid", SemanticError, "SELECT *"),
        ("SELECT bp FROM Vitals [PARTITION BY nope ROWS 3]", SemanticError, "PARTITION BY"),
        ("SELECT bp FROM Vitals WHERE level < S", SemanticError, "DOMINATED BY"),
        ("SELECT bp FROM Vitals [ROWS 3 level in {X}]", SemanticError, "unknown level"),
        ("SELECT bp AS x, pr AS x FROM Vitals", SemanticError, "twice"),
        ("SELECT bp FROM Vitals [ROWS 0]", LimitError, "window of Vitals: ROWS 0: a window holds 1 to"),
        ("SELECT bp FROM Vitals [RANGE 0 seconds]", LimitError, "window of Vitals: RANGE 0 seconds spans no instant"),
        ("SELECT bp FRM Vitals", ParseError, "FRM"),
        ("SELECT bp FROM Vitals [ROWS 3 sid in {a}]", ParseError, "level"),
        ("", ParseError, "empty"),
    ],
)
def test_rejections_name_the_clause(battlefield, text, err, fragment):
    with pytest.raises(err) as e:
        compile_query(text, battlefield, "TS")
    assert fragment in e.value.message
    assert "\n" not in str(e.value)


def test_rejections_reveal_no_data(battlefield):
    """Errors depend only on the query, the schema and the lattice: there is no data to reveal."""
    with pytest.raises(QueryError) as e1:
        compile_query("SELECT bp FROM Vitals [ROWS 3 level = TS]", battlefield, "C")
    assert "does not dominate" in e1.value.message


def test_output_names_are_unique(battlefield):
    cq = compile_query("SELECT level, ts, bp, bp FROM Vitals GROUP BY level, ts, bp", battlefield, "TS")
    names = [c.name for c in cq.outputs]
    assert len(set(n.lower() for n in names)) == len(names)
    assert "level" not in names and "ts" not in names


def test_default_r2s(battlefield):
    assert compile_query("SELECT AVG(bp) FROM Vitals", battlefield, "TS").r2s == "RSTREAM"
    assert compile_query("SELECT bp FROM Vitals", battlefield, "TS").r2s == "ISTREAM"
    assert compile_query("SELECT DSTREAM bp FROM Vitals [NOW]", battlefield, "TS").r2s == "DSTREAM"


def test_login_level_must_be_a_level(battlefield):
    with pytest.raises(AuthorizationError):
        compile_query("SELECT bp FROM Vitals", battlefield, "SECRET")


# ---- round trip ----------------------------------------------------------------------
ROUND_TRIP = [
    ("TS", "SELECT AVG(bp) FROM Vitals[Partition By level in {TS,S,C,U} Rows 100] WHERE level in {C}"),
    ("S", "SELECT sid, bp * -2 AS x FROM Vitals WHERE (bp > 1 OR pr < 2) AND NOT sid = 'o''k'"),
    ("TS", "SELECT DSTREAM V.sid, lat FROM Vitals V [NOW], Positions P [RANGE 90 seconds] WHERE V.sid = P.sid"),
    ("C", "ISTREAM(SELECT bp - (pr - weight) FROM Vitals [ROWS 3] WHERE level DOMINATED BY U OR bp IN (1, 2.5))"),
    ("TS", "SELECT sid, COUNT(*), AVG(bp) FROM Vitals [PARTITION BY sid, level ROWS 2] GROUP BY sid HAVING MAX(bp) > 3"),
    ("TS", "SELECT * FROM Vitals V [ROWS 2], Positions P [ROWS 2] WHERE V.sid = P.sid"),
    ("S", "SELECT bp / 3 % 2 FROM Vitals [RANGE 1.5 minutes] WHERE bp IS NULL OR pr IS NOT NULL"),
]


@pytest.mark.parametrize("level, text", ROUND_TRIP)
def test_rewritten_text_reparses_to_same_query(battlefield, level, text):
    cq = compile_query(text, battlefield, level)
    again = compile_query(cq.rewritten, battlefield, level)
    assert again.query == cq.query
    assert again.rewritten == cq.rewritten
    assert again.outputs == cq.outputs
    # the raw AST prints and re-parses to itself as well
    raw = parse(text)
    assert parse(to_text(raw)) == raw


def test_chinese_wall_round_trip(chinese_wall):
    cq = compile_query(
        "SELECT MIN(timestamp) FROM MessageLog [ROWS 100 WHERE level DOMINATED BY [1,B]] WHERE level != [0,0]",
        chinese_wall,
        "[T,T]",
    )
    assert analyze(parse(cq.rewritten), chinese_wall, "[T,T]").query == cq.query
