"""``chunking.prune._last_per_instant`` against its definition: a row stays when fewer than ``n`` rows of
its ``ts`` come after it."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.chunking import prune as P


def _definition(ts: list[int], n: int) -> list[int]:
    return [i for i, x in enumerate(ts) if sum(1 for y in ts[i + 1:] if y == x) < n]


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 12), max_size=40), n=st.integers(0, 6))
def test_last_per_instant_keeps_the_last_n_rows_of_each_ts(counts, n):
    ts = np.repeat(np.arange(len(counts), dtype=np.int64) * 3, counts)
    t = pa.table({"ts": ts, "row": np.arange(len(ts), dtype=np.int64)})
    got = P._last_per_instant(t, n)
    assert got.schema == t.schema
    assert got.column("row").to_pylist() == _definition(ts.tolist(), n)
