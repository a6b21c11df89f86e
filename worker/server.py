"""The worker process: gRPC server over :class:`WorkerCore`, one SparkSession, group heartbeats."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import grpc

from strata.errors import ConfigError
from strata.groups import AUTH_HEADER, execute_digest, verify_request
from strata.groups.membership import GroupMember
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import build_server, run_until_stopped
from strata.tls import PeerCheck, peer_identity, server_credentials

from .assemble import describe_error, is_infrastructure_error
from .load import make_load, spark_executor_samples
from .pools import fair_conf
from .service import QuerySpecData, WorkerCore, WorkerFenced, WorkerRefused, one_line
from strata.turns import make_turns
from .spark import get_session

__all__ = ["WorkerServicer", "serve_worker"]

log = logging.getLogger("strata.worker")


class WorkerServicer(rpc.WorkerServicer):
    def __init__(self, core: WorkerCore, key: bytes, member=None, sid: str = ""):
        self.core = core
        self.key = key
        self.member = member
        self.sid = sid

    def _auth(self, context, level: str, digest: bytes) -> None:
        header = dict(context.invocation_metadata()).get(AUTH_HEADER)
        if not verify_request(self.key, level, digest, header):
            self.core.refused["unauthenticated"] += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "request not signed with this level's group key")

    def Execute(self, request, context):
        chunk = request.chunk  # once: every read of a bytes field copies it (a unit: tens of MB)
        self._auth(context, request.level, execute_digest(request, chunk))
        if len(self.core.levels) > 1:  # a trusted worker: a level's chunks come over a link of that level
            who = peer_identity(context)
            if who is not None and who.level != request.level:
                self.core.refused["wrong_link_level"] += 1
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"an Execute of level {request.level} over a link of level {who.level}")
        try:  # fencing (after the signature: the epoch is signed): a replaced master drives no worker
            self.core.fence(request.epoch)
        except WorkerFenced as e:
            log.warning("refused an Execute: %s (stale_epoch %d)", e, self.core.refused["stale_epoch"])
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        specs = [QuerySpecData(q.query_id, q.text, q.level) for q in request.queries]
        try:
            t0 = time.perf_counter()
            results = self.core.execute(request.level, specs, chunk)
            return pb.ExecuteReply(results=results, seconds=time.perf_counter() - t0)
        except WorkerRefused as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:  # undecodable chunk (a query's own failures are results, not errors)
            self.core.refused["bad_chunk"] += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, one_line(f"bad chunk: {e}"))
        except Exception as e:  # noqa: BLE001 - the worker itself failed: one line, details in the log
            log.exception("Execute failed")
            if is_infrastructure_error(e):  # JVM or its connection gone: the master retries elsewhere
                context.abort(grpc.StatusCode.UNAVAILABLE, one_line(f"worker unavailable: {describe_error(e)}"))
            context.abort(grpc.StatusCode.INTERNAL, one_line(f"worker error: {describe_error(e)}"))

    def Info(self, request, context):
        """This worker's status; ``identity_key`` is the key its heartbeats are signed with,
        which the master binds to this address before it lists the worker (strata/groups/membership.py)."""
        self._auth(context, self.core.level, b"info")
        st = self.core.stats()
        cpu, state, identity = 0.0, "ready", b""
        if self.member is not None:
            cpu = self.member.cpu_override if self.member.cpu_override is not None else 0.0
            state, identity = self.member.state, self.member.public_key
        return pb.WorkerStatus(sid=self.sid, cpu=cpu, pid=os.getpid(), state=state,
                               chunks_done=st["chunks_done"], seen_levels=st["seen_levels"],
                               refused=st["refused"], identity_key=identity)




def driver_host(listen: str, environ=None) -> str | None:
    """The address a worker's Spark driver binds to and announces to a cluster's executors: the host
    of its ``--listen`` address (the level's interface), or ``STRATA_GROUP_INTERFACE`` when it listens
    on every interface; None when neither names one (Spark then picks an interface itself)."""
    environ = os.environ if environ is None else environ
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    host = host.strip().strip("[]")
    if host and host not in ("0.0.0.0", "::", "*"):
        return host
    return (environ.get("STRATA_GROUP_INTERFACE") or "").strip() or None


def partials_switch(environ=None) -> str:
    """The engine's pre-aggregation switch from ``STRATA_RANGE_PARTIALS`` (``auto`` unless set; ``on``
    or ``off`` to compare the paths, bench/range_partials.py); another value is refused in one line."""
    environ = os.environ if environ is None else environ
    value = (environ.get("STRATA_RANGE_PARTIALS") or "auto").strip().lower()
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"STRATA_RANGE_PARTIALS must be auto, on or off, not {value!r}")
    return value


def serve_worker(config, level: str, listen: str, spec, spark_master: str = "local[2]",
                 ready=None, stop_event: threading.Event | None = None, tls_dir=None,
                 load_reading: str = "host", warm_queries: list[str] | tuple = (),
                 spark_conf: dict | None = None, spark_secret: str | None = None, levels=()) -> None:
    """Run a worker until SIGTERM/SIGINT (or ``stop_event``).

    ``levels``: a trusted worker's levels (``[cluster] mode = "trusted"``, docs/trusted.md; ``level``
    is their top, whose group it joins): it executes chunks of each of them, for a master presenting
    that level's certificate, in that level's Spark scheduler pool (FAIR scheduling), with slots per
    level.

    ``spark_master``, ``spark_conf``, ``spark_secret``: the level's Spark (strata/spark_settings.py):
    a cluster master needs the secret, and the driver binds to :func:`driver_host` of ``listen``.
    ``load_reading``: the CPU reading its heartbeats carry for Algorithm 5
    (``host`` or ``process``, see :mod:`strata.worker.load`); a worker on a cluster reads its
    executors' task slots instead.
    ``warm_queries``: texts of the queries the run will register, if known (an embedded run's):
    the warm-up evaluates their shapes instead of generic ones (worker/warmup.py).

    With ``tls_dir`` the worker serves mutual TLS with its ``worker-<level>``
    certificate and answers only a ``master`` certificate of its own level;
    without it (``--insecure``) it relies on the group key alone.
    """
    # the JVM and Spark session start in a thread while this one does the Python side of the
    # start-up (imports, compiling the warm-up's queries, its first chunk): the JVM alone keeps
    # ~1.4 cores busy, so on 2 cores the rest overlaps
    partials = partials_switch()  # a bad value is refused before the JVM starts
    levels = tuple(dict.fromkeys(config.lattice.parse(lv) for lv in levels))
    if len(levels) > 1:  # a trusted worker: a pool per level, the least level's first (worker/pools.py)
        spark_conf = fair_conf(config.lattice, levels, spark_conf)
    t0 = time.perf_counter()
    box: dict = {}

    def start_session():
        try:
            box["spark"] = get_session(master=spark_master, app_name=f"strata-worker-{level}", build_cds=True,
                                       conf=spark_conf, secret=spark_secret, driver_host=driver_host(listen),
                                       level=level)
        except BaseException as e:  # noqa: BLE001 - raised below, in the calling thread
            box["error"] = e
        box["seconds"] = time.perf_counter() - t0

    starting = threading.Thread(target=start_session, name="spark-session", daemon=True)
    starting.start()
    # deferred: the engine and the warm-up (~55 ms of imports) load while the JVM starts in the thread above
    from .engine import Engine
    from .warmup import prepare, warm_up

    try:
        prepared = prepare(config, level, warm_queries)
    except Exception as e:  # noqa: BLE001 - never fatal: warm_up tries again and logs
        log.warning("warm-up preparation failed: %s", e)
        prepared = None
    starting.join()
    if "error" in box:
        raise box["error"]
    spark, t_session = box["spark"], box["seconds"]
    cluster = not spark_master.startswith("local")
    executors = spark_executor_samples(spark) if cluster else None
    engine = Engine(spark, config, partials=partials)
    warm = warm_up(engine, config, level, prepared=prepared)
    where = ""
    if executors is not None:
        try:
            found = executors()
            cores = sum(e.cores for e in found)
            where = (f" on {spark_master} ({len(found)} executor{'s' if len(found) != 1 else ''}, "
                     f"{cores} core{'s' if cores != 1 else ''})")
        except Exception as e:  # noqa: BLE001 - only the start-up line misses it
            where = f" on {spark_master} (executors unknown: {e.__class__.__name__})"
    print(f"[strata] worker start-up: Spark session {t_session:.1f} s{where}, warm-up {warm['seconds']:.1f} s "
          f"({warm['steps']} chunks)", file=sys.stderr, flush=True)
    core = WorkerCore(config, level, engine, levels=levels)
    core.turns = make_turns(config.cluster, config.lattice, core.levels)  # a trusted worker's scheduler, or None
    if core.turns is not None:
        print(f"[strata] worker: levels {', '.join(core.turns.levels)} take turns: {config.cluster.scheduler}, "
              f"{config.cluster.slot_seconds:g} s slots (strata/turns.py)", file=sys.stderr, flush=True)
    core.startup = {"session_seconds": round(t_session, 3), "warmup": warm}
    servicer = WorkerServicer(core, spec.key)
    creds, interceptors = None, ()
    if tls_dir is not None:  # a trusted worker: the certificate of each of its levels (the caller's by SNI)
        creds = server_credentials(tls_dir, "worker", core.level, also=core.levels)
        interceptors = (PeerCheck(core.level, ("master",), refused=core.refused, levels=core.levels),)
    # a trusted worker: each level's master has its own slots here, so one level's calls never wait for a thread
    server, address = build_server(rpc.add_WorkerServicer_to_server, servicer, listen, credentials=creds,
                                   max_workers=4 * len(core.levels), interceptors=interceptors)
    servicer.sid = address

    # a fresh Ed25519 identity signs this process's heartbeats; Info tells it to the master.
    # slots: chunks evaluated concurrently (advertised for the master's credit-based dispatch)
    member = GroupMember(spec, sid=address, role="worker", stats=core.stats,
                         load=make_load(load_reading, spark_master, executors=executors), slots=2)
    servicer.member = member
    if os.environ.get("STRATA_CPU_OVERRIDE"):  # an injected load reading (tests, drills)
        member.cpu_override = float(os.environ["STRATA_CPU_OVERRIDE"])
    server.start()
    member.start()
    log.info("worker %s level %s serving", address, level)

    def cleanup():
        if core.turns is not None:
            core.turns.stop()
            print(f"[strata] worker: turns of each level: {({lv: core.turns.stats(lv) for lv in core.turns.levels})}",
                  file=sys.stderr, flush=True)
        member.stop()
        server.stop(grace=2).wait()

    run_until_stopped(stop_event, ready and (lambda: ready(address, core, member)), cleanup)
