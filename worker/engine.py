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
   level bottom).  HAVING and the select list follow.  SUM of a 64-bit argument
   is exact: its partials are the sums of the arguments' high and low 32-bit
   words (two bigint sums: as fast as one, unlike a DECIMAL sum), so neither the
   order of additions nor partial aggregation can overflow or change it.
5. Relation to stream: RSTREAM as is; ISTREAM/DSTREAM by ``EXCEPT ALL``
   between R(τ) and R(previous instant) re-tagged with τ, over
   ``(level, columns…)`` with the level decoded to its canonical string first
   (different OR-masks can decode to the same Chinese Wall level).

Failures (SEMANTICS §8 "Arithmetic" and "Failing queries")
---------------------------------------------------------
Integer overflow is computed as data, never raised: every place where the
contract evaluates a 64-bit ``+ - *`` or unary ``-`` (a *site*: each top-level
WHERE conjunct, GROUP BY key, aggregate argument, SUM of longs, HAVING
conjunct, select item) gets a code, and the relation carries an ``_err``
column, the smallest code failing on that row (NULL if none).  A WHERE (HAVING)
conjunct that failed lets its row (group) through unless another conjunct that
did not fail is FALSE or NULL; rows and groups with ``_err`` survive every
filter up to the output, bypass the R2S differences, and the first instant
carrying one is the query's failing instant: the result keeps the rows before
it and reports ``error``/``error_ts``.  All of this is plain SQL over total
functions, so it does not depend on Spark's plan, partitioning or the chunking.
Queries without a checked operation have no ``_err`` column at all.

Any other exception while evaluating a query (a Spark or Python error) is
isolated by :meth:`Engine.run`: it evaluates prefixes of the chunk's instants
(binary search; a prefix with the chunk's full items yields exactly the output
for those instants) to find the first failing instant and returns the rows
before it with a one-line ``error`` (:func:`describe_error`).  Only failures of
the machinery itself (:func:`is_infrastructure_error`: the JVM or its
connection gone, out of memory) still raise, so that the chunk is retried.

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
  ``a{k}_cnt`` bigint (non-NULL count; COUNT, AVG), for SUM and AVG of a
  double argument ``a{k}_sum`` double, of a long/timestamp argument the exact
  sum ``S`` as two bigints ``a{k}_shi`` and ``a{k}_slo`` with
  ``S = a{k}_shi * 2**32 + a{k}_slo`` and ``0 <= a{k}_slo < 2**32`` (a state
  holding an older ``a{k}_sum`` bigint instead is converted),
  ``a{k}_min`` (MIN), ``a{k}_max`` (MAX), typed like the argument.

A state is only produced by a chunk that did not fail, so it never records a
failure (a failing query stops at its first failing instant).
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.model import ChunkResult, LegacyMode, QueryChunk, legacy_mode
from strata.chunking.relations import DEL, intervals
from strata.config import Config
from strata.arrowio import ARROW_TYPES
from strata.mlscql import ast as A
from strata.mlscql.analyze import CompiledQuery
from strata.mlscql.printer import expr_text

from .derived import DerivedRun
from .expr import INTEGRAL, SPARK_TYPES, SqlCompiler, conjuncts, ident, level_of_mask
from .setops import CompoundRun
from .windows import (ERR, MASK, TAU, end_array, end_sql, in_instants_sql, instants_sql, membership_sql, slides,
                      start_array, start_sql, successor_sql, useful_rows)

__all__ = ["Engine", "EngineError", "result_schema", "describe_error", "is_infrastructure_error"]

ROWS = "_rows"
LEVEL = "level"
PART = "_part"
#: a normalized exact SUM ``hi * 2**32 + lo`` (0 <= lo < 2**32) fits a long iff hi is in this range
_HI_RANGE = f"BETWEEN {-(2**31)} AND {2**31 - 1}"
_LO_MASK = "CAST(4294967295 AS BIGINT)"
_LONG_RANGE = f"BETWEEN CAST({-(2**63)} AS DECIMAL(38,0)) AND CAST({2**63 - 1} AS DECIMAL(38,0))"
_TWO32 = "CAST(4294967296 AS DOUBLE)"
_LONG_MIN = -(2**63)


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
    kind: str  # cnt | sum | shi | slo | min | max | set  (shi/slo: exact SUM of a 64-bit argument;
    #            set: the distinct non-NULL values, for COUNT/SUM/AVG(DISTINCT))
    arg: int  # index into the distinct aggregate arguments


@dataclass(frozen=True)
class _Part:
    """A compiled expression: its value, its failure flag (None: cannot fail) and its site code."""

    sql: str
    fails: str | None
    code: int | None


# ---------------------------------------------------------------------------- failures
_INFRA_MARKERS = (
    "OutOfMemoryError", "SparkContext was shut down", "stopped SparkContext",
    "Answer from Java side is empty", "Error while sending or receiving", "Connection refused",
    "java.lang.InterruptedException",
)


def is_infrastructure_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the machinery (JVM/Py4J gone, out of memory) rather than of
    the query: such a chunk must be retried (possibly elsewhere), not reported as the query's error."""
    if isinstance(exc, (MemoryError, ConnectionError)):
        return True
    if type(exc).__name__ in ("Py4JNetworkError",):
        return True
    text = str(exc)
    return any(m in text for m in _INFRA_MARKERS)


_ERROR_CLASS = re.compile(r"^\[([A-Z0-9_.]+)\]\s*")
_JAVA_CLASS = re.compile(r"^(?:Caused by:\s*)?(?:[a-z_$][\w$]*\.)+([A-Z][\w$]*(?:Exception|Error))(?::\s*)?")
_BOILERPLATE = (
    re.compile(r"\s*SQLSTATE:?\s*\w+.*$"),
    re.compile(r"\s*If necessary set [^.]*?(\.|$)"),
    re.compile(r"\s*Use `try_\w+`[^.]*?(\.|$)"),
    re.compile(r"\s*(To return NULL instead|Set \"?spark\.sql\.)[^.]*?(\.|$)"),
)


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """One line for the query's owner: no Java stack, no Spark error-class boilerplate.

    ``integer overflow: …``, ``division by zero``, else ``evaluation failed: …``.
    """
    cls = None
    for getter in ("getCondition", "getErrorClass"):
        fn = getattr(exc, getter, None)
        if fn is not None:
            try:
                cls = fn()
            except Exception:  # noqa: BLE001 - best effort only
                cls = None
            if cls:
                break
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    caused = [ln for ln in lines if ln.startswith("Caused by:")]
    cand = [ln for ln in lines if not ln.startswith(("at ", "An error occurred while calling", "JVM stacktrace", "..."))
            and not ln.startswith("== ")]
    line = (caused[-1] if caused else (cand[0] if cand else "")).lstrip(": ").strip()
    java = _JAVA_CLASS.match(line)
    if java:
        cls = cls or java.group(1)
        line = line[java.end():]
    m = _ERROR_CLASS.match(line)
    if m:
        cls = cls or m.group(1)
        line = line[m.end():]
    for pat in _BOILERPLATE:
        line = pat.sub("", line)
    line = line.strip().rstrip(".") or (cls or type(exc).__name__)
    kind = (cls or "").upper()
    if "OVERFLOW" in kind or "overflow" in line.lower():
        text = line if line.lower().startswith("integer overflow") else f"integer overflow: {line}"
    elif "DIVIDE_BY_ZERO" in kind or "ArithmeticException" in (cls or "") and "zero" in line.lower():
        text = "division by zero"
    elif cls is None and not isinstance(exc, EngineError):
        text = f"evaluation failed: {type(exc).__name__}: {line}"
    else:
        text = f"evaluation failed: {line}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Engine:
    """Evaluates query chunks on a SparkSession.  Stateless between calls; cheap to create."""

    #: Spark input rows (all tables of a chunk, after pruning) up to which a chunk runs in the
    #: interpreted session (see :meth:`session_for`)
    SMALL_ROWS = 20_000
    #: SQL settings of that session: no whole-stage code generation, interpreted expressions
    INTERPRETED_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN",
                        "spark.sql.ansi.enabled": "false"}

    #: a single-item aggregate is pre-aggregated per (ts, interval end, group) before its
    #: partials are spread over the instants when the windows at the chunk's instants hold each
    #: row at least this many times on average (RANGE windows over several instants) ...
    PREAGG_FACTOR = 2.0
    #: ... and at least this many rows reach Spark (below, one aggregation is cheaper to plan)
    PREAGG_MIN_ROWS = 2_000
    #: :meth:`run_many` evaluates a chunk's queries in one statement up to this many input rows
    BATCH_MAX_ROWS = 2_000_000

    def __init__(self, spark, config: Config, membership: str = "arrow", small_rows: int | None = None,
                 batch: bool = True, code_keys: bool = True, single: bool = True):
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
        #: whether :meth:`run_many` puts several queries into one Spark statement
        self.batch = batch
        #: string GROUP BY keys travel to Spark as dictionary codes where that cannot change the answer
        #: (:meth:`_Run._coded_keys`)
        self.code_keys = bool(code_keys)
        #: an input table of one partition is declared so (``coalesce(1)``): Spark's plan then
        #: satisfies every required distribution without an exchange
        self.single = bool(single)
        self._cores: int | None = None
        self.preagg_factor = self.PREAGG_FACTOR
        self.preagg_min_rows = self.PREAGG_MIN_ROWS
        self.lattice = config.lattice
        levels = list(self.lattice.levels)
        self._level_values = pa.array(levels, pa.string())
        self._level_masks = pa.array([self.lattice.encode(lv) for lv in levels], pa.int64())

    def run(self, cq: CompiledQuery, chunk: QueryChunk, isolate: bool = True) -> ChunkResult:
        """Output rows of ``cq`` for ``chunk.instants`` (and the new state for STATE queries).

        A query that fails (integer overflow, or any exception while compiling or evaluating
        it) gives a result with ``error`` (one line), ``error_ts`` (the first instant of the
        chunk whose evaluation fails), ``rows`` for the instants before ``error_ts`` only and
        no state.  ``isolate=False``: exceptions propagate instead (the shared executor's
        merged runs, which fall back to the members).  Infrastructure failures always raise.
        """
        t0 = time.perf_counter()
        mode = legacy_mode(cq)
        rows, state, failure = self._execute(cq, chunk, mode, isolate)
        return self._result(chunk, mode, rows, state, failure, time.perf_counter() - t0)

    def evaluate(self, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
        """(output rows, failure or None) of ``cq`` on ``chunk`` whose history travels as ``mode``
        says (a part of a query over a subquery, worker/derived.py); failures isolated as in :meth:`run`."""
        rows, _, failure = self._execute(cq, chunk, mode, isolate=True)
        return rows, failure

    def _execute(self, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode, isolate: bool):
        """(rows, state, failure); with ``isolate`` an exception becomes the query's failure (no state)."""
        try:
            return _run_of(self, cq, chunk, mode).execute()
        except Exception as exc:  # noqa: BLE001 - a failing query is that query's problem
            if not isolate or is_infrastructure_error(exc):
                raise
            rows, failure = self._isolate(cq, chunk, mode, exc)
            return rows, None, failure

    def run_many(self, items: list[tuple[CompiledQuery, QueryChunk]]) -> list[ChunkResult]:
        """``[run(cq, chunk) for cq, chunk in items]``, with the queries' statements evaluated as
        one Spark statement (one parse, analysis, plan and job instead of one per query).

        Each query's part of the statement is exactly the statement :meth:`run` would evaluate
        (its own CTEs and input tables; identical input tables are sent once), so its rows,
        failures (``_err``) and state are the same.  A query whose planning raises, a STATE
        query, and every query of a statement that raises are evaluated by :meth:`run`
        instead (with its isolation of failures).  Infrastructure failures raise.
        """
        if not self.batch or len(items) < 2:
            return [self.run(cq, ch) for cq, ch in items]
        t0 = time.perf_counter()
        results: list[ChunkResult | None] = [None] * len(items)
        pending: list[tuple[int, _Deferred]] = []
        for j, (cq, chunk) in enumerate(items):
            mode = legacy_mode(cq)
            if mode is LegacyMode.STATE or cq.branches or cq.subqueries:
                continue  # its statement also returns the new state / a compound query: evaluated on its own
            try:
                rows, state, failure = _Run(self, cq, chunk, mode, prefix=f"q{j}_", defer=True).execute()
            except _Deferred as d:
                pending.append((j, d))
                continue
            except Exception as exc:  # noqa: BLE001 - evaluated (and isolated) on its own below
                if is_infrastructure_error(exc):
                    raise
                continue
            results[j] = self._result(chunk, mode, rows, state, failure, time.perf_counter() - t0)
        if len(pending) >= 2 and sum(d.run.rows_in for _, d in pending) <= self.BATCH_MAX_ROWS:
            try:
                tables = self._evaluate_together([d for _, d in pending])
            except Exception as exc:  # noqa: BLE001 - each query on its own below
                if is_infrastructure_error(exc):
                    raise
                tables = None
            if tables is not None:
                secs = (time.perf_counter() - t0) / len(pending)
                for (j, d), tbl in zip(pending, tables):
                    try:
                        rows, state, failure = d.then(tbl)
                    except Exception as exc:  # noqa: BLE001
                        if is_infrastructure_error(exc):
                            raise
                        continue
                    cq, chunk = items[j]
                    results[j] = self._result(chunk, d.run.mode, rows, state, failure, secs, batched=len(pending))
        return [r if r is not None else self.run(*items[j]) for j, r in enumerate(results)]

    def _evaluate_together(self, deferred: list[_Deferred]) -> list[pa.Table]:
        """One statement: the UNION ALL of the runs' final selects, tagged ``_q``, each run's output
        columns in typed slots shared between the runs; split back per run after ``toArrow``."""
        slots: list[tuple[str, str]] = []  # (slot name, Spark type)
        layouts = []
        for d in deferred:
            r = d.run
            cols = [(f"o{k}", SPARK_TYPES[o.type]) for k, o in enumerate(r.cq.outputs)]
            seen: dict[str, int] = {}
            layout = {}
            for name, typ in cols:
                n = seen.get(typ, 0)
                seen[typ] = n + 1
                slot = f"v_{typ.lower()}_{n}"
                if (slot, typ) not in slots:
                    slots.append((slot, typ))
                layout[slot] = name
            layouts.append(layout)
        ctes: list[tuple[str, str]] = []
        frames: dict[str, pa.Table] = {}
        branches = []
        for j, (d, layout) in enumerate(zip(deferred, layouts)):
            r = d.run
            ctes += r.ctes
            frames.update(r.frames)
            cols = [f"CAST({j} AS INT) AS _q", TAU, LEVEL]
            cols += [f"CAST({layout[slot]} AS {typ}) AS {slot}" if slot in layout else f"CAST(NULL AS {typ}) AS {slot}"
                     for slot, typ in slots]
            cols.append(ERR if r.checked else f"CAST(NULL AS INT) AS {ERR}")
            branches.append(f"SELECT {', '.join(cols)} FROM ({d.final}) AS _b{j}")
        tbl = self.statement(ctes, "\nUNION ALL\n".join(branches), frames).toArrow()
        q = tbl.column("_q")
        out = []
        for j, (d, layout) in enumerate(zip(deferred, layouts)):
            part = tbl.filter(pc.equal(q, j))
            names = [TAU, LEVEL] + [f"o{k}" for k in range(len(d.run.cq.outputs))]
            arrays = [part.column(TAU), part.column(LEVEL)]
            by_name = {v: k for k, v in layout.items()}
            arrays += [part.column(by_name[f"o{k}"]) for k in range(len(d.run.cq.outputs))]
            if d.run.checked:
                names.append(ERR)
                arrays.append(part.column(ERR))
            out.append(pa.Table.from_arrays(arrays, names=names))
        return out

    def statement(self, ctes: list[tuple[str, str]], final: str, frames: dict[str, pa.Table]):
        """The DataFrame of ``WITH ctes final``, whose ``\\x00key\\x00`` placeholders name the Arrow
        tables of ``frames`` (equal tables become one DataFrame)."""
        text = final
        if ctes:
            text = "WITH " + ",\n".join(f"{n} AS ({s})" for n, s in ctes) + "\n" + final
        # spark.sql(text, **frames) formats with str.format: escape braces, then place frames
        text = text.replace("{", "{{").replace("}", "}}")
        for key in frames:
            text = text.replace(f"\x00{key}\x00", "{" + key + "}")
        session = self.session_for(sum(t.num_rows for t in frames.values()))
        dfs: dict[str, object] = {}
        made: list[tuple[pa.Table, object]] = []
        for k, t in frames.items():
            for other, df in made:
                if other.num_rows == t.num_rows and other.schema.equals(t.schema) and other.equals(t):
                    dfs[k] = df
                    break
            else:
                part = self._partitioned(t)
                df = session.createDataFrame(part)
                if self.single and part.num_rows <= self.PARTITION_ROWS:
                    # one partition Spark knows of: aggregates, joins and differences need no
                    # shuffle, one stage instead of two or three (a pruned ROWS chunk grouped by
                    # sid: 0.12 s instead of 0.15; bench/NOTES.md, RANGE entry of 2026-11-25 late)
                    df = df.coalesce(1)
                dfs[k] = df
                made.append((t, dfs[k]))
        return session.sql(text, **dfs)

    #: rows per Spark partition of an input table (at most one partition per core)
    PARTITION_ROWS = 100_000

    def _partitioned(self, table: pa.Table) -> pa.Table:
        """``table`` as record batches of one Spark partition each: ``createDataFrame`` makes one
        partition (task) per batch of at most ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows
        (worker/spark.py sets it high).  With Spark's default of 10,000 rows a 680k-row chunk became
        68 tasks whose scheduling cost 3-4x the work (docs/benchmarks/engine_micro.md)."""
        if self._cores is None:
            try:
                self._cores = max(1, int(self.spark.sparkContext.defaultParallelism))
            except Exception:  # noqa: BLE001 - e.g. a session without a local context
                self._cores = 1
        n = table.num_rows
        parts = max(1, min(self._cores, -(-n // self.PARTITION_ROWS)))
        if parts == 1:
            return table.combine_chunks()
        size = -(-n // parts)
        return pa.Table.from_batches(
            [b for k in range(parts) for b in table.slice(k * size, size).combine_chunks().to_batches()],
            schema=table.schema)

    @staticmethod
    def _result(chunk: QueryChunk, mode: LegacyMode, rows: pa.Table, state, failure, seconds: float,
                batched: int = 0) -> ChunkResult:
        stats = {
            "mode": mode.value,
            "rows_in": chunk.num_rows,
            "rows_out": rows.num_rows,
            "instants": len(chunk.instants),
            "seconds": round(seconds, 6),
        }
        if batched:
            stats["batched"] = batched
        if failure is not None:
            error_ts, reason = failure
            stats["error"] = reason
            return ChunkResult(chunk.query_id, chunk.chunk_id, rows, None, None, stats,
                               error=reason, error_ts=error_ts)
        if mode is LegacyMode.STATE:
            if not chunk.instants:
                return ChunkResult(chunk.query_id, chunk.chunk_id, rows, chunk.state, chunk.state_upto, stats)
            return ChunkResult(chunk.query_id, chunk.chunk_id, rows, state, max(chunk.instants), stats)
        return ChunkResult(chunk.query_id, chunk.chunk_id, rows, stats=stats)

    result_schema = staticmethod(result_schema)

    def _isolate(self, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode,
                 exc: Exception) -> tuple[pa.Table, tuple[int | None, str]]:
        """After ``exc``: the first failing instant by binary search over prefixes of the chunk's
        instants (each evaluated with the chunk's full items, which gives exactly the output for
        those instants); returns (rows before it, (instant, reason))."""
        instants = sorted(set(int(t) for t in chunk.instants))
        if not instants:
            return result_schema(cq).empty_table(), (None, describe_error(exc))
        good = result_schema(cq).empty_table()
        lo, hi = 0, len(instants)  # the prefix of length lo evaluates, the one of length hi fails
        while hi - lo > 1:
            mid = (lo + hi) // 2
            sub = dataclasses.replace(chunk, instants=instants[:mid])
            try:
                rows, _, failure = _run_of(self, cq, sub, mode).execute()
            except Exception as e:  # noqa: BLE001
                if is_infrastructure_error(e):
                    raise
                hi, exc = mid, e
                continue
            if failure is not None:  # an overflow before the exception: that is the first failure
                return rows, failure
            lo, good = mid, rows
        return good, (instants[hi - 1], describe_error(exc))

    def session_for(self, rows: int):
        """The session a chunk feeding ``rows`` rows to Spark runs in.

        Compiling Java for every stage (whole-stage codegen; the instants are literals,
        so each chunk's code is new) costs more than it saves on the few hundred rows a
        pruned ROWS-window chunk holds, so small chunks run in a second session of the same
        SparkContext with code generation off; larger ones in the main session.  Warm, at
        20,000 rows (a RANGE chunk of one instant of 2,000 tuples plus its legacy) the
        code-generating session executed in 67-70 ms against 165-172 ms; but a threshold of
        2,000 rows made `./dev run`'s processing 3.9-4.0 s instead of 2.2-2.6 s (each new
        statement shape compiled on a cold JVM), so it stays at 20,000 (bench/NOTES.md).
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


def _span(window: A.Window, instant_seconds: float) -> int | None:
    """T of a window whose intervals are ``[ts, ts + T)`` (RANGE T, NOW), else None."""
    if window.kind == "range":
        if window.slide_instants(instant_seconds) is not None:
            return None  # intervals from a slide boundary to another (windows.start_array)
        return int(window.range_instants(instant_seconds))
    if window.kind == "now":
        return 1
    return None


def _members(ts: np.ndarray, end: np.ndarray, instants: list[int]) -> tuple[int, np.ndarray]:
    """(how many (row, instant) pairs have the instant in the row's interval ``[ts, end)``,
    per instant of ``instants`` (ascending) whether some row's interval holds it)."""
    ins = np.asarray(instants, dtype=np.int64)
    first = np.searchsorted(ins, ts, side="left")
    last = np.searchsorted(ins, end, side="left")
    k = len(ins)
    opened = np.cumsum(np.bincount(first, minlength=k + 1) - np.bincount(last, minlength=k + 1))[:k]
    return int(np.sum(last - first)), opened > 0


class _Deferred(Exception):
    """Control flow of :meth:`Engine.run_many`: a run's planned statement, not yet evaluated.

    ``then(arrow_table)`` turns the statement's result into ``(rows, state, failure)``."""

    def __init__(self, run: "_Run", final: str, then):
        super().__init__("deferred statement")
        self.run, self.final, self.then = run, final, then


def _run_of(engine: Engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode):
    """The evaluation of ``chunk`` for ``cq``: a compound query's (worker/setops.py) or a SELECT's."""
    if cq.branches:
        return _CompoundRun(engine, cq, chunk, mode)
    if cq.subqueries:
        return DerivedRun(engine, cq, chunk, mode)
    return _Run(engine, cq, chunk, mode)


class _Run:
    """Evaluation of one chunk: builds one SQL statement, runs it, converts the result."""

    def __init__(self, engine: Engine, cq: CompiledQuery, chunk: QueryChunk, mode: LegacyMode,
                 prefix: str = "", defer: bool = False, codes: bool = True):
        self.e = engine
        #: whether string GROUP BY keys may travel as dictionary codes (not in a compound query's
        #: SELECTs, whose relations are combined before any decoding)
        self.codes = codes
        #: names of this run's CTEs and frames start with it (several runs in one statement)
        self.prefix = prefix
        #: raise :class:`_Deferred` with the planned statement instead of running it
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
        self.where_parts = [self._part(comp, c, "in WHERE") for c in conjuncts(self.q.where)]
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
            self.having_parts = [self._part(fin, c, "in HAVING") for c in conjuncts(self.q.having)]
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

    def _type(self, c: A.Column) -> str | None:
        return self.cq.items[self._item_of(c.qualifier)].schema.type_of(c.name)

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

    def _coded_keys(self) -> list[tuple[int, str]]:
        """String attributes Spark needs only to tell apart: GROUP BY keys that appear nowhere else but
        as bare select items (not in WHERE, HAVING or an aggregate argument), in a chunk evaluated
        without a running state.  They travel as int32 dictionary codes, and the output is decoded
        with the chunk's dictionary (:meth:`_finish`): equal strings have equal codes and NULL stays
        NULL, so the groups are the same, while Spark converts and hashes integers instead of
        strings (a 680 k-row RANGE chunk grouped by a string key: about half the engine time)."""
        if not self.cq.is_aggregate or self.mode is not LegacyMode.WINDOW or not self.e.code_keys or not self.codes:
            return []
        keys = [g for g in self.q.group_by if isinstance(g, A.Column) and self._type(g) == "string"]
        if not keys:
            return []
        other: list[A.Expr] = [x for x in (self.q.where, self.q.having) if x is not None]
        other += [a for s in self.q.select or () for a in A.aggregates_in(s.expr)]
        other += [s.expr for s in self.q.select or () if not isinstance(s.expr, A.Column)]
        other += [g for g in self.q.group_by if not isinstance(g, A.Column)]
        used = {(self._item_of(c.qualifier), c.name.lower()) for e in other for c in A.columns_in(e)}
        used |= {(i, p.lower()) for i, f in enumerate(self.q.from_) for p in f.window.partition_by}
        out = []
        for g in keys:
            k = (self._item_of(g.qualifier), g.name)
            if (k[0], g.name.lower()) not in used and k not in out:
                out.append(k)
        return out

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
              ts_in: list[int] | None = None, ts_after: int | None = None,
              seq: bool = False, end_column: bool = True) -> tuple[str, list[str]]:
        """Registers item ``i``'s table; returns (SQL source placeholder, SQL column list).

        Only ``ts``, the level mask and the ``needed`` attributes travel to Spark (``level``
        only when the query reads it, ``_seq`` only with ``seq``: Spark-side ROWS membership).
        With ``window`` (Arrow membership) the table also gets each tuple's interval end
        ``i{i}___end`` and loses the tuples that are in no window at any evaluated instant;
        ``ts_in`` / ``ts_after`` keep only tuples with ``ts`` in the list / after the value
        and not after the last evaluated instant.
        """
        table = self.chunk.items[i]
        schema = self.cq.items[i].schema
        lower = {n.lower(): n for n in table.column_names}

        def key(name: str) -> str:
            k = name if name in table.column_names else lower.get(name.lower())
            if k is None:
                raise EngineError(f"table of FROM item {i} ({self.cq.items[i].name}) lacks column {name!r}")
            return k

        if lower.get("_seq") is not None:  # else in arrival order already (chunking.prune.project_chunk)
            seqs = table.column(key("_seq")).cast(pa.int64()).to_numpy()
            if len(seqs) > 1 and bool(np.any(seqs[1:] < seqs[:-1])):
                table = table.take(pa.array(np.argsort(seqs, kind="stable")))
        ts = table.column(key("ts")).cast(pa.int64()).to_numpy()
        keep = None
        end = None
        start = ts
        if self.q.from_[i].window.kind == "relation":
            # a stored relation: inserts live until the delete that names them (chunking.relations)
            d = table.column(key(DEL))
            gone = d.is_valid().to_numpy(zero_copy_only=False)
            end = intervals(table.column(key("_seq")).cast(pa.int64()).to_numpy(), ts, d.fill_null(-1).to_numpy(), gone)
            keep = ~gone & useful_rows(start, end, self.evals)
        elif window is not None:
            parts = [table.column(key(c)) for c in window.partition_by]
            end = end_array(window, ts, parts, self.e.config.instant_seconds)
            start = start_array(window, ts, self.e.config.instant_seconds)
            keep = useful_rows(start, end, self.evals)
        if ts_in is not None:
            keep = np.isin(ts, np.asarray(ts_in, dtype=np.int64))
        if ts_after is not None:
            keep = (ts > ts_after) & (ts <= self.evals[-1])
        if keep is not None and not keep.all():
            mask = pa.array(keep)
            table = table.filter(mask)
            if end is not None:
                end = end[keep]
                start = start[keep]
        self.rows_in += table.num_rows
        if end is None:
            self.explode += table.num_rows
            self._cover_known = False
        else:
            pairs, cover = _members(start, end, self.evals)
            self.explode += pairs
            self.covered = cover if self.covered is None else self.covered & cover

        levels = table.column(key("level")).cast(pa.string())
        arrays = [table.column(key("ts")).cast(pa.int64()), self.e.masks_of(levels)]
        names = [f"i{i}__ts", f"i{i}__{MASK}"]
        lowered = {n.lower() for n in needed}
        if LEVEL in lowered:
            arrays.append(levels)
            names.append(f"i{i}__{LEVEL}")
        if seq:
            arrays.append(table.column(key("_seq")).cast(pa.int64()))
            names.append(f"i{i}___seq")
        if end is not None and end_column:
            arrays.append(pa.array(end, pa.int64()))
            names.append(f"i{i}___end")
        if end is not None and slides(window, self.e.config.instant_seconds):
            arrays.append(pa.array(start, pa.int64()))
            names.append(f"i{i}___start")
        for name, typ in schema.columns:
            if name in needed:
                col = table.column(key(name)).cast(ARROW_TYPES[typ])
                if (i, name) in self.coded:  # one dictionary per chunk: codes mean nothing across chunks
                    enc = pc.dictionary_encode(col.combine_chunks())
                    self.coded[(i, name)] = enc.dictionary
                    col = enc.indices.cast(pa.int32())
                arrays.append(col)
                names.append(f"i{i}__{name}")
        return self._frame(f"i{i}", pa.Table.from_arrays(arrays, names=names)), [ident(n) for n in names]

    def _frame(self, key: str, table: pa.Table) -> str:
        key = self.prefix + key
        self.frames[key] = table
        return f"\x00{key}\x00"

    def _cte(self, name: str, sql: str) -> str:
        name = self.prefix + name
        self.ctes.append((name, sql))
        return name

    def _sql(self, final: str):
        return self.e.statement(self.ctes, final, self.frames)

    def _query(self, final: str, then):
        """``then(Arrow result of final)``, or with ``defer`` a :class:`_Deferred` carrying the
        statement for :meth:`Engine.run_many`, which evaluates it together with others."""
        if self.defer:
            raise _Deferred(self, final, then)
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
            span = _span(f.window, self.e.config.instant_seconds)
            src, cols = self._load(i, needed[i], window=f.window if arrow else None,
                                   seq=not arrow and f.window.kind in ("rows", "partition"), end_column=span is None)
            ts = _col(i, "ts")
            if f.window.kind == "relation":
                end = _col(i, "_end")
            elif arrow:
                end = None if f.window.kind == "unbounded" else (
                    _col(i, "_end") if span is None else f"({ts} + CAST({span} AS BIGINT))")
                if slides(f.window, self.e.config.instant_seconds):
                    ts = _col(i, "_start")  # where the tuple's interval of instants starts
            else:
                end = end_sql(f.window, ts, _col(i, "_seq"), [_col(i, c) for c in f.window.partition_by],
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
            span = _span(self.q.from_[0].window, self.e.config.instant_seconds)
            end_key = [] if end is None or span is not None else [(end, "_e")]
            pre = self._cte("pre", self._aggregate_sql(f"{src}{where}", ts, _col(0, MASK), tau_alias="_t",
                                                       extra=end_key))
            kv = [ident(c) for c in self._group_names() + [ROWS, MASK] + [p.name for p in self._partials()]]
            err = [ERR] if self.row_err else []
            pend = None if end is None else ("_e" if span is None else f"(_t + CAST({span} AS BIGINT))")
            spread = self._cte("x", membership_sql(pre, kv + err, "_t", pend, self.evals, pruned=True))
            return self._finalize(self._cte("m", self._merge_sql(spread)))
        windows = [self._cte(f"w{i}", membership_sql(src, cols, ts, end, self.evals, pruned=arrow))
                   for i, (src, cols, ts, end) in enumerate(sources)]
        from_ = windows[0] + "".join(f" JOIN {w} USING ({TAU})" for w in windows[1:])
        mask = " | ".join(_col(i, MASK) for i in range(len(windows)))
        if self.cq.is_aggregate:
            p = self._cte("p", self._aggregate_sql(f"{from_}{where}", TAU, f"({mask})"))
            return self._finalize(p)
        else:
            err = self._err_col(self.where_parts + self.select_parts)
            rel = self._cte("r", f"SELECT {TAU}, ({mask}) AS {MASK}, {self._select_list()}{err} FROM {from_}{where}")
        return rel

    def _rows_only(self, tbl: pa.Table):
        rows, failure = self._finish(tbl)
        return rows, None, failure

    def _pre_aggregate(self) -> bool:
        """Whether to aggregate per (ts, interval end, group) before spreading over the instants:
        when the windows at the evaluated instants hold each row several times on average."""
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
        ts = _col(0, "ts")
        where = self._filter(self.where_parts)
        where = f" WHERE {where}" if where else ""
        level = level_of_mask(self.lattice, _col(0, MASK))
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
        ts = _col(0, "ts")
        where = self._filter(self.where_parts)
        where = f" WHERE {where}" if where else ""
        # partials per (ts, group), then per evaluation instant τ over all ts ≤ τ, plus the state
        pre = self._cte("pre", self._aggregate_sql(f"{src}{where}", ts, _col(0, MASK), tau_alias="_t"))
        keys = self._group_names()
        vals = [ROWS, MASK] + [p.name for p in self._partials()]
        err = [ERR] if self.row_err else []
        kv = [ident(c) for c in keys + vals]
        branches = [membership_sql(pre, kv + err, "_t", None, self.evals, pruned=True)]
        if state is not None and state.num_rows:
            state = _upgrade_state(state, self._partials())
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

    def _state_result(self, tbl: pa.Table, names: list[str]):
        part = tbl.column(PART)
        rows, failure = self._finish(tbl.filter(pc.equal(part, 0)))
        if failure is not None:
            return rows, None, failure
        new_state = tbl.filter(pc.equal(part, 1)).select([f"s_{c}" for c in names]).rename_columns(names)
        return rows, new_state.combine_chunks(), None

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
                kinds[args.index(a.arg)].update({"set"} if a.distinct else need[a.func])
        for k in kinds:
            if "sum" in kinds[k] and self.arg_types[k] in INTEGRAL:
                kinds[k] = (kinds[k] - {"sum"}) | {"shi", "slo"}  # exact: high and low 32-bit words
        return [
            _Partial(f"a{k}_{kind}", kind, k)
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

    def _set_arg(self, sql: str, p: _Partial) -> str:
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

    # -------------------------------------------------------------- relation
    def _select_list(self) -> str:
        coded = self._coded_outputs()
        return ", ".join(
            f"CAST({p.sql} AS {'INT' if k in coded else SPARK_TYPES[o.type]}) AS o{k}"
            for k, (p, o) in enumerate(zip(self.select_parts, self.cq.outputs))
        )

    def _coded_outputs(self) -> dict[int, tuple[int, str]]:
        """Output index → the coded attribute it shows (a bare select item of a coded GROUP BY key)."""
        if not self.coded:
            return {}
        out = {}
        for k, s in enumerate(self.q.select or ()):
            if isinstance(s.expr, A.Column):
                key = (self._item_of(s.expr.qualifier), s.expr.name)
                if key in self.coded:
                    out[k] = key
        return out

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

    # ------------------------------------------------------------------ output
    def _finish(self, tbl: pa.Table) -> tuple[pa.Table, tuple[int, str] | None]:
        """Spark's rows → (the chunk's output rows, failure or None).

        With failures: the first failing evaluation instant (the previous instant counts as the
        chunk's first instant) is ``error_ts``; rows at or after it are dropped."""
        failure = None
        if ERR in tbl.column_names:
            err = pc.abs(tbl.column(ERR))  # DSTREAM's failures come negated
            bad = pc.is_valid(err)
            if tbl.num_rows and pc.any(bad).as_py():
                taus = pc.filter(tbl.column(TAU), bad)
                codes = pc.filter(err, bad)
                first = pc.min(taus).as_py()
                code = pc.min(pc.filter(codes, pc.equal(taus, first))).as_py()
                error_ts = max(int(first), self.instants[0])
                failure = (error_ts, self.sites[int(code) - 1])
                tbl = tbl.filter(pc.and_(pc.invert(bad), pc.less(tbl.column(TAU), error_ts)))
        schema = result_schema(self.cq)
        arrays = [tbl.column(TAU).cast(pa.int64()), tbl.column(LEVEL).cast(pa.string())]
        coded = self._coded_outputs()
        for k, o in enumerate(self.cq.outputs):
            col = tbl.column(f"o{k}")
            if k in coded:  # back from the chunk's dictionary codes (NULL stays NULL)
                dictionary = self.coded[coded[k]]
                col = pc.take(dictionary if dictionary is not None else pa.array([], pa.string()),
                              col.cast(pa.int32()))
            arrays.append(col.cast(ARROW_TYPES[o.type]))
        out = pa.Table.from_arrays(arrays, schema=schema)
        if out.num_rows > 1:
            out = out.sort_by([("ts", "ascending")])
        return out.combine_chunks(), failure

    def _empty(self) -> pa.Table:
        return result_schema(self.cq).empty_table()


class _CompoundRun(CompoundRun):
    """A compound query's chunk: its SELECTs as :class:`_Run` relations, combined (worker/setops.py),
    then the same stream operator and output as a single SELECT."""

    def branch_run(self, cq: CompiledQuery, chunk: QueryChunk, prefix: str) -> "_Run":
        if cq.branches:  # a parenthesized compound: its combined relation is the part
            return _CompoundRun(self.e, cq, chunk, self.mode, prefix=prefix)
        if cq.subqueries:  # the subqueries first; the outer query's relation joins the statement
            chunk, failure = DerivedRun(self.e, cq, chunk, self.mode).outer_chunk()
            if failure is not None:
                self.failures.append(failure)
            cq = cq.outer
        return _Run(self.e, cq, chunk, self.mode, prefix=prefix, codes=False)

    _cte = _Run._cte
    _sql = _Run._sql
    _query = _Run._query
    _r2s = _Run._r2s
    _finish = _Run._finish
    _rows_only = _Run._rows_only
    _empty = _Run._empty
    _coded_outputs = _Run._coded_outputs


def _unqualified(e: A.Expr) -> A.Expr:
    if isinstance(e, A.Column):
        return A.Column(None, e.name)
    return A.map_children(e, _unqualified)


def _upgrade_state(state: pa.Table, partials: list[_Partial]) -> pa.Table:
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
