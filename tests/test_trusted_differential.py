"""The trusted architecture does not change the answer (docs/trusted.md, issue 33): trusted == replicated ==
the reference, for random query sets at several levels over random input of every level.

Both architectures run through the real master parts in one process: the trusted master's level
pipelines (:func:`strata.master.trusted.build_levels`, a :class:`~strata.master.core.MasterCore` per
level, each fed the same labelled input: its shepherd keeps what its level dominates) dispatch their
units exactly as the dispatch loop does (ROWS pruning, the codec, a query spec per query at the
pipeline's level) to

* **trusted**: ONE worker core trusted for every level (``WorkerCore(levels=...)``), the units of all
  levels interleaved in a random order and completed out of order;
* **replicated**: a worker core of each level alone, each level's units on its own.

Every query's output (rows, failing instant and reason) must be the same in both, and equal the
independent reference evaluator's at the query's level.  Sharing on and off, chunks of 1-3 instants,
cut all at once or incrementally (running states between chunks).  ``STRATA_TRUSTED_EXAMPLES`` sets the
examples of the default run (4); the ``slow`` variant runs more (25, or that many times 6).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.chunking.codec import decode_result, encode_chunk
from strata.chunking.prune import prune_chunk
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.trusted import build_levels
from strata.trusted import top_of
from strata.worker.engine import Engine
from strata.worker.service import QuerySpecData, WorkerCore

from .conftest import LEDGER_TOML
from .distributed import assert_outcome, released
from .strategies import example_settings, multistream, queries
from .tables import inputs_of

pytestmark = pytest.mark.spark

EXAMPLES, SETTINGS = example_settings("STRATA_TRUSTED_EXAMPLES", 4)
SLOW_EXAMPLES = max(25, 6 * EXAMPLES)
#: units go out at once (no lingering for more input: the driver below has no clock to wait on)
NO_LINGER = "\n[cluster]\ndispatch_linger = false\n"


@pytest.fixture(scope="module")
def configs(spark):
    """The battlefield and ledger deployments, each with four Spark engines (workers) of the test session."""
    out = []
    for text in (BATTLEFIELD_TOML, LEDGER_TOML):
        cfg = parse_config(text + NO_LINGER)
        out.append((cfg, [Engine(spark, cfg) for _ in range(4)]))
    return out


def execute(core, chunk, worker) -> list:
    """One unit through a worker core as the dispatch loop sends it (master/dispatch_loop.py ``_send``)."""
    specs = [QuerySpecData(qc.query_id, core.queries[qc.query_id].text, core.level)
             for qc in chunk.queries if qc.query_id in core.queries]
    body = encode_chunk(prune_chunk(chunk, dict(core.pipeline.queries)))
    return [decode_result(b) for b in worker.execute(core.level, specs, body)]


def drain(cores: dict, worker_of, rnd: random.Random) -> None:
    """Dispatch until every cut chunk is released: each round the levels' units are taken in a random
    order (each level within its own slots on the one worker ``w``), evaluated, and some of all that is in
    flight completes, in a random order."""
    for core in cores.values():
        core.heartbeat("w", 0.0, slots=2)
    flight: list = []
    while True:
        for lv in rnd.sample(sorted(cores), len(cores)):
            core = cores[lv]
            for chunk, sid in core.assignments():
                flight.append((core, chunk, sid, execute(core, chunk, worker_of(lv))))
        if not flight:
            stuck = {lv: len(c.pipeline.chunks) for lv, c in cores.items() if c.pipeline.chunks}
            assert not stuck, f"chunks cut and never dispatched: {stuck}"
            return
        rnd.shuffle(flight)
        k = rnd.randint(1, len(flight))
        for core, chunk, sid, results in flight[:k]:
            core.on_result(chunk.chunk_id, sid, results, span=(chunk.first_ts, chunk.last_ts))
        del flight[:k]


def run(config, by_level: dict[str, list[str]], inputs, worker_of, k: int, incremental: bool, seed: int) -> dict:
    """Every query's output ((level, i) -> Output) with the level pipelines of a trusted master over ``worker_of``."""
    levels = list(by_level)
    top = top_of(config.lattice, levels)
    parts = build_levels(config, [top, *[lv for lv in levels if lv != top]], users=None, chunk_instants=k)
    cores = {lv: p.core for lv, p in parts.items()}
    regs = {lv: cores[lv].register("u", texts) for lv, texts in by_level.items()}
    rnd = random.Random(seed)
    last = 0
    for stream, table in inputs.items():
        if table is not None and table.num_rows:
            last = max(last, int(table.column("ts").to_numpy().max()))
            for core in cores.values():
                core.ingest_batch(stream, table, None)  # labelled: each level's shepherd keeps what it may
    if incremental:  # instants closed a few at a time, dispatched in between: running states between chunks
        for upto in range(0, last + 1, rnd.randint(1, 3)):
            for core in cores.values():
                core.advance(upto)
            drain(cores, worker_of, rnd)
    for core in cores.values():
        core.advance(finish=True)
    drain(cores, worker_of, rnd)
    out = {}
    for lv, rs in regs.items():
        for i, o in enumerate(released(cores[lv], rs).values()):
            out[(lv, i)] = o
    return out


def check(config, engines, data) -> None:
    lattice = config.lattice
    levels = data.draw(st.lists(st.sampled_from(lattice.levels), min_size=2, max_size=3, unique=True), label="levels")
    levels = lattice.sort(levels)
    # often one text at every level (a lower level's query is valid at the higher ones) and a text twice
    # within a level: the worker's shared plans then meet the same query ids and texts at several levels
    common = data.draw(st.one_of(st.none(), queries(config, levels[0], extremes=True)), label="at every level")
    by_level = {}
    for lv in levels:
        own = [data.draw(queries(config, lv, extremes=True), label=f"query at {lv}")
               for _ in range(data.draw(st.integers(0 if common else 1, 2), label=f"queries at {lv}"))]
        texts = ([common] if common else []) + own
        if data.draw(st.booleans(), label=f"a text twice at {lv}"):
            texts.append(texts[-1])
        by_level[lv] = texts
    streams = data.draw(multistream(config, extremes=0.3), label="streams")
    inputs = inputs_of(config, streams)
    sharing = data.draw(st.booleans(), label="sharing")
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    incremental = data.draw(st.booleans(), label="incremental")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    top = top_of(lattice, levels)
    trusted_worker = WorkerCore(config, top, engines[0], sharing=sharing, levels=levels)
    replicated = {lv: WorkerCore(config, lv, engines[1 + i % 3], sharing=sharing) for i, lv in enumerate(levels)}
    trusted = run(config, by_level, inputs, lambda lv: trusted_worker, k, incremental, seed)
    apart = run(config, by_level, inputs, replicated.__getitem__, k, incremental, seed)
    for (lv, i), out in trusted.items():
        text = by_level[lv][i]
        other = apart[(lv, i)]
        assert (out.error_ts, out.error) == (other.error_ts, other.error), (lv, text)
        assert sorted(out.rows, key=repr) == sorted(other.rows, key=repr), (lv, text)
        assert_outcome(text, config, lv, streams, out)
    # the trusted worker saw each level's chunks checked at that level, and only its own queries' levels
    assert not trusted_worker.refused, dict(trusted_worker.refused)


@SETTINGS
@given(data=st.data())
def test_trusted_equals_replicated_and_reference(configs, data):
    config, engines = configs[data.draw(st.integers(0, 1), label="config")]
    check(config, engines, data)


@pytest.mark.slow
@settings(SETTINGS, max_examples=SLOW_EXAMPLES)
@given(data=st.data())
def test_trusted_equals_replicated_and_reference_longer(configs, data):
    config, engines = configs[data.draw(st.integers(0, 1), label="config")]
    check(config, engines, data)

