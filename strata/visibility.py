"""May a session of level L see a tuple labelled l: the one place that decides it.

Like Accumulo's ``VisibilityEvaluator``: a tuple's label is the text in its ``level`` column,
and a holder of level L (a session, a master, a worker) may see it iff L dominates the level
the label names.  :class:`Visibility` answers that for one holder, over a label or over the
distinct labels of an Arrow column, and every place that keeps or refuses tuples by their
level asks it:

* the producer leaving out the rows its master's shepherd would drop (``strata.inputs``:
  ``drop_above`` and the advances of ``instant_batches``);
* the master's stream shepherd, which holds only what its level dominates (master/shepherd.py);
* the worker, which refuses a chunk holding a tuple its level does not dominate (worker/service.py).

A label is *visible* (a level L dominates), *hidden* (a level L does not dominate) or
*unknown* (no level of the lattice): what to do with an unknown label (refuse the batch, leave
it to the master, refuse the chunk) is the caller's, never silently "visible".  By default a
label is read as a level literal (``Lattice.parse``: ``" S"`` is ``S``); ``canonical=True``
knows only the lattice's own spelling of each level, for labels that already travelled through
a shepherd (between master and worker), where any other text is a fault.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from .lattice import Lattice

__all__ = ["Visibility", "Labels", "VISIBLE", "HIDDEN", "UNKNOWN"]

VISIBLE, HIDDEN, UNKNOWN = "visible", "hidden", "unknown"


@dataclass(frozen=True)
class Labels:
    """The distinct labels of a column (or a collection of labels), as written, by what a holder
    of one level may do with them; ``nulls``: some row has no label (in none of the three)."""

    visible: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    nulls: bool = False


class Visibility:
    """What a holder of ``level`` may see (``canonical``: only the lattice's spelling of a level is a label)."""

    def __init__(self, lattice: Lattice, level: str, canonical: bool = False):
        self.lattice = lattice
        self.level = lattice.parse(level)
        self.canonical = canonical
        #: the canonical levels ``level`` dominates
        self.dominated = lattice.dominated(self.level)
        self._levels = frozenset(lattice.levels)

    def classify(self, label: str) -> str:
        """:data:`VISIBLE`, :data:`HIDDEN` or :data:`UNKNOWN` for one label."""
        if self.canonical:
            level = label if label in self._levels else None
        else:
            try:
                level = self.lattice.parse(label)
            except ValueError:
                level = None
        if level is None:
            return UNKNOWN
        return VISIBLE if level in self.dominated else HIDDEN

    def may_see(self, label: str) -> bool:
        """Whether a tuple labelled ``label`` is visible (an unknown label is not)."""
        return self.classify(label) == VISIBLE

    def labels(self, values: pa.Array | pa.ChunkedArray | Iterable[str | None]) -> Labels:
        """The distinct labels of an Arrow string column (one hash pass, ``pc.unique``) or of a
        collection of labels, split by :meth:`classify`, each group in first-seen order."""
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = pc.unique(values).to_pylist()
        out: dict[str, list[str]] = {VISIBLE: [], HIDDEN: [], UNKNOWN: []}
        nulls = False
        seen: set[str] = set()
        for text in values:
            if text is None:
                nulls = True
                continue
            if text in seen:
                continue
            seen.add(text)
            out[self.classify(text)].append(text)
        return Labels(tuple(out[VISIBLE]), tuple(out[HIDDEN]), tuple(out[UNKNOWN]), nulls)

    def visible_rows(self, column: pa.Array | pa.ChunkedArray, labels: Labels | None = None):
        """Boolean per row of ``column``: its label is visible (no label or an unknown one: false).
        ``labels``: the column's :meth:`labels`, when the caller has them already."""
        labels = self.labels(column) if labels is None else labels
        return pc.is_in(column, value_set=pa.array(labels.visible, _text_type(column)))

    def without_hidden(self, table: pa.Table, labels: Labels | None = None,
                       column: str = "level") -> tuple[pa.Table, int]:
        """``table`` without the rows whose label is hidden, and how many those were.  Rows with no
        label or an unknown one stay (the caller decides about them); a table with no hidden label
        is returned as it is, one with only hidden labels as its empty slice."""
        col = table.column(column)
        labels = self.labels(col) if labels is None else labels
        if not labels.hidden:
            return table, 0
        if not (labels.visible or labels.unknown or labels.nulls):
            return table.slice(0, 0), table.num_rows
        if labels.unknown or labels.nulls:
            keep = pc.fill_null(pc.invert(pc.is_in(col, value_set=pa.array(labels.hidden, _text_type(col)))), True)
        else:
            keep = pc.is_in(col, value_set=pa.array(labels.visible, _text_type(col)))
        kept = table.filter(keep)
        return kept, table.num_rows - kept.num_rows


def _text_type(column) -> pa.DataType:
    """The type of a value set for ``pc.is_in`` over ``column``: its own string type, else string."""
    t = column.type
    return t if pa.types.is_string(t) or pa.types.is_large_string(t) else pa.string()
