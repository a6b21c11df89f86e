"""A lattice of classifications with categories (issue 16), end to end: `strata replay` at a category
level through a real embedded cluster (master, shepherd, chunker, Spark worker), every output
compared with the independent reference evaluator; and `strata explain` round-tripping the
rewritten text (category levels are quoted strings in queries)."""

from __future__ import annotations

import random

import pyarrow.csv as pcsv
import pytest

from strata.config import load_config

from .reference.evaluator import compare_results, evaluate
from .tables import rows_of
from .helpers import strata, write_config, write_csv

CATEGORIES_TOML = """
[lattice]
classifications = ["U", "C", "S", "TS"]
categories = ["NATO", "CRYPTO"]

[streams.Vitals]
sid = "string"
bp = "double"
"""

QUERIES = [
    "SELECT sid, AVG(bp) FROM Vitals [RANGE 2 SECONDS] GROUP BY sid",
    "SELECT sid, bp FROM Vitals [ROWS 3] WHERE level DOMINATED BY '(C, {NATO})'",
    "SELECT COUNT(*) FROM Vitals [NOW level in {U, '(S,{NATO})'}]",
    "ISTREAM(SELECT sid, MAX(bp) FROM Vitals [RANGE UNBOUNDED] GROUP BY sid)",
    # issue 16's later forms through the CLI too
    "SELECT sid, SUM(bp) FROM Vitals [RANGE 4 SECONDS SLIDE 2 SECONDS] GROUP BY sid",
    "SELECT DISTINCT COUNT(*) AS n FROM Vitals [ROWS 4] GROUP BY sid",
    "SELECT COUNT(DISTINCT sid), SUM(DISTINCT bp), AVG(DISTINCT bp) FROM Vitals [RANGE 3 SECONDS]",
    "SELECT AVG(bp) FROM Vitals [ROWS 3 WHERE bp > 120]",
    "SELECT sid FROM Vitals [ROWS 2] UNION SELECT sid FROM Vitals [NOW] WHERE bp > 150",
    "RSTREAM(SELECT sid, bp FROM Vitals [RANGE 2 SECONDS] EXCEPT SELECT sid, bp FROM Vitals [NOW level in {U}])",
    "SELECT n, COUNT(*) AS k FROM (SELECT sid, COUNT(*) AS n FROM Vitals [RANGE 3 SECONDS] GROUP BY sid) x GROUP BY n",
]


@pytest.mark.slow
def test_replay_at_a_category_level_equals_the_reference(tmp_path):
    cfg_path = write_config(tmp_path, CATEGORIES_TOML, {"ann": "(TS, {NATO})"})
    cfg = load_config(cfg_path)
    rnd = random.Random(16)
    levels = list(cfg.lattice.levels)
    rows = [{"ts": ts, "level": rnd.choice(levels), "sid": f"s{rnd.randrange(3)}", "bp": float(rnd.randrange(60, 200))}
            for ts in range(1, 13) for _ in range(rnd.randrange(0, 6))]
    data = tmp_path / "vitals.csv"
    write_csv(data, ["ts", "level", "sid", "bp"], [(r["ts"], r["level"], r["sid"], r["bp"]) for r in rows])
    out = tmp_path / "out"
    args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", "(S,{NATO})", "--workers", "1",
            "--input", f"Vitals={data}", "--output", str(out)]
    for q in QUERIES:
        args += ["--query", q]
    r = strata(*args)
    assert r.returncode == 0, r.stderr
    hidden = sum(not cfg.lattice.leq(x["level"], "(S,{NATO})") for x in rows)
    assert f"({hidden} above level (S,{{NATO}}) dropped)" in r.stderr
    for i, q in enumerate(QUERIES):
        got = rows_of(pcsv.read_csv(out / f"q{i + 1}.csv"))
        expected = evaluate(q, cfg, "(S,{NATO})", {"Vitals": rows})
        assert expected, q  # each query has output to compare
        compare_results(got, expected)
        assert all(cfg.lattice.leq(row[1], "(S,{NATO})") for row in got)


def test_explain_prints_category_levels_that_parse_again(tmp_path):
    cfg_path = write_config(tmp_path, CATEGORIES_TOML, {"ann": "(TS, {NATO})"})
    r = strata("explain", "--config", str(cfg_path), "--level", "(S,{NATO})", QUERIES[2])
    assert r.returncode == 0, r.stderr
    assert "'(S,{NATO})'" in r.stdout and "'(U,{})'" in r.stdout
