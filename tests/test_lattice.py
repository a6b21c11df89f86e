"""Lattice laws (property tests) and the papers' facts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.lattice import BOTTOM_ALIASES, TOP_ALIASES, Categories, ChineseWall, LevelError, TotalOrder


# ---- strategies ------------------------------------------------------------------
@st.composite
def total_orders(draw):
    n = draw(st.integers(1, 8))
    names = draw(st.lists(st.from_regex(r"[A-Z][A-Za-z0-9]{0,3}", fullmatch=True), min_size=n, max_size=n, unique=True))
    return TotalOrder(names)


@st.composite
def chinese_walls(draw):
    k = draw(st.integers(1, 3))
    classes = []
    for i in range(k):
        m = draw(st.integers(1, 3))
        classes.append([f"c{i}{j}" for j in range(m)])
    return ChineseWall(classes)


@st.composite
def category_lattices(draw):
    n = draw(st.integers(1, 4))
    m = draw(st.integers(0, 4))
    return Categories([f"K{i}" for i in range(n)], [f"cat{j}" for j in range(m)])


lattices = st.one_of(total_orders(), chinese_walls(), category_lattices())


@st.composite
def lattice_and_levels(draw, n=3):
    lat = draw(lattices)
    levels = [draw(st.sampled_from(lat.levels)) for _ in range(n)]
    return lat, levels


# ---- laws -------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(lattice_and_levels())
def test_partial_order_laws(data):
    lat, (a, b, c) = data
    assert lat.leq(a, a)  # reflexive
    if lat.leq(a, b) and lat.leq(b, a):
        assert a == b  # antisymmetric
    if lat.leq(a, b) and lat.leq(b, c):
        assert lat.leq(a, c)  # transitive
    assert lat.leq(lat.bottom, a) and lat.leq(a, lat.top)


@settings(max_examples=200, deadline=None)
@given(lattice_and_levels())
def test_lub_is_least_upper_bound(data):
    lat, (a, b, _) = data
    j = lat.lub(a, b)
    assert lat.leq(a, j) and lat.leq(b, j)
    for u in lat.levels:  # least: below every upper bound
        if lat.leq(a, u) and lat.leq(b, u):
            assert lat.leq(j, u)
    assert lat.lub(a, b) == lat.lub(b, a)
    assert lat.lub(a, lat.bottom) == a
    assert lat.lub_all([]) == lat.bottom


@settings(max_examples=200, deadline=None)
@given(lattice_and_levels(n=4))
def test_mask_or_decodes_to_lub(data):
    lat, levels = data
    for r in range(len(levels) + 1):
        for combo in itertools.combinations(levels, r):
            mask = 0
            for lv in combo:
                mask |= lat.encode(lv)
            assert lat.decode(mask) == lat.lub_all(combo)


@settings(max_examples=100, deadline=None)
@given(lattices)
def test_dominated_and_linear_extension(lat):
    order = {lv: i for i, lv in enumerate(lat.levels)}
    assert len(order) == len(lat.levels)
    for a in lat.levels:
        dom = lat.dominated(a)
        assert a in dom  # ≤, not <: a user reads its own level (SEMANTICS §2)
        for b in dom:
            assert order[b] <= order[a]
        assert lat.parse(a) == a  # printing/parsing round trip


# ---- the papers' facts -------------------------------------------------------------
def test_total_order_battlefield():
    lat = TotalOrder(["U", "C", "S", "TS"])
    assert lat.leq("U", "TS") and not lat.leq("TS", "S")
    assert lat.lub("C", "S") == "S"
    assert lat.dominated("S") == {"U", "C", "S"}
    assert lat.bottom == "U" and lat.top == "TS"
    with pytest.raises(LevelError):
        lat.parse("X")


def test_chinese_wall_paper_section3():
    lat = ChineseWall([["1", "2", "3", "4", "5"], ["1", "2", "3"], ["1", "2"]])
    a, b, c = lat.parse("[5,⊥,⊥]"), lat.parse("[5,0,2]"), lat.parse("[5, ⊥, T]")
    assert lat.leq(a, b) and lat.leq(b, c) and lat.leq(a, c)
    d = lat.parse("[⊥,⊥,2]")
    assert not lat.leq(a, d) and not lat.leq(d, a)  # incomparable
    assert lat.bottom == "[⊥,⊥,⊥]" and lat.top == "[T,T,T]"


def test_chinese_wall_audit_lattice():
    lat = ChineseWall([["1", "2"], ["A", "B", "C"]])
    assert lat.lub_all(["[⊥,A]", "[⊥,B]", "[⊥,C]"]) == "[⊥,T]"
    assert lat.lub("[1,⊥]", "[⊥,B]") == "[1,B]"
    assert lat.lub("[1,⊥]", "[2,⊥]") == "[T,⊥]"
    assert lat.parse("[0,B]") == "[⊥,B]"
    assert len(lat.levels) == 4 * 5
    assert lat.dominated("[1,B]") == {"[⊥,⊥]", "[1,⊥]", "[⊥,B]", "[1,B]"}
    for bad in ("[3,A]", "[1]", "1,A", "[1,B,C]"):
        with pytest.raises(LevelError):
            lat.parse(bad)


def test_single_company_coi_keeps_T_distinct():
    lat = ChineseWall([["X"], ["A", "B"]])
    assert lat.decode(lat.encode("[X,⊥]")) == "[X,⊥]"
    assert lat.decode(lat.encode("[T,⊥]")) == "[T,⊥]"
    assert lat.lub("[X,⊥]", "[T,⊥]") == "[T,⊥]"


@pytest.mark.parametrize("bad", [[], ["A", "A"], ["a b"]])
def test_total_order_rejects_bad_levels(bad):
    with pytest.raises(ValueError):
        TotalOrder(bad)


@pytest.mark.parametrize("bad", [[], [[]], [["A", "A"]], [["T"]], [["0"]]])
def test_chinese_wall_rejects_bad_classes(bad):
    with pytest.raises(ValueError):
        ChineseWall(bad)


# ---- reserved company names (issue 12: a company named `bot` parsed as ⊥) -------------------------
RESERVED = sorted({v for a in BOTTOM_ALIASES + TOP_ALIASES for v in (a, a.upper(), a.lower(), a.capitalize())})


@pytest.mark.parametrize("name", RESERVED + ["Bot", "bOt", "t"])
def test_chinese_wall_refuses_reserved_company_names(name):
    with pytest.raises(ValueError, match="reserved"):
        ChineseWall([["1", "2"], ["A", name]])


@pytest.mark.parametrize("name", ["bot", "BOT", "T", "t", "0", "_|_", "⊥", "⊤"])
def test_config_load_refuses_reserved_company_names(name):
    from strata.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(f'[lattice]\ncoi = [["1", "2"], ["A", "{name}"]]\n')
    assert ":2: [lattice] coi: company name" in str(e.value) and "reserved" in str(e.value)


def test_every_bottom_and_top_alias_is_reserved():
    """Whatever ``parse`` maps to ⊥ or T can never also be a company (the two rules share one list)."""
    lat = ChineseWall([["A", "B"]])
    for alias in BOTTOM_ALIASES:
        assert lat.parse(f"[{alias}]") == lat.bottom
    for alias in TOP_ALIASES:
        assert lat.parse(f"[{alias}]") == lat.top


@given(st.from_regex(r"[A-Za-z0-9_-]{1,6}", fullmatch=True))
def test_an_accepted_company_is_never_bottom_or_top(name):
    try:
        lat = ChineseWall([[name]])
    except ValueError:
        return
    level = lat.parse(f"[{name}]")
    assert level == f"[{name}]" and level not in (lat.bottom, lat.top)
    assert not lat.leq(f"[{name}]", lat.bottom) and not lat.leq(lat.top, f"[{name}]")


def test_no_level_dominates_nothing():
    for lat in (TotalOrder(["U", "S"]), ChineseWall([["A", "B"]])):
        for lv in lat.levels:
            assert not lat.leq(lv, None) and not lat.leq(None, lv)


# ---- classifications with categories (issue 16) ----------------------------------------------
MILITARY = Categories(["U", "C", "S", "TS"], ["NATO", "CRYPTO"])


def test_categories_dominance_is_classification_and_inclusion():
    L = MILITARY
    s_nato, ts_crypto = L.parse("(S, {NATO})"), L.parse("(TS,{CRYPTO})")
    assert (s_nato, ts_crypto) == ("(S,{NATO})", "(TS,{CRYPTO})")
    assert not L.leq(s_nato, ts_crypto) and not L.leq(ts_crypto, s_nato)  # incomparable
    assert L.lub(s_nato, ts_crypto) == "(TS,{NATO,CRYPTO})" == L.top
    assert L.leq(L.parse("C"), s_nato) and L.parse("C") == "(C,{})" and L.bottom == "(U,{})"
    assert L.leq(L.parse("(U,{NATO})"), s_nato) and not L.leq(L.parse("(U,{CRYPTO})"), s_nato)
    assert L.parse("( TS , { CRYPTO , NATO } )") == "(TS,{NATO,CRYPTO})"  # declared order
    assert len(L.levels) == 4 * 4 and L.dominated(s_nato) == {"(U,{})", "(U,{NATO})", "(C,{})", "(C,{NATO})",
                                                               "(S,{})", "(S,{NATO})"}


@settings(max_examples=200, deadline=None)
@given(category_lattices(), st.data())
def test_categories_print_parse_round_trip(lat, data):
    lv = data.draw(st.sampled_from(lat.levels))
    cls, cats = lat.split(lv)
    spaced = f"( {cls} , {{ {' , '.join(reversed(sorted(cats)))} }} )"
    assert lat.parse(lv) == lv == lat.parse(spaced)
    assert lat.decode(lat.encode(lv)) == lv
    if not cats:
        assert lat.parse(cls) == lv


@pytest.mark.parametrize("bad,why", [("(S,{ARMY})", "unknown category 'ARMY'"), ("(X,{})", "unknown classification"),
                                     ("(S,NATO)", "not written like"), ("ARMY", "unknown classification")])
def test_categories_refuse_unknown_parts(bad, why):
    with pytest.raises(LevelError, match=why):
        MILITARY.parse(bad)


@pytest.mark.parametrize("cls,cats", [([], ["A"]), (["U"], ["A", "A"]), (["U"], ["U"]), (["U"], ["a b"]),
                                      (["U"], [f"c{i}" for i in range(11)])])
def test_categories_reject_bad_definitions(cls, cats):
    with pytest.raises(ValueError):
        Categories(cls, cats)


def test_config_with_classifications_and_categories():
    from strata.config import ConfigError, parse_config

    cfg = parse_config('[lattice]\nclassifications = ["U", "S"]\ncategories = ["NATO"]\n[streams.V]\nbp = "double"\n')
    assert isinstance(cfg.lattice, Categories) and cfg.lattice.top == "(S,{NATO})"
    for text, why in (('categories = ["NATO"]', "categories need 'classifications'"),
                      ('classifications = ["U"]\nlevels = ["U"]', "exactly one of"),
                      ('classifications = ["U"]\ncategories = "NATO"', "list of category names")):
        with pytest.raises(ConfigError, match=why):
            parse_config(f"[lattice]\n{text}\n[streams.V]\nbp = \"double\"\n")
