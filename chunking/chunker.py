"""The master's chunker: cuts the input streams into :class:`Chunk` s.

A :class:`Chunker` receives tuples per stream (:meth:`Chunker.push`), and when
told that instants are complete (:meth:`Chunker.close`) cuts chunks of
``chunk_instants`` instants (chunk ``c`` covers ``[c*K, c*K+K-1]``).  For every
registered query with at least one visible instant in the chunk it builds a
:class:`QueryChunk` whose items carry the *legacy* (dissertation Def. 13,
SEMANTICS §6) followed by the new visible tuples, so that a stateless worker can
evaluate exactly the chunk's instants.

Bookkeeping is per query and FROM item: each item keeps

* ``hist``: the visible tuples with ``ts`` before the closed boundary that a
  future chunk can still need (trimmed after every cut), and
* ``pending``: the visible tuples of chunks not cut yet, in arrival order.

Since ``ts`` never decreases within a stream, both are sorted by ``ts`` and all
selections are ``searchsorted`` slices (plus a pandas groupby-tail for
PARTITION BY windows).

A stream's committed tuples wait in a buffer until their instants close; only then are they
fed to each query's items, through the query's input shields (:mod:`chunking.shield`: security
punctuations and privacy switches, docs/semantics.md §11-12), so every punctuation and switch of
an instant is in before its tuples reach a window.  A query sees only tuples pushed while it is
registered (``_seq`` at or after its registration).  Stored relations are fed as they arrive.

Adaptive chunking (issue 13): chunks are still *cut* every ``K`` instants as
instants close (``K`` is the latency target for paced input, and a restarted
master replaying its log cuts exactly the same chunks), but when several
consecutive cut chunks wait for a worker the master sends them as one
(:func:`merge_chunks`: one Spark job), and splits the reply back per cut chunk
(:func:`split_result`) before merging results in chunk order.  A merged chunk
is the first chunk's legacy, ``prev_instant`` and state followed by every
chunk's new tuples: a superset of each later chunk's legacy, so the answer
does not change (SEMANTICS §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata import punctuations
from strata.arrowio import ARROW_TYPES
from strata.config import OP_COLUMN, RELATION_OPS
from strata.lattice import LevelError

from . import filters, relations
from .model import Chunk, ChunkResult, LegacyMode, QueryChunk, legacy_mode
from .shield import Shields, SwitchError

__all__ = ["Chunker", "ChunkingError", "stream_schema", "merge_chunks", "split_result"]

#: combine the Arrow chunks of a retained table once it is this fragmented
_MAX_FRAGMENTS = 16


class ChunkingError(ValueError):
    """A batch the chunker refuses (nothing of it is accepted), or a protocol error."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


def stream_schema(schema) -> pa.Schema:
    """Arrow schema of item tables of a stream: ``_seq, ts, level``, attributes in declaration order;
    a stored relation's also ``_del`` (:mod:`chunking.relations`)."""
    fields = [pa.field("_seq", pa.int64()), pa.field("ts", pa.int64()), pa.field("level", pa.string())]
    fields += [pa.field(name, ARROW_TYPES[typ]) for name, typ in schema.columns]
    if getattr(schema, "relation", False):
        fields.append(pa.field(relations.DEL, pa.int64()))
    return pa.schema(fields)


# ---------------------------------------------------------------------------
# per query / item bookkeeping


def _boundary(tau: int, slide: int | None) -> int:
    """The last slide boundary at or before ``tau`` (``tau`` itself without SLIDE): where the RANGE
    window at ``tau`` ends, so its legacy starts ``T - 1`` instants before."""
    return int(tau) if slide is None else (int(tau) // slide) * slide


@dataclass
class _Item:
    stream: str
    kind: str
    rows: int | None
    range_t: int | None
    partition_by: tuple[str, ...]
    unbounded_mode: LegacyMode | None  # for kind == "unbounded"
    level_set: pa.Array
    schema: pa.Schema
    levels: frozenset = frozenset()  # level_set as a set (canonical names)
    slide: int | None = None  # RANGE … SLIDE S: S in instants (the window at τ ends at ⌊τ/S⌋·S)
    #: levels whose arrivals are instants besides ``levels`` (the window's set before Alg. 4 narrowed it)
    instant_levels: frozenset = frozenset()
    #: the window condition (``[ROWS 10 WHERE bp > 100]``): the window holds the visible tuples that
    #: pass it; those that do not are instants all the same (``extra_ts``)
    filter: object = None
    extra_ts: list = field(default_factory=list)  # list[np.ndarray]: ts of such arrivals not yet cut
    hist: pa.Table = None  # type: ignore[assignment]
    pending: list = field(default_factory=list)  # list[pa.Table]
    _pend: pa.Table | None = None  # cached concatenation of ``pending``
    _pend_ts: np.ndarray | None = None

    def __post_init__(self):
        if self.hist is None:
            self.hist = self.schema.empty_table()

    # pending rows as one table plus its ts as numpy (cached until the next append)
    def pend(self) -> tuple[pa.Table, np.ndarray]:
        if self._pend is None:
            if not self.pending:
                t = self.schema.empty_table()
            elif len(self.pending) == 1:
                t = self.pending[0]
            else:
                t = pa.concat_tables(self.pending).combine_chunks()
            self.pending = [t] if t.num_rows else []
            self._pend = t
            self._pend_ts = _ts(t)
        return self._pend, self._pend_ts  # type: ignore[return-value]

    def append(self, t: pa.Table) -> None:
        if t.num_rows:
            self.pending.append(t)
            self._pend = None
            self._pend_ts = None

    def take_pending(self, upto_ts: int) -> pa.Table:
        """Remove and return the pending rows with ``ts <= upto_ts``."""
        t, ts = self.pend()
        k = int(np.searchsorted(ts, upto_ts, side="right"))
        if k == 0:
            return t.slice(0, 0)
        head, rest = t.slice(0, k), t.slice(k)
        self.pending = [rest] if rest.num_rows else []
        self._pend = rest
        self._pend_ts = ts[k:]
        return head

    def pending_ts(self) -> np.ndarray:
        return self.pend()[1]

    def take_extra(self, upto_ts: int) -> np.ndarray:
        """Remove and return the instants (ts ≤ ``upto_ts``) of arrivals outside the window's levels
        that are instants of the query all the same (``instant_levels``)."""
        if not self.extra_ts:
            return np.empty(0, dtype=np.int64)
        ts = np.concatenate(self.extra_ts)
        k = int(np.searchsorted(ts, upto_ts, side="right"))
        self.extra_ts = [ts[k:]] if k < len(ts) else []
        return ts[:k]

    @property
    def retained_rows(self) -> int:
        return self.hist.num_rows + sum(t.num_rows for t in self.pending)


@dataclass
class _Query:
    query_id: str
    cq: object
    mode: LegacyMode
    r2s: str
    items: list[_Item]
    last_instant: int | None = None  # the query's last instant emitted in a chunk
    state: pa.Table | None = None  # STATE mode: newest confirmed snapshot
    state_upto: int | None = None
    #: who registered it (user, roles): what security punctuations decide for (shield.py)
    principal: tuple = ("", frozenset())
    attrs: dict = field(default_factory=dict)  # stream -> the attributes of it the query names
    since: dict = field(default_factory=dict)  # stream -> the first _seq pushed while it is registered


def _ts(t: pa.Table) -> np.ndarray:
    if t.num_rows == 0:
        return np.empty(0, dtype=np.int64)
    return t.column("ts").to_numpy()


def _concat(a: pa.Table, b: pa.Table) -> pa.Table:
    if a.num_rows == 0:
        return b
    if b.num_rows == 0:
        return a
    return pa.concat_tables([a, b])


def _compact(t: pa.Table) -> pa.Table:
    if t.num_rows == 0:
        return t.schema.empty_table()
    return t.combine_chunks() if t.column(0).num_chunks > _MAX_FRAGMENTS else t


def _slice_ts(t: pa.Table, lo: int | None = None, hi: int | None = None) -> pa.Table:
    """Rows with ``lo <= ts < hi`` of a ts-sorted table (bounds optional)."""
    ts = _ts(t)
    a = 0 if lo is None else int(np.searchsorted(ts, lo, side="left"))
    b = len(ts) if hi is None else int(np.searchsorted(ts, hi, side="left"))
    if b <= a:
        return t.slice(0, 0)
    return t.slice(a, b - a)


def _group_ids(t: pa.Table, cols: tuple[str, ...]) -> np.ndarray:
    """Dense group id per row for the values of ``cols`` (nulls form their own group)."""
    g = np.zeros(t.num_rows, dtype=np.int64)
    for c in cols:
        col = t.column(c).combine_chunks()
        enc = pc.dictionary_encode(col, null_encoding="encode")
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        g = g * (len(enc.dictionary) + 1) + codes
        if len(cols) > 1:
            g = np.unique(g, return_inverse=True)[1].astype(np.int64).reshape(-1)
    return g


def _partition_tail(t: pa.Table, cols: tuple[str, ...], n: int) -> pa.Table:
    """Per partition (values of ``cols``) the last ``n`` rows, in arrival order."""
    if t.num_rows == 0 or n <= 0:
        return t.slice(0, 0)
    if t.num_rows <= n:
        return t
    g = _group_ids(t, cols)
    order = np.argsort(g, kind="stable")  # groups together, arrival order inside each
    gs = g[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(gs)) + 1))
    counts = np.diff(np.concatenate((starts, [len(gs)])))
    pos = np.arange(len(gs)) - np.repeat(starts, counts)
    keep_sorted = (np.repeat(counts, counts) - pos) <= n  # rank from the end < n
    mask = np.empty(len(g), dtype=bool)
    mask[order] = keep_sorted
    if mask.all():
        return t
    return t.filter(pa.array(mask))


def _stored(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table read back from a checkpoint, with the item schema (an empty one: the schema's own)."""
    if t.num_rows == 0:
        return schema.empty_table()
    return t if t.schema.equals(schema) else t.cast(schema)


# ---------------------------------------------------------------------------


class Chunker:
    """Cuts pushed tuples into chunks of ``chunk_instants`` instants for a set of queries.

    ``queries`` maps query ids to :class:`strata.mlscql.CompiledQuery`.  Queries
    see only tuples pushed while they are registered.
    """

    def __init__(self, config, queries: dict | None = None, chunk_instants: int = 1):
        if isinstance(chunk_instants, bool) or not isinstance(chunk_instants, (int, np.integer)) or chunk_instants < 1:
            raise ValueError(f"chunk_instants must be a positive integer, not {chunk_instants!r}")
        self.config = config
        self.K = int(chunk_instants)
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self._queries: dict[str, _Query] = {}
        self._next_seq: dict[str, int] = {name: 0 for name in config.streams}
        self._last_ts: dict[str, int] = {}
        self._schemas = {name: stream_schema(s) for name, s in config.streams.items()}
        self._schemas[punctuations.STREAM] = stream_schema(punctuations.SCHEMA)
        self._added: dict[str, tuple] = {}  # streams added at run time: name -> columns
        #: stored relations: their live rows and the updates of chunks not closed yet
        self._relations = {name: relations.Relation(name, self._schemas[name])
                           for name, s in config.streams.items() if s.relation}
        self._next_chunk = 0  # every chunk with a smaller index is closed
        #: security punctuations and privacy switches: applied to each query's part as instants close
        self.shields = Shields()
        self._punct_last_ts: int | None = None
        #: committed tuples of streams (not relations) not fed to the queries yet: (table, window
        #: conditions' results) per batch, fed when their instants close (``_drain``)
        #: (its levels: a superset once the batch is split) per batch, fed when their instants close (``_drain``)
        self._buffer: dict[str, list[tuple[pa.Table, dict, frozenset]]] = {}
        for qid, cq in (queries or {}).items():
            self.add_query(qid, cq)

    # -- queries ----------------------------------------------------------------
    @property
    def chunk_instants(self) -> int:
        return self.K

    @property
    def query_ids(self) -> list[str]:
        return list(self._queries)

    @property
    def closed_until(self) -> int:
        """First instant not closed yet: a tuple with a smaller ts is late."""
        return self._next_chunk * self.K

    def add_query(self, query_id: str, cq, principal: tuple | None = None) -> None:
        """Register ``cq``; it sees the tuples pushed from now on.  ``principal``: (user, roles) of the
        session that registered it, which security punctuations grant or deny."""
        if query_id in self._queries:
            raise ChunkingError(f"query {query_id!r} is already registered", "duplicate_query")
        mode = legacy_mode(cq)
        items = []
        for f, info in zip(cq.query.from_, cq.items):
            w = f.window
            if w is None or w.levels is None:
                raise ChunkingError(f"query {query_id!r}: FROM item {info.name!r} has no rewritten window")
            stream = self._stream_name(info.stream)
            schema = self._schemas[stream]
            kind = w.kind
            part: tuple[str, ...] = ()
            if kind == "partition":
                byname = {n.lower(): n for n in schema.names}
                try:
                    part = tuple(byname[p.lower()] for p in w.partition_by)
                except KeyError as e:
                    raise ChunkingError(f"query {query_id!r}: unknown PARTITION BY attribute {e.args[0]!r}") from None
            if kind not in ("rows", "range", "unbounded", "now", "partition", "relation"):
                raise ChunkingError(f"query {query_id!r}: unknown window kind {kind!r}")
            items.append(
                _Item(
                    stream=stream,
                    kind=kind,
                    rows=w.rows,
                    range_t=w.range_instants(self.config.instant_seconds) if kind == "range" else None,
                    slide=w.slide_instants(self.config.instant_seconds) if kind == "range" else None,
                    partition_by=part,
                    unbounded_mode=mode if kind == "unbounded" else None,
                    level_set=pa.array(sorted(w.levels), pa.string()),
                    schema=schema,
                    levels=frozenset(w.levels),
                    instant_levels=frozenset(w.instants or ()) - frozenset(w.levels),
                    filter=w.filter,
                )
            )
        attrs = {it.stream: punctuations.referenced_attributes(cq.query, self.config.streams[it.stream])
                 for it in items if it.stream in self.config.streams}
        user, roles = principal or ("", frozenset())
        self._queries[query_id] = _Query(query_id, cq, mode, cq.r2s, items, principal=(user, frozenset(roles)),
                                         attrs=attrs, since=dict(self._next_seq))
        for it in items:
            if it.kind == "relation":  # the relation as it is: live rows, then the updates not cut yet
                rel = self._relations[it.stream]
                it.hist = rel.visible(it.levels)
                for t in rel.recent:
                    self._feed(it, t, frozenset(pc.unique(t.column("level")).to_pylist()), {}, {})

    def remove_query(self, query_id: str) -> None:
        self._queries.pop(query_id, None)

    def set_switch(self, query_id: str, user: str, stream: str, on: bool, at: int | None = None):
        """The initial privacy switch of (query, its owner, stream) on or off from instant ``at`` (default:
        the first instant not closed); returns (the switch, whether it changed, the instant).  Raises
        :class:`ChunkingError` for an instant already closed or before the switch's last change."""
        at = self.closed_until if at is None else int(at)
        if at < self.closed_until:
            raise ChunkingError(f"instant {at} is closed (instants < {self.closed_until} are closed)", "late_switch")
        try:
            sw, changed = self.shields.set_switch(query_id, user, self._stream_name(stream), on, at)
        except SwitchError as e:
            raise ChunkingError(str(e), "bad_switch") from None
        return sw, changed, at

    def add_stream(self, config) -> None:
        """Take ``config`` with a stream added at run time (``strata streams add``): its tuples are
        accepted from now on, and chunks of queries that read it carry its schema."""
        self.config = config
        for name, s in config.streams.items():
            if name not in self._schemas:
                self._schemas[name] = stream_schema(s)
                self._next_seq[name] = 0
                self._added[name] = s.columns

    def _added_streams(self, qcs: list[QueryChunk]) -> tuple:
        """The run-time streams the queries of ``qcs`` read, with their schemas (see :class:`Chunk`)."""
        if not self._added:
            return ()
        used = {it.stream for qc in qcs for it in self._queries[qc.query_id].items}
        return tuple((n, cols) for n, cols in self._added.items() if n in used)

    def streams_of(self, query_id: str) -> list[str]:
        """The streams ``query_id`` reads (canonical names, in FROM order; none for an unknown query)."""
        q = self._queries.get(query_id)
        return list(dict.fromkeys(it.stream for it in q.items)) if q is not None else []

    def mode(self, query_id: str) -> LegacyMode:
        return self._queries[query_id].mode

    # -- input ------------------------------------------------------------------
    def push(self, stream: str, table, before_commit=None) -> int:
        """Append a batch of tuples of ``stream`` in arrival order; all or nothing.

        Returns the number of tuples accepted.  Raises :class:`ChunkingError`
        (and counts the batch's tuples in ``rejected[reason]``) otherwise.
        ``before_commit(table)``: called with the checked batch (also an empty one) after every
        check and before anything changes (the master logs the batch there); if it raises,
        nothing of the batch is applied and the exception propagates.
        """
        if punctuations.is_punctuation_stream(stream):
            return self._push_punctuations(table, before_commit)
        try:
            name = self._stream_name(stream)
        except ChunkingError as e:
            self._reject(e, table)
            raise
        try:
            t, present = self._normalize(name, table)
        except ChunkingError as e:
            self._reject(e, table)
            raise
        n = t.num_rows
        # window conditions of the queries reading this stream, once per distinct condition
        passing: dict = {}
        try:
            for q in self._queries.values():
                for it in q.items:
                    if it.stream == name and it.filter is not None and it.filter not in passing and n:
                        passing[it.filter] = filters.passes(it.filter, t)
        except Exception as e:  # noqa: BLE001 - never expected after analysis; the batch is refused whole
            err = ChunkingError(f"a window condition could not be evaluated on this batch: {e}")
            self._reject(err, table)
            raise err from None
        rel = self._relations.get(name)
        seq0 = self._next_seq[name]
        if rel is not None:  # deletes matched to live rows (all of the batch or none of it)
            try:
                matched = rel.match(t, seq0)
            except relations.RelationError as e:
                err = ChunkingError(str(e), "no_such_row")
                self._reject(err, table)
                raise err from None
        if before_commit is not None:
            before_commit(t)
        if n == 0:
            return 0
        # commit: nothing below can fail
        if rel is not None:
            t = rel.commit(t, matched)
        t = t.add_column(0, "_seq", pa.array(np.arange(seq0, seq0 + n, dtype=np.int64)))
        self._next_seq[name] = seq0 + n
        self._last_ts[name] = int(t.column("ts")[n - 1].as_py())
        self.accepted += n
        if rel is None:  # fed to the queries when its instants close, under the shields of then
            self._buffer.setdefault(name, []).append((t, passing, present))
            return n
        rel.recent.append(t)
        masks: dict[frozenset, pa.Array] = {}
        for q in self._queries.values():
            for it in q.items:
                if it.stream == name:
                    self._feed(it, t, present, passing, masks)
        return n

    def _push_punctuations(self, table, before_commit=None) -> int:
        """A batch of security punctuations (strata/punctuations.py): checked like a stream's tuples
        (columns, types, levels, ts order, not late) and parsed, all or nothing; they hold from their
        instants on (shield.py)."""
        try:
            t, _ = self._normalize(punctuations.STREAM, table)
            n = t.num_rows
            if n:
                first = int(t.column("ts")[0].as_py())
                if self._punct_last_ts is not None and first < self._punct_last_ts:
                    raise ChunkingError(f"punctuations: ts {first} is before the punctuations' last ts "
                                        f"{self._punct_last_ts}", "ts_decreasing")
                sps = punctuations.parse_batch(self.config, t.to_pylist())
                per: dict = {}
                for sp in sps:
                    per[(sp.stream, sp.level, sp.ts)] = per.get((sp.stream, sp.level, sp.ts), 0) + 1
                for (s_, lv, ts_), k in per.items():
                    held = sum(len(x) for at, x in self.shields.history.get((s_, lv), ()) if at == ts_)
                    if held + k > punctuations.MAX_POLICY_SPS:
                        raise ChunkingError(f"punctuations: more than {punctuations.MAX_POLICY_SPS} for stream {s_} "
                                            f"level {lv} at instant {ts_}", "oversized")
        except punctuations.PunctuationError as e:
            err = ChunkingError(str(e), "bad_punctuation")
            self._reject(err, table)
            raise err from None
        except ChunkingError as e:
            self._reject(e, table)
            raise
        if before_commit is not None:
            before_commit(t)
        if not n:
            return 0
        self.shields.add_punctuations(sps)
        self._punct_last_ts = int(t.column("ts")[n - 1].as_py())
        self.accepted += n
        return n

    def _drain(self, end_ts: int) -> None:
        """Feed every query its part of the buffered tuples with ``ts <= end_ts`` (instants now closed:
        every punctuation and switch of them is in), through its shields."""
        for name, buf in self._buffer.items():
            taken = []
            while buf:
                t, passing, present = buf[0]
                ts = _ts(t)
                k = int(np.searchsorted(ts, end_ts, side="right"))
                if k == 0:
                    break
                if k == len(ts):
                    taken.append((t, passing, present))
                    buf.pop(0)
                    continue
                taken.append((t.slice(0, k), {f: m.slice(0, k) for f, m in passing.items()}, present))
                buf[0] = (t.slice(k), {f: m.slice(k) for f, m in passing.items()}, present)
                break
            if len(taken) > 1:  # the closed instants' batches as one (one mask and one feed per query)
                tables = [x[0] for x in taken]
                keys = {f for x in taken for f in x[1]}  # the queries registered may differ between batches
                passing = {f: pa.concat_arrays([x[1][f] if f in x[1] else filters.passes(f, x[0]) for x in taken])
                           for f in keys}
                taken = [(pa.concat_tables(tables), passing, frozenset().union(*(x[2] for x in taken)))]
            for t, passing, present in taken:
                self._feed_all(name, t, passing, present)

    def _passing(self, name: str, t: pa.Table) -> dict:
        """The window conditions of the queries reading ``name`` on ``t`` (a checkpoint's buffer)."""
        return {it.filter: filters.passes(it.filter, t) for q in self._queries.values() for it in q.items
                if it.stream == name and it.filter is not None and t.num_rows}

    def _feed_all(self, name: str, t: pa.Table, passing: dict, present: frozenset) -> None:
        """``t``'s part to every query reading ``name``, through its shields (``present``: the levels of
        ``t``, or a superset of them)."""
        masks: dict[frozenset, pa.Array] = {}
        seq0 = int(t.column("_seq")[0].as_py())
        for q in self._queries.values():  # a window condition of a query registered after the batch came
            for it in q.items:
                if it.stream == name and it.filter is not None and it.filter not in passing:
                    passing = {**passing, it.filter: filters.passes(it.filter, t)}
        for q in self._queries.values():
            mine = None  # this query's part of t, once computed
            for it in q.items:
                if it.stream != name:
                    continue
                if mine is None:
                    keep = self.shields.mask(q.query_id, q.principal, name, q.attrs.get(name, ()), t)
                    since = q.since.get(name, 0)
                    if since > seq0:  # registered after some of these tuples were pushed
                        old = t.column("_seq").to_numpy() >= since
                        keep = old if keep is None else keep & old
                    if keep is None:
                        mine = (t, present, passing, masks)
                    else:
                        k = pa.array(keep)
                        tt = t.filter(k)
                        mine = (tt, frozenset(pc.unique(tt.column("level")).to_pylist()),
                                {f: m.filter(k) for f, m in passing.items()}, {})
                self._feed(it, *mine)

    @staticmethod
    def _feed(it: _Item, t: pa.Table, present: frozenset, passing: dict, masks: dict) -> None:
        """Give item ``it`` its part of committed batch ``t`` (levels ``present``): the visible
        tuples that pass its window condition, and the instants of the others it has."""
        level = t.column("level")
        extra = present & it.instant_levels
        instants = []  # ts of arrivals that are instants although the window does not hold them
        if extra:  # arrivals outside the window's levels as Alg. 4 narrowed them
            mask = pc.is_in(level, value_set=pa.array(sorted(extra), pa.string()))
            instants.append(_ts(t.filter(mask)))
        # the item's visible part; no per-tuple work when every level of the batch
        # is in the window's level set (or none is)
        seen = present & it.levels
        vis = None
        if len(seen) == len(present):
            vis = t
        elif seen:
            if seen not in masks:
                masks[seen] = pc.is_in(level, value_set=pa.array(sorted(seen), pa.string()))
            vis = t.filter(masks[seen])
        if vis is not None and it.filter is not None:  # visible, but filtered before the window
            keep = passing[it.filter]
            if vis is not t:
                keep = keep.filter(masks[seen])
            instants.append(_ts(vis.filter(pc.invert(keep))))
            vis = vis.filter(keep)
        if instants:
            ts = instants[0] if len(instants) == 1 else np.sort(np.concatenate(instants), kind="stable")
            if len(ts):
                it.extra_ts.append(ts)
        if vis is not None:
            it.append(vis)

    def _reject(self, e: ChunkingError, table) -> None:
        n = getattr(table, "num_rows", None)
        if n is None:
            try:
                n = len(table) if not isinstance(table, dict) else len(next(iter(table.values()), ()))
            except Exception:  # noqa: BLE001
                n = 1
        self.rejected[e.reason] = self.rejected.get(e.reason, 0) + max(int(n), 1)

    def _stream_name(self, stream: str) -> str:
        s = self.config.stream(stream) if isinstance(stream, str) else None
        if s is None:
            raise ChunkingError(
                f"unknown stream {stream!r} (streams: {', '.join(self.config.streams)})", "unknown_stream"
            )
        return s.name

    def _normalize(self, name: str, table) -> tuple[pa.Table, frozenset]:
        """Validate a batch; return it as ``ts, level, attributes`` with the stream's Arrow types,
        and its distinct (canonical) levels."""
        rel = name in self._relations
        kind = "relation" if rel else "stream"
        what = f"{kind} {name}"
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        elif not isinstance(table, pa.Table):
            try:
                table = pa.table(table)
            except Exception as e:  # noqa: BLE001
                raise ChunkingError(f"{what}: cannot read batch as a table: {e}", "bad_batch") from None
        schema = self._schemas[name]
        want = [f.name for f in schema if f.name not in ("_seq", relations.DEL)] + ([OP_COLUMN] if rel else [])
        got = table.column_names
        if len(set(c.lower() for c in got)) != len(got):
            dups = sorted({c for c in got if [x.lower() for x in got].count(c.lower()) > 1})
            raise ChunkingError(f"{what}: duplicate columns {', '.join(dups)}", "duplicate_columns")
        lower = {c.lower(): c for c in got}
        missing = [c for c in want if c.lower() not in lower]
        extra = [c for c in got if c.lower() not in {w.lower() for w in want}]
        if missing:
            raise ChunkingError(f"{what}: missing columns {', '.join(missing)}", "missing_columns")
        if extra:
            raise ChunkingError(
                f"{what}: unexpected columns {', '.join(extra)} (expected ts, level, "
                f"{', '.join(want[2:])})",
                "extra_columns",
            )
        cols = []
        for c in want:
            target = pa.string() if rel and c == OP_COLUMN else schema.field(c).type
            col = table.column(lower[c.lower()])
            if col.type != target:
                try:
                    col = col.cast(target, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    raise ChunkingError(
                        f"{what}: column {c} of type {col.type} cannot be read as {target}: {e}", "bad_type"
                    ) from None
            cols.append(col)
        n = table.num_rows
        ts, level = cols[0], cols[1]
        present: frozenset = frozenset()
        if ts.null_count:
            raise ChunkingError(f"{what}: ts is null in {ts.null_count} tuple(s)", "null_ts")
        if level.null_count:
            raise ChunkingError(f"{what}: level is null in {level.null_count} tuple(s)", "null_level")
        if rel:
            op = pc.utf8_lower(cols[-1])
            ok = pc.is_in(op, value_set=pa.array(RELATION_OPS, pa.string()))
            if n and (op.null_count or not pc.all(ok).as_py()):
                i = pc.index(pc.fill_null(ok, False), False).as_py()
                raise ChunkingError(f"{what}: row {i + 1}: op must be insert or delete, not "
                                    f"{cols[-1][i].as_py()!r}", "bad_op")
            cols[-1] = op
        if n:
            # levels: known and canonical
            uniq = pc.unique(level).to_pylist()
            canon = []
            for lv in uniq:
                try:
                    canon.append(self.config.lattice.parse(lv))
                except LevelError as e:
                    raise ChunkingError(f"{what}: {e}", "unknown_level") from None
            if canon != uniq:
                idx = pc.index_in(level, value_set=pa.array(uniq, pa.string()))
                level = pa.chunked_array([pc.take(pa.array(canon, pa.string()), idx.combine_chunks())])
                cols[1] = level
            present = frozenset(canon)
            # ts: non-negative, non-decreasing, not in a closed chunk
            tsn = ts.to_numpy()
            if tsn[0] < 0 or tsn.min() < 0:
                raise ChunkingError(f"{what}: negative ts {int(tsn.min())}", "negative_ts")
            if n > 1 and (np.diff(tsn) < 0).any():
                i = int(np.argmax(np.diff(tsn) < 0))
                raise ChunkingError(
                    f"{what}: ts decreases within the batch ({int(tsn[i])} then {int(tsn[i + 1])} "
                    f"at row {i + 1})",
                    "ts_decreasing",
                )
            last = self._last_ts.get(name)
            if last is not None and tsn[0] < last:
                raise ChunkingError(
                    f"{what}: ts {int(tsn[0])} is before the {kind}'s last ts {last}", "ts_decreasing"
                )
            if tsn[0] < self.closed_until:
                raise ChunkingError(
                    f"{what}: late tuple: ts {int(tsn[0])} is in an already closed chunk "
                    f"(instants < {self.closed_until} are closed)",
                    "late_tuple",
                )
        out_schema = pa.schema([f for f in schema if f.name not in ("_seq", relations.DEL)]
                               + ([pa.field(OP_COLUMN, pa.string())] if rel else []))
        return pa.Table.from_arrays([c if isinstance(c, pa.ChunkedArray) else pa.chunked_array([c]) for c in cols],
                                    schema=out_schema), present

    # -- cutting ----------------------------------------------------------------
    def close(self, upto_ts: int) -> list[Chunk]:
        """Instants ``<= upto_ts`` are complete: cut every chunk ending at or before it.

        Chunks without a visible instant of any query are skipped.  Returns the
        chunks in increasing ``chunk_id`` order.
        """
        end_chunk = (int(upto_ts) + 1) // self.K  # chunks [_next_chunk, end_chunk) close
        if end_chunk <= self._next_chunk:
            return []
        end_ts = end_chunk * self.K - 1
        self._drain(end_ts)
        # chunk indices with at least one visible instant of some query
        idx = []
        for q in self._queries.values():
            for it in q.items:
                for ts in [it.pending_ts(), *it.extra_ts]:
                    k = int(np.searchsorted(ts, end_ts, side="right"))
                    if k:
                        idx.append(np.unique(ts[:k] // self.K))
        cids = np.unique(np.concatenate(idx)) if idx else np.empty(0, dtype=np.int64)
        out = []
        for cid in cids.tolist():
            ch = self._cut(int(cid))
            if ch.queries:
                out.append(ch)
        self._next_chunk = end_chunk
        boundary = self.closed_until
        for q in self._queries.values():
            self._trim(q, boundary)
        for rel in self._relations.values():
            rel.fold(boundary)
        self.shields.trim(boundary)
        return out

    def finish(self) -> list[Chunk]:
        """Close every chunk holding a pushed tuple (including a partial last chunk)."""
        if not self._last_ts and self._punct_last_ts is None:
            return []
        last = max([*self._last_ts.values(), *([self._punct_last_ts] if self._punct_last_ts is not None else [])])
        return self.close((last // self.K) * self.K + self.K - 1)

    def _cut(self, cid: int) -> Chunk:
        first, last = cid * self.K, cid * self.K + self.K - 1
        qcs = []
        for q in self._queries.values():
            new = [it.take_pending(last) for it in q.items]
            extra = [it.take_extra(last) for it in q.items]
            if not any(t.num_rows for t in new) and not any(len(x) for x in extra):
                continue
            instants = np.unique(np.concatenate([_ts(t) for t in new] + extra)).tolist()
            tau_a, prev = instants[0], q.last_instant
            tables = []
            for it, nt in zip(q.items, new):
                tables.append(_concat(self._legacy(q, it, tau_a, prev), nt))
                it.hist = relations.apply(it.hist, nt) if it.kind == "relation" else _compact(_concat(it.hist, nt))
            qc = QueryChunk(
                query_id=q.query_id,
                chunk_id=cid,
                items=tables,
                instants=[int(x) for x in instants],
                prev_instant=prev,
            )
            if q.mode is LegacyMode.STATE:
                qc.state, qc.state_upto = q.state, q.state_upto
            qcs.append(qc)
            q.last_instant = int(instants[-1])
            self._trim(q, last + 1)
        return Chunk(chunk_id=cid, first_ts=first, last_ts=last, queries=qcs, streams=self._added_streams(qcs))

    def _legacy(self, q: _Query, it: _Item, tau_a: int, prev: int | None) -> pa.Table:
        """The legacy rows of item ``it`` for a chunk whose first instant is ``tau_a``."""
        h = _slice_ts(it.hist, hi=tau_a)
        if h.num_rows == 0:
            return h
        kind, istream = it.kind, q.r2s in ("ISTREAM", "DSTREAM")
        if kind == "relation":  # the rows live before τa (= at the previous instant: updates are instants)
            return it.hist
        if kind == "rows":
            n = it.rows or 0
            return h.slice(max(0, h.num_rows - n)) if n > 0 else h.slice(0, 0)
        if kind == "partition":
            return _partition_tail(h, it.partition_by, it.rows or 0)
        if kind == "range":
            lo = _boundary(tau_a, it.slide) - it.range_t + 1
            if istream and prev is not None:
                lo = min(lo, _boundary(prev, it.slide) - it.range_t + 1)
            return _slice_ts(h, lo=lo)
        if kind == "now":
            if istream and prev is not None:
                return _slice_ts(h, lo=prev, hi=prev + 1)
            return h.slice(0, 0)
        # unbounded
        if it.unbounded_mode is LegacyMode.NONE:
            return h.slice(0, 0)
        if it.unbounded_mode is LegacyMode.STATE:
            return _slice_ts(h, lo=None if q.state_upto is None else q.state_upto + 1)
        return h  # HISTORY

    def _trim(self, q: _Query, boundary: int) -> None:
        """Drop retained rows no chunk starting at or after ``boundary`` can need."""
        istream = q.r2s in ("ISTREAM", "DSTREAM")
        for it in q.items:
            h = it.hist
            if h.num_rows == 0 or it.kind == "relation":  # a relation's history is its live rows
                continue
            kind = it.kind
            if kind == "rows":
                n = it.rows or 0
                h = h.slice(max(0, h.num_rows - n)) if n > 0 else h.slice(0, 0)
            elif kind == "partition":
                h = _partition_tail(h, it.partition_by, it.rows or 0)
            elif kind == "range":
                lo = _boundary(boundary, it.slide) - it.range_t + 1
                if istream and q.last_instant is not None:
                    lo = min(lo, _boundary(q.last_instant, it.slide) - it.range_t + 1)
                h = _slice_ts(h, lo=lo)
            elif kind == "now":
                h = _slice_ts(h, lo=q.last_instant) if istream and q.last_instant is not None else h.slice(0, 0)
            elif it.unbounded_mode is LegacyMode.NONE:
                h = h.slice(0, 0)
            elif it.unbounded_mode is LegacyMode.STATE and q.state_upto is not None:
                h = _slice_ts(h, lo=q.state_upto + 1)
            it.hist = _compact(h) if h.num_rows else it.schema.empty_table()

    # -- results ----------------------------------------------------------------
    def confirm(self, result: ChunkResult) -> bool:
        """Take the state snapshot of a STATE query's result; True if it became the snapshot.

        Results of other queries, without a state, or not newer than the
        current snapshot are ignored.  ``state_upto`` may be the chunk's last
        instant or its ``last_ts``; a snapshot claiming instants beyond its
        chunk raises :class:`ChunkingError`.
        """
        q = self._queries.get(result.query_id)
        if q is None or q.mode is not LegacyMode.STATE:
            return False
        if result.state is None or result.state_upto is None:
            return False
        upto = int(result.state_upto)
        if q.state_upto is not None and upto <= q.state_upto:
            return False
        # a state may claim its chunk's last instant or the chunk's end (nothing visible in between),
        # never beyond: dropping tuples the worker did not see would lose them
        limit = min(self.closed_until - 1, int(result.chunk_id) * self.K + self.K - 1)
        if q.last_instant is None or upto > limit:
            raise ChunkingError(
                f"query {q.query_id!r}: state snapshot up to {upto} is beyond chunk {result.chunk_id} "
                f"(ends at {limit})",
                "bad_result",
            )
        q.state, q.state_upto = result.state, upto
        for it in q.items:
            it.hist = _slice_ts(it.hist, lo=upto + 1)
            if it.hist.num_rows == 0:
                it.hist = it.schema.empty_table()
        return True

    # -- checkpoints ------------------------------------------------------------------
    def export_state(self) -> tuple[dict, dict[str, pa.Table]]:
        """Everything this chunker holds, as plain JSON and named Arrow tables (the master's
        checkpoint, :mod:`strata.master.checkpoint`).  Tables are immutable: the caller may
        serialize them after releasing its lock.  :meth:`import_state` on a chunker with the
        same queries registered in the same order continues exactly as this one would."""
        meta = {"chunk_instants": self.K, "accepted": self.accepted, "rejected": dict(self.rejected),
                "next_seq": dict(self._next_seq), "last_ts": dict(self._last_ts), "next_chunk": self._next_chunk,
                "queries": [], "shields": self.shields.export(), "punct_last_ts": self._punct_last_ts,
                "buffer": {}}
        tables: dict[str, pa.Table] = {}
        for qi, q in enumerate(self._queries.values()):
            meta["queries"].append({"query_id": q.query_id, "last_instant": q.last_instant,
                                    "state_upto": q.state_upto, "state": q.state is not None, "since": q.since})
            if q.state is not None:
                tables[f"{qi}/state"] = q.state
            for i, it in enumerate(q.items):
                tables[f"{qi}/{i}/hist"] = it.hist
                tables[f"{qi}/{i}/pending"] = it.pend()[0]
                extra = np.concatenate(it.extra_ts) if it.extra_ts else np.empty(0, dtype=np.int64)
                tables[f"{qi}/{i}/extra"] = pa.table({"ts": pa.array(extra, pa.int64())})
        for name, rel in self._relations.items():
            tables[f"relation/{name}/live"], tables[f"relation/{name}/recent"] = rel.export()
        for name, buf in self._buffer.items():  # tuples not fed yet (their window conditions: again on import)
            if buf:
                meta["buffer"][name] = len(buf)
                for i, (t, _, _) in enumerate(buf):
                    tables[f"buffer/{name}/{i}"] = t
        return meta, tables

    def import_state(self, meta: dict, tables: dict[str, pa.Table]) -> None:
        """Take the state :meth:`export_state` wrote.  The same queries must be registered, in the
        same order (raises :class:`ChunkingError` otherwise, and for another ``chunk_instants``)."""
        if int(meta["chunk_instants"]) != self.K:
            raise ChunkingError(f"the checkpoint cut chunks of {meta['chunk_instants']} instants, this chunker "
                                f"{self.K}", "checkpoint")
        ids = [m["query_id"] for m in meta["queries"]]
        if ids != list(self._queries):
            raise ChunkingError(f"the checkpoint holds queries {ids}, the chunker {list(self._queries)}", "checkpoint")
        self.accepted = int(meta["accepted"])
        self.rejected = {str(k): int(v) for k, v in meta["rejected"].items()}
        self._next_seq = {name: int(meta["next_seq"].get(name, 0)) for name in self._next_seq}
        self._last_ts = {str(k): int(v) for k, v in meta["last_ts"].items()}
        self._next_chunk = int(meta["next_chunk"])
        self.shields.load(meta.get("shields"))
        self._punct_last_ts = meta.get("punct_last_ts")
        self._buffer = {}
        for name, k in meta.get("buffer", {}).items():
            for i in range(int(k)):
                t = _stored(tables[f"buffer/{name}/{i}"], self._schemas[name])
                self._buffer.setdefault(name, []).append(
                    (t, self._passing(name, t), frozenset(pc.unique(t.column("level")).to_pylist())))
        for name, rel in self._relations.items():
            if f"relation/{name}/live" in tables:
                rel.restore(_stored(tables[f"relation/{name}/live"], rel.schema),
                            _stored(tables[f"relation/{name}/recent"], rel.schema))
        for qi, (m, q) in enumerate(zip(meta["queries"], self._queries.values())):
            q.last_instant = m["last_instant"]
            if "since" in m:
                q.since = {str(k): int(v) for k, v in m["since"].items()}
            q.state_upto = m["state_upto"]
            q.state = tables[f"{qi}/state"] if m["state"] else None
            for i, it in enumerate(q.items):
                it.hist = _stored(tables[f"{qi}/{i}/hist"], it.schema)
                pend = _stored(tables[f"{qi}/{i}/pending"], it.schema)
                it.pending = [pend] if pend.num_rows else []
                it._pend = it._pend_ts = None
                extra = tables[f"{qi}/{i}/extra"].column("ts").to_numpy()
                it.extra_ts = [extra.astype(np.int64)] if len(extra) else []

    # -- introspection ------------------------------------------------------------
    @property
    def retained_rows(self) -> int:
        """Tuples held for all queries (history plus not yet cut)."""
        return sum(it.retained_rows for q in self._queries.values() for it in q.items) + \
            sum(r.retained_rows for r in self._relations.values()) + \
            sum(x[0].num_rows for buf in self._buffer.values() for x in buf)

    def retained(self, query_id: str) -> list[int]:
        """Per FROM item of ``query_id``: retained history rows (excluding uncut ones)."""
        return [it.hist.num_rows for it in self._queries[query_id].items]

    def snapshot_upto(self, query_id: str) -> int | None:
        return self._queries[query_id].state_upto

    def stats(self) -> dict:
        return {
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "retained_rows": self.retained_rows,
            "closed_until": self.closed_until,
            "queries": len(self._queries),
        }



# ---------------------------------------------------------------------------
# adaptive chunking: several consecutive cut chunks as one dispatch unit


def _new_rows(t: pa.Table, first_instant: int) -> pa.Table:
    """The rows of a query chunk's item that are new in it (``ts >= instants[0]``; the legacy is before)."""
    ts = _ts(t)
    k = int(np.searchsorted(ts, first_instant, side="left"))
    return t if k == 0 else t.slice(k)


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk that evaluates every instant of ``chunks``: consecutive chunks in cut order
    (no chunk was cut between two of them), each possibly without its stopped queries.

    Per query the merged chunk carries the legacy, ``prev_instant`` and state of the first
    of them that carries the query, then the new tuples of each in order.  Every later
    chunk's legacy is inside that (the windows at later instants need only tuples of the
    first chunk's legacy or newer), so a worker computes exactly the same rows at every
    instant; :func:`split_result` turns its reply back into one result per chunk.  The
    merged chunk has the first chunk's id and spans ``chunks[0].first_ts .. chunks[-1].last_ts``.
    """
    if not chunks:
        raise ValueError("nothing to merge")
    if len(chunks) == 1:
        return chunks[0]
    cid = chunks[0].chunk_id
    parts: dict[str, list[QueryChunk]] = {}
    for c in chunks:
        for qc in c.queries:
            parts.setdefault(qc.query_id, []).append(qc)
    out = []
    for qid, qcs in parts.items():
        head = qcs[0]
        if len(qcs) == 1:
            out.append(head if head.chunk_id == cid else QueryChunk(qid, cid, head.items, head.instants,
                                                                     head.prev_instant, head.state, head.state_upto))
            continue
        items = []
        for i, t in enumerate(head.items):
            tables = [t] + [_new_rows(q.items[i], q.instants[0]) for q in qcs[1:] if q.instants]
            tables = [x for x in tables if x.num_rows] or [t]
            items.append(tables[0] if len(tables) == 1 else pa.concat_tables(tables))
        instants = [x for q in qcs for x in q.instants]
        out.append(QueryChunk(qid, cid, items, instants, head.prev_instant, head.state, head.state_upto))
    streams = tuple(dict(s for c in chunks for s in c.streams).items())
    return Chunk(chunk_id=cid, first_ts=chunks[0].first_ts, last_ts=chunks[-1].last_ts, queries=out, streams=streams)


def _split_rows(rows: pa.Table, bounds: list[tuple[int, int]]) -> list[pa.Table]:
    """``rows`` by the instant range of each part (arrival order kept inside a part); rows outside
    every range are dropped."""
    if rows is None or rows.num_rows == 0 or "ts" not in rows.column_names:
        empty = rows if rows is not None else pa.table({})
        return [empty.slice(0, 0) if empty.num_columns else empty for _ in bounds]
    ts = rows.column("ts").to_numpy()
    out = []
    for lo, hi in bounds:
        mask = (ts >= lo) & (ts <= hi)
        if mask.all():
            out.append(rows)
        elif not mask.any():
            out.append(rows.slice(0, 0))
        else:
            idx = np.flatnonzero(mask)
            if idx[-1] - idx[0] + 1 == len(idx):  # contiguous (the usual case: rows in instant order)
                out.append(rows.slice(int(idx[0]), len(idx)))
            else:
                out.append(rows.take(pa.array(idx)))
    return out


def split_result(result: ChunkResult, parts: list[Chunk]) -> dict[int, ChunkResult]:
    """A worker's result for a merged chunk, as the results of its cut chunks.

    ``parts``: the cut chunks the merged chunk was made of, in order, except those already
    released (a prefix).  Only parts that carry the query get a result.  Rows go to the part
    whose instants hold them (rows of released parts are dropped); a failure goes to the
    part holding ``error_ts`` (parts after it get nothing: the query stops there; a failure
    in a released part is already known); a state goes to the last part that carries the
    query, with ``state_upto`` at most that part's last instant (the query has no visible
    tuple after it in the merged chunk, so the state is the same)."""
    qid = result.query_id
    carriers = [c for c in parts if any(qc.query_id == qid for qc in c.queries)]
    if not carriers:
        return {}
    if result.error is not None:
        if result.error_ts is None:
            carriers = carriers[:1]
        else:
            ets = int(result.error_ts)
            upto = [c for c in carriers if c.first_ts <= ets]
            if not upto:
                return {}  # it failed in a part released before
            carriers = upto
    rows = _split_rows(result.rows, [(c.first_ts, c.last_ts) for c in carriers])
    out = {}
    for i, (c, r) in enumerate(zip(carriers, rows)):
        last = i == len(carriers) - 1
        stats = result.stats if i == 0 else {}
        if last and result.error is not None:
            out[c.chunk_id] = ChunkResult(qid, c.chunk_id, r, None, None, stats, result.error, result.error_ts)
        elif last and result.state is not None and result.state_upto is not None:
            upto = min(int(result.state_upto), c.last_ts)
            out[c.chunk_id] = ChunkResult(qid, c.chunk_id, r, result.state, upto, stats)
        else:
            out[c.chunk_id] = ChunkResult(qid, c.chunk_id, r, stats=stats)
    return out
