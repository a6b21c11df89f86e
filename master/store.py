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
        _private_files(self.path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new file only, like auto_vacuum
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a new file only, and before WAL writes its header
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        self._check_meta(level, fingerprint)
        _private_files(self.path)  # -wal/-shm exist now: they inherited 0600; make sure

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
        with self._lock:
            cur = self._db.execute("INSERT INTO events (kind, body, data) VALUES (?, ?, ?)",
                                   (kind, json.dumps(body or {}, sort_keys=True), data))
            return int(cur.lastrowid)

    def append_batch(self, events: list[tuple[str, dict, bytes | None]], producer: str | None = None,
                     seq: int | None = None) -> list[int]:
        """Append ``events`` (kind, body, data) and, with ``producer``, set its high-water mark to ``seq``,
        all in one transaction: after a crash either all of it is in the log or none of it.  Raises
        (sqlite3.Error, OSError) with nothing written."""
        def body() -> list[int]:
            ids = [int(self._db.execute("INSERT INTO events (kind, body, data) VALUES (?, ?, ?)",
                                        (kind, json.dumps(body or {}, sort_keys=True), data)).lastrowid)
                   for kind, body, data in events]
            if producer is not None:
                self._db.execute("INSERT INTO producers VALUES (?, ?) ON CONFLICT(producer) DO UPDATE SET "
                                 "seq = max(seq, excluded.seq)", (producer, int(seq)))
            return ids

        return self._transaction(body)

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
        new = cur + 1
        batch: list[tuple[int, str, bytes]] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if batch:
                self._transaction(lambda: self._db.executemany("INSERT INTO checkpoint VALUES (?, ?, ?)", batch))
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

        dropped = self._transaction(swap)
        with self._lock:
            self._db.executescript("PRAGMA incremental_vacuum;")  # sqlite3_exec steps it to the end (execute: one page)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return int(dropped)

    def _transaction(self, body):
        """``body()`` in one write transaction under the store's lock; rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = body()
                self._db.execute("COMMIT")
                return out
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

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
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)",
                             (token_digest(token), user, level, created))

    def drop_session(self, token_sha256: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE token_sha256 = ?", (token_sha256,))

    def drop_user_sessions(self, user: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sessions WHERE user = ?", (user,))

    def sessions(self) -> list[StoredSession]:
        with self._lock:
            rows = self._db.execute("SELECT token_sha256, user, level, created FROM sessions").fetchall()
        return [StoredSession(*r) for r in rows]


def _private_files(path: Path) -> None:
    """The log and SQLite's ``-wal``/``-shm`` readable by this user only (0600), in a
    directory made 0700 if this makes it (an existing one keeps the mode it was given).

    The database file is created 0600 before SQLite opens it: SQLite creates ``-wal``,
    ``-shm`` and ``-journal`` with the mode of the database file, so they are born 0600
    too (no window in which they hold S tuples at 0644).  A process-wide umask would do
    the same but would also change the mode of every file other threads create meanwhile.
    Files an older version left readable are tightened here."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
