"""``strata replay`` and ``strata demo``: files through a cluster (an embedded one started for the run,
a running master, or the warm workers of a ``strata up`` cluster), every result written."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from strata.cli_support import add_chunk_seconds, chunk_instants_of
from strata.commands import parse_levels
from strata.config import load_config
from strata.errors import EXIT_FAILED, EXIT_LOGIN, EXIT_OK, EXIT_REJECTED, CliError
from strata.inputs import check_inputs, drop_above, instant_batches, parse_inputs
from strata.mlscql import QueryError, compile_query, parse
from strata.serving import progress
from strata.session import client_call, client_tls, fmt_value, login, read_password, register_queries
from strata.throttle import LOGIN_FAILED, MAX_PASSWORD, FileThrottle, LoginThrottle
from strata.trusted import MODES
from strata.users import AuthError, UserStore

from .local import cluster_groups  # the groups `strata up --mode` starts, and its refusals
from .local import default_workers, embedded_start, renew_master, start_cluster, stop_cluster, workers_ready_after

__all__ = ["replay", "cmd_replay", "add_parsers"]


def tls_cache() -> Path | None:
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


def _check_queries(cfg, queries: list[str], level: str | None, embedded: bool) -> None:
    """Each query text refused offline before a cluster starts for nothing, with the master's own one
    line and exit 2: compiled at the session's level for the embedded cluster (its master has this
    config and level); parsed only for another master (its streams may differ from this config),
    which still applies the bounds of text, nesting and expressions (strata/mlscql/limits.py)."""
    for i, text in enumerate(queries):
        try:
            if embedded and level:
                compile_query(text, cfg, level)
            else:
                parse(text)
        except QueryError as e:
            prefix = f"query {i + 1}: " if len(queries) > 1 else ""
            raise CliError(prefix + str(e), EXIT_REJECTED) from None


def replay(config_path: str, user: str, level: str | None, queries: list[str], inputs: list[str], output: str,
           workers: int = 2, chunk_seconds: float | None = None, master: str | None = None, tls_dir: str | None = None,
           timings: dict | None = None, cluster: str | None = None, mode: str | None = None,
           levels: str | None = None) -> int:
    """Replay files through a cluster and write every result (``strata replay``).

    Without ``master``: an embedded cluster is started for this run and stopped after it: in the
    ``replicated`` mode a master and ``workers`` workers of the login level; in the ``trusted`` mode
    (``mode``, default the configuration's ``[cluster] mode``; docs/trusted.md) one trusted master and
    ``workers`` trusted workers serving the login level and every level of ``levels`` (comma-separated),
    started as ``strata up --mode trusted`` starts them; the input goes through the login level's
    address either way.  The input is sent in instant order with the instants closed as they
    complete, so workers compute while the rest is still being sent.  ``timings`` (optional)
    receives where the time went: ``start`` (cluster start-up, with ``first``/``all`` worker
    ready), ``read``, ``process`` (first tuple sent → last result), ``write``, ``stop`` (the
    embedded cluster's shutdown), ``read_wait`` (how long the run waited for the input after the
    cluster was ready: the files are read, and the rows above the session's level left out, while
    the cluster starts)."""
    cfg = load_config(config_path)
    if level:
        try:
            level = cfg.lattice.parse(level)
        except ValueError as e:
            raise CliError(f"--level: {e}", EXIT_REJECTED) from None
    if cluster is not None and level is None:
        raise CliError("--cluster needs --level (the level group to replay into)", EXIT_REJECTED)
    if master is None and cluster is None:  # the embedded cluster's chunks: a whole number of instants
        chunk_instants_of(cfg, chunk_seconds)
    elif mode is not None or levels:  # another cluster's architecture is its own
        raise CliError("--mode and --levels are for the embedded cluster (not with --master or --cluster)",
                       EXIT_REJECTED)
    mode = mode or cfg.cluster.mode
    if mode not in MODES:
        raise CliError(f"--mode {mode}: must be {' or '.join(MODES)}", EXIT_REJECTED)
    extra_levels = parse_levels(cfg, levels) if levels else []
    if extra_levels and mode != "trusted":
        raise CliError("--levels: the replicated mode's embedded cluster serves the login level only "
                       "(--levels is for --mode trusted)", EXIT_REJECTED)
    password = None
    if master is None:  # the embedded or renewed master reads this users file: the credentials are checked
        password = read_password()  # here first, so a wrong password starts (or replaces) nothing
        principal = check_credentials(cfg, user, password, level)
        level = level or principal.level
    cluster_levels = [level] + [lv for lv in dict.fromkeys(extra_levels) if lv != level]
    if master is None and cluster is None:  # `strata up --mode`'s refusals (no top) before anything starts
        cluster_groups(cfg, cluster_levels, mode, standby=False)
    check_inputs(cfg, inputs)  # a mistyped spec or path: said before anything starts
    _check_queries(cfg, queries, level, embedded=master is None and cluster is None)
    reader = InputReader(cfg, inputs, level)  # reads while the cluster starts
    reader.start()
    tmp = None
    ok = False
    out_t = timings if timings is not None else {}
    if cluster is not None:  # a cluster of `strata up`: a fresh master, the warm workers
        t1 = time.monotonic()
        master, tls_dir, _ = renew_master(Path(cluster), level)
        out_t["start"] = round(time.monotonic() - t1, 3)
        progress(f"fresh master of level {level} at {master} (the workers of {cluster} stay)")
    elif master is None:
        tmp = Path(tempfile.mkdtemp(prefix="strata-replay-"))
        how = embedded_start(workers)
        what = (f"a trusted embedded cluster (one master) serving {', '.join(cluster_levels)}" if mode == "trusted"
                else f"an embedded cluster at level {level}")
        progress(f"starting {what} with {workers} workers"
                 + (" one after the other (few cores): the run begins when the first is ready, the others start "
                    "only if it lasts as long as that start-up" if how["lazy"] else
                    " one after the other (few cores); the run begins when the first is ready" if how["stagger"] else "")
                 + f" (user {user} has every role on it)")
        t1 = time.monotonic()
        try:
            started = start_cluster(config_path, cluster_levels, workers, tmp, chunk_seconds, owner=user,
                                    tls_dir=tls_cache(), persist=False, warm_queries=queries, abort=reader.failure,
                                    mode=mode, **how)
        except BaseException as e:
            if e is reader.failure():  # a bad input file: the cluster stopped, nothing of it to look at
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        out_t["start"] = round(time.monotonic() - t1, 3)
        out_t["start_split"] = started.get("seconds")
        master, tls_dir = started["masters"][cfg.lattice.parse(level)], started["tls_dir"]
    t_wait = time.monotonic()
    try:
        data, above, batches = reader.result()
    except BaseException:
        if tmp is not None:  # the cluster was ready before the input turned out bad
            stop_cluster(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    out_t["read"], out_t["read_wait"] = reader.seconds, round(time.monotonic() - t_wait, 3)
    try:
        c = login(master, user, level or "", tls_dir, password=password)
        regs = register_queries(c, queries)
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
        progress(f"replaying {reader.total} tuples")
        t2 = time.monotonic()
        if batches is None:  # the session's level was not known before the login (--master without --level)
            data, above = drop_above(cfg, data, c.level)  # the shepherd would drop them on arrival
            batches = instant_batches(cfg, data, c.level)
        reply = client_call(c.ingest, batches, labelled=True, what="input rejected: ")
        out_t["ingested"] = round(time.monotonic() - t2, 3)
        if reply.error:
            raise CliError(f"input rejected: {reply.error}", EXIT_REJECTED)
        client_call(c.advance, finish=True)
        out_t["sent"] = round(time.monotonic() - t2, 3)
        while th.is_alive():
            th.join(timeout=5)
            if th.is_alive():
                st = client_call(c.status)
                done = ", ".join(f"{q.query_id} {'-' if q.last_ts < 0 else q.last_ts}" for q in st.queries
                                 if q.query_id in results)
                progress(f"waiting for results ({time.monotonic() - t2:.0f} s); last instant per query: {done}")
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
        write_outputs(output, regs, results)
        out_t["write"] = round(time.monotonic() - t3, 3)
        c.close()
        progress(f"accepted {reply.accepted} tuples ({above + reply.dropped_by_shepherd} above level {c.level} dropped); "
                  f"wrote {output}")
        failed = {q: e for q, (state, e) in c.ended.items() if state == "failed"}
        for q, e in failed.items():
            print(f"strata: query {q} failed: {e}", file=sys.stderr, flush=True)
        ok = True
    finally:
        if tmp is not None:
            out_t["workers_ready"] = workers_ready_after(started)
            t4 = time.monotonic()
            stop_cluster(tmp)
            out_t["stop"] = round(time.monotonic() - t4, 3)
            if ok:  # after a failure the logs stay (the error names the directory's processes)
                shutil.rmtree(tmp, ignore_errors=True)
    return EXIT_FAILED if failed else EXIT_OK


def check_credentials(cfg, user: str, password: str, level: str | None):
    """The user's principal at ``level`` (default: the clearance) if ``password`` is right, checked
    against the configuration's users file before anything starts, with a master's login throttling
    (strata/throttle.py) kept in ``<users file>.failures`` so that it holds across runs; else one line,
    exit 3.  Costs one argon2 check (~0.1 s), as a master's login does."""
    store = UserStore(cfg.users_path, cfg.lattice)
    throttle = FileThrottle(cfg.users_path.with_name(cfg.users_path.name + ".failures"))
    try:
        try:
            keys = throttle.take(user, None)
        except AuthError:
            raise
        except OSError:  # the users file's directory is read-only here: this run's own count only
            throttle = LoginThrottle()
            keys = throttle.take(user, None)
        if len(password or "") > MAX_PASSWORD:  # no user has one: no argon2 work
            raise AuthError(LOGIN_FAILED)
        principal = store.authenticate(user, password, level)
    except AuthError as e:
        raise CliError(str(e), EXIT_LOGIN) from None
    throttle.give_back(keys)
    return principal


class InputReader(threading.Thread):
    """The replay's input read while its cluster starts (both take their time; on 2 cores reading
    1 M tuples took ~0.45 s before a start-up of ~10 s that leaves the client idle).

    When the session's level is known (``level``), the rows it does not dominate are left out
    (:func:`~strata.inputs.drop_above`) and the input is cut into its ingest batches here too;
    that also pays pyarrow's one-time pandas import (~0.3 s, the first array it builds from Python
    objects) during the start-up instead of after it.
    :meth:`failure` (polled during the start-up) is the reading's error once it has one;
    :meth:`result` waits and returns ``(data, rows left out, batches or None)`` or raises it."""

    def __init__(self, cfg, inputs: list[str], level: str | None):
        super().__init__(name="read-input", daemon=True)
        self.cfg, self.inputs, self.level = cfg, inputs, level
        self.seconds: float | None = None
        self.total = 0  # tuples in the files
        self._out = None
        self._error: BaseException | None = None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            data = parse_inputs(self.cfg, self.inputs)
            self.total = sum(t.num_rows for _, t in data)
            above, batches = 0, None
            if self.level is not None:
                data, above = drop_above(self.cfg, data, self.level)
                batches = list(instant_batches(self.cfg, data, self.level))
            self._out = (data, above, batches)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            self._error = e
        finally:
            self.seconds = round(time.monotonic() - t0, 3)

    def failure(self) -> BaseException | None:
        return self._error

    def result(self) -> tuple:
        self.join()
        if self._error is not None:
            raise self._error
        return self._out


def write_outputs(output: str, regs, results) -> None:
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
                    w.writerow([fmt_value(v) for v in row])


def cmd_replay(args) -> int:
    if args.master is None and args.workers < 1:
        raise CliError("--workers must be at least 1", EXIT_REJECTED)
    if args.master and args.cluster:
        raise CliError("give --master or --cluster, not both", EXIT_REJECTED)
    timings = {} if args.timings else None
    try:
        return replay(args.config, args.user, args.level, args.query, args.input, args.output, args.workers,
                      args.chunk_seconds, args.master, client_tls(args), timings=timings, cluster=args.cluster,
                      mode=args.mode, levels=args.levels)
    finally:
        if args.timings:
            Path(args.timings).write_text(json.dumps(timings))



def add_parsers(sub) -> None:
    r = sub.add_parser("replay", help="replay files through a cluster and write every result")
    r.add_argument("--config", required=True)
    r.add_argument("--user", required=True)
    r.add_argument("--level")
    r.add_argument("--query", action="append", required=True)
    r.add_argument("--input", action="append", required=True, help="STREAM=FILE.csv")
    r.add_argument("--output", required=True)
    r.add_argument("--workers", type=int, default=default_workers(),
                   help="workers of the embedded cluster (default: one per core, at most 2; with fewer than two "
                        "cores per worker a later one starts only once the run has lasted as long as the start-up "
                        "before it, STRATA_WORKERS_START=together: all from the start)")
    add_chunk_seconds(r)
    r.add_argument("--master", help="replay into this running master (its input is finished afterwards); or the "
                                    "level's masters a:port,b:port (an active one and its standbys)")
    r.add_argument("--cluster", metavar="STATE_DIR",
                   help="replay into the running `strata up` cluster of STATE_DIR: a fresh master of --level, its "
                        "workers already warm (the fast path for repeated runs; the user needs the analyst and "
                        "producer roles there)")
    r.add_argument("--mode", choices=MODES, default=None,
                   help="the embedded cluster's architecture: replicated (a master and --workers workers of the login "
                        "level) or trusted (one master and --workers workers serving the login level and --levels, "
                        "as `strata up --mode trusted`; docs/trusted.md); default [cluster] mode")
    r.add_argument("--levels", metavar="LEVELS",
                   help="with --mode trusted: the other levels the embedded trusted cluster serves (comma-separated; "
                        "the login level is always served, a level dominating the others must be among them)")
    r.add_argument("--tls-dir", help="client certificate for --master (default: $STRATA_TLS_DIR)")
    r.add_argument("--timings", metavar="FILE", help="write where the time went (JSON; for benchmarks)")
    r.set_defaults(func=cmd_replay)
