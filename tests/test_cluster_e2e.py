"""End to end with real processes on loopback: two level groups, their isolation,
the stream shepherd, replay against the reference, Algorithm 5 with an injected load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from strata.client import Client
from strata.deploy.local import start_cluster, stop_cluster
from strata.config import load_config
from strata.groups import AUTH_HEADER, group_spec, sign_request
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.tls import issue, make_ca, secure_channel
from strata.groups.membership import Heartbeat, encode_heartbeat

from .conftest import BATTLEFIELD_TOML, CHINESE_WALL_TOML
from .helpers import PASSWORD, WARM_UP, login, read_out, strata, write_config, write_csv  # noqa: F401 - some modules import them from here
from .polling import poll
from .reference.evaluator import compare_results, evaluate

pytestmark = pytest.mark.slow


# ---- the module's shared clusters: stopped as soon as no later test of the module uses them ----------
#: fixture name -> how to stop what it started (stopping twice is harmless: stop_cluster of a stopped one)
_SHARED: dict = {}


@pytest.fixture(autouse=True)
def _stop_shared_clusters_no_later_test_uses(request):
    """A module fixture's cluster would idle until the module's end (its JVMs' heartbeats and timers, beside
    the embedded clusters of the tests after it); it is stopped before the first test after which no test of
    this module (in run order: a file runs in one process, in order) names it."""
    items = request.session.items
    later = items[items.index(request.node):] if request.node in items else items
    wanted = {name for it in later if getattr(it, "module", None) is request.module
              for name in getattr(it, "fixturenames", ())}
    for name in [n for n in _SHARED if n not in wanted]:
        _SHARED.pop(name)()


# ---- a running two-level cluster -----------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    cfg = write_config(d, BATTLEFIELD_TOML, {"sam": "S", "tess": "TS"})
    state = d / "state"
    # injected load readings (not a real CPU hog): worker 1 of each level is saturated,
    # worker 0 idle; Algorithm 5 must leave worker 1 without chunks
    masters = start_cluster(str(cfg), ["S", "TS"], 2, state,
                            worker_env={0: {"STRATA_CPU_OVERRIDE": "5"}, 1: {"STRATA_CPU_OVERRIDE": "95"}})
    record = json.loads((state / "cluster.json").read_text())
    _SHARED["cluster"] = lambda: stop_cluster(state)
    yield {"config": cfg, "state": state, "masters": masters["masters"], "record": record, "tls": masters["tls_dir"]}
    _SHARED.pop("cluster", None)
    stop_cluster(state)


def workers_of(cluster, level):
    return sorted(p["address"] for p in cluster["record"]["processes"] if p["role"] == "worker" and p["level"] == level)


def test_group_tables_hold_only_their_level(cluster):
    for level, user in (("S", "sam"), ("TS", "tess")):
        with login(cluster, user, level) as c:
            sids = poll(lambda: sorted(w.sid for w in c.status().workers) == workers_of(cluster, level) and True)
            assert sids, f"{level} group table: {[w.sid for w in c.status().workers]}"
            assert not set(w.sid for w in c.status().workers) & set(workers_of(cluster, "S" if level == "TS" else "TS"))


def test_status_cli_json(cluster):
    r = strata("status", "--config", str(cluster["config"]), "--master", cluster["masters"]["S"], "--user", "sam",
               "--json", "--tls-dir", cluster["tls"], "--level", "S")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["level"] == "S"
    assert sorted(w["sid"] for w in st["workers"]) == workers_of(cluster, "S")
    assert all(w["pid"] > 0 for w in st["workers"])
    assert {w["sid"]: w["cpu"] for w in st["workers"]}[workers_of(cluster, "S")[0]] >= 0


def test_forged_and_wrong_key_heartbeats_are_ignored(cluster):
    cfg = load_config(cluster["config"])
    spec = group_spec(cfg, "S", cluster["state"])
    ts_spec = group_spec(cfg, "TS", cluster["state"])
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
    now = time.time()
    dest = (spec.address, cluster["record"]["multicast_port"])
    for i in range(5):
        forged = Heartbeat("S", "127.0.0.1:1", 1.0, seq=i + 1, sent_at=now)
        tx.sendto(encode_heartbeat(forged, os.urandom(32)), dest)  # no key
        other = Heartbeat("S", "127.0.0.1:2", 1.0, seq=i + 1, sent_at=now)
        tx.sendto(encode_heartbeat(other, ts_spec.key), dest)  # the TS group's key
    tx.close()
    time.sleep(0.5)  # let the datagrams arrive; the assertion below must hold at any time after
    with login(cluster, "sam", "S") as c:
        assert sorted(w.sid for w in c.status().workers) == workers_of(cluster, "S")


def _worker_info(cluster, level, sid):
    cfg = load_config(cluster["config"])
    key = group_spec(cfg, level, cluster["state"]).key
    stub = rpc.WorkerStub(secure_channel(sid, cluster["tls"], "master", level, "worker"))
    return stub.Info(pb.Empty(), metadata=((AUTH_HEADER, sign_request(key, level, b"info")),), timeout=10)


def test_ts_tuple_on_s_master_never_reaches_s_workers(cluster):
    with login(cluster, "sam", "S") as c:
        regs = c.register(["SELECT RSTREAM COUNT(*) FROM Vitals [NOW]"])
        t = pa.table({"ts": [1, 1, 2, 2, 3], "level": ["S", "TS", "TS", "U", "TS"], "sid": ["a"] * 5,
                      "bp": [1.0] * 5, "pr": [1.0] * 5, "weight": [1.0] * 5})
        reply = c.ingest([("Vitals", t)], labelled=True)
        assert (reply.accepted, reply.dropped_by_shepherd) == (2, 3)
        c.advance(finish=True)
        rows = []
        for qid, table in c.subscribe([regs[0].query_id]):
            if table is not None:
                rows.extend(zip(*[table.column(i).to_pylist() for i in range(table.num_columns)]))
        assert sorted(rows) == [(1, "S", 1), (2, "U", 1)]  # instant 3 held only a TS tuple: no output
        st = c.status()
        # the 3 dropped TS tuples were told to this producer (its reply above) and nobody else
        assert not any(k.startswith("shepherd") for k in st.rejected) and "dropped_by_shepherd" not in st.counters
        assert st.counters["accepted"] >= 2
        # where the chunks' time went: every part present, round trip >= the engine's share
        t = st.timings
        assert t["chunks"] >= 1  # dispatch units: the two chunks may travel merged (adaptive chunking)
        assert all(t[f"{p}_p50_ms"] >= 0 for p in ("wait", "rtt", "engine", "transport"))
        assert t["rtt_p99_ms"] >= t["engine_p50_ms"] > 0
    r = strata("status", "--config", str(cluster["config"]), "--master", cluster["masters"]["S"], "--user", "sam",
               "--tls-dir", cluster["tls"], "--level", "S")
    assert r.returncode == 0 and "chunks, ms p50/p99: wait" in r.stdout, r.stdout + r.stderr
    seen = {}
    for sid in workers_of(cluster, "S"):
        info = _worker_info(cluster, "S", sid)
        for lv, n in info.seen_levels.items():
            seen[lv] = seen.get(lv, 0) + n
    assert "TS" not in seen and seen.get("S", 0) >= 1


def test_busy_worker_gets_no_chunk(cluster):
    """Worker 1 of each level reports CPU 95 % (injected): Algorithm 5 sends it nothing."""
    with login(cluster, "tess", "TS") as c:
        regs = c.register(["SELECT AVG(bp) FROM Vitals [ROWS 2]"])
        t = pa.table({"ts": list(range(1, 9)), "level": ["U", "TS"] * 4, "sid": ["a"] * 8,
                      "bp": [float(i) for i in range(8)], "pr": [1.0] * 8, "weight": [1.0] * 8})
        c.ingest([("Vitals", t)], labelled=True)
        c.advance(finish=True)
        got = [tb for _, tb in c.subscribe([regs[0].query_id]) if tb is not None]
        assert sum(tb.num_rows for tb in got) == 8
        done = {w.sid: (w.chunks_done, w.cpu) for w in c.status().workers}
    busy = [sid for sid, (_, cpu) in done.items() if cpu >= 90]
    free = [sid for sid, (_, cpu) in done.items() if cpu < 90]
    assert busy and free
    assert all(done[s][0] == 0 for s in busy) and sum(done[s][0] for s in free) >= 8


def test_wrong_level_login_and_unsigned_worker_calls_refused(cluster):
    c = Client(cluster["masters"]["S"], tls_dir=cluster["tls"], level="S")
    with pytest.raises(Exception, match="serves level S"):
        c.login("tess", PASSWORD, "TS")  # clearance TS, but this master is S
    c.close()
    sid = workers_of(cluster, "S")[0]
    stub = rpc.WorkerStub(secure_channel(sid, cluster["tls"], "master", "S", "worker"))
    with pytest.raises(grpc.RpcError) as e:
        stub.Execute(pb.ExecuteRequest(level="S", chunk=b""), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    cfg = load_config(cluster["config"])
    ts_key = group_spec(cfg, "TS", cluster["state"]).key
    req = pb.ExecuteRequest(level="TS", chunk=b"")
    from strata.groups import execute_digest

    with pytest.raises(grpc.RpcError) as e:  # a TS master's key and level do not drive an S worker
        stub.Execute(req, metadata=((AUTH_HEADER, sign_request(ts_key, "TS", execute_digest(req))),), timeout=10)
    assert e.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


# ---- transport security ---------------------------------------------------------------------------
def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_tls_less_client_is_refused(cluster):
    c = Client(cluster["masters"]["S"])  # plaintext to a TLS port: no handshake, nothing reaches a servicer
    with pytest.raises(Exception, match="UNAVAILABLE"):
        c.login("sam", PASSWORD, "S")
    c.close()


def test_wrong_level_client_certificate_is_refused(cluster):
    """A TS client certificate (same CA) cannot talk to the S master, whichever name it pins."""
    tls = cluster["tls"]
    # pins master.s.strata but presents client-TS: the S master's PeerCheck refuses it
    ch = grpc.secure_channel(cluster["masters"]["S"], grpc.ssl_channel_credentials(
        (Path(tls) / "ca.pem").read_bytes(), (Path(tls) / "client-TS.key").read_bytes(),
        (Path(tls) / "client-TS.pem").read_bytes()), [("grpc.ssl_target_name_override", "master.s.strata")])
    stub = rpc.MasterStub(ch)
    assert _refused(lambda: stub.Login(pb.LoginRequest(user="tess", password=PASSWORD, level="S"),
                                       timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    # pins master.ts.strata (its own level) against the S master: the handshake fails on the name
    c = Client(cluster["masters"]["S"], tls_dir=tls, level="TS")
    with pytest.raises(Exception, match="UNAVAILABLE"):
        c.login("tess", PASSWORD, "TS")
    c.close()


def test_worker_refuses_master_certificate_of_another_level(cluster):
    sid = workers_of(cluster, "S")[0]
    tls = Path(cluster["tls"])
    cfg = load_config(cluster["config"])
    key = group_spec(cfg, "S", cluster["state"]).key
    md = ((AUTH_HEADER, sign_request(key, "S", b"info")),)
    # a TS master's certificate, even with the S group key and pinning the S worker's name
    ch = grpc.secure_channel(sid, grpc.ssl_channel_credentials(
        (tls / "ca.pem").read_bytes(), (tls / "master-TS.key").read_bytes(), (tls / "master-TS.pem").read_bytes()),
        [("grpc.ssl_target_name_override", "worker.s.strata")])
    assert _refused(lambda: rpc.WorkerStub(ch).Info(pb.Empty(), metadata=md, timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    # a client certificate of the right level is not a master
    ch = secure_channel(sid, tls, "client", "S", "worker")
    assert _refused(lambda: rpc.WorkerStub(ch).Info(pb.Empty(), metadata=md, timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    # no certificate at all
    assert _refused(lambda: rpc.WorkerStub(grpc.insecure_channel(sid)).Info(pb.Empty(), metadata=md, timeout=10)) == \
        grpc.StatusCode.UNAVAILABLE
    info = _worker_info(cluster, "S", sid)
    assert info.refused["tls_wrong_level"] >= 1 and info.refused["tls_wrong_role"] >= 1


def test_certificate_of_a_foreign_ca_is_refused(cluster, tmp_path):
    """Same names and level, but signed by another CA: the handshake fails both ways."""
    other = tmp_path / "other"
    ca = make_ca(other)
    for role in ("client", "master"):
        issue(other, role, "S", ca=ca)
    (other / "ca.pem").write_bytes((Path(cluster["tls"]) / "ca.pem").read_bytes())  # trusts the real CA
    c = Client(cluster["masters"]["S"], tls_dir=other, level="S")
    with pytest.raises(Exception, match="UNAVAILABLE"):
        c.login("sam", PASSWORD, "S")
    c.close()
    ch = secure_channel(workers_of(cluster, "S")[0], other, "master", "S", "worker")
    assert _refused(lambda: rpc.WorkerStub(ch).Info(pb.Empty(), timeout=10)) == grpc.StatusCode.UNAVAILABLE


# ---- replay against the reference -----------------------------------------------------------------
TABLE_7_2 = [(1, "U", "AAA", 125.0), (1, "U", "BBB", 100.0), (1, "U", "CCC", 150.0), (2, "U", "DDD", 110.0),
             (3, "U", "EEE", 160.0)]  # dissertation Table 7.2 (ts, level, sid, bp)
TABLE_4_2 = [(1, "U", "x", 100.0), (2, "U", "x", 100.0), (3, "TS", "x", 140.0), (4, "U", "x", 160.0)]  # Table 4.2

REPLAY_QUERIES = [
    ("SELECT AVG(bp) FROM Vitals[ROWS 3]", ["double"]),
    ("SELECT AVG(bp) FROM Vitals[ROWS 3] WHERE level = U", ["double"]),
    ("SELECT sid, COUNT(*), MAX(bp) FROM Vitals [RANGE 2 seconds] GROUP BY sid", ["string", "long", "double"]),
    ("SELECT V.sid, P.lat FROM Vitals [ROWS 2] V, Positions [NOW] P WHERE V.sid = P.sid", ["string", "double"]),
    ("SELECT DSTREAM sid, bp FROM Vitals [ROWS 2 level = U]", ["string", "double"]),
    ("SELECT sid, SUM(bp) FROM Vitals GROUP BY sid HAVING COUNT(*) > 1", ["string", "double"]),
]


def _random_streams(seed: int):
    import random

    rnd = random.Random(seed)
    vit, pos = [], []
    for ts in range(1, 9):
        for _ in range(rnd.randint(0, 4)):
            vit.append((ts, rnd.choice(["U", "C", "S", "TS"]), rnd.choice(["a", "b", "c"]),
                        float(rnd.randint(90, 180)), 70.0, 80.0))
        for _ in range(rnd.randint(0, 2)):
            pos.append((ts, rnd.choice(["U", "C", "S", "TS"]), rnd.choice(["a", "b", "c"]),
                        float(rnd.randint(1, 5)), "4E"))
    return vit, pos


REPLAY_TOML = BATTLEFIELD_TOML + """
[streams.T72]
sid = "string"
bp = "double"

[streams.T42]
sid = "string"
bp = "double"
"""


class ReplayGroups:
    """Warm clusters of the replay config for :func:`test_replay_equals_reference`: one per session level
    (U: 2 workers, TS: 3), started on first use.  Each case takes a fresh master (``strata replay
    --cluster``: a new input timeline, no queries) with its chunk length, on exactly as many running
    workers as it names: extra ones are stopped (the cases come in an order that only ever stops one), a
    stopped one is started again if a later case needs it."""

    WORKERS = {"U": 2, "TS": 3}

    def __init__(self, dir: Path):
        self.dir, self.states = dir, {}
        self.config = write_config(dir, REPLAY_TOML, {"ann": "TS"})

    def state(self, level: str, workers: int, chunk: int) -> Path:
        from strata.deploy.local import alive, restart_process
        from strata.private import write_private

        if level not in self.states:
            # every worker from the start: all of them are in the group before the first case
            start_cluster(str(self.config), [level], self.WORKERS[level], self.dir / level)
            self.states[level] = self.dir / level
        state = self.states[level]
        procs = json.loads((state / "cluster.json").read_text())["processes"]
        for p in procs:
            if p["role"] != "worker":
                continue
            wanted = int(p["name"].rsplit("-", 1)[1]) < workers
            if wanted and not alive(p["pid"]):
                restart_process(state, p["name"])
            elif not wanted and alive(p["pid"]):
                os.killpg(p["pid"], signal.SIGTERM)
                poll(lambda: not alive(p["pid"]), 30, 0.05)
                assert not alive(p["pid"]), f"{p['name']} did not stop"
        # the chunk length of the fresh master that `strata replay --cluster` starts (renew_master runs the
        # recorded command again), as `strata up --chunk-seconds` would have started it
        record = json.loads((state / "cluster.json").read_text())
        cmd = next(p for p in record["processes"] if p["role"] == "master")["cmd"]
        if "--chunk-seconds" in cmd:
            cmd[cmd.index("--chunk-seconds") + 1] = repr(float(chunk))
        else:
            cmd += ["--chunk-seconds", repr(float(chunk))]
        write_private(state / "cluster.json", json.dumps(record, indent=2))
        return state

    def stop(self) -> None:
        for state in self.states.values():
            stop_cluster(state)


@pytest.fixture(scope="module")
def replay_groups(tmp_path_factory):
    groups = ReplayGroups(tmp_path_factory.mktemp("replay"))
    _SHARED["replay_groups"] = groups.stop
    yield groups
    _SHARED.pop("replay_groups", None)
    groups.stop()


# in this order, each level's warm cluster only loses a worker: (2, 1) and (1, 2) at U, (3, 1) and (2, 2) at TS
@pytest.mark.parametrize("workers, chunk", [(2, 1), (3, 1), (1, 2), (2, 2)])
def test_replay_equals_reference(tmp_path, replay_groups, workers, chunk):
    """Tables 7.2 and 4.2 and random queries in one replay (separate streams, so
    each table starts from empty windows) with 1-3 workers and chunk lengths 1-2: every worker
    count, both chunk lengths and both sessions (U and TS) twice, on a warm cluster per session level
    (``replay_groups``): a fresh master of that chunk length and exactly ``workers`` workers each time.
    (The embedded clusters of ``strata replay``: the tests below.)"""
    cfg_path = replay_groups.config
    cfg = load_config(cfg_path)
    vit, pos = _random_streams(seed=workers * 10 + chunk)
    level = "U" if (workers + chunk) % 2 else "TS"
    state = replay_groups.state(level, workers, chunk)
    files = {
        "T72": (["ts", "level", "sid", "bp"], TABLE_7_2),
        "T42": (["ts", "level", "sid", "bp"], TABLE_4_2),
        "Vitals": (["ts", "level", "sid", "bp", "pr", "weight"], vit),
        "Positions": (["ts", "level", "sid", "lat", "lon"], pos),
    }
    queries = [("SELECT AVG(bp) FROM T72[ROWS 3]", ["double"]),
               ("SELECT AVG(bp) FROM T42[ROWS 3] WHERE level = U", ["double"])] + REPLAY_QUERIES
    args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", level, "--output", str(tmp_path / "out"),
            "--cluster", str(state)]
    streams = {}
    for name, (header, rows) in files.items():
        path = tmp_path / f"{name}.csv"
        write_csv(path, header, rows)
        args += ["--input", f"{name}={path}"]
        streams[name] = [dict(zip(header, r)) for r in rows]
    for q, _ in queries:
        args += ["--query", q]
    r = strata(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    # the master that ran: a fresh one, with this chunk length, whose group holds exactly `workers` workers
    record = json.loads((state / "cluster.json").read_text())
    master = next(p for p in record["processes"] if p["role"] == "master")
    argv = Path(f"/proc/{master['pid']}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--chunk-seconds") + 1] == repr(float(chunk)), argv
    with login({"masters": {level: master["address"]}, "tls": record["tls_dir"]}, "ann", level) as c:
        def group():
            sids = [w.sid for w in c.status().workers]
            return sids if len(sids) == workers else None

        assert poll(group), [w.sid for w in c.status().workers]
    for i, (q, types) in enumerate(queries, 1):
        got = read_out(tmp_path / "out" / f"q{i}.csv", types)
        compare_results(got, evaluate(q, cfg, level, streams))
    # the dissertation's printed answers
    assert read_out(tmp_path / "out" / "q1.csv", ["double"]) == [(1, "U", 125.0), (2, "U", 120.0), (3, "U", 140.0)]
    want = {"U": [(1, "U", 100.0), (2, "U", 100.0), (4, "U", 120.0)],
            "TS": [(1, "U", 100.0), (2, "U", 100.0), (3, "U", 100.0), (4, "U", 130.0)]}[level]
    assert sorted(read_out(tmp_path / "out" / "q2.csv", ["double"])) == want


def test_replay_exit_codes(tmp_path):
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML, {"ann": "S"})
    v = tmp_path / "v.csv"
    write_csv(v, ["ts", "level", "sid", "bp", "pr", "weight"], [(1, "U", "a", 1.0, 1.0, 1.0)])
    base = ["replay", "--config", str(cfg_path), "--user", "ann", "--input", f"Vitals={v}", "--output",
            str(tmp_path / "o.csv"), "--workers", "1"]
    r = strata(*base, "--query", "SELECT bp FROM Vitals WHERE level = TS")
    assert r.returncode == 2 and "authorization" in r.stderr.splitlines()[-1]
    r = strata(*base, "--query", "SELECT bp FROM Vitals", env_extra={"STRATA_PASSWORD": "wrong"})
    assert r.returncode == 3
    r = strata(*[("bob" if a == "ann" else a) for a in base], "--level", "S", "--query", "SELECT bp FROM Vitals")
    assert r.returncode == 3 and r.stderr.splitlines()[-1] == "strata: login failed: unknown user or wrong password"
    assert "starting an embedded cluster" not in r.stderr  # refused before a cluster starts


def test_replay_reads_its_input_while_the_cluster_starts_and_a_bad_file_stops_it(tmp_path):
    """The input is read during the start-up (``InputReader``): a value that is not a double, deep in
    the file, ends the run with the reader's one line (file, line, column), the cluster it had begun
    stopped and its directory gone; a mistyped path is said before anything starts."""
    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML, {"ann": "S"})
    v = tmp_path / "v.csv"
    rows = [(1 + k // 100, "U", "a", 1.0, 1.0, 1.0) for k in range(5000)] + [(60, "U", "a", "high", 1.0, 1.0)]
    write_csv(v, ["ts", "level", "sid", "bp", "pr", "weight"], rows)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    base = ["replay", "--config", str(cfg_path), "--user", "ann", "--output", str(tmp_path / "o.csv"),
            "--workers", "1", "--query", "SELECT AVG(bp) FROM Vitals [ROWS 10]"]
    r = strata(*base, "--input", f"Vitals={v}", env_extra={"TMPDIR": str(scratch)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == \
        f"strata: {v}: line 5002, column bp: 'high' is not a double value (only an empty field is NULL)"
    assert "Traceback" not in r.stderr
    assert not list(scratch.glob("strata-replay-*"))  # the cluster stopped, its directory removed
    r = strata(*base, "--input", f"Vitals={tmp_path / 'nope.csv'}", env_extra={"TMPDIR": str(scratch)})
    assert r.returncode != 0 and "nope.csv: No such file or directory" in r.stderr.splitlines()[-1]
    assert "starting an embedded cluster" not in r.stderr
    assert not list(scratch.glob("strata-replay-*"))


# ---- Chinese Wall audit queries (dissertation §8.3) ------------------------------------------------
def test_chinese_wall_audit_queries(tmp_path):
    cfg_path = write_config(tmp_path, CHINESE_WALL_TOML, {"cloud": "[T,T]"})
    cfg = load_config(cfg_path)
    header = ["ts", "level", "serviceId", "msgType", "sender", "receiver", "timestamp", "outcome"]
    rows = [
        (1, "[1,⊥]", "5", "send", "Company1", "CompanyB", 100, "success"),
        (1, "[⊥,B]", "5", "receive", "CompanyB", "Company1", 104, "success"),
        (2, "[⊥,A]", "7", "send", "CompanyA", "CompanyC", 200, "failure"),
        (2, "[⊥,C]", "7", "receive", "CompanyC", "CompanyA", 210, "success"),
        (3, "[⊥,B]", "7", "send", "CompanyB", "CompanyC", 300, "success"),
        (3, "[2,⊥]", "9", "send", "Company2", "CompanyA", 301, "success"),
        (4, "[1,⊥]", "5", "receive", "Company1", "CompanyB", 410, "success"),
    ]
    f = tmp_path / "log.csv"
    write_csv(f, header, rows)
    streams = {"MessageLog": [dict(zip(header, r)) for r in rows]}
    cases = {
        "[1,B]": [
            ('SELECT MIN(timestamp), MAX(timestamp) FROM MessageLog [ROWS 100] '
             'WHERE outcome = "success" AND serviceId = "5"', ["long", "long"]),
            ('SELECT R.timestamp - S.timestamp AS delay FROM MessageLog R[Rows 100], MessageLog S[Rows 100] '
             'WHERE S.msgType = "send" AND S.outcome = "success" AND R.msgType = "receive" '
             'AND R.outcome = "success" AND S.serviceId = R.serviceId', ["long"]),
        ],
        "[T,T]": [
            ('SELECT serviceId, MIN(timestamp), MAX(timestamp) FROM MessageLog[ROWS 100] '
             'WHERE outcome = "success" GROUP BY serviceId', ["string", "long", "long"]),
        ],
    }
    seen_levels = set()
    for level, qs in cases.items():
        out = tmp_path / f"out{len(seen_levels)}"
        args = ["replay", "--config", str(cfg_path), "--user", "cloud", "--level", level, "--workers", "1",
                "--input", f"MessageLog={f}", "--output", str(out)]
        for q, _ in qs:
            args += ["--query", q]
        r = strata(*args, env_extra=WARM_UP)  # the embedded run as users run it, warm-up included
        assert r.returncode == 0, r.stderr[-3000:]
        for i, (q, types) in enumerate(qs, 1):
            path = out if len(qs) == 1 else out / f"q{i}.csv"
            got = read_out(path, types)
            compare_results(got, evaluate(q, cfg, level, streams))
            seen_levels.update(r[1] for r in got)
    assert "[1,B]" in seen_levels and "[⊥,T]" in seen_levels


def test_a_lazy_worker_joins_once_the_run_has_lasted_as_long_as_the_first_start_up(tmp_path):
    """``embedded_start`` on few cores: the second worker starts only after as long again as the first
    took to be ready (``strata worker --start-lazily``), then joins the group; a run that ends sooner
    (stop_cluster) never pays for its JVM."""
    from strata.deploy.local import workers_ready_after

    cfg = write_config(tmp_path, BATTLEFIELD_TOML, {"sam": "S"})
    state = tmp_path / "state"
    # the first worker warms up with the run's queries (WARM_UP: as an embedded run's do); the lazy one
    # without (the suite's default, conftest.py): the wait before its start is what is checked
    started = start_cluster(str(cfg), ["S"], 2, state, wait="first", stagger=True, lazy=True,
                            warm_queries=["SELECT AVG(bp) FROM Vitals [ROWS 100]"], worker_env={0: WARM_UP})
    try:
        # the run's query texts for the warm-up: readable by this user only
        assert (state / "run" / "warm-queries.json").stat().st_mode & 0o777 == 0o600
        first = started["seconds"]["first"]
        assert started["seconds"]["all"] is None
        deadline = time.monotonic() + 180
        while workers_ready_after(started)[1] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = workers_ready_after(started)
        assert ready[1] is not None, (state / "logs" / "worker-S-1.log").read_text()[-2000:]
        assert ready[1] >= 2 * ready[0] - 0.5  # waited as long again, then started (and its start-up took time)
        assert "if the run still goes on" in (state / "logs" / "worker-S-1.log").read_text()
        assert first is not None
    finally:
        stop_cluster(state)
