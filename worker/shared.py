"""Shared evaluation of a chunk's queries: each shared plan once, results fanned out.

:class:`SharedExecutor` wraps an :class:`~strata.worker.engine.Engine`.  For a
chunk and the compiled queries it carries it

1. asks :func:`strata.sharing.execution.plan_groups` which queries form
   *complete* groups (equal rewritten queries) and which *merged* groups
   (same windows; partial sharing of window/join/select nodes);
2. checks, per chunk, that the members' inputs really are the same tuples
   (a query registered later has seen less of the stream; its chunk then
   differs and it runs on its own);
3. runs the engine once per group (``Engine.run`` unchanged) and derives each
   member's :class:`ChunkResult`: for complete groups a copy under the
   member's query id and column names; for merged groups the member's rows
   (its residual condition column true), projected to its select list, with its
   own R2S applied (ISTREAM/DSTREAM as bag differences between consecutive
   evaluation instants, rows carrying their level).

Each result is still exactly the member's result: filtered by its own window
level sets (the shared windows *are* its windows) and labelled with the lub of
the tuples each row derives from.  ``enabled=False`` evaluates every query on
its own (the comparison baseline).

In a trusted worker (several levels) a level's queries first look for a lower level's output over the
same instants and input (worker/cross_level.py, ``[sharing] across_levels``); what they find is their
result, the rest is evaluated as above, and a level's results are stored for the levels above it.

Failures stay with the failing query.  A merged run that raises or reports a
failure (an overflow in any member's expressions fails the merged relation)
is discarded and its members are evaluated one by one; a complete group whose
representative failed evaluates its other members on their own too.  So only
the members that really fail get error results (``Engine.run``: one line,
``error_ts``, the rows before it), and every other query of the chunk is
evaluated normally.  A merged run without a failure implies that no member
fails: each member's failure sites are evaluated by the merged query on a
superset of the rows (its residual WHERE and HAVING become select items).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.arrowio import same_table
from strata.chunking.model import ChunkResult, QueryChunk
from strata.mlscql import CompiledQuery
from strata.sharing import sharing_enabled
from strata.sharing.execution import MergedPlan, plan_groups

from .assemble import is_infrastructure_error, result_schema
from .cross_level import CrossLevelCache, Residual

__all__ = ["SharedExecutor"]


def _is_suffix(small: pa.Table, big: pa.Table) -> bool:
    if small.num_rows > big.num_rows:
        return False
    if small is big:
        return True
    return same_table(small, big.slice(big.num_rows - small.num_rows))


class SharedExecutor:
    """Evaluates a chunk's queries, sharing what can be shared (see module doc)."""

    def __init__(self, engine, config=None, enabled: bool | None = None, levels=(), across_levels: bool | None = None):
        """``levels``: the levels a trusted worker serves; with two or more and ``across_levels``
        (default ``[sharing] across_levels``) a level's queries may reuse a lower level's outputs
        (worker/cross_level.py)."""
        self.engine = engine
        self.config = config if config is not None else engine.config
        self.enabled = sharing_enabled(self.config) if enabled is None else bool(enabled)
        levels = tuple(levels)
        if across_levels is None:
            across_levels = self.config.sharing.across_levels if len(levels) > 1 else False
        across = len(levels) > 1 and bool(across_levels)
        #: lower levels' outputs a higher level's chunks may reuse (None: not a trusted worker, or off)
        self.cross = CrossLevelCache(self.config.lattice, levels, self.config.instant_seconds) if across else None
        self._plans: dict[tuple, tuple[dict, list[MergedPlan]]] = {}
        self._lock = threading.Lock()
        self.counters: Counter = Counter()

    # -- planning (cached per query set) -----------------------------------------------
    def plans(self, queries: dict[str, CompiledQuery]) -> list[MergedPlan]:
        key = tuple(sorted((qid, id(cq)) for qid, cq in queries.items()))
        with self._lock:
            hit = self._plans.get(key)
        # the cache entry keeps the compiled queries alive, so their ids cannot be reused meanwhile
        if hit is not None and all(hit[0].get(q) is cq for q, cq in queries.items()):
            return hit[1]
        got = plan_groups(queries, self.config.instant_seconds)
        with self._lock:
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = (dict(queries), got)
        return got

    # -- evaluation -----------------------------------------------------------------------
    def run(self, compiled: dict[str, CompiledQuery], chunks: list[QueryChunk]) -> list[ChunkResult]:
        """Results for ``chunks`` (one QueryChunk per query, any order), in the same order."""
        by_id = {qc.query_id: qc for qc in chunks}
        results: dict[str, ChunkResult] = {}
        level = _level_of(compiled, chunks) if self.cross is not None else None
        pending: dict[str, Residual] = {}  # split reuses whose N'' is evaluated with the chunk's other queries
        if level is not None:  # a lower level's outputs first (a miss: evaluated below, never waited for)
            for qc in chunks:
                got = self.cross.lookup(level, compiled[qc.query_id], qc)
                if isinstance(got, Residual):
                    pending[qc.query_id] = got
                elif got is not None:
                    results[qc.query_id] = got
            reused = set(results) | set(pending)
            by_id = {qid: qc for qid, qc in by_id.items() if qid not in pending}
        if self.enabled and len(by_id) > 1:
            present = {qid: compiled[qid] for qid in by_id}
            try:
                plans = self.plans(present)
            except Exception:  # noqa: BLE001 - never worse than not sharing
                self.counters["planning_errors"] += 1
                plans = []
            done: set[str] = set()
            # merged plans first (a complete group takes part through its first member), then
            # complete groups: their first member's result, computed alone or merged, is copied
            for plan in [p for p in plans if p.form == "merged"]:
                self._run_merged(plan, by_id, results, done)
            # complete groups whose representative was evaluated within a merged plan
            for plan in [p for p in plans if p.form == "complete"]:
                self._fan_out_late(plan, compiled, by_id, results)
        # the rest: each query's own statement, all of them evaluated as one Spark statement
        rest = [qc for qc in chunks if qc.query_id not in results and qc.query_id not in pending]
        if rest or pending:
            many = getattr(self.engine, "run_many", None)
            pairs = [(compiled[qc.query_id], qc) for qc in rest]
            pairs += [(compiled[qid], p.chunk) for qid, p in pending.items()]  # N'' of each split reuse
            outs = many(pairs) if many is not None else [self.engine.run(cq, qc) for cq, qc in pairs]
            for qc, r in zip(rest, outs):
                results[qc.query_id] = r
            self.counters["engine_runs"] += len(rest)
            for (qid, p), r in zip(pending.items(), outs[len(rest):]):
                try:
                    got = self.cross.combine(p, r)
                except Exception as exc:  # noqa: BLE001 - never worse than computing it
                    if is_infrastructure_error(exc):
                        raise
                    got = None
                if got is None:  # N'' failed: the query on its own, as without reuse
                    got = self.engine.run(compiled[qid], _own(chunks, qid))
                    self.counters["engine_runs"] += 1
                results[qid] = got
        self.counters["query_chunks"] += len(chunks)
        if level is not None and self.cross.stores(level):  # for the levels above (a fixed rule: always)
            for qc in chunks:
                if qc.query_id not in reused:
                    self.cross.store(level, compiled[qc.query_id], qc, results[qc.query_id])
        return [results[qc.query_id] for qc in chunks]

    def cross_level_stats(self, level: str) -> dict:
        """``level``'s own cross-level reuse counters ({} when reuse is off): never another level's."""
        return {} if self.cross is None else self.cross.stats(level)

    # complete sharing -----------------------------------------------------------------------
    @staticmethod
    def _same_input(a: QueryChunk, b: QueryChunk) -> bool:
        return (list(a.instants) == list(b.instants) and a.prev_instant == b.prev_instant
                and a.state_upto == b.state_upto and same_table(a.state, b.state)
                and len(a.items) == len(b.items)
                and all(same_table(x, y) for x, y in zip(a.items, b.items)))

    def _classes(self, members: list[str], by_id: dict[str, QueryChunk]) -> list[list[str]]:
        classes: list[list[str]] = []
        for qid in members:
            if qid not in by_id:
                continue
            for cls in classes:
                if self._same_input(by_id[cls[0]], by_id[qid]):
                    cls.append(qid)
                    break
            else:
                classes.append([qid])
        return classes

    def _fan_out_late(self, plan: MergedPlan, compiled, by_id, results) -> None:
        for cls in self._classes(plan.members, by_id):
            if len(cls) < 2:
                continue
            head = cls[0]
            if head not in results:
                results[head] = self.engine.run(compiled[head], by_id[head])
                self.counters["engine_runs"] += 1
            src = results[head]
            for qid in cls[1:]:
                if qid in results:
                    continue
                if src.error is not None:  # the representative failed: each member on its own
                    results[qid] = self.engine.run(compiled[qid], by_id[qid])
                    self.counters["engine_runs"] += 1
                    self.counters["complete_fallbacks"] += 1
                    continue
                results[qid] = _retarget(src, qid, compiled[qid])
                self.counters["shared_complete"] += 1

    # merged (partial) sharing ---------------------------------------------------------------
    def _run_merged(self, plan: MergedPlan, by_id, results, done) -> None:
        members = [s for s in plan.specs if s.query_id in by_id and s.query_id not in results]
        if len(members) < 2:
            return
        # members whose chunk inputs agree with the largest one (legacy may differ by R2S)
        base = max((by_id[s.query_id] for s in members), key=lambda qc: qc.num_rows)
        ok = []
        for s in members:
            qc = by_id[s.query_id]
            if (list(qc.instants) == list(base.instants) and qc.prev_instant == base.prev_instant
                    and len(qc.items) == len(base.items)
                    and all(_is_suffix(a, b) for a, b in zip(qc.items, base.items))):
                ok.append(s)
        if len(ok) < 2:
            return
        instants = [int(t) for t in base.instants]
        prev = base.prev_instant
        if plan.none_mode:
            evals, chunk = instants, QueryChunk("__shared__", base.chunk_id, base.items, instants, prev)
        else:
            evals = ([int(prev)] if (plan.diff and prev is not None) else []) + instants
            chunk = QueryChunk("__shared__", base.chunk_id, base.items, evals, None)
        t0 = time.perf_counter()
        try:
            merged = self.engine.run(plan.cq, chunk, isolate=False)
        except Exception as exc:  # noqa: BLE001 - never worse than not sharing
            if is_infrastructure_error(exc):
                raise
            self.counters["merged_fallbacks"] += 1
            return
        self.counters["engine_runs"] += 1
        if merged.error is not None:  # some member fails: evaluate each on its own
            self.counters["merged_fallbacks"] += 1
            self.counters["merged_failures"] += 1
            return
        secs = time.perf_counter() - t0
        rows = merged.rows
        for s in ok:
            out = _derive(rows, s, evals, instants, plan.none_mode)
            stats = dict(merged.stats, shared="merged", shared_with=len(ok), seconds=round(secs / len(ok), 6),
                         rows_out=out.num_rows)
            results[s.query_id] = ChunkResult(s.query_id, base.chunk_id, out, stats=stats)
            done.add(s.query_id)
            self.counters["shared_merged"] += 1


def _own(chunks: list[QueryChunk], qid: str) -> QueryChunk:
    return next(qc for qc in chunks if qc.query_id == qid)


def _level_of(compiled: dict[str, CompiledQuery], chunks: list[QueryChunk]) -> str | None:
    """The level of a chunk's queries (a worker runs a chunk's queries at its master's level)."""
    levels = {compiled[qc.query_id].level for qc in chunks}
    return levels.pop() if len(levels) == 1 else None


def _retarget(src: ChunkResult, qid: str, cq: CompiledQuery) -> ChunkResult:
    rows = src.rows
    schema = result_schema(cq)
    if not rows.schema.equals(schema):
        rows = pa.Table.from_arrays(list(rows.columns), schema=schema)
    stats = dict(src.stats, shared="complete", seconds=0.0)  # computed once, for the source query
    return ChunkResult(qid, src.chunk_id, rows, src.state, src.state_upto, stats,
                       error=src.error, error_ts=src.error_ts)


def _derive(rows: pa.Table, spec, evals: list[int], instants: list[int], none_mode: bool) -> pa.Table:
    """A member's output rows from the merged relation (ts = evaluation instant, level, c0..)."""
    schema = result_schema(spec.cq)
    if spec.flag is not None and rows.num_rows:
        flag = rows.column(2 + spec.flag)
        rows = rows.filter(pc.fill_null(flag, False))
    arrays = [rows.column(0), rows.column(1)] + [rows.column(2 + k) for k in spec.columns]
    t = pa.Table.from_arrays(arrays, schema=schema)
    r2s = spec.cq.r2s
    if none_mode:
        if r2s != "ISTREAM":
            return schema.empty_table()
        return t.combine_chunks()
    if r2s == "RSTREAM":
        if len(evals) != len(instants):
            t = t.filter(pc.is_in(t.column("ts"), value_set=pa.array(instants, pa.int64())))
        return t.combine_chunks()
    return _difference(t, evals, instants, r2s).combine_chunks()


def _codes(col: pa.ChunkedArray) -> np.ndarray:
    arr = col.combine_chunks()
    if pa.types.is_floating(arr.type):
        arr = pc.add(arr, pa.scalar(0.0, arr.type))  # -0.0 and 0.0 are one value (as in EXCEPT ALL)
    enc = pc.dictionary_encode(arr, null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _difference(t: pa.Table, evals: list[int], instants: list[int], r2s: str) -> pa.Table:
    """ISTREAM (R(τ) − R(τ')) or DSTREAM (R(τ') − R(τ)) at each of ``instants``, bag semantics.

    ``t`` holds R at every instant of ``evals`` (ascending; ``evals[0]`` is the
    previous instant when ``evals`` is longer than ``instants``).
    """
    n = t.num_rows
    if n == 0:
        return t
    ev = np.asarray(evals, dtype=np.int64)
    pos = np.searchsorted(ev, t.column("ts").to_numpy())
    cols = [_codes(t.column(i)) for i in range(1, t.num_columns)]  # level and values
    if cols:
        _, gid = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
        gid = gid.reshape(-1).astype(np.int64)
    else:
        gid = np.zeros(n, dtype=np.int64)
    G = int(gid.max()) + 1
    key = pos * G + gid
    order = np.argsort(key, kind="stable")
    skey = key[order]
    uniq, starts, counts = np.unique(skey, return_index=True, return_counts=True)

    def count_of(k: np.ndarray) -> np.ndarray:
        i = np.searchsorted(uniq, k)
        i2 = np.minimum(i, len(uniq) - 1)
        found = (i < len(uniq)) & (uniq[i2] == k)
        return np.where(found, counts[i2], 0)

    offset = len(evals) - len(instants)  # 1 when evals starts with the previous instant
    take: list[np.ndarray] = []
    new_ts: list[np.ndarray] = []
    upos, ugid = uniq // G, uniq % G
    if r2s == "ISTREAM":
        # rows at position p (an output instant) minus rows of the same group at p-1
        other = np.where(upos >= 1, count_of((upos - 1) * G + ugid), 0)
        extra = counts - other
        sel = (extra > 0) & (upos >= offset)
        for s, e in zip(starts[sel], extra[sel]):
            take.append(order[s:s + e])
        rows = np.concatenate(take) if take else np.empty(0, dtype=np.int64)
        out = t.take(pa.array(rows, pa.int64()))
        return out.sort_by([("ts", "ascending")]) if out.num_rows > 1 else out
    # DSTREAM at position p+1: rows of position p whose group has fewer copies at p+1
    nxt = upos + 1
    valid = nxt < len(evals)
    other = np.where(valid, count_of(nxt * G + ugid), 0)
    extra = counts - other
    sel = valid & (extra > 0) & (nxt >= offset)
    for s, e, p in zip(starts[sel], extra[sel], nxt[sel]):
        take.append(order[s:s + e])
        new_ts.append(np.full(e, ev[p], dtype=np.int64))
    if not take:
        return t.slice(0, 0)
    rows = np.concatenate(take)
    out = t.take(pa.array(rows, pa.int64()))
    out = out.set_column(0, out.schema.field(0), pa.array(np.concatenate(new_ts), pa.int64()))
    return out.sort_by([("ts", "ascending")]) if out.num_rows > 1 else out

