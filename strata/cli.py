"""The ``strata`` command line.

Exit codes: 0 success; 1 operational error (bad config, I/O) and a query
literal beyond a limit (``strata explain``); 2 rejected query, input, advance or
bad usage; 3 failed login or ended session; 4 a query failed; 5 permission denied
(a call outside the session's roles).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys

from . import __version__, commands, metrics
from .cli_support import config_of
from .config import ConfigError
from .deploy import cli as deploy_cli
from .deploy import demo, local, replay, scale_cli, slots
from .errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, CliError
from .logs import flush_output
from .master import main as master_main
from .mlscql import QueryError, compile_query
from .users import UserError, UserStore, check_roles, principals
from .worker import main as worker_main


# ---- users ------------------------------------------------------------------------
def _read_password(confirm: bool) -> str:
    if sys.stdin is not None and sys.stdin.isatty():
        pw = getpass.getpass("password: ")
        if confirm and getpass.getpass("again: ") != pw:
            raise CliError("passwords differ", EXIT_REJECTED)
        return pw
    line = sys.stdin.readline() if sys.stdin is not None else ""
    return line.rstrip("\r\n")


def cmd_users_add(args) -> int:

    cfg = config_of(args)
    store = UserStore(cfg.users_path, cfg.lattice)
    roles = _roles(args.roles) if args.roles is not None else None
    password = _read_password(confirm=True)
    try:
        user = store.add(args.name, args.clearance, password, replace=args.replace, roles=roles)
    except UserError as e:
        raise CliError(str(e), EXIT_REJECTED) from None
    print(f"user {user.name} (clearance {user.clearance}, roles {', '.join(sorted(user.roles))}) "
          f"stored in {store.path}", file=sys.stderr)
    return EXIT_OK


def _roles(text: str) -> frozenset:

    try:
        return check_roles(text)
    except UserError as e:
        raise CliError(f"--roles: {e}", EXIT_REJECTED) from None


def cmd_users_list(args) -> int:

    cfg = config_of(args)
    store = UserStore(cfg.users_path, cfg.lattice)
    try:
        users = store.load()
    except UserError as e:
        raise CliError(str(e)) from None
    rows = []
    for u in users.values():
        row = {"name": u.name, "clearance": u.clearance, "roles": sorted(u.roles),
               "principals": [p.level for p in principals(u, cfg.lattice)]}
        if u.name in store.problems:
            row["problem"] = store.problems[u.name]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return EXIT_OK
    for r in rows:
        if "problem" in r:
            print(f"{r['name']}\t(no access: {r['problem']})")
            continue
        names = ", ".join(f"{r['name']}.{lv}" for lv in r["principals"])
        print(f"{r['name']}\t{r['clearance']}\t{','.join(r['roles'])}\t{names}")
    return EXIT_OK


def _users_change(args, action: str, *extra):
    """Apply one administrator change to the users file (``UserStore.<action>``)."""

    cfg = config_of(args)
    try:
        return getattr(UserStore(cfg.users_path, cfg.lattice), action)(args.name, *extra)
    except UserError as e:
        raise CliError(str(e), EXIT_REJECTED) from None


def cmd_users_remove(args) -> int:
    _users_change(args, "remove")
    print(f"user {args.name} removed; running masters end their sessions and queries within a second",
          file=sys.stderr)
    return EXIT_OK


def cmd_users_set_clearance(args) -> int:
    u = _users_change(args, "set_clearance", args.clearance)
    print(f"user {u.name} now has clearance {u.clearance}; masters of levels it no longer dominates end the "
          f"user's sessions and queries within a second", file=sys.stderr)
    return EXIT_OK


def cmd_users_set_roles(args) -> int:
    u = _users_change(args, "set_roles", _roles(args.roles))
    print(f"user {u.name} now has roles {', '.join(sorted(u.roles))}; running masters apply it to open sessions "
          f"within a second", file=sys.stderr)
    return EXIT_OK


def cmd_users_logout(args) -> int:
    _users_change(args, "end_sessions")
    print(f"sessions of {args.name} end on every master within a second (their open result streams stop with "
          f"'session ended'); clearance, password and queries are unchanged: the user may log in again",
          file=sys.stderr)
    return EXIT_OK


# ---- explain ----------------------------------------------------------------------
def cmd_explain(args) -> int:

    cfg = config_of(args)
    specs = _explain_queries(args)
    if not specs:
        raise CliError("give a query (or --query/--query-at/--file)", EXIT_REJECTED)
    compiled = []
    for level, text in specs:
        try:
            compiled.append(compile_query(text, cfg, level))
        except QueryError as e:  # every refusal, a limit's included (limits.py), exits 2 with one line
            prefix = f"query {len(compiled) + 1}: " if len(specs) > 1 else ""
            raise CliError(prefix + str(e).replace("\n", " "), EXIT_REJECTED) from None
    if len(compiled) == 1 and not args.sharing:
        cq = compiled[0]
        shields = shield_lines(cq, cfg) if args.access else []
        if args.json:
            print(json.dumps(cq.to_json() | ({"shields": shields} if args.access else {}), ensure_ascii=False))
        else:
            print(cq.rewritten)
            for n in cq.notes:
                print(f"-- {n}")
            for line in shields:
                print(f"-- {line}")
        return EXIT_OK
    from .sharing.explain import explain_sharing, render_sharing

    report = explain_sharing(compiled, cfg, mode=args.mode)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(render_sharing(report))
    return EXIT_OK


def shield_lines(cq, cfg) -> list[str]:
    """Where the master's input shields sit for a compiled query (docs/semantics.md §11-12): one line per
    stream it reads, before the stream's windows."""
    from .punctuations import referenced_attributes  # deferred: imports numpy, kept out of `strata --help`

    out = []
    for stream, levels in _stream_levels(cq).items():
        s = cfg.stream(stream)
        if s is None or s.relation:
            continue
        attrs = referenced_attributes(cq.query, s)
        order = ", ".join(cfg.lattice.sort(levels))
        out.append(f"shield: {s.name} before its windows (the security punctuations of levels {order} in force at "
                   f"each tuple's instant, for the query's user and roles, attributes "
                   f"{', '.join(attrs) or 'none'}; then the query's privacy switch for {s.name})")
    return out


def _stream_levels(cq) -> dict[str, set]:
    out: dict[str, set] = {}
    for f, info in zip(cq.query.from_, cq.items):
        w = f.window
        out.setdefault(info.stream, set()).update((w.instants or w.levels) if w is not None and w.levels else ())
    return out


def _explain_queries(args) -> list[tuple[str, str]]:
    """(level, text) of every query given to ``explain``, in order."""
    out: list[tuple[str, str]] = []
    for text in ([args.query] if args.query is not None else []) + list(args.queries or []):
        out.append((args.level, sys.stdin.read() if text == "-" else text))
    for level, text in args.query_at or []:
        out.append((level, text))
    for path in args.file or []:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise CliError(f"cannot read {path}: {e}") from None
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("--"):
                continue
            if line.startswith("@"):  # "@LEVEL query"
                level, _, text = line[1:].partition(" ")
                out.append((level, text.strip()))
            else:
                out.append((args.level, line))
    if any(level is None for level, _ in out):
        raise CliError("--level is required for queries given without their own level", EXIT_REJECTED)
    return out


# ---- parser -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata: multilevel-secure stream processing")
    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    users = sub.add_parser("users", help="manage users and clearances")
    usub = users.add_subparsers(dest="users_command", required=True, metavar="ACTION")
    ua = usub.add_parser("add", help="add a user; the password is read from stdin")
    ua.add_argument("--config", required=True)
    ua.add_argument("--name", required=True)
    ua.add_argument("--clearance", required=True, help="highest level the user may log in at")
    ua.add_argument("--roles", metavar="R1,R2",
                    help="comma-separated roles: producer (ingest), analyst (queries), operator (cluster status); "
                         "default analyst, or the old roles with --replace")
    ua.add_argument("--replace", action="store_true",
                    help="replace an existing user (a new password ends the sessions opened with the old one)")
    ua.set_defaults(func=cmd_users_add)
    us = usub.add_parser("set-roles", help="replace a user's roles (masters apply it within a second)")
    us.add_argument("--config", required=True)
    us.add_argument("--name", required=True)
    us.add_argument("--roles", required=True, metavar="R1,R2", help="comma-separated: producer, analyst, operator")
    us.set_defaults(func=cmd_users_set_roles)
    ul = usub.add_parser("list", help="list users, roles and principals (and entries that give no access)")
    ul.add_argument("--config", required=True)
    ul.add_argument("--json", action="store_true")
    ul.set_defaults(func=cmd_users_list)
    ur = usub.add_parser("remove", help="remove a user")
    ur.add_argument("--config", required=True)
    ur.add_argument("--name", required=True)
    ur.set_defaults(func=cmd_users_remove)
    uc = usub.add_parser("set-clearance", help="change a user's clearance (a downgrade revokes access at once)")
    uc.add_argument("--config", required=True)
    uc.add_argument("--name", required=True)
    uc.add_argument("--clearance", required=True)
    uc.set_defaults(func=cmd_users_set_clearance)
    uo = usub.add_parser("logout", help="end all of a user's current sessions (the user may log in again)")
    uo.add_argument("--config", required=True)
    uo.add_argument("--name", required=True)
    uo.set_defaults(func=cmd_users_logout)

    ex = sub.add_parser("explain", help="check and rewrite a query offline (Alg. 2-4)")
    ex.add_argument("--config", required=True)
    ex.add_argument("--level", help="the session level the queries run at")
    ex.add_argument("--json", action="store_true", help="print a JSON object")
    ex.add_argument("query", nargs="?", help="MLS-CQL text, or - to read stdin")
    ex.add_argument("--query", dest="queries", action="append", metavar="TEXT",
                    help="another query at --level (repeat); with two or more, sharing decisions are shown")
    ex.add_argument("--query-at", nargs=2, action="append", metavar=("LEVEL", "TEXT"),
                    help="a query at its own level (trusted-mode sharing across levels)")
    ex.add_argument("--file", action="append", metavar="PATH",
                    help="queries, one a line ('@LEVEL text' for another level; # comments)")
    ex.add_argument("--mode", choices=("replicated", "trusted"), default="replicated",
                    help="sharing analysis: replicated shares within a level only (the cluster), "
                         "trusted also across levels (dissertation §6.3)")
    ex.add_argument("--sharing", action="store_true", help="show sharing analysis even for one query")
    ex.add_argument("--access", action="store_true", help="also show where the master's access shields sit "
                                                          "(security punctuations, privacy switches)")
    ex.set_defaults(func=cmd_explain)

    for register in _EXTENSIONS:
        register(sub)
    return p


#: the modules that add subcommands, in the order ``strata --help`` lists them: each defines
#: ``add_parsers(sub)``.  Imported above, so a missing or broken one stops every command with its
#: error instead of its commands silently vanishing.  They keep their heavy imports (Spark, Ray,
#: pyarrow, the gRPC servers) inside the commands, so ``strata --help`` stays quick.
COMMAND_MODULES = (master_main, worker_main, local, slots, commands, metrics, replay, demo, deploy_cli, scale_cli)
_EXTENSIONS = [m.add_parsers for m in COMMAND_MODULES]


def _load_extensions() -> None:
    """Nothing to load any more: :data:`COMMAND_MODULES` are imported with this module (kept for
    callers that still call it before :func:`build_parser`)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"strata: {e}", file=sys.stderr)
        return e.code
    except ConfigError as e:  # e.g. a missing group key found while starting a process
        print(f"strata: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    finally:
        flush_output()  # a master's or worker's --log-file: its last lines reach the file


if __name__ == "__main__":  # pragma: no cover - `python -m strata` is the entry point
    from strata.cli import main as _main

    sys.exit(_main())
