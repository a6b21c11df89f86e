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


def default_workers() -> int:
    """Workers of an embedded cluster by default: one per core this process may use (each worker
    is one Spark JVM on one core, ``local[1]``), at most 2 (the documented default)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


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
    if args.start_after:  # a staggered start: let the previous worker's JVM start alone first
        deadline = time.monotonic() + 120
        while not Path(args.start_after).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
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
def embedded_load_reading(cfg) -> str:
    """Algorithm 5's reading for an embedded cluster (all workers on this host): the
    configuration's ``[cluster] load_reading`` if it names one, else ``process`` (each worker's
    own processes; the host reading is the same for all of them and reads >= 90 % whenever the
    cluster works).  With credits (master/dispatch.py) either reading only keeps chunks away
    from a worker that is loaded while it has none of this master's chunks."""
    return ((cfg.sections.get("cluster") or {}).get("load_reading")) or "process"


def start_cluster(config: str, levels: list[str], workers: int, state_dir: Path, chunk_seconds: float = 1.0,
                  multicast_port: int | None = None, spark_master: str = "local[1]", timeout: float = 180.0,
                  worker_env: dict[int, dict] | None = None, tls: bool = True,
                  load_reading: str | None = None, owner: str | None = None, tls_dir: Path | None = None,
                  wait: str = "all", stagger: bool = False, persist: bool = True) -> dict:
    """Start one master and ``workers`` workers per level as background processes.

    ``owner``: a user who gets every role on these masters (``strata master --owner``): the
    embedded runs a user starts for themself (``strata replay`` without ``--master``, the
    demo).  Without it (``strata up``) sessions have the users file's roles.

    ``worker_env``: extra environment per worker index (e.g. an injected CPU reading).
    ``load_reading``: Algorithm 5's CPU reading for the workers (worker/load.py); ``None``: the
    configuration's ``[cluster] load_reading``, else ``process`` (:func:`embedded_load_reading`).
    With ``tls`` (the default) every link is mutual TLS with certificates from ``tls_dir``
    (default ``state_dir/tls``; made there if missing, client certificates too:
    ``client-<level>.pem``).
    ``persist``: masters keep their queries, sessions and input in ``state_dir`` (a restart resumes);
    a run that stops its cluster when done (``strata replay``) does without.
    ``wait``: ``all`` returns when every process is ready; ``first`` when each level's master
    and one worker are (the others join their group when ready; the master dispatches to
    whoever is there).  ``stagger``: start a level's next worker only when the previous one is
    ready (two JVMs starting at once on few cores slow each other down).
    The returned dict has ``seconds``: {``first``: first worker ready, ``all``: every process
    ready (or None if not waited for)}.
    """
    from .config import load_config
    from .groups import group_spec, level_slug

    t_start = time.monotonic()
    cfg = load_config(config)
    if load_reading is None:
        load_reading = embedded_load_reading(cfg)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # keys, logs, the event logs: this user only
    (state_dir / "logs").mkdir(exist_ok=True, mode=0o700)
    (state_dir / "run").mkdir(exist_ok=True, mode=0o700)
    port = multicast_port or _free_udp_port()
    levels = [cfg.lattice.parse(lv) for lv in levels]
    for lv in levels:
        group_spec(cfg, lv, state_dir, create_key=True)  # make the level's key before any process starts
    tls_path = Path(tls_dir) if tls_dir is not None else state_dir / "tls"
    if tls:
        from .tls import create_deployment, has_material

        missing = [lv for lv in levels if not all(has_material(tls_path, r, lv) for r in ("master", "worker", "client"))]
        if missing:
            create_deployment(tls_path, missing)
    procs = []
    base = [sys.executable, "-m", "strata"]
    for lv in levels:
        slug = level_slug(lv)
        roles = [("master", f"master-{slug}")] + [("worker", f"worker-{slug}-{i}") for i in range(workers)]
        previous = None  # the level's previous worker's ready file (stagger)
        for role, name in roles:
            ready = state_dir / "run" / f"{name}.json"
            ready.unlink(missing_ok=True)
            cmd = base + [role, "--config", str(Path(config).resolve()), "--level", lv, "--listen", "127.0.0.1:0",
                          "--state-dir", str(state_dir.resolve()), "--multicast-port", str(port),
                          "--ready-file", str(ready)]
            if not tls:
                cmd.append("--insecure")
            elif tls_dir is not None:
                cmd += ["--tls-dir", str(tls_path.resolve())]
            if role == "master":
                cmd += ["--chunk-seconds", str(chunk_seconds)]
                if not persist:
                    cmd.append("--no-persist")
                if owner:
                    cmd += ["--owner", owner]
            else:
                cmd += ["--spark-master", spark_master]
                if load_reading:
                    cmd += ["--load-reading", load_reading]
                if stagger and previous is not None:
                    cmd += ["--start-after", str(previous)]
                previous = ready
            log = open(state_dir / "logs" / f"{name}.log", "ab")
            env = None
            if role == "worker" and worker_env and int(name.rsplit("-", 1)[1]) in worker_env:
                env = {**os.environ, **worker_env[int(name.rsplit("-", 1)[1])]}
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
            procs.append({"name": name, "role": role, "level": lv, "pid": p.pid, "ready": str(ready), "cmd": cmd,
                          "env": (env or {}) and {k: v for k, v in env.items() if k.startswith("STRATA_")}})
    record = {"config": str(Path(config).resolve()), "multicast_port": port, "processes": procs,
              "tls_dir": str(tls_path.resolve()) if tls else None}
    (state_dir / "cluster.json").write_text(json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    pending = {p["name"] for p in procs}
    last = -1
    first = None

    def enough() -> bool:
        if not pending:
            return True
        if wait != "first":
            return False
        return all(any(p["level"] == lv and p["role"] == "worker" and p["name"] not in pending for p in procs)
                   and not any(p["level"] == lv and p["role"] == "master" and p["name"] in pending for p in procs)
                   for lv in levels)

    while not enough() and time.monotonic() < deadline:
        for p in procs:
            if p["name"] in pending and Path(p["ready"]).exists():
                info = json.loads(Path(p["ready"]).read_text())
                p["address"] = info["address"]
                pending.discard(p["name"])
                if p["role"] == "worker" and first is None:
                    first = time.monotonic() - t_start
            elif p["name"] in pending and not _alive(p["pid"]):
                stop_cluster(state_dir)
                log = (state_dir / "logs" / f"{p['name']}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"{p['name']} exited during start-up; log tail:\n{log}")
        if len(pending) != last:
            last = len(pending)
            _progress(f"starting cluster: {len(procs) - len(pending)}/{len(procs)} processes ready")
        if not enough():
            time.sleep(0.05)
    if not enough():
        stop_cluster(state_dir)
        raise CliError(f"cluster did not start within {timeout:.0f} s: {', '.join(sorted(pending))}")
    (state_dir / "cluster.json").write_text(json.dumps(record, indent=2))
    return {"masters": {p["level"]: p["address"] for p in procs if p["role"] == "master"},
            "tls_dir": record["tls_dir"],
            "seconds": {"first": None if first is None else round(first, 2),
                        "all": None if pending else round(time.monotonic() - t_start, 2)}}


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
    if "--start-after" in cmd:  # a staggered start's order does not apply to a restart
        i = cmd.index("--start-after")
        del cmd[i:i + 2]
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


def renew_master(state_dir: Path, level: str, timeout: float = 60.0) -> tuple[str, str | None, str]:
    """Give a running embedded cluster's ``level`` a fresh master (a new input timeline, no
    queries) on the same address, keeping its workers and their warm Spark sessions; returns
    (address, tls_dir, config path).  What ``strata replay --cluster`` does before each run."""
    from .groups import level_slug

    f = state_dir / "cluster.json"
    if not f.exists():
        raise CliError(f"no running cluster in {state_dir} (start one with `strata up`)")
    record = json.loads(f.read_text())
    p = next((x for x in record["processes"] if x["role"] == "master" and x["level"] == level), None)
    if p is None:
        raise CliError(f"the cluster in {state_dir} has no master of level {level}")
    if _alive(p["pid"]):
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 15
        while _alive(p["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(p["pid"]):
            os.killpg(p["pid"], signal.SIGKILL)
    for old in state_dir.glob(f"master-{level_slug(level)}.sqlite*"):  # its timeline, queries and sessions
        old.unlink(missing_ok=True)
    p = restart_process(state_dir, p["name"], timeout=timeout)
    return p["address"], record.get("tls_dir"), record["config"]


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
    """A replay/ingest file: CSV with header ts,level,<attributes> (or JSON lines).

    What is NULL is explicit (docs/operations.md, *Input files*): in CSV only an empty
    field of a double, long, timestamp or boolean column is NULL; a string or level
    column has no NULL (an empty field is the empty string).  ``NA``, ``NULL``, ``null``,
    ``N/A``, ``nan`` … are not NULL: in a numeric or boolean column they are refused like
    any other word.  A double must be finite: ``nan``/``NaN`` and ``inf`` are refused (in
    JSON lines too, where ``null`` is NULL).  A refusal is one line naming the file, the
    line and the column.  Reading stays Arrow's multi-threaded reader; the checks are
    vectorized.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson

    from strata.arrowio import ARROW_TYPES

    schema = cfg.stream(stream)
    if schema is None:
        raise CliError(f"unknown stream {stream!r} (streams: {', '.join(cfg.streams)})", EXIT_REJECTED)
    types = {"ts": pa.int64(), "level": pa.string()}
    types.update({c: ARROW_TYPES[t] for c, t in schema.columns})
    declared = {"ts": "long", "level": "level", **dict(schema.columns)}
    is_json = path.endswith((".jsonl", ".json"))
    first_line = 1 if is_json else 2  # the line of row 0 (one row per line; CSV: after the header)

    def refuse(row, column, message):
        where = f"line {row + first_line}, " if row is not None else ""
        raise CliError(f"{path}: {where}column {column}: {message}", EXIT_REJECTED)

    def header():
        import csv as _csv

        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            return next(_csv.reader(f), [])

    def conversion_error(e):
        """Arrow names the column by number and the bad value, not the row: find its first row."""
        import re

        m = re.search(r"In CSV column #(\d+): CSV conversion error to (\w+): invalid value '(.*)'", str(e))
        if not m:
            return
        names = header()
        idx, value = int(m.group(1)), m.group(3)
        if idx >= len(names):
            return
        name = names[idx]
        col = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
            include_columns=[name], column_types={name: pa.string()}, strings_can_be_null=False,
            quoted_strings_can_be_null=False)).column(0)
        row = pc.index(col, value).as_py()
        kind = declared.get(name, str(types.get(name, m.group(2))))
        refuse(row if row is not None and row >= 0 else None, name,
               f"{value!r} is not a {kind} value (only an empty field is NULL)")

    try:
        if is_json:
            table = pjson.read_json(path, parse_options=pjson.ParseOptions(explicit_schema=pa.schema(types)))
        else:
            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
                column_types=types, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False))
    except OSError as e:
        raise CliError(f"{path}: {str(e).splitlines()[0]}") from None
    except pa.ArrowInvalid as e:
        if not is_json:
            conversion_error(e)
        raise CliError(f"{path}: {str(e).splitlines()[0]}", EXIT_REJECTED) from None
    for name in table.column_names:  # a double must be finite: nan and ±inf are refused, never NULL
        col = table.column(name)
        if pa.types.is_floating(col.type) and col.null_count < len(col) and not pc.all(pc.is_finite(col)).as_py():
            row = pc.index(pc.is_finite(col), False).as_py()
            refuse(row, name, f"{col[row].as_py()!r} is not a finite number (nan and inf are refused; "
                              "an empty field is NULL)")
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


def _instant_batches(cfg, inputs, level: str | None, rows: int = 65536):
    """The input in instant order across streams, in batches of about ``rows`` tuples, each group of
    complete instants followed by an advance closing them: ``(stream, table, upto or None)``.

    So the master cuts chunks and the workers compute while the rest is still being sent.  An
    advance never goes beyond ``[limits] advance_horizon`` past the latest instant the master
    keeps (rows ``level`` dominates; ``None``: every row is the session's own level).  Input whose
    ``ts`` decreases is sent as it is, without advances (the master names the offending row)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    inputs = [(s, t) for s, t in inputs if t.num_rows]
    if not inputs:
        return
    ts = {i: t.column("ts").to_numpy() for i, (_, t) in enumerate(inputs)}
    if any(len(x) > 1 and bool((np.diff(x) < 0).any()) for x in ts.values()):
        for stream, table in _batches(inputs, rows):
            yield stream, table, None
        return
    horizon = int(getattr(getattr(cfg, "limits", None), "advance_horizon", 3600))
    kept_max = {}  # per stream, per row: the largest ts of a kept row up to it (-1: none yet)
    for i, (_, t) in enumerate(inputs):
        if level is None or "level" not in t.column_names:
            kept_max[i] = ts[i]
            continue
        col = t.column("level")
        seen = [x for x in pc.unique(col).to_pylist() if x is not None]
        keep = []
        for x in seen:
            try:
                if cfg.lattice.leq(cfg.lattice.parse(x), level):
                    keep.append(x)
            except ValueError:
                pass
        mask = pc.is_in(col, value_set=pa.array(keep, pa.string())).to_numpy(zero_copy_only=False)
        kept_max[i] = np.maximum.accumulate(np.where(mask, ts[i], -1))
    instants = np.unique(np.concatenate(list(ts.values())))
    starts = {i: np.searchsorted(x, instants, side="left") for i, x in ts.items()}
    ends = {i: np.searchsorted(x, instants, side="right") for i, x in ts.items()}
    sizes = sum(ends[i] - starts[i] for i in ts)
    advanced = None
    g = 0
    while g < len(instants):
        h, n = g, int(sizes[g])
        while h + 1 < len(instants) and n + int(sizes[h + 1]) <= rows:
            h += 1
            n += int(sizes[h])
        pieces = []
        for i, (stream, t) in enumerate(inputs):
            a, b = int(starts[i][g]), int(ends[i][h])
            for off in range(a, b, rows):
                pieces.append((stream, t.slice(off, min(rows, b - off))))
        upto = None
        if h + 1 < len(instants):  # the last group: the caller finishes the input
            top = max(int(kept_max[i][int(ends[i][h]) - 1]) if ends[i][h] > 0 else -1 for i in ts)
            upto = min(int(instants[h]), max(top, 0) + horizon)
            if advanced is not None and upto <= advanced:
                upto = None
        for k, (stream, piece) in enumerate(pieces):
            yield stream, piece, upto if k == len(pieces) - 1 else None
        if upto is not None:
            advanced = upto
        g = h + 1


def cmd_ingest(args) -> int:
    cfg = _config(args)
    inputs = _parse_inputs(cfg, args.input)
    c = _login(args.master, args.user, _client_level(args), _client_tls(args))
    total = sum(t.num_rows for _, t in inputs)
    sent = 0
    t0 = time.monotonic()

    rows = max(1, min(65536, int(args.rate) if args.rate else 65536))
    if args.finish:  # the file is all there is: close instants as they complete, so results flow meanwhile
        batches = _instant_batches(cfg, inputs, c.level if args.labelled else None, rows=rows)
    else:  # more may follow (from this or other producers): nothing is closed here
        batches = ((s, t, None) for s, t in _batches(inputs, rows=rows))

    def paced():
        nonlocal sent
        for stream, t, upto in batches:
            if args.rate and t is not None:
                wait = t0 + sent / args.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            sent += 0 if t is None else t.num_rows
            yield stream, t, upto

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


def _tls_cache() -> Path | None:
    """Where ``strata replay`` keeps the certificates of its private embedded clusters between runs
    (``$XDG_CACHE_HOME/strata/embedded-tls``, else ``~/.cache/...``), or None if that directory
    cannot be made private to this user (then every run makes its own).  Reusing them is safe:
    they are only ever presented on loopback between this user's own processes, and only this
    user can read them (mode 0700, owned by them); ``STRATA_NO_TLS_CACHE=1`` turns it off."""
    if os.environ.get("STRATA_NO_TLS_CACHE"):
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata" / "embedded-tls"
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = base.stat()
        if st.st_uid != os.getuid():
            return None
        if st.st_mode & 0o077:
            base.chmod(0o700)
        return base
    except OSError:
        return None


def replay(config_path: str, user: str, level: str | None, queries: list[str], inputs: list[str], output: str,
           workers: int = 2, chunk_seconds: float = 1.0, master: str | None = None, tls_dir: str | None = None,
           timings: dict | None = None, cluster: str | None = None) -> int:
    """Replay files through a cluster and write every result (``strata replay``).

    Without ``master``: an embedded cluster of the login level is started for this run and
    stopped after it.  The input is sent in instant order with the instants closed as they
    complete, so workers compute while the rest is still being sent.  ``timings`` (optional)
    receives where the time went: ``start`` (cluster start-up, with ``first``/``all`` worker
    ready), ``read``, ``process`` (first tuple sent → last result), ``write``."""
    from .config import load_config

    t0 = time.monotonic()
    cfg = load_config(config_path)
    data = _parse_inputs(cfg, inputs)
    t_read = time.monotonic() - t0
    if level:
        try:
            level = cfg.lattice.parse(level)
        except ValueError as e:
            raise CliError(f"--level: {e}", EXIT_REJECTED) from None
    tmp = None
    ok = False
    out_t = timings if timings is not None else {}
    out_t["read"] = round(t_read, 3)
    if cluster is not None:  # a cluster of `strata up`: a fresh master, the warm workers
        if level is None:
            raise CliError("--cluster needs --level (the level group to replay into)", EXIT_REJECTED)
        t1 = time.monotonic()
        master, tls_dir, _ = renew_master(Path(cluster), level)
        out_t["start"] = round(time.monotonic() - t1, 3)
        _progress(f"fresh master of level {level} at {master} (the workers of {cluster} stay)")
    elif master is None:
        if level is None:
            from .users import UserStore

            u = UserStore(cfg.users_path, cfg.lattice).load().get(user)
            if u is None or getattr(u, "clearance", None) is None:
                raise CliError("login failed: unknown user or wrong password", EXIT_LOGIN)
            level = u.clearance
        tmp = Path(tempfile.mkdtemp(prefix="strata-replay-"))
        _progress(f"starting an embedded cluster at level {level} with {workers} workers "
                  f"(user {user} has every role on it)")
        t1 = time.monotonic()
        started = start_cluster(config_path, [level], workers, tmp, chunk_seconds, owner=user,
                                tls_dir=_tls_cache(), persist=False, **EMBEDDED_START)
        out_t["start"] = round(time.monotonic() - t1, 3)
        out_t["start_split"] = started.get("seconds")
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
        t2 = time.monotonic()
        reply = _client_call(c.ingest, _instant_batches(cfg, data, c.level), labelled=True, what="input rejected: ")
        if reply.error:
            raise CliError(f"input rejected: {reply.error}", EXIT_REJECTED)
        _client_call(c.advance, finish=True)
        out_t["sent"] = round(time.monotonic() - t2, 3)
        while th.is_alive():
            th.join(timeout=5)
            if th.is_alive():
                st = _client_call(c.status)
                done = ", ".join(f"{q.query_id} {'-' if q.last_ts < 0 else q.last_ts}" for q in st.queries
                                 if q.query_id in results)
                _progress(f"waiting for results ({time.monotonic() - t2:.0f} s); last instant per query: {done}")
        out_t["process"] = round(time.monotonic() - t2, 3)
        if timings is not None:  # where the chunks' time went (operators' status)
            try:
                st = c.status()
                out_t["chunks"] = {k: float(v) for k, v in st.timings.items()}
                out_t["counters"] = {k: int(v) for k, v in st.counters.items()}
            except Exception:  # noqa: BLE001 - diagnostics only
                pass
        if error:
            raise CliError(f"result stream failed: {error[0]}")
        t3 = time.monotonic()
        _write_outputs(output, regs, results)
        out_t["write"] = round(time.monotonic() - t3, 3)
        c.close()
        _progress(f"accepted {reply.accepted} tuples ({reply.dropped_by_shepherd} above level {c.level} dropped); "
                  f"wrote {output}")
        failed = {q: e for q, (state, e) in c.ended.items() if state == "failed"}
        for q, e in failed.items():
            print(f"strata: query {q} failed: {e}", file=sys.stderr, flush=True)
        ok = True
    finally:
        if tmp is not None:
            stop_cluster(tmp)
            if ok:  # after a failure the logs stay (the error names the directory's processes)
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    return EXIT_FAILED if failed else EXIT_OK


#: how `strata replay` (and the demo) start their embedded cluster (measured: docs/benchmarks/README.md)
EMBEDDED_START = {"wait": "all", "stagger": False}


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
    if args.master and args.cluster:
        raise CliError("give --master or --cluster, not both", EXIT_REJECTED)
    timings = {} if args.timings else None
    try:
        return replay(args.config, args.user, args.level, args.query, args.input, args.output, args.workers,
                      args.chunk_seconds, args.master, _client_tls(args), timings=timings, cluster=args.cluster)
    finally:
        if args.timings:
            Path(args.timings).write_text(json.dumps(timings))


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
    w.add_argument("--start-after", help=argparse_suppress())
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
    up.add_argument("--workers", type=int, default=default_workers(),
                    help="workers per level (default: one per core, at most 2)")
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
    r.add_argument("--workers", type=int, default=default_workers(),
                   help="workers of the embedded cluster (default: one per core, at most 2)")
    r.add_argument("--chunk-seconds", type=float, default=1.0)
    r.add_argument("--master", help="replay into this running master (its input is finished afterwards)")
    r.add_argument("--cluster", metavar="STATE_DIR",
                   help="replay into the running `strata up` cluster of STATE_DIR: a fresh master of --level, its "
                        "workers already warm (the fast path for repeated runs; the user needs the analyst and "
                        "producer roles there)")
    r.add_argument("--tls-dir", help="client certificate for --master (default: $STRATA_TLS_DIR)")
    r.add_argument("--timings", metavar="FILE", help="write where the time went (JSON; for benchmarks)")
    r.set_defaults(func=cmd_replay)

    d = sub.add_parser("demo", help="the main job: battlefield replay on an embedded cluster")
    d.add_argument("--dir", default="out/demo")
    d.add_argument("--workers", type=int, default=default_workers())
    d.set_defaults(func=cmd_demo)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
