"""A command's client session with a master: the password, the master's address and the client
certificates from the command line, the login, and client calls whose refusals become one-line
:class:`~strata.errors.CliError` s with their exit codes; query registration and the text of a
result value in an output CSV.

Shared by the client commands (strata/commands.py) and ``strata replay`` (deploy/replay.py).
"""

from __future__ import annotations

import getpass
import os
import sys

from .cli_support import config_of
from .errors import EXIT_DENIED, EXIT_LOGIN, EXIT_REJECTED, CliError
from .serving import progress
from .tls import TlsError

__all__ = ["read_password", "client_level", "client_tls", "master_of", "login", "client_call", "register_queries",
           "fmt_value"]


def read_password() -> str:
    pw = os.environ.get("STRATA_PASSWORD")
    if pw is None:
        if sys.stdin is not None and sys.stdin.isatty():
            return getpass.getpass("password: ")
        raise CliError("set STRATA_PASSWORD (or run interactively)", EXIT_LOGIN)
    return pw


def client_level(args) -> str:
    """The login level of ``--level`` in canonical form (empty: the master's)."""
    if not getattr(args, "level", None):
        return ""
    try:
        return config_of(args).lattice.parse(args.level)
    except ValueError as e:
        raise CliError(f"--level: {e}", EXIT_REJECTED) from None


def client_tls(args) -> str | None:
    return getattr(args, "tls_dir", None) or os.environ.get("STRATA_TLS_DIR") or None


def master_of(args) -> str:
    """The master(s) a client command talks to: ``--master`` (``host:port``, or the level's masters
    ``a:port,b:port``: an active one and its standbys), else the configuration's ``[groups."L"] masters``
    of the login level (``--level L``, or the only level that lists masters)."""
    if getattr(args, "master", None):
        return args.master
    cfg = config_of(args)
    level = client_level(args)
    listed = {lv: g.masters for lv, g in cfg.groups.items() if g.masters}
    pick = None
    for lv, masters in listed.items():
        try:
            if level and cfg.lattice.parse(lv) == level:
                pick = masters
        except ValueError:
            continue
    if not level and len(listed) == 1:
        pick = next(iter(listed.values()))
    if not pick:
        raise CliError("give --master HOST:PORT (or the level's masters A:PORT,B:PORT), or list them in the "
                       "configuration: [groups.\"L\"] masters = [\"host:port\", ...] with --level L", EXIT_REJECTED)
    return pick if isinstance(pick, str) else ",".join(str(m) for m in pick)


def login(address: str, user: str, level: str = "", tls_dir: str | None = None, password: str | None = None):
    """A logged-in client of the master at ``address`` (through the Python API, :func:`strata.api.connect`) (``host:port``, or the level's masters
    ``a:port,b:port``: the client logs in at the active one; ``password``: read from STRATA_PASSWORD or
    the terminal when not given)."""
    # deferred: the Python API (strata.client) loads pyarrow and the gRPC stubs
    from .api import LoginFailed, StrataError, connect

    try:
        return connect(address, user, level or None, tls_dir=tls_dir,
                       password=read_password() if password is None else password).client
    except TlsError as e:
        raise CliError(str(e)) from None
    except ValueError as e:
        raise CliError(f"--master: {e}", EXIT_REJECTED) from None
    except LoginFailed as e:
        raise CliError(str(e), EXIT_LOGIN) from None
    except StrataError as e:
        if e.code == "FAILED_PRECONDITION":  # a standby master: its one line names the active one
            raise CliError(e.details, EXIT_REJECTED) from None
        hint = "" if tls_dir else " (a TLS master needs --tls-dir with a client certificate of its level)"
        raise CliError(f"cannot reach master {address}: {e}{hint}") from None


def client_call(fn, *a, what: str = "", **kw):
    """Run a client call; a refusal becomes a one-line CliError with its exit code."""
    from .client import ClientError, PermissionDenied, SessionEnded  # deferred: strata.client loads pyarrow

    try:
        return fn(*a, **kw)
    except PermissionDenied as e:
        raise CliError(str(e), EXIT_DENIED) from None
    except SessionEnded as e:
        raise CliError(f"{what}{e}", EXIT_LOGIN) from None
    except ClientError as e:
        if e.code in ("OUT_OF_RANGE", "INVALID_ARGUMENT", "FAILED_PRECONDITION"):  # refused: the master's one line
            raise CliError(f"{what}{e.details}", EXIT_REJECTED) from None
        raise CliError(f"{what}{e}") from None



def register_queries(c, queries: list[str]):
    """Register ``queries`` through client ``c``; each one's id and rewritten text on stderr."""
    from .client import QueryRejected  # deferred: strata.client loads pyarrow

    def register():
        try:
            return c.register(queries)
        except QueryRejected as e:  # before the general mapping: a rejected query exits 2
            raise CliError(str(e).replace("\n", " "), EXIT_REJECTED) from None

    regs = client_call(register)
    for r in regs:
        progress(f"{r.query_id}: {r.rewritten}")
    return regs


def fmt_value(v) -> str:
    """A result value as an output CSV field: NULL empty, a double as ``repr``, booleans lower case."""
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
