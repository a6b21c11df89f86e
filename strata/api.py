"""The Python API: a session with a level's master, for programs (the CLI's commands use it too).

    import strata

    with strata.connect("127.0.0.1:7100", "jane", "S", tls_dir="state/tls", password="...") as s:
        q = s.register("SELECT sid, AVG(bp) AS a FROM Vitals [ROWS 100] GROUP BY sid")
        s.ingest("Vitals", frame, finish=True)          # a pandas DataFrame, a pyarrow Table or a file
        for instant, table in q.results():              # (instant, pyarrow.Table), in instant order
            ...
        q.to_pandas()                                   # every row so far, once the query ended

A :class:`Session` is one login (``user`` at ``level``: the master's level; the clearance may be
higher).  Everything it receives is what the CLI receives: rows at levels the session dominates, the
session's own queries, the cluster part of the status for operators only.  Errors are the typed
exceptions of :mod:`strata.client`, re-exported here: :class:`LoginFailed`, :class:`QueryRejected`
(a refused query, input or advance: ``code`` ``INVALID_ARGUMENT``/``OUT_OF_RANGE``),
:class:`PermissionDenied` (outside the session's roles), :class:`SessionEnded` (logged out, revoked),
:class:`QueryFailed` (a query failed at an instant: :meth:`Query.results` raises it after the rows
before that instant), all subclasses of :class:`StrataError`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .client import Client, IngestResult, LoginFailed, PermissionDenied, QueryRejected, SessionEnded
from .client import ClientError as StrataError
from .config import StreamSchema
from .errors import CliError
from .inputs import batches_of, read_input
from .punctuations import SCHEMA as PUNCTUATION_SCHEMA

__all__ = ["connect", "status_view", "Session", "Query", "QueryState", "Status", "IngestResult", "StrataError",
           "LoginFailed", "QueryRejected", "PermissionDenied", "SessionEnded", "QueryFailed", "BATCH_ROWS"]

#: rows per ingest batch (the CLI's default): the master logs and acknowledges each batch
BATCH_ROWS = 65536


class QueryFailed(StrataError):
    """A query failed at an instant (``error_ts``); its rows before that instant were delivered."""

    def __init__(self, query_id: str, error: str):
        super().__init__(f"query {query_id} failed: {error}", "FAILED", error)
        self.query_id = query_id
        self.error = error


@dataclass(frozen=True)
class QueryState:
    """A query as its owner sees it in the status."""
    query_id: str
    text: str           # the rewritten text
    state: str          # running, ended, cancelled, failed or revoked
    last_ts: int        # the last instant released for it (-1: none yet)
    error: str          # failed: the one-line reason


@dataclass(frozen=True)
class Status:
    """:meth:`Session.status`: the level, this session's user and roles, its own queries; ``cluster``
    (workers, backlog, counters, timings: the keys of ``strata status --json``) for operators only,
    else None."""
    level: str
    user: str
    roles: tuple[str, ...]
    queries: tuple[QueryState, ...]
    cluster: dict | None
    shedding: dict | None = None  # the level's load shedding, for every session (docs/semantics.md §10)


def connect(master: str, user: str, level: str | None = None, *, tls_dir: str | None = None,
            password: str | None = None, timeout: float = 60.0) -> Session:
    """Log ``user`` in at ``level`` on ``master`` (``host:port``, or a level's masters ``a:port,b:port``:
    the active one is found).  ``level``: the master's (None: whatever the master's level is).
    ``tls_dir``: a directory with the CA and a client certificate of the level (``strata up`` writes
    one; default ``$STRATA_TLS_DIR``; a plaintext master needs none).  ``password``: default
    ``$STRATA_PASSWORD``."""
    if password is None:
        password = os.environ.get("STRATA_PASSWORD")
        if password is None:
            raise LoginFailed("no password: pass password=... or set STRATA_PASSWORD", "UNAUTHENTICATED")
    if tls_dir is None:
        tls_dir = os.environ.get("STRATA_TLS_DIR") or None
    client = Client(master, tls_dir=tls_dir, level=level or None, timeout=timeout)
    try:
        client.login(user, password, level or "")
    except BaseException:
        client.close()
        raise
    return Session(client, user)


class Session:
    """One login on a level's master (:func:`connect`).  ``client``: the underlying
    :class:`strata.client.Client` for what this class does not wrap."""

    def __init__(self, client: Client, user: str):
        self.client = client
        self.user = user
        self._schemas: dict[str, StreamSchema] | None = None

    @property
    def level(self) -> str:
        return self.client.level

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries ---------------------------------------------------------------------------------
    def register(self, text: str) -> Query:
        """Register one continuous query (its rewritten text: :attr:`Query.text`)."""
        return self.register_all([text])[0]

    def register_all(self, texts: list[str]) -> list[Query]:
        """Register several queries in one call (all or none: a refused one raises QueryRejected)."""
        return [Query(self, r.query_id, r.rewritten) for r in self.client.register(list(texts))]

    def cancel(self, *queries: Query | str) -> None:
        """Stop queries of this user from the next instant."""
        self.client.cancel([q.query_id if isinstance(q, Query) else q for q in queries])

    def subscribe(self, queries: Iterable[Query | str] | None = None, *,
                  acked: dict[str, int] | None = None) -> Iterator[tuple[str, int, pa.Table]]:
        """``(query_id, instant, table)`` for every instant with rows of the given queries (default: all
        this session's), in instant order per query, until they end; survives a master restart or a
        standby's takeover exactly once (``acked``: query id → last instant received, updated in place;
        pass it again to resume).  A failed query raises :class:`QueryFailed` after its last rows."""
        ids = [q.query_id if isinstance(q, Query) else q for q in queries] if queries is not None else \
            [q.query_id for q in self.status().queries if q.state == "running"]
        if not ids:
            return
        for qid, table in self.client.follow(ids, acked):
            if table is None:
                state, error = self.client.ended.get(qid, ("ended", ""))
                if state == "failed":
                    raise QueryFailed(qid, error)
                continue
            yield from ((qid, ts, part) for ts, part in by_instant(table))

    # ---- input -----------------------------------------------------------------------------------
    def ingest(self, stream: str, data, *, labelled: bool = False, finish: bool = False,
               producer_id: str | None = None, batch_rows: int = BATCH_ROWS,
               reconnect_seconds: float = 120.0) -> IngestResult:
        """Send ``data`` to ``stream`` exactly once (the producer role).

        ``data``: a pyarrow Table or RecordBatch, a pandas DataFrame, or the path of a CSV / JSON-lines
        file (header ``ts,level,<attributes>``).  Columns ``ts`` (integer instants, non-decreasing),
        the stream's attributes, and ``level`` when ``labelled`` (rows carrying levels: the master
        keeps those its level dominates); without ``labelled`` every tuple is the session's level.
        The batches are numbered under ``producer_id`` (default: derived from the stream, the rows and
        these options, so sending the same data again applies nothing twice) and each is kept until
        the master has logged it: a lost connection is resumed from the first unacknowledged batch.
        ``finish``: this is all the input, close every instant.  A refused batch raises
        :class:`QueryRejected` with the master's one line (nothing after it was applied)."""
        table = self._table_of(stream, data)
        pid = producer_id or _derived_producer_id(stream, table, labelled, finish, batch_rows, self.level)
        batches = list(batches_of([(stream, table)], batch_rows))
        result = self.client.ingest_stream(batches, pid, labelled=labelled, reconnect_seconds=reconnect_seconds)
        if result.error:
            raise QueryRejected(f"ingest stopped: {result.error}", "INVALID_ARGUMENT", result.error)
        if finish:
            self.finish()
        return result

    def advance(self, upto: int) -> int:
        """Close the instants up to ``upto`` (the producer role); the number of chunks cut."""
        return self.client.advance(upto_ts=upto)

    def finish(self) -> int:
        """The input is complete: close every instant (a producer or an operator)."""
        return self.client.advance(finish=True)

    def streams(self) -> dict[str, list[tuple[str, str]]]:
        """Every stream the master accepts: name → [(attribute, type), ...]."""
        return {name: list(s.columns) for name, s in self._streams().items()}

    def add_stream(self, name: str, attributes: list[tuple[str, str]]) -> None:
        """Declare a stream on the running master (the operator role)."""
        self.client.add_stream(name, attributes)
        self._schemas = None

    # ---- access control (docs/semantics.md §11-12) -----------------------------------------------
    def punctuate(self, data, *, labelled: bool = False, finish: bool = False) -> IngestResult:
        """Send security punctuations (a table, DataFrame or CSV/JSON-lines file with the columns of
        ``strata.punctuations.SCHEMA``) through the ordinary, exactly-once ingest path (the producer role)."""
        return self.ingest(PUNCTUATION_SCHEMA.name, data, labelled=labelled, finish=finish)

    def access(self, user: str, query: Query | str, stream: str, grant: bool) -> dict:
        """A privacy switch (the operator role): ``user``'s access to ``stream`` for ``query`` on (``grant``)
        or off from the master's first instant not closed; returns the instant and the switch's counters."""
        r = self.client.access(user, query.query_id if isinstance(query, Query) else query, stream, grant)
        w = r.switch
        return {"instant": r.instant, "changed": r.changed, "state": w.state, "access_counter": w.access_counter,
                "blocked": w.blocked, "passed": w.passed}

    # ---- status ----------------------------------------------------------------------------------
    def status(self) -> Status:
        r = self.client.status()
        view = status_view(r, [])
        queries = tuple(QueryState(q.query_id, q.text, q.state, q.last_ts, q.error) for q in r.queries)
        cluster = {k: v for k, v in view.items() if k not in ("level", "user", "roles", "queries", "shedding")}
        return Status(r.level, r.user, tuple(r.roles), queries, cluster if r.cluster else None,
                      view.get("shedding"))

    # ---- helpers ---------------------------------------------------------------------------------
    def _streams(self) -> dict[str, StreamSchema]:
        if self._schemas is None:
            self._schemas = {s.name.lower(): StreamSchema(s.name, tuple((a.name, a.type) for a in s.attributes))
                             for s in self.client.streams()}
            self._schemas[PUNCTUATION_SCHEMA.name] = PUNCTUATION_SCHEMA  # the reserved stream of punctuations
        return self._schemas

    def _table_of(self, stream: str, data) -> pa.Table:
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, (str, os.PathLike)):
            return _read_file(self._streams(), stream, Path(data))
        if type(data).__module__.startswith("pandas"):
            return pa.Table.from_pandas(data, preserve_index=False)
        raise TypeError(f"ingest takes a pyarrow Table, a pandas DataFrame or a file path, not {type(data).__name__}")


class Query:
    """A registered query of a :class:`Session`."""

    def __init__(self, session: Session, query_id: str, text: str):
        self.session = session
        self.query_id = query_id
        self.text = text  # the rewritten text (authorized, rewritten and optimized for the session's level)

    def __repr__(self) -> str:
        return f"Query({self.query_id!r}, {self.text!r})"

    def results(self, *, acked: dict[str, int] | None = None) -> Iterator[tuple[int, pa.Table]]:
        """``(instant, table)`` for each instant with rows, in order, until the query ends (the input is
        finished, or it is cancelled); a failure raises :class:`QueryFailed` after the rows before it."""
        for _, ts, table in self.session.subscribe([self], acked=acked):
            yield ts, table

    def to_arrow(self) -> pa.Table:
        """Every row of the query (``ts``, ``level`` and its columns), once it has ended."""
        parts = [t for _, t in self.results()]
        return pa.concat_tables(parts) if parts else pa.table({"ts": pa.array([], pa.int64())})

    def to_pandas(self):
        """:meth:`to_arrow` as a pandas DataFrame."""
        return self.to_arrow().to_pandas()

    def cancel(self) -> None:
        self.session.cancel(self)

    def state(self) -> QueryState | None:
        return next((q for q in self.session.status().queries if q.query_id == self.query_id), None)


def status_view(st, queries: list) -> dict:
    """A StatusReply as ``strata status --json`` prints it (``queries``: the rows to show for its
    queries); the one place a reply becomes a dict, for the CLI and :meth:`Session.status`."""
    out = {"level": st.level, "user": st.user, "roles": list(st.roles), "queries": queries}
    if st.HasField("shedding"):  # every session: the level's load shedding
        sh = st.shedding
        out["shedding"] = {"mode": sh.mode, "active": sh.active, "shed_backlog_rows": sh.shed_backlog_rows,
                           "resume_backlog_rows": sh.resume_backlog_rows, "rows": dict(sh.rows),
                           "instants": dict(sh.instants), "ranges": [[r.first, r.last] for r in sh.ranges],
                           "ranges_total": sh.ranges_total, "batches": sh.batches, "episodes": sh.episodes}
    if st.cluster:  # operators: the cluster part
        out.update({
            "workers": [{"sid": w.sid, "cpu": round(w.cpu, 1), "pid": w.pid, "state": w.state,
                         "chunks_done": w.chunks_done, "in_flight": w.in_flight} for w in st.workers],
            "backlog": st.backlog_chunks,
            "ready": st.ready_chunks,
            "lag": st.lag_seconds,
            "rejected": dict(st.rejected),
            "counters": dict(st.counters),
            "timings": dict(st.timings),
            "histograms": dict(st.histograms),
            "last_chunk_error": st.last_chunk_error,
            "switches": [{"query_id": w.query_id, "user": w.user, "stream": w.stream, "state": w.state,
                          "since": w.since, "access_counter": w.access_counter, "blocked": w.blocked,
                          "passed": w.passed} for w in st.switches],
        })
    return out


def by_instant(table: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    """The rows of a result batch (ordered by ``ts``) split per instant."""
    if not table.num_rows:
        return
    ts = table.column("ts").to_numpy()
    starts = [0] + [i for i in range(1, len(ts)) if ts[i] != ts[i - 1]] + [len(ts)]
    for a, b in zip(starts, starts[1:]):
        yield int(ts[a]), table.slice(a, b - a)


def _read_file(schemas: dict[str, StreamSchema], stream: str, path: Path) -> pa.Table:
    """A CSV / JSON-lines input file read with the stream's types, as `strata ingest` reads it."""
    schema = schemas.get(stream.lower())
    if schema is None:
        raise QueryRejected(f"unknown stream {stream!r} (streams: {', '.join(s.name for s in schemas.values())})",
                            "INVALID_ARGUMENT")
    try:
        return read_input(_Declared(schemas), schema.name, str(path))[1]
    except CliError as e:
        raise QueryRejected(str(e), "INVALID_ARGUMENT") from None


def _derived_producer_id(stream: str, table: pa.Table, labelled: bool, finish: bool, rows: int, level: str) -> str:
    """The same data sent the same way gets the same id (so a repeated send applies nothing twice)."""
    h = hashlib.sha256(f"{stream.lower()}\0{labelled}\0{finish}\0{rows}\0{level}\0".encode())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    h.update(sink.getvalue().to_pybytes())
    return "api-" + h.hexdigest()[:32]


class _Declared:
    """The master's streams where :func:`strata.inputs.read_input` expects a configuration."""

    def __init__(self, schemas: dict[str, StreamSchema]):
        self._schemas = schemas
        self.streams = [s.name for s in schemas.values()]

    def stream(self, name: str) -> StreamSchema | None:
        return self._schemas.get(name.lower())
