"""A master's checkpoint: its whole state at one point of its event log, so that a restart replays
only the log after that point, and the log before it can be dropped (compaction).

A checkpoint is a :class:`Snapshot` taken under the master's lock
(:func:`strata.master.eventlog.snapshot`) and written outside it (Arrow tables are immutable).  It
is stored as named parts in the store's ``checkpoint`` table, replacing the previous one and
deleting the events it stands for in one transaction (:meth:`MasterStore.write_checkpoint`):

* ``meta``: JSON: the log sequence number it stands for (``upto_seq``), the queries (text, owner,
  rewritten text, state, error, stop instant, last instant released, retention bookkeeping) and the
  pipeline's and chunker's scalars (:meth:`QueryPipeline.export_state`, :meth:`Chunker.export_state`);
* ``table:<key>``: one chunker table (a FROM item's history, its uncut rows, extra instants, a STATE
  query's snapshot) as Arrow IPC;
* ``chunk:<id>``: a chunk cut and not yet released, in the wire format of :mod:`strata.chunking.codec`:
  a restarted master computes it again, as it would any chunk of a replayed log;
* ``results:<query>:<run>``: the released results a query keeps for resuming subscribers, one Arrow
  table per run of results with one schema, cut back into results by the row counts in ``meta``.

Only what the master holds goes in (rows the shepherd kept: never a tuple above its level), in the
same 0600 file as the log.  Everything here is plain logic; the master calls it from a thread of
its own (:class:`Checkpointer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.codec import decode_chunk, encode_chunk
from strata.chunking.model import Chunk

from .pipeline import Released

__all__ = ["Snapshot", "encode", "decode", "Checkpointer", "VERSION"]

log = logging.getLogger("strata.master")

VERSION = 1


@dataclass
class Snapshot:
    upto_seq: int  # the newest event it stands for
    meta: dict  # JSON-able: queries, pipeline and chunker scalars
    tables: dict[str, pa.Table]  # the chunker's tables
    chunks: list[Chunk]  # cut, not released, oldest first
    results: dict[str, list[Released]] = field(default_factory=dict)  # per query, the results it keeps


def _runs(results: list[Released]) -> list[list[Released]]:
    """``results`` cut into runs whose row tables share one schema (one Arrow table each)."""
    runs: list[list[Released]] = []
    for r in results:
        if runs and runs[-1][0].rows.schema.equals(r.rows.schema):
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def encode(snap: Snapshot, sizes: list | None = None) -> Iterator[tuple[str, bytes]]:
    """The parts of ``snap`` to store (name, bytes), ``meta`` last, one at a time: the store writes
    each before the next is encoded, so a checkpoint of a large backlog never sits in memory
    whole.  ``sizes`` receives each part's length."""

    def part(name: str, data: bytes) -> tuple[str, bytes]:
        if sizes is not None:
            sizes.append(len(data))
        return name, data

    for k, t in snap.tables.items():
        yield part(f"table:{k}", to_ipc(t))
    for c in snap.chunks:
        yield part(f"chunk:{c.chunk_id}", encode_chunk(c))
    described = {}
    for qid, results in snap.results.items():
        rows = []
        for k, run in enumerate(_runs(results)):
            yield part(f"results:{qid}:{k}", to_ipc(pa.concat_tables([r.rows for r in run])))
            rows += [{"run": k, "rows": r.rows.num_rows, "chunk_id": r.chunk_id, "first_ts": r.first_ts,
                      "last_ts": r.last_ts, "error": r.error, "error_ts": r.error_ts} for r in run]
        described[qid] = rows
    meta = {"version": VERSION, "upto_seq": snap.upto_seq, "written": time.time(), **snap.meta,
            "results": described}
    yield part("meta", json.dumps(meta, sort_keys=True).encode())


def decode(parts: dict[str, bytes]) -> Snapshot | None:
    """The snapshot stored as ``parts`` (None: there is none).  Raises ValueError for a checkpoint
    of another format version."""
    if "meta" not in parts:
        return None
    meta = json.loads(parts["meta"])
    if meta.get("version") != VERSION:
        raise ValueError(f"checkpoint format {meta.get('version')!r}, this master reads {VERSION}")
    tables = {name[len("table:"):]: from_ipc(data, max_bytes=None)
              for name, data in parts.items() if name.startswith("table:")}
    chunks = sorted((decode_chunk(data) for name, data in parts.items() if name.startswith("chunk:")),
                    key=lambda c: c.chunk_id)
    results: dict[str, list[Released]] = {}
    for qid, described in meta.pop("results", {}).items():
        runs: dict[int, pa.Table] = {}
        offsets: dict[int, int] = {}
        out = []
        for d in described:
            k = int(d["run"])
            if k not in runs:
                runs[k] = from_ipc(parts[f"results:{qid}:{k}"], max_bytes=None)
                offsets[k] = 0
            rows = runs[k].slice(offsets[k], int(d["rows"]))
            offsets[k] += int(d["rows"])
            out.append(Released(qid, int(d["chunk_id"]), int(d["first_ts"]), int(d["last_ts"]), rows,
                                d.get("error"), d.get("error_ts")))
        results[qid] = out
    return Snapshot(int(meta["upto_seq"]), meta, tables, chunks, results)


class Checkpointer:
    """A thread that checkpoints ``core`` whenever :meth:`MasterCore.checkpoint_due` says so (looked
    at every ``period`` seconds).  A failed checkpoint (disk full) is logged and counted; the log
    stays whole and the next attempt comes after a minute."""

    def __init__(self, core, period: float = 0.5, retry_seconds: float = 60.0, turn=None):
        """``turn(kind)``: a context manager a checkpoint waits in (a trusted master's turns of the level)."""
        self.core = core
        self.turn = turn or contextlib.nullcontext
        self.period = period
        self.retry_seconds = retry_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)

    def start(self) -> "Checkpointer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if not self.core.checkpoint_due():
                    continue
                with self.turn("checkpoint"):
                    done = self.core.checkpoint()
                    log.info("checkpoint at event %s: %s", done["upto_seq"], done)
            except Exception as e:  # noqa: BLE001 - the log stays whole; try again later
                log.warning("checkpoint failed (the event log stays whole): %s", e)
                self._stop.wait(self.retry_seconds)
