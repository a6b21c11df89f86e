"""Workloads of the dissertation's experiments (ch. 9), as Arrow tables in memory.

Facts copied from the dissertation (Xie, *Multilevel Secure Data Stream
Management System*; nothing here reads the paper at run time):

§9.2 / §9.3.2 (battlefield, replicated MLS-DSMS overhead, Table 9.7)
    Vitals(sid, bp, pr, weight, level), Positions(sid, lat, lon, level);
    levels U < C < S < TS, "the number of tuples in each level is 1/4 of total
    tuples"; input files of 500 k, 1 M, 2 M, 4 M tuples; input rates 10,000 -
    100,000 tuples/s (Table 9.7 used 20,000 tuples/s); queries: one simple
    select, one average with group by, one join, run "in highest level" in
    vanilla STREAM and in the MLS-DSMS; reported MLS overhead 0.003 % - 0.134 %
    (Exp 1-3) and 0.54 % - 0.88 % (Exp 4, six queries).  Five runs, first two
    discarded, mean of the last three.

§9.5 (CW-DSMS, Table 9.16): MessageLog, Chinese Wall lattice with COI {1,2}
    and {A,B,C}; 2 M, 5 M, 10 M tuples at 50,000 tuples/s (Exp 6: 100 K - 500 K
    at 2,500 tuples/s); overhead 0.002 % - 0.030 % (Exp 1-5), 0.081 % - 0.218 %
    (Exp 6).  Experiments (query level; input levels; selectivity):

    1. ``SELECT timestamp FROM MessageLog WHERE msgType = "send" AND outcome =
       "success" AND receiver = "CompanyB"`` at [1,⊥]; all tuples [1,⊥]; 100 %.
    2. same with ``outcome = "failure"``; all tuples [1,⊥]; 50 %.
    3. exp 2's query at [⊥,B]; 5 levels [1,⊥] [2,⊥] [⊥,A] [⊥,B] [⊥,C], 20 %
       each (so 20 % visible); vanilla adds ``AND level = [0,B]``.
    4. ``... AND (receiver = "CompanyB" OR receiver = "CompanyA" OR receiver =
       "CompanyC")`` at [⊥,T]; same input (60 % visible); vanilla adds the three
       levels as a condition.
    5. ``SELECT MIN(timestamp), MAX(timestamp) FROM MessageLog [ROWS 100] WHERE
       outcome = "success" AND serviceId = "5"`` at [1,B]; inputs at [1,⊥] or
       [⊥,B] (LUB computation); 100 %.
    6. ``SELECT R.timestamp - S.timestamp AS delay FROM MessageLog R [Rows 100],
       MessageLog S [Rows 100] WHERE S.msgType = "send" AND S.outcome =
       "success" AND R.msgType = "receive" AND R.outcome = "success" AND
       R.receiver = "Company1" AND R.sender = "CompanyB" AND S.receiver =
       "CompanyB" AND S.sender = "Company1" AND S.serviceId = R.serviceId`` at
       [1,B]; inputs [1,⊥] or [⊥,B] in random order; 50 % selectivity per side.

"Vanilla" here (see docs/benchmarks/README.md) is the same pipeline with a
one-level lattice: every tuple carries that level, the query runs at it, the
shepherd keeps everything and the rewriting only adds the trivial level set.
For Chinese Wall experiments 3 and 4 the vanilla stream keeps the original
label in an ordinary attribute ``lbl`` and the query filters on it, as the
dissertation's vanilla queries do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML

BF_LEVELS = ["U", "C", "S", "TS"]
SIDS = 200

#: vanilla battlefield: the same streams under a one-level lattice (no labels to speak of)
VANILLA_BF_TOML = BATTLEFIELD_TOML.replace('levels = ["U", "C", "S", "TS"]', 'levels = ["P"]')
assert VANILLA_BF_TOML != BATTLEFIELD_TOML

VANILLA_CW_TOML = """\
# vanilla cloud audit: one level; the original COI label is an ordinary attribute
[lattice]
levels = ["P"]

[streams.MessageLog]
serviceId = "string"
msgType = "string"
sender = "string"
receiver = "string"
timestamp = "long"
outcome = "string"
lbl = "string"
"""

#: battlefield queries (§9.3.2 Exp 1-3 kinds, ROWS 100 windows) and the target query
BF_QUERIES = {
    "select": "SELECT sid, bp FROM Vitals [ROWS 100] WHERE bp > 120",
    "group-avg": "SELECT sid, AVG(bp) FROM Vitals [ROWS 100] GROUP BY sid",
    "avg": "SELECT AVG(bp) FROM Vitals [ROWS 100]",
    "join": "SELECT v.sid, v.bp, p.lat FROM Vitals [ROWS 100] v, Positions [ROWS 100] p WHERE v.sid = p.sid",
}
#: streams each battlefield query reads
BF_STREAMS = {"select": ["Vitals"], "group-avg": ["Vitals"], "avg": ["Vitals"], "join": ["Vitals", "Positions"]}


@dataclass
class Workload:
    """One experiment: configs, query texts and data for the MLS and the vanilla run."""

    name: str
    config: str
    level: str
    query: str
    data: dict[str, pa.Table]  # stream -> labelled table (ts, level, attributes), arrival order
    vanilla_config: str
    vanilla_level: str
    vanilla_query: str
    vanilla_data: dict[str, pa.Table]
    per_instant: int
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tuples(self) -> int:
        return sum(t.num_rows for t in self.data.values())


def _levels_quarter(n: int, rng) -> np.ndarray:
    lv = np.array(BF_LEVELS)[np.arange(n) % 4]
    rng.shuffle(lv)
    return lv


def vitals(n: int, per_instant: int, seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = np.arange(n, dtype=np.int64) // per_instant
    return pa.table({
        "ts": ts,
        "level": pa.array(_levels_quarter(n, rng)),
        "sid": pa.array(np.char.add("s", rng.integers(0, SIDS, n).astype(str))),
        "bp": rng.normal(120, 15, n).round(3),
        "pr": rng.normal(70, 10, n).round(3),
        "weight": rng.normal(80, 10, n).round(3),
    })


def positions(n: int, per_instant: int, seed: int = 2) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = np.arange(n, dtype=np.int64) // per_instant
    return pa.table({
        "ts": ts,
        "level": pa.array(_levels_quarter(n, rng)),
        "sid": pa.array(np.char.add("s", rng.integers(0, SIDS, n).astype(str))),
        "lat": rng.uniform(-90, 90, n).round(4),
        "lon": pa.array(np.where(rng.random(n) < 0.5, "E", "W")),
    })


def relabel(t: pa.Table, level: str, keep_as: str | None = None) -> pa.Table:
    """``t`` with every tuple at ``level`` (optionally the old label kept in column ``keep_as``)."""
    i = t.column_names.index("level")
    out = t.set_column(i, "level", pa.array([level] * t.num_rows, pa.string()))
    if keep_as:
        out = out.append_column(keep_as, t.column("level"))
    return out


def battlefield(query: str, tuples: int, per_instant: int, seed: int = 1) -> Workload:
    """``tuples`` per stream the query reads (the join reads both streams)."""
    data = {}
    for s in BF_STREAMS[query]:
        data[s] = vitals(tuples, per_instant, seed) if s == "Vitals" else positions(tuples, per_instant, seed + 1)
    return Workload(
        name=query, config=BATTLEFIELD_TOML, level="TS", query=BF_QUERIES[query], data=data,
        vanilla_config=VANILLA_BF_TOML, vanilla_level="P", vanilla_query=BF_QUERIES[query],
        vanilla_data={s: relabel(t, "P") for s, t in data.items()}, per_instant=per_instant,
    )


#: dissertation Table 9.7 (§9.3.2): Exp 1-3 one select / AVG GROUP BY / join at the highest level,
#: Exp 4 six queries (two copies of each); reported overhead (%) per data size
TABLE_9_7 = {
    "exp1": (["select"], {"1M": 0.010, "2M": 0.011, "4M": 0.005}),
    "exp2": (["group-avg"], {"1M": 0.011, "2M": 0.009, "4M": 0.003}),
    "exp3": (["join"], {"1M": 0.134, "2M": 0.093, "4M": 0.049}),
    "exp4": (["select", "select", "group-avg", "group-avg", "join", "join"], {"1M": 0.882, "2M": 0.580, "4M": 0.541}),
}


def battlefield_set(name: str, queries: list[str], tuples: int, per_instant: int, seed: int = 1) -> Workload:
    """Several battlefield queries (names of ``BF_QUERIES``) over ``tuples`` input tuples in all,
    split evenly over the streams they read; ``query`` of the result is the list of texts."""
    streams = sorted({s for q in queries for s in BF_STREAMS[q]}, key=["Vitals", "Positions"].index)
    n = tuples // len(streams)
    data = {s: vitals(n, per_instant, seed) if s == "Vitals" else positions(n, per_instant, seed + 1) for s in streams}
    texts = [BF_QUERIES[q] for q in queries]
    return Workload(
        name=name, config=BATTLEFIELD_TOML, level="TS", query=texts, data=data,  # type: ignore[arg-type]
        vanilla_config=VANILLA_BF_TOML, vanilla_level="P", vanilla_query=texts,  # type: ignore[arg-type]
        vanilla_data={s: relabel(t, "P") for s, t in data.items()}, per_instant=per_instant,
    )


# ---- Chinese Wall (§9.5) -----------------------------------------------------------------------
CW5 = ["[1,⊥]", "[2,⊥]", "[⊥,A]", "[⊥,B]", "[⊥,C]"]

_Q1 = 'SELECT timestamp FROM MessageLog WHERE msgType = "send" AND outcome = "success" AND receiver = "CompanyB"'
_Q2 = 'SELECT timestamp FROM MessageLog WHERE msgType = "send" AND outcome = "failure" AND receiver = "CompanyB"'
_Q4 = ('SELECT timestamp FROM MessageLog WHERE msgType = "send" AND outcome = "failure" AND '
       '(receiver = "CompanyB" OR receiver = "CompanyA" OR receiver = "CompanyC")')
_Q5 = 'SELECT MIN(timestamp), MAX(timestamp) FROM MessageLog [ROWS 100] WHERE outcome = "success" AND serviceId = "5"'
_Q6 = ('SELECT R.timestamp - S.timestamp AS delay FROM MessageLog R [Rows 100], MessageLog S [Rows 100] '
       'WHERE S.msgType = "send" AND S.outcome = "success" AND R.msgType = "receive" AND R.outcome = "success" '
       'AND R.receiver = "Company1" AND R.sender = "CompanyB" AND S.receiver = "CompanyB" '
       'AND S.sender = "Company1" AND S.serviceId = R.serviceId')

CW_EXPERIMENTS = {
    # name: (query, level, vanilla query, input levels, notes)
    "cw1": (_Q1, "[1,⊥]", _Q1, ["[1,⊥]"], "company auditing, 100 % selectivity"),
    "cw2": (_Q2, "[1,⊥]", _Q2, ["[1,⊥]"], "company auditing, 50 % selectivity"),
    "cw3": (_Q2, "[⊥,B]", _Q2 + " AND lbl = '[⊥,B]'", CW5, "service auditing at [⊥,B], 20 % visible"),
    "cw4": (_Q4, "[⊥,T]", _Q4 + " AND (lbl = '[⊥,A]' OR lbl = '[⊥,B]' OR lbl = '[⊥,C]')", CW5,
            "service auditing at [⊥,T], 60 % visible"),
    "cw5": (_Q5, "[1,B]", _Q5, ["[1,⊥]", "[⊥,B]"], "MIN/MAX over ROWS 100, LUB of [1,⊥] and [⊥,B]"),
    "cw6": (_Q6, "[1,B]", _Q6, ["[1,⊥]", "[⊥,B]"], "self-join over ROWS 100, 50 % selectivity per side"),
}


def message_log(exp: str, n: int, per_instant: int, seed: int = 5) -> pa.Table:
    rng = np.random.default_rng(seed)
    levels = CW_EXPERIMENTS[exp][3]
    lv = np.array(levels)[np.arange(n) % len(levels)]
    rng.shuffle(lv)
    ts = np.arange(n, dtype=np.int64) // per_instant
    half = rng.random(n) < 0.5
    if exp == "cw1":
        msg, out, snd, rcv, svc = np.full(n, "send"), np.full(n, "success"), np.full(n, "Company1"), \
            np.full(n, "CompanyB"), np.full(n, "5")
    elif exp in ("cw2", "cw3", "cw4"):
        msg, snd = np.full(n, "send"), np.full(n, "Company1")
        out = np.where(half, "failure", "success")
        rcv = np.array(["CompanyA", "CompanyB", "CompanyC"])[rng.integers(0, 3, n)] if exp == "cw4" \
            else np.full(n, "CompanyB")
        svc = rng.integers(0, 10, n).astype(str)
    elif exp == "cw5":
        msg, out, snd, rcv, svc = np.full(n, "send"), np.full(n, "success"), np.full(n, "Company1"), \
            np.full(n, "CompanyB"), np.full(n, "5")
    else:  # cw6: half sends Company1->CompanyB, half receives CompanyB->Company1; all succeed
        msg = np.where(half, "send", "receive")
        out = np.full(n, "success")
        snd = np.where(half, "Company1", "CompanyB")
        rcv = np.where(half, "CompanyB", "Company1")
        svc = rng.integers(0, 50, n).astype(str)
    return pa.table({
        "ts": ts,
        "level": pa.array(lv),
        "serviceId": pa.array(svc), "msgType": pa.array(msg), "sender": pa.array(snd),
        "receiver": pa.array(rcv), "timestamp": ts * 1000 + rng.integers(0, 1000, n),
        "outcome": pa.array(out),
    })


def chinese_wall(exp: str, tuples: int, per_instant: int) -> Workload:
    query, level, vq, _levels, notes = CW_EXPERIMENTS[exp]
    t = message_log(exp, tuples, per_instant)
    return Workload(
        name=exp, config=AUDIT_TOML, level=level, query=query, data={"MessageLog": t},
        vanilla_config=VANILLA_CW_TOML, vanilla_level="P", vanilla_query=vq,
        vanilla_data={"MessageLog": relabel(t, "P", keep_as="lbl")}, per_instant=per_instant, notes=notes,
    )
