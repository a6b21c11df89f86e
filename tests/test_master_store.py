"""Master persistence as plain logic: the event log replays into the same chunks; sessions come back
by token digest; an S master's disk never holds a TS tuple; revocation is logged and survives a restart."""

from __future__ import annotations

import sqlite3
import time
from functools import partial

import pyarrow as pa
import pytest

from strata.chunking.codec import encode_chunk
from strata.chunking.model import ChunkResult
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.core import MasterCore
from strata.master.sessions import Sessions
from strata.master.store import MasterStore, StateMismatch, config_fingerprint, token_digest
from strata.users import AuthError, UserStore

from .tables import two_per_instant

QUERIES = ["SELECT sid, AVG(bp) FROM Vitals [ROWS 3] GROUP BY sid", "SELECT COUNT(*) FROM Vitals"]
MARKER = 987654.25  # a TS tuple's value that must never reach the S master's disk

#: ``vitals(ts0, n)``: ``n`` tuples, two per instant from ``ts0``, levels U, C, S, TS in turn; the TS ones carry MARKER
vitals = partial(two_per_instant, bp=lambda i, t: MARKER if i % 4 == 3 else float(100 + i))


def make(tmp_path, cfg, level="S"):
    store = MasterStore(tmp_path / "m.sqlite", cfg.lattice.parse(level), config_fingerprint(cfg))
    return MasterCore(cfg, level, chunk_instants=2, store=store), store


def drive(core):
    core.register("ann", QUERIES[:1])
    core.ingest("Vitals", vitals(1, 8), None)
    core.advance(upto_ts=3)
    core.register("bob", QUERIES[1:])
    core.ingest("Vitals", vitals(4, 8), None)
    core.advance(upto_ts=6)
    core.ingest("Vitals", vitals(7, 6), None)
    core.advance(finish=True)


def chunk_bytes(core):
    return [encode_chunk(core.pipeline.chunks[c]) for c in sorted(core.pipeline.chunks)]


def test_replayed_log_makes_the_same_chunks_and_queries(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    drive(core)
    want = chunk_bytes(core)
    assert len(want) >= 4
    store.close()
    again, store2 = make(tmp_path, cfg)
    restored = again.restore()
    assert restored["queries"] == 2 and restored["batches"] == 3
    assert chunk_bytes(again) == want
    assert {q: (i.owner, i.text) for q, i in again.queries.items()} == \
        {q: (i.owner, i.text) for q, i in core.queries.items()}
    assert again.register("cid", ["SELECT bp FROM Vitals"])[0].query_id == "q3"  # ids continue
    store2.close()


def test_a_state_file_of_the_former_page_size_still_restores(tmp_path, monkeypatch):
    """New files get ``PAGE_SIZE`` pages (large ingest blobs write faster); a file written with
    SQLite's default 4 KiB pages (before that change) keeps them and restores the same chunks."""
    from strata.master import store as S

    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    assert store._db.execute("PRAGMA page_size").fetchone()[0] == S.PAGE_SIZE
    store.close()
    (tmp_path / "m.sqlite").unlink()
    monkeypatch.setattr(S, "PAGE_SIZE", 4096)
    core, store = make(tmp_path, cfg)
    drive(core)
    want = chunk_bytes(core)
    store.close()
    monkeypatch.undo()
    again, store2 = make(tmp_path, cfg)
    assert store2._db.execute("PRAGMA page_size").fetchone()[0] == 4096
    assert again.restore()["batches"] == 3
    assert chunk_bytes(again) == want
    store2.close()


def test_s_master_never_persists_a_ts_tuple(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    drive(core)
    store.close()
    raw = (tmp_path / "m.sqlite").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.glob("m.sqlite-*"))
    assert pa.py_buffer(pa.array([MARKER]).buffers()[1]).to_pybytes() not in raw
    rows = sqlite3.connect(tmp_path / "m.sqlite").execute("SELECT data FROM events WHERE kind='ingest'").fetchall()
    from strata.arrowio import from_ipc

    levels = {lv for (data,) in rows for lv in from_ipc(data).column("level").to_pylist()}
    assert levels <= {"U", "C", "S"}


def test_rejected_input_is_not_logged(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    core.register("ann", QUERIES[:1])
    core.ingest("Vitals", vitals(1, 4), None)
    core.advance(upto_ts=5)
    n = store.count()
    with pytest.raises(ValueError):  # late: instants below 5 are closed
        core.ingest("Vitals", vitals(2, 2), None)
    with pytest.raises(ValueError):
        core.ingest("Nope", vitals(9, 2), None)
    assert store.count() == n


def test_state_of_another_level_or_config_is_refused(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    store.close()
    with pytest.raises(StateMismatch, match="level-S master"):
        MasterStore(tmp_path / "m.sqlite", "TS", config_fingerprint(cfg))
    other = parse_config(BATTLEFIELD_TOML + "\n[streams.Extra]\nx = \"double\"\n")
    with pytest.raises(StateMismatch, match="different configuration"):
        MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(other))


def test_sessions_survive_a_restart_by_digest_only(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    users = UserStore(tmp_path / "users.json", cfg.lattice)
    users.add("ann", "TS", "pw")
    users.add("bob", "S", "pw")
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    s1 = Sessions(users, "S", persist=store)
    ann = s1.login("ann", "pw", "S").token
    bob = s1.login("bob", "pw", "S").token
    gone = s1.login("ann", "pw", "S").token
    s1.logout(gone)
    store.close()
    assert ann.encode() not in (tmp_path / "m.sqlite").read_bytes()
    users.set_clearance("bob", "C")  # downgraded while the master was down
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    s2 = Sessions(users, "S", persist=store)
    assert s2.restore() == 1
    assert s2.check(ann).principal.user == "ann"
    for t in (bob, gone, "forged"):
        with pytest.raises(AuthError):
            s2.check(t)
    assert {s.token_sha256 for s in store.sessions()} == {token_digest(ann)}


def test_revocation_stops_only_that_users_queries_and_survives_restart(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    core, store = make(tmp_path, cfg)
    a = core.register("ann", QUERIES[:1])[0].query_id
    b = core.register("bob", QUERIES[:1])[0].query_id
    core.ingest("Vitals", vitals(1, 8), None)
    core.advance(upto_ts=3)
    assert core.revoke_user("ann") == [a]
    assert core.queries[a].revoked_after == 3 and core.queries[a].state == "revoked"  # instants <= 3 were closed
    assert not core.queries[a].ended  # the chunks it was cut into before the switch are still to be released
    for cid in sorted(core.pipeline.chunks):  # results of those chunks still deliver, then the query ends
        core.on_result(cid, "w1", [ChunkResult(qc.query_id, cid, pa.table({"ts": [qc.instants[0]]}))
                                   for qc in core.pipeline.chunks[cid].queries])
    assert core.queries[a].ended and core.queries[a].last_ts == 3 and core.queries[a].results
    core.ingest("Vitals", vitals(4, 8), None)
    new = core.advance(upto_ts=7)
    later = [c for c in core.pipeline.chunks.values() if c.first_ts >= 4]
    assert new and later and all({q.query_id for q in c.queries} == {b} for c in later)  # branch not computed
    store.close()
    again, store2 = make(tmp_path, cfg)
    again.restore()
    assert again.queries[a].revoked_after == 3 and not again.queries[b].ended
    assert all({q.query_id for q in c.queries} == {b} for c in again.pipeline.chunks.values() if c.first_ts >= 4)
    store2.close()


def test_logout_ends_sessions_not_queries_and_survives_restart(tmp_path):
    """``strata users logout``: every session the user had ends (also after a master restart),
    the user's queries keep running, a new login works; other users are untouched."""
    from strata.master.users_watch import UsersWatch

    cfg = parse_config(BATTLEFIELD_TOML)
    users = UserStore(tmp_path / "users.json", cfg.lattice)
    users.add("ann", "TS", "pw")
    users.add("bob", "S", "pw")
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    wall = [time.time() - 60]  # these logins happened a minute ago
    sessions = Sessions(users, "S", persist=store, wall=lambda: wall[0])
    core = MasterCore(cfg, "S")
    watch = UsersWatch(core, sessions, users)
    old = [sessions.login("ann", "pw", "S").token for _ in range(2)]
    bob = sessions.login("bob", "pw", "S").token
    qid = core.register("ann", QUERIES[:1])[0].query_id
    assert watch.check() == []
    # the administrator's switch; the file's time is the real clock, later than the fake logins
    users.end_sessions("ann")
    assert users.load()["ann"].clearance == "TS" and users.authenticate("ann", "pw", "S")
    wall[0] = users.load()["ann"].sessions_after + 1
    assert watch.check() == []  # nobody is revoked ...
    for t in old:  # ... but ann's sessions are over
        with pytest.raises(AuthError):
            sessions.check(t)
    assert sessions.check(bob).principal.user == "bob"
    assert core.queries[qid].revoked_after is None and not core.queries[qid].ended
    assert sessions.logouts == 2
    new = sessions.login("ann", "pw", "S").token  # opened after the logout: stays
    watch._stamp = None
    watch.check()
    assert sessions.check(new).principal.user == "ann"
    # a restarted master takes back bob's and the new session, not the old ones
    store.close()
    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    again = Sessions(users, "S", persist=store)
    assert again.restore() == 2
    assert again.check(new) and again.check(bob)
    for t in old:
        with pytest.raises(AuthError):
            again.check(t)


def test_replaced_password_ends_old_sessions(tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    users = UserStore(tmp_path / "users.json", cfg.lattice)
    users.add("ann", "TS", "old pw")
    assert users.load()["ann"].sessions_after == 0.0  # a new user has nothing to end
    sessions = Sessions(users, "S", wall=lambda: 0.0)  # opened "long ago"
    token = sessions.login("ann", "old pw", "S").token
    users.add("ann", "TS", "new pw", replace=True)
    from strata.master.users_watch import UsersWatch

    UsersWatch(MasterCore(cfg, "S"), sessions, users).check()
    with pytest.raises(AuthError):
        sessions.check(token)
