"""Client subcommands of ``strata``: certs, status, query, streams, ingest, advance (``cmd_*`` and
their parsers, :func:`add_parsers`).

What they share with ``strata replay`` (deploy/replay.py) lives in the core: the session with a
master (login, calls with one-line errors, query registration) in :mod:`strata.session`, input
files and their batches in :mod:`strata.inputs`.  The process commands live with their roles
(``strata master``: master/main.py, ``strata worker``: worker/main.py), the embedded cluster in
deploy/local.py (``strata up/down``) and replay/demo in deploy/replay.py.  Exit codes:
:mod:`strata.errors`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
import time
from pathlib import Path

from .cli_support import config_of
from .config import StreamSchema, with_streams
from .errors import EXIT_DENIED, EXIT_FAILED, EXIT_OK, EXIT_REJECTED, CliError
from .inputs import batches_of, drop_above, instant_batches, parse_inputs, read_input
from .serving import progress
from .session import client_call, client_level, client_tls, fmt_value, login, master_of, read_password, register_queries
from .tls import ROLES, SCRAPER, create_deployment

#: what the module's users import from it: its commands, the level list of ``--levels``, and (for
#: older callers) the session and input helpers that moved to strata.session and strata.inputs
__all__ = ["add_parsers", "split_levels", "parse_levels", "producer_id", "parse_schema", "with_master_streams",
           "read_password", "login", "master_of", "client_call", "client_tls", "register_queries", "fmt_value",
           "read_input", "parse_inputs", "drop_above", "instant_batches", "EXIT_FAILED", "EXIT_DENIED"]


def split_levels(text: str) -> list[str]:
    """``S,TS`` or ``[1,B],[⊥,T]``: commas inside brackets belong to a level."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [x for x in out if x]


def parse_levels(cfg, text: str) -> list[str]:
    try:
        return [cfg.lattice.parse(x) for x in split_levels(text)]
    except ValueError as e:
        raise CliError(f"--levels: {e}", EXIT_REJECTED) from None


def cmd_certs(args) -> int:
    cfg = config_of(args)
    levels = parse_levels(cfg, args.levels)
    hosts = [h.strip() for h in (args.hosts or "").split(",") if h.strip()]
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    unknown = [r for r in roles if r not in ROLES + (SCRAPER,)]
    if unknown or not roles:  # refused before anything is written (no CA made for nothing)
        raise CliError(f"--roles: unknown role {', '.join(unknown) or '(none given)'} (roles: "
                       f"{', '.join(ROLES + (SCRAPER,))})", EXIT_REJECTED)
    written = create_deployment(Path(args.out), levels, hosts, roles=roles)
    for f in written:
        print(f)
    progress(f"CA in {Path(args.out) / 'ca.pem'} (keep ca.key off the hosts); give each host only the "
              f"files of its own level")
    return EXIT_OK


def _query_rows(queries) -> list[dict]:
    return [{"query": q.query_id, "state": q.state, "last_ts": q.last_ts, "text": q.text, "error": q.error}
            | ({"stopped_after": q.stopped_after} if q.state not in ("running", "ended") else {})
            for q in queries]


def cmd_status(args) -> int:
    c = login(master_of(args), args.user, client_level(args), client_tls(args))
    try:
        st = client_call(c.status)
    finally:
        c.close()
    from .api import status_view  # deferred: strata.api loads pyarrow and gRPC

    out = status_view(st, _query_rows(st.queries))
    if args.json:
        print(json.dumps(out))
        return EXIT_OK
    print(f"level {out['level']}: {out['user']}.{out['level']} with roles {', '.join(out['roles']) or 'none'}; "
          f"{len(out['queries'])} queries of yours")
    for q in out["queries"]:
        last = "none yet" if q["last_ts"] < 0 else q["last_ts"]
        print(f"  {q['query']}  {q['state']:<9}  last instant {last}  {q['text']}")
        if q["error"]:
            print(f"      error: {q['error']}")
    sh = out.get("shedding")
    if sh:
        ranges = ", ".join(f"{a}-{b}" for a, b in sh["ranges"])
        shown = len(sh["ranges"])
        more = f" (the newest {shown} of {sh['ranges_total']})" if sh["ranges_total"] > shown else ""
        print(f"load shedding ({sh['mode']}): {'shedding now' if sh['active'] else 'not shedding'}; shed rows "
              + (", ".join(f"{k}={v}" for k, v in sorted(sh["rows"].items())) or "none")
              + (f"; instants shed {ranges}{more}" if ranges else ""))
    if st.cluster:
        print(f"cluster: {len(out['workers'])} workers, backlog {out['backlog']} chunks, lag {out['lag']}")
        for w in out["workers"]:
            print(f"  {w['sid']}  cpu {w['cpu']:5.1f}%  {w['state']}  done {w['chunks_done']}  in flight {w['in_flight']}")
        if out["rejected"]:
            print("  rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(out["rejected"].items())))
        if out["counters"]:
            print("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(out["counters"].items())))
        if out["last_chunk_error"]:
            print(f"  last chunk error: {out['last_chunk_error']}")
        for sw in out.get("switches", []):
            print(f"  switch {sw['query_id']}/{sw['user']}/{sw['stream']}: {sw['state']} since {sw['since']}, "
                  f"access counter {sw['access_counter']}, blocked {sw['blocked']}, passed {sw['passed']}")
        t = out["timings"]
        if t:
            print(f"  last {int(t['chunks'])} chunks, ms p50/p99: " + ", ".join(
                f"{part} {t[f'{part}_p50_ms']:g}/{t[f'{part}_p99_ms']:g}" for part in ("wait", "rtt", "engine", "transport")))
    return EXIT_OK


def _print_queries(rows: list[dict], fmt: str) -> None:
    if fmt == "json":
        for r in rows:
            print(json.dumps(r))
        return
    w = csv.writer(sys.stdout)
    w.writerow(["query", "state", "last_ts", "text", "error"])
    for r in rows:
        w.writerow([r["query"], r["state"], r["last_ts"], r["text"], r["error"]])


def cmd_query(args) -> int:
    """``strata query --query TEXT...`` (register and stream), ``strata query list``,
    ``strata query cancel ID...``."""
    missing = [f"--{n}" for n in ("config", "user") if not getattr(args, n, None)]
    if missing:
        raise CliError(f"strata query needs {', '.join(missing)}", EXIT_REJECTED)
    if args.action is None and not args.query:
        raise CliError("give --query TEXT (repeatable), or `list`, or `cancel ID...`", EXIT_REJECTED)
    if args.action is not None and args.query:
        raise CliError(f"`strata query {args.action}` takes no --query", EXIT_REJECTED)
    if args.action == "cancel" and not args.ids:
        raise CliError("`strata query cancel` needs the ids of the queries to stop (see `strata query list`)",
                       EXIT_REJECTED)
    if args.action == "list" and args.ids:
        raise CliError("`strata query list` takes no ids", EXIT_REJECTED)
    c = login(master_of(args), args.user, client_level(args), client_tls(args))
    if args.action is not None:
        try:
            if args.action == "list":
                rows = _query_rows(client_call(c.status).queries)
            else:
                rows = _query_rows(client_call(c.cancel, list(args.ids)))
                for r in rows:
                    last = r.get("stopped_after", r["last_ts"])
                    progress(f"{r['query']} {r['state']}" + (f": no instant after {last} is computed"
                                                              if r["state"] == "cancelled" else ""))
        finally:
            c.close()
        _print_queries(rows, args.format)
        return EXIT_OK
    return _follow_queries(c, args)


def _follow_queries(c, args) -> int:
    from .client import ClientError  # deferred: strata.client loads pyarrow

    regs = register_queries(c, args.query)
    names = {r.query_id: list(r.columns) for r in regs}
    writer = csv.writer(sys.stdout) if args.format == "csv" else None
    if writer:
        for r in regs:
            writer.writerow(["query", "ts", "level", *r.columns])
    def reconnecting(attempt):
        if attempt == 1:
            progress(f"lost the master; reconnecting for up to {args.reconnect_seconds:.0f} s and resuming "
                      f"after the last instant received")

    failed = []
    try:
        for qid, table in c.follow([r.query_id for r in regs], reconnect_seconds=args.reconnect_seconds,
                                   on_reconnect=reconnecting):
            if table is None:
                state, error = c.ended.get(qid, ("ended", ""))
                sys.stdout.flush()
                if state == "failed":
                    failed.append(qid)
                    print(f"strata: query {qid} failed: {error}", file=sys.stderr, flush=True)
                elif state != "ended":
                    progress(f"{qid} {state}")
                continue
            for row in table.to_pylist():
                if writer:
                    writer.writerow([qid, row["ts"], row["level"], *[fmt_value(row[n]) for n in names[qid]]])
                else:
                    print(json.dumps({"query": qid, **row}, default=str))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    except ClientError as e:
        client_call(_raise, e, what="result stream failed: ")
    finally:
        c.close()
    return EXIT_FAILED if failed else EXIT_OK


def _raise(e):
    raise e


def producer_id(args, inputs_specs: list[str], level: str, rows: int) -> str:
    """The producer id of an ingest: ``--producer-id``, else derived from what is sent: the input files'
    streams and contents and the options that decide how they are cut into batches.  The same command
    on the same files sends the same batches under the same id and sequence numbers, so running it
    again after it gave up (or after it was killed) applies nothing twice and sends on from where the
    master's log ends; a changed file is another producer."""
    given = getattr(args, "producer_id", None)
    if given:
        return given
    h = hashlib.sha256()
    for spec in inputs_specs:
        stream, path = spec.split("=", 1)
        h.update(f"{stream.lower()}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    h.update(json.dumps({"rows": rows, "finish": bool(args.finish), "labelled": bool(args.labelled),
                         "level": level}, sort_keys=True).encode())
    return "file-" + h.hexdigest()[:32]


def with_master_streams(cfg, c):
    """``cfg`` plus the streams the master behind client ``c`` declares that ``cfg`` does not (added at
    run time with ``strata streams add``)."""
    return with_streams(cfg, (StreamSchema(s.name, tuple((a.name, a.type) for a in s.attributes))
                              for s in client_call(c.streams)))


def parse_schema(text: str) -> list[tuple[str, str]]:
    """``sid=string,bp=double`` as [(attribute, type), ...] (checked by the master)."""
    out = []
    for part in (text or "").split(","):
        name, eq, typ = part.strip().partition("=")
        if not eq or not name.strip() or not typ.strip():
            raise CliError(f"--schema: {part.strip()!r} is not ATTRIBUTE=TYPE (e.g. sid=string,bp=double)",
                           EXIT_REJECTED)
        out.append((name.strip(), typ.strip().lower()))
    return out


def _attributes_text(info) -> str:
    """A stream's attributes as ``a=type`` pairs (a ``StreamInfo`` reply)."""
    return ",".join(f"{a.name}={a.type}" for a in info.attributes)


def cmd_streams(args) -> int:
    """``strata streams add --name N --schema a=type,...`` (operator) and ``strata streams list``
    (argparse requires --config, --master and --user for both)."""
    if args.action == "add":
        attrs = parse_schema(args.schema)
    c = login(master_of(args), args.user, client_level(args), client_tls(args))
    try:
        if args.action == "add":
            info = client_call(c.add_stream, args.name, attrs)
            progress(f"stream {info.name} " + ("declared" if info.created else "already declared so") +
                     f": {_attributes_text(info).replace(',', ', ')}")
            return EXIT_OK
        for s in client_call(c.streams):
            row = {"stream": s.name, "attributes": {a.name: a.type for a in s.attributes},
                   "added": "run time" if s.added else "config"}
            print(json.dumps(row) if args.format == "json" else
                  f"{s.name}\t{_attributes_text(s)}\t{row['added']}")
        return EXIT_OK
    finally:
        c.close()


def cmd_access(args) -> int:
    """``strata access revoke|grant --user U --query Q --stream S --operator OP``: a privacy switch
    (docs/semantics.md §12), made by operator OP of the master's level (who logs in)."""
    c = login(master_of(args), args.operator, client_level(args), client_tls(args))
    try:
        r = client_call(c.access, args.user, args.query, args.stream, args.action == "grant")
    finally:
        c.close()
    sw = r.switch
    what = "granted" if args.action == "grant" else "revoked"
    progress(f"{sw.user}'s access to {sw.stream} for query {sw.query_id} " +
             (f"{what} from instant {r.instant}" if r.changed else f"already {sw.state} (nothing changed)") +
             f"; access counter {sw.access_counter}, tuples blocked {sw.blocked}, passed {sw.passed}")
    return EXIT_OK


def cmd_ingest(args) -> int:
    """Send input files exactly once: batches numbered under a producer id, each acknowledged once it is
    in the master's log; on a lost connection (a master killed or restarted) one line, then reconnect,
    log in again and re-send from the first unacknowledged batch (the master skips what it has)."""
    from .client import ClientError  # deferred: strata.client loads pyarrow

    cfg = config_of(args)
    c = None
    try:
        if any(cfg.stream(spec.split("=", 1)[0]) is None for spec in args.input if "=" in spec):
            c = login(master_of(args), args.user, client_level(args), client_tls(args))
            cfg = with_master_streams(cfg, c)  # a stream added at run time: its schema is the master's
        inputs = parse_inputs(cfg, args.input)  # (a file's errors before connecting, where it can be)
    except BaseException:
        if c is not None:
            c.close()
        raise
    if c is None:
        c = login(master_of(args), args.user, client_level(args), client_tls(args))
    total = sum(t.num_rows for _, t in inputs)
    above = 0
    if args.labelled:  # rows the master's shepherd would drop on arrival: not sent
        inputs, above = drop_above(cfg, inputs, c.level)
    sent = 0
    t0 = time.monotonic()

    rows = max(1, min(65536, int(args.rate) if args.rate else 65536))
    if args.finish:  # the file is all there is: close instants as they complete, so results flow meanwhile
        batches = instant_batches(cfg, inputs, c.level if args.labelled else None, rows=rows)
    else:  # more may follow (from this or other producers): nothing is closed here
        batches = ((s, t, None) for s, t in batches_of(inputs, rows=rows))
    try:
        pid = producer_id(args, args.input, c.level, rows)
    except OSError as e:
        c.close()
        raise CliError(f"cannot read input: {e}") from None

    def paced():
        nonlocal sent
        for stream, t, upto in batches:
            if args.rate and t is not None:
                wait = t0 + sent / args.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            sent += 0 if t is None else t.num_rows
            yield stream, t, upto

    def lost(first: int) -> None:
        progress(f"connection to master lost; resuming from batch {first}")

    def finish():
        deadline = time.monotonic() + args.reconnect_seconds
        while True:  # finishing twice changes nothing: safe to repeat after a lost reply
            try:
                return c.advance(finish=True)
            except ClientError as e:
                if not c.moves_on(e) or time.monotonic() > deadline:
                    raise
                progress("connection to master lost; finishing the input again")
                c.reconnect(deadline)

    shed = {"rows": 0, "first": None, "last": None}  # rows the level shed ([limits] overload = "shed")

    def acked(ack) -> None:
        if ack.shed:
            shed["rows"] += ack.shed
            shed["first"] = ack.shed_first_ts if shed["first"] is None else min(shed["first"], ack.shed_first_ts)
            shed["last"] = ack.shed_last_ts if shed["last"] is None else max(shed["last"], ack.shed_last_ts)

    try:
        reply = client_call(c.ingest_stream, paced(), pid, labelled=args.labelled,
                             reconnect_seconds=args.reconnect_seconds, on_reconnect=lost, on_ack=acked,
                             what="ingest stopped: ")
        if args.finish and not reply.error:
            client_call(finish, what="finish failed: ")
    finally:
        c.close()
    again = f" ({reply.duplicates} batches were already applied)" if reply.duplicates else ""
    progress(f"sent {sent}/{total} tuples in {reply.batches} batches: accepted {reply.accepted}, dropped above "
              f"level {c.level} {above + reply.dropped_by_shepherd}, rejected batches {reply.rejected}{again}")
    if shed["rows"]:  # not an error: the level was overloaded and shed whole instants (docs/semantics.md §10)
        progress(f"shed {shed['rows']} tuples at instants {shed['first']}-{shed['last']}: level {c.level} was "
                 f"overloaded ([limits] overload = \"shed\"); `strata status` lists the instants shed")
    if reply.error:
        raise CliError(f"ingest stopped: {reply.error}", EXIT_REJECTED)
    return EXIT_OK


def cmd_advance(args) -> int:
    """Close instants up to ``--upto`` (producer) or finish the input (producer or operator)."""
    if (args.upto is None) == (not args.finish):
        raise CliError("give exactly one of --upto N or --finish", EXIT_REJECTED)
    c = login(master_of(args), args.user, client_level(args), client_tls(args))
    try:
        n = client_call(c.advance, upto_ts=args.upto or 0, finish=args.finish)
    finally:
        c.close()
    progress(("finished the input" if args.finish else f"closed the instants up to {args.upto}") +
              f": {n} chunks cut")
    return EXIT_OK


def add_parsers(sub) -> None:
    ce = sub.add_parser("certs", help="create a CA and per-level certificates for masters, workers and clients")
    ce.add_argument("--config", required=True)
    ce.add_argument("--levels", required=True, help="comma-separated levels")
    ce.add_argument("--out", required=True, help="directory for ca.pem/ca.key and <role>-<level>.pem/.key")
    ce.add_argument("--hosts", help="extra DNS names/IP addresses for the certificates")
    ce.add_argument("--roles", default="master,worker,client",
                    help="comma-separated: master, worker, client, scraper (a level's workers' /metrics client)")
    ce.set_defaults(func=cmd_certs)

    def client(p, required: bool = True, keep_parent: bool = False):
        """The client options.  ``keep_parent``: a sub-action's copy (``query cancel``) that leaves
        what was given before the action word alone (argparse copies a subparser's defaults over)."""
        kw = {"default": argparse.SUPPRESS} if keep_parent else {}
        p.add_argument("--config", required=required, **kw)
        p.add_argument("--master", help="the master's host:port, or the level's masters a:port,b:port (an active one "
                                        "and its standbys: the client uses whichever is active); default: the "
                                        "configuration's [groups.\"L\"] masters", **kw)
        p.add_argument("--user", required=required, help="password from STRATA_PASSWORD (or prompted)", **kw)
        p.add_argument("--level", help="login level (default: the master's)", **kw)
        p.add_argument("--tls-dir", help="client certificate from `strata certs` (default: $STRATA_TLS_DIR)", **kw)

    st = sub.add_parser("status", help="your level, roles and queries; for operators also the level group")
    client(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    q = sub.add_parser("query", help="register queries and stream results (Ctrl-C to stop); "
                                     "`query list`, `query cancel ID...` (your own queries)")
    client(q, required=False)  # checked in cmd_query: they may also follow `list`/`cancel`
    q.add_argument("--query", action="append", help="a query to register and follow (repeatable)")
    q.add_argument("--format", choices=["csv", "json"], default="csv")
    q.add_argument("--reconnect-seconds", type=float, default=120.0,
                   help="how long to wait for a restarted master before giving up")
    q.set_defaults(func=cmd_query, ids=[])
    qsub = q.add_subparsers(dest="action", metavar="ACTION", required=False)
    ql = qsub.add_parser("list", help="your queries: id, state, last released instant, rewritten text, error")
    qc = qsub.add_parser("cancel", help="stop some of your queries from the next instant")
    qc.add_argument("ids", nargs="+", metavar="ID", help="query ids (see `strata query list`)")
    for sp in (ql, qc):
        client(sp, required=False, keep_parent=True)
        sp.add_argument("--format", choices=["csv", "json"], default=argparse.SUPPRESS)

    ing = sub.add_parser("ingest", help="send a CSV/JSONL file of tuples to a master")
    client(ing)
    ing.add_argument("--input", action="append", required=True, help="STREAM=FILE")
    ing.add_argument("--rate", type=float, default=0, help="tuples per second (0: as fast as possible)")
    ing.add_argument("--labelled", action="store_true", help="rows carry their own level column")
    ing.add_argument("--finish", action="store_true", help="close all instants after sending")
    ing.add_argument("--producer-id", help="this producer's id for exactly-once delivery (default: derived from "
                                          "the input files and options, so re-running the command re-sends "
                                          "nothing twice)")
    ing.add_argument("--reconnect-seconds", type=float, default=120.0,
                     help="how long to wait for a restarted master before giving up")
    ing.set_defaults(func=cmd_ingest)

    sm = sub.add_parser("streams", help="`streams list`: the streams a master accepts; `streams add --name N "
                                        "--schema a=type,...`: declare one at run time (operator)")
    smsub = sm.add_subparsers(dest="action", metavar="ACTION", required=True)
    sa = smsub.add_parser("add", help="declare a stream on a running master (logged: it survives a restart)")
    client(sa)
    sa.add_argument("--name", required=True)
    sa.add_argument("--schema", required=True, help="attributes and types, e.g. sid=string,bp=double "
                                                    "(types: string, double, long, boolean, timestamp)")
    sl = smsub.add_parser("list", help="the master's streams: name, attributes, from the config or run time")
    client(sl)
    sl.add_argument("--format", choices=["text", "json"], default="text")
    for p in (sa, sl):
        p.set_defaults(func=cmd_streams)

    ac = sub.add_parser("access", help="`access revoke|grant --user U --query Q --stream S --operator OP`: a "
                                       "privacy switch, from the next instant (operator)")
    acsub = ac.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("revoke", "turn U's access to S for query Q off from the first instant not closed"),
                       ("grant", "turn it on again from the first instant not closed")):
        p = acsub.add_parser(name, help=text)
        p.add_argument("--config", required=True)
        p.add_argument("--master", help="the master's host:port (default: the configuration's)")
        p.add_argument("--operator", required=True, help="the operator who logs in (password from STRATA_PASSWORD)")
        p.add_argument("--level", help="login level (default: the master's)")
        p.add_argument("--tls-dir", help="client certificate from `strata certs` (default: $STRATA_TLS_DIR)")
        p.add_argument("--user", required=True, help="the query's owner whose access changes")
        p.add_argument("--query", required=True, help="query id (strata query list)")
        p.add_argument("--stream", required=True, help="a stream the query reads")
        p.set_defaults(func=cmd_access)

    adv = sub.add_parser("advance", help="close instants up to a timestamp (producer) or finish the input "
                                         "(producer or operator)")
    client(adv)
    adv.add_argument("--upto", type=int, help="close every instant up to this one (at most [limits] "
                                              "advance_horizon past the latest ingested)")
    adv.add_argument("--finish", action="store_true", help="close every instant holding a tuple; no more input")
    adv.set_defaults(func=cmd_advance)
