"""`strata deploy` without a network: inventory parsing and validation, rendering of
command lines, environments and systemd units, which secrets go to which host,
transports' argv, and the host agent on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.config import ConfigError, parse_config
from strata.deploy import remote, units
from strata.deploy.inventory import InventoryError, load_inventory
from strata.groups import group_spec

from .conftest import BATTLEFIELD_TOML, CHINESE_WALL_TOML

ROOT = Path(__file__).resolve().parent.parent

BASE = """\
[deployment]
config = "strata.toml"
state_dir = "/var/lib/strata"
python = "/opt/strata/bin/python"
tls = {tls}

[levels.S]
address = "239.255.10.3"
port = 47003
ttl = 1

[levels.TS]
address = "239.255.10.4"
port = 47003

[[hosts]]
name = "a"
ssh = "root@10.0.0.2"
address = "10.0.0.2"
levels = {{ S = 2 }}

[[hosts]]
name = "b"
ssh = "root@10.0.0.3"
address = "10.0.0.3"
levels = {{ S = 1, TS = 1 }}

[[hosts]]
name = "m"
ssh = "root@10.0.0.4"
address = "10.0.0.4"
levels = {{ S = {{ master = true }}, TS = {{ master = true, workers = 0 }} }}
"""


@pytest.fixture
def cfgdir(tmp_path):
    (tmp_path / "strata.toml").write_text(BATTLEFIELD_TOML)
    return tmp_path


def inv_of(cfgdir: Path, text: str):
    p = cfgdir / "inv.toml"
    p.write_text(text)
    return load_inventory(p)


def err_of(cfgdir: Path, text: str) -> str:
    with pytest.raises(InventoryError) as e:
        inv_of(cfgdir, text)
    return str(e.value)


# ---- parsing ------------------------------------------------------------------------------------------
def test_valid_inventory(cfgdir):
    inv = inv_of(cfgdir, BASE.format(tls="true"))
    assert [h.name for h in inv.hosts] == ["a", "b", "m"]
    assert list(inv.levels) == ["S", "TS"]
    assert inv.levels["TS"].ttl == 1  # the default across hosts
    assert inv.master_host("S").name == "m" and inv.master_host("TS").name == "m"
    assert [p.name for p in inv.host("a").processes(inv)] == ["worker-S-0", "worker-S-1"]
    assert [p.name for p in inv.host("b").processes(inv)] == ["worker-S-0", "worker-TS-0"]
    assert [p.name for p in inv.host("m").processes(inv)] == ["master-S", "master-TS"]
    assert inv.host("m").processes(inv)[0].unit == "strata-master@S.service"
    assert inv.host("a").processes(inv)[1].unit == "strata-worker@S-1.service"
    assert inv.record_path == cfgdir / "inv.deployed.json"
    assert inv.secrets == cfgdir / "inv.secrets"
    assert inv.hosts[0].config == str(cfgdir / "strata.toml")  # remote_config defaults to the same path


def test_unknown_level_names_the_key(cfgdir):
    text = BASE.format(tls="true") + '\n[[hosts]]\nname = "q"\nssh = "root@10.0.0.9"\naddress = "10.0.0.9"\nlevels = { Q = 1 }\n'
    assert err_of(cfgdir, text) == "inventory hosts[3].levels: unknown level 'Q' (levels: U, C, S, TS)"


@pytest.mark.parametrize("edit, want", [
    # a second master of S
    (lambda t: t.replace('levels = { S = 2 }', 'levels = { S = { workers = 2, master = true } }'),
     "inventory hosts[2].levels.S.master: level S already has its master on a (hosts[0])"),
    # no master of TS
    (lambda t: t.replace('TS = { master = true, workers = 0 }', 'C = { master = true }')
     .replace('[levels.TS]\naddress = "239.255.10.4"\nport = 47003\n', ''),
     "inventory hosts: level TS has no master (hosts running it: b)"),
    (lambda t: t.replace('address = "239.255.10.4"', 'address = "239.255.10.3"'),
     "inventory levels.TS.address: 239.255.10.3 is also level S's group"),
    (lambda t: t.replace('ttl = 1', 'ttl = 0'), "inventory levels.S.ttl: 0 keeps heartbeats on one host"),
    (lambda t: t.replace('address = "239.255.10.4"', 'address = "10.1.1.1"'),
     "inventory levels.TS.address: 10.1.1.1 is not a multicast address"),
    (lambda t: t.replace('address = "10.0.0.2"', 'address = "eth0"'),
     "inventory hosts[0].address: 'eth0' is not an IPv4 address"),
    (lambda t: t.replace('ssh = "root@10.0.0.2"', 'ssh = "-oProxyCommand=x"'),
     "inventory hosts[0].ssh: '-oProxyCommand=x' is not a destination"),
    (lambda t: t.replace('ssh = "root@10.0.0.2"', 'ssh = "root@10.0.0.2; rm -rf /"'),
     "inventory hosts[0].ssh:"),
    (lambda t: t.replace('name = "b"', 'name = "a"'), "inventory hosts[1].name: 'a' is also hosts[0]'s name"),
    (lambda t: t.replace('levels = { S = 2 }', 'levels = { S = 0 }'),
     "inventory hosts[0].levels.S: runs neither a master nor a worker of level S"),
    (lambda t: t.replace('levels = { S = 2 }', 'levels = { S = "two" }'),
     "inventory hosts[0].levels.S: must be a worker count"),
    (lambda t: t.replace('ttl = 1', 'ttl = 1\nttll = 2'), "inventory levels.S.ttll: unknown key"),
    (lambda t: t.replace('tls = true', 'tls = true\nbogus = 1'), "inventory deployment.bogus: unknown key"),
    (lambda t: t.replace('state_dir = "/var/lib/strata"', 'state_dir = "var/lib"'),
     "inventory deployment.state_dir: 'var/lib' must be an absolute path"),
    (lambda t: t.replace('state_dir = "/var/lib/strata"', 'state_dir = "/var/lib/$(reboot)"'),
     "inventory deployment.state_dir: '/var/lib/$(reboot)': use a plain path"),
    (lambda t: t.replace('config = "strata.toml"', 'config = "nope.toml"'),
     "inventory deployment.config: "),
    (lambda t: t.replace('[levels.TS]', '[levels.Q]'), "inventory levels: unknown level 'Q'"),
    (lambda t: t + '\n[levels.C]\nport = 1\n', "inventory levels.C: no host runs level C"),
    (lambda t: t.replace('python = ', 'ssh_options = ["-p 22"]\npython = '),
     "inventory deployment.ssh_options: '-p 22': give ssh options as \"Key=Value\""),
    (lambda t: t.replace('port = 47003\nttl = 1', 'port = 47003\nttl = 1\nmaster_port = 50050\nworker_port = 50050')
     .replace('levels = { S = { master = true }', 'levels = { S = { master = true, workers = 1 }'),
     "both listen on 10.0.0.4:50050"),
])
def test_rejections_name_the_key(cfgdir, edit, want):
    assert want in err_of(cfgdir, edit(BASE.format(tls="true")))


def test_single_host_may_use_ttl_zero_and_loopback(cfgdir):
    inv = inv_of(cfgdir, """\
[deployment]
config = "strata.toml"
transport = "local"
[levels.S]
ttl = 0
[[hosts]]
name = "here"
address = "127.0.0.1"
state_dir = "/tmp/strata-state"
levels = { S = { master = true, workers = 2 } }
""")
    g = inv.levels["S"]
    assert g.ttl == 0 and g.address.startswith("239.255.") and g.port == 47000
    assert inv.hosts[0].transport == "local"


def test_config_with_group_keys_is_refused(cfgdir):
    (cfgdir / "strata.toml").write_text(BATTLEFIELD_TOML + '\n[groups."S"]\nkey_file = "keys/S.key"\n')
    msg = err_of(cfgdir, BASE.format(tls="true"))
    assert 'the config sets [groups."S"] key_file' in msg and "only to hosts of level S" in msg


def test_chinese_wall_levels(tmp_path):
    (tmp_path / "strata.toml").write_text(CHINESE_WALL_TOML)
    inv = inv_of(tmp_path, """\
[deployment]
config = "strata.toml"
[levels."[1,B]"]
address = "239.255.20.1"
[[hosts]]
name = "w"
ssh = "ops@10.0.0.2"
address = "10.0.0.2"
levels = { "[1,B]" = 1 }
[[hosts]]
name = "m"
ssh = "ops@10.0.0.3"
address = "10.0.0.3"
levels = { "[1,B]" = { master = true } }
""")
    assert list(inv.levels) == ["[1,B]"] and inv.levels["[1,B]"].slug == "1_B"
    h = inv.host("w")
    assert h.processes(inv)[0].name == "worker-1_B-0"
    env = units.render_env_files(inv, h)["/etc/strata/worker-1_B-0.env"]
    assert 'STRATA_LEVEL="[1,B]"' in env


# ---- rendering -----------------------------------------------------------------------------------------
def test_process_argv_and_environment(cfgdir):
    inv = inv_of(cfgdir, BASE.format(tls="false"))
    b = inv.host("b")
    w = b.processes(inv)[1]  # worker-TS-0
    argv = units.process_argv(inv, b, w)
    assert argv[:4] == ["/opt/strata/bin/python", "-m", "strata", "worker"]
    i = argv.index
    assert argv[i("--level") + 1] == "TS" and argv[i("--listen") + 1] == "10.0.0.3:0"
    assert argv[i("--multicast-port") + 1] == "47003" and argv[i("--state-dir") + 1] == "/var/lib/strata"
    assert argv[i("--ready-file") + 1] == "/var/lib/strata/run/worker-TS-0.json"
    assert ("--insecure" in argv) == units.tls_supported()  # tls = false
    env = units.process_env(inv, b, w)
    assert env["STRATA_GROUP_INTERFACE"] == "10.0.0.3" and env["STRATA_GROUP_ADDRESS"] == "239.255.10.4"
    assert env["STRATA_GROUP_TTL"] == "1"
    m = inv.host("m")
    margv = units.process_argv(inv, m, m.processes(inv)[0])
    assert margv[3] == "master" and "--chunk-seconds" in margv and "--spark-master" not in margv
    inv_tls = inv_of(cfgdir, BASE.format(tls="true"))
    assert "--insecure" not in units.process_argv(inv_tls, inv_tls.host("b"), inv_tls.host("b").processes(inv_tls)[0])


def test_group_spec_reads_the_deploy_environment(monkeypatch, tmp_path):
    cfg = parse_config(BATTLEFIELD_TOML)
    spec = group_spec(cfg, "S", tmp_path, create_key=True)
    assert (spec.interface, spec.ttl) == ("127.0.0.1", 0)  # defaults: loopback only
    monkeypatch.setenv("STRATA_GROUP_INTERFACE", "10.0.0.3")
    monkeypatch.setenv("STRATA_GROUP_TTL", "1")
    monkeypatch.setenv("STRATA_GROUP_ADDRESS", "239.255.10.4")
    spec = group_spec(cfg, "S", tmp_path)
    assert (spec.address, spec.interface, spec.ttl) == ("239.255.10.4", "10.0.0.3", 1)
    for var, bad in (("STRATA_GROUP_TTL", "300"), ("STRATA_GROUP_ADDRESS", "10.0.0.1"),
                     ("STRATA_GROUP_INTERFACE", "eth0")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ConfigError, match=var):
            group_spec(cfg, "S", tmp_path)
        monkeypatch.delenv(var)


def test_units_and_env_files(cfgdir):
    inv = inv_of(cfgdir, BASE.format(tls="true"))
    a = units.render_host(inv, inv.host("a"))
    assert sorted(a) == ["/etc/strata/worker-S-0.env", "/etc/strata/worker-S-1.env",
                         "/etc/systemd/system/strata-worker@.service", "/etc/systemd/system/strata.target"]
    unit = a["/etc/systemd/system/strata-worker@.service"]
    assert "@" not in unit.split("[Service]")[1].replace("strata-worker@", "")  # every placeholder filled
    for line in ("EnvironmentFile=/etc/strata/worker-%i.env", "Restart=on-failure", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ReadWritePaths=/var/lib/strata", "PrivateTmp=yes", "User=strata"):
        assert line in unit.splitlines(), line
    assert "ExecStart=/opt/strata/bin/python -m strata worker --config ${STRATA_CONFIG}" in unit
    env = a["/etc/strata/worker-S-1.env"]
    assert 'STRATA_LISTEN="10.0.0.2:0"' in env and 'STRATA_GROUP_INTERFACE="10.0.0.2"' in env
    assert 'STRATA_EXTRA_ARGS=""' in env
    m = units.render_host(inv, inv.host("m"))
    assert "/etc/systemd/system/strata-master@.service" in m and "/etc/systemd/system/strata-worker@.service" not in m
    assert "--chunk-seconds ${STRATA_CHUNK_SECONDS}" in m["/etc/systemd/system/strata-master@.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_rendered_units_pass_systemd_analyze(cfgdir, tmp_path):
    inv = inv_of(cfgdir, BASE.format(tls="true").replace("/opt/strata/bin/python", sys.executable))
    for path, text in units.render_units(inv, inv.host("b")).items():
        if not path.endswith(".service"):
            continue
        f = tmp_path / Path(path).name.replace("@.", "@x.")
        f.write_text(text)
        r = subprocess.run(["systemd-analyze", "verify", str(f)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SYSTEMD_LOG_LEVEL": "err"})
        problems = [ln for ln in (r.stderr + r.stdout).splitlines()
                    if any(w in ln for w in ("Unknown", "rror", "ignoring", "Invalid")) and "EnvironmentFile" not in ln]
        assert not problems, problems


def test_hosts_get_only_their_levels_secrets(cfgdir):
    inv = inv_of(cfgdir, BASE.format(tls="true"))
    a, b, m = (inv.host(n) for n in "abm")
    assert sorted(units.key_files_for(inv, a)) == ["/var/lib/strata/keys/S.key"]
    assert sorted(units.key_files_for(inv, b)) == ["/var/lib/strata/keys/S.key", "/var/lib/strata/keys/TS.key"]
    tls_a = units.tls_files_for(inv, a)
    assert sorted(Path(p).name for p in tls_a) == ["ca.pem", "worker-S.key", "worker-S.pem"]
    assert all(src.parent == inv.secrets / "tls" for src in tls_a.values())
    assert sorted(Path(p).name for p in units.tls_files_for(inv, m)) == [
        "ca.pem", "master-S.key", "master-S.pem", "master-TS.key", "master-TS.pem"]
    every = [Path(p).name for h in inv.hosts for p in units.tls_files_for(inv, h)]
    assert "ca.key" not in every and not any(n.startswith("client-") for n in every)
    assert units.tls_files_for(inv_of(cfgdir, BASE.format(tls="false")), a) == {}


def test_example_inventory_checks():
    inv = load_inventory(ROOT / "examples" / "inventory.toml")
    assert set(inv.levels) == {"S", "TS"}
    examples = sorted((ROOT / "examples").glob("inventory*.toml"))
    assert len(examples) >= 2
    for p in examples:
        assert load_inventory(p).hosts
    r = subprocess.run([sys.executable, "-m", "strata", "deploy", "check", "--inventory",
                        str(ROOT / "examples" / "inventory.toml"), "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["levels"]["S"]["master"] == "s-master"
    bad = subprocess.run([sys.executable, "-m", "strata", "deploy", "check", "--inventory", "/nonexistent.toml"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "cannot read" in bad.stderr


def test_units_command_writes_per_host_files(tmp_path):
    r = subprocess.run([sys.executable, "-m", "strata", "deploy", "units", "--inventory",
                        str(ROOT / "examples" / "inventory.toml"), "--out", str(tmp_path), "--host", "s-master"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s-master" / "etc" / "strata" / "master-S.env").exists()
    assert not (tmp_path / "s-work-1").exists()


# ---- transports --------------------------------------------------------------------------------------------
def test_ssh_transport_quotes_every_word():
    t = remote.SshTransport("h", "ops@10.0.0.2", ("Port=2222",))
    argv = t.wrap(["python", "-m", "x", "--level", "[1,B]", "; rm -rf / #", "$(reboot)"])
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[argv.index("Port=2222") - 1] == "-o"
    assert argv[-3:-1] == ["--", "ops@10.0.0.2"]
    assert argv[-1] == "python -m x --level '[1,B]' '; rm -rf / #' '$(reboot)'"
    import shlex

    assert shlex.split(argv[-1]) == ["python", "-m", "x", "--level", "[1,B]", "; rm -rf / #", "$(reboot)"]
    with pytest.raises(ValueError):
        remote.SshTransport("h", "-oProxyCommand=sh")
    with pytest.raises(remote.RemoteError, match="plain"):
        t.put(Path(__file__), "/var/lib/strata/keys/a b.key")


def test_netns_and_local_transports(tmp_path):
    assert remote.NetnsTransport("h", "ns1").wrap(["true"]) == ["ip", "netns", "exec", "ns1", "true"]
    with pytest.raises(ValueError):
        remote.NetnsTransport("h", "-all")
    t = remote.LocalTransport("here")
    assert t.run(["echo", "hi"]).stdout == b"hi\n"
    with pytest.raises(remote.RemoteError, match="exited 1"):
        t.run(["false"])
    src = tmp_path / "k"
    src.write_text("secret")
    assert t.put(src, str(tmp_path / "d" / "k2"), 0o600)
    assert (tmp_path / "d" / "k2").read_text() == "secret" and (tmp_path / "d" / "k2").stat().st_mode & 0o777 == 0o600
    assert not t.put(src, str(src))  # the same file (shared filesystem): nothing to copy


# ---- the host agent ---------------------------------------------------------------------------------------
SLEEPER = ("import json, os, sys, time\n"
           "p = sys.argv[sys.argv.index('--ready-file') + 1]\n"
           "open(p, 'w').write(json.dumps({'address': '127.0.0.1:9', 'pid': os.getpid()}))\n"
           "time.sleep(120)\n")


def test_agent_start_status_stop(tmp_path):
    state = tmp_path / "state"
    t = remote.LocalTransport("here")
    ready = str(state / "run" / "worker-S-0.json")
    plan = {"deployment": "t", "mode": "process", "processes": [
        {"name": "worker-S-0", "role": "worker", "level": "S", "ready": ready, "log": str(state / "logs" / "w.log"),
         "argv": [sys.executable, "-c", SLEEPER, "--ready-file", ready], "env": {"STRATA_GROUP_TTL": "1"}},
        {"name": "worker-S-1", "role": "worker", "level": "S", "ready": str(state / "run" / "w1.json"),
         "log": str(state / "logs" / "w1.log"),
         "argv": [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], "env": {}},
    ]}
    started = t.run_json(remote.agent_argv(sys.executable, "start", "--state-dir", str(state)),
                         input=json.dumps(plan).encode())
    pid = started["processes"][0]["pid"]
    deadline = time.monotonic() + 30
    while True:
        st = t.run_json(remote.agent_argv(sys.executable, "status", "--state-dir", str(state)))
        by = {p["name"]: p for p in st["processes"]}
        if (by["worker-S-0"]["ready"] and not by["worker-S-1"]["alive"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert by["worker-S-0"]["address"] == "127.0.0.1:9" and by["worker-S-0"]["pid"] == pid
    assert not by["worker-S-1"]["alive"] and "boom" in by["worker-S-1"]["log_tail"]
    with pytest.raises(remote.RemoteError, match="already running"):
        t.run_json(remote.agent_argv(sys.executable, "start", "--state-dir", str(state)),
                   input=json.dumps(plan).encode())
    res = t.run_json(remote.agent_argv(sys.executable, "stop", "--state-dir", str(state)))
    assert res["stopped"] == 1
    st = Path(f"/proc/{pid}/stat")
    assert not st.exists() or st.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert t.run_json(remote.agent_argv(sys.executable, "status", "--state-dir", str(state)))["processes"] == []


def test_agent_probe_hears_a_loopback_group(tmp_path):
    from strata.groups.membership import GroupMember, GroupSpec

    key = os.urandom(32)
    (tmp_path / "S.key").write_text(key.hex())
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    spec = GroupSpec("S", "239.255.91.7", port, key, interval=0.1)
    members = [GroupMember(spec, sid=f"127.0.0.1:{100 + i}", load=lambda: 1.0).start() for i in range(2)]
    other = GroupMember(GroupSpec("S", "239.255.91.7", port, os.urandom(32), interval=0.1), sid="127.0.0.1:666",
                        load=lambda: 1.0).start()  # another key on the same group: rejected
    try:
        res = remote.agent_probe("S", str(tmp_path / "S.key"), "239.255.91.7", port, "127.0.0.1",
                                 ["127.0.0.1:100", "127.0.0.1:101"], 10.0)
    finally:
        for m in members + [other]:
            m.stop()
    assert res["missing"] == [] and set(res["heard"]) == {"127.0.0.1:100", "127.0.0.1:101"}


# ---- up/status/down on this machine (loopback, a master only: no Spark) ---------------------------------
from strata.serving import free_udp_port  # noqa: E402


LOCAL = """\
[deployment]
config = "strata.toml"
transport = "local"
python = "{python}"
tls = false
ready_timeout = 60

[levels.S]
address = "239.255.93.{octet}"
port = {port}
ttl = 0

[[hosts]]
name = "here"
address = "127.0.0.1"
state_dir = "{state}"
config = "{config}"
levels = {{ S = {{ master = true }} }}
"""


def _deploy(*args):
    return subprocess.run([sys.executable, "-m", "strata", "deploy", *args], capture_output=True, text=True,
                          timeout=120)


def test_local_up_status_down(cfgdir):
    inv = cfgdir / "inv.toml"
    inv.write_text(LOCAL.format(python=sys.executable, octet=os.getpid() % 200 + 1, port=free_udp_port(),
                                state=cfgdir / "state", config=cfgdir / "strata.toml"))
    r = _deploy("up", "--inventory", str(inv))
    try:
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["masters"]["S"].startswith("127.0.0.1:") and out["workers"]["S"] == []
        assert "waiting for processes: 1/1 ready" in r.stderr and "level S: master host here hears 0/0" in r.stderr
        assert (cfgdir / "inv.deployed.json").exists()
        assert sorted(p.name for p in (cfgdir / "state" / "keys").iterdir()) == ["S.key"]
        again = _deploy("up", "--inventory", str(inv))
        assert again.returncode == 1 and "a deployment is recorded" in again.stderr
        st = _deploy("status", "--inventory", str(inv), "--json")
        assert st.returncode == 0, st.stderr + st.stdout
        status = json.loads(st.stdout)
        assert status["healthy"] and list(status["groups"]["S"]["heard"]) == [out["masters"]["S"]]
        pid = status["hosts"]["here"][0]["pid"]
    finally:
        d = _deploy("down", "--inventory", str(inv))
    assert d.returncode == 0 and "stopped 1 processes" in d.stderr, d.stderr
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert not (cfgdir / "inv.deployed.json").exists()


def test_local_up_fails_with_the_log_tail_and_cleans_up(cfgdir):
    inv = cfgdir / "inv.toml"
    # the host's config path does not exist there (and is not pushed): the master exits at once
    inv.write_text(LOCAL.format(python=sys.executable, octet=os.getpid() % 200 + 1, port=free_udp_port(),
                                state=cfgdir / "state", config="/nonexistent/strata.toml")
                   .replace("tls = false", "tls = false\npush_config = false"))
    r = _deploy("up", "--inventory", str(inv))
    assert r.returncode == 1
    assert "master-S on here exited during start-up; log tail:" in r.stderr
    assert "/nonexistent/strata.toml" in r.stderr and "stopping what was started" in r.stderr
    assert not (cfgdir / "inv.deployed.json").exists()


def test_agent_systemd_mode_with_a_stub_systemctl(tmp_path, monkeypatch):
    """`up --systemd` on a host: daemon-reload, enable, restart; status via `systemctl show`; stop disables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    stub = bin_dir / "systemctl"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    "case \"$1\" in show) printf 'ActiveState=active\\nMainPID=4242\\nNRestarts=1\\n';; esac\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state = tmp_path / "state"
    ready = state / "run" / "master-S.json"
    plan = {"deployment": "t", "mode": "systemd", "service_user": None, "processes": [
        {"name": "master-S", "role": "master", "level": "S", "ready": str(ready), "log": str(state / "logs" / "m.log"),
         "unit": "strata-master@S.service", "argv": [], "env": {}}]}
    t = remote.LocalTransport("here")
    res = t.run_json(remote.agent_argv(sys.executable, "start", "--state-dir", str(state)),
                     input=json.dumps(plan).encode())
    assert res["processes"][0]["unit"] == "strata-master@S.service"
    assert log.read_text().splitlines() == ["daemon-reload", "enable strata-master@S.service",
                                            "restart strata-master@S.service"]
    ready.write_text(json.dumps({"address": "10.0.0.4:50050", "pid": 4242}))
    st = t.run_json(remote.agent_argv(sys.executable, "status", "--state-dir", str(state)))
    want = {"alive": True, "ready": True, "pid": 4242, "restarts": 1, "address": "10.0.0.4:50050"}
    assert {k: st["processes"][0][k] for k in want} == want
    assert t.run_json(remote.agent_argv(sys.executable, "stop", "--state-dir", str(state)))["stopped"] == 1
    assert log.read_text().splitlines()[-1] == "disable --now strata-master@S.service"
