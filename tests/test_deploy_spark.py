"""`strata deploy` and a level's own Spark cluster (issue 31): the inventory's
``[levels."L".spark]`` table, the deprecated ``[deployment] spark_master``, which host
receives which Spark secret, and (``netns``, ``slow``) a level's Spark standalone cluster
started by ``strata deploy up`` over real ssh.

Topology of the end-to-end tests (tests/netns_hosts.py's Topology and Sshd, as in tests/test_deploy_ssh.py),
on a bridge:

    op  10.79.0.2   the operator: `strata deploy` (ssh, scp) and the clients
    a   10.79.0.3   sshd; level S's Spark standalone master and one Spark worker (1 core, 1 GB)
    b   10.79.0.4   sshd; the S master and one S worker (its Spark driver; executors on a)
    c   10.79.0.5   sshd; the TS master and one TS worker (local Spark), with TS's own secret

The config names S's cluster (``[groups."S"] spark_master = "spark://10.79.0.3:7077"``) and
each level's secret file; ``up`` starts the Spark daemons on a first (authentication and
encryption on, the secret in a 0600 properties file on a only), then the Strata processes.
A replay through the S master equals the reference evaluator, its tasks counted in the
executor's stderr under a's work dir; S's secret reaches b only (c gets TS's), no command
line or environment of any host carries it, every listening socket on a is on a's address;
a TS worker on c presenting TS's secret to S's cluster is refused in one line; ``down``
stops everything.  Needs root, openssh-server and Java; skips naming what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import BATTLEFIELD_TOML
from .helpers import write_config
from .netns_hosts import (PY, assert_replay_equals_reference, cli_op, deploy_op, ip, namespaces, ours_left,
                          replay_args, ssh_hosts, ssh_skip_reason, tls_available)
from .polling import poll
from .test_spark_cluster import assert_one_line

#: the workers this module starts warm up (conftest.py: the suite's default skips it): the level's Spark
#: cluster runs the worker's warm-up tasks before the replay's (counted)
WORKER_WARM_UP = True

S_SECRET = "level-S-spark-secret-0b5e"
TS_SECRET = "level-TS-spark-secret-77d1"


def secret_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


# ---- the inventory, without a network -------------------------------------------------------------------
UNIT_INVENTORY = """\
[deployment]
config = "strata.toml"
remote_config = "/etc/strata/strata.toml"
state_dir = "/var/lib/strata"
python = "/opt/strata/bin/python"
tls = true
{deployment}

[levels.S]
address = "239.255.10.3"
ttl = 1

[levels.S.spark]
master_host = "s-spark"
{spark}

[levels.TS]
address = "239.255.10.4"
{ts}

[[hosts]]
name = "s-spark"                 # only level S's Spark daemons: no levels
ssh = "root@10.0.3.20"
address = "10.0.3.20"

[[hosts]]
name = "s-work"
ssh = "root@10.0.3.11"
address = "10.0.3.11"
config = "/srv/strata/etc/strata.toml"
levels = {{ S = 2 }}

[[hosts]]
name = "s-master"
ssh = "root@10.0.3.10"
address = "10.0.3.10"
levels = {{ S = {{ master = true }} }}

[[hosts]]
name = "ts"
ssh = "root@10.0.4.10"
address = "10.0.4.10"
levels = {{ TS = {{ master = true, workers = 1 }} }}
"""

S_GROUP = ('[groups."S"]\nspark_master = "spark://10.0.3.20:7077"\nspark_secret_file = "keys/S.spark"\n'
           'spark_conf = { "spark.cores.max" = "1" }\n')
TS_GROUP = '[groups."TS"]\nspark_secret_file = "keys/TS.spark"\n'
#: TS on its own cluster, on the host of S's (other ports)
TS_CLUSTER = '[groups."TS"]\nspark_master = "spark://10.0.3.20:7078"\nspark_secret_file = "keys/TS.spark"\n'


def unit_inventory(d: Path, groups: str = S_GROUP + TS_GROUP, deployment: str = "", spark: str = "",
                   ts: str = ""):
    from strata.deploy.inventory import load_inventory

    secret_file(d / "keys" / "S.spark", S_SECRET)
    secret_file(d / "keys" / "TS.spark", TS_SECRET)
    (d / "strata.toml").write_text(BATTLEFIELD_TOML + groups)
    p = d / "inv.toml"
    p.write_text(UNIT_INVENTORY.format(deployment=deployment, spark=spark, ts=ts))
    return load_inventory(p)


def unit_error(d: Path, **kw) -> str:
    from strata.deploy.inventory import InventoryError

    with pytest.raises(InventoryError) as e:
        unit_inventory(d, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_levels_spark_cluster_in_the_inventory(tmp_path):
    from strata.deploy import cli, spark_daemons, units

    inv = unit_inventory(tmp_path, spark='workers = ["s-spark", "s-work"]\nworker_cores = 1\nworker_memory = "1g"')
    c = inv.spark["S"]
    assert (c.url, c.master_host, c.workers, c.master_webui_port, c.worker_port, c.worker_webui_port) == \
        ("spark://10.0.3.20:7077", "s-spark", ("s-spark", "s-work"), 8080, 0, 8081)
    assert "TS" not in inv.spark
    spark_host, s_work, s_master, ts = (inv.host(n) for n in ("s-spark", "s-work", "s-master", "ts"))
    assert spark_host.processes(inv) == [] and inv.spark_daemons(spark_host) == [("spark-master", "S"),
                                                                                 ("spark-worker", "S")]
    plan = spark_daemons.daemon_plan(inv, spark_host)
    master, worker = plan
    assert master["class"] == spark_daemons.MASTER_CLASS and master["args"] == [
        "--host", "10.0.3.20", "--port", "7077", "--webui-port", "8080",
        "--properties-file", "/var/lib/strata/spark/S/spark.properties"]
    assert worker["args"] == ["spark://10.0.3.20:7077", "--host", "10.0.3.20", "--port", "0", "--webui-port", "8081",
                              "--work-dir", "/var/lib/strata/spark/S/work", "--cores", "1", "--memory", "1g",
                              "--properties-file", "/var/lib/strata/spark/S/spark.properties"]
    assert master["env"]["SPARK_LOCAL_IP"] == "10.0.3.20"  # RPC and web UI on the host's address only
    assert S_SECRET not in json.dumps(plan)  # the plan (and the records made from it) never holds the secret

    # which host receives which Spark secret: the level's worker hosts only, at the config's path
    secrets = cli.spark_secrets(inv)
    assert secrets == {"S": S_SECRET, "TS": TS_SECRET}
    assert units.spark_secret_files_for(inv, s_work) == {"/srv/strata/etc/keys/S.spark": tmp_path / "keys" / "S.spark"}
    assert units.spark_secret_files_for(inv, ts) == {"/etc/strata/keys/TS.spark": tmp_path / "keys" / "TS.spark"}
    assert units.spark_secret_files_for(inv, s_master) == {}  # the S master runs no Spark
    assert units.spark_secret_files_for(inv, spark_host) == {}  # its daemons read the properties file

    def files(host):
        return {dst: (src, mode) for src, dst, mode in cli._host_files(inv, host, False, None, secrets)}

    props = files(spark_host)["/var/lib/strata/spark/S/spark.properties"]
    assert props[1] == 0o600
    for line in ("spark.authenticate true", f"spark.authenticate.secret {S_SECRET}",
                 "spark.network.crypto.enabled true",
                 "spark.io.encryption.enabled true", "spark.network.crypto.saslFallback false",
                 "spark.master.rest.enabled false", "spark.ui.killEnabled false", "spark.port.maxRetries 0",
                 "spark.master.ui.port 8080", "spark.worker.ui.port 8081"):
        assert line in props[0].splitlines(), line
    worker_props = files(s_work)["/var/lib/strata/spark/S/spark.properties"][0]  # a Spark worker there too
    assert "spark.master.ui.port" not in worker_props
    for host, want in ((s_work, ["/srv/strata/etc/keys/S.spark"]), (ts, ["/etc/strata/keys/TS.spark"]),
                       (s_master, []), (spark_host, [])):
        got = [dst for dst in files(host) if dst.endswith(".spark")]
        assert got == want, (host.name, got)
        text = "".join(src for src, _m in files(host).values() if isinstance(src, str))
        level_secrets = [s for s in (S_SECRET, TS_SECRET) if s in text]
        assert level_secrets == ([S_SECRET] if host in (spark_host, s_work) else []), host.name
    # the operator's file must be there and private: one line naming it
    (tmp_path / "keys" / "TS.spark").unlink()
    from strata.errors import CliError

    with pytest.raises(CliError, match=r"^\[groups\.\"TS\"\] spark_secret_file .*TS.spark: cannot read the secret of "
                                       r"level TS's Spark cluster: No such file or directory \(strata deploy copies "
                                       r"it to level TS's worker hosts\)$"):
        cli.spark_secrets(inv)


def test_the_config_must_name_the_cluster_deploy_runs(tmp_path):
    assert unit_error(tmp_path, spark="master_port = 7078") == (
        "inventory levels.S.spark: the config's [groups.\"S\"] spark_master is spark://10.0.3.20:7077, but this "
        "inventory runs level S's Spark master at spark://10.0.3.20:7078 (master_host s-spark's address, "
        "master_port): make them equal")
    assert unit_error(tmp_path, groups=TS_GROUP) == (
        "inventory levels.S.spark: the config's [groups.\"S\"] spark_master is not set; this inventory runs level S's "
        "Spark master at spark://10.0.3.20:7077: set spark_master = \"spark://10.0.3.20:7077\" and "
        "spark_secret_file there")


@pytest.mark.parametrize("spark, ts, want", [
    ('workers = ["nowhere"]', "", "inventory levels.S.spark.workers: no host named 'nowhere' (hosts: s-spark, "
                                  "s-work, s-master, ts)"),
    ("workers = []", "", "inventory levels.S.spark.workers: no Spark worker: name at least one host"),
    ("master_port = 0", "", "inventory levels.S.spark.master_port: must be a fixed TCP port"),
    ('worker_memory = "lots"', "", 'inventory levels.S.spark.worker_memory: must be an amount like "512m" or "4g"'),
    ("worker_cores = 0", "", "inventory levels.S.spark.worker_cores: must be a number of cores 1..1024"),
    ("webui_port = 1", "", "inventory levels.S.spark.webui_port: unknown key (known: master_host, master_port, "
                           "master_webui_port, worker_cores, worker_memory, worker_port, worker_webui_port, workers)"),
    # two levels' Spark daemons on one host: their own ports, or refused
    ("", '[levels.TS.spark]\nmaster_host = "s-spark"\nmaster_port = 7078\n',
     "inventory levels.TS.spark.master_webui_port: s-spark spark-master-TS (master_webui_port) and s-spark "
     "spark-master-S (master_webui_port) both listen on 10.0.3.20:8080"),
    ("", '[levels.TS.spark]\nmaster_host = "s-spark"\nmaster_port = 7078\nmaster_webui_port = 8090\n',
     "inventory levels.TS.spark.worker_webui_port: s-spark spark-worker-TS (worker_webui_port) and s-spark "
     "spark-worker-S (worker_webui_port) both listen on 10.0.3.20:8081"),
])
def test_bad_spark_tables_are_refused_naming_the_key(tmp_path, spark, ts, want):
    groups = S_GROUP + (TS_CLUSTER if "levels.TS.spark" in ts else TS_GROUP)
    assert unit_error(tmp_path, groups=groups, spark=spark, ts=ts).startswith(want)


def test_two_levels_spark_on_one_host_with_their_own_ports(tmp_path):
    inv = unit_inventory(tmp_path, groups=S_GROUP + TS_CLUSTER,
                         ts='[levels.TS.spark]\nmaster_host = "s-spark"\nmaster_port = 7078\n'
                            'master_webui_port = 8090\nworker_webui_port = 8091\n')
    from strata.deploy import spark_daemons

    plan = spark_daemons.daemon_plan(inv, inv.host("s-spark"))
    assert [d["name"] for d in plan] == ["spark-master-S", "spark-worker-S", "spark-master-TS", "spark-worker-TS"]
    assert len({d["mark"] for d in plan}) == 2 and len({d["log"] for d in plan}) == 4  # a directory and logs each
    assert {d["env"]["SPARK_CONF_DIR"] for d in plan} == {"/var/lib/strata/spark/S/conf",
                                                          "/var/lib/strata/spark/TS/conf"}


def test_the_deprecated_deployment_spark_master(tmp_path):
    from strata.deploy import units

    inv = unit_inventory(tmp_path, deployment='spark_master = "local[2]"')
    assert inv.warnings == ["deployment.spark_master is deprecated (each level's workers use the config's "
                            "[groups.\"L\"] spark_master): local[2] applies only to level TS, which sets none"]
    s_work, ts = inv.host("s-work"), inv.host("ts")
    for host in inv.hosts:
        for p in host.processes(inv):
            assert "--spark-master" not in units.process_argv(inv, host, p)
    assert "STRATA_SPARK_MASTER" not in units.process_env(inv, s_work, s_work.processes(inv)[0])  # the config's wins
    assert units.process_env(inv, ts, ts.processes(inv)[1])["STRATA_SPARK_MASTER"] == "local[2]"
    env_files = units.render_env_files(inv, ts)
    assert 'STRATA_SPARK_MASTER="local[2]"' in env_files["/etc/strata/worker-TS-0.env"]
    assert "STRATA_SPARK_MASTER" not in units.render_env_files(inv, s_work)["/etc/strata/worker-S-0.env"]
    unit = units.render_units(inv, s_work)["/etc/systemd/system/strata-worker@.service"]
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "spark" not in exec_start.lower()
    # without it: no Spark setting of deploy's own for any worker
    inv = unit_inventory(tmp_path)
    assert inv.spark_master is None and not inv.warnings
    assert "STRATA_SPARK_MASTER" not in units.process_env(inv, ts, ts.processes(inv)[1])
    # one cluster for every level: refused
    assert unit_error(tmp_path, deployment='spark_master = "spark://10.0.9.9:7077"') == (
        "inventory deployment.spark_master: spark://10.0.9.9:7077: one Spark cluster for every level is refused (a "
        "level's Spark cluster is never shared): give each level its own in the config, [groups.\"L\"] spark_master "
        "and spark_secret_file (deprecated key: remove it)")
    assert unit_error(tmp_path, deployment='spark_master = "yarn"').startswith(
        "inventory deployment.spark_master: 'yarn' is not \"local\"")


def test_deploy_check_refuses_a_mismatch_in_one_line(tmp_path):
    unit_inventory(tmp_path)
    inv = tmp_path / "inv.toml"
    inv.write_text(inv.read_text().replace('master_host = "s-spark"', 'master_host = "s-spark"\nmaster_port = 7177'))
    r = subprocess.run([sys.executable, "-m", "strata", "deploy", "check", "--inventory", str(inv)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "strata: inventory levels.S.spark: the config's [groups.\"S\"] spark_master is spark://10.0.3.20:7077, "
        "but this inventory runs level S's Spark master at spark://10.0.3.20:7177 (master_host s-spark's address, "
        "master_port): make them equal"]


FAKE_SPARK_CLASS = """#!{python}
import json, os, sys, time
role = "spark-worker" if sys.argv[1].endswith(".Worker") else "spark-master"
env = {{k: v for k, v in os.environ.items() if k.startswith("SPARK_")}}
open(os.path.join(os.environ["SPARK_CONF_DIR"], role + ".env.json"), "w").write(json.dumps(env))
print({markers}[role], flush=True)
time.sleep(120)
"""


def test_the_host_agent_runs_records_and_stops_spark_daemons(tmp_path, monkeypatch):
    """The agent's spark-start, status and stop with a stand-in for spark-class (no JVM)."""
    from dataclasses import replace

    from strata.deploy import remote, spark_daemons

    home = tmp_path / "spark-home"
    (home / "bin").mkdir(parents=True)
    launcher = home / "bin" / "spark-class"
    launcher.write_text(FAKE_SPARK_CLASS.format(python=sys.executable, markers=repr(spark_daemons.READY_MARKERS)))
    launcher.chmod(0o755)
    monkeypatch.setattr(spark_daemons, "spark_class", lambda: launcher)
    monkeypatch.setenv("SPARK_HOME", "/elsewhere")  # the agent's own SPARK_* never reach a daemon
    monkeypatch.setenv("SPARK_CONF_DIR", "/elsewhere/conf")
    inv = unit_inventory(tmp_path / "cfg")
    state = tmp_path / "state"
    host = replace(inv.host("s-spark"), state_dir=str(state))
    plan = spark_daemons.daemon_plan(inv, host)
    props = Path(spark_daemons.properties_path(host, "S"))
    props.parent.mkdir(parents=True)
    props.write_text(spark_daemons.properties_text(inv, host, "S", S_SECRET))
    res = remote.agent_spark_start(str(state), {"deployment": "t", "daemons": plan})
    assert [d["name"] for d in res["daemons"]] == ["spark-master-S", "spark-worker-S"]
    pids = [d["pid"] for d in res["daemons"]]
    assert poll(lambda: all(d["ready"] for d in remote.agent_status(str(state))["spark"]), timeout=30)
    st = {d["name"]: d for d in remote.agent_status(str(state))["spark"]}
    assert st["spark-master-S"]["address"] == "spark://10.0.3.20:7077" and st["spark-worker-S"]["alive"]
    env = json.loads((state / "spark" / "S" / "conf" / "spark-master.env.json").read_text())
    assert env == {"SPARK_HOME": str(home), "SPARK_LOCAL_IP": "10.0.3.20",
                   "SPARK_CONF_DIR": str(state / "spark/S/conf"), "SPARK_LOCAL_DIRS": str(state / "spark/S/local")}
    assert S_SECRET not in (state / "run" / "spark.json").read_text()
    # running: a second start (and a new up's port step) is refused
    assert "already running" in remote.agent_spark_start(str(state), {"daemons": plan})["error"]
    assert "spark-master-S" in remote.agent_ports(str(state), {"address": "127.0.0.1", "processes": {}})["error"]
    assert remote.agent_stop(str(state), timeout=5) == {"stopped": 0, "spark_stopped": 2}
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert remote.agent_status(str(state))["spark"] == []


# ---- end to end over ssh: a level's Spark cluster on one host, its Strata worker on another -------------------
SUBNET = "10.79.0"
HOSTS = {"op": 2, "a": 3, "b": 4, "c": 5}

E2E_INVENTORY = """\
[deployment]
name = "spark-test"
config = "strata.toml"
state_dir = "{state}/default"
python = "{python}"
secrets = "secrets"
tls = {tls}
transport = "ssh"
chunk_seconds = 1.0
ready_timeout = 240
ssh_options = {ssh_options}

[levels.S]
address = "239.255.79.3"
port = 47300
ttl = 1

[levels.S.spark]                 # level S's own Spark cluster, on host a
master_host = "a"
master_port = 7077
master_webui_port = 8080
workers = ["a"]
worker_cores = 1
worker_memory = "1g"

[levels.TS]
address = "239.255.79.4"
port = 47300
ttl = 1

[[hosts]]
name = "a"
ssh = "{user}@{addr[a]}"
address = "{addr[a]}"
state_dir = "{state}/a"
config = "{state}/a/etc/strata.toml"

[[hosts]]
name = "b"
ssh = "{user}@{addr[b]}"
address = "{addr[b]}"
state_dir = "{state}/b"
config = "{state}/b/etc/strata.toml"
levels = {{ S = {{ master = true, workers = 1 }} }}

[[hosts]]
name = "c"
ssh = "{user}@{addr[c]}"
address = "{addr[c]}"
state_dir = "{state}/c"
config = "{state}/c/etc/strata.toml"
levels = {{ TS = {{ master = true, workers = 1 }} }}
"""

E2E_GROUPS = """
[groups."S"]
spark_master = "spark://{addr}:7077"
spark_secret_file = "keys/S.spark"
spark_conf = {{ "spark.executor.memory" = "1g", "spark.cores.max" = "1" }}

[groups."TS"]
spark_secret_file = "keys/TS.spark"
"""

e2e = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(scope="module")
def topo():
    reason = ssh_skip_reason()
    if reason is None and not (os.environ.get("JAVA_HOME") or subprocess.run(["which", "java"],
                                                                                capture_output=True).returncode == 0):
        reason = "no Java: a Spark standalone cluster cannot start"
    with namespaces("sk", SUBNET, HOSTS, reason) as t:
        yield t


@pytest.fixture(scope="module")
def env(topo, tmp_path_factory):
    """sshd on a, b, c; the config (S on its cluster at a), the levels' secrets, users, inventory;
    `deploy down` and sshd stopped at the end (the namespaces' processes are killed with them)."""
    with ssh_hosts(topo, tmp_path_factory.mktemp("deploy-spark"), ["a", "b", "c"]) as info:
        d, sshd = info["dir"], info["sshd"]
        info["state"] = d / "state"
        secret_file(d / "keys" / "S.spark", S_SECRET)
        secret_file(d / "keys" / "TS.spark", TS_SECRET)
        cfg = write_config(d, BATTLEFIELD_TOML + E2E_GROUPS.format(addr=topo.address("a")), {"sam": "S"})
        tls = tls_available()
        inv = d / "inventory.toml"
        inv.write_text(E2E_INVENTORY.format(state=d / "state", python=PY, tls="true" if tls else "false",
                                            user=sshd.user, ssh_options=json.dumps(sshd.options()),
                                            addr={h: topo.address(h) for h in HOSTS}))
        info.update(config=cfg, inventory=inv, tls=tls, url=f"spark://{topo.address('a')}:7077")
        yield info


def _pids(topo, host: str) -> list[int]:
    return [int(x) for x in ip("netns", "pids", topo.ns[host]).stdout.split()]


def _executor_tasks(work: Path) -> int:
    """Tasks the standalone executors finished (their stderr under the Spark worker's work dir)."""
    return sum(f.read_text(errors="replace").count("Finished task") for f in work.glob("app-*/*/stderr"))


@pytest.mark.netns
@pytest.mark.slow
def test_check_reach_names_the_levels_cluster(topo, env):
    r = deploy_op(topo, "check", "--inventory", str(env["inventory"]), "--reach", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["levels"]["S"]["spark"] == {"master": env["url"], "master_host": "a", "workers": ["a"]}
    assert "spark" not in out["levels"]["TS"]
    assert out["hosts"]["a"]["spark_class"].endswith("/bin/spark-class")


@pytest.mark.netns
@pytest.mark.slow
def test_up_starts_the_levels_spark_cluster_first(topo, env):
    t0 = time.monotonic()
    r = deploy_op(topo, "up", "--inventory", str(env["inventory"]))
    env["up_seconds"] = time.monotonic() - t0
    assert r.returncode == 0, f"deploy up failed:\n{r.stderr[-6000:]}"
    print(f"deploy up with level S's Spark cluster: {env['up_seconds']:.1f} s\n{r.stderr}")
    for line in r.stderr.splitlines():
        assert line.startswith("[deploy] "), line
    out = json.loads(r.stdout)
    env["master"] = out["masters"]["S"]
    err = r.stderr
    assert f"level S: Spark master {env['url']} on a is up with 1 worker (a)" in err, err
    assert err.index("Spark master") < err.index("waiting for processes")  # the cluster before the Strata workers
    assert "a: " in err and "started spark-master-S, spark-worker-S" in err, err
    assert out["masters"]["S"].startswith(topo.address("b") + ":") and out["masters"]["TS"].startswith(
        topo.address("c") + ":")
    state = env["state"]
    log = (state / "b" / "logs" / "worker-S-0.log").read_text()
    assert f"on {env['url']} (1 executor, 1 core)" in log, log[-3000:]  # S's worker drives S's cluster
    assert "on spark://" not in (state / "c" / "logs" / "worker-TS-0.log").read_text()  # TS: local Spark

    # which host holds which secret: S's only on S's worker host b (0600), TS's only on c, none on a
    def secret_files(host):
        return sorted(p.name for p in (state / host / "etc" / "keys").glob("*.spark")) \
            if (state / host / "etc" / "keys").exists() else []

    assert secret_files("a") == [] and secret_files("b") == ["S.spark"] and secret_files("c") == ["TS.spark"]
    for host, level, secret in (("b", "S", S_SECRET), ("c", "TS", TS_SECRET)):
        f = state / host / "etc" / "keys" / f"{level}.spark"
        assert f.read_text().strip() == secret and f.stat().st_mode & 0o777 == 0o600
    props = state / "a" / "spark" / "S" / "spark.properties"
    assert props.stat().st_mode & 0o777 == 0o600 and f"spark.authenticate.secret {S_SECRET}" in props.read_text()
    assert not (state / "b" / "spark").exists() and not (state / "c" / "spark").exists()
    for host in ("a", "b", "c"):  # no Spark secret of another level anywhere on the host's files
        texts = [p.read_text(errors="replace") for p in (state / host).rglob("*") if p.is_file()]
        if host == "c":
            assert not any(S_SECRET in t for t in texts), host
        else:
            assert not any(TS_SECRET in t for t in texts), host

    # the secret on no command line and in no environment of any process of the hosts, but for Spark's own
    # hand-over from a standalone worker to the executor it starts (_SPARK_AUTH_SECRET, readable by root only)
    executors = 0
    for host in ("a", "b", "c"):
        for pid in _pids(topo, host):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for secret in (S_SECRET, TS_SECRET):
                assert secret.encode() not in cmd, (host, pid)
                holders = [v.split(b"=", 1)[0] for v in environ if secret.encode() in v]
                if b"CoarseGrainedExecutorBackend" in cmd and host == "a" and secret == S_SECRET:
                    assert holders == [b"_SPARK_AUTH_SECRET"], holders
                    executors += 1
                else:
                    assert holders == [], (host, pid, holders)
    assert executors == 1

    # every listening TCP socket on a (Spark master, worker and their web UIs, the executor) is on a's address
    r = topo.run("a", "ss", "-ltnH")
    listening = [line.split()[3] for line in r.stdout.splitlines() if line.strip()]
    assert any(x.endswith(":7077") for x in listening) and any(x.endswith(":8080") for x in listening), listening
    strays = [x for x in listening if topo.address("a") not in x and not x.endswith(":22")]
    assert strays == [], listening


@pytest.mark.netns
@pytest.mark.slow
def test_status_shows_the_spark_daemons(topo, env):
    r = deploy_op(topo, "status", "--inventory", str(env["inventory"]), "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    st = json.loads(r.stdout)
    assert st["healthy"]
    daemons = {d["name"]: d for d in st["spark"]["S"]}
    assert set(daemons) == {"spark-master-S", "spark-worker-S"} and all(d["host"] == "a" for d in daemons.values())
    master = daemons["spark-master-S"]
    assert master["ready"] and master["address"] == env["url"] and master["status"] == "ALIVE"
    assert master["workers"] == [topo.address("a")] and master["apps"] == ["strata-worker-S"]
    text = deploy_op(topo, "status", "--inventory", str(env["inventory"]))
    assert text.returncode == 0 and "spark-master-S" in text.stdout and "apps: strata-worker-S" in text.stdout


@pytest.mark.netns
@pytest.mark.slow
def test_replay_runs_on_the_levels_standalone_executor(topo, env, tmp_path):
    work = env["state"] / "a" / "spark" / "S" / "work"
    before = _executor_tasks(work)
    assert before > 0  # the worker's warm-up ran there already
    t0 = time.monotonic()
    r = cli_op(topo, env, ["replay"], *replay_args(tmp_path), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_replay_equals_reference(env["config"], tmp_path / "out")
    after = _executor_tasks(work)
    assert after > before, (before, after)  # the replay's jobs ran on a's executor
    print(f"replay through the S master {time.monotonic() - t0:.1f} s; executor tasks on a: {before} (warm-up) + "
          f"{after - before} (replay)")


@pytest.mark.netns
@pytest.mark.slow
def test_a_worker_with_another_levels_secret_is_refused(topo, env):
    """On c, a TS worker pointed at S's cluster with the TS secret deploy gave c: one line, in seconds."""
    from strata.groups import level_slug, load_or_create_key

    etc = env["state"] / "c" / "etc"
    bad = etc / "ts-on-s.toml"
    bad.write_text(BATTLEFIELD_TOML + f'\n[groups."TS"]\nspark_master = "{env["url"]}"\n'
                                      f'spark_secret_file = "keys/TS.spark"\n')
    state = env["dir"] / "refused-state"
    load_or_create_key(state / "keys" / f"{level_slug('TS')}.key", create=True)
    t0 = time.monotonic()
    r = topo.run("c", PY, "-m", "strata", "worker", "--config", str(bad), "--level", "TS",
                 "--listen", f"{topo.address('c')}:0", "--state-dir", str(state), "--insecure", timeout=120)
    seconds = time.monotonic() - t0
    print(f"a TS worker with TS's secret refused by S's cluster after {seconds:.1f} s")
    assert r.returncode == 1
    assert_one_line(r.stderr, f"Spark master {env['url']} refused this worker's authentication (is [groups.\"TS\"] "
                              f"spark_secret_file this level's cluster's secret?)")
    assert seconds < 60


@pytest.mark.netns
@pytest.mark.slow
def test_down_stops_everything(topo, env):
    r = deploy_op(topo, "down", "--inventory", str(env["inventory"]))
    assert r.returncode == 0, r.stderr
    assert "stopped 4 processes and 2 Spark daemons" in r.stderr, r.stderr
    assert "a: stopped 0 processes and 2 Spark daemons" in r.stderr, r.stderr
    for h in ("a", "b", "c"):  # the executor and the workers' JVMs too; sshd stays
        assert poll(lambda: ours_left(topo, h) == [], timeout=30), (h, ours_left(topo, h))
    assert not env["inventory"].with_name("inventory.deployed.json").exists()
    st = deploy_op(topo, "status", "--inventory", str(env["inventory"]), "--json")
    assert st.returncode == 1 and not json.loads(st.stdout)["spark"]
