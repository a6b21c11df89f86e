"""Streams declared at run time (issue 16: ``strata streams add --name N --schema sid=string,bp=double``).

* the master: a stream added by an operator is logged before it is applied, accepted from then on,
  queries over it compile and its chunks carry its schema (a worker knows only its configuration's
  streams); a restart from the log or from a checkpoint declares it again; a bad declaration or
  another schema for an existing name is refused in one line; the same declaration twice is a no-op;
* the worker compiles a chunk's queries with the schemas the chunk carries;
* through the CLI against a running cluster with a master kill -9 and restart in between: the stream
  is listed as added at run time, results over it equal the reference, a non-operator is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pyarrow as pa
import pytest

from strata.chunking.codec import decode_chunk, encode_chunk
from strata.config import StreamSchema, parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.core import MasterCore, Refused
from strata.master.store import MasterStore, config_fingerprint

QUERY = "SELECT k, SUM(v) AS s, COUNT(*) AS n FROM Sensors [ROWS 3] GROUP BY k"
COLUMNS = [("k", "string"), ("v", "double")]


def sensors(ts: list[int], levels: list[str]) -> pa.Table:
    return pa.table({"ts": ts, "level": levels, "k": [f"k{t % 2}" for t in ts],
                     "v": [float(10 * t) for t in ts]})


def _core(tmp_path, cfg, name="m.sqlite"):
    return MasterCore(cfg, "S", store=MasterStore(tmp_path / name, "S", config_fingerprint(cfg)), max_in_flight=10)


def test_an_added_stream_is_accepted_queried_and_carried_in_its_chunks(battlefield, tmp_path):
    core = _core(tmp_path, battlefield)
    with pytest.raises(Exception, match="unknown stream 'Sensors'"):
        core.register("ann", [QUERY])
    view, created = core.add_stream("Sensors", COLUMNS)
    assert created and view == {"name": "Sensors", "columns": [["k", "string"], ["v", "double"]]}
    assert core.add_stream("Sensors", COLUMNS) == (view, False)  # the same declaration: nothing changes
    [q] = core.register("ann", [QUERY])
    core.ingest("Sensors", sensors([1, 2, 3], ["U", "S", "C"]), None)
    core.advance(upto_ts=3)
    chunks = [core.pipeline.chunks[c] for c in sorted(core.pipeline.chunks)]
    assert chunks and all(c.streams == (("Sensors", tuple(COLUMNS)),) for c in chunks)
    assert decode_chunk(encode_chunk(chunks[0])).streams == chunks[0].streams  # on the wire
    configured = list(battlefield.streams)
    assert [s["name"] for s in core.streams()] == configured + ["Sensors"]
    assert [s["added"] for s in core.streams()] == [False] * len(configured) + [True]
    want = [encode_chunk(c) for c in chunks]
    core.store.close()

    again = _core(tmp_path, battlefield)  # from the log
    assert again.restore()["streams"] == 1
    assert [encode_chunk(again.pipeline.chunks[c]) for c in sorted(again.pipeline.chunks)] == want
    assert again.query_view(q.query_id)["text"].startswith("SELECT k, SUM(v) AS s")
    again.checkpoint()
    again.store.close()
    third = _core(tmp_path, battlefield)  # from the checkpoint (the log before it is gone)
    third.restore()
    assert [s["name"] for s in third.streams()] == configured + ["Sensors"]
    assert [encode_chunk(third.pipeline.chunks[c]) for c in sorted(third.pipeline.chunks)] == want
    third.ingest("Sensors", sensors([4], ["U"]), None)  # accepted after both restarts
    third.store.close()


@pytest.mark.parametrize("name, columns, message", [
    ("Vitals", [("sid", "string")], "stream Vitals exists with attributes sid=string, bp=double"),
    ("vitals", COLUMNS, "stream Vitals exists with attributes"),
    ("9x", COLUMNS, "stream 9x: stream name '9x' is not an identifier"),
    ("X", [("ts", "long")], "'ts' is a system attribute every stream has"),
    ("X", [("a", "float")], "unknown type 'float' (types: string, double, long, boolean, timestamp) (a)"),
    ("X", [("a", "long"), ("A", "long")], "attribute declared twice"),
    ("X", [], "declare at least one attribute"),
])
def test_a_bad_declaration_is_refused_in_one_line_and_not_logged(battlefield, tmp_path, name, columns, message):
    core = _core(tmp_path, battlefield)
    n = core.store.count()
    with pytest.raises(Refused, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        core.add_stream(name, columns)
    assert "\n" not in str(e.value) and e.value.reason == "bad_stream"
    assert core.store.count() == n and [s["name"] for s in core.streams()] == list(battlefield.streams)


def test_only_an_operator_adds_a_stream_and_every_session_lists_them(battlefield, tmp_path):
    from strata.master.server import MasterServicer
    from strata.master.sessions import Sessions
    from strata.rpc import strata_pb2 as pb
    from strata.users import UserStore

    from .fakes import Context

    users = UserStore(tmp_path / "users.json", battlefield.lattice)
    users.add("ana", "S", "pw", roles=["analyst", "producer"])
    users.add("olga", "S", "pw", roles=["operator"])
    core = MasterCore(battlefield, "S")
    sessions = Sessions(users, "S")
    sv = MasterServicer(core, sessions)
    ana, olga = (sessions.login(u, "pw", "S").token for u in ("ana", "olga"))
    req = pb.AddStreamRequest(name="Sensors", attributes=[pb.Attribute(name=c, type=t) for c, t in COLUMNS])
    with pytest.raises(AssertionError, match="PERMISSION_DENIED"):
        sv.AddStream(req, Context(ana))
    assert "Sensors" not in core.config.streams
    info = sv.AddStream(req, Context(olga))
    assert (info.name, info.created, info.added) == ("Sensors", True, True)
    with pytest.raises(AssertionError, match="INVALID_ARGUMENT.*exists with attributes"):
        sv.AddStream(pb.AddStreamRequest(name="Sensors", attributes=[pb.Attribute(name="k", type="long")]),
                     Context(olga))
    assert core.status()["rejected"]["bad_stream"] == 1
    listed = sv.Streams(pb.Empty(), Context(ana)).streams
    assert [(s.name, s.added) for s in listed][-1] == ("Sensors", True)


def test_a_worker_compiles_with_the_schemas_a_chunk_carries(battlefield):
    from strata.worker.service import QuerySpecData, WorkerCore

    w = WorkerCore(battlefield, "S", engine=type("E", (), {"config": battlefield})())
    streams = (("Sensors", tuple(COLUMNS)),)
    cq = w._compile(QuerySpecData("q1", QUERY, "S"), streams)
    assert [o.name for o in cq.outputs] == ["k", "s", "n"]
    assert w._config_for((("Vitals", (("x", "long"),)),)) is battlefield  # a configured stream keeps its schema


# ---- through the CLI against a running cluster, a master restart in between --------------------------
@pytest.mark.slow
def test_streams_add_through_the_cli_survives_a_master_restart(tmp_path, warm_s):
    """On a fresh master of the warm S cluster (conftest.py ``warm_s``; the stream added here lives in this
    master's state only: the next fresh master starts without it)."""
    from strata.deploy.local import restart_process

    from .polling import wait_for
    from .reference.evaluator import compare_results, evaluate
    from .helpers import PASSWORD, alive

    started = warm_s.renew({"ann": "TS"})
    cfg_path, state = started["config"], started["state"]
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD}
    follower = None
    try:
        address, tls = started["masters"]["S"], started["tls_dir"]
        base = ["--config", str(cfg_path), "--master", address, "--user", "ann", "--level", "S", "--tls-dir", tls]

        def strata(words: str, *rest):
            return subprocess.run([sys.executable, "-m", "strata", *words.split(), *base, *rest], env=env,
                                  capture_output=True, text=True, timeout=120)

        r = strata("streams add", "--name", "Sensors", "--schema", "k=string, v=double")
        assert r.returncode == 0 and "stream Sensors declared: k=string, v=double" in r.stderr, r.stderr
        r = strata("streams add", "--name", "Sensors", "--schema", "k=long")
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert [ln for ln in r.stderr.splitlines() if ln.strip()] == \
            ["strata: stream Sensors exists with attributes k=string, v=double"], r.stderr
        rows1 = [{"ts": t, "level": lv, "k": f"k{t % 2}", "v": float(10 * t)} for t, lv in
                 [(1, "U"), (1, "S"), (2, "C"), (3, "TS"), (3, "U"), (4, "S")]]
        rows2 = [{"ts": t, "level": lv, "k": f"k{t % 3}", "v": float(t)} for t, lv in
                 [(5, "C"), (6, "U"), (6, "S"), (7, "U")]]

        def write(rows, name):
            path = tmp_path / name
            path.write_text("ts,level,k,v\n" + "".join(f"{r['ts']},{r['level']},{r['k']},{r['v']}\n" for r in rows))
            return path

        follower = subprocess.Popen([sys.executable, "-m", "strata", "query", *base, "--query", QUERY,
                                     "--format", "json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        r = strata("ingest", "--input", f"Sensors={write(rows1, 'one.csv')}", "--labelled")
        assert r.returncode == 0, r.stderr
        r = strata("advance", "--upto", "4")
        assert r.returncode == 0, r.stderr
        master = next(p for p in json.loads((state / "cluster.json").read_text())["processes"]
                      if p["role"] == "master" and p["level"] == "S")
        os.kill(master["pid"], signal.SIGKILL)
        wait_for(lambda: not alive(master["pid"]), 10, "the master to die")
        restart_process(state, master["name"])
        r = strata("streams list", "--format", "json")
        assert r.returncode == 0, r.stderr
        listed = [json.loads(ln) for ln in r.stdout.splitlines()]
        assert {"stream": "Sensors", "attributes": {"k": "string", "v": "double"}, "added": "run time"} in listed
        r = strata("ingest", "--input", f"Sensors={write(rows2, 'two.csv')}", "--labelled", "--finish")
        assert r.returncode == 0, r.stderr
        out, err = follower.communicate(timeout=180)
        assert follower.returncode == 0, err
        got = [tuple(d[c] for c in ("ts", "level", "k", "s", "n")) for d in map(json.loads, out.splitlines())]
        cfg = parse_config(BATTLEFIELD_TOML)
        cfg = replace(cfg, streams={**cfg.streams, "Sensors": StreamSchema("Sensors", tuple(COLUMNS))})
        compare_results(got, evaluate(QUERY, cfg, "S", {"Sensors": rows1 + rows2}))
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
