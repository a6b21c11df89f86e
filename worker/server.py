"""The worker process: gRPC server over :class:`WorkerCore`, one SparkSession, group heartbeats."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time

import grpc

from strata.groups import AUTH_HEADER, verify_request
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import build_server, run_until_stopped

from .service import QuerySpecData, WorkerCore, WorkerRefused, one_line

__all__ = ["WorkerServicer", "serve_worker", "execute_digest"]

log = logging.getLogger("strata.worker")


def execute_digest(req: pb.ExecuteRequest) -> bytes:
    """What the group MAC of an Execute call covers: level, queries and chunk bytes."""
    h = hashlib.sha256()
    h.update(req.level.encode())
    for q in req.queries:
        h.update(b"\x00" + q.query_id.encode() + b"\x00" + q.level.encode() + b"\x00" + q.text.encode())
    h.update(b"\x01")
    h.update(req.chunk)
    return h.digest()


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
        self._auth(context, request.level, execute_digest(request))
        specs = [QuerySpecData(q.query_id, q.text, q.level) for q in request.queries]
        try:
            t0 = time.perf_counter()
            results = self.core.execute(request.level, specs, request.chunk)
            return pb.ExecuteReply(results=results, seconds=time.perf_counter() - t0)
        except WorkerRefused as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:  # undecodable chunk (a query's own failures are results, not errors)
            self.core.refused["bad_chunk"] += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, one_line(f"bad chunk: {e}"))
        except Exception as e:  # noqa: BLE001 - the worker itself failed: one line, details in the log
            from .engine import describe_error, is_infrastructure_error

            log.exception("Execute failed")
            if is_infrastructure_error(e):  # JVM or its connection gone: the master retries elsewhere
                context.abort(grpc.StatusCode.UNAVAILABLE, one_line(f"worker unavailable: {describe_error(e)}"))
            context.abort(grpc.StatusCode.INTERNAL, one_line(f"worker error: {describe_error(e)}"))

    def Info(self, request, context):
        """This worker's status; ``identity_key`` is the key its heartbeats are signed with,
        which the master binds to this address before it lists the worker (worker/group.py)."""
        self._auth(context, self.core.level, b"info")
        st = self.core.stats()
        cpu, state, identity = 0.0, "ready", b""
        if self.member is not None:
            cpu = self.member.cpu_override if self.member.cpu_override is not None else 0.0
            state, identity = self.member.state, self.member.public_key
        return pb.WorkerStatus(sid=self.sid, cpu=cpu, pid=os.getpid(), state=state,
                               chunks_done=st["chunks_done"], seen_levels=st["seen_levels"],
                               refused=st["refused"], identity_key=identity)


#: seconds of warm-up chunks before the worker reports ready (the first step always runs;
#: ``STRATA_WARMUP_SECONDS``; docs/benchmarks/engine.md measures first-chunk latency against it)
WARMUP_SECONDS = 6.0


def _warm_queries(config, level: str) -> list[tuple[str, object]]:
    """(kind, compiled query) of the shapes real chunks take, over the config's first stream
    that has a numeric attribute: ROWS aggregate, grouped aggregate, ISTREAM selection and
    self-join (small, pruned chunks: the interpreted session, several queries in one
    statement), RANGE grouped aggregate over many instants (the code-generating session and
    the pre-aggregation) and an unbounded aggregate (running state)."""
    from strata.mlscql import compile_query

    for stream in config.streams.values():
        num = next((c for c, t in stream.columns if t == "double"), None) or \
            next((c for c, t in stream.columns if t in ("long", "timestamp")), None)
        if num is None:
            continue
        key = next((c for c, t in stream.columns if t == "string"), None) or \
            next((c for c, t in stream.columns if c != num), num)
        s = stream.name
        texts = [
            ("small", f"SELECT AVG({num}) FROM {s} [ROWS 100]"),
            ("small", f"SELECT {key}, AVG({num}) FROM {s} [ROWS 100] GROUP BY {key}"),
            ("small", f"SELECT {key}, {num} FROM {s} [ROWS 100] WHERE {num} > 0"),
            ("small", f"SELECT a.{key}, a.{num}, b.{num} FROM {s} [ROWS 10] a, {s} [ROWS 10] b "
                      f"WHERE a.{key} = b.{key}"),
            ("range", f"SELECT {key}, COUNT(*), AVG({num}) FROM {s} [RANGE 10 SECONDS] GROUP BY {key}"),
            ("state", f"SELECT {key}, COUNT(*), SUM({num}) FROM {s} GROUP BY {key}"),
        ]
        out = []
        for kind, text in texts:
            try:
                out.append((kind, compile_query(text, config, level)))
            except Exception:  # noqa: BLE001 - e.g. a key type the query cannot group by
                continue
        return out
    return []


def _warm_table(stream, level: str, instants: list[int], per_instant: int, seed: int):
    """``per_instant`` synthetic tuples of ``stream`` at ``level`` for each instant."""
    import numpy as np
    import pyarrow as pa

    from strata.arrowio import ARROW_TYPES

    rng = np.random.default_rng(seed)
    ts = np.repeat(np.asarray(instants, dtype=np.int64), per_instant)
    n = len(ts)
    cols = {"_seq": pa.array(np.arange(n, dtype=np.int64)), "ts": pa.array(ts), "level": pa.array([level] * n)}
    for name, typ in stream.columns:
        if typ == "string":
            arr = pa.array(np.char.add("k", rng.integers(0, 50, n).astype(str)))
        elif typ == "double":
            arr = pa.array(rng.normal(100.0, 10.0, n))
        elif typ in ("long", "timestamp"):
            arr = pa.array(rng.integers(0, 1000, n))
        else:
            arr = pa.array(rng.random(n) < 0.5)
        cols[name] = arr.cast(ARROW_TYPES[typ])
    return pa.table(cols)


def warm_up(engine, config, level: str, budget: float | None = None, rounds: int | None = None) -> dict:
    """Evaluate representative chunks so the first real chunk is not the JVM's first: the JIT,
    class loading and generated code are then warm for the paths real chunks take
    (``createDataFrame`` from Arrow, the statement shapes of ROWS/RANGE/aggregate/join/state
    queries, shared plans and several queries in one statement, ``toArrow``).

    Steps, in order of how much they buy: the small queries' chunk of three instants through
    the shared executor (the JVM's first statement pays most of the cold cost), each small
    query alone on one instant, a RANGE chunk of 25 instants (code generation, pre-aggregation),
    a running state; then again on other instants.  The first step always runs; the next ones
    while less than ``budget`` seconds (default ``STRATA_WARMUP_SECONDS``, else
    :data:`WARMUP_SECONDS`; negative: no warm-up at all) have passed, and at most ``rounds``
    times through all steps.  Never fatal.  Returns what it did."""
    from strata.chunking.model import QueryChunk
    from strata.chunking.prune import prune_query_chunk

    from .shared import SharedExecutor

    if budget is None:
        budget = float(os.environ.get("STRATA_WARMUP_SECONDS", WARMUP_SECONDS))
    t0 = time.perf_counter()
    done = {"steps": 0, "rounds": 0, "seconds": 0.0, "first_step": None}
    if budget < 0:
        return done
    try:
        queries = _warm_queries(config, level)
        if not queries:
            return done
        stream = config.streams[queries[0][1].items[0].stream]
        executor = SharedExecutor(engine, config, enabled=True)
        lv = config.lattice.parse(level)
        small = {f"w{k}": cq for k, (kind, cq) in enumerate(queries) if kind == "small"}

        def batch(base):
            table = _seq(_warm_table(stream, lv, [base], 100, seed=base),
                         _warm_table(stream, lv, [base + 1, base + 2, base + 3], 300, seed=base + 1))
            chunks = [prune_query_chunk(cq, QueryChunk(qid, -1, [table] * len(cq.items), [base + 1, base + 2, base + 3],
                                                       prev_instant=base)) for qid, cq in small.items()]
            executor.run(small, chunks)

        def alone(qid, cq):
            def step(base):
                one = _seq(_warm_table(stream, lv, [base + 3], 100, seed=base + 2),
                           _warm_table(stream, lv, [base + 4], 300, seed=base + 3))
                engine.run(cq, prune_query_chunk(cq, QueryChunk(qid, -1, [one] * len(cq.items), [base + 4],
                                                                prev_instant=base + 3)))
            return step

        def ranged(cq):
            def step(base):
                t = _warm_table(stream, lv, list(range(base + 100, base + 134)), 1000, seed=base + 4)
                engine.run(cq, QueryChunk("range", -1, [t], list(range(base + 109, base + 134)),
                                          prev_instant=base + 108))
            return step

        def state(cq):
            def step(base):
                t = _warm_table(stream, lv, list(range(base + 200, base + 205)), 200, seed=base + 5)
                engine.run(cq, QueryChunk("state", -1, [t], list(range(base + 200, base + 205))))
            return step

        steps = ([batch] if small else []) + [alone(q, cq) for q, cq in small.items()]
        steps += [ranged(cq) for kind, cq in queries if kind == "range"]
        steps += [state(cq) for kind, cq in queries if kind == "state"]
        while True:
            base = 1000 * (done["rounds"] + 1)
            for step in steps:
                step(base)
                done["steps"] += 1
                elapsed = time.perf_counter() - t0
                if done["first_step"] is None:
                    done["first_step"] = round(elapsed, 3)
                if elapsed >= budget:
                    break
            else:
                done["rounds"] += 1
                if rounds is None or done["rounds"] < rounds:
                    continue
            break
    except Exception as e:  # noqa: BLE001 - never fatal: the first real chunk just pays the cost
        log.warning("warm-up failed: %s", e)
    done["seconds"] = round(time.perf_counter() - t0, 3)
    return done


def _seq(legacy, new):
    """``legacy`` then ``new`` as one item table with increasing ``_seq``."""
    import numpy as np
    import pyarrow as pa

    t = pa.concat_tables([legacy, new])
    return t.set_column(0, "_seq", pa.array(np.arange(t.num_rows, dtype=np.int64)))


def serve_worker(config, level: str, listen: str, spec, spark_master: str = "local[2]",
                 ready=None, stop_event: threading.Event | None = None, tls_dir=None,
                 load_reading: str = "host") -> None:
    """Run a worker until SIGTERM/SIGINT (or ``stop_event``).

    ``load_reading``: the CPU reading its heartbeats carry for Algorithm 5
    (``host`` or ``process``, see :mod:`strata.worker.load`).

    With ``tls_dir`` the worker serves mutual TLS with its ``worker-<level>``
    certificate and answers only a ``master`` certificate of its own level;
    without it (``--insecure``) it relies on the group key alone.
    """
    from strata.worker.engine import Engine
    from strata.worker.group import GroupMember
    from strata.worker.spark import get_session

    t0 = time.perf_counter()
    spark = get_session(master=spark_master, app_name=f"strata-worker-{level}", build_cds=True)
    t_session = time.perf_counter() - t0
    engine = Engine(spark, config)
    warm = warm_up(engine, config, level)
    print(f"[strata] worker start-up: Spark session {t_session:.1f} s, warm-up {warm['seconds']:.1f} s "
          f"({warm['steps']} chunks)", file=sys.stderr, flush=True)
    core = WorkerCore(config, level, engine)
    core.startup = {"session_seconds": round(t_session, 3), "warmup": warm}
    servicer = WorkerServicer(core, spec.key)
    creds, interceptors = None, ()
    if tls_dir is not None:
        from strata.tls import PeerCheck, server_credentials

        creds = server_credentials(tls_dir, "worker", core.level)
        interceptors = (PeerCheck(core.level, ("master",), refused=core.refused),)
    server, address = build_server(rpc.add_WorkerServicer_to_server, servicer, listen, credentials=creds,
                                   max_workers=4, interceptors=interceptors)
    servicer.sid = address
    from strata.worker.load import make_load

    # a fresh Ed25519 identity signs this process's heartbeats; Info tells it to the master.
    # slots: chunks evaluated concurrently (advertised for the master's credit-based dispatch)
    member = GroupMember(spec, sid=address, role="worker", stats=core.stats,
                         load=make_load(load_reading, spark_master), slots=2)
    servicer.member = member
    if os.environ.get("STRATA_CPU_OVERRIDE"):  # an injected load reading (tests, drills)
        member.cpu_override = float(os.environ["STRATA_CPU_OVERRIDE"])
    server.start()
    member.start()
    log.info("worker %s level %s serving", address, level)

    def cleanup():
        member.stop()
        server.stop(grace=2).wait()

    run_until_stopped(stop_event, ready and (lambda: ready(address, core, member)), cleanup)
