"""The worker's SparkSession: one long-lived session per process, tuned for small jobs.

A worker evaluates many small chunks (a few thousand to a few hundred thousand
rows each), so the session is configured for latency rather than throughput:
no UI, few shuffle partitions, Arrow transfer in both directions, non-ANSI
arithmetic (``x / 0`` is NULL, as SEMANTICS §8 requires; 64-bit overflow is not
left to Spark at all: the engine checks every integer ``+ - *`` and SUM itself and
reports it as the query's failure, see ``engine.py``) and a driver bound to
the loopback interface on ephemeral ports.  The master URL is configurable so
that a worker can submit to a real Spark cluster instead of ``local[N]``.

A cluster master (``spark://host:port``, a level's own cluster: strata/spark_settings.py) is
reached only with Spark's authentication and encryption on (:data:`CLUSTER_SECURITY`; the
level's secret goes into the driver's configuration through Py4J, never onto the JVM's command
line or into its environment), with the driver bound to the level's interface.  Before the
SparkContext exists, :func:`probe_master` asks the master over Spark's own authenticated RPC
from the already-launched JVM, so a master that refuses the secret (or cannot be reached) ends
the worker within seconds with one line (:class:`SparkClusterError`) instead of Spark's
registration retries (~60 s) and a Py4J traceback; after it, :func:`wait_for_executors` waits
until the cluster gave the application an executor.

The driver JVM (started by the first :func:`get_session` of a process) runs with
:data:`JAVA_OPTIONS`, chosen for short jobs on few cores and measured in
``docs/benchmarks/engine_micro.md`` and ``bench/NOTES.md``: C1 only
(``-XX:TieredStopAtLevel=1``: the C2 compiler's background compilations cost more
CPU than a worker's short jobs win back), the serial collector (one core) with a
1 GB heap from the start (``-Xms1g``: no full collection while a unit of a million
rows makes it grow; the young generation stays at its former ~128 MB, so that short
jobs touch no more fresh memory than before), and Arrow's readers without their per-value bounds
and null-check indirections (``arrow.enable_unsafe_memory_access``,
``arrow.enable_null_check_for_get``; the JVM reads only the Arrow batches PySpark
writes from tables the worker built itself).  It also maps an AppCDS
archive of the classes a worker loads (:func:`cds_options`), which halves the
CPU of starting a session.  Java 17 cannot create one on the fly, so a worker that
finds none starts :func:`build_archive` in a detached background process at the
lowest CPU priority: it starts a session with ``-XX:ArchiveClassesAtExit``, runs
the warm-up chunks, exits (the JVM writes the archive) and moves the archive into
the cache; the next start maps it.  ``python -m strata.worker.spark --build-archive``
does the same in the foreground (a set-up step).  ``STRATA_JAVA_OPTS`` replaces the
options, ``STRATA_CDS=0`` turns the archive off, ``STRATA_CACHE_DIR`` moves the cache
(default ``$XDG_CACHE_HOME/strata`` or ``~/.cache/strata``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from strata.errors import CliError
from strata.serving import pid_alive

__all__ = ["get_session", "DEFAULT_CONF", "LOCAL_CONF", "CLUSTER_CONF", "CLUSTER_SECURITY", "JAVA_OPTIONS",
           "java_options", "cds_options", "cache_dir", "build_archive", "SparkClusterError", "probe_master",
           "wait_for_executors", "refusal_cause", "PROBE_SECONDS", "EXECUTOR_WAIT_SECONDS"]

log = logging.getLogger("strata.worker.spark")

#: settings applied to every session (``conf`` passed to get_session overrides them)
DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.execution.arrow.pyspark.fallback.enabled": "false",
    # ANSI mode would raise on x / 0 (NULL here) and on overflow inside whatever operator
    # Spark happens to evaluate first; the engine's overflow checks are explicit and total
    "spark.sql.ansi.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    # Adaptive execution re-plans after every shuffle stage; for chunk-sized jobs
    # that costs more than it saves (measured in bench/engine_micro.py).
    "spark.sql.adaptive.enabled": "false",
    # Arrow tables below this size become a LocalRelation, which the optimizer and the
    # task serializer copy around row by row; an RDD of Arrow batches was as fast for
    # small chunks and several times faster (and far leaner) for 100k+ rows.
    "spark.sql.execution.arrow.localRelationThreshold": "0",
    # createDataFrame(Arrow table) makes one partition (one task) per record batch of at most
    # this many rows; Spark's default (10,000) turned a 680k-row chunk into 68 tasks whose
    # scheduling cost 3-4x the work.  The engine cuts its tables into one batch per core itself.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "10000000",
    # per-statement planning work a chunk does not need (each measured at -4..-8 % of a warm
    # chunk's CPU, docs/benchmarks/engine_micro.md): inferring filters from constraints (the engine's
    # plans have no redundant joins to prune) and the formatted plan text every execution
    # records for the (disabled) UI
    "spark.sql.constraintPropagation.enabled": "false",
    "spark.sql.ui.explainMode": "simple",
    # only effective when this call starts the JVM; chunks of several 100k rows need >1g
    "spark.driver.memory": "2g",
    "spark.port.maxRetries": "64",
}

#: JVM options of the driver (module docstring; bench/NOTES.md, "JVM options for large units"):
#: C1 only, serial collector, the heap at 1 GB from the start, Arrow reads unchecked.
#: A warm 1.18 M-row RANGE unit: 1.13-1.22 s against 1.55-1.65 s with the first two alone.
JAVA_OPTIONS: tuple[str, ...] = (
    "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xms1g", "-Xmn128m",
    "-Darrow.enable_unsafe_memory_access=true", "-Darrow.enable_null_check_for_get=false",
)

#: loggers whose warnings are expected in normal operation
_QUIET_LOGGERS = ("org.apache.spark.sql.execution.window.WindowExec",)

#: added for ``local[...]`` masters only: executors of a real cluster must reach the driver
LOCAL_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}

#: added for a cluster master before the level's ``spark_conf`` (which may change them): no
#: fall-back from Spark's AES-based authentication protocol to SASL DIGEST-MD5
CLUSTER_CONF: dict[str, str] = {
    "spark.network.crypto.saslFallback": "false",
}

#: set for a cluster master after the level's ``spark_conf`` (Strata's, strata/spark_settings.py
#: refuses them there): Spark's own authentication (the secret: ``spark.authenticate.secret``,
#: set through Py4J) and encryption of its RPC, block transfers and local spill/shuffle files
CLUSTER_SECURITY: dict[str, str] = {
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
    "spark.io.encryption.enabled": "true",
}

#: seconds the probe of a cluster master waits for its answer (connection, authentication, lookup)
PROBE_SECONDS = 5.0
#: seconds a worker waits for its first executor of a cluster (``STRATA_SPARK_EXECUTOR_WAIT``)
EXECUTOR_WAIT_SECONDS = 60.0


class SparkClusterError(CliError):
    """The level's Spark cluster cannot be used (refused, unreachable, no executor): one line naming
    the master and the likely cause; ``strata worker`` exits 1 with it."""


_lock = threading.Lock()
#: set by :func:`build_archive`: the file this process's JVM writes the archive to at exit
_dump_to: Path | None = None


def java_options() -> list[str]:
    """The driver's JVM options: ``STRATA_JAVA_OPTS`` if set (split on spaces), else :data:`JAVA_OPTIONS`."""
    env = os.environ.get("STRATA_JAVA_OPTS")
    return env.split() if env is not None else list(JAVA_OPTIONS)


def cache_dir() -> Path:
    """Where the worker keeps what survives it (the CDS archive)."""
    env = os.environ.get("STRATA_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "strata"


def _spark_home() -> Path | None:
    try:
        from pyspark.find_spark_home import _find_spark_home

        return Path(_find_spark_home())
    except Exception:  # noqa: BLE001 - no archive then
        return None


def _java_binary() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return (Path(home) / "bin" / "java").resolve()
    import shutil

    found = shutil.which("java")
    return Path(found).resolve() if found else None


def _cds_key(options: list[str]) -> str | None:
    """Identifies what an archive is valid for: the JVM, Spark's jars and the JVM options."""
    java, home = _java_binary(), _spark_home()
    if java is None or home is None or not (home / "jars").is_dir():
        return None
    h = hashlib.sha256()
    st = java.stat()
    h.update(f"{java}:{st.st_size}:{int(st.st_mtime)}\0".encode())
    for jar in sorted((home / "jars").iterdir()):
        st = jar.stat()
        h.update(f"{jar.name}:{st.st_size}:{int(st.st_mtime)}\0".encode())
    h.update(" ".join(options).encode())
    return h.hexdigest()[:20]


def _archive_paths(options: list[str]) -> tuple[Path, Path, Path] | None:
    """(archive, lock, directory) for these JVM options, or None when no archive applies."""
    if os.environ.get("STRATA_CDS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    key = _cds_key(options)
    if key is None:
        return None
    d = cache_dir() / "cds"
    return d / f"spark-{key}.jsa", d / f"spark-{key}.lock", d


def _take_lock(lock: Path) -> bool:
    """Create ``lock`` holding this pid (taking over one left by a dead process)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and pid_alive(holder):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def cds_options(options: list[str], build: bool = False) -> list[str]:
    """JVM options that map the AppCDS archive for ``options`` (``-Xshare:auto``: a stale or
    damaged archive is ignored by the JVM, never fatal), or none when there is no archive yet.

    ``build``: when there is none, start :func:`build_archive` in a detached background
    process at the lowest CPU priority (unless one is already running); it loads what a
    worker loads (a session and the warm-up chunks), writes the archive as its JVM exits and
    moves it into place, so the next start maps it.  Workers pass ``build=True``.
    """
    paths = _archive_paths(options)
    if paths is None:
        return []
    final, lock, _ = paths
    if final.is_file() and final.stat().st_size > 0:
        return [f"-XX:SharedArchiveFile={final}", "-Xshare:auto", *_QUIET_CDS]
    if build:
        try:
            if _take_lock(lock):
                lock.unlink()  # the builder takes it itself
                import subprocess
                import sys

                subprocess.Popen([sys.executable, "-m", "strata.worker.spark", "--build-archive"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=lambda: os.nice(19), env=dict(os.environ))
        except OSError as e:  # read-only or full cache: run without
            log.info("no CDS archive: %s", e)
    return []


#: no CDS warnings on the worker's stdout (a stale archive is simply not used)
_QUIET_CDS = ("-Xlog:cds*=off",)


def build_archive(timeout: float = 600.0) -> Path | None:
    """Write the AppCDS archive for :func:`java_options` (this process's JVM dumps it at exit):
    a session, the warm-up chunks, then the JVM's exit.  Returns the archive, or None if
    another process is writing it or it could not be written."""
    global _dump_to
    opts = java_options()
    paths = _archive_paths(opts)
    if paths is None:
        return None
    final, lock, d = paths
    if not _take_lock(lock):
        return None
    tmp = d / f"{final.name}.{os.getpid()}"
    try:
        for old in d.glob(f"{final.name}.*"):
            old.unlink(missing_ok=True)
        _dump_to = tmp
        session = get_session(master="local[1]", app_name="strata-cds")
        try:
            from strata.examples import BATTLEFIELD_TOML
            from strata.config import parse_config

            from .engine import Engine
            from .warmup import warm_up

            cfg = parse_config(BATTLEFIELD_TOML)
            warm_up(Engine(session, cfg), cfg, cfg.lattice.levels[-1], budget=float("inf"), rounds=1)
        except Exception as e:  # noqa: BLE001 - the session's classes alone are worth archiving
            log.info("warm-up for the archive failed: %s", e)
        from pyspark import SparkContext

        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is None:
            return None
        proc.stdin.close()  # the gateway exits on EOF: System.exit writes the archive
        proc.wait(timeout=timeout)
        if proc.returncode == 0 and tmp.is_file() and tmp.stat().st_size > 0:
            os.replace(tmp, final)
            prune_archives(d, keep=final)
            return final
        return None
    finally:
        tmp.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


#: archives (~160 MB each, one per JVM options and classpath, i.e. per checkout and venv) kept in
#: the cache besides the one just written: the most recently used ones ...
KEEP_ARCHIVES = 3
#: ... and any used within this many days
KEEP_ARCHIVE_DAYS = 7.0


def prune_archives(d: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the CDS archives of ``d`` that neither are ``keep``, nor among the
    :data:`KEEP_ARCHIVES` most recently used (access or modification time), nor used within
    :data:`KEEP_ARCHIVE_DAYS`.  A JVM that maps a removed archive keeps its mapping; the next
    start of that checkout builds it again.  Returns what was removed."""
    now = time.time() if now is None else now
    olds = []
    for p in d.glob("spark-*.jsa"):
        if p == keep:
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        olds.append((max(st.st_atime, st.st_mtime), p))
    olds.sort(reverse=True)
    gone = []
    for used, p in olds[KEEP_ARCHIVES:]:
        if now - used > KEEP_ARCHIVE_DAYS * 86400:
            try:
                p.unlink()
                gone.append(p)
            except OSError:
                continue
    return gone


def get_session(master: str = "local[2]", app_name: str = "strata-worker", conf: dict | None = None,
                build_cds: bool = False, secret: str | None = None, driver_host: str | None = None,
                level: str | None = None, probe_seconds: float = PROBE_SECONDS,
                executor_wait: float | None = None):
    """The process's SparkSession (created on first call, then reused).

    ``master`` may be ``local[N]`` (driver bound to 127.0.0.1, ephemeral
    ports) or a cluster URL (``spark://host:7077``: the level's own cluster).  ``conf`` adds or
    overrides Spark settings (the level's ``spark_conf``; ``spark.driver.extraJavaOptions`` there
    replaces :func:`java_options` and the archive).  ``build_cds``: start building the
    CDS archive in the background if there is none (:func:`cds_options`).  A second
    call returns the same session; its runtime-settable SQL options in ``conf`` are
    applied to it.

    For a cluster: ``secret`` (required) is the text of the cluster's ``spark.authenticate.secret``;
    Spark's authentication and encryption are on (:data:`CLUSTER_SECURITY`, over ``conf``); the driver
    binds to ``driver_host`` (``spark.driver.host`` and ``spark.driver.bindAddress``, unless ``conf``
    sets them), on the ports ``conf`` gives (``spark.driver.port``, ``spark.driver.blockManager.port``
    or ``spark.blockManager.port``) or ephemeral ones.  Before the SparkContext starts,
    :func:`probe_master` checks that the master accepts the secret (``probe_seconds``), and after it
    the call waits up to ``executor_wait`` seconds (default ``STRATA_SPARK_EXECUTOR_WAIT`` or
    :data:`EXECUTOR_WAIT_SECONDS`) for an executor; either failing raises :class:`SparkClusterError`
    (one line; ``level`` names the configuration key to check) and stops the JVM.
    """
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    local = master.startswith("local")
    settings = dict(DEFAULT_CONF)
    if local:
        settings.update(LOCAL_CONF)
        # one shuffle partition per local core: a chunk-sized job split further only adds tasks
        cores = master[len("local["):-1] if master.startswith("local[") else "1"
        if cores.isdigit():
            settings["spark.sql.shuffle.partitions"] = cores
            settings["spark.default.parallelism"] = cores
        # Spark's own host lookup (block manager, shuffle) would otherwise pick the
        # first non-loopback interface; a local session stays on loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    else:
        settings.update(CLUSTER_CONF)
        if driver_host:
            settings["spark.driver.host"] = driver_host
            settings["spark.driver.bindAddress"] = driver_host
    if conf:
        settings.update({k: str(v) for k, v in conf.items()})
    if not local:
        settings.update(CLUSTER_SECURITY)
        if settings.get("spark.driver.bindAddress"):  # the block manager's and shuffle's host lookups too
            os.environ.setdefault("SPARK_LOCAL_IP", settings["spark.driver.bindAddress"])
    with _lock:
        new = SparkContext._active_spark_context is None
        if new and "spark.driver.extraJavaOptions" not in (conf or {}):
            opts = java_options()
            if _dump_to is not None:
                extra = [f"-XX:ArchiveClassesAtExit={_dump_to}", *_QUIET_CDS]
            else:
                extra = cds_options(opts, build=build_cds)
            settings["spark.driver.extraJavaOptions"] = " ".join(opts + extra)
        if new and not local:
            if not secret:
                where = f' (set [groups."{level}"] spark_secret_file)' if level else ""
                raise SparkClusterError(f"Spark master {master}: no secret for the level's cluster{where}; Strata "
                                        f"reaches a Spark cluster only with Spark's authentication on")
            _start_cluster_context(master, app_name, settings, secret, level, probe_seconds)
        active = SparkSession.getActiveSession()
        builder = SparkSession.builder.master(master).appName(app_name)
        for k, v in settings.items():
            builder = builder.config(k, v)
        session = builder.getOrCreate()
        if active is not None and conf:
            for k, v in conf.items():
                if k.startswith("spark.sql."):
                    try:
                        session.conf.set(k, str(v))
                    except Exception:  # static SQL conf of a running session
                        pass
        session.sparkContext.setLogLevel("WARN")
        _quiet(session)
        if new and not local:
            wait = executor_wait if executor_wait is not None else float(
                os.environ.get("STRATA_SPARK_EXECUTOR_WAIT", EXECUTOR_WAIT_SECONDS))
            try:
                wait_for_executors(session.sparkContext, master, wait, settings.get("spark.driver.host"))
            except BaseException:
                _stop_jvm()
                raise
    return session


def _hint(level: str | None) -> str:
    return (f'is [groups."{level}"] spark_secret_file this level\'s cluster\'s secret?' if level
            else "is the secret this cluster's spark.authenticate.secret?")


def _start_cluster_context(master: str, app_name: str, settings: dict, secret: str, level: str | None,
                           probe_seconds: float) -> None:
    """Launch the JVM with ``settings`` on its command line (not the secret), probe ``master`` with the
    secret, then create the SparkContext with the secret set in its configuration through Py4J."""
    from pyspark import SparkConf, SparkContext

    if SparkContext._gateway is None:
        launch = SparkConf(loadDefaults=False)
        for k, v in settings.items():
            launch.set(k, v)
        SparkContext._ensure_initialized(conf=launch)
    try:
        probe_master(SparkContext._jvm, master, secret, settings, timeout=probe_seconds, level=level)
        sconf = SparkConf()  # backed by the JVM now: what is set here stays in the JVM
        for k, v in settings.items():
            sconf.set(k, v)
        sconf.setMaster(master).setAppName(app_name)
        sconf.set("spark.authenticate.secret", secret)
        SparkContext(conf=sconf)
    except BaseException:
        _stop_jvm()
        raise


def _stop_jvm() -> None:
    """Stop this process's SparkContext and its JVM (a worker that cannot use its cluster exits)."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is not None:
        try:
            sc.stop()
        except Exception:  # noqa: BLE001 - the JVM goes below anyway
            pass
    gw = SparkContext._gateway
    proc = getattr(gw, "proc", None)
    try:
        if gw is not None:
            gw.shutdown()
    except Exception:  # noqa: BLE001
        pass
    if proc is not None:
        try:
            proc.stdin.close()  # the gateway exits on EOF
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            proc.kill()
    SparkContext._gateway = None
    SparkContext._jvm = None


def _cluster_address(master: str) -> tuple[str, int]:
    hostport = master[len("spark://"):]
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


#: loggers a failed probe would fill with stack traces (the probe reports in one line itself)
_PROBE_LOGGERS = ("org.apache.spark.network", "org.apache.spark.rpc")


def probe_master(jvm, master: str, secret: str, settings: dict | None = None, timeout: float = PROBE_SECONDS,
                 level: str | None = None) -> None:
    """Ask the Spark standalone master ``master`` over Spark's own RPC, authenticated with ``secret``
    and encrypted as the session will be, whether it is there and accepts this worker; raises
    :class:`SparkClusterError` with one line naming the master and the likely cause.

    In the JVM (``jvm``: Py4J's view of it, before any SparkContext): a client-mode ``RpcEnv`` with a
    ``SecurityManager`` holding the secret opens a connection (the authentication handshake) and
    looks up the ``Master`` endpoint; everything waits at most ``timeout`` seconds."""
    from py4j.protocol import Py4JError, Py4JJavaError

    host, port = _cluster_address(master)
    conf = jvm.org.apache.spark.SparkConf(False)
    for k, v in (settings or {}).items():
        if k.startswith(("spark.authenticate", "spark.network.", "spark.rpc.")):
            conf.set(k, str(v))
    for k, v in CLUSTER_SECURITY.items():
        conf.set(k, v)
    conf.set("spark.authenticate.secret", secret)
    limit = f"{max(1, int(round(timeout * 1000)))}ms"
    for k in ("spark.rpc.askTimeout", "spark.rpc.lookupTimeout", "spark.rpc.io.connectionTimeout",
              "spark.rpc.io.connectionCreationTimeout", "spark.network.timeout"):
        conf.set(k, limit)
    bind = (settings or {}).get("spark.driver.bindAddress") or "127.0.0.1"
    levels = _silence(jvm, _PROBE_LOGGERS)
    try:
        config_pkg = jvm.java.lang.Class.forName("org.apache.spark.internal.config.package$")
        secret_file_entry = config_pkg.getField("MODULE$").get(None).AUTH_SECRET_FILE()
        security = jvm.org.apache.spark.SecurityManager(conf, jvm.scala.Option.empty(), secret_file_entry)
        env = jvm.org.apache.spark.rpc.RpcEnv.create("strata-probe", bind, 0, conf, security, True)
        try:
            address = jvm.org.apache.spark.rpc.RpcAddress(host, port)
            try:  # the connection alone, so that its own failure (not a dropped message) is what we see
                env.createClient(address).close()
            except Py4JJavaError:
                raise
            except Py4JError:  # no such method in this Spark: the lookup below connects as well
                pass
            env.setupEndpointRef(address, "Master")
        finally:
            env.shutdown()
    except Py4JJavaError as e:
        raise SparkClusterError(f"Spark master {master} {refusal_cause(_java_chain(e), timeout, level)}") from None
    except Py4JError as e:  # Spark's internals moved (another Spark version): its own registration decides
        log.warning("cannot probe the Spark master %s before registering (%s); a refusal shows as Spark's own "
                    "registration failure", master, str(e).splitlines()[0] if str(e) else e.__class__.__name__)
    finally:
        _restore(jvm, levels)


def refusal_cause(chain: str, timeout: float = PROBE_SECONDS, level: str | None = None) -> str:
    """What a failed probe's Java exception chain (its classes and messages, one text) says went wrong,
    as the end of a sentence starting with the master's name."""
    c = chain
    if "UnknownHostException" in c:
        return "cannot be reached: its host name does not resolve"
    if "Connection refused" in c:
        return "cannot be reached: connection refused (is the level's Spark master running there, on that port?)"
    if "No route to host" in c or "Network is unreachable" in c or "NoRouteToHost" in c:
        return "cannot be reached: no route to its host"
    if "ConnectTimeoutException" in c or "connection timed out" in c.lower():
        return f"cannot be reached: no connection within {timeout:g} s (a firewall dropping the port?)"
    if "RequestMessage" in c or "readRpcAddress" in c:
        return ("answered without Spark authentication: a level's cluster must run with spark.authenticate=true "
                "and the level's secret (Strata sends no level data to an unauthenticated cluster)")
    if "RpcEndpointNotFoundException" in c or "Cannot find endpoint" in c:
        return "is not a Spark standalone master (no Master endpoint there)"
    if "TimeoutException" in c or "timed out" in c.lower():
        return f"did not complete the authentication within {timeout:g} s ({_hint(level)})"
    return f"refused this worker's authentication ({_hint(level)})"


def _java_chain(e) -> str:
    """The classes and messages of a Py4JJavaError's Java exception and its causes, one text."""
    parts = []
    try:
        j = e.java_exception
        for _ in range(12):
            if j is None:
                break
            parts.append(f"{j.getClass().getName()}: {j.getMessage()}")
            j = j.getCause()
    except Exception:  # noqa: BLE001 - the JVM went away: its text is all there is
        parts.append(str(e))
    return " | ".join(parts)


def _silence(jvm, names) -> dict:
    """Set the log4j loggers ``names`` to OFF; returns their former levels."""
    out = {}
    try:
        log4j = jvm.org.apache.logging.log4j
        for name in names:
            out[name] = log4j.LogManager.getLogger(name).getLevel()
            log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    except Exception:  # noqa: BLE001 - another logging backend: its messages stay
        pass
    return out


def _restore(jvm, levels: dict) -> None:
    try:
        for name, level in levels.items():
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, level)
    except Exception:  # noqa: BLE001
        pass


def wait_for_executors(sc, master: str, timeout: float, driver_host: str | None = None) -> int:
    """Wait until the cluster gave this application an executor; returns how many it has.  Raises
    :class:`SparkClusterError` after ``timeout`` seconds, or at once if the application ended."""
    jsc = sc._jsc.sc()
    deadline = time.monotonic() + timeout
    while True:
        n = len(jsc.statusTracker().getExecutorInfos()) - 1  # the driver is listed too
        if n > 0:
            return n
        if jsc.isStopped():
            raise SparkClusterError(f"Spark master {master} ended this worker's application (see the worker's log)")
        if time.monotonic() >= deadline:
            port = sc.getConf().get("spark.driver.port", "?")
            raise SparkClusterError(
                f"Spark master {master} accepted this worker but gave it no executor within {timeout:g} s (does the "
                f"level's cluster have a live worker with free cores and memory for spark.executor.cores/memory, "
                f"spark.cores.max set for several Strata workers, and can its executors reach this driver at "
                f"{driver_host or '?'}:{port}?)")
        time.sleep(0.1)


def _quiet(session) -> None:
    """Silence per-chunk warnings (e.g. ROWS windows without PARTITION BY use one partition)."""
    try:
        jvm = session.sparkContext._jvm
        level = jvm.org.apache.logging.log4j.Level.ERROR
        for name in _QUIET_LOGGERS:
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, level)
    except Exception:  # a different logging backend: keep its warnings
        pass


def main(argv=None) -> int:
    """``python -m strata.worker.spark --build-archive``: write the CDS archive now (a set-up step;
    workers otherwise start it in the background when they find none)."""
    import argparse

    ap = argparse.ArgumentParser(description="the worker's Spark session")
    ap.add_argument("--build-archive", action="store_true", help="write the AppCDS archive for the JVM options")
    ap.add_argument("--if-missing", action="store_true", help="only when there is none yet (what ./dev run does)")
    args = ap.parse_args(argv)
    if args.build_archive:
        paths = _archive_paths(java_options())
        if args.if_missing and (paths is None or (paths[0].is_file() and paths[0].stat().st_size > 0)):
            print(paths[0] if paths else "CDS is off")
            return 0
        logging.basicConfig(level=logging.INFO)
        out = build_archive()
        print(out if out is not None else "no archive written (another process is writing it, or CDS is off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
