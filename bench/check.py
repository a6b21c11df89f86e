"""Correctness of benchmark output: the reference evaluator on sampled instants, DuckDB on all.

A fast wrong answer must fail the harness, so every run's output is compared:

* :func:`check_sample` runs ``tests/reference/evaluator.py`` (the brute-force
  reference of SEMANTICS §1-§5) on the tuples of instants ``τ-1`` and ``τ`` for
  a few sampled instants ``τ`` and compares its rows at ``τ`` with the run's.
  Every benchmark window is ``ROWS 100`` (or unbounded without aggregate, or
  ``RANGE 1``) and every instant holds far more than 100 visible tuples, so the
  windows at ``τ`` and ``τ-1`` (ISTREAM) are complete in that excerpt.
* :func:`duckdb_avg_rows` evaluates ``SELECT AVG(x) FROM S [ROWS n]`` at a level
  of a total order for *all* instants with DuckDB window SQL (the ceiling
  peer), used to compare the whole output of the target query.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.config import parse_config


class BenchCheckFailed(AssertionError):
    pass


def _rows_at(table: pa.Table | None, tau: int) -> list[tuple]:
    if table is None:
        return []
    t = table.filter(pc.equal(table.column("ts"), tau))
    cols = [t.column(i).to_pylist() for i in range(t.num_columns)]
    return [tuple(r) for r in zip(*cols)]


def sample_instants(data: dict[str, pa.Table], k: int = 3) -> list[int]:
    ts = np.unique(np.concatenate([t.column("ts").to_numpy() for t in data.values()]))
    if len(ts) <= k:
        return [int(x) for x in ts]
    idx = np.linspace(0, len(ts) - 1, k).round().astype(int)
    return sorted({int(ts[i]) for i in idx})


def check_sample(config_text: str, level: str, query: str, data: dict[str, pa.Table], rows: pa.Table | None,
                 k: int = 3, rel: float = 1e-6) -> list[int]:
    """Compare ``rows`` (a run's whole output) with the reference at ``k`` sampled instants."""
    from tests.reference.evaluator import compare_results, evaluate

    cfg = parse_config(config_text)
    taus = sample_instants(data, k)
    for tau in taus:
        excerpt = {}
        for s, t in data.items():
            ts = t.column("ts")
            m = pc.and_(pc.greater_equal(ts, tau - 1), pc.less_equal(ts, tau))
            excerpt[s] = t.filter(m).to_pylist()
        expected = [r for r in evaluate(query, cfg, level, excerpt) if r[0] == tau]
        actual = _rows_at(rows, tau)
        try:
            compare_results(actual, expected, rel=rel)
        except AssertionError as e:
            raise BenchCheckFailed(f"{query!r} at {level}: instant {tau} differs from the reference: "
                                   f"{str(e)[:1500]}") from None
    return taus


def duckdb_avg_rows(table: pa.Table, column: str, rows: int, visible: list[str], order: list[str]) -> tuple[pa.Table, float]:
    """(ts, level, avg) per instant of ``AVG(column) [ROWS rows]`` over the ``visible`` levels of a total order;
    returns the table and the seconds DuckDB took."""
    import time

    import duckdb

    con = duckdb.connect()
    src = table.select(["ts", "level", column]).append_column("idx", pa.array(np.arange(table.num_rows)))
    ranks = pa.table({"level": order, "rk": list(range(len(order)))})
    con.register("src", src)
    con.register("ranks", ranks)
    vis = ", ".join(f"'{v}'" for v in visible)
    sql = f"""
    WITH v AS (SELECT s.ts, s.idx, s.{column} AS x, r.rk FROM src s JOIN ranks r USING (level)
               WHERE s.level IN ({vis})),
    w AS (SELECT ts, idx,
                 AVG(x) OVER (ORDER BY idx ROWS BETWEEN {rows - 1} PRECEDING AND CURRENT ROW) AS a,
                 MAX(rk) OVER (ORDER BY idx ROWS BETWEEN {rows - 1} PRECEDING AND CURRENT ROW) AS rk
          FROM v),
    last AS (SELECT ts, MAX(idx) AS idx FROM v GROUP BY ts)
    SELECT w.ts, w.rk, w.a FROM w JOIN last USING (ts, idx) ORDER BY w.ts
    """
    t0 = time.perf_counter()
    out = con.sql(sql).to_arrow_table()
    secs = time.perf_counter() - t0
    if hasattr(out, "read_all"):
        out = out.read_all()
    lv = pc.take(pa.array(order), out.column("rk"))
    res = pa.table({"ts": out.column("ts"), "level": lv, "avg": out.column("a")})
    return res, secs


def compare_avg(actual: pa.Table | None, expected: pa.Table, rel: float = 1e-9) -> None:
    """Whole-output comparison of a one-row-per-instant AVG result with DuckDB's."""
    if actual is None:
        raise BenchCheckFailed("no output rows")
    a = actual.sort_by("ts")
    if a.num_rows != expected.num_rows:
        raise BenchCheckFailed(f"{a.num_rows} output rows, DuckDB has {expected.num_rows}")
    if a.column("ts").to_pylist() != expected.column("ts").to_pylist():
        raise BenchCheckFailed("output instants differ from DuckDB's")
    if a.column("level").to_pylist() != expected.column("level").to_pylist():
        raise BenchCheckFailed("output levels differ from DuckDB's")
    x = np.asarray(a.column(2).to_numpy(zero_copy_only=False), dtype=float)
    y = np.asarray(expected.column("avg").to_numpy(zero_copy_only=False), dtype=float)
    if not np.allclose(x, y, rtol=rel, atol=1e-9):
        i = int(np.argmax(~np.isclose(x, y, rtol=rel, atol=1e-9)))
        raise BenchCheckFailed(f"AVG at instant {a.column('ts')[i].as_py()}: {x[i]} vs DuckDB {y[i]}")


class Excerpts:
    """Per instant τ, the input a reference needs for τ's rows of windows no wider than ``trim`` tuples of an
    instant: each stream's tuples of τ and the last ``trim`` of τ-1 (``tables`` sorted by ``ts``)."""

    def __init__(self, tables: dict[str, pa.Table], trim: int):
        self.tables, self.trim = tables, trim
        self.ts = {s: t.column("ts").to_numpy() for s, t in tables.items()}
        self.instants = sorted(set(np.concatenate(list(self.ts.values())).tolist()))

    def excerpt(self, tau: int, streams=None) -> dict[str, list[dict]]:
        """The rows of ``streams`` (default: every stream) the reference is given for instant ``tau``."""
        out = {}
        for s in self.ts if streams is None else streams:
            ts = self.ts[s]
            a = max(int(np.searchsorted(ts, tau - 1, "left")), int(np.searchsorted(ts, tau, "left")) - self.trim)
            b = int(np.searchsorted(ts, tau, "right"))
            out[s] = self.tables[s].slice(a, b - a).to_pylist()
        return out
