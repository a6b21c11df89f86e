"""Synchronous replication, the active side: every committed write of the store shipped to standbys.

An active master with standbys (:mod:`strata.master.standby`) hands its store a listener
(:attr:`MasterStore.listener <strata.master.store.MasterStore.listener>`): :class:`LogShipper`
numbers every committed write (``lsn``, in commit order) and queues it for each attached standby.
A standby attaches with a copy of the state file taken under the store's lock
(:meth:`MasterStore.snapshot_to <strata.master.store.MasterStore.snapshot_to>`), so it gets exactly
the records after it; it is **in sync** once it confirmed the copy and the first batch after it.
The master acknowledges a write only once every standby in sync confirmed it (:meth:`LogShipper.wait`);
one that does not within ``ack_seconds`` (2 s), or falls more than :data:`MAX_QUEUE_BYTES` behind,
is detached (counted, logged) and the master goes on alone until it attaches again.

:meth:`LogShipper.serve` is one Follow call's stream (on the master's event loop): the copy in
pieces, ``snapshot_end``, then the records as they commit, a ``ping`` when idle.  The rest is plain
state under one condition (tests/test_standby.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from strata.rpc import strata_pb2 as pb

from .store import MasterStore

__all__ = ["LogShipper", "DEFAULT_ACK_SECONDS", "PING_SECONDS", "MAX_QUEUE_BYTES"]

log = logging.getLogger("strata.master")

#: seconds the active waits for a standby's confirmation of a write before it detaches it
DEFAULT_ACK_SECONDS = 2.0
PING_SECONDS = 0.5  # the active's pings on an idle Follow stream
PIECE = 1 << 20  # bytes of the state file's copy per record
MAX_QUEUE_BYTES = 512 << 20  # records waiting for one standby beyond which it is detached


class _Follower:
    def __init__(self, name: str):
        self.name = name
        self.base = 0  # the record the copy of the file stands for
        self.queue: deque = deque()  # (lsn, kind, body, data) committed after the copy, not yet sent
        self.bytes = 0
        self.confirmed = -1
        self.mark: int | None = None  # the last record of the first batch sent after the copy
        self.synced = False  # confirmed the copy and that batch: writes wait for it from now on
        self.detached: str | None = None


class LogShipper:
    """Ships every committed write of ``store`` (its :attr:`~MasterStore.listener`) to the attached
    standbys and waits for their confirmations (:meth:`wait`).  Records are numbered (``lsn``) in
    commit order; a standby attaches with a copy of the file taken under the store's lock, so it
    gets exactly the records after it."""

    def __init__(self, store: MasterStore, ack_seconds: float = DEFAULT_ACK_SECONDS,
                 max_queue_bytes: int = MAX_QUEUE_BYTES, clock=time.monotonic):
        self.store = store
        self.ack_seconds = float(ack_seconds)
        self.max_queue_bytes = int(max_queue_bytes)
        self._clock = clock
        self.cond = threading.Condition()
        self.lsn = 0
        self.followers: dict[int, _Follower] = {}
        self._ids = 0
        self.attached = 0  # attachments so far
        self.detached = 0  # standbys detached (no confirmation in time, too far behind)
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="master-follow")
        store.listener = self._on_write

    # -- called under the store's lock -----------------------------------------------------------------
    def _on_write(self, kind: str, body: dict, data: bytes | None) -> None:
        with self.cond:
            self.lsn += 1
            for f in self.followers.values():
                if f.detached:
                    continue
                f.queue.append((self.lsn, kind, body, data))
                f.bytes += len(data or b"")
                if f.bytes > self.max_queue_bytes:
                    self._detach(f, f"{f.bytes} bytes of records waiting for it (more than {self.max_queue_bytes})")
            self.cond.notify_all()

    # -- followers -------------------------------------------------------------------------------------
    def attach(self, name: str, copy: Path) -> _Follower:
        """A new standby: the store's file copied to ``copy`` and the standby registered, under the
        store's lock (no write in between)."""
        f = _Follower(name)

        def register() -> None:
            with self.cond:
                f.base = self.lsn
                self._ids += 1
                self.followers[self._ids] = f
                self.attached += 1

        self.store.snapshot_to(copy, then=register)
        return f

    def drop(self, f: _Follower) -> None:
        with self.cond:
            for k, v in list(self.followers.items()):
                if v is f:
                    del self.followers[k]
            f.queue.clear()
            self.cond.notify_all()

    def _detach(self, f: _Follower, why: str) -> None:  # with cond held
        if f.detached:
            return
        f.detached = why
        f.queue.clear()
        f.bytes = 0
        self.detached += 1
        log.warning("standby %s detached: %s; going on alone until it attaches again", f.name, why)
        self.cond.notify_all()

    def take(self, f: _Follower, timeout: float) -> list:
        """The records waiting for ``f`` (blocks up to ``timeout`` for one)."""
        with self.cond:
            if not f.queue and not f.detached:
                self.cond.wait(timeout)
            out = list(f.queue)
            f.queue.clear()
            f.bytes = 0
            if f.mark is None and not f.detached:
                f.mark = out[-1][0] if out else f.base
                self._check_synced(f)
            return out

    def confirm(self, f: _Follower, lsn: int) -> None:
        with self.cond:
            if lsn > f.confirmed:
                f.confirmed = int(lsn)
                self._check_synced(f)
                self.cond.notify_all()

    def _check_synced(self, f: _Follower) -> None:  # with cond held
        if not f.synced and not f.detached and f.mark is not None and f.confirmed >= f.mark:
            f.synced = True
            log.warning("standby %s in sync at record %d: writes are acknowledged once it stored them", f.name,
                        f.confirmed)

    def in_sync(self) -> int:
        with self.cond:
            return sum(1 for f in self.followers.values() if f.synced and not f.detached)

    def wait(self, lsn: int | None = None) -> bool:
        """Block until every standby in sync confirmed record ``lsn`` (default: the newest), at most
        ``ack_seconds``; those that did not are detached.  True if none was."""
        with self.cond:
            lsn = self.lsn if lsn is None else int(lsn)
            deadline = self._clock() + self.ack_seconds
            while True:
                behind = [f for f in self.followers.values() if f.synced and not f.detached and f.confirmed < lsn]
                if not behind:
                    return True
                left = deadline - self._clock()
                if left <= 0:
                    for f in behind:
                        self._detach(f, f"no confirmation of record {lsn} within {self.ack_seconds:g} s")
                    return False
                self.cond.wait(left)

    # -- the Follow stream (on the master's event loop) -------------------------------------------------
    async def serve(self, first, request_iterator, context):
        """The records of one Follow call: the copy of the state file in pieces, ``snapshot_end``, then
        the records as they are committed (a ``ping`` every :data:`PING_SECONDS` when idle)."""
        loop = asyncio.get_running_loop()

        def run(fn, *args):
            return loop.run_in_executor(self.pool, functools.partial(fn, *args))

        name = first.follower or context.peer()
        copy = self.store.path.with_name(f".{self.store.path.name}.follow-{uuid.uuid4().hex[:12]}")
        f = None
        reader = None
        try:
            f = await run(self.attach, name, copy)
            size = copy.stat().st_size
            log.warning("standby %s attached: a copy of the state file (%d bytes) at record %d", name, size, f.base)

            async def confirmations():  # every message after the first confirms (record 0: an empty log's copy)
                async for m in request_iterator:
                    self.confirm(f, int(m.confirmed))

            reader = asyncio.ensure_future(confirmations())
            with open(copy, "rb") as fh:
                while True:
                    piece = await run(fh.read, PIECE)
                    if not piece:
                        break
                    yield pb.LogRecord(kind="snapshot", lsn=f.base, data=piece)
            copy.unlink(missing_ok=True)
            yield pb.LogRecord(kind="snapshot_end", lsn=f.base, body=json.dumps({"bytes": size}).encode())
            while True:
                records = await run(self.take, f, PING_SECONDS)
                if f.detached:
                    await context.abort(grpc.StatusCode.ABORTED, f"detached: {f.detached}")
                if reader.done() and not records:
                    return  # the standby closed its side
                if not records:
                    yield pb.LogRecord(kind="ping", lsn=self.lsn)
                for lsn, kind, body, data in records:
                    yield pb.LogRecord(kind=kind, lsn=lsn, body=json.dumps(body).encode(), data=data or b"")
        finally:
            if reader is not None:
                if reader.done() and not reader.cancelled():
                    reader.exception()  # retrieved: a cancelled call's read error is no news
                reader.cancel()
            if f is not None:
                self.drop(f)
            copy.unlink(missing_ok=True)
