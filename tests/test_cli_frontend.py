"""`strata users` and `strata explain` as a user runs them (subprocesses, then in process through
``strata.cli.main``)."""

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
    assert json.loads(r.stdout) == [
        {"name": "jane", "clearance": "TS", "roles": ["analyst"], "principals": ["U", "C", "S", "TS"]}
    ]
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


# ---- in process: `strata.cli.main` with the password on stdin ----------------------------------
def run(argv, capsys, monkeypatch, stdin=""):
    import io

    from strata.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_users_roles_add_replace_set_and_list(cfg, capsys, monkeypatch):
    c = ["--config", str(cfg)]
    code, _, err = run(["users", "add", *c, "--name", "ann", "--clearance", "S"], capsys, monkeypatch, "pw\n")
    assert code == 0 and "roles analyst" in err
    code, _, err = run(["users", "add", *c, "--name", "pat", "--clearance", "TS", "--roles", "producer,operator"],
                       capsys, monkeypatch, "pw\n")
    assert code == 0 and "roles operator, producer" in err
    # --replace without --roles keeps the old roles
    code, _, _ = run(["users", "add", *c, "--name", "pat", "--clearance", "C", "--replace"], capsys, monkeypatch, "pw2\n")
    assert code == 0
    code, out, _ = run(["users", "list", *c, "--json"], capsys, monkeypatch)
    assert {u["name"]: u["roles"] for u in json.loads(out)} == {"ann": ["analyst"], "pat": ["operator", "producer"]}
    code, _, err = run(["users", "set-roles", *c, "--name", "ann", "--roles", "Analyst, producer"], capsys, monkeypatch)
    assert code == 0
    assert err.count("\n") == 1 and "now has roles analyst, producer" in err and "within a second" in err
    code, out, _ = run(["users", "list", *c], capsys, monkeypatch)
    assert out.splitlines() == ["ann\tS\tanalyst,producer\tann.U, ann.C, ann.S", "pat\tC\toperator,producer\tpat.U, pat.C"]


@pytest.mark.parametrize("argv", [
    ["users", "add", "--name", "bob", "--clearance", "S", "--roles", "analyst,admin"],
    ["users", "set-roles", "--name", "ann", "--roles", "root"],
    ["users", "set-roles", "--name", "ann", "--roles", ","],
])
def test_users_unknown_role_is_one_line_exit_2(cfg, capsys, monkeypatch, argv):
    run(["users", "add", "--config", str(cfg), "--name", "ann", "--clearance", "S"], capsys, monkeypatch, "pw\n")
    code, out, err = run([*argv, "--config", str(cfg)], capsys, monkeypatch, "pw\n")
    assert code == 2 and out == ""
    assert err.startswith("strata: --roles: ") and err.count("\n") == 1
    assert "unknown role" in err or "at least one role" in err


def test_users_list_shows_entries_without_access(cfg, capsys, monkeypatch):
    run(["users", "add", "--config", str(cfg), "--name", "ann", "--clearance", "S"], capsys, monkeypatch, "pw\n")
    path = cfg.with_name("battle.users.json")
    data = json.loads(path.read_text())
    data["users"]["old"] = {"clearance": "Secret", "hash": data["users"]["ann"]["hash"], "roles": ["analyst"]}
    path.write_text(json.dumps(data))
    code, out, _ = run(["users", "list", "--config", str(cfg)], capsys, monkeypatch)
    assert code == 0
    assert out.splitlines() == [
        "ann\tS\tanalyst\tann.U, ann.C, ann.S",
        "old\t(no access: clearance: unknown level 'Secret' (levels: U, C, S, TS))",
    ]
    code, out, _ = run(["users", "list", "--config", str(cfg), "--json"], capsys, monkeypatch)
    old = json.loads(out)[1]
    assert old == {"name": "old", "clearance": None, "roles": ["analyst"], "principals": [],
                   "problem": "clearance: unknown level 'Secret' (levels: U, C, S, TS)"}
    assert "$argon2" not in out
    path.write_text("{broken")
    code, out, err = run(["users", "list", "--config", str(cfg)], capsys, monkeypatch)
    assert code == 1 and out == "" and "unreadable users file" in err and err.count("\n") == 1


@pytest.mark.parametrize("query, fragment", [
    ("SELECT bp FROM Vitals [RANGE 99999999999999999999 days]", "limit error: window of Vitals: RANGE"),
    ("SELECT bp FROM Vitals [ROWS 0]", "limit error: window of Vitals: ROWS 0"),
    ("SELECT bp FROM Vitals WHERE bp > 123456789012345678901234567890123456789012345", "limit error: WHERE"),
    ("SELECT bp FROM Vitals WHERE bp > 1e400", "limit error: WHERE: a decimal literal"),
    ("SELECT bp FROM Vitals WHERE bp > " + "9" * 20000, "limit error: WHERE: a number written with 20000"),
])
def test_explain_limit_errors_exit_2_one_line(cfg, capsys, monkeypatch, query, fragment):
    """A limit error is a refused query like any other: exit 2, one line (issue 30)."""
    code, out, err = run(["explain", "--config", str(cfg), "--level", "S", query], capsys, monkeypatch)
    assert code == 2 and out == ""
    assert err.startswith("strata: " + fragment) and err.count("\n") == 1 and len(err) < 300


def test_explain_authorization_is_still_exit_2(cfg, capsys, monkeypatch):
    code, _, err = run(["explain", "--config", str(cfg), "--level", "S",
                        "SELECT bp FROM Vitals WHERE level DOMINATED BY TS"], capsys, monkeypatch)
    assert code == 2
    assert err == ("strata: authorization error: WHERE condition names level TS, which the query level S "
                   "does not dominate\n")
