"""Literal bounds of the front end (issue 12): window sizes, RANGE lengths in instants,
64-bit integers, finite doubles; every refusal is one LimitError line naming the clause."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.mlscql import CompiledQuery, LimitError, QueryError, compile_query, parse
from strata.mlscql.limits import LONG_MAX, LONG_MIN, MAX_NUMBER_CHARS, MAX_ROWS

MAX_TS = 2**53 - 1
DIGITS_45 = "123456789012345678901234567890123456789012345"


def refused(text, cfg, fragment, level="TS"):
    with pytest.raises(LimitError) as e:
        compile_query(text, cfg, level)
    assert fragment in e.value.message, e.value.message
    assert "\n" not in str(e.value) and str(e.value).startswith("limit error: ")
    return e.value


@pytest.mark.parametrize("text", [
    f"SELECT bp FROM Vitals [ROWS {MAX_ROWS}]",
    "SELECT bp FROM Vitals [ROWS 1]",
    f"SELECT bp FROM Vitals [PARTITION BY sid ROWS {MAX_ROWS}]",
    f"SELECT bp FROM Vitals [Partition By level in {{U}} Rows {MAX_ROWS}]",
    f"SELECT bp FROM Vitals [RANGE {MAX_TS} seconds]",
    "SELECT bp FROM Vitals [RANGE 1 ms]",  # one instant (ceil)
    "SELECT bp FROM Vitals [RANGE 0.5 seconds]",
    "SELECT bp FROM Vitals [RANGE 104249991374 days]",  # 9007199254713600 s
    f"SELECT bp FROM Vitals WHERE bp > {LONG_MAX} AND pr < {LONG_MIN}",
    f"SELECT {LONG_MAX} + 1, -{-LONG_MIN} FROM Vitals",  # bounds are on literals, not on arithmetic
    "SELECT bp FROM Vitals WHERE bp < 1.7976931348623157e308 AND bp > -1.7976931348623157e308",
    "SELECT bp FROM Vitals WHERE bp > 1e-400",  # underflows to 0.0: finite
    "SELECT bp FROM Vitals WHERE bp IN (00000000000000000000000000000000000001, 2.5)",
])
def test_values_at_the_bounds_are_accepted(battlefield, text):
    cq = compile_query(text, battlefield, "TS")
    again = compile_query(cq.rewritten, battlefield, "TS")
    assert again.query == cq.query


@pytest.mark.parametrize("text, fragment", [
    ("SELECT bp FROM Vitals [ROWS 0]", "window of Vitals: ROWS 0: a window holds 1 to 2147483647 rows"),
    (f"SELECT bp FROM Vitals [ROWS {MAX_ROWS + 1}]", f"window of Vitals: ROWS {MAX_ROWS + 1}"),
    (f"SELECT bp FROM Vitals V [PARTITION BY sid ROWS {DIGITS_45}]", "window of V: ROWS of 45 digits"),
    ("SELECT bp FROM Vitals [PARTITIONED BY level = C ROWS 0]", "window of Vitals: ROWS 0"),
    ("SELECT bp FROM Vitals [RANGE 99999999999999999999 days]", "window of Vitals: RANGE 1e+20 days is about"),
    (f"SELECT bp FROM Vitals [RANGE {MAX_TS + 1} seconds]", f"at most {MAX_TS} ([limits] max_ts)"),
    ("SELECT bp FROM Vitals [RANGE 104249991375 days]", "is about 9.01e+15 instants"),
    ("SELECT bp FROM Vitals [RANGE 1e400 days]", "is longer than any limit"),
    ("SELECT bp FROM Vitals [RANGE 1e300 ms]", "is about 1e+297 instants"),
    ("SELECT bp FROM Vitals [RANGE 0 seconds]", "RANGE 0 seconds spans no instant"),
    ("SELECT bp FROM Vitals [RANGE 0.0 minutes]", "spans no instant"),
    ("SELECT bp FROM Vitals [RANGE 1e-13 seconds]", "spans no instant"),
    (f"SELECT bp FROM Vitals WHERE bp > {LONG_MAX + 1}", "WHERE: integer literal 9223372036854775808 does not fit"),
    (f"SELECT bp FROM Vitals WHERE bp > -{-LONG_MIN + 1}", "WHERE: integer literal -9223372036854775809"),
    (f"SELECT bp FROM Vitals WHERE bp > {DIGITS_45}", "WHERE: integer literal of 45 digits"),
    (f"SELECT bp + {DIGITS_45} FROM Vitals", "SELECT: integer literal of 45 digits"),
    (f"SELECT COUNT(*) FROM Vitals GROUP BY sid HAVING COUNT(*) > {DIGITS_45}", "HAVING: integer literal of 45"),
    (f"SELECT COUNT(*) FROM Vitals GROUP BY bp > {DIGITS_45}", "GROUP BY: integer literal of 45"),
    (f"SELECT bp FROM Vitals WHERE bp IN (1, {DIGITS_45})", "WHERE: integer literal of 45"),
    (f"SELECT bp FROM Vitals WHERE bp IN {{1, {DIGITS_45}}}", "WHERE: integer literal of 45"),
    (f"SELECT bp FROM Vitals WHERE level = {DIGITS_45}", "WHERE: integer literal of 45"),
    (f"SELECT bp FROM Vitals WHERE NOT bp = - - {LONG_MAX + 1}", "WHERE: integer literal"),
    ("SELECT bp FROM Vitals WHERE bp > 1e400", "WHERE: a decimal literal is beyond the range of a double"),
    ("SELECT -1.8e308 FROM Vitals", "SELECT: a decimal literal is beyond"),
    ("SELECT bp FROM Vitals WHERE bp IN {2.5, 1e999}", "WHERE: a decimal literal"),
    ("SELECT bp FROM Vitals WHERE bp > " + "9" * 5000, "WHERE: a number written with 5000 characters"),
    ("SELECT bp FROM Vitals WHERE bp > 0." + "1" * MAX_NUMBER_CHARS, "WHERE: a number written with 102 characters"),
    ("SELECT bp FROM Vitals [ROWS " + "1" * 5000 + "]", "window of Vitals: a number written with 5000"),
    ("SELECT bp FROM Vitals [RANGE " + "1" * 5000 + " days]", "window of Vitals: a number written with"),
    ("SELECT bp FROM Vitals [ROWS 3 level = " + "1" * 5000 + "]", "window of Vitals: a number written with"),
    ("SELECT " + "7" * 4400 + " FROM Vitals", "SELECT: a number written with 4400 characters"),
    ("SELECT COUNT(*) FROM Vitals GROUP BY sid HAVING COUNT(*) > " + "1" * 9999, "HAVING: a number written"),
])
def test_literals_beyond_a_limit_are_refused(battlefield, text, fragment):
    refused(text, battlefield, fragment)


def test_the_first_clause_in_text_order_is_named(battlefield):
    refused(f"SELECT {DIGITS_45} FROM Vitals [ROWS 0] WHERE bp > 1e400", battlefield, "SELECT:")
    refused(f"SELECT bp FROM Vitals [ROWS 0] WHERE bp > {DIGITS_45}", battlefield, "window of Vitals")
    # limits come before every other check: an unknown stream with an absurd window is a limit error
    refused("SELECT bp FROM Nope [ROWS 0]", battlefield, "window of Nope")


def test_limits_come_from_the_configuration():
    cfg = parse_config(BATTLEFIELD_TOML + "\n[limits]\nmax_ts = 100\n")
    assert compile_query("SELECT bp FROM Vitals [RANGE 100 seconds]", cfg, "S")
    refused("SELECT bp FROM Vitals [RANGE 101 seconds]", cfg, "at most 100 ([limits] max_ts)")
    refused("SELECT bp FROM Vitals [RANGE 2 minutes]", cfg, "RANGE 2 minutes is about 120 instants")
    half = parse_config(BATTLEFIELD_TOML.replace("[streams.Vitals]", "[time]\ninstant_seconds = 0.5\n\n[streams.Vitals]")
                        + "\n[limits]\nmax_ts = 100\n")
    assert compile_query("SELECT bp FROM Vitals [RANGE 50 seconds]", half, "S").query.from_[0].window.range_amount == 50
    refused("SELECT bp FROM Vitals [RANGE 51 seconds]", half, "is about 102 instants")


def test_parse_alone_refuses_only_absurd_digit_strings():
    assert parse("SELECT bp FROM Vitals [ROWS 0]").from_[0].window.rows == 0  # bounded by the analyzer
    with pytest.raises(LimitError, match="WHERE: a number written with 101 characters"):
        parse("SELECT bp FROM Vitals WHERE bp = " + "1" * 101)


# ---- fuzz: random huge numbers in every literal position --------------------------------
POSITIONS = [
    ("rows", "SELECT bp FROM Vitals [ROWS {n}]"),
    ("rows", "SELECT bp FROM Vitals [PARTITION BY sid ROWS {n}]"),
    ("rows", "SELECT bp FROM Vitals [Partition By level in {{U, C}} Rows {n}]"),
    ("range 86400", "SELECT bp FROM Vitals [RANGE {n} days]"),
    ("range 0.001", "SELECT bp FROM Vitals [RANGE {n} ms level = C]"),
    ("range 1", "SELECT bp FROM Vitals [RANGE {n}]"),
    ("value", "SELECT bp FROM Vitals WHERE bp > {n}"),
    ("value", "SELECT bp FROM Vitals WHERE bp > -{n}"),
    ("value", "SELECT bp * {n} AS x FROM Vitals"),
    ("value", "SELECT sid, COUNT(*) FROM Vitals GROUP BY sid HAVING MAX(bp) < {n}"),
    ("value", "SELECT COUNT(*) FROM Vitals GROUP BY bp + {n}"),
    ("value", "SELECT bp FROM Vitals WHERE bp IN (1, {n})"),
    ("value", "SELECT bp FROM Vitals WHERE bp NOT IN {{{n}}}"),
    ("level", "SELECT bp FROM Vitals WHERE level = {n}"),
    ("level", "SELECT bp FROM Vitals WHERE level in {{U, {n}}}"),
    ("window level", "SELECT bp FROM Vitals [ROWS 3 level = {n}]"),  # a level name there, not a number
]

numbers = st.one_of(
    st.integers(0, 10**60).map(str),
    st.integers(0, 2**64).map(str),
    st.sampled_from([str(LONG_MAX), str(LONG_MAX + 1), str(MAX_ROWS), str(MAX_ROWS + 1), str(MAX_TS),
                     str(MAX_TS + 1), "0", "00", "1e308", "1.8e308", "1e400", "1e-400", ".5", "0.0"]),
    st.builds(lambda m, e: f"{m}e{e}", st.integers(1, 99), st.integers(0, 2000)),
    st.builds(lambda a, b: f"{a}.{b}", st.integers(0, 10**40), st.integers(0, 10**40)),
    st.integers(1, 6000).map(lambda k: "9" * k),
)


def _expected_limit(kind: str, text: str, negated: bool) -> bool | None:
    """True: a LimitError is certain; False: the number is within every limit; None: not decided here."""
    if len(text) > MAX_NUMBER_CHARS:
        return True
    is_int = text.isdigit()
    value = int(text) if is_int else float(text)
    if kind == "rows":
        return not (is_int and 1 <= value <= MAX_ROWS) if is_int else None  # a decimal is a parse error
    if kind == "window level":
        return False
    if kind.startswith("range"):
        span = float(value) * float(kind.split()[1])  # instants (one instant is one second)
        if span > MAX_TS:  # also inf
            return True
        return False if span >= 1e-6 else None  # a tiny span rounds to no instant: the tests above
    if is_int:
        return not (LONG_MIN <= (-value if negated else value) <= LONG_MAX)
    return value == float("inf")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.sampled_from(POSITIONS), n=numbers)
def test_fuzz_huge_numbers_raise_only_query_errors(battlefield, pos, n):
    kind, template = pos
    text = template.format(n=n)
    try:
        cq = compile_query(text, battlefield, "TS")
    except LimitError:
        assert _expected_limit(kind, n, "-{n}" in template) is not False, text[:200]
        return
    except QueryError as e:
        assert "\n" not in str(e)
        assert not _expected_limit(kind, n, "-{n}" in template), text[:200]
        return
    assert isinstance(cq, CompiledQuery)
    assert not _expected_limit(kind, n, "-{n}" in template), text[:200]
    again = compile_query(cq.rewritten, battlefield, "TS")  # what is accepted prints and re-parses to itself
    assert again.query == cq.query
