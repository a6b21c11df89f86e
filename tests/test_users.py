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


# ---- roles -----------------------------------------------------------------------------------
def test_roles_default_replace_and_set(store):
    from strata.users import DEFAULT_ROLES

    assert store.add("ann", "S", "pw").roles == DEFAULT_ROLES == {"analyst"}
    assert store.add("bob", "S", "pw", roles="producer, operator").roles == {"producer", "operator"}
    assert store.add("bob", "C", "pw2", replace=True).roles == {"producer", "operator"}  # kept
    assert store.set_roles("bob", ["analyst"]).roles == {"analyst"}
    assert store.authenticate("bob", "pw2", "C").roles == {"analyst"}
    with pytest.raises(UserError, match="unknown role"):
        store.set_roles("bob", "admin")
    with pytest.raises(UserError, match="at least one role"):
        store.add("cy", "S", "pw", roles="")


# ---- a broken entry never stops the others (issue 12) -------------------------------------------
def _write(store, users: dict):
    store.path.write_text(json.dumps({"format": 1, "users": users}))


@pytest.fixture
def mixed(store, battlefield):
    """A users file with one good user and one broken entry of each kind."""
    store.add("good", "S", "pw-good")
    h = json.loads(store.path.read_text())["users"]["good"]["hash"]
    _write(store, {
        "good": {"clearance": "S", "hash": h, "roles": ["analyst"]},
        "secret": {"clearance": "Secret", "hash": h, "roles": ["analyst"]},
        "nohash": {"clearance": "S"},
        "numhash": {"clearance": "S", "hash": 42},
        "junkhash": {"clearance": "S", "hash": "not-an-argon2-hash"},
        "badroles": {"clearance": "S", "hash": h, "roles": ["admin"]},
        "strroles": {"clearance": "S", "hash": h, "roles": "analyst"},
        "notobj": ["S", h],
        "noclear": {"hash": h},
        "badafter": {"clearance": "S", "hash": h, "sessions_after": "yesterday"},
        "swapped": {"clearance": h, "hash": "S"},
    })
    return store, h


BROKEN = {
    "secret": "clearance: unknown level 'Secret'",
    "nohash": "no password hash",
    "numhash": "the password hash is not a string",
    "junkhash": "the password hash is not an argon2 hash",
    "badroles": "roles: unknown role(s) admin",
    "strroles": "roles: must be a list of role names",
    "notobj": "the entry is not an object",
    "noclear": "no clearance",
    "badafter": "sessions_after is not a number",
    "swapped": "the clearance is not a level of the lattice; the password hash is not an argon2 hash",
}


def test_broken_entries_load_without_access(mixed, battlefield, caplog):
    store, h = mixed
    with caplog.at_level("WARNING", logger="strata.users"):
        users = store.load()
    assert set(users) == {"good", *BROKEN}
    assert users["good"].clearance == "S" and "good" not in store.problems
    for name, reason in BROKEN.items():
        assert users[name].clearance is None, name
        assert users[name].name == name
        assert reason in store.problems[name], (name, store.problems[name])
        assert principals(users[name], battlefield.lattice) == []
        # what master code does today must not blow up on a broken entry: no level is dominated
        assert not battlefield.lattice.leq("U", users[name].clearance)
    logged = [r.getMessage() for r in caplog.records if r.name == "strata.users"]
    assert len(logged) == len(BROKEN)
    for name in BROKEN:
        assert any(repr(name) in m and store.problems[name] in m for m in logged)
    assert not any(h in m or "$argon2" in m for m in logged)
    store.load()  # the same problems are logged once per store
    assert len([r for r in caplog.records if r.name == "strata.users"]) == len(BROKEN)


def test_broken_entries_cannot_log_in_and_cost_the_same(mixed, monkeypatch):
    import strata.users as users_mod

    store, _ = mixed
    assert store.authenticate("good", "pw-good", "S").level == "S"
    calls = []
    real = users_mod._HASHER

    class Spy:
        def verify(self, h, pw):
            calls.append(h)
            return real.verify(h, pw)

    monkeypatch.setattr(users_mod, "_HASHER", Spy())
    messages = set()
    for name in [*BROKEN, "nobody"]:
        with pytest.raises(AuthError) as e:
            store.authenticate(name, "pw-good", "S")  # even with the right password
        messages.add(str(e.value))
    with pytest.raises(AuthError) as e:
        store.authenticate("good", "wrong", "S")
    messages.add(str(e.value))
    assert messages == {"login failed: unknown user or wrong password"}
    # one full argon2 verification each, against a hash with the same parameters as a real one
    assert len(calls) == len(BROKEN) + 2
    assert calls[:-1] == [users_mod._DUMMY_HASH] * (len(BROKEN) + 1)


def test_whole_file_not_a_users_file_still_raises(store):
    for text in ("{not json", "[1, 2]", '{"users": [1]}', "\xff\xfe"):
        store.path.write_text(text, encoding="latin-1")
        with pytest.raises(UserError, match="users file"):
            store.load()


def test_changes_keep_broken_entries_as_they_were(mixed):
    store, h = mixed
    before = json.loads(store.path.read_text())["users"]
    store.add("new", "C", "pw-new")
    after = json.loads(store.path.read_text())["users"]
    assert {k: after[k] for k in BROKEN} == {k: before[k] for k in BROKEN}
    # fixing a broken entry's clearance gives access back (its hash was fine)
    assert store.set_clearance("secret", "C").clearance == "C"
    assert store.authenticate("secret", "pw-good", "C").level == "C"
    # changing roles of an entry whose clearance is still broken keeps the broken clearance on disk
    store.set_roles("noclear", "producer")
    rec = json.loads(store.path.read_text())["users"]["noclear"]
    assert rec == {"hash": h, "roles": ["producer"]}
    assert store.load()["noclear"].clearance is None
    # a new password for an entry with bad roles gets the default role
    assert store.add("badroles", "S", "pw-b", replace=True).roles == {"analyst"}
    assert store.authenticate("badroles", "pw-b", "S").level == "S"


def test_dummy_hash_costs_what_a_real_hash_costs():
    """Unknown names are verified against a written-out hash: it must have the hasher's
    parameters (time, memory, lanes), or a changed hasher would make unknown names cheaper."""
    from argon2 import extract_parameters

    from strata import users

    want = extract_parameters(users._HASHER.hash("x"))
    got = extract_parameters(users._DUMMY_HASH)
    assert (got.type, got.time_cost, got.memory_cost, got.parallelism, got.hash_len, got.salt_len) == \
        (want.type, want.time_cost, want.memory_cost, want.parallelism, want.hash_len, want.salt_len)
    assert not users._HASHER.check_needs_rehash(users._DUMMY_HASH)
