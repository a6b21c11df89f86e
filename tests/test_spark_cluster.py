"""A Spark cluster per level (strata/spark_settings.py, worker/spark.py, worker/load.py).

Unit tests (no Spark): the ``[groups."L"]`` Spark settings, their one-line errors, the secret file,
which master a worker uses, the probe's diagnosis of a refusal, the driver's address and Algorithm 5's
reading of a cluster's executors.

End to end (``slow``): a Spark standalone master and worker started here with the pyspark package's
own launcher on loopback, with Spark's authentication and encryption on; ``strata up`` with
``[groups."S"] spark_master`` pointing at it, a replay into it equal to the reference with its jobs on
the standalone executor; and workers refused in one line within seconds: one with another level's
secret, one that cannot reach its master, one without a secret, one pointed at another level's cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from strata.config import ConfigError, load_config, parse_config
from strata.spark_settings import SparkSettings, check_spark_settings, master_problem, spark_settings
from strata.worker.load import ExecutorSample, ExecutorSlotsLoad, ProcessTreeLoad, host_cpu_percent, make_load

from .conftest import BATTLEFIELD_TOML

#: the workers this module starts warm up (conftest.py: the suite's default skips it): the level's Spark
#: cluster runs the worker's warm-up tasks before the replay's (counted)
WORKER_WARM_UP = True

BASE = '[lattice]\nlevels = ["U", "C", "S", "TS"]\n'


def secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


# ---- the settings ---------------------------------------------------------------------------------
def test_defaults_and_a_cluster_level(tmp_path):
    secret_file(tmp_path / "keys" / "S.spark", "s-secret\n")
    p = tmp_path / "strata.toml"
    p.write_text(BASE + '[groups."S"]\nspark_master = "spark://10.0.0.7:7077"\nspark_secret_file = "keys/S.spark"\n'
                 'spark_conf = { "spark.executor.memory" = "1g", "spark.executor.cores" = 1, '
                 'spark.driver.port = 40100, "spark.speculation" = false }\n'
                 '[groups."TS"]\nspark_master = "local[*]"\n')
    cfg = load_config(p)
    s = spark_settings(cfg, "S", environ={})
    assert s == SparkSettings(level="S", master="spark://10.0.0.7:7077",
                              conf={"spark.executor.memory": "1g", "spark.executor.cores": "1",
                                    "spark.driver.port": "40100", "spark.speculation": "false"},
                              secret_file=tmp_path / "keys" / "S.spark", source="config")
    assert not s.is_local and s.read_secret() == "s-secret"  # the final newline is not part of it
    assert spark_settings(cfg, "TS", environ={}).is_local
    u = spark_settings(cfg, "U", environ={})
    assert (u.master, u.source, u.conf, u.secret_file, u.is_local) == ("local[1]", "default", {}, None, True)


def test_which_master_a_worker_uses(tmp_path):
    cfg = parse_config(BASE + '[groups."S"]\nspark_master = "local[2]"\n')
    env = {"STRATA_SPARK_MASTER": "local[3]"}
    assert spark_settings(cfg, "S", environ=env).master == "local[2]"  # the configuration beats the environment
    assert spark_settings(cfg, "S", "local[4]", environ=env).master == "local[4]"  # the flag beats both
    assert spark_settings(cfg, "U", environ=env).master == "local[3]"  # no setting: the environment
    assert spark_settings(cfg, "U", environ={}).master == "local[1]"
    with pytest.raises(ConfigError, match=r"^STRATA_SPARK_MASTER: 'yarn' is not"):
        spark_settings(cfg, "U", environ={"STRATA_SPARK_MASTER": "yarn"})
    with pytest.raises(ConfigError, match=r"^--spark-master: 'mesos://h:1' is not"):
        spark_settings(cfg, "U", "mesos://h:1", environ={})


def test_a_flag_may_not_point_a_worker_at_another_levels_cluster(tmp_path):
    secret_file(tmp_path / "S.spark", "s")
    p = tmp_path / "strata.toml"
    p.write_text(BASE + '[groups."S"]\nspark_master = "spark://h:7077"\nspark_secret_file = "S.spark"\n')
    cfg = load_config(p)
    with pytest.raises(ConfigError) as e:
        spark_settings(cfg, "TS", "spark://H:7077", environ={})
    assert str(e.value) == ('--spark-master spark://H:7077 is level S\'s Spark master ([groups."S"] spark_master); '
                            "a level's Spark cluster is never shared with another level")
    # a cluster given to a level without a secret: refused when the worker reads it
    s = spark_settings(cfg, "TS", "spark://other:7077", environ={})
    with pytest.raises(ConfigError, match=r'^Spark master spark://other:7077: level TS has no secret for its Spark '
                                          r'cluster: set \[groups."TS"\] spark_secret_file'):
        s.read_secret()


@pytest.mark.parametrize("group, message", [
    ('spark_master = "yarn"', ':7: [groups."S"] spark_master: \'yarn\' is not "local", "local[N]", "local[*]" or '
                              '"spark://host:port" (a Spark standalone master)'),
    ('spark_master = "local[0]"', ':7: [groups."S"] spark_master: \'local[0]\' is not'),
    ('spark_master = "spark://h"', ':7: [groups."S"] spark_master: \'spark://h\' is not'),
    ('spark_master = "spark://h:70000"', ':7: [groups."S"] spark_master: \'spark://h:70000\' is not'),
    ('spark_master = "spark://a:7077,b:7077"', ":7: [groups.\"S\"] spark_master: 'spark://a:7077,b:7077': one "
                                               "standalone master per level"),
    ('spark_master = 7077', ':7: [groups."S"] spark_master: must be "local", "local[N]"'),
    ('spark_master = "spark://h:7077"', ':7: [groups."S"] spark_master: a Spark cluster (spark://h:7077) needs '
                                        "spark_secret_file, the text of the cluster's spark.authenticate.secret"),
    ('spark_conf = "x"', ':7: [groups."S"] spark_conf: must be a table of Spark settings'),
    ('spark_conf = { "executor.memory" = "1g" }', ':7: [groups."S"] spark_conf: \'executor.memory\' is not a Spark '
                                                  'setting (keys start with "spark.")'),
    ('spark_conf = { "spark.master" = "local" }', ":7: [groups.\"S\"] spark_conf: 'spark.master' is Strata's to set: "
                                                  "give the level's master as spark_master"),
    ('spark_conf = { "spark.app.name" = "x" }', ":7: [groups.\"S\"] spark_conf: 'spark.app.name' is Strata's to set"),
    ('spark_conf = { "spark.authenticate" = false }', ":7: [groups.\"S\"] spark_conf: 'spark.authenticate' is "
                                                      "Strata's to set: Spark's authentication and encryption are "
                                                      "always on"),
    ('spark_conf = { "spark.authenticate.secret" = "x" }', "'spark.authenticate.secret' is Strata's to set: give the "
                                                           "file with the level's secret as spark_secret_file"),
    ('spark_conf = { spark.authenticate.enableSaslEncryption = true }', "'spark.authenticate.enableSaslEncryption' "
                                                                        "is Strata's to set"),
    ('spark_conf = { "spark.network.crypto.enabled" = false }', "'spark.network.crypto.enabled' is Strata's to set"),
    ('spark_conf = { "spark.io.encryption.enabled" = false }', "'spark.io.encryption.enabled' is Strata's to set"),
    ('spark_conf = { "spark.executor.extraClassPath" = ["a"] }', ":7: [groups.\"S\"] spark_conf: "
                                                                 "'spark.executor.extraClassPath': the value must be a "
                                                                 "string, number or boolean"),
    ('spark_secret_file = ""', ':7: [groups."S"] spark_secret_file: must be the path of the file'),
    ('spark_masterr = "local"', ':7: [groups."S"] spark_masterr: unknown key (the Spark keys of a level: '
                                'spark_master, spark_conf, spark_secret_file)'),
])
def test_bad_settings_are_refused_in_one_line_naming_file_line_and_key(tmp_path, group, message):
    p = tmp_path / "strata.toml"
    p.write_text(BASE + '\n[groups."U"]\ncpus = "0"\n[groups."S"]\n' + group + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    text = str(e.value)
    assert text.startswith(f"{p}:") and "\n" not in text
    assert message in text, text


def test_unquoted_group_names_find_their_line():
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + "[groups.TS]\nspark_master = \"yarn\"\n")
    assert str(e.value).startswith("<config>:4: [groups.TS] spark_master: 'yarn' is not")


def test_a_cluster_is_never_shared_between_levels(tmp_path):
    a = secret_file(tmp_path / "keys" / "S.spark", "one secret\n")
    secret_file(tmp_path / "keys" / "TS.spark", "another\n")
    p = tmp_path / "strata.toml"

    def load(ts: str):
        p.write_text(BASE + '[groups."S"]\nspark_master = "spark://10.0.0.7:7077"\nspark_secret_file = "keys/S.spark"\n'
                     '[groups."TS"]\n' + ts)
        return load_config(p)

    load('spark_master = "spark://10.0.0.8:7077"\nspark_secret_file = "keys/TS.spark"\n')
    with pytest.raises(ConfigError) as e:
        load('spark_master = "spark://10.0.0.7:7077"\nspark_secret_file = "keys/TS.spark"\n')
    assert str(e.value) == (f"{p}:7: [groups.\"TS\"] spark_master: spark://10.0.0.7:7077 is also level S's Spark "
                            f"master; a level's Spark cluster is never shared with another level")
    with pytest.raises(ConfigError, match=r":8: \[groups.\"TS\"\] spark_secret_file: .*keys/S.spark is also level "
                                          r"S's spark_secret_file; a level's Spark cluster is never shared"):
        load('spark_master = "spark://10.0.0.8:7077"\nspark_secret_file = "keys/../keys/S.spark"\n')
    secret_file(tmp_path / "keys" / "TS.spark", "one secret")  # another file, the same text
    with pytest.raises(ConfigError, match=r":8: \[groups.\"TS\"\] spark_secret_file: .*TS.spark holds the same "
                                          r"secret as level S's spark_secret_file"):
        load('spark_master = "spark://10.0.0.8:7077"\nspark_secret_file = "keys/TS.spark"\n')
    a.unlink()  # one of them not readable here (another host's file): nothing to compare, no error
    load('spark_master = "spark://10.0.0.8:7077"\nspark_secret_file = "keys/TS.spark"\n')


def test_the_secret_file_is_private_and_not_empty(tmp_path):
    f = secret_file(tmp_path / "S.spark", "s3cret\n", mode=0o644)
    p = tmp_path / "strata.toml"
    p.write_text(BASE + '[groups."S"]\nspark_master = "spark://h:7077"\nspark_secret_file = "S.spark"\n')
    with pytest.raises(ConfigError) as e:  # seen at load (a stat, not a read)
        load_config(p)
    assert str(e.value) == (f"{p}:5: [groups.\"S\"] spark_secret_file: {f} is readable or writable by group or "
                            f"others (mode 0644): chmod 600 it")
    f.chmod(0o400)
    s = spark_settings(load_config(p), "S", environ={})
    assert s.read_secret() == "s3cret"
    f.chmod(0o600)
    f.write_text("\n")
    with pytest.raises(ConfigError, match=r"spark_secret_file .*S.spark is empty"):
        s.read_secret()
    f.unlink()
    load_config(p)  # a file that is not here is the worker's concern, not every command's
    with pytest.raises(ConfigError, match=r"cannot read the secret of level S's Spark cluster: No such file"):
        s.read_secret()


def test_master_urls():
    for ok in ("local", "local[1]", "local[16]", "local[*]", "spark://h:7077", "spark://10.0.0.7:7077",
               "spark://[::1]:7077", "spark://spark-s.example.org:1"):
        assert master_problem(ok) is None, ok
    for bad in ("", "local[]", "local[0]", "local[2,3]", "yarn", "spark://h", "spark://:7077", "spark://h:0",
                "k8s://h:443", "spark://h:7077/", None):
        assert master_problem(bad), bad


def test_check_without_a_loader_names_the_file():
    cfg = parse_config(BASE)
    assert check_spark_settings(cfg) == {}


# ---- the worker's side, without Spark -------------------------------------------------------------
def test_the_probe_names_the_likely_cause():
    from strata.worker.spark import refusal_cause

    closed = ("java.lang.RuntimeException: java.io.IOException: Failed to send RPC RPC 1 to 127.0.0.1/127.0.0.1:7077: "
              "io.netty.channel.StacklessClosedChannelException | io.netty.channel.StacklessClosedChannelException: None")
    assert refusal_cause(closed, 5, "S") == ("refused this worker's authentication (is [groups.\"S\"] "
                                             "spark_secret_file this level's cluster's secret?)")
    refused = ("java.io.IOException: Failed to connect to /127.0.0.1:1 | java.net.ConnectException: finishConnect(..) "
               "failed with error(-111): Connection refused")
    assert refusal_cause(refused).startswith("cannot be reached: connection refused")
    assert refusal_cause("java.net.UnknownHostException: nowhere").endswith("does not resolve")
    assert "no connection within 5 s" in refusal_cause("io.netty.channel.ConnectTimeoutException: connection timed out")
    unauthenticated = "java.lang.RuntimeException: java.io.EOFException at o.a.s.rpc.netty.RequestMessage$.readRpcAddress"
    assert refusal_cause(unauthenticated).startswith("answered without Spark authentication")
    assert refusal_cause("org.apache.spark.rpc.RpcEndpointNotFoundException: Cannot find endpoint: "
                         "spark://Master@h:1").startswith("is not a Spark standalone master")


def test_the_driver_binds_to_the_levels_interface():
    from strata.worker.server import driver_host

    assert driver_host("10.0.3.11:50061", environ={}) == "10.0.3.11"
    assert driver_host("127.0.0.1:0", environ={"STRATA_GROUP_INTERFACE": "10.0.0.1"}) == "127.0.0.1"
    assert driver_host("0.0.0.0:50061", environ={"STRATA_GROUP_INTERFACE": "10.0.3.11"}) == "10.0.3.11"
    assert driver_host("[::]:50061", environ={}) is None
    assert driver_host("[fd00::7]:1", environ={}) == "fd00::7"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_cluster_workers_reading_is_its_executors_busy_task_slots():
    clock = Clock()
    now: list[ExecutorSample] = []
    load = ExecutorSlotsLoad(lambda: now, clock=clock)
    assert load() == 100.0  # no executor yet: nothing can run here
    now[:] = [ExecutorSample("0", 2, 1, 0.0), ExecutorSample("1", 2, 0, 0.0)]
    assert load() == 25.0  # first reading with executors: 1 of 4 slots busy now
    clock.t += 1.0
    now[:] = [ExecutorSample("0", 2, 0, 1000.0), ExecutorSample("1", 2, 0, 1000.0)]
    assert load() == 50.0  # 2 s of tasks finished in 1 s on 4 slots, none running now
    clock.t += 1.0
    now[:] = [ExecutorSample("0", 2, 2, 1000.0), ExecutorSample("1", 2, 2, 1000.0)]
    assert load() == 100.0  # every slot running a task
    clock.t += 2.0
    now[:] = [ExecutorSample("0", 2, 0, 2000.0), ExecutorSample("1", 2, 0, 1400.0), ExecutorSample("2", 4, 0, 800.0)]
    # 1 + 0.4 + 0.8 (an executor new since the last reading) = 2.2 s of tasks in 2 s on 8 slots
    assert load() == pytest.approx(100 * 2.2 / (2 * 8))
    clock.t += 0.5
    now[:] = [ExecutorSample("2", 4, 0, 800.0)]  # two executors gone, one idle
    assert load() == 0.0
    clock.t += 1.0
    now[:] = [ExecutorSample("2", 4, 1, 60800.0)]  # a long task ended: capped
    assert load() == 100.0


def test_make_load_reads_executors_for_a_cluster_only():
    source = list
    assert isinstance(make_load("host", "spark://h:7077", executors=source), ExecutorSlotsLoad)
    assert isinstance(make_load("process", "spark://h:7077", executors=source), ExecutorSlotsLoad)
    assert make_load("host", "local[1]", executors=source) is host_cpu_percent
    assert isinstance(make_load("process", "local[2]", executors=source), ProcessTreeLoad)
    assert make_load("host", "spark://h:7077") is host_cpu_percent  # no status source: as before
    with pytest.raises(ValueError):
        make_load("dedicated", "spark://h:7077", executors=source)


# ---- end to end: a standalone cluster with authentication and encryption ---------------------------
S_SECRET = "level-S-cluster-secret-7f3a"
TS_SECRET = "level-TS-cluster-secret-91c2"
#: a refused worker must say so within this many seconds (a JVM start and the probe; measured 3-8 s)
REFUSAL_SECONDS = 30.0


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _master_json(webui: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=5) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError):
        return None


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """A Spark standalone master and one worker (1 core, 1 GB) on 127.0.0.1, started with the pyspark
    package's spark-class, with spark.authenticate and network encryption on and level S's secret."""
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.skip("no Java: spark-class cannot start a Spark standalone cluster")
    from pyspark.find_spark_home import _find_spark_home

    spark_class = Path(_find_spark_home()) / "bin" / "spark-class"
    if not spark_class.exists():
        pytest.skip(f"no {spark_class}: this pyspark cannot start a standalone cluster")
    d = tmp_path_factory.mktemp("standalone")
    props = d / "spark-s.properties"
    props.write_text(f"spark.authenticate true\nspark.authenticate.secret {S_SECRET}\n"
                     "spark.network.crypto.enabled true\nspark.master.rest.enabled false\n")
    props.chmod(0o600)
    (d / "conf").mkdir()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_CONF_DIR": str(d / "conf"),
           "SPARK_LOG_DIR": str(d / "logs")}
    env.pop("SPARK_HOME", None)
    port, webui = free_tcp_port(), free_tcp_port()
    procs: list[subprocess.Popen] = []

    def start(name, args):
        log = open(d / f"{name}.log", "wb")
        p = subprocess.Popen([str(spark_class), *args], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        procs.append(p)
        return p

    def tail(name):
        return (d / f"{name}.log").read_text(errors="replace")[-2000:]

    t0 = time.monotonic()
    master = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                              "--webui-port", str(webui), "--properties-file", str(props)])
    try:
        deadline = time.monotonic() + 120
        while (_master_json(webui) or {}).get("status") != "ALIVE":
            if master.poll() is not None:
                pytest.skip(f"spark-class could not start a standalone master (exit {master.returncode}): "
                            f"{tail('master')}")
            if time.monotonic() > deadline:
                pytest.skip(f"the standalone master did not come up within 120 s: {tail('master')}")
            time.sleep(0.2)
        work = d / "work"
        work.mkdir()
        worker = start("worker", ["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                                  "--host", "127.0.0.1", "--port", str(free_tcp_port()), "--cores", "1",
                                  "--memory", "1g", "--webui-port", str(free_tcp_port()), "--work-dir", str(work),
                                  "--properties-file", str(props)])
        deadline = time.monotonic() + 120
        while (_master_json(webui) or {}).get("aliveworkers", 0) < 1:
            assert worker.poll() is None, f"the standalone worker exited: {tail('worker')}"
            assert time.monotonic() < deadline, f"the standalone worker did not register: {tail('worker')}"
            time.sleep(0.2)
        print(f"standalone cluster up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        yield {"url": f"spark://127.0.0.1:{port}", "port": port, "webui": webui, "work": work, "dir": d}
    finally:
        _stop(procs)


def cluster_config(dir: Path, url: str, users: dict | None = None) -> Path:
    """The battlefield config with level S on the standalone cluster (its secret) and TS with its own
    secret (TS's cluster would be elsewhere; here TS runs local[1])."""
    from .helpers import write_config

    secret_file(dir / "keys" / "S.spark", S_SECRET + "\n")
    secret_file(dir / "keys" / "TS.spark", TS_SECRET + "\n")
    text = BATTLEFIELD_TOML + f"""
[streams.T72]
sid = "string"
bp = "double"

[streams.T42]
sid = "string"
bp = "double"

[groups."S"]
spark_master = "{url}"
spark_secret_file = "keys/S.spark"
spark_conf = {{ "spark.executor.memory" = "1g", "spark.cores.max" = "1" }}

[groups."TS"]
spark_secret_file = "keys/TS.spark"
"""
    return write_config(dir, text, users or {"ann": "TS"})


def run_worker(config: Path, level: str, state: Path, *extra: str, timeout: float = 120.0):
    """``strata worker`` in the foreground (its group key made beforehand); (exit code, stderr, seconds)."""
    from strata.groups import level_slug, load_or_create_key

    load_or_create_key(state / "keys" / f"{level_slug(level)}.key", create=True)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "strata", "worker", "--config", str(config), "--level", level,
                        "--listen", "127.0.0.1:0", "--state-dir", str(state), "--insecure", *extra],
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stderr, time.monotonic() - t0


def assert_one_line(stderr: str, expected: str) -> None:
    """``strata: <expected>`` is the process's one line of its own, and no traceback came with it."""
    ours = [line for line in stderr.splitlines() if line.startswith("strata:")]
    assert ours == [f"strata: {expected}"], stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == f"strata: {expected}"
    for noise in ("Traceback", "Py4J", "py4j", "\tat org.apache", "Exception"):
        assert noise not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_a_worker_with_another_levels_secret_is_refused_in_one_line(standalone, tmp_path):
    """A TS worker whose configuration points TS at the S cluster (a different spelling of a URL, another
    deployment's configuration: nothing the load-time checks can see), with TS's own secret."""
    from .helpers import write_config

    secret_file(tmp_path / "keys" / "TS.spark", TS_SECRET + "\n")
    cfg = write_config(tmp_path, BATTLEFIELD_TOML + f'\n[groups."TS"]\nspark_master = "{standalone["url"]}"\n'
                                                    f'spark_secret_file = "keys/TS.spark"\n', {})
    code, err, seconds = run_worker(cfg, "TS", tmp_path / "state")
    print(f"another level's secret refused after {seconds:.1f} s", file=sys.stderr)
    assert code == 1
    assert_one_line(err, f"Spark master {standalone['url']} refused this worker's authentication (is [groups.\"TS\"] "
                         f"spark_secret_file this level's cluster's secret?)")
    assert seconds < REFUSAL_SECONDS


@pytest.mark.slow
def test_a_worker_that_cannot_reach_its_master_says_so_in_one_line(tmp_path):
    from .helpers import write_config

    secret_file(tmp_path / "keys" / "TS.spark", TS_SECRET)
    url = f"spark://127.0.0.1:{free_tcp_port()}"  # nothing listens there
    cfg = write_config(tmp_path, BATTLEFIELD_TOML + f'\n[groups."TS"]\nspark_master = "{url}"\n'
                                                    f'spark_secret_file = "keys/TS.spark"\n', {})
    code, err, seconds = run_worker(cfg, "TS", tmp_path / "state")
    print(f"unreachable master reported after {seconds:.1f} s", file=sys.stderr)
    assert code == 1
    assert_one_line(err, f"Spark master {url} cannot be reached: connection refused (is the level's Spark master "
                         f"running there, on that port?)")
    assert seconds < REFUSAL_SECONDS


@pytest.mark.slow
def test_a_worker_without_a_secret_or_on_another_levels_cluster_stops_before_its_jvm(standalone, tmp_path):
    """Neither starts a JVM: a cluster without a secret is never contacted, and the configuration names
    the S cluster as S's."""
    cfg = cluster_config(tmp_path, standalone["url"])
    # C has no spark_secret_file, and the flag names S's cluster: the sharing check speaks first
    code, err, seconds = run_worker(cfg, "C", tmp_path / "state", "--spark-master", standalone["url"], timeout=60)
    assert code == 1
    assert_one_line(err, f"--spark-master {standalone['url']} is level S's Spark master ([groups.\"S\"] spark_master); "
                         f"a level's Spark cluster is never shared with another level")
    other = f"spark://127.0.0.1:{free_tcp_port()}"
    code, err, seconds = run_worker(cfg, "C", tmp_path / "state", "--spark-master", other, timeout=60)
    print(f"no secret refused after {seconds:.1f} s", file=sys.stderr)
    assert code == 1
    assert_one_line(err, f"Spark master {other}: level C has no secret for its Spark cluster: set [groups.\"C\"] "
                         f"spark_secret_file to a file with the text of the cluster's spark.authenticate.secret "
                         f"(Strata reaches a Spark cluster only with Spark's authentication)")
    assert seconds < 10


def _finished_tasks(work: Path, app: str) -> int:
    return sum(f.read_text(errors="replace").count("Finished task") for f in (work / app).glob("*/stderr"))


@pytest.mark.slow
def test_up_and_replay_on_the_levels_standalone_cluster(standalone, tmp_path):
    """``strata up`` (no Spark flag) puts level S's worker on the S cluster: its application holds the
    standalone worker's core, its executor runs the replay's tasks, the output equals the reference, and
    the secret appears on no command line, in no environment and in no log."""
    import psutil

    from strata.deploy.local import stop_cluster

    from .reference.evaluator import compare_results, evaluate
    from .helpers import read_out, strata, write_csv
    from .test_cluster_e2e import REPLAY_QUERIES, TABLE_4_2, TABLE_7_2, _random_streams

    cfg_path = cluster_config(tmp_path, standalone["url"])
    cfg = load_config(cfg_path)
    state = tmp_path / "state"
    t0 = time.monotonic()
    try:
        r = strata("up", "--config", str(cfg_path), "--levels", "S", "--workers", "1", "--state-dir", str(state),
                   timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        t_up = time.monotonic() - t0
        record = json.loads((state / "cluster.json").read_text())
        worker = next(p for p in record["processes"] if p["role"] == "worker")
        assert "--spark-master" not in worker["cmd"]  # the worker took its level's setting itself
        log = (state / "logs" / "worker-S-0.log").read_text()
        assert f"on {standalone['url']} (1 executor, 1 core)" in log, log[-3000:]
        assert "load reading failed" not in log  # Algorithm 5's reading of the executors works
        apps = [a for a in _master_json(standalone["webui"])["activeapps"] if a["name"] == "strata-worker-S"]
        assert len(apps) == 1 and apps[0]["cores"] == 1, apps
        app = apps[0]["id"]
        before = _finished_tasks(standalone["work"], app)  # the warm-up's tasks
        assert before > 0

        # the secret: in the driver JVM's configuration only, not on its command line or in its environment
        jvms = [c for c in psutil.Process(worker["pid"]).children(recursive=True) if "java" in c.name()]
        assert jvms
        for proc in jvms + [psutil.Process(worker["pid"])]:
            assert S_SECRET not in " ".join(proc.cmdline())
            assert not any(S_SECRET in v for v in proc.environ().values())

        vit, pos = _random_streams(seed=31)
        files = {"T72": (["ts", "level", "sid", "bp"], TABLE_7_2), "T42": (["ts", "level", "sid", "bp"], TABLE_4_2),
                 "Vitals": (["ts", "level", "sid", "bp", "pr", "weight"], vit),
                 "Positions": (["ts", "level", "sid", "lat", "lon"], pos)}
        queries = [("SELECT AVG(bp) FROM T72[ROWS 3]", ["double"]),
                   ("SELECT AVG(bp) FROM T42[ROWS 3] WHERE level = U", ["double"])] + REPLAY_QUERIES
        args = ["replay", "--config", str(cfg_path), "--user", "ann", "--level", "S", "--cluster", str(state),
                "--output", str(tmp_path / "out")]
        streams = {}
        for name, (header, rows) in files.items():
            path = tmp_path / f"{name}.csv"
            write_csv(path, header, rows)
            args += ["--input", f"{name}={path}"]
            streams[name] = [dict(zip(header, row)) for row in rows]
        for q, _ in queries:
            args += ["--query", q]
        t1 = time.monotonic()
        r = strata(*args, timeout=400)
        t_replay = time.monotonic() - t1
        assert r.returncode == 0, r.stderr[-3000:]
        for i, (q, types) in enumerate(queries, 1):
            compare_results(read_out(tmp_path / "out" / f"q{i}.csv", types), evaluate(q, cfg, "S", streams))
        assert read_out(tmp_path / "out" / "q1.csv", ["double"]) == [(1, "U", 125.0), (2, "U", 120.0), (3, "U", 140.0)]
        after = _finished_tasks(standalone["work"], app)
        assert after > before, (before, after)  # the replay's jobs ran on the standalone executor
        print(f"strata up on the standalone cluster {t_up:.1f} s; replay --cluster {t_replay:.1f} s; executor tasks "
              f"{before} (warm-up) + {after - before} (replay)", file=sys.stderr)
    finally:
        stop_cluster(state)
    for f in [*standalone["work"].rglob("*"), *(standalone["dir"]).glob("*.log"), *(state / "logs").glob("*")]:
        if f.is_file():
            assert S_SECRET not in f.read_text(errors="replace"), f
    # the application ended with its worker
    assert not [a for a in _master_json(standalone["webui"])["activeapps"] if a["name"] == "strata-worker-S"]
