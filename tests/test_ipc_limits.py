"""Decoded size limits on Arrow IPC (issue 14, item 1): a compressed "bomb" is refused before it is
decompressed, with one line and nothing applied; everything under the cap round-trips."""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.arrowio import MAX_DECODED_BYTES, BatchTooLarge, from_ipc, to_ipc
from strata.chunking.codec import CodecError, decode_chunk, encode_chunk
from strata.chunking.model import Chunk, QueryChunk
from strata.master.core import MAX_INGEST_BYTES, MasterCore
from strata.master.sessions import Sessions
from strata.master.store import MasterStore
from strata.rpc import strata_pb2 as pb
from strata.users import UserStore

from . import tables
from .fakes import Context

MiB = 1 << 20


def compressed(table: pa.Table, codec: str = "zstd", repeat: int = 1, max_chunksize: int | None = None) -> bytes:
    """IPC of ``table`` (written ``repeat`` times) with compressed bodies, as another client could send."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as w:
        for _ in range(repeat):
            w.write_table(table, max_chunksize=max_chunksize)
    return sink.getvalue().to_pybytes()


def zeros_strings(rows: int, size: int) -> pa.Array:
    """``rows`` strings of ``size`` NUL bytes each, over one lazily zeroed buffer (no real memory)."""
    data = pa.py_buffer(np.zeros(rows * size, dtype=np.uint8))
    offsets = pa.py_buffer(np.arange(0, rows * size + 1, size, dtype=np.int64))
    return pa.Array.from_buffers(pa.large_string(), rows, [None, offsets, data])


#: this module's Vitals tuples: level U, sid "a" unless given, every number 1.0
vitals = partial(tables.vitals, level="U", bp=1.0)


# ---- from_ipc alone ---------------------------------------------------------------------------------
def test_a_compressed_bomb_is_refused_before_it_is_decompressed():
    bomb = compressed(pa.table({"sid": zeros_strings(136, MiB)}))  # 136 MiB of NULs
    assert len(bomb) < MiB  # a few KB on the wire
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    old = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        with pytest.raises(BatchTooLarge) as e:
            from_ipc(bomb, max_bytes=128 * MiB)
    finally:
        pa.set_memory_pool(old)
    assert str(e.value) == "batch too large: decodes to more than 128 MiB"
    assert isinstance(e.value, ValueError)
    assert pool.max_memory() < 8 * MiB  # nothing was inflated


def test_many_small_compressed_batches_count_together():
    t = pa.table({"x": pa.array(np.zeros(MiB // 8, dtype=np.int64))})  # 1 MiB a batch, compresses to ~nothing
    with pytest.raises(BatchTooLarge, match="more than 4 MiB"):
        from_ipc(compressed(t, "lz4", repeat=5), max_bytes=4 * MiB)
    assert from_ipc(compressed(t, "lz4", repeat=4), max_bytes=4 * MiB).num_rows == 4 * t.num_rows


def test_row_cap_counts_every_batch():
    t = pa.table({"x": pa.array([None] * 1000, pa.null())})  # rows that take no bytes at all
    data = compressed(t, repeat=3)
    assert from_ipc(data, max_rows=3000).num_rows == 3000
    with pytest.raises(BatchTooLarge, match="^batch too large: more than 2999 rows$"):
        from_ipc(data, max_rows=2999)


@pytest.mark.parametrize("codec", [None, "zstd", "lz4"])
def test_within_the_cap_compressed_or_not_round_trips(codec):
    t = vitals(list(range(1000)))
    t = t.replace_schema_metadata({"k": "v"})
    data = to_ipc(t) if codec is None else compressed(t, codec, max_chunksize=300)
    back = from_ipc(data, max_bytes=t.nbytes + 4096, max_rows=t.num_rows)  # + offsets/padding per batch
    assert back.equals(t) and back.schema.metadata == {b"k": b"v"}


def test_empty_and_dictionary_tables_round_trip():
    empty = pa.table({"x": pa.array([], pa.int64())})
    assert from_ipc(to_ipc(empty), max_bytes=0, max_rows=0).equals(empty)
    d = pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode()})
    assert from_ipc(compressed(d)).equals(d)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_table_under_the_cap_round_trips(data):
    n = data.draw(st.integers(0, 200))
    cols = {
        "l": data.draw(st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), min_size=n, max_size=n)),
        "d": data.draw(st.lists(st.one_of(st.none(), st.floats(allow_nan=False)), min_size=n, max_size=n)),
        "s": data.draw(st.lists(st.one_of(st.none(), st.text(max_size=20)), min_size=n, max_size=n)),
        "b": data.draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n)),
    }
    t = pa.table({"l": pa.array(cols["l"], pa.int64()), "d": pa.array(cols["d"], pa.float64()),
                  "s": pa.array(cols["s"], pa.string()), "b": pa.array(cols["b"], pa.bool_())})
    codec = data.draw(st.sampled_from([None, "zstd", "lz4"]))
    chunk = data.draw(st.integers(1, 50))
    raw = to_ipc(t) if codec is None else compressed(t, codec, max_chunksize=chunk)
    exact = from_ipc(raw, max_bytes=None).get_total_buffer_size()  # what the decoded table holds
    back = from_ipc(raw, max_bytes=exact, max_rows=n)
    assert back.equals(t)
    if exact:  # the cap is exact: one byte less is refused
        with pytest.raises(BatchTooLarge):
            from_ipc(raw, max_bytes=exact - 1)
    if n:
        with pytest.raises(BatchTooLarge):
            from_ipc(raw, max_rows=n - 1)


def test_corrupt_streams_raise_one_line_value_errors_never_crash():
    t = pa.table({"a": [1, 2, None, 4, 5], "s": ["x", "yy", None, "z", "w"], "l": [[1], [2, 3], None, [], [4]],
                  "d": pa.array(["a", "b", "a", "b", "a"]).dictionary_encode()})
    clean = {c: compressed(t, c, max_chunksize=2) if c else to_ipc(t) for c in (None, "zstd", "lz4")}
    rng = random.Random(14)
    for _ in range(3000):
        b = bytearray(clean[rng.choice([None, "zstd", "lz4"])])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            from_ipc(bytes(b), max_bytes=MiB)
        except ValueError as e:
            assert "\n" not in str(e)
    for bad in (b"", b"garbage" * 10, clean[None][:-50], clean["zstd"][:100]):
        with pytest.raises(ValueError):
            from_ipc(bad)


# ---- the worker's chunk decoding ----------------------------------------------------------------------
def test_a_chunk_of_compressed_tables_has_one_budget(monkeypatch):
    from strata.chunking import codec

    t = vitals(list(range(100)))
    chunk = Chunk(chunk_id=1, first_ts=0, last_ts=99,
                  queries=[QueryChunk(query_id="q1", chunk_id=1, items=[t, t, t], instants=[0])])
    assert decode_chunk(encode_chunk(chunk)).queries[0].items[2].equals(t)
    monkeypatch.setattr(codec, "MAX_DECODED_BYTES", 2 * t.get_total_buffer_size() + 100)
    with pytest.raises(CodecError, match="^bad Arrow data in encoded chunk: batch too large"):
        decode_chunk(encode_chunk(chunk))
    assert MAX_DECODED_BYTES == 1 << 30


# ---- the master: refused with one line, counted, nothing applied ----------------------------------------
def test_master_refuses_a_bomb_batch_in_one_line_and_applies_nothing(battlefield, tmp_path):
    from strata.master.server import MasterServicer

    users = UserStore(tmp_path / "users.json", battlefield.lattice)
    users.add("sam", "S", "pw", roles="producer")
    store = MasterStore(tmp_path / "state" / "master.sqlite", "S", "fp")
    core = MasterCore(battlefield, "S", store=store)
    sessions = Sessions(users, "S")
    servicer = MasterServicer(core, sessions)
    token = sessions.login("sam", "pw", "S").token

    good = pb.IngestBatch(stream="Vitals", arrow=to_ipc(vitals([1, 1, 2])), labelled=True)
    reply = servicer.Ingest(iter([good]), Context(token))
    assert (reply.accepted, reply.error) == (3, "")
    logged, last = store.count(), core.last_input_ts

    rows = 140
    bomb_table = vitals(list(range(3, 3 + rows)), sid=zeros_strings(rows, MiB))  # 140 MiB decoded
    bomb = compressed(bomb_table)
    del bomb_table
    assert len(bomb) < 1 * MiB and 2 * MAX_INGEST_BYTES == 128 * MiB
    after = pb.IngestBatch(stream="Vitals", arrow=to_ipc(vitals([9])), labelled=True)
    reply = servicer.Ingest(iter([pb.IngestBatch(stream="Vitals", arrow=bomb, labelled=True), after]), Context(token))
    assert reply.accepted == 0 and reply.rejected == 1
    assert "\n" not in reply.error and "batch too large: decodes to more than 128 MiB" in reply.error
    assert (store.count(), core.last_input_ts) == (logged, last)  # nothing applied, nothing logged
    assert core.status(cluster=True)["rejected"] == {"bad_batch": 1}

    reply = servicer.Ingest(iter([after]), Context(token))  # the stream goes on as before
    assert (reply.accepted, reply.error) == (1, "")
    store.close()
