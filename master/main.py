"""``strata master``: run the master of one level (registered with the one CLI, strata/cli.py)."""

from __future__ import annotations

from pathlib import Path

from strata.cli_support import add_chunk_seconds, chunk_instants_of, config_of, level_of
from strata.cpusets import pin_current_process
from strata.errors import EXIT_OK, EXIT_REJECTED, CliError
from strata.groups import level_slug
from strata.private import private_dir
from strata.serving import add_process_options, exit_now, group_spec_of, progress, ready_writer, server_tls, \
    start_logging
from strata.trusted import trusted_levels
from strata.users import UserStore

__all__ = ["cmd_master", "add_parsers"]


def cmd_master(args) -> int:
    # deferred: the server pulls pyarrow, grpc.aio and the master's core; `strata --help` loads this module
    from strata.master.server import serve_master
    from strata.master.store import StateMismatch

    start_logging(args.log_file)
    cfg = config_of(args)
    level = level_of(cfg, args.level)
    chunk_instants = chunk_instants_of(cfg, args.chunk_seconds)
    peers = [p.strip() for p in (args.peers or "").split(",") if p.strip()]
    if peers and (args.no_persist or not (args.state_dir or args.state_file)):
        raise CliError("--peers needs a state file (--state-dir or --state-file): a standby copies the active "
                       "master's event log into it", EXIT_REJECTED)
    levels = trusted_levels(cfg, level, args.trusted_levels)  # a trusted master's (docs/trusted.md); () else
    if levels and (peers or args.state_file):
        raise CliError("--trusted-levels: a trusted master has no standbys (--peers) and keeps a state file per level "
                       "in --state-dir (or each level's data_dir), not --state-file", EXIT_REJECTED)
    pin_current_process(level, cfg)  # [groups."L"] cpus: this level's CPUs only
    tls_dir = server_tls(level, "master", args.tls_dir, args.state_dir, args.insecure)
    for lv in levels[1:]:  # a trusted master holds the certificate of each of its levels
        server_tls(lv, "master", args.tls_dir, args.state_dir, args.insecure)
    spec = group_spec_of(cfg, level, args.state_dir, args.multicast_port)
    users = UserStore(cfg.users_path, cfg.lattice)
    state_path = None
    if args.state_file and not args.no_persist:
        state_path = Path(args.state_file)
    elif (data := cfg.group(level).data_path(cfg.path)) is not None and not args.no_persist:
        # [groups."L"] data_dir: the level's own disk
        state_path = private_dir(data, f'[groups."{level}"] data_dir') / f"master-{level_slug(level)}.sqlite"
    elif args.state_dir and not args.no_persist:
        state_path = Path(args.state_dir) / f"master-{level_slug(level)}.sqlite"
    elif not args.no_persist:
        progress("WARNING: no --state-dir: queries, sessions and input are lost if this master stops")
    if args.owner:
        progress(f"user {args.owner} has every role on this master (--owner)")
    try:
        if levels:  # one process for several levels: a pipeline and a state file per level (master/trusted.py)
            from strata.master.trusted import serve_trusted_master  # deferred: as the server, above

            serve_trusted_master(cfg, levels, args.listen, spec, users, chunk_instants=chunk_instants,
                                 ready=ready_writer(args.ready_file, "master"), tls_dir=tls_dir,
                                 state_paths={lv: _state_path(cfg, lv, args) for lv in levels},
                                 owner=args.owner or None)
        elif peers:  # a standby of the active one, or the active one its standbys follow (master/standby.py)
            from strata.master.standby import Fenced, serve_replicated  # deferred: as the server, above

            try:
                serve_replicated(cfg, level, args.listen, spec, users, peers, state_path,
                                 chunk_instants=chunk_instants, ready=ready_writer(args.ready_file, "master"),
                                 tls_dir=tls_dir, owner=args.owner or None, takeover_seconds=args.takeover_seconds)
            except Fenced as e:
                raise CliError(str(e)) from None
        else:
            serve_master(cfg, level, args.listen, spec, users, chunk_instants=chunk_instants,
                         ready=ready_writer(args.ready_file, "master"), tls_dir=tls_dir, state_path=state_path,
                         owner=args.owner or None)
    except StateMismatch as e:  # the state file belongs to another level or configuration
        raise CliError(str(e)) from None
    exit_now(EXIT_OK)


def _state_path(cfg, level: str, args) -> Path | None:
    """A trusted master's state file of ``level``: in the level's ``data_dir``, else in ``--state-dir``
    (as a master of that level alone keeps it); None with ``--no-persist`` or neither."""
    if args.no_persist:
        return None
    if (data := cfg.group(level).data_path(cfg.path)) is not None:
        return private_dir(data, f'[groups."{level}"] data_dir') / f"master-{level_slug(level)}.sqlite"
    return Path(args.state_dir) / f"master-{level_slug(level)}.sqlite" if args.state_dir else None


def add_parsers(sub) -> None:
    m = sub.add_parser("master", help="run the master of one level")
    add_process_options(m)
    m.add_argument("--listen", default="127.0.0.1:0")
    add_chunk_seconds(m)
    m.add_argument("--no-persist", action="store_true",
                   help="keep queries, sessions and input in memory only (a restart loses them)")
    m.add_argument("--owner", metavar="USER",
                   help="a user who has every role on this master (a private master of one user's embedded "
                        "run; others have the users file's roles)")
    m.add_argument("--peers", metavar="HOST:PORT,...",
                   help="the level's other masters (standby masters, docs/operations.md): this master follows the "
                        "active one as its standby and takes over when it dies, or is the active one they follow")
    m.add_argument("--state-file", metavar="PATH",
                   help="the state file (default STATE_DIR/master-<level>.sqlite; a standby on the same host needs "
                        "its own)")
    m.add_argument("--takeover-seconds", type=float, default=2.0,
                   help="with --peers: how long the active master may not answer before a standby in sync takes over")
    m.add_argument("--trusted-levels", metavar="LEVELS",
                   help="the trusted architecture (docs/trusted.md): also serve the sessions of these levels, each "
                        "with its own pipeline and state file (--level is their top: its group; a certificate per "
                        "level)")
    m.set_defaults(func=cmd_master)

