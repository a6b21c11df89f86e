"""State files 0600 and state directories 0700 (issue 14, item 7): the event log's -wal/-shm hold the
level's tuples and must never be readable by other local users, not even for a moment."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

from strata.master.store import MasterStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    """The usual 022: what made -wal/-shm 0644 before."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_event_log_wal_shm_and_directory_are_private(tmp_path, loose_umask):
    db = tmp_path / "state" / "master-S.sqlite"
    store = MasterStore(db, "S", "fp")
    store.append("ingest", {"stream": "Vitals"}, b"S tuples" * 1000)
    store.save_session("token", "ann", "S", 1.0)
    wal, shm = db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")
    assert wal.exists() and shm.exists()  # WAL mode, connection open
    assert {p.name: mode(p) for p in (db, wal, shm)} == {db.name: 0o600, wal.name: 0o600, shm.name: 0o600}
    assert mode(db.parent) == 0o700
    store.close()


def test_files_an_older_version_left_readable_are_tightened(tmp_path, loose_umask):
    db = tmp_path / "master-S.sqlite"
    old = sqlite3.connect(db)  # what an older master left: 0644 files, -wal and -shm still there
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE t (x)")
    old.execute("INSERT INTO t VALUES (1)")
    old.commit()
    files = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    assert all(mode(p) == 0o644 for p in files)
    store = MasterStore(db, "S", "fp")
    assert [mode(p) for p in files] == [0o600] * 3
    store.close()
    old.close()


def test_reopening_keeps_the_modes(tmp_path, loose_umask):
    db = tmp_path / "s" / "m.sqlite"
    MasterStore(db, "S", "fp").close()
    store = MasterStore(db, "S", "fp")
    store.append("advance", {"upto": 3})
    assert all(mode(p) == 0o600 for p in db.parent.iterdir())
    store.close()


def test_group_key_and_tls_directories_are_private(tmp_path, loose_umask):
    from strata.groups import load_or_create_key
    from strata.tls import make_ca

    key = tmp_path / "state" / "keys" / "S.key"
    load_or_create_key(key, create=True)
    assert (mode(key.parent), mode(key)) == (0o700, 0o600)
    tls = tmp_path / "state" / "tls"
    make_ca(tls)
    assert (mode(tls), mode(tls / "ca.key")) == (0o700, 0o600)


def test_start_cluster_state_directories_are_private(tmp_path, loose_umask, monkeypatch):
    """Only the directory lines of start_cluster, without starting anything."""
    from strata.deploy import local

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(local, "free_udp_port", stop)  # right after the directories are made
    state = tmp_path / "cluster"
    from strata.examples import BATTLEFIELD_TOML

    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    with pytest.raises(Stop):
        local.start_cluster(str(cfg), ["S"], 0, state, multicast_port=None)
    assert [mode(p) for p in (state, state / "logs", state / "run")] == [0o700] * 3
