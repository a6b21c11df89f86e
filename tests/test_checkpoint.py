"""Master checkpoints (issue 14, item 4): a restart loads the last checkpoint and replays only the log
after it; the log before it is gone.

* the chunker's state, exported at any point and imported into a fresh chunker with the same queries,
  cuts exactly the chunks the original cuts from there on (random queries, input and cut points);
* a master checkpointed at any point and restarted cuts the same chunks, keeps the same queries
  (stopped ones stopped), results and query ids as one restarted from its whole log, and its log
  holds only the events after the checkpoint;
* through real Spark engines: random merges, failures *and* checkpoint-restarts at random points
  give the reference's answer (the differential harness of test_adaptive);
* cadence: ``[limits] checkpoint_rows`` / ``checkpoint_events``, not while a backlog is computed.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata.arrowio import from_ipc, to_ipc
from strata.chunking.chunker import Chunker
from strata.chunking.codec import encode_chunk
from strata.chunking.model import ChunkResult
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.core import MasterCore
from strata.master.store import MasterStore, config_fingerprint
from strata.mlscql import compile_query

from .distributed import assert_reference, executors_of, released
from .strategies import example_settings, multistream, queries
from .tables import inputs_of, rows_of, two_per_instant
from .test_adaptive import _Harness  # test_adaptive's harness, restarted here

EXAMPLES, SETTINGS = example_settings("STRATA_CHECKPOINT_EXAMPLES", 15)


# ---- the chunker alone ------------------------------------------------------------------------------
def _batches(config, streams, rnd):
    """(stream, table) batches and closes in arrival order: a close after some instants."""
    tables = inputs_of(config, streams)
    instants = sorted({r["ts"] for rows in streams.values() for r in rows})
    sent = {s: 0 for s in tables}
    steps = []
    for tau in instants:
        for s, t in tables.items():
            ts = t.column("ts").to_pylist()
            end = sum(1 for x in ts if x <= tau)
            if end > sent[s]:
                steps.append(("push", s, t.slice(sent[s], end - sent[s])))
                sent[s] = end
        if rnd.random() < 0.6:
            steps.append(("close", tau, None))
    steps.append(("finish", None, None))
    return steps


def _case(data, config, max_instants: int):
    """A level, 1-3 random queries at it, random streams, a chunk length and a seeded random source."""
    level = data.draw(st.sampled_from(config.lattice.levels), label="level")
    texts = [data.draw(queries(config, level), label=f"query{i}") for i in range(data.draw(st.integers(1, 3)))]
    streams = data.draw(multistream(config, max_instants=max_instants), label="streams")
    k = data.draw(st.sampled_from([1, 2, 3]), label="chunk_instants")
    return level, texts, streams, k, random.Random(data.draw(st.integers(0, 2**32), label="seed"))


def _stored(meta, tables):
    """Through JSON and Arrow IPC, as a checkpoint stores them."""
    return json.loads(json.dumps(meta)), {k: from_ipc(to_ipc(t), max_bytes=None) for k, t in tables.items()}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_an_imported_chunker_cuts_what_the_original_cuts(battlefield, data):
    config = battlefield
    level, texts, streams, k, rnd = _case(data, config, max_instants=8)
    compiled = {f"q{i + 1}": compile_query(t, config, level) for i, t in enumerate(texts)}
    steps = _batches(config, streams, rnd)
    at = data.draw(st.integers(0, len(steps)), label="checkpoint after step")

    def run(chunker, part):
        out = []
        for kind, a, b in part:
            if kind == "push":
                chunker.push(a, b)
            else:
                out += chunker.close(a) if kind == "close" else chunker.finish()
        return [encode_chunk(c) for c in out]

    original = Chunker(config, compiled, chunk_instants=k)
    run(original, steps[:at])
    meta, tables = _stored(*original.export_state())
    restored = Chunker(config, compiled, chunk_instants=k)
    restored.import_state(meta, tables)
    assert restored.stats() == original.stats()
    assert run(restored, steps[at:]) == run(original, steps[at:])


def test_a_checkpoint_of_another_chunk_length_is_refused_by_name(battlefield):
    from strata.chunking.chunker import ChunkingError

    cq = compile_query("SELECT COUNT(*) FROM Vitals [ROWS 3]", battlefield, "S")
    meta, tables = Chunker(battlefield, {"q1": cq}, chunk_instants=2).export_state()
    with pytest.raises(ChunkingError, match="chunks of 2 instants, this chunker 1"):
        Chunker(battlefield, {"q1": cq}, chunk_instants=1).import_state(meta, tables)


def test_a_master_with_another_chunk_length_than_its_checkpoint_says_what_to_do(battlefield, tmp_path):
    from strata.master.store import StateMismatch

    core = _core(tmp_path / "m.sqlite", battlefield)  # 2 instants per chunk
    core.register("ann", QUERIES[:1])
    core.checkpoint()
    core.store.close()
    other = MasterCore(battlefield, "S", chunk_instants=1,
                       store=MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(battlefield)))
    with pytest.raises(StateMismatch, match="start the master with --chunk-seconds 2 or move the file away"):
        other.restore()


# ---- a master with its store --------------------------------------------------------------------------
QUERIES = ["SELECT sid, AVG(bp) FROM Vitals [ROWS 3] GROUP BY sid", "SELECT COUNT(*) FROM Vitals [RANGE 2 SECONDS]",
           "SELECT bp FROM Vitals [NOW]", "ISTREAM (SELECT sid FROM Vitals [RANGE 3 SECONDS])"]


def _core(path: Path, cfg, **kw):
    store = MasterStore(path, "S", config_fingerprint(cfg))
    return MasterCore(cfg, "S", chunk_instants=2, store=store, max_in_flight=10, adaptive=False, **kw)


def _answer_some(core, rnd):
    """Answer some of the units sent (each query: its instants and its rows' count); the others' worker
    vanishes and comes back (its chunks go back to the queue): nothing stays in flight."""
    core.heartbeat("w1", 5.0)
    for chunk, sid in core.assignments():
        if rnd.random() < 0.6:
            res = [ChunkResult(qc.query_id, chunk.chunk_id, pa.table({"ts": pa.array(qc.instants, pa.int64()),
                                                                       "level": ["S"] * len(qc.instants),
                                                                       "n": [qc.num_rows] * len(qc.instants)}))
                   for qc in chunk.queries]
            core.on_result(chunk.chunk_id, sid, res)
        else:
            core.on_failure(chunk.chunk_id, sid, drop_worker=True)
            core.heartbeat(sid, 5.0)


def _steps(core, rnd) -> list:
    """Registrations, input, advances, answers, a cancel, a failed query: one fixed script."""
    return [lambda: core.register("ann", QUERIES[:2]),
            lambda: core.ingest("Vitals", two_per_instant(1, 8), None), lambda: core.advance(upto_ts=3),
            lambda: _answer_some(core, rnd), lambda: core.register("bob", QUERIES[2:]),
            lambda: core.ingest("Vitals", two_per_instant(4, 12), None), lambda: core.advance(upto_ts=7),
            lambda: _answer_some(core, rnd), lambda: core.cancel("ann", ["q1"]),
            lambda: core.ingest("Vitals", two_per_instant(9, 10), None), lambda: core.advance(upto_ts=11),
            lambda: _answer_some(core, rnd), lambda: core.ingest("Vitals", two_per_instant(14, 6), None),
            lambda: core.advance(finish=True), lambda: _answer_some(core, rnd)]


N_STEPS = 15


def _state(core):
    chunks = [encode_chunk(core.pipeline.chunks[c]) for c in sorted(core.pipeline.chunks)]
    views = {q: core.query_view(q) for q in core.queries}
    results = {q: [(r.chunk_id, r.first_ts, r.last_ts, rows_of(r.rows)) for r in i.results]
               for q, i in core.queries.items()}
    st = core.status()
    return {"chunks": chunks, "views": views, "results": results, "chunker": core.pipeline.chunker.stats(),
            "accepted": st["counters"]["accepted"], "ready": list(core._ready), "backlog": core.backlog_rows(),
            "lag": st["lag_instants"], "ended": {q: i.ended for q, i in core.queries.items()}}


@pytest.mark.parametrize("at", range(0, N_STEPS + 1))
def test_a_master_restarted_from_a_checkpoint_goes_on_as_if_never_stopped(battlefield, tmp_path, at):
    """The script with a checkpoint after step ``at``: once run through, once stopped right after the
    checkpoint and restarted from it (an empty log after it).  Both end in the same state: the chunks
    still to compute, every query's view, released results and end, the chunker's counts."""
    assert len(_steps(None, None)) == N_STEPS
    rnd = random.Random(7)
    live = _core(tmp_path / "live.sqlite", battlefield)
    for i, step in enumerate(_steps(live, rnd)):
        if i == at:
            live.checkpoint()
        step()
    if at == N_STEPS:
        live.checkpoint()

    rnd = random.Random(7)
    core = _core(tmp_path / "m.sqlite", battlefield)
    steps = _steps(core, rnd)
    for step in steps[:at]:
        step()
    logged = core.store.count()
    done = core.checkpoint()
    assert done["events_dropped"] == logged and core.store.count() == 0  # compacted in the same transaction
    core.store.close()
    again = _core(tmp_path / "m.sqlite", battlefield)
    restored = again.restore()
    assert restored["batches"] == 0 and restored["checkpoint"] == done["upto_seq"]
    for step in _steps(again, rnd)[at:]:
        step()
    assert _state(again) == _state(live)
    assert again.store.count() == live.store.count()  # the log after the checkpoint, event for event
    if at < 2:
        return
    # restarted once more, from the checkpoint and the log after it: the queries come back as they were
    again.store.close()
    third = _core(tmp_path / "m.sqlite", battlefield)
    third.restore()
    def stops(core):  # the view's state says "ended" only once the chunks computed again are in
        return {q: (i.rewritten, i.state, i.revoked_after) for q, i in core.queries.items()}

    assert stops(third) == stops(live)
    assert third.register("cid", ["SELECT bp FROM Vitals [ROWS 1]"])[0].query_id == \
        f"q{len(live.queries) + 1}"  # ids continue
    third.store.close()


def test_a_checkpoint_gives_the_log_s_pages_back(tmp_path):
    import os

    store = MasterStore(tmp_path / "m.sqlite", "S", "fingerprint")
    for _ in range(80):
        store.append_batch([("ingest", {}, os.urandom(250_000))])
    size = lambda: sum(f.stat().st_size for f in tmp_path.glob("m.sqlite*"))  # noqa: E731
    assert size() > 20e6
    assert store.write_checkpoint(store.last_seq(), [("meta", b"{}")]) == 80
    assert size() < 1e6 and store.count() == 0
    store.append("advance", {"upto": 1})
    assert store.last_seq() == 81  # numbering goes on after the compaction
    store.close()


def test_a_checkpoint_interrupted_while_written_leaves_the_old_one_and_the_whole_log(tmp_path):
    """The parts go in as a new generation, a batch at a time; only the last transaction makes it the
    checkpoint.  A write that fails half way (here: the encoder raises) changes nothing a restart
    reads, and the next write removes what it left."""
    store = MasterStore(tmp_path / "m.sqlite", "S", "fingerprint")
    store.CHECKPOINT_BATCH_BYTES = 10
    store.append("advance", {"upto": 1})
    assert store.write_checkpoint(1, [("meta", b"one"), ("table:a", b"x" * 20)]) == 1
    store.append("advance", {"upto": 2})

    def broken():
        yield "meta", b"two"
        yield "table:a", b"y" * 20  # a batch of its own: in the file, not yet current
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.write_checkpoint(2, broken())
    assert store.read_checkpoint() == {"meta": b"one", "table:a": b"x" * 20} and store.count() == 1
    assert store.write_checkpoint(2, [("meta", b"three")]) == 1
    assert store.read_checkpoint() == {"meta": b"three"} and store.count() == 0
    rows = store._db.execute("SELECT COUNT(*) FROM checkpoint").fetchone()[0]
    assert rows == 1  # the interrupted generation is gone too
    store.close()


def test_checkpoints_come_by_rows_or_events_and_wait_for_a_backlog(battlefield, tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML + "\n[limits]\ncheckpoint_rows = 100\ncheckpoint_events = 50\n")
    core = MasterCore(cfg, "S", chunk_instants=1, store=MasterStore(tmp_path / "m.sqlite", "S",
                                                                   config_fingerprint(cfg)), max_in_flight=10)
    core.register("ann", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])
    assert not core.checkpoint_due()
    core.ingest("Vitals", two_per_instant(1, 60), None)  # 45 rows at or below S
    assert not core.checkpoint_due()
    core.ingest("Vitals", two_per_instant(40, 80), None)
    assert core._logged_rows == 105 and core.checkpoint_due()  # rows
    core.advance(upto_ts=80)  # a backlog of 105 rows > 100 / 4: wait for it
    assert not core.checkpoint_due()
    _answer_some_all(core)
    assert core.backlog_rows() == 0 and core.checkpoint_due()
    core.checkpoint()
    assert not core.checkpoint_due() and core.status()["counters"]["checkpoints"] == 1
    for t in range(81, 131):  # 50 advances: events
        core.ingest("Vitals", two_per_instant(t, 1), None)  # one U row each: logged with ... (one event per batch)
    assert core._logged_events >= 50 and core.checkpoint_due()
    off = parse_config(BATTLEFIELD_TOML + "\n[limits]\ncheckpoint_rows = 0\ncheckpoint_events = 0\n")
    never = MasterCore(off, "S", store=MasterStore(tmp_path / "n.sqlite", "S", config_fingerprint(off)))
    never.register("ann", ["SELECT COUNT(*) FROM Vitals [ROWS 3]"])
    never.ingest("Vitals", two_per_instant(1, 4000), None)
    assert not never.checkpoint_due()


def _answer_some_all(core):
    core.heartbeat("w1", 5.0)
    while core._ready:
        for chunk, sid in core.assignments():
            core.on_result(chunk.chunk_id, sid, [ChunkResult(qc.query_id, chunk.chunk_id, pa.table({}))
                                                  for qc in chunk.queries])


# ---- through real engines: random merges, failures and restarts ------------------------------------------
def _run_with_restarts(config, level, texts, streams, executors, k, rnd, path: Path):
    """test_adaptive's harness with a store, restarted (after a checkpoint or from the whole log) at
    random points: whatever was in flight is lost with the old master, as with a real crash."""
    def fresh():
        core = MasterCore(config, level, chunk_instants=k, max_in_flight=rnd.randint(1, 3), chunk_retries=10**6,
                          store=MasterStore(path, config.lattice.parse(level), config_fingerprint(config)))
        core._unit_size = lambda ready, free: rnd.choice([1, ready, -(-ready // max(1, free))])
        for w in range(2):
            core.heartbeat(f"w{w}", 0.0)
        return core

    core = fresh()
    regs = core.register("ana", texts)
    h = _Harness(core, executors, dict(core.pipeline.queries), rnd, prune=True, fail=0.1, vanish=0.0)
    restarts = checkpoints = 0

    def restart():
        nonlocal restarts, checkpoints
        if rnd.random() < 0.7:
            h.core.checkpoint()
            checkpoints += 1
        h.core.store.close()
        h.core = fresh()
        h.core.restore()
        h.in_flight, h.stale = [], []
        restarts += 1

    for kind, a, b in _batches(config, streams, rnd):
        if kind == "push":
            h.core.ingest(a, b, None)
        elif kind == "close":
            h.core.advance(upto_ts=a)
            for _ in range(rnd.choice([0, 1, 2])):
                h.step()
            if rnd.random() < 0.4:
                restart()
        else:
            h.core.advance(finish=True)
            if rnd.random() < 0.5:
                restart()
    h.drain()
    event(f"restarts: {min(restarts, 3)}, after a checkpoint: {min(checkpoints, 3)}")
    out = released(h.core, regs)
    h.core.store.close()
    return out


@pytest.mark.spark
@SETTINGS
@given(data=st.data())
def test_restarts_from_checkpoints_equal_reference(battlefield, engines, data):
    config = battlefield
    level, texts, streams, k, rnd = _case(data, config, max_instants=10)
    restarted_equals_reference(config, level, texts, streams, executors_of(engines, config, 2, True), k, rnd)


def restarted_equals_reference(config, level, texts, streams, executors, k, rnd) -> None:
    """:func:`_run_with_restarts` in a temporary directory; every query's rows and failing instant
    equal the reference's."""
    with tempfile.TemporaryDirectory() as d:
        out = _run_with_restarts(config, level, texts, streams, executors, k, rnd, Path(d) / "m.sqlite")
    assert_reference(config, level, texts, streams, out)
