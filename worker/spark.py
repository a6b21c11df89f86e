"""The worker's SparkSession: one long-lived session per process, tuned for small jobs.

A worker evaluates many small chunks (a few thousand to a few hundred thousand
rows each), so the session is configured for latency rather than throughput:
no UI, few shuffle partitions, Arrow transfer in both directions, non-ANSI
arithmetic (``x / 0`` is NULL, as SEMANTICS §8 requires; 64-bit overflow is not
left to Spark at all: the engine checks every integer ``+ - *`` and SUM itself and
reports it as the query's failure, see ``engine.py``) and a driver bound to
the loopback interface on ephemeral ports.  The master URL is configurable so
that a worker can submit to a real Spark cluster instead of ``local[N]``.
"""

from __future__ import annotations

import os
import threading

__all__ = ["get_session", "DEFAULT_CONF", "LOCAL_CONF"]

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
    # only effective when this call starts the JVM; chunks of several 100k rows need >1g
    "spark.driver.memory": "2g",
    "spark.port.maxRetries": "64",
}

#: loggers whose warnings are expected in normal operation
_QUIET_LOGGERS = ("org.apache.spark.sql.execution.window.WindowExec",)

#: added for ``local[...]`` masters only: executors of a real cluster must reach the driver
LOCAL_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}

_lock = threading.Lock()


def get_session(master: str = "local[2]", app_name: str = "strata-worker", conf: dict | None = None):
    """The process's SparkSession (created on first call, then reused).

    ``master`` may be ``local[N]`` (driver bound to 127.0.0.1, ephemeral
    ports) or a cluster URL (``spark://host:7077``; set ``spark.driver.host``
    in ``conf`` to an address the executors can reach); ``conf`` adds or
    overrides Spark settings.  A second call returns the same
    session; its runtime-settable SQL options in ``conf`` are applied to it.
    """
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")
    from pyspark.sql import SparkSession

    settings = dict(DEFAULT_CONF)
    if master.startswith("local"):
        settings.update(LOCAL_CONF)
        # one shuffle partition per local core: a chunk-sized job split further only adds tasks
        cores = master[len("local["):-1] if master.startswith("local[") else "1"
        if cores.isdigit():
            settings["spark.sql.shuffle.partitions"] = cores
            settings["spark.default.parallelism"] = cores
        # Spark's own host lookup (block manager, shuffle) would otherwise pick the
        # first non-loopback interface; a local session stays on loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if conf:
        settings.update({k: str(v) for k, v in conf.items()})
    with _lock:
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
    return session


def _quiet(session) -> None:
    """Silence per-chunk warnings (e.g. ROWS windows without PARTITION BY use one partition)."""
    try:
        jvm = session.sparkContext._jvm
        level = jvm.org.apache.logging.log4j.Level.ERROR
        for name in _QUIET_LOGGERS:
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, level)
    except Exception:  # a different logging backend: keep its warnings
        pass
