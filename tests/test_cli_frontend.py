"""`strata users` and `strata explain` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest

from .conftest import BATTLEFIELD_TOML, CHINESE_WALL_TOML


def strata(*args, input=None):
    return subprocess.run(
        [sys.executable, "-m", "strata", *args], input=input, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "battle.toml"
    p.write_text(BATTLEFIELD_TOML)
    return p


def test_users_add_reads_stdin_and_stores_hash(cfg):
    r = strata("users", "add", "--config", str(cfg), "--name", "jane", "--clearance", "TS", input="s3cret pw\n")
    assert r.returncode == 0, r.stderr
    users = cfg.with_name("battle.users.json")
    assert stat.S_IMODE(users.stat().st_mode) == 0o600
    assert "s3cret" not in users.read_text()
    r = strata("users", "list", "--config", str(cfg), "--json")
    assert json.loads(r.stdout) == [{"name": "jane", "clearance": "TS", "principals": ["U", "C", "S", "TS"]}]
    r = strata("users", "add", "--config", str(cfg), "--name", "jane", "--clearance", "TS", input="x\n")
    assert r.returncode == 2 and "already exists" in r.stderr


def test_explain_json(cfg):
    r = strata("explain", "--config", str(cfg), "--level", "S", "--json", "SELECT bp FROM Vitals V")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["level"] == "S"
    assert out["rewritten"] == "SELECT bp FROM Vitals [RANGE UNBOUNDED level in {U, C, S}] V"
    assert out["windows"] == [{"stream": "Vitals", "alias": "V", "kind": "unbounded", "levels": ["U", "C", "S"]}]


def test_explain_windows_in_from_order(cfg):
    r = strata(
        "explain", "--config", str(cfg), "--level", "TS", "--json",
        "SELECT V.sid FROM Positions [ROWS 2 level = C] P, Vitals [Partition By level Rows 3] V WHERE V.sid = P.sid",
    )
    wins = json.loads(r.stdout)["windows"]
    assert [(w["stream"], w["alias"], w["kind"], w["levels"]) for w in wins] == [
        ("Positions", "P", "rows", ["C"]),
        ("Vitals", "V", "partition", ["U", "C", "S", "TS"]),
    ]


@pytest.mark.parametrize(
    "query, fragment",
    [
        ("SELECT bp FROM Vitals WHERE level in {C,U,TS}", "authorization error"),
        ("SELECT bp FRM Vitals", "parse error"),
        ("SELECT nope FROM Vitals", "semantic error"),
        ("SELECT AVG(bp) FROM Vitals[RANGE 3 minutes level in {C,U}] WHERE level in {S}", "never output"),
    ],
)
def test_explain_rejections_exit_2_one_line(cfg, query, fragment):
    r = strata("explain", "--config", str(cfg), "--level", "S", query)
    assert r.returncode == 2
    assert r.stdout == ""
    assert fragment in r.stderr and r.stderr.count("\n") == 1


def test_explain_chinese_wall_text(tmp_path):
    p = tmp_path / "cw.toml"
    p.write_text(CHINESE_WALL_TOML)
    r = strata("explain", "--config", str(p), "--level", "[1,B]", "SELECT MIN(timestamp), MAX(timestamp) "
               "FROM MessageLog [ROWS 100] WHERE outcome = \"success\" AND serviceId = \"5\"")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        "SELECT MIN(timestamp), MAX(timestamp) FROM MessageLog [ROWS 100 level in {[⊥,⊥], [⊥,B], [1,⊥], [1,B]}] "
        "WHERE outcome = 'success' AND serviceId = '5'"
    )


def test_bad_config_exit_1(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[lattice]\nlevels = 3\n")
    r = strata("explain", "--config", str(p), "--level", "S", "SELECT 1 FROM X")
    assert r.returncode == 1 and "[lattice] levels" in r.stderr


def test_users_logout_and_other_switches(cfg):
    assert strata("users", "add", "--config", str(cfg), "--name", "jane", "--clearance", "S", input="pw\n").returncode == 0
    r = strata("users", "logout", "--config", str(cfg), "--name", "jane")
    assert r.returncode == 0 and "log in again" in r.stderr
    rec = json.loads(cfg.with_name("battle.users.json").read_text())["users"]["jane"]
    assert rec["clearance"] == "S" and rec["sessions_after"] > 0
    r = strata("users", "logout", "--config", str(cfg), "--name", "nobody")
    assert r.returncode == 2 and "no user 'nobody'" in r.stderr
    # the other administrator switches go through the same path
    r = strata("users", "set-clearance", "--config", str(cfg), "--name", "jane", "--clearance", "C")
    assert r.returncode == 0 and "now has clearance C" in r.stderr
    assert strata("users", "set-clearance", "--config", str(cfg), "--name", "jane", "--clearance", "X").returncode == 2
    assert strata("users", "remove", "--config", str(cfg), "--name", "jane").returncode == 0
    assert json.loads(strata("users", "list", "--config", str(cfg), "--json").stdout) == []
