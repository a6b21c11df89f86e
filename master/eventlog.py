"""The master's event log: what to log for each accepted stimulus, restore, and checkpoints.

The master is a state machine driven by stimuli (a registration, an ingest batch, an advance, a
stopped query, a stream added at run time), in the style of dask/distributed's scheduler
(``stimulus -> transitions``).  For each stimulus it accepts the core decides what must be logged,
as events made here (:func:`register_event`, :func:`stop_event`, :func:`batch_events`,
:func:`advance_event`, :func:`stream_event`), writes them through :class:`EventLog`, and only then
applies them: a batch or an advance is in the log before anything of it is applied, and one that
cannot be logged is refused with nothing applied.  (A registration and a stop are applied, then
logged, under the same lock hold: nobody sees the state in between.)

Restart (:func:`restore`): a fresh core loads the last checkpoint, if any (:func:`load`), then
replays the events after it, each through the same transition the live stimulus took
(:meth:`MasterCore.apply <strata.master.core.MasterCore.apply>`), without logging it again.

Checkpoints (:func:`checkpoint_due`, :func:`checkpoint`): the master's whole state at one event
(:func:`snapshot`, under the core's lock), written outside the lock in the format of
:mod:`strata.master.checkpoint`, and the log before it dropped, so a restart replays only what came
after.  No I/O but the store's calls; no lock of its own (the core's is taken where needed).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Callable

import pyarrow as pa

from strata.arrowio import to_ipc
from strata.chunking.chunker import ChunkingError
from strata.errors import one_line

from . import checkpoint as ckpt
from .admission import Refused
from .queries import QueryInfo, query_number
from .store import StateMismatch

if TYPE_CHECKING:
    from .core import MasterCore

__all__ = ["EventLog", "LogEvent", "register_event", "stop_event", "batch_events", "advance_event", "stream_event",
           "shed_event", "restore", "snapshot", "load", "checkpoint_due", "checkpoint"]

#: one event as the store writes it: (kind, body, Arrow IPC data or None)
LogEvent = tuple[str, dict, "bytes | None"]


# ---- what to log for each stimulus ------------------------------------------------------------------
def register_event(query_id: str, owner: str, text: str, roles=()) -> LogEvent:
    """A query registered (restored as the same query id, owner, roles and text)."""
    return "register", {"query_id": query_id, "owner": owner, "text": text, "roles": sorted(roles)}, None


def stop_event(info: QueryInfo, reason: str) -> LogEvent:
    """A query stopped (cancelled, revoked, failed) after instant ``info.revoked_after``."""
    return "remove", {"query_id": info.query_id, "revoked_after": info.revoked_after, "reason": reason,
                      "state": info.state, "error": info.error}, None


def advance_event(upto: int | None, finish: bool) -> LogEvent:
    """Instants closed up to ``upto`` (or all of them: ``finish``)."""
    return "advance", {"upto": upto, "finish": finish}, None


def batch_events(stream: str, kept: pa.Table, rows: int, producer: str | None, seq: int,
                 advance_upto: int | None) -> list[LogEvent]:
    """One producer batch: its ``rows`` kept rows (only what the shepherd let through reaches the
    disk; none: no ingest event), with its producer's sequence number, then its advance."""
    events: list[LogEvent] = []
    if rows:
        events.append(("ingest", {"stream": stream} | ({"producer": producer, "seq": seq} if producer else {}),
                       to_ipc(kept)))
    if advance_upto is not None:
        events.append(advance_event(advance_upto, False))
    return events


def stream_event(schema) -> LogEvent:
    """A stream declared at run time."""
    return "stream", {"name": schema.name, "columns": [list(c) for c in schema.columns]}, None


def shed_event(body: dict) -> LogEvent:
    """A batch's load-shedding decision (master/shedding.py :meth:`Decision.body`), logged before the
    batch's kept rows, so a restart keeps exactly the same rows and sheds the same later ones."""
    return "shed", body, None


# ---- writing ----------------------------------------------------------------------------------------
class EventLog:
    """The core's writes to its ``store`` (a :class:`~strata.master.store.MasterStore`; None: no
    log, nothing is written), counted toward the next checkpoint, and the checkpoints' counters.

    ``count(reason)`` counts a refusal (a batch that could not be written: ``log_failed``)."""

    def __init__(self, store, count: Callable[[str], None]):
        self.store = store
        self._count = count
        self.rows = 0  # rows logged since the last checkpoint
        self.events = 0  # events logged since the last checkpoint
        self.checkpoints = 0
        self.checkpoint_failures = 0
        self.checkpoint_running = False
        self.last_checkpoint: dict = {}

    def append(self, event: LogEvent) -> None:
        """Log one event of a registration or a stop (what the store raises, it raises)."""
        if self.store is not None:
            kind, body, _ = event
            self.store.append(kind, body)
            self.events += 1

    def write(self, events: list[LogEvent], producer: str | None = None, seq: int = 0, what: str = "batch") -> None:
        """Write events (and a producer's high-water mark) in one transaction, or refuse (counted
        ``log_failed``) with nothing written: the caller applies nothing then."""
        if self.store is None or not events and producer is None:
            return
        try:
            if hasattr(self.store, "append_batch"):
                self.store.append_batch(events, producer, seq)
            else:  # a minimal store (tests): one event at a time
                for kind, body, data in events:
                    self.store.append(kind, body, data)
            self.events += len(events)
        except Exception as e:  # noqa: BLE001 - disk full, I/O error, closed store: nothing is applied
            self._count("log_failed")
            raise Refused(f"{what} not written to the event log ({one_line(e) or type(e).__name__}); "
                          f"nothing of it was applied", "log_failed") from None


# ---- restart ----------------------------------------------------------------------------------------
def restore(core: "MasterCore") -> dict:
    """Replay ``core.store``'s checkpoint and log into ``core`` (fresh); returns what was restored.

    The chunks it makes are computed again by the workers; results a client already has are
    skipped by its ``resume_after_ts``.  Cancelled, failed and revoked queries come back stopped,
    after the same instant."""
    n = {"queries": 0, "batches": 0, "chunks": 0}
    store = core.store
    if store is None:
        return n
    with core.cond:
        top, after, snap = 0, 0, None
        try:
            snap = ckpt.decode(store.read_checkpoint())
            if snap is not None:
                top, after = load(core, snap), snap.upto_seq
        except (ChunkingError, ValueError) as e:
            k = getattr(snap, "meta", {}).get("pipeline", {}).get("chunker", {}).get("chunk_instants")
            hint = f"start the master with --chunk-seconds {k * core.config.instant_seconds:g} or " if \
                k and k != core.pipeline.chunker.K else ""
            raise StateMismatch(f"{getattr(store, 'path', 'state')}: cannot continue from its checkpoint "
                                f"({one_line(e)}); {hint}move the file away to start afresh") from None
        if snap is not None:
            n |= {"checkpoint": after, "queries": len(core.queries), "chunks": len(snap.chunks)}
        for ev in store.events(after=after):
            chunks = core.apply(ev.kind, ev.body, ev.data)
            if ev.kind == "register":
                top = max(top, query_number(ev.body["query_id"]))
                n["queries"] += 1
            elif ev.kind == "ingest":
                n["batches"] += 1
            elif ev.kind == "advance":
                n["chunks"] += chunks
            elif ev.kind == "stream":
                n["streams"] = n.get("streams", 0) + 1
        core.query_ids = itertools.count(top + 1)
        marks = getattr(store, "producers", None)
        core.producers = dict(marks()) if marks is not None else {}
        n["producers"] = len(core.producers)
    return n


# ---- checkpoints (issue 14) -------------------------------------------------------------------------
def checkpoint_due(core: "MasterCore") -> bool:
    """Whether to checkpoint now: ``checkpoint_rows`` rows or ``checkpoint_events`` events were
    logged since the last one, and the backlog (whose chunks the checkpoint holds) is small: at
    most a quarter of ``checkpoint_rows`` rows, or at most half the rows the checkpoint drops from
    the log (a backlog that does not drain: each checkpoint then still shrinks the state file, which
    stays within a few times ``max(checkpoint_rows, max_backlog_rows)`` rows)."""
    if core.store is None or not hasattr(core.store, "write_checkpoint"):
        return False
    rows, events = core.eventlog.rows, core.eventlog.events
    if not ((core.checkpoint_rows and rows >= core.checkpoint_rows)
            or (core.checkpoint_events and events >= core.checkpoint_events)):
        return False
    return core.backlog_rows() <= max(core.checkpoint_rows // 4, rows // 2)


def snapshot(core: "MasterCore") -> ckpt.Snapshot:
    """``core``'s state as of the newest logged event (take it under ``core.cond``; every logged
    event is applied under it)."""
    pmeta, tables, chunks = core.pipeline.export_state()
    queries = [{"query_id": i.query_id, "text": i.text, "owner": i.owner, "roles": list(i.roles),
                "rewritten": i.rewritten, "r2s": i.r2s,
                "columns": list(i.columns), "base": i.base, "dropped_upto": i.dropped_upto, "ended": i.ended,
                "revoked_after": i.revoked_after, "state": i.state, "error": i.error, "last_ts": i.last_ts}
               for i in core.queries.values()]
    meta = {"queries": queries, "live": list(core.pipeline.queries), "pipeline": pmeta,
            "streams": [[n, [list(c) for c in cols]] for n, cols in core.added_streams.items()],
            "last_input_ts": core.last_input_ts, "last_output_ts": core.last_output_ts,
            "finished": core.finished, "logged": [core.eventlog.rows, core.eventlog.events],
            "shedding": core.shedder.export()}
    return ckpt.Snapshot(core.store.last_seq(), meta, tables, chunks,
                         {q: list(i.results) for q, i in core.queries.items() if i.results})


def checkpoint(core: "MasterCore") -> dict:
    """Snapshot under the lock, write it and drop the log before it outside; returns what was done
    (also in status).  Raises what the store raises (nothing changed then; counted)."""
    log = core.eventlog
    t0 = time.perf_counter()
    with core.cond:
        snap = snapshot(core)
        log.checkpoint_running = True
    sizes: list[int] = []
    try:
        dropped = core.store.write_checkpoint(snap.upto_seq, ckpt.encode(snap, sizes))
    except Exception:
        with core.cond:
            log.checkpoint_failures += 1
            log.checkpoint_running = False
        raise
    rows, events = snap.meta["logged"]
    with core.cond:
        log.rows -= rows
        log.events -= events
        log.checkpoints += 1
        log.checkpoint_running = False
        log.last_checkpoint = {"upto_seq": snap.upto_seq, "events_dropped": dropped,
                               "bytes": sum(sizes), "chunks": len(snap.chunks),
                               "seconds": round(time.perf_counter() - t0, 3)}
        return dict(log.last_checkpoint)


def load(core: "MasterCore", snap: ckpt.Snapshot) -> int:
    """Take a checkpoint into the fresh ``core``; returns the largest query number it knew."""
    meta = snap.meta
    for name, cols in meta.get("streams", []):  # before the queries that read them
        core.add_stream(name, [tuple(c) for c in cols], log=False)
    infos = {q["query_id"]: q for q in meta["queries"]}
    for qid in meta["live"]:  # the chunker's queries, in their order
        core.pipeline.add_query(infos[qid]["text"], query_id=qid,
                                principal=(infos[qid]["owner"], frozenset(infos[qid].get("roles", ()))))
    core.pipeline.import_state(meta["pipeline"], snap.tables, snap.chunks)
    top = 0
    for q in meta["queries"]:
        info = QueryInfo(q["query_id"], q["text"], q["owner"], q["rewritten"], q["r2s"], list(q["columns"]),
                         base=int(q["base"]), dropped_upto=q["dropped_upto"], ended=bool(q["ended"]),
                         revoked_after=q["revoked_after"], state=q["state"], error=q["error"], last_ts=q["last_ts"],
                         roles=tuple(q.get("roles", ())))
        info.results = snap.results.get(info.query_id, [])
        info.kept_rows = sum(r.rows.num_rows for r in info.results)
        core.queries[info.query_id] = info
        top = max(top, query_number(info.query_id))
    core.last_input_ts, core.last_output_ts = meta["last_input_ts"], meta["last_output_ts"]
    core.finished = bool(meta["finished"])
    core.shedder.load(meta.get("shedding"))
    core.admit(snap.chunks)
    core.eventlog.checkpoints, core.eventlog.last_checkpoint = 0, {"upto_seq": snap.upto_seq, "restored": True}
    return top
