"""What a master must not forget across a restart, in one SQLite file under its state dir.

One ordered event log, written before a call is acknowledged:

* ``register``  a query (id, owner, text);
* ``remove``    a query stopped: cancelled by its owner, failed (with its one-line error), or
  revoked (owner removed or downgraded); with the last instant it covers (``revoked_after``);
* ``ingest``    a batch the pipeline accepted (Arrow IPC bytes + the session's source level);
* ``advance``   instants closed up to a timestamp, or ``finish``.

A *checkpoint* (:mod:`strata.master.checkpoint`) stands for every event up to its ``upto_seq``:
it is written as a new generation of the ``checkpoint`` table, then one transaction makes it
current and deletes the previous one and those events (:meth:`MasterStore.write_checkpoint`),
so the log holds only what came after it.

A producer's batch (its rows, its advance) and the producer's new high-water
sequence number (table ``producers``, keyed ``user/producer_id``) are written
in one transaction (:meth:`MasterStore.append_batch`) *before* the batch is
applied in memory: a batch is either in the log with its mark or not at all,
and a re-sent batch at or below the mark is recognised after a restart.

plus the live sessions (only a SHA-256 of each token is stored) and the
configuration's fingerprint.  A restarted master loads the checkpoint, then replays
the log after it into its pipeline: the same calls in the same order make the same
chunks, which are computed again (as are the chunks the checkpoint holds unreleased); a client resumes by subscribing after the last instant it
acknowledged (``resume_after_ts``), so it sees each result once.

Writes use ``synchronous=FULL`` in WAL mode: a batch whose Ingest call returned
survives a crash of the master or of its host.  A new file gets 64 KiB pages
(:data:`PAGE_SIZE`): ingest batches are blobs of megabytes.

Standby masters (:mod:`strata.master.standby`): an active master's store tells its ``listener``
every write right after it commits, under the store's lock (so in commit order), as a record
``(kind, body, data)``; a standby's store applies the same records (:meth:`MasterStore.apply_shipped`)
after installing a copy of the active's file (:meth:`MasterStore.snapshot_to`,
:meth:`MasterStore.install_snapshot`), and so holds the same events under the same seq numbers, the
same producers' marks, sessions and checkpoint.  The master's **epoch** (``meta``: ``epoch``,
``epoch_owner``) counts the masters that became active on this history.  Without a listener
nothing of this runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from strata.private import private_dir

__all__ = ["MasterStore", "Event", "StoredSession", "StateMismatch", "token_digest", "config_fingerprint"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    body TEXT NOT NULL DEFAULT '{}',
    data BLOB
);
CREATE TABLE IF NOT EXISTS sessions (
    token_sha256 TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    level TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS producers (
    producer TEXT PRIMARY KEY,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoint (
    gen INTEGER NOT NULL,
    name TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (gen, name)
);
"""


#: SQLite page size of a new state file.  Ingest events are Arrow batches of up to a few MB, which
#: SQLite keeps in chains of overflow pages: 64 KiB pages wrote 12 batches of 65,536 Vitals rows
#: (35 MB) in 0.18-0.20 s against 0.38-0.47 s with the default 4 KiB (bench/NOTES.md)
PAGE_SIZE = 65536


class StateMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class Event:
    seq: int
    kind: str
    body: dict
    data: bytes | None


@dataclass(frozen=True)
class StoredSession:
    token_sha256: str
    user: str
    level: str
    created: float  # wall clock (time.time())


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class MasterStore:
    def __init__(self, path: Path | str, level: str, fingerprint: str):
        self.path = Path(path)
        self.level, self.fingerprint = level, fingerprint
        #: called under the lock with (kind, body, data) after each committed write (an active master
        #: with standbys ships them: :class:`strata.master.log_shipping.LogShipper`); None: nobody listens
        self.listener = None
        self._lock = threading.Lock()
        with self._lock:
            self._open()
        self._check_meta(level, fingerprint)
        _private_files(self.path)  # -wal/-shm exist now: they inherited 0600; make sure

    def _open(self) -> None:
        """Open the file (with the lock held)."""
        _private_files(self.path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new file only, like auto_vacuum
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a new file only, and before WAL writes its header
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def _ship(self, kind: str, body: dict, data: bytes | None = None) -> None:
        """Tell the listener of a committed write (call with the lock held, right after the commit)."""
        if self.listener is not None:
            self.listener(kind, body, data)

    def _check_meta(self, level: str, fingerprint: str) -> None:
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            with self._lock:
                self._db.executemany("INSERT INTO meta VALUES (?, ?)",
                                     [("level", level), ("config", fingerprint), ("created", str(time.time()))])
            return
        if meta.get("level") != level:
            raise StateMismatch(f"{self.path}: state of a level-{meta.get('level')} master, not {level}")
        if meta.get("config") != fingerprint:
            raise StateMismatch(f"{self.path}: written under a different configuration (lattice or streams "
                                f"changed); move the file away to start this master afresh")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- events --------------------------------------------------------------------------
    def append(self, kind: str, body: dict | None = None, data: bytes | None = None) -> int:
        text = json.dumps(body or {}, sort_keys=True)
        with self._lock:
            cur = self._db.execute("INSERT INTO events (kind, body, data) VALUES (?, ?, ?)", (kind, text, data))
            seq = int(cur.lastrowid)
            if self.listener is not None:
                self._ship(*_batch_record([(seq, kind, text, data)], None, None))
            return seq

    def append_batch(self, events: list[tuple[str, dict, bytes | None]], producer: str | None = None,
                     seq: int | None = None) -> list[int]:
        """Append ``events`` (kind, body, data) and, with ``producer``, set its high-water mark to ``seq``,
        all in one transaction: after a crash either all of it is in the log or none of it.  Raises
        (sqlite3.Error, OSError) with nothing written."""
        rows = [(kind, json.dumps(body or {}, sort_keys=True), data) for kind, body, data in events]

        def body() -> list[int]:
            ids = [int(self._db.execute("INSERT INTO events (kind, body, data) VALUES (?, ?, ?)", row).lastrowid)
                   for row in rows]
            if producer is not None:
                self._db.execute("INSERT INTO producers VALUES (?, ?) ON CONFLICT(producer) DO UPDATE SET "
                                 "seq = max(seq, excluded.seq)", (producer, int(seq)))
            return ids

        def shipped(ids: list[int]) -> None:
            self._ship(*_batch_record([(i, *row) for i, row in zip(ids, rows)], producer, seq))

        return self._transaction(body, shipped if self.listener is not None else None)

    def producers(self) -> dict[str, int]:
        """Every producer's high-water mark: the largest batch seq logged for it."""
        with self._lock:
            rows = self._db.execute("SELECT producer, seq FROM producers").fetchall()
        return {str(p): int(q) for p, q in rows}

    def events(self, after: int = 0) -> Iterator[Event]:
        """The logged events with a sequence number above ``after``, in order (read in pages: a long
        log is never in memory at once)."""
        while True:
            with self._lock:
                rows = self._db.execute("SELECT seq, kind, body, data FROM events WHERE seq > ? ORDER BY seq "
                                        "LIMIT 256", (int(after),)).fetchall()
            if not rows:
                return
            for seq, kind, body, data in rows:
                yield Event(int(seq), kind, json.loads(body), data)
            after = int(rows[-1][0])

    def last_seq(self) -> int:
        """The sequence number of the newest event ever logged (0: none); compaction keeps counting."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return int(row[0]) if row else 0

    # -- checkpoints -----------------------------------------------------------------------
    #: a checkpoint is written in transactions of about this many bytes (the lock is held for one at a time)
    CHECKPOINT_BATCH_BYTES = 8 << 20

    def _checkpoint_gen(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'checkpoint_gen'").fetchone()
        return int(row[0]) if row else 0

    def write_checkpoint(self, upto_seq: int, parts: Iterable[tuple[str, bytes]]) -> int:
        """Replace the checkpoint by ``parts`` (name, bytes; taken one at a time, e.g. from a generator)
        standing for every event up to ``upto_seq``, and drop those events.

        The parts go in as a new generation, in transactions of about :data:`CHECKPOINT_BATCH_BYTES`,
        holding the store's lock for one of them at a time (producers' batches are logged in between;
        a part is encoded with no lock held).  One last transaction makes the new generation the
        checkpoint, deletes the old one and the events it stands for: after a crash at any moment
        either the old checkpoint and the whole log are there, or the new one and the log after it
        (an interrupted generation is ignored, and removed by the next write).  Returns the events
        dropped.  The freed pages are given back to the file system afterwards (a file made by this
        version) and the WAL is truncated."""
        with self._lock:
            cur = self._checkpoint_gen()
            self._db.execute("DELETE FROM checkpoint WHERE gen != ?", (cur,))
            self._ship("ckpt_clean", {"keep": cur})
        new = cur + 1
        batch: list[tuple[int, str, bytes]] = []
        size = 0

        def parts_shipped(rows) -> None:
            for gen, name, data in rows:
                self._ship("ckpt_part", {"gen": gen, "name": name}, data)

        def flush() -> None:
            nonlocal batch, size
            if batch:
                rows = batch
                self._transaction(lambda: self._db.executemany("INSERT INTO checkpoint VALUES (?, ?, ?)", rows),
                                  (lambda _: parts_shipped(rows)) if self.listener is not None else None)
            batch, size = [], 0

        for name, data in parts:
            batch.append((new, name, data))
            size += len(data)
            if size >= self.CHECKPOINT_BATCH_BYTES:
                flush()
        flush()

        def swap() -> int:
            self._db.execute("INSERT INTO meta VALUES ('checkpoint_gen', ?) ON CONFLICT(key) DO UPDATE SET "
                             "value = excluded.value", (str(new),))
            self._db.execute("DELETE FROM checkpoint WHERE gen != ?", (new,))
            return self._db.execute("DELETE FROM events WHERE seq <= ?", (int(upto_seq),)).rowcount

        dropped = self._transaction(swap, lambda _: self._ship("ckpt_swap", {"gen": new, "upto": int(upto_seq)}))
        self._compact()
        return int(dropped)

    def _compact(self) -> None:
        with self._lock:
            self._db.executescript("PRAGMA incremental_vacuum;")  # sqlite3_exec steps it to the end (execute: one page)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _transaction(self, body, committed=None):
        """``body()`` in one write transaction under the store's lock; rolled back if it raises.
        ``committed(result)`` runs after the commit, still under the lock (shipping, in commit order)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = body()
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            if committed is not None:
                committed(out)
            return out

    def read_checkpoint(self) -> dict[str, bytes]:
        """The parts of the checkpoint by name (empty: none was written)."""
        with self._lock:
            rows = self._db.execute("SELECT name, data FROM checkpoint WHERE gen = ?",
                                    (self._checkpoint_gen(),)).fetchall()
        return {str(n): bytes(d) for n, d in rows}

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    # -- sessions ------------------------------------------------------------------------------
    def save_session(self, token: str, user: str, level: str, created: float) -> None:
        self._save_session(token_digest(token), user, level, created)

    def _save_session(self, digest: str, user: str, level: str, created: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)", (digest, user, level, created))
            self._ship("session", {"sha": digest, "user": user, "level": level, "created": created})

    def drop_session(self, token_sha256: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE token_sha256 = ?", (token_sha256,))
            self._ship("drop_session", {"sha": token_sha256})

    def drop_user_sessions(self, user: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE user = ?", (user,))
            self._ship("drop_user", {"user": user})

    def sessions(self) -> list[StoredSession]:
        with self._lock:
            rows = self._db.execute("SELECT token_sha256, user, level, created FROM sessions").fetchall()
        return [StoredSession(*r) for r in rows]

    # -- standby masters: the epoch, a copy of the file, shipped writes ---------------------------
    def epoch(self) -> tuple[int, str]:
        """(epoch, the address of the master that began it); (0, "") for a file never made active
        by a master with standbys."""
        with self._lock:
            meta = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('epoch', 'epoch_owner')"))
        return int(meta.get("epoch") or 0), str(meta.get("epoch_owner") or "")

    def set_epoch(self, epoch: int, owner: str) -> None:
        """Make ``epoch`` (begun by the master at ``owner``) this file's epoch, durably."""
        def body() -> None:
            self._db.executemany("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                                 [("epoch", str(int(epoch))), ("epoch_owner", owner)])

        self._transaction(body, lambda _: self._ship("epoch", {"epoch": int(epoch), "owner": owner}))

    def snapshot_to(self, path: Path | str, then=None):
        """Copy the whole state file to ``path`` (SQLite's online backup: a consistent file of every
        committed write) and call ``then()`` before any later write commits (the lock is held
        throughout: an active master registers a new follower there, so that the records shipped
        to it are exactly those after the copy).  Returns what ``then`` returns."""
        path = Path(path)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))  # this user's only, from the start
        with self._lock:
            dst = sqlite3.connect(path)
            try:
                self._db.backup(dst)
            finally:
                dst.close()
            return then() if then is not None else None

    def install_snapshot(self, path: Path | str) -> None:
        """Replace this store's file by ``path`` (a :meth:`snapshot_to` copy of an active master's file,
        received by a standby), atomically: after a crash at any moment either the old file or the
        new one is there, whole.  Refused (:class:`StateMismatch`, nothing changed) if the copy is of
        another level or configuration."""
        path = Path(path)
        try:
            probe = sqlite3.connect(path)
            try:
                meta = dict(probe.execute("SELECT key, value FROM meta").fetchall())
                probe.execute("SELECT COUNT(*) FROM events").fetchone()
            finally:
                probe.close()
        except sqlite3.Error as e:
            raise StateMismatch(f"the copy of the active master's state file is not readable: {e}") from None
        if meta.get("level") != self.level or meta.get("config") != self.fingerprint:
            raise StateMismatch(f"the active master's state is of level {meta.get('level')} under "
                                f"{'the same' if meta.get('config') == self.fingerprint else 'another'} "
                                f"configuration; this master is of level {self.level}")
        os.chmod(path, 0o600)
        with self._lock:
            self._db.close()  # the last connection: SQLite checkpoints its WAL into the file and removes it
            for extra in ("-wal", "-shm", "-journal"):
                self.path.with_name(self.path.name + extra).unlink(missing_ok=True)
            os.replace(path, self.path)
            _fsync_dir(self.path.parent)
            self._open()

    def apply_shipped(self, kind: str, body: dict, data: bytes | None = None) -> None:
        """Apply one record an active master's store shipped (:attr:`listener`), as that store wrote it:
        events keep their seq numbers, a batch and its producer's mark commit in one transaction.
        Raises ValueError for a record this version does not know."""
        if kind == "batch":
            rows, off = [], 0
            for seq, ekind, text, size in body["events"]:
                blob = None
                if size is not None:
                    blob, off = bytes(data[off:off + int(size)]), off + int(size)
                rows.append((int(seq), ekind, text, blob))
            producer = body.get("producer")

            def write() -> None:
                self._db.executemany("INSERT OR REPLACE INTO events (seq, kind, body, data) VALUES (?, ?, ?, ?)", rows)
                if producer is not None:
                    self._db.execute("INSERT INTO producers VALUES (?, ?) ON CONFLICT(producer) DO UPDATE SET "
                                     "seq = max(seq, excluded.seq)", (producer, int(body["pseq"])))

            self._transaction(write)
        elif kind == "session":
            self._save_session(body["sha"], body["user"], body["level"], float(body["created"]))
        elif kind == "drop_session":
            self.drop_session(body["sha"])
        elif kind == "drop_user":
            self.drop_user_sessions(body["user"])
        elif kind == "ckpt_clean":
            with self._lock:
                self._db.execute("DELETE FROM checkpoint WHERE gen != ?", (int(body["keep"]),))
        elif kind == "ckpt_part":
            self._transaction(lambda: self._db.execute("INSERT OR REPLACE INTO checkpoint VALUES (?, ?, ?)",
                                                       (int(body["gen"]), body["name"], bytes(data or b""))))
        elif kind == "ckpt_swap":
            gen, upto = int(body["gen"]), int(body["upto"])

            def swap() -> None:
                self._db.execute("INSERT INTO meta VALUES ('checkpoint_gen', ?) ON CONFLICT(key) DO UPDATE SET "
                                 "value = excluded.value", (str(gen),))
                self._db.execute("DELETE FROM checkpoint WHERE gen != ?", (gen,))
                self._db.execute("DELETE FROM events WHERE seq <= ?", (upto,))

            self._transaction(swap)
            self._compact()
        elif kind == "epoch":
            self.set_epoch(int(body["epoch"]), str(body["owner"]))
        else:
            raise ValueError(f"unknown shipped record {kind!r} (the active master runs another version)")


def _batch_record(events: list[tuple[int, str, str, bytes | None]], producer: str | None,
                  seq: int | None) -> tuple[str, dict, bytes | None]:
    """The shipped record of one committed batch: its events (seq, kind, JSON text, data) and a
    producer's mark; the events' data are concatenated, each event naming its length."""
    blobs = [d for _, _, _, d in events if d is not None]
    body = {"events": [[seq_, kind, text, None if d is None else len(d)] for seq_, kind, text, d in events]}
    if producer is not None:
        body |= {"producer": producer, "pseq": int(seq)}
    return "batch", body, (None if not blobs else blobs[0] if len(blobs) == 1 else b"".join(blobs))


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _private_files(path: Path) -> None:
    """The log and SQLite's ``-wal``/``-shm`` readable by this user only (0600), in a
    directory only this user may enter (strata/private.py: made 0700, or tightened to it).

    The database file is created 0600 before SQLite opens it: SQLite creates ``-wal``,
    ``-shm`` and ``-journal`` with the mode of the database file, so they are born 0600
    too (no window in which they hold S tuples at 0644).  A process-wide umask would do
    the same but would also change the mode of every file other threads create meanwhile.
    Files an older version left readable are tightened here."""
    private_dir(path.parent)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for f in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        try:
            if f.stat().st_mode & 0o077:
                f.chmod(0o600)
        except FileNotFoundError:
            pass


def config_fingerprint(config) -> str:
    """What a stored log depends on: the lattice and the streams (not users, not cluster settings)."""
    streams = {name: [list(c) for c in s.columns] for name, s in sorted(config.streams.items())}
    doc = {"lattice": repr(config.lattice), "streams": streams, "instant": config.instant_seconds}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()
