"""One authorization rule (issue 12): every level a query names, in any clause and any
spelling, must be dominated by the session level; the refusal names the clause only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.mlscql import AuthorizationError, QueryError, compile_query, may_read, parse
from strata.mlscql.authorize import levels_named

# {X}: the level named; {S}: the stream; {a}: one of its numeric attributes
SPELLINGS = [
    ("window clause of {S}", "SELECT {a} FROM {S} [ROWS 5 level in {{{X}}}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [ROWS 5 level = {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [ROWS 5 level DOMINATED BY {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [ROWS 5 WHERE level in {{{X}}}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [ROWS 5 WHERE level = {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [Rows 5 Where Level Dominated By {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [RANGE 3 seconds level = {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [RANGE UNBOUNDED level in {{{X}}}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [NOW WHERE level DOMINATED BY {X}]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [PARTITION BY level in {{{X}}} ROWS 3]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [PARTITIONED BY level = {X} ROWS 3]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [PARTITION BY level DOMINATED BY {X} ROWS 3]"),
    ("window clause of {S}", "SELECT {a} FROM {S} [PARTITION BY level ROWS 3 level = {X}]"),
    ("window clause of W", "SELECT W.{a} FROM {S} AS W [ROWS 5 level = {X}]"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level = {X}"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE {X} = level"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level != {X}"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level = '{X}'"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level in {{{X}}}"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level NOT IN {{{X}}}"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level IN ('{X}')"),
    ("WHERE condition", "SELECT {a} FROM {S} WHERE level DOMINATED BY {X}"),
    ("WHERE condition", "SELECT {a} FROM {S} [ROWS 5] WHERE NOT level DOMINATED BY {X}"),
    ("WHERE condition", "SELECT {a} FROM {S} [ROWS 5] WHERE {a} > 1 OR level DOMINATED BY {X}"),
    ("SELECT condition", "SELECT level = {X} AS hi FROM {S}"),
    ("SELECT condition", "SELECT level DOMINATED BY {X} AS hi FROM {S}"),
    ("GROUP BY condition", "SELECT COUNT(*) FROM {S} GROUP BY level DOMINATED BY {X}"),
    ("GROUP BY condition", "SELECT COUNT(*) FROM {S} GROUP BY level in {{{X}}}"),
    ("HAVING condition", "SELECT level, COUNT(*) FROM {S} GROUP BY level HAVING level = {X}"),
    ("HAVING condition", "SELECT level, COUNT(*) FROM {S} GROUP BY level HAVING level DOMINATED BY {X}"),
]

BATTLE = {"S": "Vitals", "a": "bp"}
AUDIT = {"S": "MessageLog", "a": "timestamp"}


def _query(template: str, names: dict, level_text: str) -> str:
    return template.format(X=level_text, **names)


def _refused(cfg, names, clause, template, level_text, session, named):
    with pytest.raises(AuthorizationError) as e:
        compile_query(_query(template, names, level_text), cfg, session)
    assert e.value.message == (
        f"{clause.format(**names)} names level {named}, which the query level {session} does not dominate"
    )


# ---- total order ---------------------------------------------------------------------------
@pytest.mark.parametrize("clause, template", SPELLINGS)
def test_every_spelling_at_S_refuses_TS(battlefield, clause, template):
    _refused(battlefield, BATTLE, clause, template, "TS", "S", "TS")


@pytest.mark.parametrize("clause, template", SPELLINGS)
def test_every_spelling_at_S_accepts_C(battlefield, clause, template):
    cq = compile_query(_query(template, BATTLE, "C"), battlefield, "S")
    assert all(lv in ("U", "C", "S") for f in cq.query.from_ for lv in f.window.levels)


def test_same_message_whatever_the_data_or_spelling(battlefield):
    """The refusal depends on the clause and the level only: no data exists at compile time,
    and WHERE `=`, `IN` and `DOMINATED BY` are refused alike."""
    msgs = set()
    for text in ("SELECT bp FROM Vitals WHERE level = TS", "SELECT bp FROM Vitals WHERE level in {TS}",
                 "SELECT bp FROM Vitals WHERE level DOMINATED BY TS", "SELECT bp FROM Vitals WHERE level = 'TS'"):
        with pytest.raises(AuthorizationError) as e:
            compile_query(text, battlefield, "S")
        msgs.add(str(e.value))
    assert msgs == {"authorization error: WHERE condition names level TS, which the query level S does not dominate"}


# ---- Chinese Wall: above and incomparable are refused ----------------------------------------
@pytest.mark.parametrize("clause, template", SPELLINGS)
@pytest.mark.parametrize("named, text", [
    ("[T,T]", "[T,T]"),      # above
    ("[1,A]", "[1,A]"),      # incomparable: a competitor of B
    ("[2,⊥]", "[2, bot]"),   # incomparable: a competitor of 1, spelled with an alias
    ("[⊥,T]", "[0,T]"),      # incomparable
])
def test_chinese_wall_refuses_levels_not_dominated(chinese_wall, clause, template, named, text):
    _refused(chinese_wall, AUDIT, clause, template, text, "[1,B]", named)


@pytest.mark.parametrize("clause, template", SPELLINGS)
@pytest.mark.parametrize("text", ["[1,⊥]", "[0,B]", "[1,B]"])
def test_chinese_wall_accepts_dominated_levels(chinese_wall, clause, template, text):
    assert compile_query(_query(template, AUDIT, text), chinese_wall, "[1,B]")


# ---- the rule itself ------------------------------------------------------------------------------
def test_may_read(battlefield, chinese_wall):
    lat = battlefield.lattice
    assert may_read(lat, "S", "C") and may_read(lat, "S", "S") and not may_read(lat, "S", "TS")
    assert not may_read(lat, None, "U")  # no clearance: reads nothing
    assert not may_read(lat, "S", None)
    assert not may_read(lat, "Secret", "U") and not may_read(lat, "S", "Secret")
    cw = chinese_wall.lattice
    assert may_read(cw, "[1,B]", "[⊥,B]") and not may_read(cw, "[1,B]", "[1,A]")
    assert not may_read(cw, "[1,B]", "[⊥]")  # malformed: not a level of this lattice
    assert not may_read(cw, "[1,B]", "[0,B]")  # not canonical: parse it first
    assert not may_read(cw, None, cw.bottom)


def test_levels_named_sees_every_clause(battlefield):
    from strata.mlscql import analyze

    q = analyze(parse("SELECT level = C AS x, COUNT(*) FROM Vitals [ROWS 3 level DOMINATED BY S] "
                      "WHERE level DOMINATED BY C GROUP BY level = C, level HAVING level in {U}"), battlefield, "TS")
    # after rewriting, the window clause is the explicit set dominated(S)
    assert list(levels_named(q.query)) == [
        ("window clause of Vitals", "U"), ("window clause of Vitals", "C"), ("window clause of Vitals", "S"),
        ("SELECT condition", "C"), ("WHERE condition", "C"), ("GROUP BY condition", "C"),
        ("HAVING condition", "U"),
    ]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_accepted_iff_the_session_level_dominates_what_is_named(data, battlefield, chinese_wall):
    cfg, names = data.draw(st.sampled_from([(battlefield, BATTLE), (chinese_wall, AUDIT)]))
    lat = cfg.lattice
    session = data.draw(st.sampled_from(lat.levels))
    named = data.draw(st.sampled_from(lat.levels))
    clause, template = data.draw(st.sampled_from(SPELLINGS))
    text = _query(template, names, named)
    try:
        compile_query(text, cfg, session)
        refused = False
    except AuthorizationError as e:
        assert e.message.startswith(clause.format(**names))
        refused = True
    except QueryError:  # e.g. "never output": authorized, then optimized away
        refused = False
    assert refused == (not lat.leq(named, session))
