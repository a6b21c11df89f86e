"""A compound query's chunk (``q1 UNION [ALL] q2 EXCEPT q3 …``) as one Spark statement.

Each SELECT is evaluated as the engine evaluates a query (its own FROM items of the chunk, the
same evaluation instants) up to its relation R_j(τ) with the rows' level masks; the relations
are combined left to right, then the compound's stream operator turns the result into output
rows exactly as for a single SELECT (docs/semantics.md §3, *Compound queries*):

* ``UNION ALL``: the rows of both, each at its own level;
* ``UNION``: one row per distinct value tuple at an instant, at the lub of every row (of either
  side) it stands for;
* ``EXCEPT``: one row per distinct value tuple of the left side that the right side does not
  have at that instant (NULLs equal, as SQL's set operators), at the lub of the left rows it
  stands for;
* ``INTERSECT``: one row per distinct value tuple of the left side that the right side has too,
  at the lub of the rows of both sides it stands for.

A SELECT may be a parenthesized compound query (``q1 EXCEPT (q2 UNION q3)``; an INTERSECT after
a SELECT is one too, as it binds tighter): its combined relation is a part like a SELECT's.

Failures: a row carrying a failure (``_err``, the SELECT's site code shifted past the codes of
the SELECTs before it) is never merged away or removed by EXCEPT, and the right side's failed
rows are kept too, so an overflow in any SELECT fails the compound query at its instant.  A
SELECT over subqueries in FROM evaluates them first (worker/derived.py), then its outer query's
relation joins the statement; a subquery's failure at τ fails the compound query at τ.
"""

from __future__ import annotations

import pyarrow.compute as pc

from strata.chunking.model import LegacyMode, QueryChunk
from strata.mlscql.analyze import CompiledQuery

from .expr import SPARK_TYPES
from .windows import ERR, MASK, TAU

__all__ = ["CompoundRun"]


class CompoundRun:
    """Evaluation of one chunk of a compound query.  The engine's subclass gives it the SELECTs'
    evaluation (:meth:`branch_run`) and the single-SELECT machinery it shares: ``_cte``,
    ``_query``, ``_r2s`` (the stream operator) and ``_finish`` (output and failures)."""

    def __init__(self, engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode, prefix: str = ""):
        self.e = engine
        self.cq = cq
        self.chunk = chunk
        self.mode = mode
        self.prefix = prefix
        self.defer = False
        self.lattice = engine.lattice
        self.runs: list = []
        #: failures of subqueries read by the SELECTs ((error_ts, reason)): the query's at that instant
        self.failures: list[tuple[int, str]] = []
        start = 0
        for j, b in enumerate(cq.branches):
            n = len(b.items)
            sub = QueryChunk(chunk.query_id, chunk.chunk_id, chunk.items[start:start + n], chunk.instants,
                             chunk.prev_instant)
            self.runs.append(self.branch_run(b, sub, f"{prefix}b{j}_"))
            start += n
        first = self.runs[0]
        self.instants, self.evals, self.diff = first.instants, first.evals, first.diff
        self.coded: dict = {}
        self.checked = True  # the combined relation always carries _err
        self.sites: list[str] = []
        self.ctes: list[tuple[str, str]] = []
        self.frames: dict = {}
        self.rows_in = 0

    def branch_run(self, cq: CompiledQuery, chunk: QueryChunk, prefix: str):
        """The evaluation of one SELECT's part of the chunk, with ``relation()`` (the engine's)."""
        raise NotImplementedError

    def execute(self):
        if not self.instants:
            return self._empty(), None, None
        return self._query(self._r2s(self.relation()), self._with_failures)

    def relation(self) -> str:
        """The CTE of the combined relation over the evaluation instants: ``(_tau, _mask, o.., _err)``
        (also what a parenthesized compound is as a SELECT of another)."""
        parts = [self._branch(j, r) for j, r in enumerate(self.runs)]
        for r in self.runs:
            self.ctes += r.ctes
            self.frames.update(r.frames)
            self.rows_in += r.rows_in
            self.failures += getattr(r, "failures", [])
        acc = self._cte("s0", parts[0])
        for k, (op, right) in enumerate(zip(self.cq.set_ops, parts[1:]), start=1):
            acc = self._combine(op, acc, self._cte(f"s{k}", right), k)
        return acc

    def _with_failures(self, tbl):
        """The output rows and failure, with the first failure of a subquery a SELECT reads: the
        query fails at the earliest of them, keeping only the rows before it."""
        rows, state, failure = self._rows_only(tbl)
        first = min(self.failures + ([failure] if failure else []), key=lambda f: f[0], default=None)
        if first is not None and first is not failure and rows.num_rows:
            rows = rows.filter(pc.less(rows.column("ts"), first[0]))
        return rows, state, first

    def _outs(self) -> list[str]:
        return [f"o{k}" for k in range(len(self.cq.outputs))]

    def _branch(self, j: int, run) -> str:
        """SQL of SELECT ``j``'s relation in the compound's column types, failure codes shifted."""
        rel = run.relation()  # (a parenthesized compound registers its SELECTs' sites here)
        offset = len(self.sites)
        self.sites += run.sites
        cols = [f"CAST(o{k} AS {SPARK_TYPES[o.type]}) AS o{k}" for k, o in enumerate(self.cq.outputs)]
        if rel is None:  # empty at every instant
            nulls = ", ".join(f"CAST(NULL AS {SPARK_TYPES[o.type]}) AS o{k}" for k, o in enumerate(self.cq.outputs))
            return (f"SELECT CAST(NULL AS BIGINT) AS {TAU}, CAST(0 AS BIGINT) AS {MASK}, {nulls}, "
                    f"CAST(NULL AS INT) AS {ERR} WHERE FALSE")
        err = f"CAST({ERR} + {offset} AS INT) AS {ERR}" if run.checked else f"CAST(NULL AS INT) AS {ERR}"
        return f"SELECT {TAU}, {MASK}, {', '.join(cols)}, {err} FROM {rel}"

    def _combine(self, op: str, left: str, right: str, k: int) -> str:
        keys = ", ".join([TAU] + self._outs() + [ERR])
        if op == "UNION ALL":
            return self._cte(f"c{k}", f"SELECT * FROM {left} UNION ALL SELECT * FROM {right}")
        if op == "UNION":
            both = f"(SELECT * FROM {left} UNION ALL SELECT * FROM {right})"
            return self._cte(f"c{k}", f"SELECT {TAU}, bit_or({MASK}) AS {MASK}, {', '.join(self._outs())}, {ERR} "
                                      f"FROM {both} GROUP BY {keys}")
        # EXCEPT: the left side's distinct rows the right side's (unfailed) rows do not match; failed
        # rows of either side stay
        d = self._cte(f"d{k}", f"SELECT {TAU}, bit_or({MASK}) AS {MASK}, {', '.join(self._outs())}, {ERR} "
                               f"FROM {left} GROUP BY {keys}")
        on = " AND ".join([f"l.{TAU} = r.{TAU}"] + [f"l.{o} <=> r.{o}" for o in self._outs()]
                          + [f"l.{ERR} IS NULL"])
        failed = f"SELECT * FROM {right} WHERE {ERR} IS NOT NULL"
        if op == "INTERSECT":
            # the left side's distinct rows the right side's (unfailed) rows match, at the lub of the
            # rows of both sides they stand for; failed rows of either side stay
            r = self._cte(f"r{k}", f"SELECT {TAU}, bit_or({MASK}) AS {MASK}, {', '.join(self._outs())} "
                                   f"FROM {right} WHERE {ERR} IS NULL GROUP BY {', '.join([TAU] + self._outs())}")
            both = (f"SELECT l.{TAU}, l.{MASK} | r.{MASK} AS {MASK}, {', '.join(f'l.{o}' for o in self._outs())}, "
                    f"l.{ERR} FROM {d} l JOIN {r} r ON {on}")
            return self._cte(f"c{k}", f"{both} UNION ALL SELECT * FROM {d} WHERE {ERR} IS NOT NULL UNION ALL {failed}")
        kept = (f"SELECT l.* FROM {d} l LEFT ANTI JOIN (SELECT * FROM {right} WHERE {ERR} IS NULL) r ON {on}")
        return self._cte(f"c{k}", f"{kept} UNION ALL {failed}")
