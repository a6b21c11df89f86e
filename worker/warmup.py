"""Warming a worker's Spark session before it reports ready, so the first user chunk is not the
JVM's first: representative chunks of the shapes real chunks take (also what the CDS archive
records, worker/spark.py)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pyarrow as pa

from strata.arrowio import ARROW_TYPES
from strata.chunking.model import QueryChunk
from strata.chunking.prune import prune_query_chunk
from strata.mlscql import compile_query

from .engine import describe_error
from .shared import SharedExecutor

__all__ = ["warm_up", "prepare", "WARMUP_SECONDS"]

log = logging.getLogger("strata.worker")


#: seconds of warm-up chunks before the worker reports ready (the first step always runs;
#: ``STRATA_WARMUP_SECONDS``).  3 s rather than 6 s: a 2-worker replay's start-up 2.3 s shorter (and
#: 4 s of CPU less) for its first jobs ~0.08 s slower (1 M-tuple replay, 2 jobs per run)
WARMUP_SECONDS = 3.0


def _warm_queries(config, level: str) -> list[tuple[str, object]]:
    """(kind, compiled query) of the shapes real chunks take, over the config's first stream
    that has a numeric attribute: ROWS aggregate, grouped aggregate, ISTREAM selection and
    self-join (small, pruned chunks: the interpreted session, several queries in one
    statement), RANGE grouped aggregate over many instants (the code-generating session and
    the pre-aggregation) and an unbounded aggregate (running state)."""
    for stream in config.streams.values():
        if stream.relation:  # the shapes below are windows over a stream
            continue
        num = next((c for c, t in stream.columns if t == "double"), None) or \
            next((c for c, t in stream.columns if t in ("long", "timestamp")), None)
        if num is None:
            continue
        key = next((c for c, t in stream.columns if t == "string"), None) or \
            next((c for c, t in stream.columns if c != num), num)
        s = stream.name
        texts = [
            ("small", f"SELECT AVG({num}) FROM {s} [ROWS 100]"),
            ("small", f"SELECT {key}, AVG({num}) FROM {s} [ROWS 100] GROUP BY {key}"),
            ("small", f"SELECT {key}, {num} FROM {s} [ROWS 100] WHERE {num} > 0"),
            ("small", f"SELECT a.{key}, a.{num}, b.{num} FROM {s} [ROWS 10] a, {s} [ROWS 10] b "
                      f"WHERE a.{key} = b.{key}"),
            ("range", f"SELECT {key}, COUNT(*), AVG({num}) FROM {s} [RANGE 10 SECONDS] GROUP BY {key}"),
            ("state", f"SELECT {key}, COUNT(*), SUM({num}) FROM {s} GROUP BY {key}"),
        ]
        out = []
        for kind, text in texts:
            try:
                out.append((kind, compile_query(text, config, level)))
            except Exception:  # noqa: BLE001 - e.g. a key type the query cannot group by
                continue
        return out
    return []


def _warm_table(stream, level: str, instants: list[int], per_instant: int, seed: int):
    """``per_instant`` synthetic tuples of ``stream`` at ``level`` for each instant."""
    rng = np.random.default_rng(seed)
    ts = np.repeat(np.asarray(instants, dtype=np.int64), per_instant)
    n = len(ts)
    cols = {"_seq": pa.array(np.arange(n, dtype=np.int64)), "ts": pa.array(ts), "level": pa.array([level] * n)}
    for name, typ in stream.columns:
        if typ == "string":
            arr = pa.array(np.char.add("k", rng.integers(0, 50, n).astype(str)))
        elif typ == "double":
            arr = pa.array(rng.normal(100.0, 10.0, n))
        elif typ in ("long", "timestamp"):
            arr = pa.array(rng.integers(0, 1000, n))
        else:
            arr = pa.array(rng.random(n) < 0.5)
        cols[name] = arr.cast(ARROW_TYPES[typ])
    return pa.table(cols)


#: the instants of the warm-up's first round start here (round k at k times it)
_BASE = 1000


def _batch_table(stream, lv, base: int):
    """The first step's chunk: one legacy instant of 100 tuples, then three of 300."""
    return _seq(_warm_table(stream, lv, [base], 100, seed=base),
                _warm_table(stream, lv, [base + 1, base + 2, base + 3], 300, seed=base + 1))


def _own_queries(config, level: str, texts) -> list:
    """The compiled ``texts`` (the queries a run will register, when it knows them: ``strata worker
    --warm-queries``) that the warm-up can evaluate: windows over streams only (a text that does not
    compile, or reads a stored relation, is left out: the user's registration names its error)."""
    out = []
    for text in texts or ():
        try:
            cq = compile_query(text, config, level)
        except Exception:  # noqa: BLE001 - refused at registration, with its own message
            continue
        if all(not config.streams[it.stream].relation for it in cq.items):
            out.append(cq)
    return out


def prepare(config, level: str, own: list[str] | tuple = ()) -> dict | None:
    """The warm-up's Python side (compiling its queries, the first step's table), which needs no
    Spark: a worker does it while its JVM starts (worker/server.py).  ``own``: the texts of the
    queries the run will register, if known (then only their shapes are warmed).  None: nothing to warm."""
    lv = config.lattice.parse(level)
    mine = _own_queries(config, level, own)
    if mine:  # only their shapes are warmed (warm_up): no generic query to compile, no table to build
        return {"queries": [], "stream": None, "lv": lv, "own": mine, "first": None}
    queries = _warm_queries(config, level)
    if not queries:
        return None
    stream = config.streams[queries[0][1].items[0].stream]
    return {"queries": queries, "stream": stream, "lv": lv, "own": [], "first": _batch_table(stream, lv, _BASE)}


#: tuples per instant of the warm-up's chunk for a run's own RANGE query (34 instants: 204 k rows).  The
#: JIT compiles a large unit's hot loops only after enough rows: after a 34 k-row step the first 1.18 M-row
#: unit of a 1 M replay took 2.0-2.3 s, after this one 1.3-1.4 s (the second and later 1.2-1.6 s), for
#: no longer a warm-up (4.4-4.5 s against the default's 4.5-5.0 s: bench/NOTES.md)
_OWN_RANGE_PER_INSTANT = 6000


def _own_steps(engine, executor, config, own: list, lv) -> list:
    """Warm-up steps for the run's own queries, in the shapes their chunks take: those with RANGE
    windows one at a time (25 evaluated instants after 9 legacy ones: the code-generating session and
    the pre-aggregation, at a size the JIT compiles), those with unbounded windows one at a time (5
    instants, a running state), the others together through the shared executor as real chunks go
    (one legacy instant, three new)."""
    def kinds(cq):
        return {f.window.kind for f in cq.query.from_}

    def tables(cq, ins, per, seed):
        return [_warm_table(config.streams[it.stream], lv, ins, per, seed=seed + j) for j, it in enumerate(cq.items)]

    def alone(k, cq, kind):
        def step(base):
            if kind == "range":
                ins, evals, prev = list(range(base + 300, base + 334)), list(range(base + 309, base + 334)), base + 308
                items = tables(cq, ins, _OWN_RANGE_PER_INSTANT, base + 10 + 7 * k)
            else:
                ins = evals = list(range(base + 400, base + 405))
                prev, items = None, tables(cq, ins, 200, base + 10 + 7 * k)
            engine.run(cq, QueryChunk(f"own{k}", -1, items, evals, prev_instant=prev))
        return step

    together = {f"own{k}": cq for k, cq in enumerate(own) if not kinds(cq) & {"range", "unbounded"}}

    def batch(base):
        made = {}
        for cq in together.values():
            for it in cq.items:
                if it.stream not in made:
                    made[it.stream] = _batch_table(config.streams[it.stream], lv, base + 500)
        chunks = [prune_query_chunk(cq, QueryChunk(qid, -1, [made[it.stream] for it in cq.items],
                                                   [base + 501, base + 502, base + 503], prev_instant=base + 500))
                  for qid, cq in together.items()]
        executor.run(together, chunks)

    steps = [batch] if together else []
    steps += [alone(k, cq, "range") for k, cq in enumerate(own) if "range" in kinds(cq)]
    steps += [alone(k, cq, "state") for k, cq in enumerate(own) if "unbounded" in kinds(cq) and "range" not in kinds(cq)]
    return [_tolerant(s) for s in steps]


def _tolerant(step):
    """``step``, whose failure (a query of the run's that the engine refuses) is logged and ends only
    itself: the other steps still warm the session."""
    def run(base):
        try:
            step(base)
        except Exception as e:  # noqa: BLE001 - the real chunk reports the query's own error
            log.warning("warm-up step for the run's queries failed: %s", describe_error(e))
    return run


def warm_up(engine, config, level: str, budget: float | None = None, rounds: int | None = None,
            prepared: dict | None = None) -> dict:
    """Evaluate representative chunks so the first real chunk is not the JVM's first: the JIT,
    class loading and generated code are then warm for the paths real chunks take
    (``createDataFrame`` from Arrow, the statement shapes of ROWS/RANGE/aggregate/join/state
    queries, shared plans and several queries in one statement, ``toArrow``).

    When the worker knows the queries the run will register (``prepare(own=...)``, ``strata worker
    --warm-queries``: an embedded run's), the steps are chunks of those shapes only
    (:func:`_own_steps`).  Otherwise, in order of how much they buy: the small queries' chunk of
    three instants through
    the shared executor (the JVM's first statement pays most of the cold cost), a RANGE chunk of
    25 instants (code generation, pre-aggregation), a running state, each small query alone on
    one instant; then again on other instants.  Every shape comes before any repeat.  The first
    step always runs; the next ones while less than ``budget`` seconds (default ``STRATA_WARMUP_SECONDS``, else
    :data:`WARMUP_SECONDS`; negative: no warm-up at all) have passed, and at most ``rounds``
    times through all steps.  On the shared 2-core VM the first step alone now takes 5-6 s, so
    with the default budget the later shapes are not warmed before ready (the RANGE step would
    make the first code-generated chunk 0.6-0.9 s cheaper for ~1 s more start-up; warming them in
    the background after ready was tried and slowed replays: bench/NOTES.md).  Never fatal.
    Returns what it did."""
    if budget is None:
        budget = float(os.environ.get("STRATA_WARMUP_SECONDS", WARMUP_SECONDS))
    t0 = time.perf_counter()
    done = {"steps": 0, "rounds": 0, "seconds": 0.0, "first_step": None}
    if budget < 0:
        return done
    try:
        prepared = prepared or prepare(config, level)
        if prepared is None:
            return done
        queries, stream, lv = prepared["queries"], prepared["stream"], prepared["lv"]
        executor = SharedExecutor(engine, config, enabled=True)
        own = _own_steps(engine, executor, config, prepared["own"], lv)
        small = {f"w{k}": cq for k, (kind, cq) in enumerate(queries) if kind == "small"}

        def batch(base):
            table = prepared["first"] if base == _BASE else _batch_table(stream, lv, base)
            chunks = [prune_query_chunk(cq, QueryChunk(qid, -1, [table] * len(cq.items), [base + 1, base + 2, base + 3],
                                                       prev_instant=base)) for qid, cq in small.items()]
            executor.run(small, chunks)

        def alone(qid, cq):
            def step(base):
                one = _seq(_warm_table(stream, lv, [base + 3], 100, seed=base + 2),
                           _warm_table(stream, lv, [base + 4], 300, seed=base + 3))
                engine.run(cq, prune_query_chunk(cq, QueryChunk(qid, -1, [one] * len(cq.items), [base + 4],
                                                                prev_instant=base + 3)))
            return step

        def ranged(cq):
            def step(base):
                t = _warm_table(stream, lv, list(range(base + 100, base + 134)), 1000, seed=base + 4)
                engine.run(cq, QueryChunk("range", -1, [t], list(range(base + 109, base + 134)),
                                          prev_instant=base + 108))
            return step

        def state(cq):
            def step(base):
                t = _warm_table(stream, lv, list(range(base + 200, base + 205)), 200, seed=base + 5)
                engine.run(cq, QueryChunk("state", -1, [t], list(range(base + 200, base + 205))))
            return step

        # the run's own shapes when known (then prepare made no generic query), else the generic ones
        steps = own + ([batch] if small else []) + [ranged(cq) for kind, cq in queries if kind == "range"]
        steps += [state(cq) for kind, cq in queries if kind == "state"]
        steps += [alone(q, cq) for q, cq in small.items()]
        while True:
            base = _BASE * (done["rounds"] + 1)
            for step in steps:
                step(base)
                done["steps"] += 1
                elapsed = time.perf_counter() - t0
                if done["first_step"] is None:
                    done["first_step"] = round(elapsed, 3)
                if elapsed >= budget:
                    break
            else:
                done["rounds"] += 1
                if rounds is None or done["rounds"] < rounds:
                    continue
            break
    except Exception as e:  # noqa: BLE001 - never fatal: the first real chunk just pays the cost
        log.warning("warm-up failed: %s", e)
    done["seconds"] = round(time.perf_counter() - t0, 3)
    return done


def _seq(legacy, new):
    """``legacy`` then ``new`` as one item table with increasing ``_seq``."""
    t = pa.concat_tables([legacy, new])
    return t.set_column(0, "_seq", pa.array(np.arange(t.num_rows, dtype=np.int64)))
