"""``strata scale``: the elastic scaler of one level group (Ray actors, backlog/CPU driven)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["add_parsers", "cmd_scale"]


def cmd_scale(args) -> int:
    from strata.errors import EXIT_LOGIN, EXIT_REJECTED, CliError
    from strata.client import ClientError, LoginFailed
    from strata.commands import read_password
    from strata.config import ConfigError

    from .scaler import ScalerOptions, run_scaler
    from .scaler_policy import PolicySettings

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s scaler[{args.level}] %(message)s")
    try:
        settings = PolicySettings(min_workers=args.min, max_workers=args.max, up_backlog=args.up_backlog,
                                  cpu_threshold=args.cpu_threshold, up_sustain=args.up_sustain,
                                  up_cooldown=args.up_cooldown, max_step_up=args.max_step,
                                  down_backlog=args.down_backlog, down_cpu=args.down_cpu, down_idle=args.down_idle,
                                  down_cooldown=args.down_cooldown)
    except ValueError as e:
        raise CliError(str(e), EXIT_REJECTED) from None
    opts = ScalerOptions(config=args.config, level=args.level, master=args.master, user=args.user,
                         state_dir=Path(args.state_dir), settings=settings, interval=args.interval,
                         multicast_port=args.multicast_port, tls_dir=args.tls_dir, insecure=args.insecure,
                         spark_master=args.spark_master, load_reading=args.load_reading,
                         listen=args.listen, worker_cpus=args.worker_cpus,
                         ray_cpus=args.ray_cpus, start_timeout=args.start_timeout, stop_grace=args.stop_grace,
                         verbose=args.verbose)
    password = read_password()
    try:
        return run_scaler(opts, password)
    except LoginFailed as e:
        raise CliError(str(e), EXIT_LOGIN) from None
    except ClientError as e:
        raise CliError(f"cannot reach master {args.master}: {e}") from None
    except (ConfigError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None


def add_parsers(sub) -> None:
    p = sub.add_parser("scale", help="elastic workers for one level group (Ray actors, by backlog and CPU)")
    p.add_argument("--config", required=True)
    p.add_argument("--level", required=True, help="the level group to scale (one scaler and Ray cluster per level)")
    p.add_argument("--master", required=True, help="the level's master host:port")
    p.add_argument("--user", required=True, help="an operator user of the level; password from STRATA_PASSWORD")
    p.add_argument("--state-dir", required=True, help="the level's state dir (keys, certs, logs, Ray temp dir)")
    p.add_argument("--min", type=int, default=1, help="fewest workers in the group (default 1)")
    p.add_argument("--max", type=int, default=4, help="most workers in the group (default 4)")
    p.add_argument("--multicast-port", type=int, help="the group's multicast port (default: STATE_DIR/cluster.json "
                                                       "or the config)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between status polls (default 1)")
    p.add_argument("--tls-dir", help="certificates (default: STATE_DIR/tls)")
    p.add_argument("--insecure", action="store_true", help="no TLS (development clusters only)")
    p.add_argument("--spark-master", default="local[1]", help="the workers' Spark master (default local[1])")
    p.add_argument("--load-reading", choices=["host", "process"], default="process",
                   help="the workers' CPU reading for Algorithm 5 and the scaling policy: their own processes "
                        "(default; the pool shares one host) or the host's CPUs")
    p.add_argument("--listen", default="127.0.0.1:0", help="the workers' gRPC address (default 127.0.0.1:0)")
    g = p.add_argument_group("policy")
    g.add_argument("--up-backlog", type=int, default=4, help="waiting chunks above which the group is behind")
    g.add_argument("--cpu-threshold", type=float, default=90.0, help="CPU %% at which a worker counts as busy")
    g.add_argument("--up-sustain", type=float, default=2.0, help="seconds behind before adding workers")
    g.add_argument("--up-cooldown", type=float, default=10.0, help="seconds between scale-ups")
    g.add_argument("--max-step", type=int, default=2, help="workers added by one decision")
    g.add_argument("--down-backlog", type=int, default=0, help="backlog at or below which the group may be idle")
    g.add_argument("--down-cpu", type=float, default=50.0, help="mean CPU %% below which the group may be idle")
    g.add_argument("--down-idle", type=float, default=30.0, help="seconds idle before removing a worker")
    g.add_argument("--down-cooldown", type=float, default=30.0, help="seconds after any action before removing one")
    r = p.add_argument_group("ray")
    r.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per worker actor")
    r.add_argument("--ray-cpus", type=int, help="CPUs of the level's Ray cluster (default max x worker-cpus)")
    r.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a worker to start")
    r.add_argument("--stop-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("-v", "--verbose", action="store_true", help="log every decision, not only changes")
    p.set_defaults(func=cmd_scale)
