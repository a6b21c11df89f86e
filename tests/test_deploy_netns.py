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
import time
from functools import partial

import pytest

from .conftest import BATTLEFIELD_TOML
from .helpers import gone, write_config
from .netns_hosts import (PY, assert_replay_equals_reference, deploy, ip, namespaces, replay_args, skip_reason,
                          tls_available)
from .polling import poll as _poll

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SUBNET = "10.77.0"
HOSTS = {"s1": 2, "s2": 3, "t1": 4, "m": 5}  # host → last octet
poll = partial(_poll, interval=0.2)

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
    with namespaces("st", SUBNET, HOSTS, skip_reason()) as t:
        yield t


@pytest.fixture(scope="module")
def deployed(topo, tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    cfg = write_config(d, BATTLEFIELD_TOML, {"sam": "S", "tess": "TS"})  # ingest, query and cluster status
    tls = tls_available()
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
    args = [PY, "-m", "strata", "replay", *_client_args(deployed, "S"), "--user", "sam",
            "--master", deployed["out"]["masters"]["S"], *replay_args(tmp_path)]
    r = topo.run("s1", *args, timeout=180)  # a client on a worker host: gRPC crosses the bridge too
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 above level S dropped" in r.stderr, r.stderr[-1500:]
    assert_replay_equals_reference(deployed["config"], tmp_path / "out")
    st = _status(topo, deployed, "S", "sam")
    done = {w["sid"]: w["chunks_done"] for w in st["workers"]}
    assert sum(done.values()) >= 1


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
    assert poll(lambda: all(gone(pid) for pid in pids), timeout=30)
    assert not (deployed["dir"] / "inventory.deployed.json").exists()
    # nothing left in the host namespaces
    for host in HOSTS:  # (the Spark JVMs too: down waits for each process group)
        assert ip("netns", "pids", topo.ns[host]).stdout.split() == [], host
