"""Stored relations on the master (docs/semantics.md §3a): live rows and delete matching.

A relation's input rows say ``op = insert`` or ``op = delete``.  An insert adds a row; a
delete removes the **oldest live row of the same level with equal attribute values**
(NULL equals NULL, NaN equals NaN, -0.0 equals 0.0), and a delete that matches no live
row refuses its whole batch.  Matching is per level, so what a level's rows become never
depends on rows of another level.

Committed rows carry ``_del``: NULL for an insert, the ``_seq`` of the row it removes for
a delete.  Query chunks carry, per relation FROM item, the visible rows live before the
chunk's first instant (the legacy: every visible update is an instant, so that is also
their content at the previous instant) followed by the chunk's visible updates in arrival
order; the worker turns a delete into the end of its row's interval ``[ts, delete ts)``.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.config import OP_COLUMN

__all__ = ["DEL", "Relation", "RelationError", "apply", "intervals"]

#: the column of a committed relation row naming the row a delete removes (NULL: an insert)
DEL = "_del"

_NAN = object()  # NaN as a dictionary key equal to itself (-0.0 and 0.0 are equal keys already)


class RelationError(ValueError):
    """A batch that deletes a row that is not live."""


def _norm(values: list) -> list:
    return [_NAN if isinstance(v, float) and math.isnan(v) else v for v in values]


def _keys(t: pa.Table, attributes: list[str]) -> list[tuple]:
    cols = [t.column("level").to_pylist()] + [_norm(t.column(c).to_pylist()) for c in attributes]
    return list(zip(*cols))


def apply(live: pa.Table, updates: pa.Table) -> pa.Table:
    """``live`` (rows in ``_seq`` order) after ``updates`` (committed rows in arrival order)."""
    if updates.num_rows == 0:
        return live
    d = updates.column(DEL)
    inserts = updates.filter(pc.is_null(d)) if d.null_count != updates.num_rows else updates
    gone = pc.drop_null(d)
    out = pa.concat_tables([live, inserts]) if live.num_rows else inserts
    if len(gone):
        out = out.filter(pc.invert(pc.is_in(out.column("_seq"), value_set=gone.combine_chunks())))
    return out.combine_chunks() if out.num_rows else live.schema.empty_table()


def intervals(seq: np.ndarray, ts: np.ndarray, deleted: np.ndarray, is_delete: np.ndarray) -> np.ndarray:
    """Per row, the end of its interval of instants: the ts of the delete that removes it, or the
    int64 maximum (∞); deletes get their own ts (an empty interval).  ``deleted``: the ``_del``
    values (anything where ``is_delete`` is False)."""
    end = np.full(len(ts), np.iinfo(np.int64).max, np.int64)
    if not is_delete.any():
        return end
    end[is_delete] = ts[is_delete]
    order = np.argsort(seq, kind="stable")
    targets = deleted[is_delete].astype(np.int64)
    pos = np.searchsorted(seq[order], targets)
    ok = pos < len(seq)
    ok[ok] = seq[order][pos[ok]] == targets[ok]  # a target outside the chunk is not one of its rows
    end[order[pos[ok]]] = ts[is_delete][ok]
    return end


class Relation:
    """One stored relation's rows on a master: ``live`` as of the closed boundary, ``recent`` the
    committed updates after it (chunks not closed yet), and the live rows of every key for matching."""

    def __init__(self, name: str, schema: pa.Schema):
        self.name = name
        self.schema = schema  # committed rows: _seq, ts, level, attributes, _del
        self.attributes = [f.name for f in schema][3:-1]
        self.live = schema.empty_table()
        self.recent: list[pa.Table] = []
        self._index: dict[tuple, deque] = {}  # key -> _seq of its live rows, oldest first

    @property
    def retained_rows(self) -> int:
        return self.live.num_rows + sum(t.num_rows for t in self.recent)

    def match(self, t: pa.Table, seq0: int):
        """The deletes of checked batch ``t`` (``ts, level, attributes, op``; its rows get
        ``_seq`` from ``seq0``) matched to live rows, without changing anything; raises
        :class:`RelationError` for a delete that matches none."""
        if t.num_rows == 0:
            return None
        ops = t.column(OP_COLUMN).to_pylist()
        keys = _keys(t, self.attributes)
        local: dict[tuple, deque] = {}
        dels = [None] * len(ops)
        for r, (k, op) in enumerate(zip(keys, ops)):
            q = local.get(k)
            if q is None:
                q = local[k] = deque(self._index.get(k, ()))
            if op == "insert":
                q.append(seq0 + r)
            elif q:
                dels[r] = q.popleft()
            else:
                shown = ", ".join(f"{a}={t.column(a)[r].as_py()!r}" for a in self.attributes)
                raise RelationError(f"relation {self.name}: row {r + 1} (ts {t.column('ts')[r].as_py()}) deletes "
                                    f"a row that is not in the relation: level {k[0]}, {shown}")
        return local, dels

    def commit(self, t: pa.Table, matched) -> pa.Table:
        """Apply what :meth:`match` found; ``t`` as committed rows (``op`` replaced by ``_del``)."""
        local, dels = matched
        for k, q in local.items():
            if q:
                self._index[k] = q
            else:
                self._index.pop(k, None)
        t = t.drop_columns([OP_COLUMN])
        return t.append_column(DEL, pa.array(dels, pa.int64()))

    def visible(self, levels) -> pa.Table:
        """The live rows (as of the closed boundary) of ``levels``."""
        if self.live.num_rows == 0:
            return self.schema.empty_table()
        return self.live.filter(pc.is_in(self.live.column("level"), value_set=pa.array(sorted(levels), pa.string())))

    def fold(self, boundary: int) -> None:
        """Instants before ``boundary`` closed: their updates join ``live``."""
        done, rest = [], []
        for t in self.recent:
            ts = t.column("ts").to_numpy()
            k = int(np.searchsorted(ts, boundary, side="left"))
            if k:
                done.append(t.slice(0, k))
            if k < t.num_rows:
                rest.append(t.slice(k))
        if done:
            self.live = apply(self.live, pa.concat_tables(done))
        self.recent = rest

    # -- checkpoints --------------------------------------------------------------
    def export(self) -> tuple[pa.Table, pa.Table]:
        recent = pa.concat_tables(self.recent) if self.recent else self.schema.empty_table()
        return self.live, recent

    def restore(self, live: pa.Table, recent: pa.Table) -> None:
        self.live, self.recent = live, ([recent] if recent.num_rows else [])
        self._index = {}
        for k, s in zip(_keys(live, self.attributes), live.column("_seq").to_pylist()):
            self._index.setdefault(k, deque()).append(s)
        if recent.num_rows:
            for k, s, d in zip(_keys(recent, self.attributes), recent.column("_seq").to_pylist(),
                               recent.column(DEL).to_pylist()):
                if d is None:
                    self._index.setdefault(k, deque()).append(s)
                else:
                    self._index[k].remove(d)
                    if not self._index[k]:
                        del self._index[k]
