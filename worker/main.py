"""``strata worker``: run a worker of one level (registered with the one CLI, strata/cli.py)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from strata.config import config_of
from strata.errors import EXIT_OK
from strata.serving import add_process_options, exit_now, group_spec_of, ready_writer, server_tls

__all__ = ["cmd_worker", "add_parsers"]


def cmd_worker(args) -> int:
    from strata.worker.server import serve_worker

    cfg = config_of(args)
    from strata.cpusets import pin_current_process
    pin_current_process(args.level, cfg)  # [groups."L"] cpus: this level's CPUs only (the JVM inherits them)
    tls_dir = server_tls(args, cfg, "worker")
    spec = group_spec_of(args, cfg)
    # Algorithm 5's CPU reading (worker/load.py): the flag, else [cluster] load_reading, else host
    reading = args.load_reading or (cfg.sections.get("cluster") or {}).get("load_reading", "host")
    if args.start_after:  # a staggered start: let the previous worker's JVM start alone first
        deadline = time.monotonic() + 120
        while not Path(args.start_after).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    serve_worker(cfg, args.level, args.listen, spec, spark_master=args.spark_master,
                 ready=ready_writer(args.ready_file, "worker"), tls_dir=tls_dir, load_reading=reading)
    exit_now(EXIT_OK)


def add_parsers(sub) -> None:
    w = sub.add_parser("worker", help="run a worker of one level (gRPC + Spark + group heartbeats)")
    add_process_options(w)
    w.add_argument("--listen", default="127.0.0.1:0")
    w.add_argument("--spark-master", default=os.environ.get("STRATA_SPARK_MASTER", "local[1]"))
    w.add_argument("--start-after", help=argparse.SUPPRESS)
    w.add_argument("--load-reading", choices=["host", "process"], default=None,
                   help="the CPU reading Algorithm 5 compares with 90 %%: the host's CPUs (default, "
                        "[cluster] load_reading) or this worker's own processes (workers sharing a host)")
    w.set_defaults(func=cmd_worker)

