"""``strata replay`` with security punctuations: an ``--input _punctuations=FILE`` (the reserved stream,
docs/semantics.md §11) replayed with the data through an embedded cluster governs the queries exactly
as the reference says (tests/reference/access.py): a tuple-level grant by role on Vitals at two levels,
replaced by a newer policy later in the run, a grant by user name and a deny of one attribute on
Positions, and a join of both shielded sides (SCJoin).  The same files with the punctuations in JSON
lines give the same output."""

from __future__ import annotations

import json

import pytest

from strata.config import load_config

from .conftest import BATTLEFIELD_TOML
from .helpers import read_out, strata, write_config, write_csv
from .reference.access import evaluate_access
from .reference.evaluator import compare_results

pytestmark = pytest.mark.slow

ROLES = {"producer", "analyst", "operator"}  # write_config gives a user named by clearance every role
QUERIES = [("SELECT sid, bp FROM Vitals [ROWS 4]", ["string", "double"]),
           ("SELECT sid, COUNT(*) FROM Vitals [RANGE 2] GROUP BY sid", ["string", "long"]),
           ("SELECT sid, lat FROM Positions [NOW]", ["string", "double"]),
           ("SELECT v.sid, v.bp, p.lat FROM Vitals [ROWS 3] v, Positions [ROWS 3] p WHERE v.sid = p.sid",
            ["string", "double", "double"])]
PUNCT_COLS = ["ts", "level", "stream", "tuples", "attributes", "roles", "users", "sign", "immutable"]


def _sp(ts, level, stream, tuples, attributes="*", roles="", users="", sign="+", immutable=""):
    return dict(zip(PUNCT_COLS, (ts, level, stream, tuples, attributes, roles, users, sign, immutable)))


PUNCT = [
    _sp(0, "U", "Vitals", "sid=a|b", roles="analyst"),          # U tuples of Vitals: sids a and b only
    _sp(0, "S", "Vitals", "bp=100..120", roles="analyst"),      # S tuples: bp in [100, 120]
    _sp(1, "U", "Positions", "*", users="ann"),                 # U positions: all, by user name
    _sp(1, "U", "Positions", "sid=c", attributes="lat", roles="analyst", sign="-"),  # ... but no lat of c
    _sp(4, "U", "Vitals", "sid=c", roles="analyst", immutable="true"),  # from 4: a new U policy (c only)
    _sp(5, "TS", "Vitals", "*", roles="analyst", sign="-"),     # above the session's level: dropped
]


def _streams():
    vit, pos = [], []
    for ts in range(8):
        for i, lv in enumerate(("U", "C", "S", "TS", "U", "S")):
            vit.append({"ts": ts, "level": lv, "sid": "abc"[(ts + i) % 3], "bp": 95.0 + 3 * ts + i, "pr": 1.0,
                        "weight": 2.0})
        for i, lv in enumerate(("U", "S", "U")):
            pos.append({"ts": ts, "level": lv, "sid": "abc"[(ts + i) % 3], "lat": float(10 * ts + i), "lon": "E"})
    return {"Vitals": vit, "Positions": pos}


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_replay_with_punctuations_equals_the_reference(tmp_path, fmt):
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML, {"ann": "TS"})
    cfg = load_config(cfg_path)
    streams = _streams()
    args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", "S", "--output", str(tmp_path / "out"),
            "--workers", "1", "--chunk-seconds", "2"]
    for name, rows in streams.items():
        path = tmp_path / f"{name}.csv"
        write_csv(path, list(rows[0]), [tuple(r.values()) for r in rows])
        args += ["--input", f"{name}={path}"]
    path = tmp_path / f"punct.{fmt}"
    if fmt == "csv":
        write_csv(path, PUNCT_COLS, [tuple(p.values()) for p in PUNCT])
    else:
        path.write_text("".join(json.dumps({**p, "immutable": p["immutable"] == "true"}) + "\n" for p in PUNCT))
    args += ["--input", f"_punctuations={path}"]
    for q, _ in QUERIES:
        args += ["--query", q]
    r = strata(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    punct = [dict(p, immutable=p["immutable"] == "true") for p in PUNCT]
    outs = []
    for i, (q, types) in enumerate(QUERIES, 1):
        got = read_out(tmp_path / "out" / f"q{i}.csv", types)
        compare_results(got, evaluate_access(q, cfg, "S", streams, punct, ("ann", ROLES)).rows)
        outs.append(got)
    # the policies did something: every query's output differs from the output without them
    for i, (q, _) in enumerate(QUERIES):
        assert sorted(outs[i]) != sorted(evaluate_access(q, cfg, "S", streams, [], ("ann", ROLES)).rows), q
    assert not [row for row in outs[2] if row[2] == "c" and row[0] >= 1 and row[1] == "U"]  # lat of c denied
