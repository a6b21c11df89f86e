"""``strata scale``: the elastic scaler of one level group (Ray actors, backlog/CPU driven).

    strata scale ...                    the scaler (a local Ray head, or --node-ip: the level's head
                                        on this host's level address; --address: join a level cluster)
    strata scale node ...               a node of the level's Ray cluster on this host (the head with
                                        --head, else joining --address HEAD:PORT); runs until SIGTERM
    strata scale cert ...               a Ray certificate of the level's Ray CA for another host's node

See docs/scaling.md.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from strata.config import ConfigError, load_config
from strata.cpusets import pin_current_process
from strata.errors import EXIT_LOGIN, EXIT_REJECTED, CliError
from strata.groups import level_slug
from strata.session import read_password

__all__ = ["add_parsers", "cmd_scale", "cmd_scale_node", "cmd_scale_cert"]

#: set in the environment of a scaler re-executed with the bind shim preloaded (no second re-exec)
_REEXEC = "STRATA_SCALE_REEXEC"


def _logging(level: str, what: str = "scaler") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {what}[{level}] %(message)s")


def _preload_bind_shim(args) -> None:
    """A scaler on a multi-host level cluster is a Ray driver with a listener of its own (its core
    worker): re-execute it once with the bind shim preloaded so that listener is on --node-ip
    too (Ray's own processes get the shim from the environment when they start)."""
    from .ray_pool import BIND_ENV, build_bind_shim, check_node_ip  # deferred: ~25 ms to import, `strata scale` only

    if not args.node_ip or args.ray_bind_any:
        return
    try:
        ip = check_node_ip(args.node_ip)
        shim = str(build_bind_shim(Path(args.state_dir)))
    except (ValueError, RuntimeError, OSError) as e:
        raise CliError(str(e)) from None
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    if os.environ.get(BIND_ENV) == ip and shim in preload:
        return
    if os.environ.get(_REEXEC):
        raise CliError(f"the bind shim {shim} did not load (LD_PRELOAD); give --ray-bind-any to run without it")
    env = {**os.environ, "LD_PRELOAD": ":".join([shim] + [p for p in preload if p != shim]), BIND_ENV: ip,
           _REEXEC: "1"}
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def cmd_scale(args) -> int:
    # deferred: the client (pyarrow, the gRPC stubs) and the scaler (ray_pool: ~25 ms) for `strata scale` only
    from strata.client import ClientError, LoginFailed

    from .scaler import ScalerOptions, run_scaler
    from .scaler_policy import PolicySettings

    missing = [f"--{k.replace('_', '-')}" for k in ("config", "level", "master", "user", "state_dir")
               if not getattr(args, k, None)]
    if missing:
        args.parser.error(f"the following arguments are required: {', '.join(missing)}")
    _logging(args.level)
    try:
        settings = PolicySettings(min_workers=args.min, max_workers=args.max, up_backlog=args.up_backlog,
                                  cpu_threshold=args.cpu_threshold, up_sustain=args.up_sustain,
                                  up_cooldown=args.up_cooldown, max_step_up=args.max_step,
                                  down_backlog=args.down_backlog, down_cpu=args.down_cpu, down_idle=args.down_idle,
                                  down_cooldown=args.down_cooldown)
    except ValueError as e:
        raise CliError(str(e), EXIT_REJECTED) from None
    _preload_bind_shim(args)
    opts = ScalerOptions(config=args.config, level=args.level, master=args.master, user=args.user,
                         state_dir=Path(args.state_dir), settings=settings, interval=args.interval,
                         multicast_port=args.multicast_port, tls_dir=args.tls_dir, insecure=args.insecure,
                         spark_master=args.spark_master, load_reading=args.load_reading,
                         listen=args.listen, worker_cpus=args.worker_cpus,
                         ray_cpus=args.ray_cpus, start_timeout=args.start_timeout, stop_grace=args.stop_grace,
                         node_ip=args.node_ip, ray_address=args.address, ray_port=args.ray_port,
                         ray_worker_ports=args.ray_worker_ports, placement=args.placement,
                         bind_any=args.ray_bind_any, verbose=args.verbose)
    password = read_password()
    try:
        return run_scaler(opts, password)
    except LoginFailed as e:
        raise CliError(str(e), EXIT_LOGIN) from None
    except ClientError as e:
        raise CliError(f"cannot reach master {args.master}: {e}") from None
    except (ConfigError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None


def cmd_scale_node(args) -> int:
    """Run one node of the level's Ray cluster on this host until SIGTERM/SIGINT."""
    import json
    import signal
    import threading

    from .ray_pool import RayNode, check_node_ip, default_ray_port  # deferred: ~25 ms to import, this command only

    _logging(args.level, "ray-node")
    log = logging.getLogger("strata.scaler")
    if bool(args.head) == bool(args.address):
        args.parser.error("give either --head (this node is the level's head) or --address HEAD:PORT (join it)")
    if not args.node_ip:
        args.parser.error("--node-ip is required: this host's address on the level's network")
    try:
        cfg = load_config(args.config)
        level = cfg.lattice.parse(args.level)
        ip = check_node_ip(args.node_ip)
        port = args.ray_port or default_ray_port(cfg, level)
        node = RayNode(level, Path(args.state_dir), ip, head=args.head, address=args.address, port=port,
                       num_cpus=args.ray_cpus, worker_ports=args.ray_worker_ports, bind_any=args.ray_bind_any,
                       config=args.config, tls_dir=args.tls_dir)
    except (ConfigError, ValueError, RuntimeError) as e:
        raise CliError(str(e)) from None
    pin_current_process(level, cfg)
    run = Path(args.state_dir).resolve() / "run"
    run.mkdir(parents=True, exist_ok=True)
    record = run / f"ray-node-{level_slug(level)}.json"
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        try:
            info = node.start()
        except (RuntimeError, ValueError, OSError) as e:
            raise CliError(str(e)) from None
        for sig in previous:  # again: Ray may have installed its own handlers
            signal.signal(sig, lambda *_: stop.set())
        info.update(pid=os.getpid(), level=level, pids=sorted({os.getpid()} | _tree_pids()))
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(record)
        log.info("Ray %s of level %s at %s %s %s (%d CPUs, ports %s) after %.1f s", "head" if args.head else "node",
                 level, ip, "serving" if args.head else "joined", node.address, node.num_cpus, node.ports.as_dict(),
                 info["started_in"])
        while not stop.wait(1.0):
            if not node.alive():
                log.error("the node's raylet%s exited; stopping", " or GCS" if args.head else "")
                code = 1
                break
    finally:
        left = node.stop()
        record.unlink(missing_ok=True)
        for sig, h in previous.items():
            signal.signal(sig, h)
        log.info("Ray node of level %s stopped%s", level, f" (killed {left})" if left else "")
    return code


def _tree_pids() -> set[int]:
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001
        return set()


def cmd_scale_cert(args) -> int:
    """Issue a node certificate of the level's Ray CA (made if absent) for another host."""
    from .ray_pool import issue_node_cert, ray_tls_dir, token_path  # deferred: ~25 ms to import, this command only

    try:
        level = load_config(args.config).lattice.parse(args.level)
        out = Path(args.out) if args.out else None
        for ip in args.ip:
            crt, key = issue_node_cert(Path(args.state_dir), level, ip, out=out)
            print(f"{crt}\n{key}")
    except (ConfigError, ValueError, RuntimeError, OSError) as e:
        raise CliError(str(e)) from None
    if out is not None:
        print(f"copy {out}/ray/ into that host's state dir (STATE/ray/: the CA certificate, the node's pair, the "
              f"level's token; keys mode 0600)", file=sys.stderr)
    else:
        print(f"copy {ray_tls_dir(Path(args.state_dir), level)}/ca.pem and the node's pair to STATE/ray/"
              f"{ray_tls_dir(Path('.'), level).name}/ on that host, and {token_path(Path(args.state_dir), level)} "
              f"to STATE/ray/ (mode 0600)", file=sys.stderr)
    return 0


def _ray_options(g, node: bool) -> None:
    g.add_argument("--node-ip", help="this host's address on the level's network: Ray listens there only"
                   + ("" if node else "; starts the level's Ray head here for other hosts to join (or, with "
                                      "--address, joins through this host's node)"))
    g.add_argument("--ray-port", type=int, help='the level\'s base Ray port: GCS on it, the node\'s other ports '
                   'above it (default: [groups."L"] ray_port, else 46000 + 100 x the level\'s lattice position)')
    g.add_argument("--ray-cpus", type=int, default=1 if node else None,
                   help="CPUs this node offers the level's worker actors (0: none)" if node else
                   "CPUs of this host's Ray node (default max x worker-cpus; 0 with --node-ip: the head "
                   "hosts no worker)")
    g.add_argument("--ray-worker-ports", type=int, default=40, help="ports for Ray's worker processes (default 40)")
    g.add_argument("--ray-bind-any", action="store_true",
                   help="no bind shim: accept Ray's listeners on 0.0.0.0 (still mutual TLS and the level's token)")


def add_parsers(sub) -> None:
    p = sub.add_parser("scale", help="elastic workers for one level group (Ray actors, by backlog and CPU)",
                       description="strata scale [node|cert] ...: the scaler; `strata scale node` runs a node of the "
                                   "level's Ray cluster; `strata scale cert` issues a Ray node certificate")
    p.add_argument("--config")
    p.add_argument("--level", help="the level group to scale (one scaler and Ray cluster per level)")
    p.add_argument("--master", help="the level's master host:port")
    p.add_argument("--user", help="an operator user of the level; password from STRATA_PASSWORD")
    p.add_argument("--state-dir", help="the level's state dir (keys, certs, logs, Ray temp dir)")
    p.add_argument("--min", type=int, default=1, help="fewest workers in the group (default 1)")
    p.add_argument("--max", type=int, default=4, help="most workers in the group (default 4)")
    p.add_argument("--multicast-port", type=int, help="the group's multicast port (default: STATE_DIR/cluster.json "
                                                       "or the config)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between status polls (default 1)")
    p.add_argument("--tls-dir", help="certificates (default: STATE_DIR/tls)")
    p.add_argument("--insecure", action="store_true", help="no TLS (development clusters only)")
    p.add_argument("--spark-master", default=None,
                   help="the workers' Spark master (default: each worker uses its level's [groups.\"L\"] Spark "
                        "settings from the config)")
    p.add_argument("--load-reading", choices=["host", "process"], default="process",
                   help="the workers' CPU reading for Algorithm 5 and the scaling policy: their own processes "
                        "(default; pool workers may share a host) or the host's CPUs")
    p.add_argument("--listen", default=None,
                   help="the workers' gRPC address (default: the address of the Ray node each lands on, port 0)")
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
    _ray_options(r, node=False)
    r.add_argument("--address", help='HEAD:PORT of the level\'s Ray cluster to join (default: [groups."L"] '
                                     'ray_address); needs --node-ip and a `strata scale node` on this host')
    r.add_argument("--placement", choices=["spread", "pack"], default="spread",
                   help="where Ray puts new workers: spread over the level's nodes (default) or pack a node first")
    r.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a worker to start")
    r.add_argument("--stop-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("-v", "--verbose", action="store_true", help="log every decision, not only changes")
    p.set_defaults(func=cmd_scale, parser=p)

    ss = p.add_subparsers(dest="scale_command", metavar="{node,cert}")
    n = ss.add_parser("node", help="a node of the level's Ray cluster on this host (until SIGTERM)")
    n.add_argument("--config", required=True)
    n.add_argument("--level", required=True)
    n.add_argument("--state-dir", required=True,
                   help="this host's state dir of the level: STATE/ray/<level>.token and STATE/ray/<level>-tls/ "
                        "(ca.pem, this node's certificate) from the head's host; the workers placed here use its "
                        "keys, certificates and logs")
    n.add_argument("--tls-dir", help="the workers' certificates on this host (default STATE_DIR/tls)")
    where = n.add_mutually_exclusive_group()
    where.add_argument("--head", action="store_true", help="start the level's head here")
    where.add_argument("--address", help="HEAD:PORT: join the level's head")
    _ray_options(n, node=True)
    n.set_defaults(func=cmd_scale_node, parser=n)
    c = ss.add_parser("cert", help="a node certificate of the level's Ray CA (run it on the head's host)")
    c.add_argument("--config", required=True)
    c.add_argument("--level", required=True)
    c.add_argument("--state-dir", required=True,
                   help="the state dir holding the level's Ray CA (STATE/ray/<level>-tls)")
    c.add_argument("--ip", action="append", required=True, help="the node's address (repeat for several nodes)")
    c.add_argument("--out", metavar="DIR", help="also write what that host needs under DIR as it goes in its state dir "
                                                "(DIR/ray/<level>-tls/ca.pem, the node's pair, DIR/ray/<level>.token)")
    c.set_defaults(func=cmd_scale_cert, parser=c)
