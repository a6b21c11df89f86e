"""The trusted stream shepherd: what a master of level L may ever hold.

A master of level L accepts only tuples whose level L dominates; anything else
is dropped on arrival, counted, and never stored, forwarded or logged (the
dissertation's "a level-S master never receives a TS tuple").  A source logged
in at level l may only write tuples of level l (restricted *-property).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from strata.lattice import Lattice

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
        self._visible = sorted(self.lattice.dominated(self.level))

    def admit(self, stream: str, table: pa.Table) -> pa.Table:
        """Rows the master may hold; the rest are counted per stream, never kept."""
        if table.num_rows == 0:
            return table
        keep = pc.is_in(table.column("level"), value_set=pa.array(self._visible, pa.string()))
        keep = pc.fill_null(keep, False)
        kept = table.filter(keep)
        n = table.num_rows - kept.num_rows
        if n:
            self.dropped[stream] += n
        return kept

    def check_source(self, source_level: str, table: pa.Table) -> pa.Table:
        """A source writes only its own level: stamp missing levels, refuse others."""
        lv = self.lattice.parse(source_level)
        if "level" not in table.column_names:
            return table.append_column("level", pa.array([lv] * table.num_rows, pa.string()))
        levels = table.column("level")
        bad = pc.sum(pc.cast(pc.fill_null(pc.not_equal(levels, lv), True), pa.int64())).as_py() or 0
        if bad:
            raise ShepherdError(f"a source at level {lv} may only write level {lv}; {bad} tuple(s) carry another level")
        return table
