"""Chunk evaluation on Spark: ``Engine(spark, config).run(compiled_query, chunk)``.

One call evaluates one :class:`~strata.chunking.model.QueryChunk` (SEMANTICS
§5) with a handful of Spark jobs (one ``toArrow`` per chunk) and keeps nothing
between calls: all history arrives in the chunk (legacy rows or, for
``LegacyMode.STATE``, a running state table).

The parts of an evaluation
--------------------------
* worker/load_chunk.py, **loading the chunk into Spark**: each FROM item's table as a frame of
  the statement (step 1 below), the query's columns resolved to the items;
* worker/evaluate.py, **per-query evaluation**: the statement of one query (steps 2-5), with its
  failure sites and aggregation, for a SELECT (``SelectRun``), a compound query (worker/setops.py)
  or a query over subqueries (worker/derived.py);
* worker/assemble.py, **assembling the result**: Spark's rows as the chunk's output rows and
  first failure, the new state, the one-line error, the :class:`ChunkResult`;
* this module, the :class:`Engine`: the Spark sessions, running statements (several queries in
  one statement: :meth:`Engine.run_many`), and isolating a failing query's first instant.

Plan of a chunk
---------------
The whole plan is one Spark SQL statement (CTEs over the chunk's tables),
parsed and analyzed once: building it through the DataFrame API took hundreds
of Py4J round trips and doubled the latency of small chunks.  A CTE read only
once is written in place as a derived table before Spark sees the statement
(:func:`inline_ctes`): Spark's analyzer resolves a chain of CTEs one link per
pass of its rules, so a small chunk's statement cost ~25 % more JVM time.

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
   A single-item aggregate whose windows hold each row at several instants (RANGE
   windows over many instants) is aggregated *before* step 2 instead: partials per
   (ts, interval end, group) after WHERE, then those partials spread over the instants
   of their interval and merged per (τ, group), so a row is read once, not once per
   window holding it.  ``Engine(partials="auto"|"on"|"off")`` (the worker:
   ``STRATA_RANGE_PARTIALS``) chooses by size, always, or never (the old path, kept to
   compare; tests/test_range_partials.py checks both against the reference).
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

import pyarrow as pa
import pyarrow.compute as pc

from strata.chunking.model import ChunkResult, LegacyMode, QueryChunk, legacy_mode
from strata.config import Config
from strata.mlscql.analyze import CompiledQuery

from .assemble import LEVEL, EngineError, chunk_result, describe_error, is_infrastructure_error, result_schema
from .evaluate import Deferred, SelectRun, run_of
from .expr import SPARK_TYPES
from .windows import ERR, TAU

__all__ = ["Engine", "EngineError", "result_schema", "describe_error", "is_infrastructure_error", "inline_ctes"]

#: the evaluation of a SELECT's chunk under its old name (tests patch ``engine._Run.execute``)
_Run = SelectRun


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
    #: the switch of that pre-aggregation (``partials``): "auto" (the two thresholds above), "on"
    #: (whenever the query can: one FROM item, aggregates, Arrow membership), "off" (the rows are
    #: exploded over the instants and aggregated per instant: the path before it, kept to compare)
    PARTIALS = ("auto", "on", "off")
    #: :meth:`run_many` evaluates a chunk's queries in one statement up to this many input rows
    BATCH_MAX_ROWS = 2_000_000

    def __init__(self, spark, config: Config, membership: str = "arrow", small_rows: int | None = None,
                 batch: bool = True, code_keys: bool = True, single: bool = True, partials: str = "auto"):
        if membership not in ("arrow", "spark"):
            raise ValueError("membership must be 'arrow' or 'spark'")
        if partials not in self.PARTIALS:
            raise ValueError(f"partials must be one of {', '.join(self.PARTIALS)}, not {partials!r}")
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
        #: (:meth:`~strata.worker.load_chunk.ChunkLoad._coded_keys`)
        self.code_keys = bool(code_keys)
        #: an input table of one partition is declared so (``coalesce(1)``): Spark's plan then
        #: satisfies every required distribution without an exchange
        self.single = bool(single)
        self._cores: int | None = None
        self.preagg_factor = self.PREAGG_FACTOR
        self.preagg_min_rows = self.PREAGG_MIN_ROWS
        #: RANGE (and every single-item) aggregates pre-aggregated per (ts, interval end, group):
        #: "auto", "on" or "off" (:data:`PARTIALS`)
        self.partials = partials
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
            return run_of(self, cq, chunk, mode).execute()
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
        pending: list[tuple[int, Deferred]] = []
        for j, (cq, chunk) in enumerate(items):
            mode = legacy_mode(cq)
            if mode is LegacyMode.STATE or cq.branches or cq.subqueries:
                continue  # its statement also returns the new state / a compound query: evaluated on its own
            try:
                rows, state, failure = SelectRun(self, cq, chunk, mode, prefix=f"q{j}_", defer=True).execute()
            except Deferred as d:
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

    def _evaluate_together(self, deferred: list[Deferred]) -> list[pa.Table]:
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
        tables of ``frames`` (equal tables become one DataFrame).  A CTE read once is written in place
        (:func:`inline_ctes`)."""
        ctes, final = inline_ctes(ctes, final)
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

    #: the :class:`ChunkResult` of a run (worker/assemble.py)
    _result = staticmethod(chunk_result)

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
                rows, _, failure = run_of(self, cq, sub, mode).execute()
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


# ---- CTEs read once, written in place ----------------------------------------------------------------
#: what may follow a CTE's name where it is read (``FROM name`` / ``JOIN name``) for the name to be
#: replaced by ``(its query) AS name``: the end of the text or of a parenthesis, a comma, or a keyword
#: that ends a FROM item (never an alias: ``FROM name alias`` is left alone)
_AFTER_ITEM = re.compile(r"\s*(?:$|\)|,|(?:WHERE|GROUP|JOIN|LEFT|RIGHT|FULL|INNER|CROSS|UNION|EXCEPT|INTERSECT|ON|USING"
                         r"|ORDER|HAVING|LIMIT)\b)", re.IGNORECASE)
_BEFORE_ITEM = re.compile(r"\b(?:FROM|JOIN)\s+$", re.IGNORECASE)


#: a string literal (backslash escapes, as Spark's parser reads them) or a back-quoted identifier
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`]|``)*`", re.DOTALL)


def _masked(text: str) -> str:
    """``text`` with the insides of its string literals and back-quoted identifiers blanked (same length),
    so that a name is only found where it is SQL, never inside a literal or an identifier."""
    return _QUOTED.sub(lambda m: m.group(0)[0] + " " * (len(m.group(0)) - 2) + m.group(0)[-1], text)


def inline_ctes(ctes: list[tuple[str, str]], final: str) -> tuple[list[tuple[str, str]], str]:
    """``WITH ctes final`` with every CTE that is read exactly once, as a FROM or JOIN item, written in
    place as a derived table of the same name (``FROM name`` → ``FROM (its query) AS name``); the others
    stay CTEs.  The same statement: Spark inlines such a CTE anyway (its optimizer's InlineCTE), but its
    analyzer resolves a chain of CTEs one link per pass of its rules, and a derived table in one pass (a
    small chunk's compound query: ~25 % less JVM time per statement).  A name that occurs anywhere else
    (a qualifier, an alias, a column), or is followed by an alias, keeps its CTE."""
    if not ctes:
        return ctes, final
    texts = [sql for _, sql in ctes] + [final]
    masked = [_masked(t) for t in texts]
    kept: list[int] = []
    for i, (name, _) in enumerate(ctes):
        pattern = re.compile(rf"(?<![\w.`]){re.escape(name)}(?![\w`])", re.IGNORECASE)
        where = [(j, m) for j in range(i + 1, len(texts)) for m in pattern.finditer(masked[j])]
        if len(where) != 1:
            kept.append(i)
            continue
        j, m = where[0]
        if not _BEFORE_ITEM.search(masked[j][:m.start()]) or not _AFTER_ITEM.match(masked[j], m.end()):
            kept.append(i)
            continue
        texts[j] = f"{texts[j][:m.start()]}({texts[i]}) AS {name}{texts[j][m.end():]}"
        masked[j] = f"{masked[j][:m.start()]}({masked[i]}) AS {name}{masked[j][m.end():]}"
    return [(ctes[i][0], texts[i]) for i in kept], texts[-1]
