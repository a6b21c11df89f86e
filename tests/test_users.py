"""Users: argon2id hashes in a 0600 file, principals (Table 4.1), login checks."""

from __future__ import annotations

import json
import stat

import pytest

from strata.users import AuthError, UserError, UserStore, principals


@pytest.fixture
def store(tmp_path, battlefield):
    return UserStore(tmp_path / "strata.users.json", battlefield.lattice)


def test_hash_not_password_and_mode_0600(store):
    store.add("jane", "TS", "correct horse battery")
    raw = store.path.read_text()
    assert "correct horse battery" not in raw
    rec = json.loads(raw)["users"]["jane"]
    assert rec["hash"].startswith("$argon2id$")
    assert rec["clearance"] == "TS"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_table_4_1_principals(store, battlefield):
    # dissertation Table 4.1: Bob (TS) runs Q_d at U, Kim at S, Jim at U, Alice at TS
    for name, clearance in [("Bob", "TS"), ("Kim", "S"), ("Jim", "U"), ("Alice", "TS"), ("JaneDoe", "TS")]:
        store.add(name, clearance, f"pw-{name}")
    assert store.authenticate("Bob", "pw-Bob", "U").level == "U"
    assert store.authenticate("Kim", "pw-Kim", "S").level == "S"
    assert store.authenticate("Jim", "pw-Jim", "U").level == "U"
    assert store.authenticate("Alice", "pw-Alice", "TS").level == "TS"
    with pytest.raises(AuthError):
        store.authenticate("Jim", "pw-Jim", "S")  # no read up
    with pytest.raises(AuthError):
        store.authenticate("Kim", "pw-Kim", "TS")
    jane = store.load()["JaneDoe"]
    assert [str(p) for p in principals(jane, battlefield.lattice)] == [
        "JaneDoe.U", "JaneDoe.C", "JaneDoe.S", "JaneDoe.TS"
    ]


def test_login_failures_do_not_say_which_part_was_wrong(store):
    store.add("ann", "S", "pw1")
    with pytest.raises(AuthError) as wrong_pw:
        store.authenticate("ann", "nope", "S")
    with pytest.raises(AuthError) as no_user:
        store.authenticate("bob", "pw1", "S")
    assert str(wrong_pw.value) == str(no_user.value)


def test_admin_errors(store):
    store.add("ann", "S", "pw")
    with pytest.raises(UserError, match="already exists"):
        store.add("ann", "S", "pw")
    store.add("ann", "C", "pw2", replace=True)
    assert store.authenticate("ann", "pw2").level == "C"
    with pytest.raises(UserError, match="clearance"):
        store.add("x", "SECRET", "pw")
    with pytest.raises(UserError, match="empty password"):
        store.add("x", "S", "")
    with pytest.raises(UserError, match="user name"):
        store.add("bad name", "S", "pw")
    store.remove("ann")
    with pytest.raises(UserError):
        store.remove("ann")
