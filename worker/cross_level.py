"""Cross-level operator reuse in a trusted worker (dissertation Defs. 11-12, Alg. 1; docs/trusted.md).

A trusted worker (``WorkerCore(levels=...)``) executes the chunks of every level it serves.  This
module lets a query of a level ``H`` reuse what a query of a level ``L`` strictly dominated by ``H``
computed over the same instants, never the reverse:

* **storing** (``L``'s side): after a chunk of ``L`` is evaluated, each result without failure is kept
  with the query's compiled form and the chunk's inputs (references, no copy).  ``L`` stores whenever
  the worker serves a level strictly above ``L``: a fixed rule, independent of whether any query above
  ``L`` exists or what it is, so ``L``'s work and timing do not depend on them; ``L`` never waits for
  anything here (the cache's lock covers a dictionary update);
* **reading** (``H``'s side), before ``H``'s chunk is evaluated, per query chunk, from entries of levels
  that ``H`` strictly dominates (checked with the lattice) only:

  - **whole** (an identical node, Def. 2 / 4): the query's complete sharing key (strata/sharing,
    ``complete_key``: windows *with their resolved level sets*, WHERE, GROUP BY, HAVING, select list,
    R2S, legacy mode) equals the stored query's, the chunk evaluates the same instants after the same
    previous instant with the same running state, and each FROM item holds the same input (below).
    The stored result is ``H``'s
    result (its rows, state and levels; only the query id and column names change).  Any query kind but
    compound queries, queries over subqueries and queries over stored relations.
  - **split** (Def. 12's decomposition ``N = N' ∪ N''`` of a selection over a window whose levels do not
    interact): a single-item selection (no aggregate, no DISTINCT) over a RANGE, NOW or UNBOUNDED window,
    a PARTITION BY window partitioned by ``level`` or a ROWS window over a single level.  Its output at an
    instant is the union over the window's levels of the output over each level alone (a row is one
    tuple, at the tuple's level; ISTREAM/DSTREAM differences keep the level in the row, so they split by
    level too).  With the stored query equal but for its window level set ``A`` and ``H``'s set ``B``,
    ``C = A ∩ B`` non-empty, and ``H``'s tuples of the levels ``C`` the same as the stored chunk's:
    ``N'`` = the stored rows of the levels ``C`` (Def. 11 case 3 when ``B ⊂ A``: a level selection
    over the lower output) and ``N''`` = ``H``'s query over its tuples of the levels ``B \\ A`` alone
    (the residual: not evaluated at all when the chunk has none of them, else evaluated in the chunk's
    one batch with ``H``'s other queries, worker/shared.py).  A failing residual run, or any error in
    here, evaluates ``H``'s query as usual.

"The same input" is checked, not assumed (two level pipelines need not have been fed alike): the same
running state and, per FROM item, the same rows of the compared levels in arrival order (without the
pipeline's own arrival numbers ``_seq``), in the columns the query reads, limited as the engine limits
them to the rows in a window at an evaluated instant (a chunk serves all of its level's queries, so
another level's carries other legacy rows and columns).

Everything else, and every miss, is evaluated as if this module did not exist: a miss never waits.
Each storing level's entries are bounded on their own (entries and stored rows, its oldest dropped
first), so which of a level's outputs remain never depends on another level's stores or on who read
them.  Hits, misses and the reasons are counted per reading level; :meth:`CrossLevelCache.stats` gives a
level its own counters only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import same_table
from strata.chunking.model import ChunkResult, LegacyMode, QueryChunk, legacy_mode
from strata.chunking.prune import used_columns
from strata.sharing.execution import complete_key
from strata.sharing.optree import Node

from .assemble import is_infrastructure_error, result_schema
from .windows import end_array, start_array, useful_rows

__all__ = ["CrossLevelCache", "Residual", "reuse_shape"]

SEQ = "_seq"
#: window kinds whose rows the comparison of inputs prunes to those in a window at an evaluated instant
_PRUNABLE = ("rows", "partition", "range", "now")


@dataclass(frozen=True)
class Shape:
    """How a query may be reused: ``whole`` key (identical node) and, for a level-separable
    selection, ``split`` key (the same but for the window's level set) with that set."""

    whole: tuple
    split: tuple | None
    levels: frozenset | None  # the window's level set (split queries only)
    item_levels: tuple  # per FROM item: the level set its chunk rows may carry
    windows: tuple = ()  # per FROM item: its window (ast)
    cols: frozenset | None = None  # the attributes the query reads (lower case; None: all)


def _normal_window(w: Node) -> Node | None:
    """The window node without its level set if its levels do not interact (None otherwise):
    RANGE/NOW/UNBOUNDED windows, PARTITION BY level, and ROWS over one level (= PARTITION BY level)."""
    parm = dict(w.parm)
    if "instants" in parm:  # narrowed by Alg. 4, instants of a wider set: evaluated on its own
        return None
    levels = parm.pop("levels")
    if w.op == "time_win":
        return dataclasses.replace(w, parm=tuple(sorted(parm.items())))
    if w.op == "part_win" and "level" in parm["by"]:
        return dataclasses.replace(w, parm=tuple(sorted(parm.items())))
    if w.op in ("tuple_win", "part_win") and len(levels) == 1:
        # ROWS n (PARTITION BY a.. ROWS n) over one level is PARTITION BY level[, a..] ROWS n over it
        parm["by"] = frozenset(parm.get("by", frozenset())) | {"level"}
        return dataclasses.replace(w, op="part_win", parm=tuple(sorted(parm.items())))
    return None


def reuse_shape(cq, instant_seconds: float = 1.0) -> Shape | None:
    """The reuse keys of compiled query ``cq`` (None: never reused nor stored)."""
    if cq.branches or cq.subqueries:
        return None
    wins = cq.query.from_
    if any(f.window.kind == "relation" for f in wins):
        return None  # stored relations: rows carry delete references to the pipeline's arrival numbers
    whole = complete_key(cq, instant_seconds)
    item_levels = tuple(frozenset(f.window.levels) | frozenset(f.window.instants or ()) for f in wins)
    split = levels = None
    if (len(wins) == 1 and not cq.is_aggregate and not cq.query.distinct
            and legacy_mode(cq) in (LegacyMode.WINDOW, LegacyMode.HISTORY, LegacyMode.NONE)):
        w = whole[0][0]
        norm = _normal_window(w)
        if norm is not None:
            split = ((norm,),) + tuple(whole[1:])
            levels = frozenset(w.levels)
    cols = used_columns(cq.query)
    return Shape(whole, split, levels, item_levels, tuple(f.window for f in wins),
                 None if cols is None else frozenset(cols))


def _only(t: pa.Table, levels) -> pa.Table:
    """``t``'s rows of ``levels`` in arrival order (the pipeline's own arrival numbers dropped)."""
    if SEQ in t.column_names:
        seqs = t.column(SEQ).to_numpy()
        if len(seqs) > 1 and bool(np.any(seqs[1:] < seqs[:-1])):
            t = t.take(pa.array(np.argsort(seqs, kind="stable")))
        t = t.drop_columns([SEQ])
    if t.num_rows == 0:
        return t
    return t.filter(pc.is_in(t.column("level"), value_set=pa.array(sorted(levels), pa.string())))


def _relevant(t: pa.Table, levels, window, evals: list[int], cols: set | None, instant_seconds: float) -> pa.Table:
    """What of item table ``t`` the query's output over ``evals`` can depend on: its rows of ``levels`` in
    arrival order, the columns it reads (``cols``; None: all), and, as the engine prunes them
    (worker/load_chunk.py), only the rows in a window at one of ``evals``.  Two chunks whose tables agree
    on this give the query the same output (another level's chunk may carry more legacy rows and columns
    for its other queries: the chunk's tables serve all of them)."""
    t = _only(t, levels)
    if cols is not None:
        t = t.select([n for n in t.column_names if n in ("ts", "level") or n.lower() in cols])
    if window is None or window.filter is not None or window.kind not in _PRUNABLE or t.num_rows == 0:
        return t
    lower = {n.lower(): n for n in t.column_names}
    if any(c.lower() not in lower for c in window.partition_by):
        return t
    ts = t.column("ts").cast(pa.int64()).to_numpy()
    parts = [t.column(lower[c.lower()]) for c in window.partition_by]
    end = end_array(window, ts, parts, instant_seconds)
    keep = useful_rows(start_array(window, ts, instant_seconds), end, evals)
    return t if keep.all() else t.filter(pa.array(keep))


@dataclass
class _Entry:
    level: str
    shape: Shape
    chunk: QueryChunk
    result: ChunkResult


class CrossLevelCache:
    """The trusted worker's store of lower levels' query outputs (see the module doc)."""

    #: entries kept per storing level (its oldest dropped first) ...
    MAX_ENTRIES = 1024
    #: ... and at most this many rows per storing level (stored input and output rows: references to the
    #: chunk's own tables, kept alive while stored; a chunk larger than this is not stored)
    MAX_ROWS = 1_000_000
    #: a split reuse with a non-empty residual N'' only for chunks whose item has at least this many rows
    #: (0: always).  N'' joins the chunk's one Spark statement (worker/engine.py ``run_many``) with its
    #: own, filtered, input table: on small chunks that costs about what the whole query costs there
    #: (measured in docs/trusted.md: no clear difference either way), on large ones it reads fewer rows
    RESIDUAL_MIN_ROWS = 0

    def __init__(self, lattice, levels, instant_seconds: float = 1.0, max_entries: int | None = None,
                 max_rows: int | None = None):
        self.lattice = lattice
        self.levels = tuple(levels)
        self.instant_seconds = instant_seconds
        self.max_entries = self.MAX_ENTRIES if max_entries is None else int(max_entries)
        self.max_rows = self.MAX_ROWS if max_rows is None else int(max_rows)
        #: a split reuse whose N'' is not empty is taken only for an item of at least this many rows
        self.residual_min_rows = self.RESIDUAL_MIN_ROWS
        self._index: dict = {}  # (kind, key, instants, prev) -> {(level, id): _Entry}
        self._parts: dict[str, OrderedDict] = {}  # storing level -> its entries, oldest first
        self._rows: dict[str, int] = {}  # storing level -> rows its entries hold
        self._lock = threading.Lock()
        self._counters: dict[str, Counter] = {lv: Counter() for lv in self.levels}
        self._shapes: dict = {}

    # -- who stores, who reads --------------------------------------------------------------
    def stores(self, level: str) -> bool:
        """Whether ``level``'s results are kept: the worker serves a level strictly above it (a fixed
        rule of the worker's configuration, not of the queries above)."""
        return any(lv != level and self.lattice.leq(level, lv) for lv in self.levels)

    def reads(self, level: str) -> bool:
        return any(lv != level and self.lattice.leq(lv, level) for lv in self.levels)

    def _may_read(self, reader: str, stored: str) -> bool:
        return stored != reader and self.lattice.leq(stored, reader)

    def shape(self, cq) -> Shape | None:
        key = id(cq)
        hit = self._shapes.get(key)
        if hit is not None and hit[0] is cq:
            return hit[1]
        try:
            s = reuse_shape(cq, self.instant_seconds)
        except Exception:  # noqa: BLE001 - a query the keys cannot describe is never reused
            s = None
        if len(self._shapes) > 4096:
            self._shapes.clear()
        self._shapes[key] = (cq, s)  # holds cq: its id cannot be reused while the entry exists
        return s

    @staticmethod
    def _when(qc: QueryChunk) -> tuple:
        return tuple(int(t) for t in qc.instants), qc.prev_instant

    # -- storing -------------------------------------------------------------------------------
    def store(self, level: str, cq, qc: QueryChunk, result: ChunkResult) -> None:
        if result.error is not None or not self.stores(level):
            return
        s = self.shape(cq)
        if s is None:
            return
        when = self._when(qc)
        entry = _Entry(level, s, qc, result)
        size = qc.num_rows + result.rows.num_rows + (qc.state.num_rows if qc.state is not None else 0)
        if size > self.max_rows:
            return
        keys = [("whole", s.whole) + when] + ([("split", s.split) + when] if s.split is not None else [])
        eid = id(entry)
        with self._lock:
            for k in keys:
                self._index.setdefault(k, {})[(level, eid)] = entry
            part = self._parts.setdefault(level, OrderedDict())
            part[eid] = (entry, size, keys)
            self._rows[level] = self._rows.get(level, 0) + size
            # each storing level has its own bounds and drops its oldest entries first: what a level's
            # entries are never depends on another level's stores or on who reads them
            while part and (len(part) > self.max_entries or self._rows[level] > self.max_rows):
                old, (_, osize, okeys) = part.popitem(last=False)
                self._rows[level] -= osize
                for k in okeys:
                    slot = self._index.get(k)
                    if slot is not None:
                        slot.pop((level, old), None)
                        if not slot:
                            del self._index[k]

    def _candidates(self, key) -> list[_Entry]:
        with self._lock:
            return list(self._index.get(key, {}).values())

    def _counter(self, level: str):
        def count(*names: str) -> None:
            with self._lock:
                c = self._counters.setdefault(level, Counter())
                for n in names:
                    c[n] += 1
        return count

    # -- reading -------------------------------------------------------------------------------
    def lookup(self, level: str, cq, qc: QueryChunk, engine=None) -> "ChunkResult | Residual | None":
        """``level``'s result for ``qc`` from a lower level's stored output, or None (evaluate it), or a
        :class:`Residual`: N'' still to evaluate (its ``chunk``, ``qc`` restricted to the levels the stored
        output lacks), then :meth:`combine`; with ``engine`` that is done here (one run of its own)."""
        count = self._counter(level)
        if not self.reads(level):
            return None
        s = self.shape(cq)
        if s is None:
            count("not_reusable")
            return None
        when = self._when(qc)
        seen = False  # a lower level's output of this query over these instants (whose input then differed)
        try:
            for e in self._candidates(("whole", s.whole) + when):
                if not self._may_read(level, e.level):
                    continue
                seen = True
                if self._same_input(e, qc, s, s.item_levels):
                    count("hits", "hits_whole")
                    return _as(e.result, qc, cq, "whole")
            if s.split is not None:
                best = None
                for e in self._candidates(("split", s.split) + when):
                    if not self._may_read(level, e.level):
                        continue
                    common = s.levels & e.shape.levels
                    if not common or (best is not None and len(common) <= len(best[1])):
                        continue
                    seen = True
                    if self._same_input(e, qc, s, (common,)):
                        best = (e, common)
                if best is not None:
                    out = self._split(best[0], best[1], s, cq, qc, level)
                    if out is None:
                        count("misses", "misses_residual_small")
                        return None
                    if isinstance(out, Residual):
                        # N'' evaluated by the caller (with its chunk's other queries), or here
                        return out if engine is None else self.combine(out, engine.run(cq, out.chunk))
                    else:
                        count("hits", "hits_split", "residual_" + out.stats["residual"])
                        return out
        except Exception as exc:  # noqa: BLE001 - never worse than computing it
            if is_infrastructure_error(exc):
                raise
            count("errors")
        count("misses", "misses_other_input" if seen else "misses_absent")
        return None

    def _same_input(self, e: _Entry, qc: QueryChunk, s: Shape, item_levels: tuple) -> bool:
        """Whether stored entry ``e``'s chunk and ``qc`` hold the same input for ``s``'s query (restricted
        to ``item_levels`` per item): the same running state and the same relevant rows (:func:`_relevant`)."""
        st = e.chunk
        if st.state_upto != qc.state_upto or not same_table(st.state, qc.state) or len(st.items) != len(qc.items):
            return False
        evals = sorted({int(t) for t in qc.instants}
                       | ({int(qc.prev_instant)} if qc.prev_instant is not None else set()))
        for a, b, lv, w in zip(st.items, qc.items, item_levels, s.windows):
            if not same_table(_relevant(a, lv, w, evals, s.cols, self.instant_seconds),
                          _relevant(b, lv, w, evals, s.cols, self.instant_seconds)):
                return False
        return True

    def _split(self, e: _Entry, common: frozenset, s: Shape, cq, qc: QueryChunk,
               level: str) -> "ChunkResult | Residual | None":
        """Def. 12: the stored rows of the levels ``common`` plus the query over its other levels."""
        rows = e.result.rows
        if rows.num_rows:
            rows = rows.filter(pc.is_in(rows.column("level"), value_set=pa.array(sorted(common), pa.string())))
        rest = s.levels - common
        item = qc.items[0]
        part = item.filter(pc.is_in(item.column("level"), value_set=pa.array(sorted(rest), pa.string()))) \
            if rest and item.num_rows else item.slice(0, 0)
        if part.num_rows == 0:  # no tuple of the other levels: N'' is empty at every instant
            base = _as(dataclasses.replace(e.result, rows=rows), qc, cq, "split")
            base.stats["residual"] = "empty" if rest else "none"
            return base
        if item.num_rows < self.residual_min_rows:
            return None  # N'' would cost about what the whole query costs in the chunk's batch
        base = _as(dataclasses.replace(e.result, rows=rows), qc, cq, "split")
        return Residual(level, base, dataclasses.replace(qc, items=[part]))

    def combine(self, pending: "Residual", residual: ChunkResult) -> ChunkResult | None:
        """N' ∪ N'': the result of ``pending``'s query from its stored part and ``residual`` (the query's
        result on ``pending.chunk``); None when the residual failed (evaluate the query as usual)."""
        count = self._counter(pending.level)
        if residual.error is not None:
            count("residual_failures", "misses", "misses_residual_failed")
            return None
        base = pending.base
        both = pa.concat_tables([base.rows, residual.rows.cast(base.rows.schema)])
        if both.num_rows > 1:
            both = both.sort_by([("ts", "ascending")])
        count("hits", "hits_split", "residual_run")
        return dataclasses.replace(base, rows=both, stats=dict(base.stats, residual="run"))

    # -- counters ------------------------------------------------------------------------------
    def stats(self, level: str) -> dict:
        """``level``'s own reuse counters (hits, misses, ...): never another level's."""
        with self._lock:
            return dict(self._counters.get(level, Counter()))

    def size(self, level: str) -> tuple[int, int]:
        """(entries, rows) ``level``'s stores hold now."""
        with self._lock:
            return len(self._parts.get(level, ())), self._rows.get(level, 0)


@dataclass
class Residual:
    """A split reuse waiting for N'': ``base`` holds the stored rows of the common levels, ``chunk`` the
    query's chunk restricted to its other levels (to evaluate, e.g. with the chunk's other queries)."""

    level: str  # the reading level (whose counters it updates)
    base: ChunkResult
    chunk: QueryChunk


def _as(src: ChunkResult, qc: QueryChunk, cq, how: str) -> ChunkResult:
    """``src`` as the result of ``qc``'s query (its id, chunk and column names)."""
    rows = src.rows
    schema = result_schema(cq)
    if not rows.schema.equals(schema):
        rows = pa.Table.from_arrays(list(rows.columns), schema=schema)
    stats = dict(src.stats, shared="cross_level", cross_level=how, seconds=0.0)
    return ChunkResult(qc.query_id, qc.chunk_id, rows, src.state, src.state_upto, stats)
