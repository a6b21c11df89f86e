"""Assembling a query's result for a chunk: from the rows Spark returns to a :class:`ChunkResult`.

The last of the three parts of a chunk's evaluation (worker/load_chunk.py loads the chunk into
Spark, worker/evaluate.py builds and runs the query's statement): the output schema, the rows
per instant in order with their failure (the first failing instant and its site, SEMANTICS §8),
string keys decoded from their dictionary codes, the new running state, and the one-line error of
a query that failed, with the line between a query's failure and the machinery's
(:func:`is_infrastructure_error`: the chunk is retried, not reported).
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import ARROW_TYPES
from strata.chunking.model import ChunkResult, LegacyMode, QueryChunk
from strata.errors import one_line
from strata.mlscql import ast as A
from strata.mlscql.analyze import CompiledQuery

from .windows import ERR, TAU

__all__ = ["EngineError", "result_schema", "describe_error", "is_infrastructure_error", "chunk_result", "Assembly",
           "LEVEL", "PART"]

LEVEL = "level"
#: the column of a STATE statement's rows telling output rows (0) from the new state's (1)
PART = "_part"


class EngineError(ValueError):
    """A chunk that cannot be evaluated (inconsistent with its query)."""


def result_schema(cq: CompiledQuery) -> pa.Schema:
    """Arrow schema of ``ChunkResult.rows`` for ``cq``: ts, level, then the outputs."""
    fields = [pa.field("ts", pa.int64()), pa.field(LEVEL, pa.string())]
    fields += [pa.field(o.name, ARROW_TYPES[o.type]) for o in cq.outputs]
    return pa.schema(fields)


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
    return one_line(text, limit)


def chunk_result(chunk: QueryChunk, mode: LegacyMode, rows: pa.Table, state, failure, seconds: float,
                 batched: int = 0) -> ChunkResult:
    """The :class:`ChunkResult` of one query's evaluation of ``chunk``: its rows, its new state (STATE
    queries), or its failure ``(error_ts, reason)``; ``stats`` say how it went."""
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


class Assembly:
    """The output side of a run (worker/evaluate.py's :class:`~strata.worker.evaluate.SelectRun`,
    and of a compound query's): Spark's rows → (the chunk's output rows, failure), and the new
    state.  Reads the run's ``cq``, ``q``, ``instants``, ``sites`` (failure sites by code) and
    ``coded`` (string keys sent as dictionary codes, worker/load_chunk.py)."""

    def _rows_only(self, tbl: pa.Table):
        rows, failure = self._finish(tbl)
        return rows, None, failure

    def _state_result(self, tbl: pa.Table, names: list[str]):
        part = tbl.column(PART)
        rows, failure = self._finish(tbl.filter(pc.equal(part, 0)))
        if failure is not None:
            return rows, None, failure
        new_state = tbl.filter(pc.equal(part, 1)).select([f"s_{c}" for c in names]).rename_columns(names)
        return rows, new_state.combine_chunks(), None

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
