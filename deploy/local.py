"""The embedded local cluster (like dask's ``LocalCluster``): one master and N workers per level as
background processes on this host, their ready files, restarts and shutdown; ``strata up`` and
``strata down``.  It starts the roles as *processes* (``python -m strata master|worker``) and
imports neither."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from strata.commands import parse_levels
from strata.cli_support import add_chunk_seconds, chunk_instants_of, config_of
from strata.config import ConfigError, chunk_instants, load_config
from strata.errors import EXIT_OK, EXIT_REJECTED, CliError
from strata.groups import group_spec, level_slug
from strata.private import open_private_log, private_dir, write_private
from strata.serving import free_udp_port, pid_alive, progress
from strata.tls import SCRAPER, create_deployment, has_material, issue_scraper
from strata.trusted import MODES, top_of

from .slots import check_round, release, start_gate

__all__ = ["start_cluster", "cluster_groups", "embedded_start", "stop_cluster", "restart_process", "renew_master",
           "workers_ready_after", "alive", "default_workers", "embedded_load_reading", "add_parsers"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers() -> int:
    """Workers of an embedded cluster by default: one per core this process may use (each worker
    is one Spark JVM on one core, ``local[1]``), at most 2 (the documented default)."""
    return max(1, min(2, _cores()))


def embedded_start(workers: int, cores: int | None = None) -> dict:
    """How a run that starts its own cluster (``strata replay``, the demo) starts it: the
    ``wait`` and ``stagger`` arguments of :func:`start_cluster`.

    A worker's start-up (JVM, Spark session, warm-up) keeps ~1.4 cores busy for ~10 s.  With
    fewer than two cores per worker, workers started together only slow each other down (on
    2 cores: both ready after 14-17 s, against 10-12 s for one alone), so they start one after
    the other and the run begins as soon as the master and the first worker are ready.  A later
    worker then starts only once the run has lasted as long as the start-up before it took
    (``lazy``, the ski-rental rule: a start-up is what a worker costs): a run that ends sooner
    never has a JVM starting beside it (on 2 cores a second JVM starting during a 1 M-tuple RANGE
    replay made its processing 4.0 s instead of 2.8-2.9 s), a longer one gets its workers, which
    join the group (and get chunks) when ready.  With enough cores they start together and the
    run waits for all of them.  Measured: bench/NOTES.md.

    ``STRATA_WORKERS_START`` overrides the choice: ``together`` (every worker from the start, the run
    waits for all: a run known to be long), ``staggered`` (one after the other, none lazily)."""
    forced = os.environ.get("STRATA_WORKERS_START", "").strip().lower()
    if forced == "together":
        return {"wait": "all", "stagger": False, "lazy": False}
    if forced == "staggered":
        return {"wait": "first", "stagger": True, "lazy": False}
    cores = _cores() if cores is None else cores
    if workers > 1 and cores < 2 * workers:
        return {"wait": "first", "stagger": True, "lazy": True}
    return {"wait": "all", "stagger": False, "lazy": False}


def embedded_load_reading(cfg) -> str:
    """Algorithm 5's reading for an embedded cluster (all workers on this host): the
    configuration's ``[cluster] load_reading`` if it names one, else ``process`` (each worker's
    own processes; the host reading is the same for all of them and reads >= 90 % whenever the
    cluster works).  With credits (master/dispatch.py) either reading only keeps chunks away
    from a worker that is loaded while it has none of this master's chunks."""
    return cfg.cluster.reading(embedded=True)


def start_cluster(config: str, levels: list[str], workers: int, state_dir: Path, chunk_seconds: float | None = None,
                  multicast_port: int | None = None, spark_master: str | None = None, timeout: float = 180.0,
                  worker_env: dict[int, dict] | None = None, tls: bool = True,
                  load_reading: str | None = None, owner: str | None = None, tls_dir: Path | None = None,
                  wait: str = "all", stagger: bool = False, persist: bool = True,
                  warm_queries: list[str] | None = None, lazy: bool = False, abort=None, standby: bool = False,
                  mode: str = "replicated") -> dict:
    """Start one master and ``workers`` workers per level as background processes.

    ``mode`` ``trusted`` (docs/trusted.md): instead, one trusted master (``master-trusted``) and
    ``workers`` trusted workers (``worker-trusted-<i>``) serve every level of ``levels``, which must have
    a top (a level dominating the others: the group they join); ``masters`` then names the one address
    for each level.

    ``standby``: also a standby master per level (``master-<level>-standby``, its own state file
    ``master-<level>-standby.sqlite`` and address; docs/operations.md, *Standby masters*), started once
    the level's master is active; the two name each other with ``--peers``.  The result then has
    ``standbys``: level -> its address.

    ``chunk_seconds``: the masters' chunk length (None: one instant; else a positive whole multiple of
    ``[time] instant_seconds``, refused with :class:`ConfigError` before anything starts).

    ``owner``: a user who gets every role on these masters (``strata master --owner``): the
    embedded runs a user starts for themself (``strata replay`` without ``--master``, the
    demo).  Without it (``strata up``) sessions have the users file's roles.

    ``worker_env``: extra environment per worker index (e.g. an injected CPU reading).
    ``spark_master``: the workers' Spark master, only to override their level's own setting
    (``[groups."L"] spark_master``, strata/spark_settings.py; default ``local[1]``).
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
    ready (two JVMs starting at once on few cores slow each other down); with ``lazy`` as well,
    only after as long again as the previous one took (``strata worker --start-lazily``).
    ``warm_queries``: texts of the queries the run will register (``strata replay``, the demo): the
    workers' warm-up evaluates their shapes instead of generic ones (``strata worker
    --warm-queries``, a file in ``state_dir``, which only this user can read).
    ``abort``: a callable polled while the processes start; an exception it returns stops the cluster
    and is raised (``strata replay`` reads its input meanwhile: a bad file ends the start-up at once).
    The returned dict has ``seconds``: {``first``: first worker ready, ``all``: every process
    ready (or None if not waited for)}.
    """
    t_start = time.monotonic()
    cfg = load_config(config)
    try:
        chunk_instants(chunk_seconds, cfg.instant_seconds)
    except ValueError as e:
        raise ConfigError(f"chunk_seconds {chunk_seconds!r}: {e}") from None
    if load_reading is None:
        load_reading = embedded_load_reading(cfg)
    for d in (state_dir, state_dir / "logs", state_dir / "run"):  # keys, logs, the event logs: this user only
        private_dir(d)
    port = multicast_port or free_udp_port()
    levels = [cfg.lattice.parse(lv) for lv in levels]
    if mode != "trusted":  # a trusted worker's turns stop no process (strata/turns.py): any round is fine
        check_round(cfg, len(levels))  # [cluster] scheduler's rounds too long for a stopped worker: refused now
    for lv in levels:
        group_spec(cfg, lv, state_dir, create_key=True)  # make the level's key before any process starts
    tls_path = Path(tls_dir) if tls_dir is not None else state_dir / "tls"
    if tls:
        missing = [lv for lv in levels if not all(has_material(tls_path, r, lv) for r in ("master", "worker", "client"))]
        if missing:
            create_deployment(tls_path, missing)
        for lv in levels:  # a level whose workers serve /metrics: its scraper's certificate beside its clients'
            if cfg.group(lv).worker_metrics_port is not None and not has_material(tls_path, SCRAPER, lv) \
                    and (tls_path / "ca.key").exists():
                issue_scraper(tls_path, lv)
    warm_file = None
    if warm_queries:
        warm_file = state_dir / "run" / "warm-queries.json"  # the user's query texts: this user only
        warm_file.unlink(missing_ok=True)
        with os.fdopen(os.open(warm_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(list(warm_queries)))
    if standby and not persist:
        raise CliError("a standby master copies the active one's event log: it needs persist", EXIT_REJECTED)
    groups = cluster_groups(cfg, levels, mode, standby)  # (level, name slug, extra arguments): a group of processes each
    procs = []
    deferred = []  # standbys: started once their level's master is ready (it is then the active one)
    base = [sys.executable, "-m", "strata"]
    for lv, slug, extra in groups:
        roles = [("master", f"master-{slug}")] + [("worker", f"worker-{slug}-{i}") for i in range(workers)]
        standby_listen = f"127.0.0.1:{_free_tcp_port()}" if standby else None
        previous = None  # the level's previous worker's ready file (stagger)
        for role, name in roles:
            ready = state_dir / "run" / f"{name}.json"
            ready.unlink(missing_ok=True)
            cmd = base + [role, "--config", str(Path(config).resolve()), "--level", lv, "--listen", "127.0.0.1:0",
                          "--state-dir", str(state_dir.resolve()), "--multicast-port", str(port),
                          "--ready-file", str(ready), "--log-file", str((state_dir / "logs" / f"{name}.log").resolve())]
            cmd += extra
            if not tls:
                cmd.append("--insecure")
            elif tls_dir is not None:
                cmd += ["--tls-dir", str(tls_path.resolve())]
            if role == "master":
                if chunk_seconds is not None:
                    cmd += ["--chunk-seconds", repr(float(chunk_seconds))]
                if not persist:
                    cmd.append("--no-persist")
                if owner:
                    cmd += ["--owner", owner]
                if standby_listen:  # its standby's address, chosen now: a restarted master asks it first
                    cmd += ["--peers", standby_listen]
                    s_name = f"master-{slug}-standby"
                    s_ready = state_dir / "run" / f"{s_name}.json"
                    s_ready.unlink(missing_ok=True)
                    s_cmd = [x if x != str(ready) else str(s_ready) for x in cmd[:cmd.index("--peers")]]
                    s_cmd[s_cmd.index("--listen") + 1] = standby_listen
                    s_cmd[s_cmd.index("--log-file") + 1] = str((state_dir / "logs" / f"{s_name}.log").resolve())
                    # beside the active master's state: in the level's own data_dir when it has one
                    data = cfg.group(lv).data_path(cfg.path)
                    s_dir = private_dir(data, f'[groups."{lv}"] data_dir') if data is not None else state_dir
                    s_cmd += ["--state-file", str((s_dir / f"master-{slug}-standby.sqlite").resolve()),
                              "--peers", ""]  # the master's address, once it is ready
                    deferred.append({"name": s_name, "role": "standby", "level": lv, "ready": str(s_ready),
                                     "cmd": s_cmd, "env": {}, "of": name})
            else:
                if spark_master:  # else the worker takes its level's [groups."L"] spark_master (default local[1])
                    cmd += ["--spark-master", spark_master]
                if load_reading:
                    cmd += ["--load-reading", load_reading]
                if warm_file is not None:
                    cmd += ["--warm-queries", str(warm_file.resolve())]
                if stagger and previous is not None:
                    cmd += ["--start-after", str(previous)] + (["--start-lazily"] if lazy else [])
                previous = ready
            log = open_private_log(state_dir / "logs" / f"{name}.log")
            env = None
            if role == "worker" and worker_env and int(name.rsplit("-", 1)[1]) in worker_env:
                env = {**os.environ, **worker_env[int(name.rsplit("-", 1)[1])]}
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
            procs.append({"name": name, "role": role, "level": lv, "pid": p.pid, "ready": str(ready), "cmd": cmd,
                          "env": (env or {}) and {k: v for k, v in env.items() if k.startswith("STRATA_")}}
                         | ({"serves": list(levels)} if mode == "trusted" else {}))
    record = {"config": str(Path(config).resolve()), "multicast_port": port, "processes": procs,
              "tls_dir": str(tls_path.resolve()) if tls else None}
    write_private(state_dir / "cluster.json", json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    pending = {p["name"] for p in procs}
    last = -1
    first = None

    def start_standbys() -> None:
        """Start each level's standby once its master is ready, as a standby of it."""
        for d in list(deferred):
            m = next(p for p in procs if p["name"] == d["of"])
            if m["name"] in pending:
                continue
            deferred.remove(d)
            d["cmd"][-1] = m["address"]
            log = open_private_log(state_dir / "logs" / f"{d['name']}.log")
            child = subprocess.Popen(d["cmd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            procs.append({k: v for k, v in d.items() if k != "of"} | {"pid": child.pid})
            pending.add(d["name"])
            write_private(state_dir / "cluster.json", json.dumps(record, indent=2))  # stop_cluster finds it

    def enough() -> bool:
        if deferred and wait != "first":
            return False
        if not pending:
            return True
        if wait != "first":
            return False
        return all(any(p["level"] == lv and p["role"] == "worker" and p["name"] not in pending for p in procs)
                   and not any(p["level"] == lv and p["role"] == "master" and p["name"] in pending for p in procs)
                   for lv, _, _ in groups)

    while not enough() and time.monotonic() < deadline:
        failure = abort() if abort is not None else None
        if failure is not None:
            stop_cluster(state_dir)
            raise failure
        for p in procs:
            if p["name"] in pending and Path(p["ready"]).exists():
                info = json.loads(Path(p["ready"]).read_text())
                p["address"] = info["address"]
                pending.discard(p["name"])
                if p["role"] == "worker" and first is None:
                    first = time.monotonic() - t_start
                if deferred and p["role"] == "master":
                    start_standbys()
            elif p["name"] in pending and not alive(p["pid"]):
                stop_cluster(state_dir)
                log = (state_dir / "logs" / f"{p['name']}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"{p['name']} exited during start-up; log tail:\n{log}")
        if len(pending) != last:
            last = len(pending)
            progress(f"starting cluster: {len(procs) - len(pending)}/{len(procs)} processes ready")
        if not enough():
            time.sleep(0.05)
    if not enough():
        stop_cluster(state_dir)
        raise CliError(f"cluster did not start within {timeout:.0f} s: {', '.join(sorted(pending))}")
    write_private(state_dir / "cluster.json", json.dumps(record, indent=2))
    try:  # the host's slot gate ([cluster] scheduler not shared: deploy/slots.py), once the levels run;
        # a trusted process serves every level: its workers take the turns inside (strata/turns.py)
        start_gate(state_dir, record, "shared" if mode == "trusted" else cfg.cluster.scheduler)
    except CliError:
        stop_cluster(state_dir)
        raise
    out = {"masters": {lv: p["address"] for p in procs if p["role"] == "master" for lv in p.get("serves", [p["level"]])},
           "tls_dir": record["tls_dir"],
           "seconds": {"first": None if first is None else round(first, 2),
                       "all": None if pending else round(time.monotonic() - t_start, 2)},
           "worker_ready_files": [p["ready"] for p in procs if p["role"] == "worker"],
           "started_at": time.time() - (time.monotonic() - t_start)}
    if standby:
        out["standbys"] = {p["level"]: p.get("address") for p in procs if p["role"] == "standby"}
    return out


def cluster_groups(cfg, levels: list[str], mode: str, standby: bool) -> list[tuple[str, str, list[str]]]:
    """The groups of processes to start: (level, name slug, extra arguments of each process).  Replicated:
    one per level.  Trusted: one for all ``levels``, of their top, named ``trusted``."""
    if mode == "replicated":
        return [(lv, level_slug(lv), []) for lv in levels]
    if mode != "trusted":
        raise CliError(f"--mode {mode}: must be replicated or trusted", EXIT_REJECTED)
    top = top_of(cfg.lattice, levels)
    if top is None:
        raise CliError(f"--mode trusted: no level of {', '.join(levels)} dominates the others (a trusted master and "
                       f"its workers join the group of their top level)", EXIT_REJECTED)
    if standby:
        raise CliError("--mode trusted: a trusted master has no standbys yet (--standby)", EXIT_REJECTED)
    return [(top, "trusted", ["--trusted-levels", ",".join(levels)])]


def _free_tcp_port() -> int:
    """A TCP port free on loopback now (a standby's address is chosen before its master starts)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_ready_after(started: dict) -> list[float | None]:
    """Seconds from the start of :func:`start_cluster` (its result ``started``) until each worker
    was ready, None for one not ready (yet): a staggered start returns before the later ones are."""
    out = []
    for f in started.get("worker_ready_files", []):
        try:
            out.append(round(Path(f).stat().st_mtime - started["started_at"], 2))
        except OSError:
            out.append(None)
    return out


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
    if alive(p["pid"]):
        raise CliError(f"{name} (pid {p['pid']}) is still running; nothing to restart", EXIT_REJECTED)
    cmd = list(p["cmd"])
    if p.get("address"):  # its address again (one that never became ready picks a port as at its start)
        cmd[cmd.index("--listen") + 1] = p["address"]
    if "--start-after" in cmd:  # a staggered start's order does not apply to a restart
        i = cmd.index("--start-after")
        del cmd[i:i + 2]
    ready = Path(p["ready"])
    ready.unlink(missing_ok=True)
    log = open_private_log(state_dir / "logs" / f"{name}.log")
    env = {**os.environ, **(p.get("env") or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    p["pid"] = proc.pid
    write_private(f, json.dumps(record, indent=2))
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not alive(proc.pid):
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
    f = state_dir / "cluster.json"
    if not f.exists():
        raise CliError(f"no running cluster in {state_dir} (start one with `strata up`)")
    record = json.loads(f.read_text())
    p = next((x for x in record["processes"] if x["role"] == "master" and level in x.get("serves", [x["level"]])), None)
    if p is None:
        raise CliError(f"the cluster in {state_dir} has no master of level {level}")
    if any(x["role"] == "standby" and x["level"] == level for x in record["processes"]):
        raise CliError(f"the cluster in {state_dir} runs a standby master of level {level} (strata up --standby): "
                       f"a fresh master needs a cluster without one", EXIT_REJECTED)
    if alive(p["pid"]):
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 15
        while alive(p["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(p["pid"]):
            os.killpg(p["pid"], signal.SIGKILL)
    for lv in p.get("serves", [level]):  # a trusted master's: every level's (they restart together)
        for old in state_dir.glob(f"master-{level_slug(lv)}.sqlite*"):  # its timeline, queries and sessions
            old.unlink(missing_ok=True)
    p = restart_process(state_dir, p["name"], timeout=timeout)
    return p["address"], record.get("tls_dir"), record["config"]


def alive(pid: int) -> bool:
    """Whether a process started here still runs (a zombie child of ours counts as gone)."""
    if not pid_alive(pid):
        return False
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def stop_cluster(state_dir: Path, timeout: float = 15.0) -> int:
    f = state_dir / "cluster.json"
    if not f.exists():
        return 0
    procs = json.loads(f.read_text())["processes"]
    release(procs)  # the slot gate first: every process it stopped runs again (deploy/slots.py)
    for p in procs:
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p["pid"]) for p in procs):
        time.sleep(0.1)
    for p in procs:
        if alive(p["pid"]):
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    f.unlink()
    return len(procs)


def process_name(state_dir: Path, spec: str) -> str:
    """The name in ``cluster.json`` of ``--restart``'s ``spec``: ``master:L``, ``master:L:standby`` (``strata
    up --standby``), ``worker:L:I`` (the level's I-th worker, from 0) or a process name as ``strata up``
    recorded it (``master-S``, ``master-S-standby``, ``worker-S-1``)."""
    f = state_dir / "cluster.json"
    if not f.exists():
        raise CliError(f"no cluster in {state_dir} (no cluster.json; start one with `strata up`)")
    names = [p["name"] for p in json.loads(f.read_text())["processes"]]
    role, _, rest = spec.partition(":")
    if role == "master" and rest.endswith(":standby"):  # master:S:standby: the level's standby master
        name = f"master-{level_slug(rest[:-len(':standby')])}-standby"
    elif role in ("master", "worker") and rest:
        level, _, index = rest.partition(":") if role == "worker" else (rest, "", "")
        if role == "worker" and not index.isdigit():
            raise CliError(f"--restart {spec}: a worker is worker:LEVEL:INDEX (e.g. worker:S:0)", EXIT_REJECTED)
        name = f"master-{level_slug(level)}" if role == "master" else f"worker-{level_slug(level)}-{int(index)}"
    else:
        name = spec
    if name not in names:
        raise CliError(f"--restart {spec}: no process {name} in {f} (there: {', '.join(names)})", EXIT_REJECTED)
    return name


def cmd_up(args) -> int:
    if args.restart:
        return cmd_restart(args)
    missing = [f"--{k}" for k in ("config", "levels") if not getattr(args, k)]
    if missing:
        raise CliError(f"strata up needs {' and '.join(missing)} (or --restart PROCESS)", EXIT_REJECTED)
    cfg = config_of(args)
    levels = parse_levels(cfg, args.levels)
    chunk_instants_of(cfg, args.chunk_seconds)  # a chunk length that is no whole number of instants: refused now
    out = start_cluster(args.config, levels, args.workers, Path(args.state_dir), args.chunk_seconds,
                        args.multicast_port or None, tls=not args.insecure, standby=args.standby,
                        mode=args.mode or cfg.cluster.mode)
    print(json.dumps({k: out[k] for k in ("masters", "standbys", "tls_dir", "seconds") if k in out}))
    return EXIT_OK


def cmd_restart(args) -> int:
    """``strata up --state-dir DIR --restart master:S``: start a process of a running cluster that died
    (the OOM killer, a kill -9) again, with its recorded command line on its recorded address.  A master
    restores its queries, sessions, input and producers' marks from its event log, so clients resume
    (``strata ingest`` from its first unacknowledged batch, ``strata query`` after its last instant)."""
    state_dir = Path(args.state_dir)
    out = []
    for spec in args.restart:
        name = process_name(state_dir, spec)
        pid = next(p["pid"] for p in json.loads((state_dir / "cluster.json").read_text())["processes"]
                   if p["name"] == name)
        if alive(pid):
            raise CliError(f"{name} (pid {pid}) is still running; nothing to restart", EXIT_REJECTED)
        t0 = time.monotonic()
        progress(f"restarting {name}")
        p = restart_process(state_dir, name)
        out.append({"name": name, "address": p.get("address"), "pid": p["pid"],
                    "seconds": round(time.monotonic() - t0, 2)})
        where = f"serving at {p['address']}" if p.get("address") else "running"  # the gate serves nothing
        progress(f"{name} {where} again (pid {p['pid']})")
    print(json.dumps({"restarted": out}))
    return EXIT_OK


def cmd_down(args) -> int:
    n = stop_cluster(Path(args.state_dir))
    progress(f"stopped {n} processes" if n else "nothing running there")
    return EXIT_OK


def add_parsers(sub) -> None:
    up = sub.add_parser("up", help="start an embedded local cluster in the background (or restart one of its "
                                   "processes: --restart)")
    up.add_argument("--config", help="the deployment's configuration (not with --restart)")
    up.add_argument("--levels", help="comma-separated levels, one group each (not with --restart)")
    up.add_argument("--workers", type=int, default=default_workers(),
                    help="workers per level (default: one per core, at most 2)")
    up.add_argument("--state-dir", required=True)
    add_chunk_seconds(up)
    up.add_argument("--multicast-port", type=int, default=0)
    up.add_argument("--insecure", action="store_true", help="no TLS (development only)")
    up.add_argument("--standby", action="store_true",
                    help="also a standby master per level: it follows the master's event log and takes over when it "
                         "dies (printed under \"standbys\"; restart it with --restart master:LEVEL:standby)")
    up.add_argument("--mode", choices=MODES, default=None,
                    help="replicated: a master and workers per level; trusted: one master and --workers workers serve "
                         "every level of --levels (default [cluster] mode; docs/trusted.md)")
    up.add_argument("--restart", action="append", metavar="PROCESS",
                    help="start a dead process of the cluster in --state-dir again on its address: master:LEVEL, "
                         "master:LEVEL:standby, worker:LEVEL:INDEX or its recorded name (repeat for several); a master resumes from its "
                         "event log, its clients reconnect")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop what `strata up` started in a state dir")
    down.add_argument("--state-dir", required=True)
    down.set_defaults(func=cmd_down)

