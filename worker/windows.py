"""Window membership (SEMANTICS §3, §5) as per-tuple validity intervals.

Every window kind gives each tuple a half-open interval of evaluation instants
``[ts, end)`` during which the tuple is in the window:

* ``RANGE UNBOUNDED``:  ``end = ∞``                          (all ``ts ≤ τ``)
* ``NOW``:              ``end = ts + 1``                     (``ts = τ``)
* ``RANGE T``:          ``end = ts + T``                     (``τ - T < ts ≤ τ``)
* ``ROWS N``:           ``end = ts of the N-th later tuple``  (``∞`` if none)
* ``PARTITION BY a ROWS N``: the same within the tuple's partition.

For ROWS this holds because ``ts`` never decreases in arrival (``_seq``)
order: the tuples with ``ts ≤ τ`` are a prefix, and the tuple at position
``p`` is among the last N of that prefix exactly while the prefix does not
reach position ``p + N``, i.e. while ``τ < ts[p + N]``.  Ties in ``ts`` are
broken by arrival order, as the contract demands.

The interval end is computed either in NumPy on the chunk's Arrow table
(:func:`end_array`; the default: the engine then drops every tuple that is in
no window at an evaluated instant before Spark sees it, e.g. all but the last
N tuples of each instant for ``ROWS N``) or in Spark (:func:`end_sql`, a
``lead()`` window function).  :func:`membership_sql` then pairs each tuple with
the evaluation instants inside its interval (a literal array, filtered and
exploded), giving the window contents at every instant as one relation keyed
by ``_tau``.
"""

from __future__ import annotations


import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.mlscql import ast as A

__all__ = [
    "TAU", "FOREVER", "end_sql", "end_array", "useful_rows",
    "membership_sql", "instants_sql", "in_instants_sql", "successor_sql",
]

TAU = "_tau"
#: the engine's relation columns besides TAU: a row's level mask and its failure code
MASK = "_mask"
ERR = "_err"
END = "_end"
#: interval end standing for ∞ in :func:`end_array`
FOREVER = np.iinfo(np.int64).max

def end_sql(window: A.Window, ts: str, seq: str, partition: list[str], instant_seconds: float) -> str | None:
    """SQL for the exclusive end of each tuple's interval; ``None`` means ∞ for every tuple.

    The expression may be NULL for some rows (∞ for those).  ``partition``
    are the (SQL) columns of a PARTITION BY window.
    """
    kind = window.kind
    if kind == "unbounded":
        return None
    if kind == "now":
        return f"({ts} + 1)"
    if kind == "range":
        return _boundary_sql(f"({ts} + {window.range_instants(instant_seconds)})", window.slide_instants(instant_seconds))
    if kind in ("rows", "partition"):
        n = int(window.rows)
        if n <= 0:
            return ts  # empty interval: an empty window
        parts = ", ".join(partition) if kind == "partition" and partition else "0"
        return f"lead({ts}, {n}) OVER (PARTITION BY {parts} ORDER BY {seq})"
    raise ValueError(f"unknown window kind {kind!r}")


def start_sql(window: A.Window, ts: str, instant_seconds: float) -> str:
    """SQL for the first instant of each tuple's interval: ``ts``, or with ``RANGE T SLIDE S`` the
    first slide boundary at or after ``ts`` (the window at τ is the RANGE window at ``⌊τ/S⌋·S``, so
    a tuple is in it from the first boundary that reaches it until the first one at or after
    ``ts + T``: the interval ``[⌈ts/S⌉·S, ⌈(ts+T)/S⌉·S)``)."""
    return _boundary_sql(ts, window.slide_instants(instant_seconds))


def start_array(window: A.Window, ts: np.ndarray, instant_seconds: float) -> np.ndarray:
    """:func:`start_sql` in NumPy."""
    return _boundary_array(ts, window.slide_instants(instant_seconds))


def slides(window: A.Window | None, instant_seconds: float) -> bool:
    """Whether ``window`` is a ``RANGE … SLIDE`` window (its intervals do not start at ``ts``;
    only the parser's RANGE windows carry a slide)."""
    return window is not None and window.slide_instants(instant_seconds) is not None


def _boundary_sql(x: str, slide: int | None) -> str:
    """SQL: the first slide boundary (multiple of ``slide``) at or after ``x``; ``x`` without a slide."""
    return x if slide is None else f"({x} + pmod(-{x}, {slide}))"


def _boundary_array(x: np.ndarray, slide: int | None) -> np.ndarray:
    """:func:`_boundary_sql` in NumPy."""
    return x if slide is None else x + np.mod(-x, slide)


def end_array(window: A.Window, ts: np.ndarray, partition: list[pa.ChunkedArray], instant_seconds: float) -> np.ndarray:
    """:func:`end_sql` computed in NumPy (vectorized) for tuples in arrival order.

    ``ts`` is int64 in ``_seq`` order; ``partition`` are the PARTITION BY
    columns (Arrow).  ∞ is :data:`FOREVER`.  Lets the engine drop, before Spark
    sees them, the tuples that are in no window at any evaluated instant (most
    of a chunk for ``ROWS N`` with N much smaller than the chunk).
    """
    kind = window.kind
    n = len(ts)
    if kind == "unbounded":
        return np.full(n, FOREVER, np.int64)
    if kind == "now":
        return ts + 1
    if kind == "range":
        return _boundary_array(ts + window.range_instants(instant_seconds), window.slide_instants(instant_seconds))
    if kind not in ("rows", "partition"):
        raise ValueError(f"unknown window kind {kind!r}")
    rows = int(window.rows)
    end = np.full(n, FOREVER, np.int64)
    if rows <= 0:
        return ts.copy()
    if rows >= n:
        return end
    if kind == "rows" or not partition:
        end[:-rows] = ts[rows:]
        return end
    key = _partition_key(partition)
    order = np.argsort(key, kind="stable")  # stable: arrival order within each partition
    k, t = key[order], ts[order]
    same = k[rows:] == k[:-rows]
    sorted_end = np.full(n, FOREVER, np.int64)
    sorted_end[:-rows][same] = t[rows:][same]
    end[order] = sorted_end
    return end


def _partition_key(columns: list[pa.ChunkedArray]) -> np.ndarray:
    """One int64 code per row, equal iff all partition values are equal (NULLs equal each other)."""
    codes = []
    for col in columns:
        if pa.types.is_floating(col.type):
            col = pc.add(col, 0.0)  # -0.0 and 0.0 are one partition, as in SQL
        enc = pc.dictionary_encode(col, null_encoding="encode").combine_chunks()
        codes.append(np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64))
    if len(codes) == 1:
        return codes[0]
    _, inverse = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def useful_rows(ts: np.ndarray, end: np.ndarray, instants: list[int]) -> np.ndarray:
    """Boolean mask of tuples whose interval ``[ts, end)`` holds at least one of ``instants``."""
    ins = np.asarray(sorted(set(int(t) for t in instants)), dtype=np.int64)
    first = np.searchsorted(ins, ts, side="left")  # first instant ≥ ts
    ok = first < len(ins)
    nxt = ins[np.minimum(first, len(ins) - 1)]
    return ok & (nxt < end)


def instants_sql(instants: list[int]) -> str:
    """An ARRAY<BIGINT> literal of ``instants``.

    Catalyst folds it into one array-valued literal, which generated code reads from its
    references array: unlike a BIGINT literal it never appears in the Java source, so a
    statement that names the instants only through such arrays compiles to the same code
    for every chunk (the code generator's cache then skips the compile).
    """
    return "array(" + ", ".join(f"CAST({int(t)} AS BIGINT)" for t in instants) + ")"


def in_instants_sql(column: str, instants: list[int]) -> str:
    """``column IN (instants…)`` written so that the generated code does not depend on the instants."""
    return f"array_contains({instants_sql(sorted(set(int(t) for t in instants)))}, {column})"


def successor_sql(column: str, pairs: dict[int, int]) -> str:
    """The image of ``column`` under the map ``pairs`` (NULL outside it), instants-independent code."""
    if not pairs:
        return "CAST(NULL AS BIGINT)"
    keys, vals = zip(*sorted(pairs.items()))
    return f"element_at(map_from_arrays({instants_sql(keys)}, {instants_sql(vals)}), {column})"


def membership_sql(source: str, columns: list[str], ts: str, end: str | None, instants: list[int],
                   pruned: bool = False) -> str:
    """A query over ``source`` giving ``columns`` plus ``_tau`` for each τ with ``ts ≤ τ < end``.

    A row in no window is dropped; a row in k windows appears k times.
    ``end`` may be a window function (``end_sql``); NULL means ∞.  ``pruned``: every row of
    ``source`` is known to be in at least one window (``useful_rows`` dropped the others), so
    no filter before the explode is needed (and with one instant, no membership test at all).
    The instants appear only as an array literal, so the statement's generated code is the same
    for every chunk (see :func:`instants_sql`).
    """
    ins = sorted(set(int(t) for t in instants))
    cols = ", ".join(columns)
    lo, hi = ins[0], ins[-1]
    if pruned and len(ins) == 1:
        # every row is in the window at the one instant: no per-row lambda (a chunk of one
        # instant, e.g. paced input, or RANGE windows one instant at a time)
        return f"SELECT {cols}, explode({instants_sql(ins)}) AS {TAU} FROM {source}"
    if end is not None:
        source = f"(SELECT *, {end} AS {END} FROM {source})"
        keep = f"{ts} <= {hi} AND ({END} IS NULL OR {END} > {lo})"
        member = f"filter({instants_sql(ins)}, _lv -> _lv >= {ts} AND ({END} IS NULL OR _lv < {END}))"
    else:
        keep = f"{ts} <= {hi}"
        member = f"filter({instants_sql(ins)}, _lv -> _lv >= {ts})"
    where = "" if pruned else f" WHERE {keep}"
    return f"SELECT {cols}, explode({member}) AS {TAU} FROM {source}{where}"
