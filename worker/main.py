"""``strata worker``: run a worker of one level (registered with the one CLI, strata/cli.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from strata.cli_support import config_of, level_of
from strata.cpusets import pin_current_process
from strata.errors import EXIT_OK
from strata.private import private_dir
from strata.serving import add_process_options, exit_now, group_spec_of, ready_writer, server_tls, start_logging
from strata.spark_settings import spark_settings
from strata.trusted import trusted_levels

from . import metrics as worker_metrics

__all__ = ["cmd_worker", "add_parsers"]


def cmd_worker(args) -> int:
    from strata.worker.server import serve_worker

    start_logging(args.log_file)
    cfg = config_of(args)
    level = level_of(cfg, args.level)
    levels = trusted_levels(cfg, level, args.trusted_levels)  # a trusted worker's (docs/trusted.md); () else

    # the level's Spark: --spark-master, else [groups."L"] spark_master, else $STRATA_SPARK_MASTER, else
    # local[1]; a cluster's secret is read now (a missing or exposed file: one line before anything starts)
    spark = spark_settings(cfg, level, args.spark_master)
    secret = None if spark.is_local else spark.read_secret()
    pin_current_process(level, cfg)  # [groups."L"] cpus: this level's CPUs only (the JVM inherits them)
    tls_dir = server_tls(level, "worker", args.tls_dir, args.state_dir, args.insecure)
    for lv in levels[1:]:  # a trusted worker holds the certificate of each of its levels
        server_tls(lv, "worker", args.tls_dir, args.state_dir, args.insecure)
    spec = group_spec_of(cfg, level, args.state_dir, args.multicast_port)
    # Algorithm 5's CPU reading (worker/load.py): the flag, else [cluster] load_reading, else host
    reading = args.load_reading or cfg.cluster.reading()
    # [groups."L"] worker_metrics_port: the worker's own /metrics (worker/metrics.py), bound now, served once ready
    endpoint = worker_metrics.endpoint_of(cfg, level, args.listen, tls_dir)
    if args.start_after:  # a staggered start: let the previous worker's JVM start alone first
        deadline = time.monotonic() + 120
        while not Path(args.start_after).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if args.start_lazily and Path(args.start_after).exists():
            wait = lazy_wait(Path(args.start_after).stat().st_mtime, _started_at(), time.time())
            if wait > 0:
                print(f"[strata] starting in {wait:.1f} s if the run still goes on then (as long as the start-up "
                      f"before this worker took)", file=sys.stderr, flush=True)
                time.sleep(wait)  # a run that ends sooner stops this process meanwhile (SIGTERM)
    serve_worker(cfg, level, args.listen, spec, spark_master=spark.master, levels=levels,
                 ready=worker_metrics.on_ready(endpoint, args.ready_file, ready_writer(args.ready_file, "worker")),
                 tls_dir=tls_dir, load_reading=reading,
                 warm_queries=_read_warm_queries(args.warm_queries),
                 spark_conf=scratch_conf(dict(spark.conf), cfg.group(level).data_path(cfg.path) or args.state_dir,
                                         spark.is_local), spark_secret=secret)
    exit_now(EXIT_OK)


def scratch_conf(conf: dict, state_dir: str | None, local: bool) -> dict:
    """The level's Spark settings with its local session's scratch space (``spark.local.dir``: shuffle
    and spill files, the level's data) in a private directory under ``state_dir`` (the level's
    ``data_dir``, else the process's state directory), not in the host's shared temporary directory,
    unless the level's ``spark_conf`` names one.  A cluster's executors keep their own
    (``SPARK_LOCAL_DIRS`` of their daemons)."""
    if local and state_dir and "spark.local.dir" not in conf:
        scratch = private_dir(private_dir(state_dir, "data directory") / "spark-local", "Spark scratch directory")
        conf = {**conf, "spark.local.dir": str(scratch)}
    return conf


def lazy_wait(previous_ready: float, started: float, now: float) -> float:
    """Seconds a lazily started worker still waits (``--start-lazily``): until as long after the
    previous worker became ready (``previous_ready``) as that took from this process's start
    (``started``; the cluster starts its processes together), i.e. until the run has lasted as long
    as the start-up before it, the ski-rental rule: the run pays for a start-up only once it has
    spent as much without one."""
    return max(0.0, previous_ready + max(0.0, previous_ready - started) - now)


def _started_at() -> float:
    """When this process started (wall clock), else now."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the wait counts from here
        return time.time()


def _read_warm_queries(path: str | None) -> list[str]:
    """The query texts of ``--warm-queries`` (a JSON list; unreadable or malformed: none, logged)."""
    if not path:
        return []
    import json
    import logging

    try:
        texts = json.loads(Path(path).read_text())
        if isinstance(texts, list) and all(isinstance(t, str) for t in texts):
            return texts
        raise ValueError("not a JSON list of strings")
    except (OSError, ValueError) as e:
        logging.getLogger("strata.worker").warning("--warm-queries %s not used: %s", path, e)
        return []


def add_parsers(sub) -> None:
    w = sub.add_parser("worker", help="run a worker of one level (gRPC + Spark + group heartbeats)")
    add_process_options(w)
    w.add_argument("--listen", default="127.0.0.1:0")
    w.add_argument("--spark-master", default=None,
                   help='the Spark master (overrides the configuration\'s [groups."L"] spark_master; without '
                        'either, $STRATA_SPARK_MASTER, else local[1]): local, local[N], local[*] or '
                        'spark://host:port (the level\'s own cluster, with [groups."L"] spark_secret_file)')
    w.add_argument("--start-after", help=argparse.SUPPRESS)
    w.add_argument("--start-lazily", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--warm-queries", metavar="FILE",
                   help="a JSON list of the query texts the run will register: the warm-up evaluates their "
                        "shapes instead of generic ones, so the first real chunk is not their first (embedded runs "
                        "write it)")
    w.add_argument("--load-reading", choices=["host", "process"], default=None,
                   help="the CPU reading Algorithm 5 compares with 90 %%: the host's CPUs (default, "
                        "[cluster] load_reading) or this worker's own processes (workers sharing a host)")
    w.add_argument("--trusted-levels", metavar="LEVELS",
                   help="the trusted architecture (docs/trusted.md): also execute chunks of these levels' masters, "
                        "each checked as a worker of that level would (--level is their top: its group; a "
                        "certificate per level)")
    w.set_defaults(func=cmd_worker)
    worker_metrics.add_parsers(sub)  # strata scraper-cert: the certificate the workers' /metrics answer

