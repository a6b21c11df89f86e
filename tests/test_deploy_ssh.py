"""`strata deploy` over real ssh: OpenSSH servers in network namespaces made by the test.

Topology (tests/netns_hosts.py's Topology and Sshd):

    bridge namespace  ss<pid>-br : br0 (multicast snooping off), one veth per host
    op  10.78.0.2   the operator: `strata deploy` (ssh, scp) and the clients run here
    m   10.78.0.3   sshd; the S master                        all on br0
    w   10.78.0.4   sshd; one S worker (Spark local[1])

Each host namespace runs ``/usr/sbin/sshd -D -f CONFIG`` (package openssh-server) with
its own host key, listening on that namespace's address only, public-key logins
only with a key pair the test makes; the client trusts exactly those host keys
(``UserKnownHostsFile``, ``StrictHostKeyChecking=yes``).  Nothing is added to the
root namespace; the namespaces and everything running in them (sshd, masters,
workers, their JVMs) are removed afterwards, also on failure.

The two hosts share this machine's file system and the config's path on them
(``remote_config``), so ``up`` copies the same file from two hosts at the same
moment (issue 31: one fixed temporary name made one of them fail).  Then:
``deploy status``; a replay through the master equals the reference evaluator;
``down`` and ``up`` again restore the master's timeline (its queries are listed,
its finished input refuses tuples) on the same address (``master_port = 0``: a
port chosen once and kept); ``up --fresh`` starts a new timeline (input accepted
again, the old event log kept as ``*.old``).

systemd: PID 1 of the development sandbox is not systemd; the systemd test skips
there with the reason (``deploy up --systemd`` is otherwise covered only by the
agent test against a stub ``systemctl`` in tests/test_inventory.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import BATTLEFIELD_TOML
from .helpers import write_config
from .netns_hosts import (PY, assert_replay_equals_reference, cli_op, deploy_op, namespaces, ours_left, replay_args,
                          ssh_hosts, ssh_skip_reason, tls_available, vitals_csv)
from .polling import poll

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SUBNET = "10.78.0"
SSH_HOSTS = {"op": 2, "m": 3, "w": 4}  # host → last octet


INVENTORY = """\
[deployment]
name = "ssh-test"
config = "strata.toml"
remote_config = "{shared}/strata.toml"   # one path on both hosts, one file system: copied by both at once
state_dir = "{state}/default"
python = "{python}"
secrets = "secrets"
tls = {tls}
transport = "ssh"
chunk_seconds = 1.0
ready_timeout = 240
ssh_options = {ssh_options}

[levels.S]
address = "239.255.78.3"
port = 47200
ttl = 1                                  # master_port and worker_port 0: chosen once, kept

[[hosts]]
name = "m"
ssh = "{user}@{addr[m]}"
address = "{addr[m]}"
state_dir = "{state}/m"
levels = {{ S = {{ master = true }} }}

[[hosts]]
name = "w"
ssh = "{user}@{addr[w]}"
address = "{addr[w]}"
state_dir = "{state}/w"
levels = {{ S = 1 }}
"""


@pytest.fixture(scope="module")
def topo():
    with namespaces("ss", SUBNET, SSH_HOSTS, ssh_skip_reason()) as t:
        yield t


@pytest.fixture(scope="module")
def env(topo, tmp_path_factory):
    """sshd on m and w, the config, users and inventory; `deploy down` and sshd stopped at the end."""
    with ssh_hosts(topo, tmp_path_factory.mktemp("deploy-ssh"), ["m", "w"]) as info:
        d, sshd = info["dir"], info["sshd"]
        cfg = write_config(d, BATTLEFIELD_TOML, {"sam": "S"})
        tls = tls_available()
        inv = d / "inventory.toml"
        inv.write_text(INVENTORY.format(shared=d / "shared", state=d / "state", python=PY,
                                        tls="true" if tls else "false", user=sshd.user,
                                        ssh_options=json.dumps(sshd.options()),
                                        addr={h: topo.address(h) for h in SSH_HOSTS}))
        info.update(config=cfg, inventory=inv, tls=tls)
        yield info


def _query_ids(topo, env) -> list[str]:
    r = cli_op(topo, env, ["query", "list"], "--format", "json")
    assert r.returncode == 0, r.stderr
    return sorted(json.loads(line)["query"] for line in r.stdout.splitlines() if line.strip())


def _up(topo, env, *extra: str) -> dict:
    t0 = time.monotonic()
    r = deploy_op(topo, "up", "--inventory", str(env["inventory"]), *extra)
    assert r.returncode == 0, f"deploy up {' '.join(extra)} failed:\n{r.stderr[-6000:]}"
    for line in r.stderr.splitlines():  # one line per step
        assert line.startswith("[deploy] "), line
    out = json.loads(r.stdout)
    out["stderr"], out["seconds"] = r.stderr, time.monotonic() - t0
    print(f"deploy up {' '.join(extra)}: {out['seconds']:.1f} s\n{r.stderr}")
    env["master"] = out["masters"]["S"]
    return out


def _down(topo, env) -> None:
    r = deploy_op(topo, "down", "--inventory", str(env["inventory"]))
    assert r.returncode == 0 and "stopped 2 processes" in r.stderr, r.stderr
    for h in ("m", "w"):  # nothing of ours left on the hosts (the worker's JVM included); sshd stays
        assert poll(lambda: ours_left(topo, h) == [], timeout=30), (h, ours_left(topo, h))


# ---- the scenario, in order ------------------------------------------------------------------------------
def test_check_reach_over_ssh(topo, env):
    r = deploy_op(topo, "check", "--inventory", str(env["inventory"]), "--reach", "--json")
    assert r.returncode == 0, r.stderr
    hosts = json.loads(r.stdout)["hosts"]
    assert set(hosts) == {"m", "w"} and all(h["executable"] for h in hosts.values())


def test_up_over_ssh_on_a_shared_file_system(topo, env):
    out = _up(topo, env)
    env["first"] = out
    err = out["stderr"]
    assert out["masters"]["S"].startswith(topo.address("m") + ":")
    assert [w.rsplit(":", 1)[0] for w in out["workers"]["S"]] == [topo.address("w")]
    assert "master host m hears 1/1 workers" in err, err
    # both hosts copied the config onto the one shared path, in parallel, without a collision
    assert "m: " in err and "w: " in err and "strata-tmp" not in err, err
    shared = env["dir"] / "shared"
    assert sorted(p.name for p in shared.iterdir()) == ["strata.toml", "strata.users.json"]
    assert (shared / "strata.toml").read_text() == env["config"].read_text()
    assert (shared / "strata.users.json").stat().st_mode & 0o777 == 0o600
    # port 0: a port chosen on each host once and recorded there, outside the ephemeral range
    assert "ports kept for restarts: master-S " in err and "ports kept for restarts: worker-S-0 " in err, err
    ports = json.loads((env["dir"] / "state" / "m" / "run" / "ports.json").read_text())
    assert f"{topo.address('m')}:{ports['master-S']['port']}" == out["masters"]["S"]
    print(f"deploy up over ssh took {out['seconds']:.1f} s (tls={env['tls']})")


def test_status_over_ssh(topo, env):
    r = deploy_op(topo, "status", "--inventory", str(env["inventory"]), "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    st = json.loads(r.stdout)
    assert st["healthy"] and set(st["hosts"]) == {"m", "w"}
    assert sorted(st["groups"]["S"]["heard"]) == sorted(env["first"]["workers"]["S"] + [env["master"]])


def test_replay_through_the_master_equals_reference(topo, env, tmp_path):
    r = cli_op(topo, env, ["replay"], *replay_args(tmp_path), timeout=180)  # its input is finished afterwards
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 above level S dropped" in r.stderr, r.stderr[-1500:]
    assert_replay_equals_reference(env["config"], tmp_path / "out")
    env["queries"] = _query_ids(topo, env)
    assert len(env["queries"]) == 2, env["queries"]


def test_down_then_up_restores_the_timeline_on_the_same_address(topo, env, tmp_path):
    _down(topo, env)
    out = _up(topo, env)
    assert out["masters"]["S"] == env["first"]["masters"]["S"]  # the same port: its clients find it again
    assert out["workers"]["S"] == env["first"]["workers"]["S"]
    assert "ports kept for restarts" not in out["stderr"] and "new timeline" not in out["stderr"]
    assert _query_ids(topo, env) == env["queries"]  # restored from the master's event log
    r = cli_op(topo, env, ["ingest"], "--input", f"Vitals={vitals_csv(tmp_path / 'more.csv', [(9, 'U', 'c', 1.0, 2.0, 3.0)])}",
                "--labelled")
    assert r.returncode == 2 and "input is finished" in r.stderr, (r.returncode, r.stderr[-1500:])


def test_up_fresh_starts_a_new_timeline(topo, env, tmp_path):
    _down(topo, env)
    out = _up(topo, env, "--fresh")
    err = out["stderr"]
    assert out["masters"]["S"] == env["first"]["masters"]["S"]
    assert "m: " in err and "new timeline, old event log kept as master-S.sqlite." in err, err
    old = sorted(p.name for p in (env["dir"] / "state" / "m").glob("master-S.sqlite.*.old"))
    assert len(old) == 1 and old[0].endswith("Z.old"), old
    assert (env["dir"] / "state" / "m" / "master-S.sqlite").exists()  # the new timeline's log
    assert _query_ids(topo, env) == []
    r = cli_op(topo, env, ["ingest"], "--input", f"Vitals={vitals_csv(tmp_path / 'again.csv')}", "--labelled",
                "--finish")
    assert r.returncode == 0, r.stderr[-1500:]
    _down(topo, env)


# ---- systemd ---------------------------------------------------------------------------------------------
def _systemd_reason() -> str | None:
    try:
        comm = Path("/proc/1/comm").read_text().strip()
    except OSError:
        comm = "?"
    if comm != "systemd":
        return (f"PID 1 is {comm!r}, not systemd: `strata deploy up --systemd` cannot be tested for real here "
                f"(only against the stub systemctl of tests/test_inventory.py)")
    r = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=30)
    state = r.stdout.strip()
    if state not in ("running", "degraded"):
        return f"systemd is {state or 'not answering'} (`systemctl is-system-running`): cannot start units"
    return None


SYSTEMD_INVENTORY = """\
[deployment]
name = "ssh-systemd-test"
config = "{base}/strata.toml"
remote_config = "{base}/shared/strata.toml"
state_dir = "{base}/state"
python = "{python}"
secrets = "{base}/secrets"
tls = {tls}
transport = "ssh"
ready_timeout = 240
ssh_options = {ssh_options}
systemd_dir = "/run/systemd/system"      # runtime units: gone at the next boot whatever happens
env_dir = "{base}/env"
service_user = "root"

[levels.S]
address = "239.255.78.5"
port = 47201
ttl = 1

[[hosts]]
name = "m"
ssh = "{user}@{addr[m]}"
address = "{addr[m]}"
state_dir = "{base}/state-m"
levels = {{ S = {{ master = true }} }}

[[hosts]]
name = "w"
ssh = "{user}@{addr[w]}"
address = "{addr[w]}"
state_dir = "{base}/state-w"
levels = {{ S = 1 }}
"""


def test_systemd_units_restart_on_the_same_address(topo, env):
    """Under systemd a killed master comes back (Restart=on-failure) on the port `up` fixed for it.

    Units run in the root namespace unless told otherwise: drop-ins put each unit into its
    host's namespace (NetworkNamespacePath).  Everything lives outside /tmp (the units'
    PrivateTmp hides it) under /var/lib/strata-ssh-test-<pid>, removed afterwards."""
    reason = _systemd_reason()
    if reason:
        pytest.skip(reason)
    base = Path(f"/var/lib/strata-ssh-test-{os.getpid()}")
    dropins = [Path("/run/systemd/system") / f"{unit}.d" for unit in ("strata-master@S.service",
                                                                       "strata-worker@S-0.service")]
    base.mkdir(mode=0o700)
    inv = base / "inventory.toml"
    try:
        shutil.copy(env["config"], base / "strata.toml")
        shutil.copy(env["config"].with_name("strata.users.json"), base / "strata.users.json")
        inv.write_text(SYSTEMD_INVENTORY.format(base=base, python=PY, tls="true" if env["tls"] else "false",
                                                ssh_options=json.dumps(env["sshd"].options()),
                                                user=env["sshd"].user,
                                                addr={h: topo.address(h) for h in SSH_HOSTS}))
        for d, host in zip(dropins, ("m", "w")):
            d.mkdir(parents=True, exist_ok=True)
            (d / "netns.conf").write_text(f"[Service]\nNetworkNamespacePath=/run/netns/{topo.ns[host]}\n")
        r = deploy_op(topo, "up", "--inventory", str(inv), "--systemd")
        assert r.returncode == 0, r.stderr[-6000:]
        master = json.loads(r.stdout)["masters"]["S"]
        subprocess.run(["systemctl", "kill", "--signal=KILL", "strata-master@S.service"], check=True, timeout=30)

        def healthy_again():
            s = deploy_op(topo, "status", "--inventory", str(inv), "--json")
            st = json.loads(s.stdout) if s.stdout.strip() else {}
            procs = st.get("hosts", {}).get("m", [])
            return st.get("healthy") and procs and procs[0].get("restarts", 0) >= 1 and procs[0]["address"] == master

        assert poll(healthy_again, timeout=120, interval=2), "the master did not come back on its address"
    finally:
        deploy_op(topo, "down", "--inventory", str(inv))
        for d in dropins:
            shutil.rmtree(d, ignore_errors=True)
        for unit in ("strata-master@.service", "strata-worker@.service", "strata.target"):
            Path("/run/systemd/system", unit).unlink(missing_ok=True)
        subprocess.run(["systemctl", "daemon-reload"], timeout=60)
        shutil.rmtree(base, ignore_errors=True)


# ---- the pieces, without namespaces (no root needed) -------------------------------------------------
SSH_STUB = """#!/bin/sh
# ssh stand-in: runs the one quoted remote command here; STUB_FAIL_MV makes `mv` fail (a read-only mount)
for last; do :; done
case "$last" in mv\\ *) if [ -n "$STUB_FAIL_MV" ]; then echo "mv: cannot move: Read-only file system" >&2; exit 1; fi;; esac
exec sh -c "$last"
"""
SCP_STUB = """#!/bin/sh
n=$#; eval "src=\\${$((n-1))}"; eval "dst=\\${$n}"
exec cp -- "$src" "${dst#*:}"
"""


@pytest.fixture
def stub_ssh(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", SSH_STUB), ("scp", SCP_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return monkeypatch


def test_parallel_puts_to_one_shared_path_do_not_collide(stub_ssh, tmp_path):
    """Issue 31: hosts on one file system copy the same file at once (ssh and shared-fs transports)."""
    from concurrent.futures import ThreadPoolExecutor

    from strata.deploy import remote

    src = tmp_path / "strata.toml"
    src.write_text("[lattice]\n" * 2000)
    shared = tmp_path / "shared"
    shared.mkdir()
    transports = [remote.SshTransport(f"h{i}", f"root@10.0.0.{i}") for i in range(4)] + \
        [remote.LocalTransport(f"l{i}") for i in range(4)]
    with ThreadPoolExecutor(8) as ex:
        done = list(ex.map(lambda t: [t.put(src, str(shared / "strata.toml"), 0o644) for _ in range(5)], transports))
    assert all(all(d) for d in done)
    assert [p.name for p in shared.iterdir()] == ["strata.toml"]  # no temporary copy left behind
    assert (shared / "strata.toml").read_text() == src.read_text()
    assert (shared / "strata.toml").stat().st_mode & 0o777 == 0o644


def test_ssh_put_tolerates_an_identical_file_it_cannot_replace(stub_ssh, tmp_path):
    from strata.deploy import remote

    src, dst = tmp_path / "k", tmp_path / "d" / "k"
    src.write_text("same")
    dst.parent.mkdir()
    dst.write_text("same")
    t = remote.SshTransport("h", "root@10.0.0.1")
    stub_ssh.setenv("STUB_FAIL_MV", "1")
    assert t.put(src, str(dst), 0o600)  # already in place, identical: fine
    dst.write_text("other")
    with pytest.raises(remote.RemoteError, match=r"^h: cannot move .* into place as .*Read-only file system$"):
        t.put(src, str(dst), 0o600)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["k"] and dst.read_text() == "other"


def test_agent_ports_chooses_once_and_keeps(tmp_path):
    import socket

    from strata.deploy import remote

    state = str(tmp_path / "state")
    req = {"address": "127.0.0.1", "processes": {"master-S": 0, "worker-S-0": 0, "worker-S-1": 50061}}
    first = remote.agent_ports(state, req)
    ports = first["ports"]
    assert first["chosen"] == ["master-S", "worker-S-0"] and ports["worker-S-1"] == 50061
    assert len(set(ports.values())) == 3
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(remote.PORT_FLOOR <= ports[n] < low for n in first["chosen"])  # never an outgoing connection's
    again = remote.agent_ports(state, req)
    assert again["ports"] == ports and again["chosen"] == [] and again["moved"] == []
    # another program took the master's port meanwhile: a new one, said so
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ports["master-S"]))
        s.listen(1)
        moved = remote.agent_ports(state, req)
    assert moved["moved"] == [{"name": "master-S", "old": ports["master-S"], "new": moved["ports"]["master-S"]}]
    assert moved["ports"]["master-S"] != ports["master-S"]
    assert remote.agent_ports(state, req)["ports"] == moved["ports"]  # the new one is kept
    # a fixed port given to another process wins over a recorded one
    req2 = {"address": "127.0.0.1", "processes": {"master-S": 0, "worker-S-0": moved["ports"]["master-S"]}}
    assert remote.agent_ports(state, req2)["ports"]["master-S"] != moved["ports"]["master-S"]
    with pytest.raises(remote.RemoteError, match="192.0.2.1 is not an address of this host"):
        remote.agent_ports(state, {"address": "192.0.2.1", "processes": {"master-S": 0}})


def test_fresh_sets_the_event_log_aside(tmp_path):
    from strata.deploy import remote

    state = tmp_path / "state"
    state.mkdir()

    def make():
        for n in ("master-S.sqlite", "master-S.sqlite-wal", "master-TS.sqlite"):
            (state / n).write_text(n)

    make()
    first = remote._set_aside(str(state), [str(state / "master-S.sqlite")])
    assert len(first) == 2 and all(n.endswith("Z.old") for n in first)
    make()
    second = remote._set_aside(str(state), [str(state / "master-S.sqlite")])
    assert not set(first) & set(second)  # within one second too: nothing overwritten
    assert len({n.replace("-wal", "") for n in second}) == 1  # the log and its -wal: one suffix
    names = sorted(p.name for p in state.iterdir())
    assert "master-S.sqlite" not in names and "master-TS.sqlite" in names and len(names) == 5
    with pytest.raises(remote.RemoteError, match="is not a state file in"):
        remote._set_aside(str(state), [str(tmp_path / "master-S.sqlite")])


def test_systemd_environment_files_carry_the_kept_port():
    """A unit restarted by systemd (Restart=on-failure) listens where `up` fixed its port."""
    from dataclasses import replace

    from strata.deploy import cli, units
    from strata.deploy.inventory import load_inventory

    inv = load_inventory(Path(__file__).resolve().parents[1] / "examples" / "inventory.toml")
    host = inv.host("ts-master")
    procs = [replace(p, port=20000 + i) for i, p in enumerate(host.processes(inv))]
    env = units.render_env_files(inv, host, procs)
    assert 'STRATA_LISTEN="10.0.4.10:20000"' in env["/etc/strata/master-TS.env"]
    assert 'STRATA_LISTEN="10.0.4.10:20001"' in env["/etc/strata/worker-TS-0.env"]
    plan = cli._plan(inv, host, True, procs, fresh=True)
    assert [p["argv"][p["argv"].index("--listen") + 1] for p in plan["processes"]] == ["10.0.4.10:20000",
                                                                                       "10.0.4.10:20001"]
    assert plan["fresh"] == ["/var/lib/strata/master-TS.sqlite"]
