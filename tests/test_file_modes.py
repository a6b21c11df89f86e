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


# ---- state directories made beforehand (issue 30 item 6) -------------------------------------------
def test_a_state_directory_made_with_0755_is_tightened(tmp_path, loose_umask):
    """``strata up``, a master's event log, the certificates and the group keys all go through
    private_dir: a directory the user made beforehand with the usual 0755 becomes 0700."""
    from strata.groups import load_or_create_key
    from strata.private import private_dir
    from strata.tls import create_deployment

    for name in ("state", "certs", "keys", "events"):
        (tmp_path / name).mkdir(mode=0o755)
        assert mode(tmp_path / name) == 0o755
    private_dir(tmp_path / "state")
    create_deployment(tmp_path / "certs", ["S"])
    load_or_create_key(tmp_path / "keys" / "S.key", create=True)
    MasterStore(tmp_path / "events" / "master-S.sqlite", "S", "fp").close()
    assert [mode(tmp_path / n) for n in ("state", "certs", "keys", "events")] == [0o700] * 4
    assert mode(private_dir(tmp_path / "new" / "deeper")) == 0o700


def test_a_state_directory_of_another_user_or_a_file_is_refused_in_one_line(tmp_path):
    from strata.errors import CliError
    from strata.private import private_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(CliError, match="exists and is not a directory"):
        private_dir(tmp_path / "file")
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    other = tmp_path / "theirs"
    other.mkdir(mode=0o755)
    os.chown(other, 65534, 65534)
    with pytest.raises(CliError) as e:
        private_dir(other)
    assert "belongs to uid 65534, not to this user" in str(e.value) and "\n" not in str(e.value)
    assert mode(other) == 0o755  # not ours to change


def test_strata_up_tightens_its_state_directory(tmp_path, loose_umask):
    """Through the command: the state directory, its logs/ and run/ are 0700 once `strata up` ran (a
    master alone, stopped again)."""
    import subprocess
    import sys

    from strata.examples import BATTLEFIELD_TOML

    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    up = [sys.executable, "-m", "strata", "up", "--config", str(cfg), "--levels", "S", "--workers", "0",
          "--state-dir", str(state)]
    try:
        r = subprocess.run(up, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert mode(state) == 0o700 and mode(state / "logs") == 0o700 and mode(state / "run") == 0o700
        assert mode(state / "cluster.json") & 0o077 == 0 and mode(state / "logs" / "master-S.log") == 0o600
    finally:
        subprocess.run([sys.executable, "-m", "strata", "down", "--state-dir", str(state)], timeout=60)


@pytest.mark.slow
def test_a_levels_data_dir_holds_its_event_log_and_spark_scratch(tmp_path, loose_umask):
    """``[groups."S"] data_dir`` (a device per level): the master's event log and the local Spark
    session's scratch (``spark.local.dir``: shuffle files, the level's data) live there, private, and
    not in the state directory or the host's shared temporary directory."""
    import subprocess
    import sys

    from strata.examples import BATTLEFIELD_TOML

    from .polling import wait_for

    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + '\n[groups."S"]\ndata_dir = "disk-s"\n')
    state, data = tmp_path / "state", tmp_path / "disk-s"
    up = [sys.executable, "-m", "strata", "up", "--config", str(cfg), "--levels", "S", "--workers", "1",
          "--state-dir", str(state)]
    try:
        r = subprocess.run(up, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (data / "master-S.sqlite").exists() and not (state / "master-S.sqlite").exists()
        assert mode(data) == 0o700 and mode(data / "spark-local") == 0o700
        wait_for(lambda: list((data / "spark-local").glob("blockmgr-*")), 60, "the worker's Spark scratch")
    finally:
        subprocess.run([sys.executable, "-m", "strata", "down", "--state-dir", str(state)], timeout=60)
