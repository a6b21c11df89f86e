"""`strata scale` on a level's Ray cluster that spans two "hosts" (network namespaces).

Topology (tests/netns_hosts.py's Topology):

    bridge namespace  sr<pid>-br : br0 (multicast snooping off), one veth per host
    a  10.79.0.2   the S master and its first worker (`strata deploy`, transport netns);
                   the level's Ray head offering no worker CPU, and the scaler: either
                   ``head``: `strata scale --node-ip 10.79.0.2 --ray-cpus 0` starts the head, or
                   ``join``: `strata scale node --head --node-ip 10.79.0.2 --ray-cpus 0` runs it
                   and `strata scale --node-ip 10.79.0.2` joins it (the config's
                   ``[groups."S"] ray_address``)
    b  10.79.0.3   `strata scale node --address 10.79.0.2:46200 --node-ip 10.79.0.3`: a Ray
                   node of level S offering one CPU; its own state dir with the level's group
                   key, worker certificates, the Ray CA certificate, its node certificate and
                   the level's Ray token (copied as an operator would)

Multicast heartbeats cross the bridge only (ttl 1).  A client on host a keeps a backlog in
front of the single worker (as tests/test_scaler.py does); the scaler adds a worker, Ray
places it on host b (the only node with a CPU), it listens on b's address, joins the group
across the bridge and computes chunks; when the input stops, the group idles and the
scaler drains that worker on b.  The query outputs equal the reference evaluator.  On the
way: every Ray listener on both hosts is on its host's address (never 0.0.0.0: the bind
shim), and the head's GCS refuses a peer without a certificate of the level's Ray CA, one
with another level's CA, and a call without the level's token.

Skips where namespaces cannot be created (as tests/test_deploy_netns.py does) and -- with the
measured reason -- when Ray itself does not start within its fixed time-outs on a busy host.
That test is marked netns, slow and ray; the unit tests after it (command lines, ports,
certificates, the bind shim, a pool worker's command on its node) are not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from strata.config import load_config
from strata.examples import BATTLEFIELD_TOML

from .reference.evaluator import compare_results, evaluate
from .helpers import PASSWORD, add_users, gone
from .netns_hosts import deploy, namespaces, skip_reason


SUBNET = "10.79.0"
RAY_HOSTS = {"a": 2, "b": 3}  # host → last octet
GROUP, MCAST_PORT, RAY_PORT = "239.255.79.3", 47300, 46200
PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
QUERIES = ["SELECT sid, AVG(bp), COUNT(*) FROM Vitals [ROWS 100] GROUP BY sid",
           "SELECT AVG(bp) FROM Vitals [ROWS 30]"]
# the time-outs Ray has fixed for its own start-up (its raylet: 30 s to register; its GCS port file)
#: Ray's own start-up time-outs on a busy host (a GCS that never answered makes Ray read a gcs_server.err
#: it no longer writes); deploy/ray_pool.py retries each once
RAY_DID_NOT_START = ("timed out during startup", "Timed out waiting for file", "gcs_server.err")

CONFIG = BATTLEFIELD_TOML + f"""
[cluster]
load_reading = "process"     # each worker's own processes: other load on this host does not make the group busy

[groups."S"]
ray_port = {RAY_PORT}         # the level's Ray ports: GCS {RAY_PORT}, the nodes' others above it
"""
JOIN = f'ray_address = "{SUBNET}.{RAY_HOSTS["a"]}:{RAY_PORT}"   # the scaler joins the level\'s running Ray cluster\n'

INVENTORY = """\
[deployment]
name = "ray-hosts-test"
config = "strata.toml"
state_dir = "{state}/default"
python = "{python}"
secrets = "secrets"
tls = {tls}
transport = "netns"
chunk_seconds = 1.0
ready_timeout = 300

[levels.S]
address = "{group}"
port = {port}
ttl = 1

[[hosts]]
name = "a"
netns = "{ns_a}"
address = "{addr_a}"
state_dir = "{state}/a"
levels = {{ S = {{ workers = 1, master = true }} }}
"""

# The client: runs on host a (the root namespace has no route to the bridge).  Started while the Ray
# nodes start (its imports and log-in overlap theirs), it registers the queries, then waits for the
# test's "feed" (host b's node is up) to keep a backlog in front of the group until the test says
# "go", then lets it drain, finishes the input and writes every row it ingested and every result row
# it received.
DRIVER = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import pyarrow as pa
from strata.client import Client
from tests.tables import collect_in_background

master, tls, b_ip, work = sys.argv[1:5]
queries = json.loads(sys.argv[5])
T0 = time.monotonic()
progress = open(os.path.join(work, "progress.jsonl"), "a", buffering=1)

def note(**kw):
    kw["t"] = round(time.monotonic() - T0, 1)
    progress.write(json.dumps(kw) + "\n")

def client():
    c = Client(master, tls_dir=tls or None, level="S", timeout=60)
    c.login("sam", os.environ["STRATA_PASSWORD"], "S")
    return c

c, sub = client(), client()
qids = [r.query_id for r in c.register(queries)]
got, ended = collect_in_background(sub, qids)
first = {w.sid for w in c.status().workers}
note(phase="ready", workers=sorted(first), wall=time.time())
deadline = time.monotonic() + 600
while not os.path.exists(os.path.join(work, "feed")) and time.monotonic() < deadline:
    time.sleep(0.05)
first = {w.sid for w in c.status().workers}
note(phase="start", workers=sorted(first))
vitals, ts = [], 0

def feed(n):
    global ts
    rows = []
    for _ in range(n):
        ts += 1
        rows += [{"ts": ts, "level": "UCS"[(ts + k) % 3], "sid": f"s{k % 8}", "bp": float(90 + (7 * ts + k) % 70),
                  "pr": 1.0, "weight": 1.0} for k in range(40)]
    vitals.extend(rows)
    c.ingest([("Vitals", pa.Table.from_pylist(rows))], labelled=True)
    c.advance(upto_ts=ts)

go, new, joined, last = os.path.join(work, "go"), None, set(), {}
deadline = time.monotonic() + 480
while time.monotonic() < deadline and not os.path.exists(go):
    st = c.status()
    if st.backlog_chunks < 12:
        feed(6)
    for w in st.workers:
        if w.sid not in first:
            last[w.sid] = w.chunks_done
            if w.sid not in joined:
                joined.add(w.sid)
                note(phase="joined", sid=w.sid, backlog=st.backlog_chunks)
            if new is None and w.sid.rsplit(":", 1)[0] == b_ip and w.chunks_done > 0:
                new = w.sid
                note(phase="scaled", sid=w.sid, chunks_done=w.chunks_done, instants=ts,
                     workers=[(x.sid, x.chunks_done) for x in st.workers])
    time.sleep(0.2)
note(phase="fed", instants=ts, rows=len(vitals), new=new)
deadline = time.monotonic() + 240
while new and time.monotonic() < deadline:
    st = c.status()
    if new in {w.sid for w in st.workers}:
        last[new] = next(w.chunks_done for w in st.workers if w.sid == new)
    else:
        note(phase="drained", sid=new, workers=[(x.sid, x.chunks_done) for x in st.workers])
        break
    time.sleep(0.1)
c.advance(finish=True)
done = ended.wait(300)
note(phase="finished", ended=done)
with open(os.path.join(work, "results.json.tmp"), "w") as f:
    json.dump({"vitals": vitals, "got": [got[q] for q in qids], "ended": done, "new": new, "chunks": last}, f)
os.replace(os.path.join(work, "results.json.tmp"), os.path.join(work, "results.json"))
"""

# A peer on host b talks to the head's GCS: (1) no client certificate, (2) a certificate of
# another level's Ray CA, (3) the level's certificate without the token, (4) with it.
PROBE = r"""
import grpc, json, sys
target, ca, good_crt, good_key, bad_crt, bad_key, token_file = sys.argv[1:8]
read = lambda p: open(p, "rb").read()

def call(crt, key, token):
    creds = grpc.ssl_channel_credentials(read(ca), read(key) if key else None, read(crt) if crt else None)
    ch = grpc.secure_channel(target, creds)
    md = [("authorization", "Bearer " + read(token_file).decode().strip())] if token else []
    try:
        reply = ch.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo")(b"", timeout=15, metadata=md)
        return "OK", len(reply)
    except grpc.RpcError as e:
        return e.code().name, (e.details() or "")[:120]
    finally:
        ch.close()

print(json.dumps({"no certificate": call(None, None, True), "another level's CA": call(bad_crt, bad_key, True),
                  "level certificate, no token": call(good_crt, good_key, False),
                  "level certificate and token": call(good_crt, good_key, True)}))
"""


def _ray_skip_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install ray)"
    return None


@pytest.fixture(scope="module")
def topo():
    with namespaces("sr", SUBNET, RAY_HOSTS, skip_reason() or _ray_skip_reason()) as t:
        yield t


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {p.pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> float:
    """Seconds until ``path`` exists; skips when ``proc`` exited because Ray missed its own start-up
    time-outs (the machine too busy), fails for any other exit."""
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            if any(s in text for s in RAY_DID_NOT_START):
                pytest.skip(f"{what}: Ray did not start within its own fixed time-outs after "
                            f"{time.monotonic() - t0:.0f} s (a busy host); not exercised: {text[-600:]}")
            raise AssertionError(f"{what} exited ({proc.returncode}):\n{text[-4000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: no {path.name} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return time.monotonic() - t0


def _progress(work: Path) -> list[dict]:
    f = work / "progress.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _stop(*procs: subprocess.Popen | None, grace: float = 90) -> list[int | str | None]:
    """SIGTERM to each (all at once, in this order), then -- for one that has not exited ``grace`` s
    later -- SIGKILL to its whole tree; each one's exit code, or "killed" (None: never started)."""
    trees = {}
    for proc in procs:
        if proc is not None and proc.poll() is None:
            trees[proc.pid] = _tree(proc.pid)
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    out = []
    for proc in procs:
        if proc is None:
            out.append(None)
            continue
        try:
            out.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for pid in trees.get(proc.pid, set()) | _tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait(10)
            out.append(f"killed: no exit within {grace:.0f} s of SIGTERM")
    return out


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["head", "join"])
def test_scale_places_a_worker_on_another_host_and_drains_it(topo, tmp_path, mode):
    from strata.deploy.ray_pool import ensure_ray_ca, issue_node_cert, node_cert_paths, ray_tls_dir, token_path

    marks: dict[str, float] = {}
    t_start = time.monotonic()
    d = tmp_path
    cfg_path = d / "strata.toml"
    cfg_path.write_text(CONFIG + (JOIN if mode == "join" else ""))
    cfg = load_config(cfg_path)
    add_users(cfg_path, {"sam": "S"})
    import importlib.util

    tls = importlib.util.find_spec("strata.tls") is not None
    state = d / "state"
    a_ip, b_ip = topo.address("a"), topo.address("b")
    inv = d / "inventory.toml"
    inv.write_text(INVENTORY.format(state=state, python=PY, tls="true" if tls else "false", group=GROUP,
                                    port=MCAST_PORT, ns_a=topo.ns["a"], addr_a=a_ip))
    scaler = node = head = driver = probe = cert = None
    deployed = False
    logs = {k: d / f"{k}.log" for k in ("scaler", "node", "head", "driver")}
    work = d / "work"
    work.mkdir()
    seen_b: set[int] = set()
    sa, sb = state / "a", state / "b"
    try:
        # `strata deploy up` in the background: in ``join`` mode the level's Ray nodes start meanwhile
        # (they need no master; the scaler does)
        up: dict = {}

        def deploy_up():
            try:
                up["r"] = deploy("up", "--inventory", str(inv), timeout=600)
            except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
                up["error"] = e
            up["t"] = time.monotonic() - t_start

        up_thread = threading.Thread(target=deploy_up, daemon=True)
        up_thread.start()
        deployed = True
        # from the head's host (`strata scale cert`): the Ray CA certificate, b's node certificate and
        # the level's Ray token for host b's state dir (the Ray CA key stays in host a's STATE/ray)
        cert = subprocess.Popen([PY, "-m", "strata", "scale", "cert", "--config", str(cfg_path), "--level", "S",
                                 "--state-dir", str(sa), "--ip", b_ip, "--out", str(sb)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = cert.communicate(timeout=120)
        assert cert.returncode == 0, err
        assert (ray_tls_dir(sb, "S") / "ca.pem").exists() and token_path(sb, "S").stat().st_mode & 0o077 == 0
        assert not (ray_tls_dir(sb, "S") / "ca.key").exists()  # the Ray CA key stays on the head's host

        env = {**os.environ, "STRATA_PASSWORD": PASSWORD, "STRATA_GROUP_ADDRESS": GROUP, "STRATA_GROUP_TTL": "1"}

        def start_node_b():
            with open(logs["node"], "wb") as f:
                return subprocess.Popen(
                    ["ip", "netns", "exec", topo.ns["b"], PY, "-m", "strata", "scale", "node", "--config",
                     str(cfg_path), "--level", "S", "--state-dir", str(sb), "--address", f"{a_ip}:{RAY_PORT}",
                     "--node-ip", b_ip, "--ray-cpus", "1"],
                    # an injected idle reading for the workers placed on b (as bench/e2e.py does): the master's
                    # pick among free workers (master/dispatch.py: free slots, then load in 10 % buckets, then
                    # round robin) does not depend on what else this machine runs meanwhile
                    stdout=f, stderr=subprocess.STDOUT, env={**env, "STRATA_CPU_OVERRIDE": "0"}, cwd=str(d))

        def node_b_up():
            marks["Ray node up (host b)"] = _wait_file(sb / "run" / "ray-node-S.json", node, logs["node"], 300,
                                                       "strata scale node (host b)")
            record_b = json.loads((sb / "run" / "ray-node-S.json").read_text())
            assert record_b["node_ip"] == b_ip and record_b["address"] == f"{a_ip}:{RAY_PORT}"
            marks["Ray node start-up in the process (host b)"] = record_b["started_in"]

        def start_driver():  # the load's client on host a: logs in and registers, feeds once b's node is up
            with open(logs["driver"], "wb") as f:
                return subprocess.Popen(["ip", "netns", "exec", topo.ns["a"], PY, "-c", DRIVER, master, client_tls,
                                         b_ip, str(work), json.dumps(QUERIES)],
                                        stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))

        # the head on a, offering no CPU: every worker the scaler starts lands on another host's node
        if mode == "join":
            with open(logs["head"], "wb") as f:
                head = subprocess.Popen(
                    ["ip", "netns", "exec", topo.ns["a"], PY, "-m", "strata", "scale", "node", "--config",
                     str(cfg_path), "--level", "S", "--state-dir", str(sa), "--head", "--node-ip", a_ip,
                     "--ray-cpus", "0"], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(d))
            marks["Ray head up (strata scale node --head)"] = _wait_file(
                sa / "run" / "ray-node-S.json", head, logs["head"], 300, "strata scale node --head (host a)")
            marks["Ray head start-up in the process"] = json.loads(
                (sa / "run" / "ray-node-S.json").read_text())["started_in"]
            node = start_node_b()
            node_b_up()
        up_thread.join(660)
        if "error" in up:
            raise up["error"]
        r = up["r"]
        assert r.returncode == 0, f"deploy up failed:\n{r.stderr[-6000:]}"
        out = json.loads(r.stdout)
        marks["deploy up"] = up["t"]
        master = out["masters"]["S"]
        first = list(out["workers"]["S"])
        assert master.startswith(a_ip + ":") and [w.rsplit(":", 1)[0] for w in first] == [a_ip]
        client_tls = str(d / "secrets" / "tls") if tls else ""

        # the rest of host b's state dir, as an operator would make it: the level's group key and worker
        # certificates (from host a)
        (sb / "keys").mkdir(parents=True, mode=0o700)
        shutil.copy2(sa / "keys" / "S.key", sb / "keys" / "S.key")
        if tls:
            (sb / "tls").mkdir(mode=0o700)
            for f in ("ca.pem", "worker-S.pem", "worker-S.key"):
                shutil.copy2(sa / "tls" / f, sb / "tls" / f)

        with open(logs["scaler"], "wb") as f:
            scaler = subprocess.Popen(
                ["ip", "netns", "exec", topo.ns["a"], PY, "-m", "strata", "scale", "--config", str(cfg_path),
                 "--level", "S", "--master", master, "--user", "sam", "--state-dir", str(sa),
                 *(["--tls-dir", client_tls] if tls else ["--insecure"]), "--node-ip", a_ip,
                 *(["--ray-cpus", "0"] if mode == "head" else []),
                 "--multicast-port", str(MCAST_PORT), "--min", "1", "--max", "2", "--interval", "0.5",
                 "--up-backlog", "2", "--up-sustain", "1", "--down-idle", "3", "--down-cooldown", "5",
                 "--start-timeout", "600"],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(d))
        if mode == "join":
            driver = start_driver()
        marks[f"scaler up ({mode})"] = _wait_file(sa / "run" / "scaler-S.json", scaler, logs["scaler"], 300,
                                                  f"strata scale ({mode})")
        if mode == "head":  # b's node joins the head the scaler started
            node = start_node_b()
            driver = start_driver()
            node_b_up()
        # the load: the client keeps a backlog in front of the single worker (Ray places the scaler's
        # new worker on b, the only node with a CPU)
        (work / "feed").touch()
        t_both = time.monotonic()  # the scaler and b's node up

        # meanwhile, from host b, a peer talks to the head's GCS (checked below): TLS with the level's
        # Ray CA and the level's token, both required
        other = d / "other-level"
        ensure_ray_ca(other, "TS")
        issue_node_cert(other, "TS", b_ip)
        good_crt, good_key = node_cert_paths(ray_tls_dir(sb, "S"), b_ip)
        bad_crt, bad_key = node_cert_paths(ray_tls_dir(other, "TS"), b_ip)
        probe = subprocess.Popen(["ip", "netns", "exec", topo.ns["b"], PY, "-c", PROBE, f"{a_ip}:{RAY_PORT}",
                                  str(ray_tls_dir(sb, "S") / "ca.pem"), str(good_crt), str(good_key), str(bad_crt),
                                  str(bad_key), str(token_path(sb, "S"))],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def scaler_state():
            try:
                return json.loads((sa / "run" / "scaler-S.json").read_text())
            except (OSError, ValueError):
                return {}

        def scaler_saw_b() -> bool:
            """Whether the scaler lists b's node as alive (it must within 60 s of both being up)."""
            if "Ray node seen by the scaler" in marks:
                return True
            if not any(n["ip"] == b_ip and n["alive"] for n in scaler_state().get("ray", {}).get("nodes", [])):
                assert time.monotonic() - t_both < 60, f"the scaler never saw b's node: {scaler_state()}"
                return False
            marks["Ray node seen by the scaler"] = time.monotonic() - t_both
            ray_info = scaler_state()["ray"]
            assert ray_info["mode"] == mode and ray_info["gcs_address"] == f"{a_ip}:{RAY_PORT}", ray_info
            marks[f"Ray {'head start-up' if mode == 'head' else 'connect'} in the scaler"] = ray_info["started_in"]
            assert ray_info["ports"]["gcs"] == RAY_PORT and ray_info["ports"]["workers"] == [RAY_PORT + 10,
                                                                                             RAY_PORT + 49]
            return True

        t0 = time.monotonic()
        while not any(p["phase"] == "scaled" for p in _progress(work)):
            assert driver.poll() is None, f"client exited:\n{logs['driver'].read_text()[-3000:]}"
            assert scaler.poll() is None, logs["scaler"].read_text()[-3000:]
            assert node.poll() is None, logs["node"].read_text()[-3000:]
            scaler_saw_b()
            seen_b |= _tree(node.pid)
            if time.monotonic() - t0 > 600:
                pytest.fail(f"no worker on host b did chunks: {_progress(work)[-5:]}\n"
                            f"{logs['scaler'].read_text()[-3000:]}")
            time.sleep(0.1)
        scaled = next(p for p in _progress(work) if p["phase"] == "scaled")
        marks["worker on b did a chunk"] = time.monotonic() - t_start
        new_sid = scaled["sid"]
        assert new_sid.rsplit(":", 1)[0] == b_ip, scaled  # it listens on ITS node's address
        t0 = time.monotonic()  # (the scaler's state file follows its next tick: the worker may be faster)
        while not (mine := [w for w in scaler_state().get("workers", []) if w["sid"] == new_sid]):
            assert time.monotonic() - t0 < 30, scaler_state()
            time.sleep(0.1)
        assert mine[0]["node_ip"] == b_ip and mine[0]["pid"] in topo.pids("b"), scaler_state()
        assert str(sb) in (mine[0]["log"] or ""), mine  # its log on b's state dir
        worker_tree = set(mine[0]["tree"]) | _tree(mine[0]["pid"])
        seen_b |= _tree(node.pid) | worker_tree
        assert _cmd(mine[0]["pid"]).count("--spark-master") == 0  # the level's Spark from the config
        while not scaler_saw_b():
            time.sleep(0.1)

        # every Ray listener on both hosts on that host's address (the Strata workers and their JVMs apart)
        strata_procs = set()
        for pid in topo.pids("a") | topo.pids("b"):
            if " -m strata worker" in _cmd(pid) or " -m strata master" in _cmd(pid):
                strata_procs |= _tree(pid)
        ray_a = ((_tree(scaler.pid) | (_tree(head.pid) if head else set())) & topo.pids("a")) - strata_procs
        ray_b = (_tree(node.pid) & topo.pids("b")) - strata_procs
        assert len(ray_a) >= 4 and len(ray_b) >= 3, (ray_a, ray_b)
        # (psutil reads the socket tables of the namespace it runs in: ask from inside each host; both at once)
        checks = {h: subprocess.Popen(
            ["ip", "netns", "exec", topo.ns[h], PY, "-c",
             "import json, sys; from strata.deploy.ray_pool import listeners_outside; "
             "print(json.dumps([listeners_outside(json.loads(sys.argv[1]), sys.argv[2]), "
             "listeners_outside(json.loads(sys.argv[1]), None)]))", json.dumps(sorted(pids)), ip],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h, ip, pids in (("a", a_ip, ray_a), ("b", b_ip, ray_b))}
        ss = {h: [line.split() for line in topo.run(h, "ss", "-ltnpH").stdout.splitlines() if line.strip()]
              for h in ("a", "b")}  # State Recv-Q Send-Q Local Peer Process
        for h, p in checks.items():
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            outside, listening = json.loads(stdout)
            assert outside == [] and len(listening) >= 3, (outside, listening)
            print(f"Ray processes' listeners on host {h} (psutil): "
                  + ", ".join(sorted(f"{c[3]}:{c[4]} {c[1]}" for c in listening)))

        def local(f):  # ss's local address as "ip:port" ([::ffff:10.79.0.2]:46200 → 10.79.0.2:46200)
            host, port = f[3].rsplit(":", 1)
            return f"{host.strip('[]').removeprefix('::ffff:')}:{port}"

        def pids_of(f):  # users:(("raylet",pid=123,fd=4),...)
            return {int(x.split(",")[0]) for x in f[-1].split("pid=")[1:]}

        for h, ip, pids in (("a", a_ip, ray_a), ("b", b_ip, ray_b)):
            ray_lines = [f for f in ss[h] if pids_of(f) & pids]
            assert any('"raylet"' in f[-1] for f in ray_lines), ss[h]
            for f in ray_lines:  # never 0.0.0.0, [::] or *
                assert local(f).rsplit(":", 1)[0] == ip, f
            print(f"Ray listeners on host {h} (ss): " + ", ".join(f"{local(f)} {f[-1].split(chr(34))[1]}"
                                                                  for f in ray_lines))
        assert any(local(f) == f"{a_ip}:{RAY_PORT}" and '"gcs_server"' in f[-1] for f in ss["a"]), ss["a"]
        # the worker on b serves gRPC on b's address
        assert any(local(f) == new_sid for f in ss["b"]), ss["b"]

        # no more input: the group idles and the scaler drains the worker on b
        (work / "go").touch()
        t_go = time.monotonic()

        # the head's GCS (the probe from host b, started above): TLS with the level's Ray CA and the
        # level's token, both required
        stdout, stderr = probe.communicate(timeout=120)
        assert probe.returncode == 0, stderr
        res = json.loads(stdout)
        assert res["level certificate and token"][0] == "OK", res
        assert res["level certificate, no token"][0] == "UNAUTHENTICATED", res
        assert res["no certificate"][0] == "UNAVAILABLE" and res["another level's CA"][0] == "UNAVAILABLE", res

        while not (work / "results.json").exists():
            assert driver.poll() is None or (work / "results.json").exists(), logs["driver"].read_text()[-3000:]
            assert time.monotonic() - t_go < 700, f"{_progress(work)[-5:]}\n{logs['scaler'].read_text()[-3000:]}"
            time.sleep(0.1)
        phases = {p["phase"]: p for p in _progress(work)}
        assert "drained" in phases, f"{_progress(work)[-5:]}\n{logs['scaler'].read_text()[-3000:]}"
        marks["worker on b drained"] = marks["worker on b did a chunk"] + phases["drained"]["t"] - scaled["t"]
        assert [sid for sid, _ in phases["drained"]["workers"]] == first
        text = logs["scaler"].read_text()
        assert "decision +1" in text and "behind" in text and f"draining {new_sid}" in text and "decision -1" in text
        assert f"Ray node {b_ip} up" in text
        t0 = time.monotonic()
        while [p for p in worker_tree if not gone(p)] and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert not [p for p in worker_tree if not gone(p)], "the drained worker on b still runs"
        assert phases["finished"]["ended"]

        res = json.loads((work / "results.json").read_text())
        assert res["chunks"][new_sid] >= 1
        streams = {"Vitals": res["vitals"]}
        for q, rows in zip(QUERIES, res["got"]):
            assert rows, f"{q}: no output"
            compare_results([tuple(r) for r in rows], evaluate(q, cfg, "S", streams))
        marks["outputs checked"] = time.monotonic() - t_start
    finally:
        for p in (driver, probe, cert):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        if node is not None:
            seen_b |= _tree(node.pid)
        # b's node and the scaler at once: b's raylet then leaves a head whose GCS still answers (after
        # the head's GCS, a node takes ~8 s more to stop: its raylet is killed, its agents waited for)
        rc_node, rc_scaler = _stop(node, scaler)
        temp_dirs = []
        for rec in (state / "a" / "run" / "scaler-S.json", state / "b" / "run" / "ray-node-S.json",
                    state / "a" / "run" / "ray-node-S.json"):
            try:
                temp_dirs.append(json.loads(rec.read_text()).get("temp_dir") or "")
            except (OSError, ValueError):
                pass
        down = None
        if deployed:  # `deploy down` (the master and its worker) while the head (join mode) stops
            up_thread.join(660)  # (a failure while `deploy up` still ran: down after it)
            down = threading.Thread(target=deploy, args=("down", "--inventory", str(inv)))
            down.start()
        rc_head, = _stop(head)
        for tmp in temp_dirs:
            if tmp.startswith(tempfile_root()):
                shutil.rmtree(tmp, ignore_errors=True)
        if down is not None:
            down.join(330)
    marks["stopped"] = time.monotonic() - t_start
    assert rc_scaler == 0, logs["scaler"].read_text()[-3000:]
    assert rc_node == 0, logs["node"].read_text()[-3000:]
    assert rc_head == (0 if mode == "join" else None), logs["head"].read_text()[-3000:] if head else ""
    assert "Ray cluster of level S stopped" in logs["scaler"].read_text()
    assert not (state / "a" / "run" / "scaler-S.json").exists()
    assert not (state / "b" / "run" / "ray-node-S.json").exists()
    left = [p for p in seen_b if not gone(p)]
    assert not left and topo.pids("b") == set(), (left, topo.pids("b"))
    t0 = time.monotonic()  # and after `deploy down`, nothing on host a either
    while topo.pids("a") and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert topo.pids("a") == set(), [_cmd(p)[:120] for p in topo.pids("a")]
    print("Ray across hosts: " + ", ".join(f"{k} {v:.1f} s" for k, v in marks.items()))


def tempfile_root() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), "strata-ray-")


# ---- unit tests (no namespaces, no Ray cluster) --------------------------------------------------------
def test_pool_workers_get_a_spark_master_only_when_given(tmp_path):
    from strata.cli import _load_extensions, build_parser
    from strata.deploy.ray_pool import worker_command
    from strata.deploy.scaler import ScalerOptions

    cmd = worker_command("c.toml", "S", tmp_path, tmp_path / "r.json", listen="10.0.0.7:0")
    assert "--spark-master" not in cmd and cmd[cmd.index("--listen") + 1] == "10.0.0.7:0"
    cmd = worker_command("c.toml", "S", tmp_path, tmp_path / "r.json", spark_master="local[2]")
    assert cmd[cmd.index("--spark-master") + 1] == "local[2]"
    assert ScalerOptions("c", "S", "m:1", "u", tmp_path).spark_master is None
    _load_extensions()
    args = build_parser().parse_args(["scale", "--config", "c", "--level", "S", "--master", "m:1", "--user", "u",
                                      "--state-dir", str(tmp_path)])
    assert args.spark_master is None and args.listen is None and args.node_ip is None and args.address is None
    assert args.placement == "spread" and not args.ray_bind_any


def test_pool_worker_builds_its_command_on_its_node(tmp_path, monkeypatch):
    """The actor's command is made where Ray placed it: that node's address, config and state dir."""
    from strata.deploy.ray_pool import NODE_ENV, PoolWorker

    spec = {"level": "S", "config": "/a/strata.toml", "state_dir": str(tmp_path / "a"), "tls_dir": "/a/tls",
            "insecure": False, "multicast_port": 47300, "spark_master": None, "load_reading": "process",
            "listen": None, "env": {"STRATA_GROUP_ADDRESS": GROUP, "STRATA_GROUP_TTL": "1"}}
    prof = {"level": "S", "node_ip": "10.0.0.8", "state_dir": str(tmp_path / "b"), "config": "/b/strata.toml",
            "tls_dir": None}
    monkeypatch.setenv(NODE_ENV, json.dumps(prof))
    w = PoolWorker(spec, "scaled-S-1-1")
    arg = dict(zip(w.cmd, w.cmd[1:]))
    assert arg["--listen"] == "10.0.0.8:0" and arg["--config"] == "/b/strata.toml"
    assert arg["--state-dir"] == str(tmp_path / "b") and arg["--multicast-port"] == "47300"
    assert "--tls-dir" not in w.cmd and "--spark-master" not in w.cmd  # b's own STATE/tls; the level's Spark
    assert w.ready_file == tmp_path / "b" / "run" / "scaled-S-1-1.json"
    assert w.log_file == tmp_path / "b" / "logs" / "scaled-S-1-1.log" and arg["--log-file"] == str(w.log_file)
    assert w.env == {"STRATA_GROUP_ADDRESS": GROUP, "STRATA_GROUP_TTL": "1", "STRATA_GROUP_INTERFACE": "10.0.0.8"}
    # the scaler's own host: its paths hold (and a loopback node keeps the configured interface)
    monkeypatch.setenv(NODE_ENV, json.dumps({**prof, "node_ip": "127.0.0.1", "state_dir": spec["state_dir"],
                                             "config": None}))
    w = PoolWorker(spec, "scaled-S-1-2")
    arg = dict(zip(w.cmd, w.cmd[1:]))
    assert arg["--listen"] == "127.0.0.1:0" and arg["--tls-dir"] == "/a/tls" and arg["--config"] == "/a/strata.toml"
    assert "STRATA_GROUP_INTERFACE" not in w.env
    # a node of another level refuses the actor
    monkeypatch.setenv(NODE_ENV, json.dumps({**prof, "level": "TS"}))
    with pytest.raises(RuntimeError, match="node of level TS"):
        PoolWorker(spec, "scaled-S-1-3")


def test_worker_environment_drops_ray_settings():
    from strata.deploy.ray_pool import worker_environment

    env = worker_environment({"RAY_AUTH_TOKEN_PATH": "/s/ray/S.token", "RAY_USE_TLS": "1",
                              "STRATA_RAY_BIND_IP": "10.0.0.8", "STRATA_RAY_NODE": "{}", "STRATA_SCALE_REEXEC": "1",
                              "PATH": "/bin",
                              "LD_PRELOAD": "/s/ray/strata-bind-0123.so:/usr/lib/other.so", "STRATA_GROUP_TTL": "1"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": "/usr/lib/other.so", "STRATA_GROUP_TTL": "1"}


def test_ray_ports_one_range_per_level(tmp_path):
    from strata.deploy.ray_pool import RayPorts, default_ray_port

    p = RayPorts(46200).as_dict()
    assert (p["gcs"], p["node_manager"], p["object_manager"], p["runtime_env_agent"]) == (46200, 46201, 46202, 46203)
    assert p["workers"] == [46210, 46249]
    for bad in (80, 65500):
        with pytest.raises(ValueError):
            RayPorts(bad)
    cfg_path = tmp_path / "strata.toml"
    cfg_path.write_text(BATTLEFIELD_TOML)
    cfg = load_config(cfg_path)
    bases = [default_ray_port(cfg, lv) for lv in cfg.lattice.levels]
    assert bases == [46000, 46100, 46200, 46300]  # ranges of 100: never two levels on one port
    cfg_path.write_text(BATTLEFIELD_TOML + '\n[groups."S"]\nray_port = 50000\n')
    assert default_ray_port(load_config(cfg_path), "S") == 50000


def test_one_ray_ca_per_level_and_node_certificates(tmp_path):
    import ipaddress

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    from strata.deploy.ray_pool import ensure_ray_ca, issue_node_cert, node_tls, ray_tls_dir, token_path

    head, other, copy = tmp_path / "head", tmp_path / "other", tmp_path / "copy"
    crt, key = issue_node_cert(head, "S", "10.0.0.8", out=copy)
    assert crt == ray_tls_dir(copy, "S") / "node-10.0.0.8.pem" and key.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in ray_tls_dir(copy, "S").iterdir()) == ["ca.pem", "node-10.0.0.8.key",
                                                                         "node-10.0.0.8.pem"]
    assert token_path(copy, "S").read_bytes() == token_path(head, "S").read_bytes()
    assert token_path(copy, "S").stat().st_mode & 0o777 == 0o600
    assert (ray_tls_dir(head, "S") / "ca.key").stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.8") in sans.get_values_for_type(x509.IPAddress)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ensure_ray_ca(head, "S").read_bytes()))
    with pytest.raises((ValueError, InvalidSignature)):  # another level's CA did not issue it
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ensure_ray_ca(other, "TS").read_bytes()))
    # a host without the CA key cannot issue itself a certificate for another address
    with pytest.raises(RuntimeError, match="strata scale cert"):
        node_tls(copy, "S", "10.0.0.9", create_ca=False)
    env = node_tls(copy, "S", "10.0.0.8", create_ca=False)
    assert env["RAY_USE_TLS"] == "1" and env["RAY_TLS_SERVER_CERT"] == str(crt)


def test_bind_shim_moves_wildcard_binds_to_the_node_address(tmp_path):
    from strata.deploy.ray_pool import build_bind_shim

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the bind shim cannot be built here")
    shim = build_bind_shim(tmp_path)
    assert build_bind_shim(tmp_path) == shim  # built once
    probe = (
        "import json, socket\n"
        "def name(fam, addr):\n"
        "    s = socket.socket(fam, socket.SOCK_STREAM)\n"
        "    try:\n"
        "        if fam == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
        "        s.bind((addr, 0)); return s.getsockname()[0]\n"
        "    except OSError: return None\n"
        "    finally: s.close()\n"
        "print(json.dumps([name(socket.AF_INET, '0.0.0.0'), name(socket.AF_INET, '127.0.0.1'),"
        " name(socket.AF_INET6, '::')]))\n")

    def run(env):
        r = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        return json.loads(r.stdout)

    v4, explicit, v6 = run({"LD_PRELOAD": str(shim), "STRATA_RAY_BIND_IP": "127.0.0.1"})
    assert (v4, explicit) == ("127.0.0.1", "127.0.0.1")
    assert v6 in ("::ffff:127.0.0.1", None), v6  # (None: a host without IPv6)
    assert run({"LD_PRELOAD": str(shim)})[0] == "0.0.0.0"  # without an address: untouched


def test_scale_node_and_cert_command_lines(tmp_path):
    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    base = [PY, "-m", "strata", "scale", "node", "--config", str(cfg), "--level", "S", "--state-dir", str(tmp_path)]

    def run(*argv):
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, cwd=str(tmp_path))

    r = run(*base, "--node-ip", "127.0.0.1")
    assert r.returncode == 2 and "either --head" in r.stderr
    r = run(*base, "--head", "--address", "10.0.0.7:46200")
    assert r.returncode == 2 and "not allowed with" in r.stderr
    r = run(*base, "--head")
    assert r.returncode == 2 and "--node-ip is required" in r.stderr
    r = run(*base, "--head", "--node-ip", "192.0.2.77")  # TEST-NET-1: never this host's
    assert r.returncode == 1 and "is not an address of this host" in r.stderr
    r = run(PY, "-m", "strata", "scale", "--config", str(cfg), "--level", "S")
    assert r.returncode == 2 and "--master, --user, --state-dir" in r.stderr
    r = run(PY, "-m", "strata", "scale", "cert", "--config", str(cfg), "--level", "S",
            "--state-dir", str(tmp_path / "h"), "--ip", "10.0.0.8", "--ip", "10.0.0.9")
    assert r.returncode == 0 and r.stdout.count(".pem") == 2, r.stderr


def test_a_failed_ray_start_up_names_its_processes_last_warnings(tmp_path):
    from strata.deploy.ray_pool import _startup_logs

    logs = tmp_path / "session_2026" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(tmp_path / "session_2026")
    (logs / "gcs_server.out").write_text(
        "[2026-11-27 12:58:58,101 I 1 1] (gcs_server) gcs_server_main.cc:98: Ray cluster metadata\n"
        "[2026-11-27 12:58:58,102 E 1 1] (gcs_server) grpc_server.cc:130: Failed to bind 10.79.0.2:46200\n")
    (logs / "raylet.out").write_text("[2026-11-27 12:58:59,000 I 2 2] (raylet) main.cc:283: Setting cluster ID\n")
    why = _startup_logs(tmp_path)
    assert "Failed to bind 10.79.0.2:46200" in why and "metadata" not in why
    assert "raylet.out: " in why and "no warning" in why
    assert "no GCS or raylet log" in _startup_logs(tmp_path / "nowhere") and _startup_logs(None) == "no Ray temp dir"
