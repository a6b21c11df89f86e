"""Chunk evaluation on Spark: ``Engine(spark, config).run(compiled_query, chunk)``.

One call evaluates one :class:`~strata.chunking.model.QueryChunk` (SEMANTICS
§5) with a handful of Spark jobs (one ``toArrow`` per chunk) and keeps nothing
between calls: all history arrives in the chunk (legacy rows or, for
``LegacyMode.STATE``, a running state table).

Plan of a chunk
---------------
The whole plan is one Spark SQL statement (CTEs over the chunk's tables),
parsed and analyzed once: building it through the DataFrame API took hundreds
of Py4J round trips and doubled the latency of small chunks.

1. Each FROM item's Arrow table goes to Spark with its columns prefixed
   (``i0__sid``, ``i0___mask``; Spark names are case-insensitive and a self-join
   has the same attribute twice), only the attributes the query reads, and a
   level bitmask column computed in Arrow.
2. Window contents at every evaluation instant: each tuple's membership
   interval ``[ts, end)`` (``windows.end_array`` in NumPy, which also drops
   the tuples in no window at an evaluated instant before Spark sees them; or
   ``windows.end_sql`` in Spark with ``Engine(..., membership="spark")``) is
   intersected with the evaluation instants and exploded, giving the window
   at τ keyed by ``_tau``.  Evaluation instants are ``chunk.instants`` plus
   ``prev_instant`` for ISTREAM/DSTREAM.
3. The items are joined on ``_tau`` (the window contents at the *same* τ),
   WHERE filters (Catalyst pushes equalities into the join keys), and the
   output mask is the OR of the joined tuples' masks.
4. Aggregates are computed as mergeable partials (row count, per argument:
   count/sum/min/max, bit_or of masks) grouped by ``(_tau, group keys…)`` and then
   finalized; without GROUP BY every instant gets its row (COUNT 0, others NULL,
   level bottom).  HAVING and the select list follow.
5. Relation to stream: RSTREAM as is; ISTREAM/DSTREAM by ``EXCEPT ALL``
   between R(τ) and R(previous instant) re-tagged with τ, over
   ``(level, columns…)`` with the level decoded to its canonical string first
   (different OR-masks can decode to the same Chinese Wall level).

Legacy modes (``legacy_mode(cq)``): WINDOW and HISTORY as above.  NONE
(unbounded, one item, no aggregate, ISTREAM/DSTREAM): ISTREAM at τ is the
select list over the tuples with ``ts = τ`` passing WHERE; DSTREAM is empty.
STATE (unbounded, one item, aggregate): the state's partials are merged with
the partials of the chunk's tuples per (ts, group) spread over the evaluation
instants ≥ ts (cost: distinct (ts, group) pairs × instants in the chunk).

STATE table schema (``LegacyMode.STATE``; opaque to the master)
--------------------------------------------------------------
One row per group that has at least one visible tuple passing WHERE with
``ts <= state_upto`` (no GROUP BY: at most one row):

* ``g0 … gK``      the GROUP BY key values (Spark types of the key expressions)
* ``_rows``        bigint: tuples in the group (COUNT(*))
* ``_mask``        bigint: bit_or of the tuples' level masks (``Lattice.encode``)
* per distinct aggregate argument ``k`` (in order of first appearance in the
  select list then HAVING), only the partials its aggregates need:
  ``a{k}_cnt`` bigint (non-NULL count; COUNT, AVG), ``a{k}_sum`` (SUM, AVG;
  bigint for long arguments, else double), ``a{k}_min`` (MIN), ``a{k}_max`` (MAX),
  typed like the argument.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.model import ChunkResult, LegacyMode, QueryChunk, legacy_mode
from strata.config import Config
from strata.arrowio import ARROW_TYPES
from strata.mlscql import ast as A
from strata.mlscql.analyze import CompiledQuery

from .expr import SPARK_TYPES, SqlCompiler, ident, level_of_mask
from .windows import TAU, end_array, end_sql, instants_sql, membership_sql, useful_rows

__all__ = ["Engine", "EngineError", "result_schema"]

MASK = "_mask"
ROWS = "_rows"
LEVEL = "level"
PART = "_part"


class EngineError(ValueError):
    """A chunk that cannot be evaluated (inconsistent with its query)."""


def result_schema(cq: CompiledQuery) -> pa.Schema:
    """Arrow schema of ``ChunkResult.rows`` for ``cq``: ts, level, then the outputs."""
    fields = [pa.field("ts", pa.int64()), pa.field(LEVEL, pa.string())]
    fields += [pa.field(o.name, ARROW_TYPES[o.type]) for o in cq.outputs]
    return pa.schema(fields)


@dataclass(frozen=True)
class _Partial:
    name: str  # column in partial/state tables
    kind: str  # cnt | sum | min | max
    arg: int  # index into the distinct aggregate arguments


class Engine:
    """Evaluates query chunks on a SparkSession.  Stateless between calls; cheap to create."""

    #: Spark input rows (all tables of a chunk, after pruning) up to which a chunk runs in the
    #: interpreted session (see :meth:`session_for`)
    SMALL_ROWS = 20_000
    #: SQL settings of that session: no whole-stage code generation, interpreted expressions
    INTERPRETED_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}

    def __init__(self, spark, config: Config, membership: str = "arrow", small_rows: int | None = None):
        if membership not in ("arrow", "spark"):
            raise ValueError("membership must be 'arrow' or 'spark'")
        self.spark = spark
        #: chunks feeding Spark at most this many rows run without code generation (0: never)
        self.small_rows = self.SMALL_ROWS if small_rows is None else int(small_rows)
        self._interpreted = None
        self.config = config
        #: where window intervals are computed: "arrow" (NumPy on the chunk, pruning tuples
        #: in no window before Spark sees them) or "spark" (lead() window functions in Spark)
        self.membership = membership
        self.lattice = config.lattice
        levels = list(self.lattice.levels)
        self._level_values = pa.array(levels, pa.string())
        self._level_masks = pa.array([self.lattice.encode(lv) for lv in levels], pa.int64())

    def run(self, cq: CompiledQuery, chunk: QueryChunk) -> ChunkResult:
        """Output rows of ``cq`` for ``chunk.instants`` (and the new state for STATE queries)."""
        t0 = time.perf_counter()
        mode = legacy_mode(cq)
        rows, state = _Run(self, cq, chunk, mode).execute()
        stats = {
            "mode": mode.value,
            "rows_in": chunk.num_rows,
            "rows_out": rows.num_rows,
            "instants": len(chunk.instants),
            "seconds": round(time.perf_counter() - t0, 6),
        }
        if mode is LegacyMode.STATE:
            if not chunk.instants:
                return ChunkResult(chunk.query_id, chunk.chunk_id, rows, chunk.state, chunk.state_upto, stats)
            return ChunkResult(chunk.query_id, chunk.chunk_id, rows, state, max(chunk.instants), stats)
        return ChunkResult(chunk.query_id, chunk.chunk_id, rows, stats=stats)

    result_schema = staticmethod(result_schema)

    def session_for(self, rows: int):
        """The session a chunk feeding ``rows`` rows to Spark runs in.

        Compiling Java for every stage (whole-stage codegen; the instants are literals,
        so each chunk's code is new) costs more than it saves on the few hundred rows a
        pruned ROWS-window chunk holds: interpreted execution was 1.5-2x faster for such
        chunks (bench/NOTES.md).  Small chunks therefore run in a second session of the
        same SparkContext with code generation off; larger ones in the main session.
        """
        if rows > self.small_rows:
            return self.spark
        if self._interpreted is None:
            sess = self.spark.newSession()
            for k, v in self.INTERPRETED_CONF.items():
                sess.conf.set(k, v)
            self._interpreted = sess
        return self._interpreted

    def masks_of(self, levels) -> pa.Array:
        """Level bitmasks (int64) of an Arrow array of canonical level strings."""
        idx = pc.index_in(levels, value_set=self._level_values)
        if idx.null_count:
            bad = pc.filter(levels, pc.is_null(idx))
            raise EngineError(f"chunk holds a level the lattice does not contain: {bad[0].as_py()!r}")
        return pc.take(self._level_masks, idx)


def _col(i: int, name: str) -> str:
    return ident(f"i{i}__{name}")


class _Run:
    """Evaluation of one chunk: builds one SQL statement, runs it, converts the result."""

    def __init__(self, engine: Engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
        self.e = engine
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
        self.compiler = SqlCompiler(self.lattice, self._resolve)
        self.frames: dict[str, pa.Table] = {}  # placeholder → Arrow table (a DataFrame in _sql)
        self.ctes: list[tuple[str, str]] = []

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
        return _col(self._item_of(c.qualifier), c.name)

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
              ts_in: list[int] | None = None, ts_after: int | None = None) -> tuple[str, list[str]]:
        """Registers item ``i``'s table; returns (SQL source placeholder, SQL column list).

        Only ``_seq``, ``ts``, ``level``, the level mask and the ``needed``
        attributes travel to Spark.  With ``window`` (Arrow membership) the
        table also gets each tuple's interval end ``i{i}___end`` and loses the
        tuples that are in no window at any evaluated instant; ``ts_in`` /
        ``ts_after`` keep only tuples with ``ts`` in the list / after the value.
        """
        table = self.chunk.items[i]
        schema = self.cq.items[i].schema
        lower = {n.lower(): n for n in table.column_names}

        def key(name: str) -> str:
            k = name if name in table.column_names else lower.get(name.lower())
            if k is None:
                raise EngineError(f"table of FROM item {i} ({self.cq.items[i].name}) lacks column {name!r}")
            return k

        seq = table.column(key("_seq")).cast(pa.int64()).to_numpy()
        if len(seq) > 1 and bool(np.any(seq[1:] < seq[:-1])):
            table = table.take(pa.array(np.argsort(seq, kind="stable")))
        ts = table.column(key("ts")).cast(pa.int64()).to_numpy()
        keep = None
        end = None
        if window is not None:
            parts = [table.column(key(c)) for c in window.partition_by]
            end = end_array(window, ts, parts, self.e.config.instant_seconds)
            keep = useful_rows(ts, end, self.evals)
        if ts_in is not None:
            keep = np.isin(ts, np.asarray(ts_in, dtype=np.int64))
        if ts_after is not None:
            keep = ts > ts_after
        if keep is not None and not keep.all():
            mask = pa.array(keep)
            table = table.filter(mask)
            if end is not None:
                end = end[keep]

        levels = table.column(key("level")).cast(pa.string())
        arrays = [table.column(key("_seq")).cast(pa.int64()), table.column(key("ts")).cast(pa.int64()),
                  levels, self.e.masks_of(levels)]
        names = [f"i{i}___seq", f"i{i}__ts", f"i{i}__{LEVEL}", f"i{i}__{MASK}"]
        if end is not None:
            arrays.append(pa.array(end, pa.int64()))
            names.append(f"i{i}___end")
        for name, typ in schema.columns:
            if name in needed:
                arrays.append(table.column(key(name)).cast(ARROW_TYPES[typ]))
                names.append(f"i{i}__{name}")
        return self._frame(f"i{i}", pa.Table.from_arrays(arrays, names=names)), [ident(n) for n in names]

    def _frame(self, key: str, table: pa.Table) -> str:
        self.frames[key] = table
        return f"\x00{key}\x00"

    def _cte(self, name: str, sql: str) -> str:
        self.ctes.append((name, sql))
        return name

    def _sql(self, final: str):
        text = final
        if self.ctes:
            text = "WITH " + ",\n".join(f"{n} AS ({s})" for n, s in self.ctes) + "\n" + final
        # spark.sql(text, **frames) formats with str.format: escape braces, then place frames
        text = text.replace("{", "{{").replace("}", "}}")
        for key in self.frames:
            text = text.replace(f"\x00{key}\x00", "{" + key + "}")
        session = self.e.session_for(sum(t.num_rows for t in self.frames.values()))
        self.codegen = session is self.spark
        frames = {k: session.createDataFrame(t) for k, t in self.frames.items()}
        return session.sql(text, **frames)

    # ------------------------------------------------------------------- main
    def execute(self) -> tuple[pa.Table, pa.Table | None]:
        if not self.instants:
            return self._empty(), None
        if self.mode is LegacyMode.NONE:
            return self._execute_none(), None
        if self.mode is LegacyMode.STATE:
            return self._execute_state()
        if not self.cq.is_aggregate and any(t.num_rows == 0 for t in self.chunk.items):
            return self._empty(), None  # some window is empty at every instant: R(τ) = ∅
        needed = self._needed()
        sources = []
        arrow = self.e.membership == "arrow"
        for i, f in enumerate(self.q.from_):
            src, cols = self._load(i, needed[i], window=f.window if arrow else None)
            ts, seq = _col(i, "ts"), _col(i, "_seq")
            if arrow:
                end = _col(i, "_end")
                if f.window.kind == "unbounded":
                    end = None
            else:
                end = end_sql(f.window, ts, seq, [_col(i, c) for c in f.window.partition_by],
                              self.e.config.instant_seconds)
            sources.append(self._cte(f"w{i}", membership_sql(src, cols, ts, end, self.evals)))
        from_ = sources[0] + "".join(f" JOIN {w} USING ({TAU})" for w in sources[1:])
        mask = " | ".join(_col(i, MASK) for i in range(len(sources)))
        where = f" WHERE {self.compiler(self.q.where)}" if self.q.where is not None else ""
        if self.cq.is_aggregate:
            p = self._cte("p", self._aggregate_sql(f"{from_}{where}", TAU, f"({mask})"))
            rel = self._finalize(p)
        else:
            rel = self._cte("r", f"SELECT {TAU}, ({mask}) AS {MASK}, {self._select_list(self.compiler)} FROM {from_}{where}")
        return self._finish(self._sql(self._r2s(rel)).toArrow()), None

    # ---------------------------------------------------------- NONE (monotone)
    def _execute_none(self) -> pa.Table:
        """Unbounded single item, no aggregate: ISTREAM at τ is the rows of the tuples with ts = τ."""
        if self.cq.r2s != "ISTREAM" or self.chunk.items[0].num_rows == 0:
            return self._empty()  # DSTREAM of a monotone relation is empty
        src, _ = self._load(0, self._needed()[0], ts_in=self.instants)
        ts = _col(0, "ts")
        cond = f"{ts} IN ({', '.join(str(t) for t in self.instants)})"
        if self.q.where is not None:
            cond += f" AND {self.compiler(self.q.where)}"
        level = level_of_mask(self.lattice, _col(0, MASK))
        sql = f"SELECT {ts} AS {TAU}, {level} AS {LEVEL}, {self._select_list(self.compiler)} FROM {src} WHERE {cond}"
        return self._finish(self._sql(sql).toArrow())

    # ------------------------------------------------------- STATE (running)
    def _execute_state(self) -> tuple[pa.Table, pa.Table]:
        upto = self.chunk.state_upto
        state = self.chunk.state
        if state is not None and upto is None:
            raise EngineError("chunk carries a state without state_upto")
        if upto is not None and self.evals[0] < upto:
            raise EngineError(f"cannot evaluate instant {self.evals[0]} from a state as of {upto}")
        src, cols = self._load(0, self._needed()[0], ts_after=None if upto is None else int(upto))
        ts = _col(0, "ts")
        conds = [] if upto is None else [f"{ts} > {int(upto)}"]
        if self.q.where is not None:
            conds.append(self.compiler(self.q.where))
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        # partials per (ts, group), then per evaluation instant τ over all ts ≤ τ, plus the state
        pre = self._cte("pre", self._aggregate_sql(f"{src}{where}", ts, _col(0, MASK), tau_alias="_t"))
        keys = self._group_names()
        vals = [ROWS, MASK] + [p.name for p in self._partials()]
        kv = [ident(c) for c in keys + vals]
        branches = [membership_sql(pre, kv, "_t", None, self.evals)]
        if state is not None and state.num_rows:
            missing = [c for c in keys + vals if c not in state.column_names]
            if missing:
                raise EngineError(f"state table lacks column {missing[0]!r}; it was made for another query")
            st = self._frame("state", state.select(keys + vals))
            branches.append(f"SELECT {', '.join(kv)}, explode({instants_sql(self.evals)}) AS {TAU} FROM {st}")
        union = self._cte("u", " UNION ALL ".join(f"SELECT {TAU}, {', '.join(kv)} FROM ({b})" for b in branches))
        merged = self._cte("m", self._merge_sql(union))
        out = self._cte("o", self._r2s(self._finalize(merged)))
        out_cols = [TAU, LEVEL] + [f"o{k}" for k in range(len(self.cq.outputs))]
        last = self.instants[-1]
        a = f"SELECT 0 AS {PART}, {', '.join(out_cols)}, {', '.join(f'NULL AS s_{c}' for c in keys + vals)} FROM {out}"
        b = (f"SELECT 1 AS {PART}, {', '.join(f'NULL AS {c}' for c in out_cols)}, "
             f"{', '.join(f'{ident(c)} AS s_{c}' for c in keys + vals)} FROM {merged} WHERE {TAU} = {last}")
        tbl = self._sql(f"{a} UNION ALL {b}").toArrow()
        part = tbl.column(PART)
        rows = tbl.filter(pc.equal(part, 0))
        new_state = tbl.filter(pc.equal(part, 1)).select([f"s_{c}" for c in keys + vals]).rename_columns(keys + vals)
        return self._finish(rows), new_state.combine_chunks()

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

    def _partials(self) -> list[_Partial]:
        args = self._args()
        kinds: dict[int, set[str]] = {k: set() for k in range(len(args))}
        need = {"COUNT": {"cnt"}, "SUM": {"sum"}, "AVG": {"sum", "cnt"}, "MIN": {"min"}, "MAX": {"max"}}
        for a in self._aggregates():
            if a.arg is not None:
                kinds[args.index(a.arg)].update(need[a.func])
        return [
            _Partial(f"a{k}_{kind}", kind, k)
            for k in range(len(args))
            for kind in ("cnt", "sum", "min", "max")
            if kind in kinds[k]
        ]

    def _aggregate_sql(self, from_where: str, tau: str, mask: str, tau_alias: str = TAU) -> str:
        """Partials per (τ, group keys) of the rows of ``FROM from_where``."""
        cols = [f"{tau} AS {tau_alias}"]
        cols += [f"{self.compiler(g)} AS {n}" for g, n in zip(self.q.group_by, self._group_names())]
        cols += [f"count(1) AS {ROWS}", f"bit_or({mask}) AS {MASK}"]
        args = [self.compiler(a) for a in self._args()]
        fn = {"cnt": "count", "sum": "sum", "min": "min", "max": "max"}
        cols += [f"{fn[p.kind]}({args[p.arg]}) AS {p.name}" for p in self._partials()]
        groups = ", ".join(str(k + 1) for k in range(1 + len(self.q.group_by)))
        return f"SELECT {', '.join(cols)} FROM {from_where} GROUP BY {groups}"

    def _merge_sql(self, source: str) -> str:
        keys = self._group_names()
        fn = {"cnt": "sum", "sum": "sum", "min": "min", "max": "max"}
        cols = [TAU, *keys, f"sum({ROWS}) AS {ROWS}", f"bit_or({MASK}) AS {MASK}"]
        cols += [f"{fn[p.kind]}({p.name}) AS {p.name}" for p in self._partials()]
        groups = ", ".join(str(k + 1) for k in range(1 + len(keys)))
        return f"SELECT {', '.join(cols)} FROM {source} GROUP BY {groups}"

    def _finalize(self, partials: str) -> str:
        """Partials per (_tau, keys) → relation (_tau, _mask, o0..) after HAVING and the select list."""
        source = partials
        if not self.q.group_by:
            # exactly one row per instant, even with no input rows (COUNT 0, others NULL, level bottom)
            zero = {ROWS, MASK} | {p.name for p in self._partials() if p.kind == "cnt"}
            cols = [TAU] + [
                f"coalesce({c}, CAST(0 AS BIGINT)) AS {c}" if c in zero else c
                for c in [ROWS, MASK] + [p.name for p in self._partials()]
            ]
            source = self._cte(
                "f",
                f"SELECT {', '.join(cols)} FROM (SELECT explode({instants_sql(self.evals)}) AS {TAU}) "
                f"LEFT JOIN {partials} USING ({TAU})",
            )
        args = self._args()
        names = self._group_names()

        def subst(e: A.Expr) -> str | None:
            if isinstance(e, A.Aggregate):
                if e.arg is None:
                    return ROWS
                k = args.index(e.arg)
                if e.func == "AVG":
                    return f"(CAST(a{k}_sum AS DOUBLE) / CAST(a{k}_cnt AS DOUBLE))"
                return {"COUNT": f"a{k}_cnt", "SUM": f"a{k}_sum", "MIN": f"a{k}_min", "MAX": f"a{k}_max"}[e.func]
            for j, g in enumerate(self.q.group_by):
                if e == g:
                    return names[j]
            return None

        comp = SqlCompiler(self.lattice, self._ungrouped, subst)
        having = f" WHERE {comp(self.q.having)}" if self.q.having is not None else ""
        return self._cte("r", f"SELECT {TAU}, {MASK}, {self._select_list(comp)} FROM {source}{having}")

    @staticmethod
    def _ungrouped(c: A.Column) -> str:
        raise EngineError(f"column {c.qualifier}.{c.name} is neither grouped nor aggregated")

    # -------------------------------------------------------------- relation
    def _select_list(self, comp: SqlCompiler) -> str:
        return ", ".join(
            f"CAST({comp(s.expr)} AS {SPARK_TYPES[o.type]}) AS o{k}"
            for k, (s, o) in enumerate(zip(self.q.select, self.cq.outputs))
        )

    def _r2s(self, rel: str) -> str:
        """SQL turning relation ``rel`` (_tau, _mask, o..) over the evaluation instants into the
        chunk's output rows (_tau, level, o..)."""
        outs = ", ".join(f"o{k}" for k in range(len(self.cq.outputs)))
        lvl = self._cte("lv", f"SELECT {TAU}, {level_of_mask(self.lattice, MASK)} AS {LEVEL}, {outs} FROM {rel}")
        cols = f"{TAU}, {LEVEL}, {outs}"
        only = f" WHERE {TAU} IN ({', '.join(str(t) for t in self.instants)})"
        extra = len(self.evals) != len(self.instants)
        cur = f"SELECT {cols} FROM {lvl}{only if extra else ''}"
        if not self.diff:
            return cur
        order = self.evals  # ascending; prev_instant first when present
        succ = {order[k]: order[k + 1] for k in range(len(order) - 1)}
        if succ:
            case = " ".join(f"WHEN {a} THEN CAST({b} AS BIGINT)" for a, b in succ.items())
            shifted = (f"SELECT (CASE {TAU} {case} END) AS {TAU}, {LEVEL}, {outs} FROM {lvl} "
                       f"WHERE {TAU} IN ({', '.join(str(t) for t in succ)})")
        else:
            shifted = f"SELECT {cols} FROM {lvl} WHERE FALSE"
        if self.cq.r2s == "ISTREAM":
            return f"({cur}) EXCEPT ALL ({shifted})"
        return f"({shifted}) EXCEPT ALL ({cur})"

    # ------------------------------------------------------------------ output
    def _finish(self, tbl: pa.Table) -> pa.Table:
        schema = result_schema(self.cq)
        arrays = [tbl.column(TAU).cast(pa.int64()), tbl.column(LEVEL).cast(pa.string())]
        for k, o in enumerate(self.cq.outputs):
            arrays.append(tbl.column(f"o{k}").cast(ARROW_TYPES[o.type]))
        out = pa.Table.from_arrays(arrays, schema=schema)
        if out.num_rows > 1:
            out = out.sort_by([("ts", "ascending")])
        return out.combine_chunks()

    def _empty(self) -> pa.Table:
        return result_schema(self.cq).empty_table()
