"""Per-query evaluation of a chunk: the second of the three parts of a chunk's evaluation.

A run builds one Spark SQL statement for its query over the frames of the chunk's items (loaded by
worker/load_chunk.py): the windows' contents at every evaluation instant, the join on ``_tau``,
WHERE with its failure sites, the aggregation as mergeable partials (:class:`Aggregation`), HAVING
and the select list, then the relation-to-stream operator; the engine runs the statement and
worker/assemble.py turns its rows into the chunk's result.  worker/engine.py's module docstring
describes the plan step by step; a compound query's runs are combined in worker/setops.py, a
query over subqueries evaluates them first (worker/derived.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.model import LegacyMode, QueryChunk
from strata.mlscql import ast as A
from strata.mlscql.analyze import CompiledQuery
from strata.mlscql.printer import expr_text

from .assemble import LEVEL, PART, Assembly, EngineError
from .derived import DerivedRun
from .expr import INTEGRAL, SPARK_TYPES, SqlCompiler, ident, level_of_mask
from .load_chunk import ChunkLoad, interval_span, item_col
from .setops import CompoundRun
from .windows import (ERR, MASK, TAU, end_sql, in_instants_sql, instants_sql, membership_sql, slides, start_sql,
                      successor_sql)

__all__ = ["SelectRun", "CompoundSelectRun", "Aggregation", "Deferred", "Partial", "run_of", "upgrade_state", "ROWS"]

ROWS = "_rows"
#: a normalized exact SUM ``hi * 2**32 + lo`` (0 <= lo < 2**32) fits a long iff hi is in this range
_HI_RANGE = f"BETWEEN {-(2**31)} AND {2**31 - 1}"
_LO_MASK = "CAST(4294967295 AS BIGINT)"
_LONG_RANGE = f"BETWEEN CAST({-(2**63)} AS DECIMAL(38,0)) AND CAST({2**63 - 1} AS DECIMAL(38,0))"
_TWO32 = "CAST(4294967296 AS DOUBLE)"
_LONG_MIN = -(2**63)


@dataclass(frozen=True)
class Partial:
    name: str  # column in partial/state tables
    kind: str  # cnt | sum | shi | slo | min | max | set  (shi/slo: exact SUM of a 64-bit argument;
    #            set: the distinct non-NULL values, for COUNT/SUM/AVG(DISTINCT))
    arg: int  # index into the distinct aggregate arguments


@dataclass(frozen=True)
class _Part:
    """A compiled expression: its value, its failure flag (None: cannot fail) and its site code."""

    sql: str
    fails: str | None
    code: int | None



class Deferred(Exception):
    """Control flow of :meth:`Engine.run_many`: a run's planned statement, not yet evaluated.

    ``then(arrow_table)`` turns the statement's result into ``(rows, state, failure)``."""

    def __init__(self, run: "SelectRun", final: str, then):
        super().__init__("deferred statement")
        self.run, self.final, self.then = run, final, then


def run_of(engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
    """The evaluation of ``chunk`` for ``cq``: a compound query's (worker/setops.py), a query's over
    subqueries (worker/derived.py) or a SELECT's."""
    if cq.branches:
        return CompoundSelectRun(engine, cq, chunk, mode)
    if cq.subqueries:
        return DerivedRun(engine, cq, chunk, mode)
    return SelectRun(engine, cq, chunk, mode)



class Aggregation:
    """The aggregation of a run: mergeable partials per (τ, group) (row count, per argument
    count/sum/exact 64-bit sum words/min/max/distinct set, bit_or of masks), their merge, and the
    finalization into the relation after HAVING and the select list, with the groups' failures.
    Reads the run's ``q``, ``cq``, ``key_parts``, ``arg_parts``, ``arg_types``, failure sites and
    statement helpers (:class:`SelectRun`)."""

    # --------------------------------------------------------------- aggregate
    def _group_names(self) -> list[str]:
        return [f"g{j}" for j in range(len(self.q.group_by))]

    def _aggregates(self) -> list[A.Aggregate]:
        out: list[A.Aggregate] = []
        exprs = [s.expr for s in self.q.select or ()] + ([self.q.having] if self.q.having is not None else [])
        for e in exprs:
            for a in A.aggregates_in(e):
                if a not in out:
                    out.append(a)
        return out

    def _args(self) -> list[A.Expr]:
        args: list[A.Expr] = []
        for a in self._aggregates():
            if a.arg is not None and a.arg not in args:
                args.append(a.arg)
        return args

    def _partials(self) -> list[Partial]:
        args = self._args()
        kinds: dict[int, set[str]] = {k: set() for k in range(len(args))}
        need = {"COUNT": {"cnt"}, "SUM": {"sum"}, "AVG": {"sum", "cnt"}, "MIN": {"min"}, "MAX": {"max"}}
        for a in self._aggregates():
            if a.arg is not None:
                kinds[args.index(a.arg)].update({"set"} if a.distinct else need[a.func])
        for k in kinds:
            if "sum" in kinds[k] and self.arg_types[k] in INTEGRAL:
                kinds[k] = (kinds[k] - {"sum"}) | {"shi", "slo"}  # exact: high and low 32-bit words
        return [
            Partial(f"a{k}_{kind}", kind, k)
            for k in range(len(args))
            for kind in ("cnt", "sum", "shi", "slo", "min", "max", "set")
            if kind in kinds[k]
        ]

    def _aggregate_sql(self, from_where: str, tau: str, mask: str, tau_alias: str = TAU,
                       extra: list[tuple[str, str]] = ()) -> str:
        """Partials per (τ, extra keys, group keys) of the rows of ``FROM from_where`` (plus
        ``_err``, the smallest failing row site, when WHERE, a key or an argument can fail);
        ``extra`` are (SQL, alias) pairs grouped by after τ."""
        cols = [f"{tau} AS {tau_alias}"] + [f"{x} AS {alias}" for x, alias in extra]
        cols += [f"{p.sql} AS {n}" for p, n in zip(self.key_parts, self._group_names())]
        cols += [f"count(1) AS {ROWS}", f"bit_or({mask}) AS {MASK}"]
        args = [p.sql for p in self.arg_parts]
        fn = {"cnt": "count({})", "sum": "sum({})", "min": "min({})", "max": "max({})",
              "shi": "sum(shiftright({}, 32))", "slo": f"sum(({{}}) & {_LO_MASK})", "set": "collect_set({})"}
        cols += [f"{fn[p.kind].format(self._set_arg(args[p.arg], p) if p.kind == 'set' else args[p.arg])} AS {p.name}"
                 for p in self._partials()]
        if self.row_err:
            cols.append(f"min({self._err_case(self.where_parts + self.key_parts + self.arg_parts)}) AS {ERR}")
        groups = ", ".join(str(k + 1) for k in range(1 + len(extra) + len(self.q.group_by)))
        return f"SELECT {', '.join(cols)} FROM {from_where} GROUP BY {groups}"

    def _set_arg(self, sql: str, p: Partial) -> str:
        """A COUNT(DISTINCT) argument as collected: a double plus 0.0, so that -0.0 and 0.0 are one
        value (as SQL equality has them)."""
        return f"(({sql}) + CAST(0.0 AS DOUBLE))" if self.arg_types[p.arg] == "double" else sql

    def _merge_sql(self, source: str) -> str:
        keys = self._group_names()
        fn = {"cnt": "sum", "sum": "sum", "min": "min", "max": "max"}
        cols = [TAU, *keys, f"sum({ROWS}) AS {ROWS}", f"bit_or({MASK}) AS {MASK}"]
        for p in self._partials():
            if p.kind == "set":  # the union of the parts' sets
                cols.append(f"array_distinct(flatten(collect_list({p.name}))) AS {p.name}")
            elif p.kind == "shi":  # normalized: carry the low words' overflow into the high word
                cols.append(f"(sum({p.name}) + shiftright(sum(a{p.arg}_slo), 32)) AS {p.name}")
            elif p.kind == "slo":
                cols.append(f"(sum({p.name}) & {_LO_MASK}) AS {p.name}")
            else:
                cols.append(f"{fn[p.kind]}({p.name}) AS {p.name}")
        if self.row_err:
            cols.append(f"min({ERR}) AS {ERR}")
        groups = ", ".join(str(k + 1) for k in range(1 + len(keys)))
        return f"SELECT {', '.join(cols)} FROM {source} GROUP BY {groups}"

    def _subst(self, e: A.Expr) -> str | None:
        """After aggregation: an aggregate or a group key → the column computed for it."""
        if isinstance(e, A.Aggregate):
            if e.arg is None:
                return ROWS
            k = self._args().index(e.arg)
            if e.distinct:
                return self._over_set(e.func, k)
            exact = self.arg_types[k] in INTEGRAL
            if e.func == "AVG":
                if exact:  # the exact sum, rounded once to a double, over the count
                    return (f"((CAST(a{k}_hi AS DOUBLE) * {_TWO32} + CAST(a{k}_lo AS DOUBLE)) "
                            f"/ CAST(a{k}_cnt AS DOUBLE))")
                return f"(CAST(a{k}_sum AS DOUBLE) / CAST(a{k}_cnt AS DOUBLE))"
            if e.func == "SUM" and exact:  # in range (else the group fails): hi * 2**32 + lo
                return f"(shiftleft(a{k}_hi, 32) | a{k}_lo)"
            return {"COUNT": f"a{k}_cnt", "SUM": f"a{k}_sum", "MIN": f"a{k}_min", "MAX": f"a{k}_max"}[e.func]
        for j, g in enumerate(self.q.group_by):
            if e == g:
                return self._group_names()[j]
        return None

    def _distinct_sum(self, k: int) -> str:
        """SQL: the sum of argument ``k``'s set of distinct values (NULL for no set).  64-bit
        integers are summed exactly as DECIMAL(38, 0) (out of the 64-bit range: a failure of the
        group, :meth:`_finalize`); doubles in ascending order, so every worker gets the same bits."""
        s = f"a{k}_set"
        if self.arg_types[k] in INTEGRAL:
            return f"aggregate({s}, CAST(0 AS DECIMAL(38,0)), (_da, _dx) -> _da + CAST(_dx AS DECIMAL(38,0)))"
        return f"aggregate(array_sort({s}), CAST(0.0 AS DOUBLE), (_da, _dx) -> _da + CAST(_dx AS DOUBLE))"

    def _over_set(self, func: str, k: int) -> str:
        """COUNT/SUM/AVG(DISTINCT) from the set partial: its size (0 without rows), its sum and the
        sum over its size (NULL when the set is missing or empty, as SQL's SUM and AVG of no value)."""
        s, n = f"a{k}_set", f"size(a{k}_set)"
        if func == "COUNT":
            return f"(CASE WHEN {s} IS NULL THEN CAST(0 AS BIGINT) ELSE CAST({n} AS BIGINT) END)"
        total = self._distinct_sum(k)
        if func == "SUM":
            val = f"CAST({total} AS BIGINT)" if self.arg_types[k] in INTEGRAL else total
        else:  # AVG: the exact sum rounded once to a double, over the count
            val = f"(CAST({total} AS DOUBLE) / CAST({n} AS DOUBLE))"
        return f"(CASE WHEN {s} IS NULL OR {n} = 0 THEN NULL ELSE {val} END)"

    def _finalize(self, partials: str) -> str:
        """Partials per (_tau, keys) → relation (_tau, _mask, o.., _err) after HAVING and the select list.

        Failures of a group (beyond its rows' ``_err``): a SUM of longs outside the 64-bit range
        (every group), a HAVING conjunct (every group), a select item (groups HAVING keeps).  A
        group that failed is kept whatever HAVING says: it carries the instant's failure."""
        source = partials
        parts = [p.name for p in self._partials()]
        if not self.q.group_by and self._every_instant_has_rows():
            # every instant already has its row: the join below would add none (one shuffle less)
            cols = [TAU] + [
                f"coalesce({c}, CAST(0 AS BIGINT)) AS {c}" if c in (ROWS, MASK) else c
                for c in [ROWS, MASK] + parts
            ] + ([ERR] if self.row_err else [])
            source = self._cte("f", f"SELECT {', '.join(cols)} FROM {partials}")
        elif not self.q.group_by:
            # exactly one row per instant, even with no input rows (COUNT 0, others NULL, level bottom)
            zero = {ROWS, MASK} | {p.name for p in self._partials() if p.kind == "cnt"}
            cols = [TAU] + [
                f"coalesce({c}, CAST(0 AS BIGINT)) AS {c}" if c in zero else c
                for c in [ROWS, MASK] + parts
            ] + ([ERR] if self.row_err else [])
            source = self._cte(
                "f",
                f"SELECT {', '.join(cols)} FROM (SELECT explode({instants_sql(self.evals)}) AS {TAU}) "
                f"LEFT JOIN {partials} USING ({TAU})",
            )
        exact = sorted({p.arg for p in self._partials() if p.kind == "shi"})
        if exact:  # normalized exact sums: hi * 2**32 + lo with 0 <= lo < 2**32
            norm = [f"(a{k}_shi + shiftright(a{k}_slo, 32)) AS a{k}_hi, (a{k}_slo & {_LO_MASK}) AS a{k}_lo"
                    for k in exact]
            source = self._cte("n", f"SELECT *, {', '.join(norm)} FROM {source}")
        # failures of every group: its rows' (WHERE, keys, arguments), its SUMs out of range
        sums = self._err_case([], [(f"(a{k}_hi NOT {_HI_RANGE})", code) for k, code in self.sum_sites]
                              + [(f"({self._distinct_sum(k)} NOT {_LONG_RANGE})", code) for k, code in self.dsum_sites])
        failed = [x for x in (ERR if self.row_err else None, sums) if x]
        failed = None if not failed else failed[0] if len(failed) == 1 else f"coalesce({', '.join(failed)})"
        # HAVING keeps a group whose conjuncts are TRUE or failed (then a failure of the group)
        cond = self._filter(self.having_parts)
        if cond and failed:
            cond = f"({cond}) OR {failed} IS NOT NULL"
        having = f" WHERE {cond}" if cond else ""
        err = ""
        if self.checked:
            later = [x for x in (failed, self._err_case(self.having_parts), self._err_case(self.select_parts)) if x]
            err = f"coalesce({', '.join(later)})" if len(later) > 1 else (later[0] if later else "CAST(NULL AS INT)")
            err = f", {err} AS {ERR}"
        rel = self._cte("r", f"SELECT {TAU}, {MASK}, {self._select_list()}{err} FROM {source}{having}")
        if not self.q.distinct_rows:
            return rel
        # SELECT DISTINCT over the groups' rows: one per value tuple, at the lub of the rows it stands for
        keys = [TAU] + [f"o{k}" for k in range(len(self.cq.outputs))] + ([ERR] if self.checked else [])
        return self._cte("d", f"SELECT {TAU}, bit_or({MASK}) AS {MASK}, {', '.join(keys[1:])} FROM {rel} "
                              f"GROUP BY {', '.join(keys)}")

    def _every_instant_has_rows(self) -> bool:
        """Whether the aggregation without GROUP BY has a group at every evaluated instant on its
        own: no WHERE, and (Arrow membership) every item's window holds a tuple at every
        evaluated instant, so the join of window contents on ``_tau`` is non-empty there.  Then
        :meth:`_finalize` needs no outer join with the instants (a shuffle, a sort-merge join
        and a stage: 137 → 129 ms of a warm 5-instant ROWS chunk, up to a third in isolation)."""
        return (not self.where_parts and self._cover_known and self.covered is not None
                and len(self.covered) == len(self.evals) and bool(self.covered.all()))

    @staticmethod
    def _ungrouped(c: A.Column) -> str:
        raise EngineError(f"column {c.qualifier}.{c.name} is neither grouped nor aggregated")


class SelectRun(ChunkLoad, Aggregation, Assembly):
    """Evaluation of one chunk of a SELECT: builds one SQL statement over the chunk's frames
    (:class:`ChunkLoad`), runs it, converts the result (:class:`Assembly`).

    The statement follows the chunk's legacy mode: a relation R(τ) over the evaluated instants
    (WINDOW, HISTORY; aggregated by :class:`Aggregation`), ISTREAM of the tuples at each instant
    (NONE), or a running state merged with the chunk's partials (STATE); then the stream operator
    (:meth:`_r2s`).  Failure sites (:meth:`_prepare`) are compiled once."""

    def __init__(self, engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode,
                 prefix: str = "", defer: bool = False, codes: bool = True):
        self.e = engine
        #: whether string GROUP BY keys may travel as dictionary codes (not in a compound query's
        #: SELECTs, whose relations are combined before any decoding)
        self.codes = codes
        #: names of this run's CTEs and frames start with it (several runs in one statement)
        self.prefix = prefix
        #: raise :class:`Deferred` with the planned statement instead of running it
        self.defer = defer
        self.rows_in = 0  # rows sent to Spark
        self.explode = 0  # (row, evaluated instant) pairs of rows in windows (Arrow membership)
        #: per evaluated instant, whether every item's window holds a tuple there (known only
        #: with Arrow membership; None: unknown).  See :meth:`_every_instant_has_rows`.
        self.covered: np.ndarray | None = None
        self._cover_known = True
        self.spark = engine.spark
        self.lattice = engine.lattice
        self.cq = cq
        self.q = cq.query
        self.chunk = chunk
        self.mode = mode
        if len(chunk.items) != len(cq.items):
            raise EngineError(f"chunk has {len(chunk.items)} item tables; the query has {len(cq.items)} FROM items")
        self.instants = sorted(set(int(t) for t in chunk.instants))
        self.diff = cq.r2s in ("ISTREAM", "DSTREAM")
        self.prev = int(chunk.prev_instant) if chunk.prev_instant is not None else None
        if self.prev is not None and self.instants and self.prev >= self.instants[0]:
            raise EngineError(f"prev_instant {self.prev} is not before the chunk's first instant {self.instants[0]}")
        self.evals = list(self.instants)
        if self.diff and self.prev is not None and mode is not LegacyMode.NONE:
            self.evals = [self.prev] + self.evals
        self.index = {it.name: i for i, it in enumerate(cq.items)}
        self.index_ci = {it.name.lower(): i for i, it in enumerate(cq.items)}
        self.compiler = SqlCompiler(self.lattice, self._resolve, column_type=self._type)
        #: string attributes that travel to Spark as dictionary codes (:meth:`_coded_keys`): (item, name)
        #: → the chunk's dictionary, set by :meth:`_load`
        self.coded: dict[tuple[int, str], pa.Array | None] = {k: None for k in self._coded_keys()}
        self.frames: dict[str, pa.Table] = {}  # placeholder → Arrow table (a DataFrame in _sql)
        self.ctes: list[tuple[str, str]] = []
        self._prepare()

    # -------------------------------------------------------------- failure sites
    def _prepare(self) -> None:
        """Compiles every expression once, registering a failure site (code) for each that can
        overflow, in a fixed order: WHERE conjuncts, GROUP BY keys, aggregate arguments, SUMs of
        longs, HAVING conjuncts, select items (the smallest failing code names the failure)."""
        self.sites: list[str] = []
        comp = self.compiler
        self.where_parts = [self._part(comp, c, "in WHERE") for c in A.conjuncts(self.q.where)]
        self.key_parts: list[_Part] = []
        self.arg_parts: list[_Part] = []
        self.sum_sites: list[tuple[int, int]] = []  # (argument, code) of SUMs of 64-bit arguments
        self.dsum_sites: list[tuple[int, int]] = []  # ... and of SUM(DISTINCT)s of them
        self.having_parts: list[_Part] = []
        if self.cq.is_aggregate:
            self.key_parts = [self._part(comp, g, "in GROUP BY") for g in self.q.group_by]
            args = self._args()
            self.arg_types = [comp.type_of(a) for a in args]
            self.arg_parts = [self._part(comp, a, "in the aggregate argument") for a in args]
            for k, a in enumerate(args):
                if self.arg_types[k] in INTEGRAL and A.Aggregate("SUM", a) in self._aggregates():
                    self.sum_sites.append((k, self._site(f": SUM({self._text(a)}) is outside the 64-bit range")))
            for k, a in enumerate(args):
                if self.arg_types[k] in INTEGRAL and A.Aggregate("SUM", a, True) in self._aggregates():
                    self.dsum_sites.append(
                        (k, self._site(f": SUM(DISTINCT {self._text(a)}) is outside the 64-bit range")))
            fin = SqlCompiler(self.lattice, self._ungrouped, self._subst, column_type=self._type)
            self.having_parts = [self._part(fin, c, "in HAVING") for c in A.conjuncts(self.q.having)]
            self.select_parts = [self._part(fin, s.expr, "in SELECT") for s in self.q.select]
        else:
            self.select_parts = [self._part(self.compiler, s.expr, "in SELECT") for s in self.q.select]
        #: sites evaluated on rows (before any aggregation): WHERE, GROUP BY, aggregate arguments
        self.row_err = any(p.code for p in self.where_parts + self.key_parts + self.arg_parts)
        #: whether the relation carries an ``_err`` column at all
        self.checked = bool(self.sites)

    def _site(self, what: str) -> int:
        self.sites.append("integer overflow" + what)
        return len(self.sites)

    def _text(self, e: A.Expr) -> str:
        if len(self.cq.items) == 1:
            e = _unqualified(e)
        t = expr_text(e)
        return t if len(t) <= 120 else t[:117] + "..."

    def _part(self, comp: SqlCompiler, e: A.Expr, where: str) -> _Part:
        sql, fails = comp.checked(e)
        return _Part(sql, fails, None if fails is None else self._site(f" {where}: {self._text(e)}"))

    @staticmethod
    def _filter(parts: list[_Part]) -> str | None:
        """AND of conjuncts; a conjunct that failed lets the row through (it then carries _err)."""
        if not parts:
            return None
        return " AND ".join(p.sql if p.fails is None else f"({p.fails} OR {p.sql})" for p in parts)

    @staticmethod
    def _err_case(parts: list[_Part], extra: list[tuple[str, int]] = ()) -> str | None:
        """SQL int: the smallest code of the failing sites among ``parts`` (NULL if none fails)."""
        whens = [(p.fails, p.code) for p in parts if p.fails is not None] + list(extra)
        if not whens:
            return None
        whens.sort(key=lambda w: w[1])
        return "(CASE " + " ".join(f"WHEN {f} THEN {c}" for f, c in whens) + " END)"

    def _err_col(self, parts: list[_Part]) -> str:
        if not self.checked:
            return ""
        case = self._err_case(parts) or "CAST(NULL AS INT)"
        return f", {case} AS {ERR}"

    def _cte(self, name: str, sql: str) -> str:
        name = self.prefix + name
        self.ctes.append((name, sql))
        return name

    def _sql(self, final: str):
        return self.e.statement(self.ctes, final, self.frames)

    def _query(self, final: str, then):
        """``then(Arrow result of final)``, or with ``defer`` a :class:`Deferred` carrying the
        statement for :meth:`Engine.run_many`, which evaluates it together with others."""
        if self.defer:
            raise Deferred(self, final, then)
        return then(self._sql(final).toArrow())

    # ------------------------------------------------------------------- main
    def execute(self) -> tuple[pa.Table, pa.Table | None, tuple[int, str] | None]:
        """(output rows, new state, failure): failure is (error_ts, reason) or None; on a failure
        the rows are those before error_ts and there is no state."""
        if not self.instants:
            return self._empty(), None, None
        if self.mode is LegacyMode.NONE:
            return self._execute_none()
        if self.mode is LegacyMode.STATE:
            return self._execute_state()
        rel = self.relation()
        if rel is None:
            return self._empty(), None, None
        return self._query(self._r2s(rel), self._rows_only)

    def relation(self) -> str | None:
        """The CTE of R(τ) over the evaluation instants: ``(_tau, _mask, o.. [, _err])``; None when
        R(τ) is empty at every instant (no CTE).  WINDOW and HISTORY chunks."""
        if not self.cq.is_aggregate and any(t.num_rows == 0 for t in self.chunk.items):
            return None  # some window is empty at every instant: R(τ) = ∅
        needed = self._needed()
        sources = []
        arrow = self.e.membership == "arrow"
        for i, f in enumerate(self.q.from_):
            # RANGE and NOW intervals end at ts + T: computed in SQL, not sent
            span = interval_span(f.window, self.e.config.instant_seconds)
            src, cols = self._load(i, needed[i], window=f.window if arrow else None,
                                   seq=not arrow and f.window.kind in ("rows", "partition"), end_column=span is None)
            ts = item_col(i, "ts")
            if f.window.kind == "relation":
                end = item_col(i, "_end")
            elif arrow:
                end = None if f.window.kind == "unbounded" else (
                    item_col(i, "_end") if span is None else f"({ts} + CAST({span} AS BIGINT))")
                if slides(f.window, self.e.config.instant_seconds):
                    ts = item_col(i, "_start")  # where the tuple's interval of instants starts
            else:
                end = end_sql(f.window, ts, item_col(i, "_seq"), [item_col(i, c) for c in f.window.partition_by],
                              self.e.config.instant_seconds)
                ts = start_sql(f.window, ts, self.e.config.instant_seconds)
            sources.append((src, cols, ts, end))
        cond = self._filter(self.where_parts)
        where = f" WHERE {cond}" if cond else ""
        if self.cq.is_aggregate and len(sources) == 1 and arrow and self._pre_aggregate():
            # partials per (ts, interval end, group) first, then spread over the instants of each
            # (ts, end) interval and merged: the rows are aggregated once instead of once per
            # instant whose window holds them (RANGE windows over many instants)
            src, cols, ts, end = sources[0]
            span = interval_span(self.q.from_[0].window, self.e.config.instant_seconds)
            end_key = [] if end is None or span is not None else [(end, "_e")]
            pre = self._cte("pre", self._aggregate_sql(f"{src}{where}", ts, item_col(0, MASK), tau_alias="_t",
                                                       extra=end_key))
            kv = [ident(c) for c in self._group_names() + [ROWS, MASK] + [p.name for p in self._partials()]]
            err = [ERR] if self.row_err else []
            pend = None if end is None else ("_e" if span is None else f"(_t + CAST({span} AS BIGINT))")
            spread = self._cte("x", membership_sql(pre, kv + err, "_t", pend, self.evals, pruned=True))
            return self._finalize(self._cte("m", self._merge_sql(spread)))
        windows = [self._cte(f"w{i}", membership_sql(src, cols, ts, end, self.evals, pruned=arrow))
                   for i, (src, cols, ts, end) in enumerate(sources)]
        from_ = windows[0] + "".join(f" JOIN {w} USING ({TAU})" for w in windows[1:])
        mask = " | ".join(item_col(i, MASK) for i in range(len(windows)))
        if self.cq.is_aggregate:
            p = self._cte("p", self._aggregate_sql(f"{from_}{where}", TAU, f"({mask})"))
            return self._finalize(p)
        else:
            err = self._err_col(self.where_parts + self.select_parts)
            rel = self._cte("r", f"SELECT {TAU}, ({mask}) AS {MASK}, {self._select_list()}{err} FROM {from_}{where}")
        return rel

    def _pre_aggregate(self) -> bool:
        """Whether to aggregate per (ts, interval end, group) before spreading over the instants:
        when the windows at the evaluated instants hold each row several times on average, or
        always / never as the engine's switch says (``Engine.partials``)."""
        if self.e.partials != "auto":
            return self.e.partials == "on"
        return self.rows_in >= self.e.preagg_min_rows and self.explode >= self.e.preagg_factor * self.rows_in

    # ---------------------------------------------------------- NONE (monotone)
    def _execute_none(self) -> tuple[pa.Table, pa.Table | None, tuple[int, str] | None]:
        """Unbounded single item, no aggregate: ISTREAM at τ is the rows of the tuples with ts = τ.

        (DSTREAM of this monotone relation is empty, but R(τ) is still evaluated at every
        instant: its failures are the query's.)"""
        if self.chunk.items[0].num_rows == 0:
            return self._empty(), None, None
        if self.cq.r2s != "ISTREAM" and not self.checked:
            return self._empty(), None, None  # DSTREAM of a monotone relation is empty
        src, _ = self._load(0, self._needed()[0], ts_in=self.instants)  # only tuples with ts = an instant
        ts = item_col(0, "ts")
        where = self._filter(self.where_parts)
        where = f" WHERE {where}" if where else ""
        level = level_of_mask(self.lattice, item_col(0, MASK))
        err = self._err_col(self.where_parts + self.select_parts)
        sql = f"SELECT {ts} AS {TAU}, {level} AS {LEVEL}, {self._select_list()}{err} FROM {src}{where}"
        if self.cq.r2s != "ISTREAM":
            sql = f"SELECT * FROM ({sql}) WHERE {ERR} IS NOT NULL"  # DSTREAM: only the failures matter
        return self._query(sql, self._rows_only)

    # ------------------------------------------------------- STATE (running)
    def _execute_state(self) -> tuple[pa.Table, pa.Table | None, tuple[int, str] | None]:
        upto = self.chunk.state_upto
        state = self.chunk.state
        if state is not None and upto is None:
            raise EngineError("chunk carries a state without state_upto")
        if upto is not None and self.evals[0] < upto:
            raise EngineError(f"cannot evaluate instant {self.evals[0]} from a state as of {upto}")
        # only tuples after the state and not after the last instant (the others are in no window)
        src, cols = self._load(0, self._needed()[0], ts_after=_LONG_MIN if upto is None else int(upto))
        ts = item_col(0, "ts")
        where = self._filter(self.where_parts)
        where = f" WHERE {where}" if where else ""
        # partials per (ts, group), then per evaluation instant τ over all ts ≤ τ, plus the state
        pre = self._cte("pre", self._aggregate_sql(f"{src}{where}", ts, item_col(0, MASK), tau_alias="_t"))
        keys = self._group_names()
        vals = [ROWS, MASK] + [p.name for p in self._partials()]
        err = [ERR] if self.row_err else []
        kv = [ident(c) for c in keys + vals]
        branches = [membership_sql(pre, kv + err, "_t", None, self.evals, pruned=True)]
        if state is not None and state.num_rows:
            state = upgrade_state(state, self._partials())
            missing = [c for c in keys + vals if c not in state.column_names]
            if missing:
                raise EngineError(f"state table lacks column {missing[0]!r}; it was made for another query")
            st = self._frame("state", state.select(keys + vals))
            none = [f"CAST(NULL AS INT) AS {ERR}"] if err else []
            branches.append(f"SELECT {', '.join(kv + none)}, explode({instants_sql(self.evals)}) AS {TAU} FROM {st}")
        union = self._cte("u", " UNION ALL ".join(f"SELECT {TAU}, {', '.join(kv + err)} FROM ({b})" for b in branches))
        merged = self._cte("m", self._merge_sql(union))
        out = self._cte("o", self._r2s(self._finalize(merged)))
        out_cols = [TAU, LEVEL] + [f"o{k}" for k in range(len(self.cq.outputs))] + ([ERR] if self.checked else [])
        last = self.instants[-1]
        a = f"SELECT 0 AS {PART}, {', '.join(out_cols)}, {', '.join(f'NULL AS s_{c}' for c in keys + vals)} FROM {out}"
        b = (f"SELECT 1 AS {PART}, {', '.join(f'NULL AS {c}' for c in out_cols)}, "
             f"{', '.join(f'{ident(c)} AS s_{c}' for c in keys + vals)} FROM {merged} "
             f"WHERE {in_instants_sql(TAU, [last])}")
        return self._query(f"{a} UNION ALL {b}", lambda tbl: self._state_result(tbl, keys + vals))

    # -------------------------------------------------------------- relation
    def _select_list(self) -> str:
        coded = self._coded_outputs()
        return ", ".join(
            f"CAST({p.sql} AS {'INT' if k in coded else SPARK_TYPES[o.type]}) AS o{k}"
            for k, (p, o) in enumerate(zip(self.select_parts, self.cq.outputs))
        )

    def _r2s(self, rel: str) -> str:
        """SQL turning relation ``rel`` (_tau, _mask, o.. [, _err]) over the evaluation instants into
        the chunk's output rows (_tau, level, o.. [, _err]).

        Failed rows reach the output through the differences: ``_err`` is part of the rows'
        identity, and R(τ) has no failed row before the first failing instant, so at that
        instant ISTREAM keeps them; DSTREAM gets them from a negated copy on its positive side
        (``_finish`` takes the absolute code).  A failure at the previous instant alone may go
        unseen: it is the failure of an earlier chunk, where the query stops."""
        outs = ", ".join(f"o{k}" for k in range(len(self.cq.outputs)))
        err = f", {ERR}" if self.checked else ""
        lvl = self._cte("lv", f"SELECT {TAU}, {level_of_mask(self.lattice, MASK)} AS {LEVEL}, {outs}{err} FROM {rel}")
        cols = f"{TAU}, {LEVEL}, {outs}{err}"
        # the instants appear only as array/map literals: the same generated code for every chunk
        only = f" WHERE {in_instants_sql(TAU, self.instants)}"
        extra = len(self.evals) != len(self.instants)
        cur = f"SELECT {cols} FROM {lvl}{only if extra else ''}"
        if not self.diff:
            return cur
        order = self.evals  # ascending; prev_instant first when present
        succ = {order[k]: order[k + 1] for k in range(len(order) - 1)}
        shift = successor_sql(TAU, succ)
        if self.cq.r2s == "DSTREAM" and self.checked:
            where = f"{in_instants_sql(TAU, list(succ))} OR {ERR} IS NOT NULL" if succ else f"{ERR} IS NOT NULL"
            shifted = (f"SELECT (CASE WHEN {ERR} IS NOT NULL THEN {TAU} ELSE {shift} END) AS {TAU}, {LEVEL}, "
                       f"{outs}, (- {ERR}) AS {ERR} FROM {lvl} WHERE {where}")
        elif succ:
            shifted = f"SELECT {shift} AS {TAU}, {LEVEL}, {outs}{err} FROM {lvl} WHERE {in_instants_sql(TAU, list(succ))}"
        else:
            shifted = f"SELECT {cols} FROM {lvl} WHERE FALSE"
        if self.cq.r2s == "ISTREAM":
            return f"({cur}) EXCEPT ALL ({shifted})"
        return f"({shifted}) EXCEPT ALL ({cur})"


class CompoundSelectRun(CompoundRun, Assembly):
    """A compound query's chunk: its SELECTs as :class:`SelectRun` relations, combined
    (worker/setops.py), then the same stream operator and output as a single SELECT."""

    def branch_run(self, cq: CompiledQuery, chunk: QueryChunk, prefix: str) -> "SelectRun":
        if cq.branches:  # a parenthesized compound: its combined relation is the part
            return CompoundSelectRun(self.e, cq, chunk, self.mode, prefix=prefix)
        if cq.subqueries:  # the subqueries first; the outer query's relation joins the statement
            chunk, failure = DerivedRun(self.e, cq, chunk, self.mode).outer_chunk()
            if failure is not None:
                self.failures.append(failure)
            cq = cq.outer
        return SelectRun(self.e, cq, chunk, self.mode, prefix=prefix, codes=False)

    _cte = SelectRun._cte
    _sql = SelectRun._sql
    _query = SelectRun._query
    _r2s = SelectRun._r2s


def _unqualified(e: A.Expr) -> A.Expr:
    if isinstance(e, A.Column):
        return A.Column(None, e.name)
    return A.map_children(e, _unqualified)


def upgrade_state(state: pa.Table, partials: list[Partial]) -> pa.Table:
    """A state written before exact SUMs (``a{k}_sum`` bigint for a long argument) in today's
    form (``a{k}_shi``/``a{k}_slo``)."""
    for p in partials:
        if p.kind != "shi" or p.name in state.column_names:
            continue
        old = f"a{p.arg}_sum"
        if old not in state.column_names or not pa.types.is_integer(state.column(old).type):
            continue
        total = state.column(old).cast(pa.int64())
        state = state.append_column(p.name, pc.shift_right(total, 32))
        state = state.append_column(f"a{p.arg}_slo", pc.bit_wise_and(total, 0xFFFFFFFF))
    return state
