"""Security punctuations and privacy switches do not change what distribution computes
(docs/semantics.md §11-12): random punctuation streams, random queries and random revoke/re-grant
schedules through the real master pipeline (shepherd, chunker with its shields, legacy windows) on
1-3 Spark workers with sharing on or off, cut all at once or incrementally, equal the reference
(tests/reference/access.py: each query's input filtered tuple by tuple, the existing evaluator, then
the terminal switch).  A query without a switch is compared with its plain reference too: another
query's switch never changes it, shared operators or not."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata import punctuations

from .distributed import executors_of, run_distributed
from .reference.access import evaluate_access, shield_streams
from .reference.evaluator import compare_results
from .strategies import example_settings, multistream, queries
from .tables import inputs_of
from .test_punctuations import sp_table

pytestmark = pytest.mark.spark

EXAMPLES, SETTINGS = example_settings("STRATA_ACCESS_EXAMPLES", 6)
USERS = ("jane", "bob")


@st.composite
def sps(draw, config, top_ts: int = 12) -> list[dict]:
    """A random punctuation stream over ``config``'s streams: few instants, patterns on each part."""
    out = []
    ts = 0
    for _ in range(draw(st.integers(0, 4), label="policies")):
        ts += draw(st.sampled_from((0, 1, 2, 3)))
        if ts > top_ts:
            break
        for _ in range(draw(st.integers(1, 3))):
            stream = draw(st.sampled_from(["*", *config.streams]))
            names = sorted({c for s in config.streams.values() for c, _ in s.columns} if stream == "*"
                           else [c for c, _ in config.streams[stream].columns])
            attr = draw(st.sampled_from(["sid", *names]))
            typ = next((t for s in config.streams.values() for c, t in s.columns if c == attr), "string")
            if attr not in names or typ not in ("string", "double"):
                tuples = "*"
            elif typ == "string":
                tuples = draw(st.sampled_from(["*", f"{attr}=a", f"{attr}=a|b", f"{attr}=c"]))
            else:
                tuples = draw(st.sampled_from(["*", f"{attr}=100..120", f"{attr}=0..110.5", f"{attr}=125.25"]))
            attrs = draw(st.sampled_from(["*", "*", "|".join(draw(st.lists(st.sampled_from(names), min_size=1,
                                                                              max_size=2, unique=True)))]))
            who = draw(st.sampled_from([("", "analyst"), ("jane", ""), ("bob", ""), ("", "producer"),
                                        ("jane|bob", "")]))
            out.append({"ts": ts, "level": draw(st.sampled_from(config.lattice.levels)), "stream": stream,
                        "tuples": tuples, "attributes": attrs, "users": who[0], "roles": who[1],
                        "sign": draw(st.sampled_from("++-")), "immutable": None})
    return out


def _check(config, engines, data, n_queries: int):
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    texts = [data.draw(queries(config, level), label=f"query{i}") for i in range(n_queries)]
    streams = data.draw(multistream(config), label="streams")
    policy = data.draw(sps(config), label="punctuations")
    user = data.draw(st.sampled_from(USERS), label="user")
    roles = data.draw(st.sampled_from([frozenset({"analyst"}), frozenset({"analyst", "producer"})]), label="roles")
    switches = []
    for i in range(n_queries):
        for s in config.streams:
            if data.draw(st.booleans(), label=f"switch q{i + 1} {s}"):
                a = data.draw(st.integers(0, 10), label="off from")
                b = data.draw(st.one_of(st.none(), st.integers(a + 1, 14)), label="on again")
                switches.append((i, s, a, b))
    inputs = inputs_of(config, streams)
    if policy:
        inputs[punctuations.STREAM] = sp_table(policy)
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    n = data.draw(st.integers(1, 3), label="workers")
    sharing = data.draw(st.booleans(), label="sharing")
    incremental = data.draw(st.booleans(), label="incremental")
    prune = data.draw(st.booleans(), label="prune ROWS windows as on the wire")
    out = run_distributed(config, level, texts, inputs, executors_of(engines, config, n, sharing), chunk_instants=k,
                          rnd=random.Random(data.draw(st.integers(0, 2**32), label="seed")), incremental=incremental,
                          prune=prune, principal=(user, roles), switches=tuple(switches))
    event("punctuations" if policy else "no punctuations")
    event("switched" if switches else "no switch")
    for i, text in enumerate(texts):
        mine = [(s, a, b) for j, s, a, b in switches if j == i]
        canon = [dict(x, level=config.lattice.parse(x["level"])) for x in policy]
        hidden = sum(map(len, streams.values())) - sum(map(len, shield_streams(
            config, text, {s: [dict(r, level=config.lattice.parse(r["level"])) for r in rows]
                           for s, rows in streams.items()}, canon, (user, set(roles))).values()))
        event("policies hide tuples" if hidden else "policies hide nothing")
        expected = evaluate_access(text, config, level, streams, policy, (user, set(roles)), mine)
        actual = out[f"q{i + 1}"]
        assert actual.error_ts == expected.error_ts, (text, actual.error, expected.error)
        compare_results(actual.rows, expected.rows)


@SETTINGS
@given(data=st.data())
def test_policies_and_switches_equal_reference(battlefield, engines, data):
    _check(battlefield, engines, data, n_queries=data.draw(st.integers(1, 2), label="n_queries"))


@pytest.mark.slow
@settings(SETTINGS, max_examples=max(10, EXAMPLES * 4))
@given(data=st.data())
def test_policies_and_switches_equal_reference_more(battlefield, engines, data):
    _check(battlefield, engines, data, n_queries=data.draw(st.integers(1, 3), label="n_queries"))
