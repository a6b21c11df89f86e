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
from strata.config import config_of
from strata.errors import EXIT_OK, CliError
from strata.serving import free_udp_port, pid_alive, progress

__all__ = ["start_cluster", "embedded_start", "stop_cluster", "restart_process", "renew_master",
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
    return ((cfg.sections.get("cluster") or {}).get("load_reading")) or "process"


def start_cluster(config: str, levels: list[str], workers: int, state_dir: Path, chunk_seconds: float = 1.0,
                  multicast_port: int | None = None, spark_master: str = "local[1]", timeout: float = 180.0,
                  worker_env: dict[int, dict] | None = None, tls: bool = True,
                  load_reading: str | None = None, owner: str | None = None, tls_dir: Path | None = None,
                  wait: str = "all", stagger: bool = False, persist: bool = True,
                  warm_queries: list[str] | None = None, lazy: bool = False, abort=None) -> dict:
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
    from strata.config import load_config
    from strata.groups import group_spec, level_slug

    t_start = time.monotonic()
    cfg = load_config(config)
    if load_reading is None:
        load_reading = embedded_load_reading(cfg)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # keys, logs, the event logs: this user only
    (state_dir / "logs").mkdir(exist_ok=True, mode=0o700)
    (state_dir / "run").mkdir(exist_ok=True, mode=0o700)
    port = multicast_port or free_udp_port()
    levels = [cfg.lattice.parse(lv) for lv in levels]
    for lv in levels:
        group_spec(cfg, lv, state_dir, create_key=True)  # make the level's key before any process starts
    tls_path = Path(tls_dir) if tls_dir is not None else state_dir / "tls"
    if tls:
        from strata.tls import create_deployment, has_material

        missing = [lv for lv in levels if not all(has_material(tls_path, r, lv) for r in ("master", "worker", "client"))]
        if missing:
            create_deployment(tls_path, missing)
    warm_file = None
    if warm_queries:
        warm_file = state_dir / "run" / "warm-queries.json"  # the user's query texts: this user only
        warm_file.unlink(missing_ok=True)
        with os.fdopen(os.open(warm_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(list(warm_queries)))
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
                if warm_file is not None:
                    cmd += ["--warm-queries", str(warm_file.resolve())]
                if stagger and previous is not None:
                    cmd += ["--start-after", str(previous)] + (["--start-lazily"] if lazy else [])
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
    (state_dir / "cluster.json").write_text(json.dumps(record, indent=2))
    return {"masters": {p["level"]: p["address"] for p in procs if p["role"] == "master"},
            "tls_dir": record["tls_dir"],
            "seconds": {"first": None if first is None else round(first, 2),
                        "all": None if pending else round(time.monotonic() - t_start, 2)},
            "worker_ready_files": [p["ready"] for p in procs if p["role"] == "worker"],
            "started_at": time.time() - (time.monotonic() - t_start)}


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
    from strata.groups import level_slug

    f = state_dir / "cluster.json"
    if not f.exists():
        raise CliError(f"no running cluster in {state_dir} (start one with `strata up`)")
    record = json.loads(f.read_text())
    p = next((x for x in record["processes"] if x["role"] == "master" and x["level"] == level), None)
    if p is None:
        raise CliError(f"the cluster in {state_dir} has no master of level {level}")
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
    for old in state_dir.glob(f"master-{level_slug(level)}.sqlite*"):  # its timeline, queries and sessions
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


def cmd_up(args) -> int:
    levels = parse_levels(config_of(args), args.levels)
    out = start_cluster(args.config, levels, args.workers, Path(args.state_dir), args.chunk_seconds,
                        args.multicast_port or None, tls=not args.insecure)
    print(json.dumps({k: out[k] for k in ("masters", "tls_dir", "seconds")}))
    return EXIT_OK


def cmd_down(args) -> int:
    n = stop_cluster(Path(args.state_dir))
    progress(f"stopped {n} processes" if n else "nothing running there")
    return EXIT_OK


def add_parsers(sub) -> None:
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

    down = sub.add_parser("down", help="stop what `strata up` started in a state dir")
    down.add_argument("--state-dir", required=True)
    down.set_defaults(func=cmd_down)

