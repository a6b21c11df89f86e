"""Loading a chunk into Spark: the first of the three parts of a chunk's evaluation.

Each FROM item's Arrow table becomes one frame of the run's statement (worker/evaluate.py builds
the statement, worker/assemble.py turns its rows into the result): in arrival order, only ``ts``,
the level bitmask (computed in Arrow) and the attributes the query reads, with its columns
prefixed by the item (``i0__sid``: Spark names are case-insensitive and a self-join has the same
attribute twice).  With Arrow membership each tuple's interval of instants (``windows.end_array``
in NumPy) travels too and the tuples in no window at an evaluated instant stay behind; a stored
relation's rows carry the end their delete gives them.  String GROUP BY keys that Spark needs only
to tell apart travel as a per-chunk dictionary's int32 codes.  Column names in queries resolve to
the items here as well.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import ARROW_TYPES
from strata.chunking.model import LegacyMode
from strata.chunking.relations import DEL, intervals
from strata.mlscql import ast as A

from .assemble import LEVEL, EngineError
from .expr import ident
from .windows import MASK, end_array, slides, start_array, useful_rows

__all__ = ["ChunkLoad", "item_col", "interval_span", "window_members"]


def item_col(i: int, name: str) -> str:
    """The Spark column of FROM item ``i``'s attribute ``name`` (``i0__sid``)."""
    return ident(f"i{i}__{name}")


def interval_span(window: A.Window, instant_seconds: float) -> int | None:
    """T of a window whose intervals are ``[ts, ts + T)`` (RANGE T, NOW), else None."""
    if window.kind == "range":
        if window.slide_instants(instant_seconds) is not None:
            return None  # intervals from a slide boundary to another (windows.start_array)
        return int(window.range_instants(instant_seconds))
    if window.kind == "now":
        return 1
    return None


def window_members(ts: np.ndarray, end: np.ndarray, instants: list[int]) -> tuple[int, np.ndarray]:
    """(how many (row, instant) pairs have the instant in the row's interval ``[ts, end)``,
    per instant of ``instants`` (ascending) whether some row's interval holds it)."""
    ins = np.asarray(instants, dtype=np.int64)
    first = np.searchsorted(ins, ts, side="left")
    last = np.searchsorted(ins, end, side="left")
    k = len(ins)
    opened = np.cumsum(np.bincount(first, minlength=k + 1) - np.bincount(last, minlength=k + 1))[:k]
    return int(np.sum(last - first)), opened > 0



class ChunkLoad:
    """The input side of a run (worker/evaluate.py's :class:`~strata.worker.evaluate.SelectRun`):
    resolving the query's columns to its FROM items and registering the items' tables as frames.

    Reads the run's ``e`` (the engine), ``cq``, ``q``, ``chunk``, ``mode``, ``evals`` (the evaluated
    instants), ``prefix`` and ``codes``; keeps ``frames``, ``coded``, ``rows_in`` (rows sent to
    Spark), ``explode`` and ``covered`` (how the windows cover the instants, see
    :meth:`~strata.worker.evaluate.Aggregation._every_instant_has_rows`)."""

    def _type(self, c: A.Column) -> str | None:
        return self.cq.items[self._item_of(c.qualifier)].schema.type_of(c.name)

    # ------------------------------------------------------------- resolution
    def _item_of(self, qualifier: str | None) -> int:
        if qualifier is None:
            if len(self.cq.items) == 1:
                return 0
            raise EngineError("unqualified column in a compiled query")
        if qualifier in self.index:
            return self.index[qualifier]
        return self.index_ci[qualifier.lower()]

    def _resolve(self, c: A.Column) -> str:
        return item_col(self._item_of(c.qualifier), c.name)

    def _coded_keys(self) -> list[tuple[int, str]]:
        """String attributes Spark needs only to tell apart: GROUP BY keys that appear nowhere else but
        as bare select items (not in WHERE, HAVING or an aggregate argument), in a chunk evaluated
        without a running state.  They travel as int32 dictionary codes, and the output is decoded
        with the chunk's dictionary (:meth:`_finish`): equal strings have equal codes and NULL stays
        NULL, so the groups are the same, while Spark converts and hashes integers instead of
        strings (a 680 k-row RANGE chunk grouped by a string key: about half the engine time)."""
        if not self.cq.is_aggregate or self.mode is not LegacyMode.WINDOW or not self.e.code_keys or not self.codes:
            return []
        keys = [g for g in self.q.group_by if isinstance(g, A.Column) and self._type(g) == "string"]
        if not keys:
            return []
        other: list[A.Expr] = [x for x in (self.q.where, self.q.having) if x is not None]
        other += [a for s in self.q.select or () for a in A.aggregates_in(s.expr)]
        other += [s.expr for s in self.q.select or () if not isinstance(s.expr, A.Column)]
        other += [g for g in self.q.group_by if not isinstance(g, A.Column)]
        used = {(self._item_of(c.qualifier), c.name.lower()) for e in other for c in A.columns_in(e)}
        used |= {(i, p.lower()) for i, f in enumerate(self.q.from_) for p in f.window.partition_by}
        out = []
        for g in keys:
            k = (self._item_of(g.qualifier), g.name)
            if (k[0], g.name.lower()) not in used and k not in out:
                out.append(k)
        return out

    def _needed(self) -> list[set[str]]:
        need: list[set[str]] = [set() for _ in self.cq.items]
        exprs = [s.expr for s in self.q.select or ()] + list(self.q.group_by)
        exprs += [x for x in (self.q.where, self.q.having) if x is not None]
        for e in exprs:
            for c in A.columns_in(e):
                need[self._item_of(c.qualifier)].add(c.name)
        for i, f in enumerate(self.q.from_):
            need[i].update(f.window.partition_by)
        return need

    # ------------------------------------------------------------------ input
    def _load(self, i: int, needed: set[str], window: A.Window | None = None,
              ts_in: list[int] | None = None, ts_after: int | None = None,
              seq: bool = False, end_column: bool = True) -> tuple[str, list[str]]:
        """Registers item ``i``'s table; returns (SQL source placeholder, SQL column list).

        Only ``ts``, the level mask and the ``needed`` attributes travel to Spark (``level``
        only when the query reads it, ``_seq`` only with ``seq``: Spark-side ROWS membership).
        With ``window`` (Arrow membership) the table also gets each tuple's interval end
        ``i{i}___end`` and loses the tuples that are in no window at any evaluated instant;
        ``ts_in`` / ``ts_after`` keep only tuples with ``ts`` in the list / after the value
        and not after the last evaluated instant.
        """
        table = self.chunk.items[i]
        schema = self.cq.items[i].schema
        lower = {n.lower(): n for n in table.column_names}

        def key(name: str) -> str:
            k = name if name in table.column_names else lower.get(name.lower())
            if k is None:
                raise EngineError(f"table of FROM item {i} ({self.cq.items[i].name}) lacks column {name!r}")
            return k

        if lower.get("_seq") is not None:  # else in arrival order already (chunking.prune.project_chunk)
            seqs = table.column(key("_seq")).cast(pa.int64()).to_numpy()
            if len(seqs) > 1 and bool(np.any(seqs[1:] < seqs[:-1])):
                table = table.take(pa.array(np.argsort(seqs, kind="stable")))
        ts = table.column(key("ts")).cast(pa.int64()).to_numpy()
        keep = None
        end = None
        start = ts
        if self.q.from_[i].window.kind == "relation":
            # a stored relation: inserts live until the delete that names them (chunking.relations)
            d = table.column(key(DEL))
            gone = d.is_valid().to_numpy(zero_copy_only=False)
            end = intervals(table.column(key("_seq")).cast(pa.int64()).to_numpy(), ts, d.fill_null(-1).to_numpy(), gone)
            keep = ~gone & useful_rows(start, end, self.evals)
        elif window is not None:
            parts = [table.column(key(c)) for c in window.partition_by]
            end = end_array(window, ts, parts, self.e.config.instant_seconds)
            start = start_array(window, ts, self.e.config.instant_seconds)
            keep = useful_rows(start, end, self.evals)
        if ts_in is not None:
            keep = np.isin(ts, np.asarray(ts_in, dtype=np.int64))
        if ts_after is not None:
            keep = (ts > ts_after) & (ts <= self.evals[-1])
        if keep is not None and not keep.all():
            mask = pa.array(keep)
            table = table.filter(mask)
            if end is not None:
                end = end[keep]
                start = start[keep]
        self.rows_in += table.num_rows
        if end is None:
            self.explode += table.num_rows
            self._cover_known = False
        else:
            pairs, cover = window_members(start, end, self.evals)
            self.explode += pairs
            self.covered = cover if self.covered is None else self.covered & cover

        levels = table.column(key("level")).cast(pa.string())
        arrays = [table.column(key("ts")).cast(pa.int64()), self.e.masks_of(levels)]
        names = [f"i{i}__ts", f"i{i}__{MASK}"]
        lowered = {n.lower() for n in needed}
        if LEVEL in lowered:
            arrays.append(levels)
            names.append(f"i{i}__{LEVEL}")
        if seq:
            arrays.append(table.column(key("_seq")).cast(pa.int64()))
            names.append(f"i{i}___seq")
        if end is not None and end_column:
            arrays.append(pa.array(end, pa.int64()))
            names.append(f"i{i}___end")
        if end is not None and slides(window, self.e.config.instant_seconds):
            arrays.append(pa.array(start, pa.int64()))
            names.append(f"i{i}___start")
        for name, typ in schema.columns:
            if name in needed:
                col = table.column(key(name)).cast(ARROW_TYPES[typ])
                if (i, name) in self.coded:  # one dictionary per chunk: codes mean nothing across chunks
                    enc = pc.dictionary_encode(col.combine_chunks())
                    self.coded[(i, name)] = enc.dictionary
                    col = enc.indices.cast(pa.int32())
                arrays.append(col)
                names.append(f"i{i}__{name}")
        return self._frame(f"i{i}", pa.Table.from_arrays(arrays, names=names)), [ident(n) for n in names]

    def _frame(self, key: str, table: pa.Table) -> str:
        key = self.prefix + key
        self.frames[key] = table
        return f"\x00{key}\x00"
