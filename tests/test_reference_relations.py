"""Stored relations in the reference evaluator, against answers computed by hand.

Lattice U < C < S; stream Vitals(sid, bp); relations Units(sid, unit) and Limits(sid, high).  A
relation's input is its updates in arrival order (``op`` insert | delete); a FROM item on it holds
at τ the rows live at τ that it sees, and its visible updates (deletes too) are instants.
"""

from __future__ import annotations

import pytest

from strata.config import parse_config
from tests.reference import compare_results, evaluate

CONFIG = parse_config("""
[lattice]
levels = ["U", "C", "S"]

[time]
instant_seconds = 1

[streams.Vitals]
sid = "string"
bp = "double"

[relations.Units]
sid = "string"
unit = "string"

[relations.Limits]
sid = "string"
high = "double"
""")

JOIN = "SELECT v.sid, u.unit FROM Vitals [NOW] v, Units u WHERE v.sid = u.sid"


def vit(ts, level, sid, bp=None):
    return {"ts": ts, "level": level, "sid": sid, "bp": bp}


def ins(ts, level, sid, unit):
    return {"ts": ts, "level": level, "op": "insert", "sid": sid, "unit": unit}


def dele(ts, level, sid, unit):
    return {"ts": ts, "level": level, "op": "delete", "sid": sid, "unit": unit}


def lim(op, ts, level, sid, high):
    return {"ts": ts, "level": level, "op": op, "sid": sid, "high": high}


def run(query, level, streams):
    return evaluate(query, CONFIG, level, streams)


def check(actual, expected):
    compare_results(actual, expected)
    assert len(actual) == len(expected)


# ---- joins with a stream -----------------------------------------------------------------
JOIN_INPUT = {
    "Units": [ins(1, "U", "a", "alpha"), ins(1, "S", "b", "bravo")],
    "Vitals": [vit(2, "U", "a", 100), vit(2, "U", "b", 110), vit(3, "S", "b", 120)],
}


def test_join_at_U_sees_only_the_U_row():
    # instants 1 (the U insert) and 2; at 2 only a has a U unit
    check(run(JOIN, "U", JOIN_INPUT), [(2, "U", "a", "alpha")])


def test_join_at_S_levels_are_the_lub():
    # at 2: a⋈alpha (U, U) and b⋈bravo (U, S) → S; at 3 b⋈bravo again (no ISTREAM output)
    check(run(JOIN, "S", JOIN_INPUT), [(2, "U", "a", "alpha"), (2, "S", "b", "bravo")])
    rjoin = JOIN.replace("SELECT", "SELECT RSTREAM", 1)
    check(run(rjoin, "S", JOIN_INPUT),
          [(2, "U", "a", "alpha"), (2, "S", "b", "bravo"), (3, "S", "b", "bravo")])


def test_relation_rows_join_whatever_their_ts():
    s = {"Units": [ins(1, "U", "a", "alpha")], "Vitals": [vit(100, "U", "a", 1.0)]}
    check(run(JOIN, "U", s), [(100, "U", "a", "alpha")])


def test_delete_makes_an_instant_and_removes_the_row():
    s = {"Units": [ins(1, "U", "a", "alpha"), dele(3, "U", "a", "alpha"), ins(3, "U", "a", "alpha2")],
         "Vitals": [vit(2, "U", "a"), vit(3, "U", "a"), vit(4, "U", "a")]}
    q = JOIN.replace("SELECT", "SELECT RSTREAM", 1)
    # at 3 the arrivals of ts 3 are all applied: alpha is gone, alpha2 is live
    check(run(q, "U", s), [(2, "U", "a", "alpha"), (3, "U", "a", "alpha2"), (4, "U", "a", "alpha2")])
    check(run(JOIN.replace("SELECT", "SELECT DSTREAM", 1), "U", s), [(3, "U", "a", "alpha")])


# ---- R2S over the relation's contents ----------------------------------------------------------
CONTENTS = {"Units": [ins(1, "U", "a", "alpha"), ins(1, "U", "b", "bravo"), dele(5, "U", "a", "alpha"),
                      ins(7, "U", "c", "charlie")]}


def test_istream_dstream_rstream_of_the_contents():
    check(run("SELECT sid, unit FROM Units", "U", CONTENTS),  # ISTREAM by default
          [(1, "U", "a", "alpha"), (1, "U", "b", "bravo"), (7, "U", "c", "charlie")])
    check(run("SELECT DSTREAM sid, unit FROM Units", "U", CONTENTS), [(5, "U", "a", "alpha")])
    check(run("SELECT RSTREAM sid, unit FROM Units", "U", CONTENTS),
          [(1, "U", "a", "alpha"), (1, "U", "b", "bravo"), (5, "U", "b", "bravo"),
           (7, "U", "b", "bravo"), (7, "U", "c", "charlie")])
    check(run("SELECT * FROM Units", "U", CONTENTS),
          [(1, "U", "a", "alpha"), (1, "U", "b", "bravo"), (7, "U", "c", "charlie")])


def test_count_over_time():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(2, "S", "b", "bravo"), dele(4, "S", "b", "bravo"),
                   ins(6, "U", "c", "charlie"), dele(8, "U", "a", "alpha"), dele(9, "U", "c", "charlie")]}
    q = "SELECT COUNT(*) FROM Units"  # RSTREAM by default
    # at U the S updates at 2 and 4 are not instants; an empty relation counts 0 at the bottom
    check(run(q, "U", s), [(1, "U", 1), (6, "U", 2), (8, "U", 1), (9, "U", 0)])
    check(run(q, "C", s), [(1, "U", 1), (6, "U", 2), (8, "U", 1), (9, "U", 0)])
    check(run(q, "S", s), [(1, "U", 1), (2, "S", 2), (4, "U", 1), (6, "U", 2), (8, "U", 1), (9, "U", 0)])


def test_level_clause_on_a_relation():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(2, "C", "b", "bravo"), ins(3, "S", "c", "charlie"),
                   dele(4, "S", "c", "charlie"), dele(5, "U", "a", "alpha")]}
    # only the C and U updates are instants (not 3 and 4); the S row is never counted
    check(run("SELECT COUNT(*) FROM Units [level in {U, C}]", "S", s), [(1, "U", 1), (2, "C", 2), (5, "C", 1)])
    check(run("SELECT COUNT(*) FROM Units [level = S]", "S", s), [(3, "S", 1), (4, "U", 0)])
    check(run("SELECT COUNT(*) FROM Units [level DOMINATED BY C] u", "S", s),
          [(1, "U", 1), (2, "C", 2), (5, "C", 1)])
    check(run("SELECT COUNT(*) FROM Units [level = U]", "C", s), [(1, "U", 1), (5, "U", 0)])


def test_where_on_level_filters_after_and_keeps_the_instants():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(2, "C", "b", "bravo"), dele(3, "C", "b", "bravo")]}
    check(run("SELECT RSTREAM sid FROM Units WHERE level = U", "C", s),
          [(1, "U", "a"), (2, "U", "a"), (3, "U", "a")])


# ---- which row a delete removes -------------------------------------------------------------
def test_delete_of_one_of_two_equal_rows_removes_the_oldest():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(3, "U", "a", "alpha"), dele(4, "U", "a", "alpha"),
                   ins(5, "U", "a", "alpha"), dele(6, "U", "a", "alpha")]}
    q = "SELECT RSTREAM u.ts, u.unit FROM Units u"
    check(run(q, "U", s), [(1, "U", 1, "alpha"),
                           (3, "U", 1, "alpha"), (3, "U", 3, "alpha"),
                           (4, "U", 3, "alpha"),
                           (5, "U", 3, "alpha"), (5, "U", 5, "alpha"),
                           (6, "U", 5, "alpha")])


def test_equal_rows_in_one_instant():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(1, "U", "a", "alpha"), dele(1, "U", "a", "alpha")]}
    check(run("SELECT RSTREAM u.ts, u.unit FROM Units u", "U", s), [(1, "U", 1, "alpha")])


def test_delete_matches_its_own_level_only():
    # the C row is older, but the delete is at U: it removes the U row
    s = {"Units": [ins(1, "C", "a", "alpha"), ins(2, "U", "a", "alpha"), dele(3, "U", "a", "alpha")]}
    check(run("SELECT RSTREAM u.ts, u.level, u.unit FROM Units u", "S", s),
          [(1, "C", 1, "C", "alpha"),
           (2, "C", 1, "C", "alpha"), (2, "U", 2, "U", "alpha"),
           (3, "C", 1, "C", "alpha")])


def test_delete_above_the_session_is_no_instant_for_it():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(2, "S", "b", "bravo"), dele(4, "S", "b", "bravo")],
         "Vitals": [vit(5, "U", "b")]}
    q = "SELECT RSTREAM u.sid FROM Units u"
    check(run(q, "C", s), [(1, "U", "a")])  # 2 and 4 are S updates: not instants at C
    check(run(q, "S", s), [(1, "U", "a"), (2, "U", "a"), (2, "S", "b"), (4, "U", "a")])
    # the join at S: bravo was deleted at 4, so nothing joins at 5
    check(run(JOIN, "S", s), [])


def test_null_attributes_match():
    s = {"Units": [ins(1, "U", "a", None), ins(1, "U", "a", "x"), ins(2, "U", None, None),
                   dele(3, "U", "a", None), dele(4, "U", None, None)]}
    check(run("SELECT RSTREAM sid, unit FROM Units", "U", s),
          [(1, "U", "a", None), (1, "U", "a", "x"),
           (2, "U", "a", None), (2, "U", "a", "x"), (2, "U", None, None),
           (3, "U", "a", "x"), (3, "U", None, None),
           (4, "U", "a", "x")])


def test_nan_and_negative_zero_match():
    s = {"Limits": [lim("insert", 1, "U", "a", float("nan")), lim("insert", 1, "U", "b", -0.0),
                    lim("insert", 1, "U", "c", 1.5),
                    lim("delete", 2, "U", "a", float("nan")), lim("delete", 3, "U", "b", 0.0)]}
    check(run("SELECT COUNT(*) FROM Limits", "U", s), [(1, "U", 3), (2, "U", 2), (3, "U", 1)])


def test_op_in_any_case():
    s = {"Units": [{**ins(1, "U", "a", "alpha"), "op": "INSERT"}, {**dele(2, "U", "a", "alpha"), "OP": "Delete"}]}
    s["Units"][1].pop("op")
    check(run("SELECT COUNT(*) FROM Units", "U", s), [(1, "U", 1), (2, "U", 0)])


def test_two_relations_joined():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(1, "U", "b", "bravo")],
         "Limits": [lim("insert", 2, "C", "a", 140.0), lim("delete", 3, "C", "a", 140.0)]}
    q = "SELECT RSTREAM u.unit, l.high FROM Units u, Limits l WHERE u.sid = l.sid"
    check(run(q, "C", s), [(2, "C", "alpha", 140.0)])
    check(run(q, "U", s), [])


# ---- subqueries and set operators ----------------------------------------------------------
def test_subquery_over_a_relation():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(2, "S", "b", "bravo"), dele(3, "U", "a", "alpha")]}
    q = "SELECT x.n FROM (SELECT COUNT(*) AS n FROM Units) x"  # ISTREAM over x read through [NOW]
    check(run(q, "U", s), [(1, "U", 1), (3, "U", 0)])
    check(run(q, "S", s), [(1, "U", 1), (2, "S", 2), (3, "S", 1)])


def test_subquery_over_a_relation_joined_with_a_stream():
    s = {"Units": [ins(1, "U", "a", "alpha"), ins(1, "U", "a", "alpha2"), dele(3, "U", "a", "alpha")],
         "Vitals": [vit(2, "U", "a"), vit(4, "U", "a")]}
    q = ("SELECT v.sid, x.n FROM Vitals [NOW] v, (SELECT sid, COUNT(*) AS n FROM Units GROUP BY sid) x "
         "WHERE v.sid = x.sid")
    check(run(q, "U", s), [(2, "U", "a", 2), (4, "U", "a", 1)])


def test_union_with_a_relation():
    s = {"Units": [ins(1, "U", "a", "alpha"), dele(3, "U", "a", "alpha")], "Vitals": [vit(2, "U", "b")]}
    check(run("SELECT sid FROM Units UNION SELECT sid FROM Vitals [NOW]", "U", s), [(1, "U", "a"), (2, "U", "b")])
    check(run("DSTREAM(SELECT sid FROM Units UNION SELECT sid FROM Vitals [NOW])", "U", s),
          [(3, "U", "a"), (3, "U", "b")])
    check(run("RSTREAM(SELECT sid FROM Units EXCEPT SELECT sid FROM Vitals [NOW])", "U",
              {"Units": [ins(1, "U", "a", "x"), ins(1, "U", "b", "y")], "Vitals": [vit(2, "U", "b")]}),
          [(1, "U", "a"), (1, "U", "b"), (2, "U", "a")])


# ---- invalid input -----------------------------------------------------------------------------
@pytest.mark.parametrize("units", [
    [dele(1, "U", "a", "alpha")],  # nothing live
    [dele(1, "U", "a", "alpha"), ins(1, "U", "a", "alpha")],  # the insert arrives after the delete
    [ins(1, "U", "a", "alpha"), dele(2, "C", "a", "alpha")],  # another level
    [ins(1, "U", "a", "alpha"), dele(2, "U", "a", "alpha"), dele(3, "U", "a", "alpha")],  # already gone
    [ins(1, "U", "a", None), dele(2, "U", "a", "None")],  # NULL is not the string "None"
])
def test_a_delete_matching_no_live_row_is_refused(units):
    with pytest.raises(ValueError, match="relation Units: update .* matches no live row"):
        run("SELECT COUNT(*) FROM Units", "U", {"Units": units})


def test_an_invalid_delete_is_refused_whatever_the_session_sees():
    units = [ins(1, "U", "a", "alpha"), dele(9, "S", "b", "bravo")]
    with pytest.raises(ValueError, match="matches no live row"):
        run("SELECT COUNT(*) FROM Units", "U", {"Units": units})


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="not insert or delete"):
        run("SELECT COUNT(*) FROM Units", "U", {"Units": [{**ins(1, "U", "a", "alpha"), "op": "upsert"}]})
