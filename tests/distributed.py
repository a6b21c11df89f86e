"""A query set through the real master data path and Spark workers, in one process.

:func:`run_distributed` is what the differential tests compare with the reference:
the master's pipeline (shepherd, chunker with legacy windows, ROWS pruning as on the
wire) cuts the input into chunks, each chunk runs on one of several
:class:`~strata.worker.shared.SharedExecutor` instances (the worker's evaluation,
shared plans included), results come back in a random order, and per query they
are assembled like the master does: in chunk order, and a query *stops* at its
first result carrying an error, keeping that result's rows before ``error_ts``.
The assembly is written here from the ChunkResult contract, not taken from the
master, so the master's merge is not what is being trusted.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pyarrow as pa
from hypothesis import strategies as st

from strata.chunking.model import Chunk, ChunkResult
from strata.master.local import cut_chunks

from .reference.evaluator import compare_results, evaluate_outcome
from .strategies import multistream, queries
from .tables import inputs_of, rows_of

__all__ = ["Output", "run_distributed", "assert_reference", "assert_outcome", "drawn_run", "draw_case", "released",
           "executors_of", "check_examples", "Evaluated"]


@dataclass
class Output:
    """One query's distributed output: rows (ts, level, cols...) and its failure, if any."""

    rows: list[tuple] = field(default_factory=list)
    error_ts: int | None = None
    error: str | None = None


def run_distributed(config, level: str, texts: list[str], inputs: dict[str, pa.Table], executors: list,
                    chunk_instants: int = 1, rnd: random.Random | None = None, prune: bool = False,
                    incremental: bool = False, principal: tuple | None = None,
                    switches: tuple = ()) -> dict[str, Output]:
    """Outputs per query id (``q1``, ``q2``… in the order of ``texts``).

    ``principal``: (user, roles) every query is registered for (security punctuations in ``inputs``
    under ``strata.punctuations.STREAM`` decide for it); ``switches``: (query index, stream, off
    from, on again or None), set before any input, applied by the pipeline (the initial switch)
    and, as the master does on release, to the assembled rows (the terminal switch).

    ``executors``: SharedExecutors (one per simulated worker); each chunk goes to a random
    one.  ``incremental``: chunks are cut one at a time and each result is confirmed before
    the next is cut (running states travel between chunks, as in a live cluster); else all
    chunks are cut first and complete in a random order.
    """
    rnd = rnd or random.Random(0)
    p, ids, chunks = _setup(config, level, texts, inputs, chunk_instants, incremental, principal, switches)
    results: dict[int, list[ChunkResult]] = {}
    order: list[Chunk] = []

    def evaluate(chunk: Chunk) -> list[ChunkResult]:
        if prune:  # what the master's dispatch sends on the wire (ROWS windows pruned)
            from strata.chunking.prune import prune_chunk

            chunk = prune_chunk(chunk, p.queries)
        ex = executors[rnd.randrange(len(executors))]
        res = ex.run(p.queries, chunk.queries)
        for qc, r in zip(chunk.queries, res):
            assert r.query_id == qc.query_id and r.chunk_id == chunk.chunk_id
            if r.error is not None:
                _check_error_result(qc, r)
        return res

    if incremental:
        last = max((int(t.column("ts").to_numpy().max()) for t in inputs.values() if t is not None and t.num_rows),
                   default=0)
        for upto in range(0, last + chunk_instants + 1, chunk_instants):
            for chunk in p.advance(upto):
                results[chunk.chunk_id] = evaluate(chunk)
                order.append(chunk)
                for r in results[chunk.chunk_id]:
                    if r.error is None:
                        p.chunker.confirm(r)
        for chunk in p.finish():
            results[chunk.chunk_id] = evaluate(chunk)
            order.append(chunk)
    else:
        shuffled = list(chunks)
        rnd.shuffle(shuffled)  # out-of-order completion
        for chunk in shuffled:
            results[chunk.chunk_id] = evaluate(chunk)
        order = chunks
    return _assemble(order, results, ids, p.terminal if switches else None)


def _setup(config, level, texts, inputs, chunk_instants, incremental, principal=None, switches=()):
    if not incremental and principal is None and not switches:
        return cut_chunks(config, level, texts, inputs, chunk_instants)
    from strata.master.pipeline import QueryPipeline

    p = QueryPipeline(config, level, chunk_instants=chunk_instants)
    ids = [p.add_query(q, principal=principal)[0] for q in texts]
    for i, stream, off, on in switches:
        p.switch(ids[i], (principal or ("",))[0], stream, False, off)
        if on is not None:
            p.switch(ids[i], (principal or ("",))[0], stream, True, on)
    for stream, table in inputs.items():
        if table is not None and table.num_rows:
            p.ingest(stream, table)
    return p, ids, ([] if incremental else p.finish())


def _check_error_result(qc, r: ChunkResult) -> None:
    """The ChunkResult contract for a failed query."""
    assert isinstance(r.error, str) and r.error and "\n" not in r.error, r.error
    assert r.state is None and r.state_upto is None
    assert r.error_ts in [int(t) for t in qc.instants], (r.error_ts, qc.instants)
    ts = r.rows.column("ts").to_pylist() if r.rows.num_rows else []
    assert all(t < r.error_ts for t in ts), "rows at or after error_ts"


def _assemble(order: list[Chunk], results: dict[int, list[ChunkResult]], ids: list[str],
              terminal=None) -> dict[str, Output]:
    out = {qid: Output() for qid in ids}
    stopped: set[str] = set()
    for chunk in sorted(order, key=lambda c: c.chunk_id):
        for r in results[chunk.chunk_id]:
            if r.query_id in stopped or r.query_id not in out:
                continue
            o = out[r.query_id]
            rows = rows_of(r.rows if terminal is None else terminal(r.query_id, r.rows))
            if r.error is not None:
                o.rows += [row for row in rows if row[0] < r.error_ts]
                o.error_ts, o.error = r.error_ts, r.error
                stopped.add(r.query_id)
            else:
                o.rows += rows
    return out


def released(core, regs) -> dict[str, Output]:
    """What a :class:`~strata.master.core.MasterCore` released per registered query (every one of them
    ended): its rows, and where it failed, the failing instant and the reason."""
    out = {}
    for r in regs:
        info = core.queries[r.query_id]
        assert info.ended, (r.query_id, info.state)
        out[r.query_id] = Output([row for rel in info.results for row in rows_of(rel.rows)],
                                 info.revoked_after + 1 if info.state == "failed" else None, info.error)
    return out


def assert_outcome(text: str, config, level: str, streams: dict[str, list[dict]], actual: Output):
    """One query's distributed outcome on ``streams`` equals the reference evaluation's: the same failing
    instant, if any (the reasons' wording may differ), and the same rows before it.  Returns the
    reference's outcome."""
    expected = evaluate_outcome(text, config, level, streams)
    assert actual.error_ts == expected.error_ts, (
        f"{text}: fails at {actual.error_ts} ({actual.error}); "
        f"the reference fails at {expected.error_ts} ({expected.error})")
    compare_results(actual.rows, expected.rows)
    return expected


def assert_reference(config, level: str, texts: list[str], streams: dict[str, list[dict]],
                     out: dict[str, Output]) -> None:
    """Every query's distributed output (``out["q1"]``... for ``texts`` in order, as ``run_distributed``
    and :func:`released` name them) equals the reference evaluation (:func:`assert_outcome`)."""
    for i, text in enumerate(texts):
        assert_outcome(text, config, level, streams, out[f"q{i + 1}"])


def draw_case(data, config, n_queries: int, extremes: float = 0.0, **stream_kw):
    """A level, ``n_queries`` random queries at it and random streams of ``config`` (``extremes``: the
    fraction of examples whose 64-bit values lie near the limits; then the queries carry overflow-prone
    arithmetic too).  ``stream_kw``: more of :func:`~tests.strategies.multistream`'s settings."""
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    texts = [data.draw(queries(config, level, extremes=extremes > 0), label=f"query{i}") for i in range(n_queries)]
    streams = data.draw(multistream(config, extremes=extremes, **stream_kw), label="streams")
    return level, texts, streams


def executors_of(engines, config, n: int = 2, sharing: bool | None = None) -> list:
    """The first ``n`` of the engines fixture's Spark engines for ``config`` as workers' shared executors
    (``sharing``: on or off; ``None``: as the config says)."""
    from strata.worker.shared import SharedExecutor

    return [SharedExecutor(e, config, enabled=sharing) for e in engines[id(config)][:n]]


def drawn_run(data, config, level: str, texts: list[str], streams: dict[str, list[dict]], engines: list,
              prune: bool = True) -> dict[str, Output]:
    """``run_distributed`` with hypothesis-drawn settings: chunks of 1-3 instants, 1-3 of ``engines``
    as workers, sharing on or off, a seed for the completion order, cut incrementally (running
    states between chunks) or not, and with ``prune`` ROWS pruning as on the wire or not."""
    from strata.worker.shared import SharedExecutor

    k = data.draw(st.integers(1, 3), label="chunk_instants")
    n = data.draw(st.integers(1, 3), label="workers")
    executors = [SharedExecutor(e, config, enabled=data.draw(st.booleans(), label="sharing")) for e in engines[:n]]
    return run_distributed(config, level, texts, inputs_of(config, streams), executors, chunk_instants=k,
                           rnd=random.Random(data.draw(st.integers(0, 2**32), label="seed")),
                           incremental=data.draw(st.booleans(), label="incremental"),
                           prune=prune and data.draw(st.booleans(), label="prune"))


class Evaluated:
    """Wraps a test's executors so that a unit equal to one they already evaluated is not evaluated again:
    the same queries (ids, texts, levels, rewritten texts and plans) and, per query, the same chunk id,
    instants, previous instant, state and item tables (``pa.Table.equals``, schemas and metadata included) get the
    earlier results (copies).  Any difference, however small, evaluates the unit.  ``hits``: units answered
    so.  (The engine keeps nothing between calls, so a unit's results are a function of the unit.)"""

    def __init__(self):
        self.units: list[tuple[tuple, list, list[ChunkResult]]] = []
        self.hits = 0

    def wrap(self, executors: list) -> list:
        return [_Remembering(self, ex) for ex in executors]

    @staticmethod
    def _key(queries, chunks) -> tuple:
        out = []
        for qc in chunks:
            cq = queries[qc.query_id]
            out.append((qc.query_id, cq.text, cq.level, cq.rewritten, cq.query, qc.chunk_id,
                        tuple(int(t) for t in qc.instants), qc.prev_instant, qc.state_upto, qc.state is None,
                        len(qc.items)))
        return tuple(out)

    @staticmethod
    def _tables(chunks) -> list[pa.Table]:
        return [t for qc in chunks for t in ([] if qc.state is None else [qc.state]) + list(qc.items)]

    def run(self, ex, queries, chunks) -> list[ChunkResult]:
        key, tables = self._key(queries, chunks), self._tables(chunks)
        for k, ts, results in self.units:
            if k == key and all(a.equals(b, check_metadata=True) for a, b in zip(ts, tables)):
                self.hits += 1
                return [dataclasses.replace(r) for r in results]
        results = ex.run(queries, chunks)
        self.units.append((key, tables, [dataclasses.replace(r) for r in results]))
        return results


class _Remembering:
    def __init__(self, memo: Evaluated, ex):
        self.memo, self.ex = memo, ex

    def run(self, queries, chunks):
        return self.memo.run(self.ex, queries, chunks)


def check_examples(config, texts: list[str], plain: dict[str, list[dict]], above: dict[str, list[dict]],
                   executors: list, incremental: tuple[int, ...], low: str = "U", high: str = "S") -> None:
    """``texts`` at ``low`` and ``high`` through chunks of 1 and 3 instants and the lengths in
    ``incremental`` on ``executors`` (cut incrementally for the lengths in ``incremental``): at ``low`` on
    ``plain`` and on ``plain`` plus ``above`` (tuples above ``low``), at ``high`` on both together, all
    equal to the reference; and a ``low`` session's output is the same with and without the tuples above
    it.  (Other chunk lengths: the drawn differential tests, chunks of 1-3 instants.)

    The shepherd drops the tuples above ``low`` before anything else sees them, so the ``low`` session's
    units with them are normally exactly those without; a unit equal to one evaluated without them gets
    that evaluation's results (:class:`Evaluated`) instead of the same Spark run twice, and every unit that
    differs in any way is evaluated.  Both outputs are still compared with the reference and each other."""
    with_above = {s: sorted(rows + above.get(s, []), key=lambda r: r["ts"]) for s, rows in plain.items()}
    for level in (low, high):
        for k in sorted({1, 3, *incremental}):
            outs = []
            memo = Evaluated()
            for streams in ((plain, with_above) if level == low else (with_above,)):
                out = run_distributed(config, level, texts, inputs_of(config, streams), memo.wrap(executors),
                                      chunk_instants=k, rnd=random.Random(k), incremental=k in incremental)
                assert_reference(config, level, texts, streams, out)
                outs.append(out)
            if level == low:
                for i, text in enumerate(texts):
                    assert sorted(outs[0][f"q{i + 1}"].rows) == sorted(outs[1][f"q{i + 1}"].rows), text
