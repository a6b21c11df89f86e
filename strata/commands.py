"""Cluster subcommands of ``strata``: worker, master, up, down, status, query, ingest, advance, replay, demo.

Exit codes beyond :mod:`strata.cli`'s (0 success, 1 error, 2 rejected query, input
or advance, or bad usage, 3 failed login or ended session): 4 a query failed while
it ran (its one-line error is on stderr), 5 permission denied (the call needs a
role the session does not have; the line names it).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .cli import EXIT_LOGIN, EXIT_OK, EXIT_REJECTED, CliError, _config

__all__ = ["add_parsers", "start_cluster", "stop_cluster", "EXIT_FAILED", "EXIT_DENIED"]

#: a query failed while it ran (``strata query``, ``strata replay``)
EXIT_FAILED = 4
#: the call needs a role the session does not have
EXIT_DENIED = 5


def _progress(msg: str) -> None:
    print(f"[strata] {msg}", file=sys.stderr, flush=True)


def _free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _spec(args, cfg, create_key: bool = False):
    from .groups import group_spec

    spec = group_spec(cfg, args.level, Path(args.state_dir) if args.state_dir else None, create_key=create_key)
    if getattr(args, "multicast_port", None):
        from dataclasses import replace

        spec = replace(spec, port=int(args.multicast_port))
    return spec


def _ready_writer(path: str | None, role: str):
    def ready(address, core, member):
        if path:
            tmp = Path(path + ".tmp")
            tmp.write_text(json.dumps({"role": role, "address": address, "pid": os.getpid()}))
            tmp.replace(path)
        _progress(f"{role} listening on {address}")

    return ready


# ---- processes ---------------------------------------------------------------------
def _server_tls(args, cfg, role: str):
    """The TLS directory a master/worker serves with, or None with --insecure."""
    from .tls import has_material

    if args.insecure:
        _progress(f"WARNING: {role} runs without TLS (--insecure); only the group key protects it")
        return None
    level = cfg.lattice.parse(args.level)
    tls_dir = Path(args.tls_dir) if args.tls_dir else (Path(args.state_dir) / "tls" if args.state_dir else None)
    if tls_dir is None or not has_material(tls_dir, role, level):
        where = tls_dir or "--tls-dir"
        raise CliError(f"no TLS certificate for the {role} of level {level} in {where}: create one with "
                       f"`strata certs --config ... --levels {level} --out DIR` and pass --tls-dir DIR "
                       f"(or --insecure for a development cluster)")
    return tls_dir


def cmd_worker(args) -> int:
    from strata.worker.server import serve_worker

    cfg = _config(args)
    from .cpusets import pin_current_process
    pin_current_process(args.level, cfg)  # [groups."L"] cpus: this level's CPUs only (the JVM inherits them)
    tls_dir = _server_tls(args, cfg, "worker")
    spec = _spec(args, cfg)
    # Algorithm 5's CPU reading (worker/load.py): the flag, else [cluster] load_reading, else host
    reading = args.load_reading or (cfg.sections.get("cluster") or {}).get("load_reading", "host")
    serve_worker(cfg, args.level, args.listen, spec, spark_master=args.spark_master,
                 ready=_ready_writer(args.ready_file, "worker"), tls_dir=tls_dir, load_reading=reading)
    return EXIT_OK


def cmd_master(args) -> int:
    from strata.master.server import serve_master
    from strata.master.store import StateMismatch
    from strata.users import UserStore

    cfg = _config(args)
    from .cpusets import pin_current_process
    pin_current_process(args.level, cfg)  # [groups."L"] cpus: this level's CPUs only
    tls_dir = _server_tls(args, cfg, "master")
    spec = _spec(args, cfg)
    users = UserStore(cfg.users_path, cfg.lattice)
    chunk_instants = max(1, round(args.chunk_seconds / cfg.instant_seconds))
    state_path = None
    if args.state_dir and not args.no_persist:
        from .groups import level_slug

        state_path = Path(args.state_dir) / f"master-{level_slug(cfg.lattice.parse(args.level))}.sqlite"
    elif not args.no_persist:
        _progress("WARNING: no --state-dir: queries, sessions and input are lost if this master stops")
    if args.owner:
        _progress(f"user {args.owner} has every role on this master (--owner)")
    try:
        serve_master(cfg, args.level, args.listen, spec, users, chunk_instants=chunk_instants,
                     ready=_ready_writer(args.ready_file, "master"), tls_dir=tls_dir, state_path=state_path,
                     owner=args.owner or None)
    except StateMismatch as e:  # the state file belongs to another level or configuration
        raise CliError(str(e)) from None
    return EXIT_OK


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


def _levels(cfg, text: str) -> list[str]:
    try:
        return [cfg.lattice.parse(x) for x in split_levels(text)]
    except ValueError as e:
        raise CliError(f"--levels: {e}", EXIT_REJECTED) from None


def cmd_certs(args) -> int:
    from .tls import create_deployment

    cfg = _config(args)
    levels = _levels(cfg, args.levels)
    hosts = [h.strip() for h in (args.hosts or "").split(",") if h.strip()]
    written = create_deployment(Path(args.out), levels, hosts, roles=tuple(args.roles.split(",")))
    for f in written:
        print(f)
    _progress(f"CA in {Path(args.out) / 'ca.pem'} (keep ca.key off the hosts); give each host only the "
              f"files of its own level")
    return EXIT_OK


# ---- embedded cluster ------------------------------------------------------------------
def start_cluster(config: str, levels: list[str], workers: int, state_dir: Path, chunk_seconds: float = 1.0,
                  multicast_port: int | None = None, spark_master: str = "local[1]", timeout: float = 180.0,
                  worker_env: dict[int, dict] | None = None, tls: bool = True,
                  load_reading: str | None = "process", owner: str | None = None) -> dict:
    """Start one master and ``workers`` workers per level as background processes.

    ``owner``: a user who gets every role on these masters (``strata master --owner``): the
    embedded runs a user starts for themself (``strata replay`` without ``--master``, the
    demo).  Without it (``strata up``) sessions have the users file's roles.

    ``worker_env``: extra environment per worker index (e.g. an injected CPU reading).
    ``load_reading``: Algorithm 5's CPU reading for the workers (worker/load.py); all of them
    share this host, so by default each reports its own processes' load (``process``), not
    the host's, which would read >= 90 % for all of them whenever the cluster works.  ``None``:
    the configuration's ``[cluster] load_reading``.
    With ``tls`` (the default) every link is mutual TLS with certificates made
    in ``state_dir/tls`` (client certificates too: ``client-<level>.pem``).
    """
    from .config import load_config
    from .groups import group_spec, level_slug

    cfg = load_config(config)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    (state_dir / "run").mkdir(exist_ok=True)
    port = multicast_port or _free_udp_port()
    levels = [cfg.lattice.parse(lv) for lv in levels]
    for lv in levels:
        group_spec(cfg, lv, state_dir, create_key=True)  # make the level's key before any process starts
    if tls:
        from .tls import create_deployment, has_material

        missing = [lv for lv in levels if not all(has_material(state_dir / "tls", r, lv) for r in ("master", "worker", "client"))]
        if missing:
            create_deployment(state_dir / "tls", missing)
    procs = []
    base = [sys.executable, "-m", "strata"]
    for lv in levels:
        slug = level_slug(lv)
        roles = [("master", f"master-{slug}")] + [("worker", f"worker-{slug}-{i}") for i in range(workers)]
        for role, name in roles:
            ready = state_dir / "run" / f"{name}.json"
            ready.unlink(missing_ok=True)
            cmd = base + [role, "--config", str(Path(config).resolve()), "--level", lv, "--listen", "127.0.0.1:0",
                          "--state-dir", str(state_dir.resolve()), "--multicast-port", str(port),
                          "--ready-file", str(ready)]
            if not tls:
                cmd.append("--insecure")
            if role == "master":
                cmd += ["--chunk-seconds", str(chunk_seconds)]
                if owner:
                    cmd += ["--owner", owner]
            else:
                cmd += ["--spark-master", spark_master]
                if load_reading:
                    cmd += ["--load-reading", load_reading]
            log = open(state_dir / "logs" / f"{name}.log", "ab")
            env = None
            if role == "worker" and worker_env and int(name.rsplit("-", 1)[1]) in worker_env:
                env = {**os.environ, **worker_env[int(name.rsplit("-", 1)[1])]}
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
            procs.append({"name": name, "role": role, "level": lv, "pid": p.pid, "ready": str(ready), "cmd": cmd,
                          "env": (env or {}) and {k: v for k, v in env.items() if k.startswith("STRATA_")}})
    record = {"config": str(Path(config).resolve()), "multicast_port": port, "processes": procs,
              "tls_dir": str((state_dir / "tls").resolve()) if tls else None}
    (state_dir / "cluster.json").write_text(json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    pending = {p["name"] for p in procs}
    last = -1
    while pending and time.monotonic() < deadline:
        for p in procs:
            if p["name"] in pending and Path(p["ready"]).exists():
                info = json.loads(Path(p["ready"]).read_text())
                p["address"] = info["address"]
                pending.discard(p["name"])
            elif p["name"] in pending and not _alive(p["pid"]):
                stop_cluster(state_dir)
                log = (state_dir / "logs" / f"{p['name']}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"{p['name']} exited during start-up; log tail:\n{log}")
        if len(pending) != last:
            last = len(pending)
            _progress(f"starting cluster: {len(procs) - len(pending)}/{len(procs)} processes ready")
        time.sleep(0.2)
    if pending:
        stop_cluster(state_dir)
        raise CliError(f"cluster did not start within {timeout:.0f} s: {', '.join(sorted(pending))}")
    (state_dir / "cluster.json").write_text(json.dumps(record, indent=2))
    return {"masters": {p["level"]: p["address"] for p in procs if p["role"] == "master"},
            "tls_dir": record["tls_dir"]}


def restart_process(state_dir: Path, name: str, timeout: float = 120.0) -> dict:
    """Start a stopped process of an embedded cluster again, on the address it had.

    A restarted master reads its state file (queries, sessions, input) and
    resumes; clients reconnect to the same address.
    """
    f = state_dir / "cluster.json"
    record = json.loads(f.read_text())
    p = next((x for x in record["processes"] if x["name"] == name), None)
    if p is None:
        raise CliError(f"no process {name!r} in {f}")
    if _alive(p["pid"]):
        raise CliError(f"{name} (pid {p['pid']}) is still running")
    cmd = list(p["cmd"])
    cmd[cmd.index("--listen") + 1] = p["address"]
    ready = Path(p["ready"])
    ready.unlink(missing_ok=True)
    log = open(state_dir / "logs" / f"{name}.log", "ab")
    env = {**os.environ, **(p.get("env") or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    p["pid"] = proc.pid
    f.write_text(json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not _alive(proc.pid):
            tail = (state_dir / "logs" / f"{name}.log").read_text(errors="replace")[-2000:]
            raise CliError(f"{name} exited during restart; log tail:\n{tail}")
        if time.monotonic() > deadline:
            raise CliError(f"{name} did not restart within {timeout:.0f} s")
        time.sleep(0.1)
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def stop_cluster(state_dir: Path, timeout: float = 15.0) -> int:
    f = state_dir / "cluster.json"
    if not f.exists():
        return 0
    procs = json.loads(f.read_text())["processes"]
    for p in procs:
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p["pid"]) for p in procs):
        time.sleep(0.1)
    for p in procs:
        if _alive(p["pid"]):
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    f.unlink()
    return len(procs)


def cmd_up(args) -> int:
    levels = _levels(_config(args), args.levels)
    out = start_cluster(args.config, levels, args.workers, Path(args.state_dir), args.chunk_seconds,
                        args.multicast_port or None, tls=not args.insecure)
    print(json.dumps(out))
    return EXIT_OK


def cmd_down(args) -> int:
    n = stop_cluster(Path(args.state_dir))
    _progress(f"stopped {n} processes" if n else "nothing running there")
    return EXIT_OK


# ---- client commands ----------------------------------------------------------------------
def _password() -> str:
    pw = os.environ.get("STRATA_PASSWORD")
    if pw is None:
        if sys.stdin is not None and sys.stdin.isatty():
            import getpass

            return getpass.getpass("password: ")
        raise CliError("set STRATA_PASSWORD (or run interactively)", EXIT_LOGIN)
    return pw


def _client_level(args) -> str:
    if not getattr(args, "level", None):
        return ""
    try:
        return _config(args).lattice.parse(args.level)
    except ValueError as e:
        raise CliError(f"--level: {e}", EXIT_REJECTED) from None


def _client_tls(args) -> str | None:
    return getattr(args, "tls_dir", None) or os.environ.get("STRATA_TLS_DIR") or None


def _login(address: str, user: str, level: str = "", tls_dir: str | None = None):
    from .client import Client, ClientError, LoginFailed
    from .tls import TlsError

    try:
        c = Client(address, tls_dir=tls_dir, level=level or None)
    except TlsError as e:
        raise CliError(str(e)) from None
    try:
        c.login(user, _password(), level)
    except LoginFailed as e:
        c.close()
        raise CliError(str(e), EXIT_LOGIN) from None
    except ClientError as e:
        c.close()
        hint = "" if tls_dir else " (a TLS master needs --tls-dir with a client certificate of its level)"
        raise CliError(f"cannot reach master {address}: {e}{hint}") from None
    return c


def _client_call(fn, *a, what: str = "", **kw):
    """Run a client call; a refusal becomes a one-line CliError with its exit code."""
    from .client import ClientError, PermissionDenied, SessionEnded

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


def _query_rows(queries) -> list[dict]:
    return [{"query": q.query_id, "state": q.state, "last_ts": q.last_ts, "text": q.text, "error": q.error}
            | ({"stopped_after": q.stopped_after} if q.state not in ("running", "ended") else {})
            for q in queries]


def cmd_status(args) -> int:
    c = _login(args.master, args.user, _client_level(args), _client_tls(args))
    try:
        st = _client_call(c.status)
    finally:
        c.close()
    out = {"level": st.level, "user": st.user, "roles": list(st.roles), "queries": _query_rows(st.queries)}
    if st.cluster:  # operators: the cluster part
        out.update({
            "workers": [{"sid": w.sid, "cpu": round(w.cpu, 1), "pid": w.pid, "state": w.state,
                         "chunks_done": w.chunks_done, "in_flight": w.in_flight} for w in st.workers],
            "backlog": st.backlog_chunks,
            "ready": st.ready_chunks,
            "lag": st.lag_seconds,
            "rejected": dict(st.rejected),
            "counters": dict(st.counters),
            "timings": dict(st.timings),
            "last_chunk_error": st.last_chunk_error,
        })
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
        t = out["timings"]
        if t:
            print(f"  last {int(t['chunks'])} chunks, ms p50/p99: " + ", ".join(
                f"{part} {t[f'{part}_p50_ms']:g}/{t[f'{part}_p99_ms']:g}" for part in ("wait", "rtt", "engine", "transport")))
    return EXIT_OK


def _register(c, queries: list[str]):
    from .client import QueryRejected

    def register():
        try:
            return c.register(queries)
        except QueryRejected as e:  # before the general mapping: a rejected query exits 2
            raise CliError(str(e).replace("\n", " "), EXIT_REJECTED) from None

    regs = _client_call(register)
    for r in regs:
        _progress(f"{r.query_id}: {r.rewritten}")
    return regs


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


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
    missing = [f"--{n}" for n in ("config", "master", "user") if not getattr(args, n, None)]
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
    c = _login(args.master, args.user, _client_level(args), _client_tls(args))
    if args.action is not None:
        try:
            if args.action == "list":
                rows = _query_rows(_client_call(c.status).queries)
            else:
                rows = _query_rows(_client_call(c.cancel, list(args.ids)))
                for r in rows:
                    last = r.get("stopped_after", r["last_ts"])
                    _progress(f"{r['query']} {r['state']}" + (f": no instant after {last} is computed"
                                                              if r["state"] == "cancelled" else ""))
        finally:
            c.close()
        _print_queries(rows, args.format)
        return EXIT_OK
    return _follow_queries(c, args)


def _follow_queries(c, args) -> int:
    from .client import ClientError

    regs = _register(c, args.query)
    names = {r.query_id: list(r.columns) for r in regs}
    writer = csv.writer(sys.stdout) if args.format == "csv" else None
    if writer:
        for r in regs:
            writer.writerow(["query", "ts", "level", *r.columns])
    def reconnecting(attempt):
        if attempt == 1:
            _progress(f"lost the master; reconnecting for up to {args.reconnect_seconds:.0f} s and resuming "
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
                    _progress(f"{qid} {state}")
                continue
            for row in table.to_pylist():
                if writer:
                    writer.writerow([qid, row["ts"], row["level"], *[_fmt(row[n]) for n in names[qid]]])
                else:
                    print(json.dumps({"query": qid, **row}, default=str))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    except ClientError as e:
        _client_call(_raise, e, what="result stream failed: ")
    finally:
        c.close()
    return EXIT_FAILED if failed else EXIT_OK


def _raise(e):
    raise e


def read_input(cfg, stream: str, path: str):
    """A replay/ingest file: CSV with header ts,level,<attributes> (or JSON lines)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson

    from strata.arrowio import ARROW_TYPES

    schema = cfg.stream(stream)
    if schema is None:
        raise CliError(f"unknown stream {stream!r} (streams: {', '.join(cfg.streams)})", EXIT_REJECTED)
    types = {"ts": pa.int64(), "level": pa.string()}
    types.update({c: ARROW_TYPES[t] for c, t in schema.columns})
    try:
        if path.endswith((".jsonl", ".json")):
            table = pjson.read_json(path, parse_options=pjson.ParseOptions(explicit_schema=pa.schema(types)))
        else:
            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                                                             quoted_strings_can_be_null=False))
    except (OSError, pa.ArrowInvalid) as e:
        raise CliError(f"{path}: {str(e).splitlines()[0]}") from None
    return schema.name, table


def _parse_inputs(cfg, specs: list[str]):
    out = []
    for spec in specs:
        if "=" not in spec:
            raise CliError(f"--input must be STREAM=FILE, got {spec!r}", EXIT_REJECTED)
        s, f = spec.split("=", 1)
        out.append(read_input(cfg, s, f))
    return out


def _batches(inputs, rows: int = 65536):
    for stream, table in inputs:
        for off in range(0, table.num_rows, rows):
            yield stream, table.slice(off, rows)


def cmd_ingest(args) -> int:
    cfg = _config(args)
    inputs = _parse_inputs(cfg, args.input)
    c = _login(args.master, args.user, _client_level(args), _client_tls(args))
    total = sum(t.num_rows for _, t in inputs)
    sent = 0
    t0 = time.monotonic()

    def paced():
        nonlocal sent
        for stream, t in _batches(inputs, rows=max(1, min(65536, int(args.rate) if args.rate else 65536))):
            if args.rate:
                wait = t0 + sent / args.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            sent += t.num_rows
            yield stream, t

    try:
        reply = _client_call(c.ingest, paced(), labelled=args.labelled, what="ingest stopped: ")
        if args.finish and not reply.error:
            _client_call(c.advance, finish=True)
    finally:
        c.close()
    _progress(f"sent {sent}/{total} tuples: accepted {reply.accepted}, dropped by shepherd "
              f"{reply.dropped_by_shepherd}, rejected batches {reply.rejected}")
    if reply.error:
        raise CliError(f"ingest stopped: {reply.error}", EXIT_REJECTED)
    return EXIT_OK


def cmd_advance(args) -> int:
    """Close instants up to ``--upto`` (producer) or finish the input (producer or operator)."""
    if (args.upto is None) == (not args.finish):
        raise CliError("give exactly one of --upto N or --finish", EXIT_REJECTED)
    c = _login(args.master, args.user, _client_level(args), _client_tls(args))
    try:
        n = _client_call(c.advance, upto_ts=args.upto or 0, finish=args.finish)
    finally:
        c.close()
    _progress(("finished the input" if args.finish else f"closed the instants up to {args.upto}") +
              f": {n} chunks cut")
    return EXIT_OK


def replay(config_path: str, user: str, level: str | None, queries: list[str], inputs: list[str], output: str,
           workers: int = 2, chunk_seconds: float = 1.0, master: str | None = None, tls_dir: str | None = None) -> int:
    from .config import load_config

    cfg = load_config(config_path)
    data = _parse_inputs(cfg, inputs)
    if level:
        try:
            level = cfg.lattice.parse(level)
        except ValueError as e:
            raise CliError(f"--level: {e}", EXIT_REJECTED) from None
    tmp = None
    if master is None:
        if level is None:
            from .users import UserStore

            u = UserStore(cfg.users_path, cfg.lattice).load().get(user)
            if u is None or getattr(u, "clearance", None) is None:
                raise CliError("login failed: unknown user or wrong password", EXIT_LOGIN)
            level = u.clearance
        tmp = Path(tempfile.mkdtemp(prefix="strata-replay-"))
        _progress(f"starting an embedded cluster at level {level} with {workers} workers "
                  f"(user {user} has every role on it)")
        started = start_cluster(config_path, [level], workers, tmp, chunk_seconds, owner=user)
        master, tls_dir = started["masters"][cfg.lattice.parse(level)], started["tls_dir"]
    try:
        c = _login(master, user, level or "", tls_dir)
        regs = _register(c, queries)
        results: dict[str, list] = {r.query_id: [] for r in regs}
        error: list[BaseException] = []

        def collect():
            try:
                for qid, table in c.subscribe([r.query_id for r in regs]):
                    if table is not None:
                        results[qid].append(table)
            except BaseException as e:  # pragma: no cover - surfaced below
                error.append(e)

        th = threading.Thread(target=collect, daemon=True)
        th.start()
        total = sum(t.num_rows for _, t in data)
        _progress(f"replaying {total} tuples")
        reply = _client_call(c.ingest, _batches(data), labelled=True, what="input rejected: ")
        if reply.error:
            raise CliError(f"input rejected: {reply.error}", EXIT_REJECTED)
        _client_call(c.advance, finish=True)
        t0 = time.monotonic()
        while th.is_alive():
            th.join(timeout=5)
            if th.is_alive():
                st = _client_call(c.status)
                done = ", ".join(f"{q.query_id} {'-' if q.last_ts < 0 else q.last_ts}" for q in st.queries
                                 if q.query_id in results)
                _progress(f"waiting for results ({time.monotonic() - t0:.0f} s); last instant per query: {done}")
        if error:
            raise CliError(f"result stream failed: {error[0]}")
        _write_outputs(output, regs, results)
        c.close()
        _progress(f"accepted {reply.accepted} tuples ({reply.dropped_by_shepherd} above level {c.level} dropped); "
                  f"wrote {output}")
        failed = {q: e for q, (state, e) in c.ended.items() if state == "failed"}
        for q, e in failed.items():
            print(f"strata: query {q} failed: {e}", file=sys.stderr, flush=True)
    finally:
        if tmp is not None:
            stop_cluster(tmp)
    return EXIT_FAILED if failed else EXIT_OK


def _write_outputs(output: str, regs, results) -> None:
    out = Path(output)
    targets = [(out, regs[0])] if len(regs) == 1 else [(out / f"q{i + 1}.csv", r) for i, r in enumerate(regs)]
    if len(regs) > 1:
        out.mkdir(parents=True, exist_ok=True)
    for path, r in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["ts", "level", *r.columns])
            for t in results[r.query_id]:
                cols = [t.column(i).to_pylist() for i in range(t.num_columns)]
                for row in zip(*cols):
                    w.writerow([_fmt(v) for v in row])


def cmd_replay(args) -> int:
    if args.master is None and args.workers < 1:
        raise CliError("--workers must be at least 1", EXIT_REJECTED)
    return replay(args.config, args.user, args.level, args.query, args.input, args.output, args.workers,
                  args.chunk_seconds, args.master, _client_tls(args))


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(Path(args.dir), workers=args.workers)


# ---- registration ------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    def common(p, level=True):
        p.add_argument("--config", required=True)
        if level:
            p.add_argument("--level", required=True)
        p.add_argument("--state-dir", help="where keys, logs and state live")
        p.add_argument("--multicast-port", type=int, help="override the group's multicast port")
        p.add_argument("--ready-file", help=argparse_suppress())
        if level:
            p.add_argument("--tls-dir", help="certificates from `strata certs` (default: STATE_DIR/tls)")
            p.add_argument("--insecure", action="store_true", help="no TLS (development only)")

    w = sub.add_parser("worker", help="run a worker of one level (gRPC + Spark + group heartbeats)")
    common(w)
    w.add_argument("--listen", default="127.0.0.1:0")
    w.add_argument("--spark-master", default=os.environ.get("STRATA_SPARK_MASTER", "local[1]"))
    w.add_argument("--load-reading", choices=["host", "process"], default=None,
                   help="the CPU reading Algorithm 5 compares with 90 %%: the host's CPUs (default, "
                        "[cluster] load_reading) or this worker's own processes (workers sharing a host)")
    w.set_defaults(func=cmd_worker)

    m = sub.add_parser("master", help="run the master of one level")
    common(m)
    m.add_argument("--listen", default="127.0.0.1:0")
    m.add_argument("--chunk-seconds", type=float, default=1.0)
    m.add_argument("--no-persist", action="store_true",
                   help="keep queries, sessions and input in memory only (a restart loses them)")
    m.add_argument("--owner", metavar="USER",
                   help="a user who has every role on this master (a private master of one user's embedded "
                        "run; others have the users file's roles)")
    m.set_defaults(func=cmd_master)

    up = sub.add_parser("up", help="start an embedded local cluster in the background")
    up.add_argument("--config", required=True)
    up.add_argument("--levels", required=True, help="comma-separated levels, one group each")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--state-dir", required=True)
    up.add_argument("--chunk-seconds", type=float, default=1.0)
    up.add_argument("--multicast-port", type=int, default=0)
    up.add_argument("--insecure", action="store_true", help="no TLS (development only)")
    up.set_defaults(func=cmd_up)

    ce = sub.add_parser("certs", help="create a CA and per-level certificates for masters, workers and clients")
    ce.add_argument("--config", required=True)
    ce.add_argument("--levels", required=True, help="comma-separated levels")
    ce.add_argument("--out", required=True, help="directory for ca.pem/ca.key and <role>-<level>.pem/.key")
    ce.add_argument("--hosts", help="extra DNS names/IP addresses for the certificates")
    ce.add_argument("--roles", default="master,worker,client")
    ce.set_defaults(func=cmd_certs)

    down = sub.add_parser("down", help="stop what `strata up` started in a state dir")
    down.add_argument("--state-dir", required=True)
    down.set_defaults(func=cmd_down)

    def client(p, required: bool = True, keep_parent: bool = False):
        """The client options.  ``keep_parent``: a sub-action's copy (``query cancel``) that leaves
        what was given before the action word alone (argparse copies a subparser's defaults over)."""
        kw = {"default": argparse_suppress()} if keep_parent else {}
        p.add_argument("--config", required=required, **kw)
        p.add_argument("--master", required=required, help="the master's host:port", **kw)
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
        sp.add_argument("--format", choices=["csv", "json"], default=argparse_suppress())

    ing = sub.add_parser("ingest", help="send a CSV/JSONL file of tuples to a master")
    client(ing)
    ing.add_argument("--input", action="append", required=True, help="STREAM=FILE")
    ing.add_argument("--rate", type=float, default=0, help="tuples per second (0: as fast as possible)")
    ing.add_argument("--labelled", action="store_true", help="rows carry their own level column")
    ing.add_argument("--finish", action="store_true", help="close all instants after sending")
    ing.set_defaults(func=cmd_ingest)

    adv = sub.add_parser("advance", help="close instants up to a timestamp (producer) or finish the input "
                                         "(producer or operator)")
    client(adv)
    adv.add_argument("--upto", type=int, help="close every instant up to this one (at most [limits] "
                                              "advance_horizon past the latest ingested)")
    adv.add_argument("--finish", action="store_true", help="close every instant holding a tuple; no more input")
    adv.set_defaults(func=cmd_advance)

    r = sub.add_parser("replay", help="replay files through a cluster and write every result")
    r.add_argument("--config", required=True)
    r.add_argument("--user", required=True)
    r.add_argument("--level")
    r.add_argument("--query", action="append", required=True)
    r.add_argument("--input", action="append", required=True, help="STREAM=FILE.csv")
    r.add_argument("--output", required=True)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--chunk-seconds", type=float, default=1.0)
    r.add_argument("--master")
    r.add_argument("--tls-dir", help="client certificate for --master (default: $STRATA_TLS_DIR)")
    r.set_defaults(func=cmd_replay)

    d = sub.add_parser("demo", help="the main job: battlefield replay on an embedded cluster")
    d.add_argument("--dir", default="out/demo")
    d.add_argument("--workers", type=int, default=2)
    d.set_defaults(func=cmd_demo)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
