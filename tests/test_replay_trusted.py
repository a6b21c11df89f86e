"""``strata replay`` in the trusted mode (issue 33, docs/trusted.md *Around the mode*): with ``[cluster] mode =
"trusted"`` in the configuration (or ``--mode trusted``, which overrides it) the embedded cluster is one trusted
master and its workers serving the login level and ``--levels``, as ``strata up --mode trusted`` starts it, and
the input goes through the login level's address.  One cluster start: a session at S of a trusted cluster
serving S and TS replays labelled input of every level (the TS rows dropped by S's shepherd) through several
queries (two sharing a window, a join, a level clause, a RANGE GROUP BY) and gets exactly the reference's rows
(tests/reference/), i.e. what the replicated mode's replay returns (tests/test_cluster_e2e.py and the
differential tests check the replicated mode against the same reference).  The refusals need no cluster."""

from __future__ import annotations

import pytest

from strata.config import load_config

from .conftest import BATTLEFIELD_TOML
from .helpers import read_out, strata, write_config, write_csv
from .reference.evaluator import compare_results, evaluate

QUERIES = [("SELECT sid, AVG(bp) FROM Vitals [ROWS 5] GROUP BY sid", ["string", "double"]),
           ("SELECT MAX(bp) FROM Vitals [ROWS 5]", ["double"]),  # shares the window with the first
           ("SELECT sid, COUNT(*) FROM Vitals [RANGE 2 level in {U, C}] GROUP BY sid", ["string", "long"]),
           ("SELECT v.sid, v.bp, p.lat FROM Vitals [ROWS 3] v, Positions [ROWS 3] p WHERE v.sid = p.sid",
            ["string", "double", "double"])]


def _streams():
    vit, pos = [], []
    for ts in range(8):
        for i, lv in enumerate(("U", "C", "S", "TS", "U", "S", "TS")):
            vit.append({"ts": ts, "level": lv, "sid": "abc"[(ts + i) % 3], "bp": 95.0 + 3 * ts + i, "pr": 1.0,
                        "weight": 2.0})
        for i, lv in enumerate(("U", "S", "TS", "C")):
            pos.append({"ts": ts, "level": lv, "sid": "abc"[(ts + i) % 3], "lat": float(10 * ts + i), "lon": "E"})
    return {"Vitals": vit, "Positions": pos}


def _args(tmp_path, cfg_path, streams, *extra):
    args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", "S", "--output", str(tmp_path / "out"),
            "--workers", "1", "--chunk-seconds", "2", *extra]
    for name, rows in streams.items():
        path = tmp_path / f"{name}.csv"
        write_csv(path, list(rows[0]), [tuple(r.values()) for r in rows])
        args += ["--input", f"{name}={path}"]
    for q, _ in QUERIES:
        args += ["--query", q]
    return args


@pytest.mark.slow
def test_replay_through_a_trusted_cluster_equals_the_reference(tmp_path):
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML + '\n[cluster]\nmode = "trusted"\n', {"ann": "TS"})
    cfg = load_config(cfg_path)
    streams = _streams()
    r = strata(*_args(tmp_path, cfg_path, streams, "--levels", "TS"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trusted embedded cluster (one master) serving S, TS" in r.stderr, r.stderr[-2000:]
    for i, (q, types) in enumerate(QUERIES, 1):
        got = read_out(tmp_path / "out" / f"q{i}.csv", types)
        want = evaluate(q, cfg, "S", streams)
        assert want, q  # the comparison is not vacuous
        compare_results(got, want)
        assert all(row[1] in ("U", "C", "S") for row in got), q  # nothing of TS reached the S session


@pytest.mark.parametrize("extra, message", [
    (["--mode", "replicated", "--levels", "TS"], "--levels is for --mode trusted"),  # --mode overrides the config
    (["--mode", "trusted", "--master", "127.0.0.1:1"], "--mode and --levels are for the embedded cluster"),
    (["--levels", "TS", "--cluster", "nowhere"], "--mode and --levels are for the embedded cluster"),
    (["--mode", "trusted", "--levels", "XX"], "--levels:"),
])
def test_replay_mode_refusals(tmp_path, extra, message):
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML + '\n[cluster]\nmode = "trusted"\n', {"ann": "TS"})
    r = strata(*_args(tmp_path, cfg_path, _streams(), *extra))
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

