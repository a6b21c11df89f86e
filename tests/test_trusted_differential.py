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
cut all at once or incrementally (running states between chunks), cross-level reuse (worker/cross_level.py)
on and off, the levels' units taken in a random order or lowest level first.  With reuse *forced*
(``test_cross_level_reuse_forced``: reusable common texts, lowest level first, input whose higher-level
tuples arrive at the lower level's instants, derandomized; ``test_cross_level_reuse_fixed``: a fixed
example) the trusted worker must actually reuse (hits > 0) and every output must still be the replicated mode's and the
reference's.  ``STRATA_TRUSTED_EXAMPLES`` sets the examples of the default run (4); the ``slow`` variant
runs more (25, or that many times 6).
"""

from __future__ import annotations

import random
from collections import Counter

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


def drain(cores: dict, worker_of, rnd: random.Random, order=None) -> None:
    """Dispatch until every cut chunk is released: each round the levels' units are taken in a random
    order (``order``: in that order of levels, e.g. lowest first, so that a trusted worker meets a lower
    level's chunk before a higher level's over the same instants; each level within its own slots on the
    one worker ``w``), evaluated, and some of all that is in flight completes, in a random order."""
    for core in cores.values():
        core.heartbeat("w", 0.0, slots=2)
    flight: list = []
    while True:
        for lv in (order if order is not None else rnd.sample(sorted(cores), len(cores))):
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


def run(config, by_level: dict[str, list[str]], inputs, worker_of, k: int, incremental: bool, seed: int,
        lowest_first: bool = False) -> dict:
    """Every query's output ((level, i) -> Output) with the level pipelines of a trusted master over ``worker_of``
    (``lowest_first``: each round's units dispatched level by level, from the lowest)."""
    levels = list(by_level)
    top = top_of(config.lattice, levels)
    parts = build_levels(config, [top, *[lv for lv in levels if lv != top]], users=None, chunk_instants=k)
    cores = {lv: p.core for lv, p in parts.items()}
    regs = {lv: cores[lv].register("u", texts) for lv, texts in by_level.items()}
    rnd = random.Random(seed)
    order = config.lattice.sort(levels) if lowest_first else None
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
            drain(cores, worker_of, rnd, order)
    for core in cores.values():
        core.advance(finish=True)
    drain(cores, worker_of, rnd, order)
    out = {}
    for lv, rs in regs.items():
        for i, o in enumerate(released(cores[lv], rs).values()):
            out[(lv, i)] = o
    return out


def check(config, engines, data, forced: bool = False) -> dict:
    """One example; ``forced``: cross-level reuse on, the common text one a higher level can reuse
    (:func:`reusable`) and each round's units dispatched lowest level first.  Returns the trusted
    worker's cross-level counters per level."""
    lattice = config.lattice
    levels = data.draw(st.lists(st.sampled_from(lattice.levels), min_size=2, max_size=3, unique=True), label="levels")
    levels = lattice.sort(levels)
    # often one text at every level (a lower level's query is valid at the higher ones) and a text twice
    # within a level: the worker's shared plans then meet the same query ids and texts at several levels
    if forced:
        common = data.draw(reusable(config, levels[0]), label="at every level")
    else:
        common = data.draw(st.one_of(st.none(), reusable(config, levels[0]), queries(config, levels[0], extremes=True)),
                           label="at every level")
    by_level = {}
    for lv in levels:
        own = [data.draw(queries(config, lv, extremes=True), label=f"query at {lv}")
               for _ in range(data.draw(st.integers(0 if common else 1, 2), label=f"queries at {lv}"))]
        texts = ([common] if common else []) + own
        if data.draw(st.booleans(), label=f"a text twice at {lv}"):
            texts.append(texts[-1])
        by_level[lv] = texts
    streams = data.draw(multistream(config, extremes=0.3), label="streams")
    if forced:  # the higher levels' tuples at the lower level's instants: the levels' chunks then meet
        streams = aligned(config, streams, levels, data)
    sharing = data.draw(st.booleans(), label="sharing")
    k = data.draw(st.integers(1, 3), label="chunk_instants")
    incremental = data.draw(st.booleans(), label="incremental")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    across = True if forced else data.draw(st.booleans(), label="across levels")
    lowest_first = forced or data.draw(st.booleans(), label="lowest first")
    # split reuses with a residual N'' on every chunk (the default) or never (only an empty N'')
    residual_min_rows = None if forced else data.draw(st.sampled_from([None, 10**9]), label="residual min rows")
    return compare(config, engines, by_level, streams, sharing, k, incremental, seed, across, lowest_first,
                   residual_min_rows)


def compare(config, engines, by_level: dict, streams: dict, sharing: bool, k: int, incremental: bool, seed: int,
            across: bool, lowest_first: bool, residual_min_rows: int | None = None) -> dict:
    """Trusted (one worker core, cross-level reuse ``across``) == replicated == the reference for every query;
    returns the trusted worker's cross-level counters per level."""
    lattice = config.lattice
    levels = lattice.sort(by_level)
    inputs = inputs_of(config, streams)
    top = top_of(lattice, levels)
    trusted_worker = WorkerCore(config, top, engines[0], sharing=sharing, levels=levels, across_levels=across)
    if residual_min_rows is not None and trusted_worker.shared.cross is not None:
        trusted_worker.shared.cross.residual_min_rows = residual_min_rows
    replicated = {lv: WorkerCore(config, lv, engines[1 + i % 3], sharing=sharing) for i, lv in enumerate(levels)}
    trusted = run(config, by_level, inputs, lambda lv: trusted_worker, k, incremental, seed, lowest_first=lowest_first)
    apart = run(config, by_level, inputs, replicated.__getitem__, k, incremental, seed)
    for (lv, i), out in trusted.items():
        text = by_level[lv][i]
        other = apart[(lv, i)]
        assert (out.error_ts, out.error) == (other.error_ts, other.error), (lv, text)
        assert sorted(out.rows, key=repr) == sorted(other.rows, key=repr), (lv, text)
        assert_outcome(text, config, lv, streams, out)
    # the trusted worker saw each level's chunks checked at that level, and only its own queries' levels
    assert not trusted_worker.refused, dict(trusted_worker.refused)
    stats = {lv: trusted_worker.shared.cross_level_stats(lv) for lv in levels}
    assert not stats[levels[0]].get("hits"), stats  # the lowest level has nothing below it to reuse
    return stats


def aligned(config, streams: dict, levels: list[str], data) -> dict:
    """``streams`` with the tuples of the lowest level only, each often followed by a copy at a higher level of
    ``levels`` (other values): the higher levels' tuples then arrive at the lower level's instants, so a
    higher chunk's instants are the lower chunk's and its windows hold more levels than the lower's."""
    lattice = config.lattice
    out = {}
    for name, rows in streams.items():
        if config.streams[name].relation:
            out[name] = rows
            continue
        new = []
        for i, row in enumerate(rows):
            if not lattice.leq(row["level"], levels[0]):
                continue
            new.append(row)
            up = data.draw(st.sampled_from([None, *levels[1:]]), label=f"{name} copy {i}")
            if up is not None:
                other = data.draw(st.sampled_from(rows), label=f"{name} values {i}")
                new.append({**other, "ts": row["ts"], "level": up})
        out[name] = new
    return out


@st.composite
def reusable(draw, config, low: str) -> str:
    """A query a higher level's same text may reuse (worker/cross_level.py): a selection over a window whose
    levels do not interact (split: the level sets differ between levels), or any query over an explicit
    level set ``{low}`` (whole: the same node at every level)."""
    stream = draw(st.sampled_from(sorted(n for n in config.streams if not config.streams[n].relation)))
    cols = [c for c, _ in config.stream(stream).columns]
    attrs = draw(st.lists(st.sampled_from(cols), min_size=1, max_size=2, unique=True))
    where = draw(st.sampled_from(["", f" WHERE {attrs[0]} IS NOT NULL"]))
    r2s = draw(st.sampled_from(["ISTREAM", "RSTREAM", "DSTREAM"]))
    if draw(st.integers(0, 3)) == 0:  # whole: an aggregate or a ROWS window over one explicit level
        window = draw(st.sampled_from([f"RANGE 2 seconds level in {{{low}}}", f"ROWS 2 level in {{{low}}}"]))
        select = draw(st.sampled_from(["COUNT(*)", ", ".join(attrs)]))
        return f"SELECT {select} FROM {stream} [{window}]{where}"
    window = draw(st.sampled_from(["RANGE 2 seconds", "NOW", "RANGE UNBOUNDED", "PARTITION BY level ROWS 2",
                                   "RANGE 3 seconds SLIDE 2 seconds", f"ROWS 2 level in {{{low}}}"]))
    return f"{r2s}(SELECT {', '.join(attrs)} FROM {stream} [{window}]{where})"


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



def test_cross_level_reuse_forced(configs):
    """Cross-level reuse on, lower levels' chunks evaluated first over the same instants: the trusted worker
    reuses lower outputs (hits > 0 over the run) and every query's output still equals the replicated
    mode's and the reference's.  A reuse that ignored the level sets (a lower output taken whole for a
    higher window holding more levels) fails here (docs/trusted.md)."""
    hits = Counter()

    # derandomized: the same examples every run, so that "hits > 0" is a fact about the code, not the seed
    @settings(SETTINGS, max_examples=max(4, EXAMPLES), derandomize=True)
    @given(data=st.data())
    def forced(data):
        config, engines = configs[data.draw(st.integers(0, 1), label="config")]
        for counters in check(config, engines, data, forced=True).values():
            hits.update(counters)

    forced()
    print("cross-level counters over the run:", dict(hits))
    assert hits["hits"] > 0, dict(hits)


#: texts a higher level reuses from a lower one at every level of the fixed example below
FIXED_TEXTS = [
    "SELECT sid, bp FROM Vitals [RANGE 2 seconds]",              # split: ISTREAM, a residual at higher levels
    "RSTREAM(SELECT sid FROM Vitals [NOW] WHERE bp > 100)",      # split
    "SELECT bp FROM Vitals [PARTITION BY level ROWS 2]",         # split over a ROWS window by level
    "SELECT COUNT(*), AVG(bp) FROM Vitals [RANGE 3 seconds level in {U}]",  # whole: the same node everywhere
    "SELECT AVG(bp) FROM Vitals [ROWS 2]",                       # never: ROWS over different level sets
]


@pytest.mark.parametrize("sharing", [True, False])
def test_cross_level_reuse_fixed(configs, sharing):
    """A fixed example where reuse certainly happens, whole and split with residual runs: U, C and TS tuples
    at the same instants, the texts above at U, C and TS, lower levels first.  Deterministic, so that a reuse
    ignoring the level sets (a lower output taken as a higher query's whole) fails here every time."""
    config, engines = configs[0]
    rows = []
    for ts in range(0, 7):
        for j, lv in enumerate(("U", "C", "TS", "U", "C")):
            rows.append({"ts": ts, "level": lv, "sid": "abc"[(ts + j) % 3], "bp": 90.0 + 7 * ((ts * 5 + j) % 6),
                         "pr": 60.0 + j})
    streams = {name: [] for name in config.streams}
    streams["Vitals"] = [{c: r.get(c, 0.0) for c in ("ts", "level", *[n for n, _ in config.stream("Vitals").columns])}
                         for r in rows]
    by_level = {lv: list(FIXED_TEXTS) for lv in ("U", "C", "TS")}
    stats = compare(config, engines, by_level, streams, sharing, 2, True, 7, across=True, lowest_first=True,
                    residual_min_rows=0)
    print("cross-level counters (fixed example):", stats)
    assert stats["C"].get("hits_whole") and stats["TS"].get("hits_whole"), stats
    assert stats["C"].get("residual_run") and stats["TS"].get("residual_run"), stats
