"""`strata deploy` across "hosts" that are network namespaces of this machine.

Topology (created and removed by the test; nothing touches the root namespace's
interfaces or routes):

    bridge namespace  <prefix>-br : br0 (multicast snooping off), veth v0..v3
    s1  10.77.0.2   one S worker                       ┐
    s2  10.77.0.3   one S worker                       │  all on br0: multicast
    t1  10.77.0.4   one TS worker                      │  crosses the bridge (ttl 1)
    m   10.77.0.5   the S master and the TS master     ┘

The S and TS groups use the same multicast port, but distinct groups and keys:
the S master's table must list exactly the two S workers (heard across the
bridge), never the TS worker, and a replay through the S master must equal the
reference evaluator.  Skips where namespaces cannot be created (not root, no
CAP_NET_ADMIN, no iproute2); deselect with ``-m "not netns"``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.config import load_config
from strata.users import ROLES, UserStore

from .conftest import BATTLEFIELD_TOML
from .polling import poll as _poll
from .reference.evaluator import compare_results, evaluate

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PASSWORD = "correct horse"
SUBNET = "10.77.0"
HOSTS = {"s1": 2, "s2": 3, "t1": 4, "m": 5}  # host → last octet
PY = sys.executable


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found: cannot create network namespaces"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run as root or deselect with -m 'not netns'"
    probe = f"stprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed (no CAP_NET_ADMIN in this container?): {r.stderr.strip()}"
    try:
        r = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair in a namespace: {r.stderr.strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


class Topology:
    """Namespaces with unique names (from the pid), veth pairs into a bridge in its own namespace."""

    def __init__(self):
        self.prefix = f"st{os.getpid()}"
        self.bridge = f"{self.prefix}-br"
        self.ns = {h: f"{self.prefix}-{h}" for h in HOSTS}
        self.created: list[str] = []

    def address(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def up(self) -> None:
        br = self.bridge
        _ip("netns", "add", br)
        self.created.append(br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self.created.append(ns)
            # the veth pair is made inside the bridge namespace, its peer moved straight into the host's
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def down(self) -> None:
        """Kill whatever still runs in our namespaces (only ours: we created them), then delete them."""
        for ns in reversed(self.created):
            for _ in range(50):
                r = _ip("netns", "pids", ns, check=False)
                pids = [int(x) for x in r.stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _ip("netns", "delete", ns, check=False)
        self.created.clear()

    def run(self, host: str, *argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "STRATA_PASSWORD": PASSWORD, **(env or {})})


def poll(predicate, timeout=30.0, interval=0.2):
    return _poll(predicate, timeout, interval)


def deploy(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "strata", "deploy", *args], capture_output=True, text=True, timeout=timeout)


INVENTORY = """\
[deployment]
name = "netns-test"
config = "strata.toml"
state_dir = "{state}/default"
python = "{python}"
secrets = "secrets"
tls = {tls}
transport = "netns"
chunk_seconds = 1.0
ready_timeout = 240

[levels.S]
address = "239.255.77.3"
port = 47100
ttl = 1

[levels.TS]
address = "239.255.77.4"
port = 47100                     # the same port: only the group address and key keep the levels apart
ttl = 1

[[hosts]]
name = "s1"
netns = "{ns[s1]}"
address = "{addr[s1]}"
state_dir = "{state}/s1"
levels = {{ S = 1 }}

[[hosts]]
name = "s2"
netns = "{ns[s2]}"
address = "{addr[s2]}"
state_dir = "{state}/s2"
levels = {{ S = 1 }}

[[hosts]]
name = "t1"
netns = "{ns[t1]}"
address = "{addr[t1]}"
state_dir = "{state}/t1"
levels = {{ TS = 1 }}

[[hosts]]
name = "m"
netns = "{ns[m]}"
address = "{addr[m]}"
state_dir = "{state}/m"
levels = {{ S = {{ master = true }}, TS = {{ master = true }} }}
"""


@pytest.fixture(scope="module")
def topo():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    t = Topology()
    try:
        t.up()
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def deployed(topo, tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    cfg = d / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML)
    store = UserStore(load_config(cfg).users_path, load_config(cfg).lattice)
    store.add("sam", "S", PASSWORD, replace=True, roles=ROLES)  # ingest, query and cluster status
    store.add("tess", "TS", PASSWORD, replace=True, roles=ROLES)
    tls = _tls_available()
    inv = d / "inventory.toml"
    inv.write_text(INVENTORY.format(state=d / "state", python=PY, ns=topo.ns, tls="true" if tls else "false",
                                    addr={h: topo.address(h) for h in HOSTS}))
    r = deploy("check", "--inventory", str(inv), "--reach")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    r = deploy("up", "--inventory", str(inv))
    up_seconds = time.monotonic() - t0
    info = {"dir": d, "config": cfg, "inventory": inv, "tls": tls, "up_stderr": r.stderr,
            "up_seconds": up_seconds, "down": None}
    try:
        assert r.returncode == 0, f"deploy up failed:\n{r.stderr[-6000:]}"
        info["out"] = json.loads(r.stdout)
        yield info
    finally:
        if info["down"] is None:
            deploy("down", "--inventory", str(inv))


def _tls_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("strata.tls") is not None


def _client_args(deployed, level: str) -> list[str]:
    args = ["--config", str(deployed["config"]), "--level", level]
    if deployed["tls"]:
        args += ["--tls-dir", str(deployed["dir"] / "secrets" / "tls")]
    return args


def _status(topo, deployed, level: str, user: str, host: str = "m") -> dict | None:
    r = topo.run(host, PY, "-m", "strata", "status", *_client_args(deployed, level),
                 "--master", deployed["out"]["masters"][level], "--user", user, "--json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def test_up_reports_progress_and_addresses(topo, deployed):
    out = deployed["out"]
    assert set(out["masters"]) == {"S", "TS"}
    assert out["masters"]["S"].startswith(topo.address("m") + ":")
    assert sorted(w.rsplit(":", 1)[0] for w in out["workers"]["S"]) == [topo.address("s1"), topo.address("s2")]
    assert [w.rsplit(":", 1)[0] for w in out["workers"]["TS"]] == [topo.address("t1")]
    err = deployed["up_stderr"]
    assert "waiting for processes" in err and "master host m hears 2/2 workers" in err, err
    print(f"deploy up took {deployed['up_seconds']:.1f} s (tls={deployed['tls']})")


def test_each_master_lists_exactly_its_levels_workers(topo, deployed):
    """Heartbeats crossed the bridge; the other level's worker never shows up."""
    out = deployed["out"]
    for level, user in (("S", "sam"), ("TS", "tess")):
        want = sorted(out["workers"][level])
        st = poll(lambda: (s := _status(topo, deployed, level, user)) and sorted(w["sid"] for w in s["workers"]) == want
                  and s, timeout=30)
        assert st, f"{level} master's table: {_status(topo, deployed, level, user)}"
        other = out["workers"]["TS" if level == "S" else "S"]
        assert not {w["sid"] for w in st["workers"]} & set(other)
    # and over some more heartbeats, the S table never gains the TS worker
    for _ in range(3):
        st = _status(topo, deployed, "S", "sam")
        assert st and {w["sid"] for w in st["workers"]} == set(out["workers"]["S"])


def test_hosts_receive_only_their_levels_keys_and_certificates(deployed):
    state = deployed["dir"] / "state"
    secrets = deployed["dir"] / "secrets"

    def names(host, sub):
        p = state / host / sub
        return sorted(x.name for x in p.iterdir()) if p.exists() else []

    assert names("s1", "keys") == ["S.key"] and names("s2", "keys") == ["S.key"]
    assert names("t1", "keys") == ["TS.key"]
    assert names("m", "keys") == ["S.key", "TS.key"]
    for host in ("s1", "s2", "m"):  # one key per level, the same on every host of the level
        assert (state / host / "keys" / "S.key").read_bytes() == (secrets / "keys" / "S.key").read_bytes()
    assert (state / "t1" / "keys" / "TS.key").stat().st_mode & 0o077 == 0
    if deployed["tls"]:
        assert names("s1", "tls") == ["ca.pem", "worker-S.key", "worker-S.pem"]
        assert names("t1", "tls") == ["ca.pem", "worker-TS.key", "worker-TS.pem"]
        assert names("m", "tls") == ["ca.pem", "master-S.key", "master-S.pem", "master-TS.key", "master-TS.pem"]
        assert (secrets / "tls" / "ca.key").exists()  # the CA key never leaves the operator
    else:
        assert names("s1", "tls") == []


def test_replay_through_the_s_master_equals_reference(topo, deployed, tmp_path):
    cfg = load_config(deployed["config"])
    header = ["ts", "level", "sid", "bp", "pr", "weight"]
    rows = [(1, "U", "a", 120.0, 70.0, 80.0), (1, "TS", "a", 200.0, 70.0, 80.0), (2, "S", "b", 130.0, 70.0, 80.0),
            (2, "C", "a", 110.0, 70.0, 80.0), (3, "TS", "b", 190.0, 70.0, 80.0), (3, "U", "b", 150.0, 70.0, 80.0),
            (4, "S", "a", 100.0, 70.0, 80.0), (5, "U", "a", 140.0, 70.0, 80.0)]
    f = tmp_path / "vitals.csv"
    f.write_text("\n".join([",".join(header)] + [",".join(map(str, r)) for r in rows]) + "\n")
    queries = [("SELECT AVG(bp) FROM Vitals [ROWS 2]", ["double"]),
               ("SELECT sid, COUNT(*) FROM Vitals [RANGE 2 seconds] GROUP BY sid", ["string", "long"])]
    args = [PY, "-m", "strata", "replay", *_client_args(deployed, "S"), "--user", "sam",
            "--master", deployed["out"]["masters"]["S"], "--input", f"Vitals={f}", "--output", str(tmp_path / "out")]
    for q, _ in queries:
        args += ["--query", q]
    r = topo.run("s1", *args, timeout=180)  # a client on a worker host: gRPC crosses the bridge too
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 above level S dropped" in r.stderr, r.stderr[-1500:]
    streams = {"Vitals": [dict(zip(header, row)) for row in rows]}
    for i, (q, types) in enumerate(queries, 1):
        got = _read(tmp_path / "out" / f"q{i}.csv", types)
        assert got, f"query {i} produced nothing"
        compare_results(got, evaluate(q, cfg, "S", streams))
    st = _status(topo, deployed, "S", "sam")
    done = {w["sid"]: w["chunks_done"] for w in st["workers"]}
    assert sum(done.values()) >= 1


def _gone(pid: int) -> bool:
    """Exited (a zombie left for an init that does not reap counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _read(path: Path, types: list[str]) -> list[tuple]:
    import csv

    conv = {"double": float, "long": int, "string": str}
    with open(path) as fh:
        rows = list(csv.reader(fh))
    return [(int(r[0]), r[1], *[None if v == "" else conv[t](v) for t, v in zip(types, r[2:])]) for r in rows[1:]]


def test_deploy_status_then_down(topo, deployed):
    r = deploy("status", "--inventory", str(deployed["inventory"]), "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    st = json.loads(r.stdout)
    assert st["healthy"]
    assert sorted(st["groups"]["S"]["heard"]) == sorted(deployed["out"]["workers"]["S"] + [deployed["out"]["masters"]["S"]])
    assert not set(st["groups"]["S"]["heard"]) & set(deployed["out"]["workers"]["TS"])
    pids = [p["pid"] for procs in st["hosts"].values() for p in procs]
    assert len(pids) == 5
    r = deploy("down", "--inventory", str(deployed["inventory"]))
    deployed["down"] = r
    assert r.returncode == 0, r.stderr
    assert "stopped 5 processes" in r.stderr
    assert poll(lambda: all(_gone(pid) for pid in pids), timeout=30)
    assert not (deployed["dir"] / "inventory.deployed.json").exists()
    # nothing left in the host namespaces
    for host in HOSTS:  # (the Spark JVMs too: down waits for each process group)
        assert _ip("netns", "pids", topo.ns[host]).stdout.split() == [], host
