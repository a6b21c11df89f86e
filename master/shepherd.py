"""The trusted stream shepherd: what a master of level L may ever hold.

A master of level L accepts only tuples whose level L dominates; anything else
is dropped on arrival and never stored, forwarded, counted where another
session can see it, or logged (the dissertation's "a level-S master never
receives a TS tuple").  How many rows of a batch were dropped is told only to
the producer that sent the batch (its ingest reply).  A source logged in at
level l may only write tuples of level l (restricted *-property).

:meth:`Shepherd.filter` is pure (no shared state), so the master runs it
outside its lock: how many above-level rows a batch had never changes how
long another session waits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from strata.lattice import Lattice
from strata.visibility import Visibility

__all__ = ["Shepherd", "ShepherdError"]


class ShepherdError(ValueError):
    """A batch a source may not write (wrong levels, unknown levels)."""


@dataclass
class Shepherd:
    lattice: Lattice
    level: str
    dropped: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.level = self.lattice.parse(self.level)
        #: what this master may hold: labels here are canonical (``_canonical`` runs first)
        self.visibility = Visibility(self.lattice, self.level, canonical=True)

    def canonical_levels(self, table: pa.Table) -> pa.Table:
        """The batch with every level in canonical form; a missing, null or unknown level
        rejects the whole batch (ShepherdError), so nothing is half accepted."""
        return self._canonical(table)[0]

    def _canonical(self, table: pa.Table) -> tuple[pa.Table, set[str]]:
        """:meth:`canonical_levels` and the batch's distinct (canonical) levels, one hash pass."""
        if "level" not in table.column_names:
            raise ShepherdError("labelled input needs a 'level' column")
        col = table.column("level")
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise ShepherdError(f"the 'level' column must hold level names, not {col.type}")
        if col.null_count:
            raise ShepherdError(f"{col.null_count} tuple(s) have no level")
        distinct = pc.unique(col).to_pylist()
        canon = {}
        for text in distinct:
            try:
                canon[text] = self.lattice.parse(text)
            except ValueError:
                raise ShepherdError(f"unknown level {text!r}") from None
        if all(k == v for k, v in canon.items()):
            return table, set(canon)
        keys = pa.array(list(canon), pa.string())
        vals = pa.array(list(canon.values()), pa.string())
        fixed = pc.take(vals, pc.index_in(col, value_set=keys))
        return table.set_column(table.column_names.index("level"), "level", fixed), set(canon.values())

    def filter(self, table: pa.Table) -> tuple[pa.Table, int]:
        """(rows the master may hold, how many were dropped); touches no shared state.

        A batch whose levels are all visible passes as it is (no per-tuple work beyond the
        one pass that finds its distinct levels); one with none visible is dropped whole.
        A missing, null or unknown level refuses the whole batch (:class:`ShepherdError`)."""
        if table.num_rows == 0:
            return table, 0
        table, levels = self._canonical(table)
        return self.visibility.without_hidden(table, self.visibility.labels(sorted(levels)))

    def admit(self, stream: str, table: pa.Table) -> pa.Table:
        """:meth:`filter`, counting the dropped rows per stream in ``dropped`` (tests and the
        in-process runner; the master never shows this count to anyone)."""
        kept, n = self.filter(table)
        if n:
            self.dropped[stream] += n
        return kept

    def check_source(self, source_level: str, table: pa.Table) -> pa.Table:
        """A source writes only its own level: stamp missing levels, refuse others."""
        lv = self.lattice.parse(source_level)
        if "level" not in table.column_names:
            return table.append_column("level", pa.array([lv] * table.num_rows, pa.string()))
        table = self.canonical_levels(table)
        bad = pc.sum(pc.cast(pc.not_equal(table.column("level"), lv), pa.int64())).as_py() or 0
        if bad:
            raise ShepherdError(f"a source at level {lv} may only write level {lv}; {bad} tuple(s) carry another level")
        return table
