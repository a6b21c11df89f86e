"""The elastic scaler of one level group: master status → policy → Ray worker actors.

One scaler per level.  It

1. pins itself to the level's CPU set if the configuration has one (so its Ray
   cluster and every worker it starts inherit the set: :mod:`strata.cpusets`);
2. starts or joins the level's Ray cluster (:class:`LevelRayCluster`: own namespace,
   temp dir, token; loopback only on one host, or -- with ``node_ip``/``ray_address`` --
   a cluster across the level's hosts with Ray's mutual TLS under a per-level CA, every
   listener on the level's addresses);
3. every ``interval`` seconds reads the master's ``Status`` (logged in as an
   operator user of the master's level), turns it into an
   :class:`~strata.deploy.scaler_policy.Observation`, asks the
   :class:`~strata.deploy.scaler_policy.ScalingPolicy` and applies the decision
   through the :class:`WorkerPool` (start workers -- Ray places each on a node of the
   level's cluster with a free CPU, and the worker listens on that node's address --
   or drain one), logging every decision with its reason;
4. on SIGTERM/SIGINT (or exit) stops its workers and the Ray cluster.

Workers it starts join the group like any other (multicast heartbeats with the
level's key), so the master dispatches to them at its next refresh; it only
ever stops workers it started itself.  ``STATE/run/scaler-<level>.json`` shows
the scaler's current view (its workers and their pids, the last decision).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata.client import Client
from strata.config import load_config
from strata.cpusets import format_cpus, pin_current_process
from strata.groups import level_slug
from strata.tls import has_material

from .ray_pool import LevelRayCluster, WorkerPool, check_node_ip, default_ray_port
from .scaler_policy import Decision, Observation, PolicySettings, ScalingPolicy, WorkerObs

__all__ = ["ScalerOptions", "Scaler", "make_client", "observation_from_status", "run_scaler"]

log = logging.getLogger("strata.scaler")


def make_client(address: str, tls_dir: str | None, level: str, timeout: float = 30.0):
    """The one place the scaler builds a master client (mutual TLS when ``tls_dir`` is set)."""
    return Client(address, tls_dir=tls_dir, level=level, timeout=timeout)


def observation_from_status(st, now: float, owned: dict[str, object], starting: int,
                            draining: set[str]) -> Observation:
    """An :class:`Observation` from a ``StatusReply`` and the pool's view."""
    workers = tuple(
        WorkerObs(sid=w.sid, cpu=float(w.cpu), in_flight=int(w.in_flight), chunks_done=int(w.chunks_done),
                  state=w.state or "ready", drainable=w.sid in owned)
        for w in st.workers
    )
    ready = getattr(st, "ready_chunks", None)  # newer masters report it; else backlog − in flight
    return Observation(now=now, backlog_chunks=int(st.backlog_chunks), workers=workers,
                       ready_chunks=None if ready is None else int(ready), starting=starting,
                       draining=tuple(sorted(draining)))


@dataclass
class ScalerOptions:
    config: str
    level: str
    master: str
    user: str
    state_dir: Path
    settings: PolicySettings = field(default_factory=PolicySettings)
    interval: float = 1.0
    multicast_port: int | None = None
    tls_dir: str | None = None
    insecure: bool = False
    spark_master: str | None = None     # None: the workers use their level's Spark settings (the config)
    load_reading: str | None = "process"  # the workers' Algorithm 5 reading (worker/load.py)
    listen: str | None = None           # None: the address of the node a worker lands on, port 0
    worker_cpus: float = 1.0            # Ray CPUs per worker actor
    ray_cpus: int | None = None         # CPUs this host's node offers (default max × worker_cpus; head: may be 0)
    node_ip: str | None = None          # this host's address on the level's network: a multi-host cluster
    ray_address: str | None = None      # HEAD:PORT of an existing level cluster to join (else the config's)
    ray_port: int | None = None         # the level's base Ray port (default: config or per-level default)
    ray_worker_ports: int = 40          # ports for Ray's worker processes on this node
    placement: str = "spread"           # spread | pack (Ray's SPREAD or DEFAULT strategy)
    bind_any: bool = False              # accept Ray's wildcard listeners (no bind shim)
    start_timeout: float = 300.0
    stop_grace: float = 15.0
    join_timeout: float = 30.0          # a ready worker must appear in the master's table within this
    verbose: bool = False


class Scaler:
    def __init__(self, opts: ScalerOptions, password: str, clock=time.monotonic):
        self.opts = opts
        self.password = password
        self.clock = clock
        self.cfg = load_config(opts.config)
        self.level = self.cfg.lattice.parse(opts.level)
        self.slug = level_slug(self.level)
        self.state_dir = Path(opts.state_dir).resolve()
        self.policy = ScalingPolicy(opts.settings)
        self.client = None
        self.cluster = None
        self.pool = None
        self.last_decision: Decision | None = None
        self._last_logged = ""
        self._last_logged_at = 0.0
        self._stopped: dict[str, float] = {}  # sids we stopped recently (they linger in the table ~3 s)
        self._lock_fd: int | None = None
        self.stop_event = threading.Event()
        self.tls_dir = self._tls_dir()
        self.multicast_port = opts.multicast_port or self._cluster_port()
        self._nodes: list[dict] = []
        self._nodes_at = -1e9

    # -- set-up ------------------------------------------------------------------------------------
    def _tls_dir(self) -> str | None:
        if self.opts.insecure:
            return None
        if self.opts.tls_dir:
            return str(Path(self.opts.tls_dir).resolve())
        d = self.state_dir / "tls"
        try:
            if has_material(d, "client", self.level):
                return str(d)
        except ImportError:  # pragma: no cover - TLS module absent
            pass
        return None

    def _cluster_port(self) -> int | None:
        f = self.state_dir / "cluster.json"  # written by `strata up`
        try:
            port = int(json.loads(f.read_text())["multicast_port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        log.info("multicast port %d from %s", port, f)
        return port

    def _lock(self) -> None:
        run = self.state_dir / "run"
        run.mkdir(parents=True, exist_ok=True)
        fd = os.open(run / f"scaler-{self.slug}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"another scaler of level {self.level} runs on {self.state_dir}") from None
        self._lock_fd = fd

    def login(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        c = make_client(self.opts.master, self.tls_dir, self.level)
        try:
            c.login(self.opts.user, self.password, self.level)
        except Exception:
            c.close()
            raise
        self.client = c

    def start(self, after_ray=None) -> None:
        """Lock, log in, pin, start the level's Ray cluster and the pool; ``after_ray()`` right after ray.init."""
        self._lock()
        self.login()  # fail fast on a wrong password or master
        st = self.client.status()
        if self.cfg.lattice.parse(st.level) != self.level:
            raise RuntimeError(f"master {self.opts.master} serves level {st.level}, not {self.level}")
        cpus = pin_current_process(self.level, self.cfg)
        if cpus is not None:
            log.info("pinned to CPUs %s (level %s); Ray and the workers inherit them", format_cpus(cpus), self.level)
        self.cluster = self.make_cluster()
        info = self.cluster.start()
        if after_ray is not None:
            after_ray()
        log.info("Ray cluster of level %s (%s): gcs %s, node %s, namespace %s, temp dir %s, %s, up after %.1f s%s",
                 self.level, self.cluster.mode, info.get("gcs_address"), info.get("node_ip_address"),
                 self.cluster.namespace, self.cluster.temp_dir,
                 "joined through this host's node" if self.cluster.mode == "join"
                 else f"{self.cluster.num_cpus} CPUs here", info.get("started_in") or 0.0,
                 f" (the head node {info['node_started_in']:.1f} s)" if info.get("node_started_in") else "")
        spec = {"config": str(Path(self.opts.config).resolve()), "state_dir": str(self.state_dir),
                "tls_dir": self.opts.tls_dir if self.tls_dir else None, "insecure": self.opts.insecure,
                "multicast_port": self.multicast_port, "spark_master": self.opts.spark_master,
                "load_reading": self.opts.load_reading, "listen": self.opts.listen}
        # the level's multicast group as `strata deploy` sets it; each worker's interface is its node's address
        env = {k: os.environ[k] for k in ("STRATA_GROUP_ADDRESS", "STRATA_GROUP_TTL") if os.environ.get(k)}
        self.pool = WorkerPool(self.level, self.state_dir, spec, actor_cpus=self.opts.worker_cpus, env=env,
                               start_timeout=self.opts.start_timeout, stop_grace=self.opts.stop_grace,
                               placement=self.opts.placement, clock=self.clock)

    def ray_settings(self) -> dict:
        """Where the level's Ray cluster is: ``node_ip``, ``address`` (to join), ``port`` (base)."""
        address = self.opts.ray_address or self.cfg.group(self.level).ray_address
        node_ip = check_node_ip(self.opts.node_ip) if self.opts.node_ip else None
        if address and not node_ip:
            raise RuntimeError(f"joining the level's Ray cluster at {address} needs --node-ip: this host's address "
                               f"on the level's network (where this host's `strata scale node` runs)")
        port = self.opts.ray_port or default_ray_port(self.cfg, self.level)
        if address:
            try:
                port = int(str(address).rsplit(":", 1)[1])
            except (IndexError, ValueError):
                raise RuntimeError(f"Ray address {address!r} is not HOST:PORT") from None
        return {"node_ip": node_ip, "address": address, "port": port}

    def make_cluster(self):
        s = self.opts.settings
        r = self.ray_settings()
        ray_cpus = self.opts.ray_cpus
        if ray_cpus is None:
            ray_cpus = max(1, int(round(s.max_workers * self.opts.worker_cpus)))
        if ray_cpus < 0 or (ray_cpus == 0 and not r["node_ip"]):
            raise RuntimeError("--ray-cpus 0 leaves no CPU for workers on a single-host cluster; with --node-ip the "
                               "head may offer none (workers then go to the other hosts' nodes)")
        return LevelRayCluster(self.level, self.state_dir, ray_cpus, node_ip=r["node_ip"], address=r["address"],
                               port=r["port"] if r["node_ip"] else None, worker_ports=self.opts.ray_worker_ports,
                               bind_any=self.opts.bind_any, config=self.opts.config,
                               tls_dir=self.opts.tls_dir if self.tls_dir else None)

    # -- the loop -----------------------------------------------------------------------------------
    def status(self):
        import grpc

        try:
            return self.client.status()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # session expired: log in again
                self.login()
                return self.client.status()
            raise

    def watch_nodes(self, now: float, every: float = 5.0) -> None:
        """Log Ray nodes of the level joining and leaving (every ``every`` s)."""
        if now - self._nodes_at < every:
            return
        self._nodes_at = now
        try:
            nodes = self.cluster.nodes()
        except Exception as e:  # noqa: BLE001 - the GCS busy: next time
            log.debug("ray.nodes(): %s", e)
            return
        before = {(n["ip"], n["alive"]) for n in self._nodes}
        for n in nodes:
            if (n["ip"], n["alive"]) not in before:
                log.info("Ray node %s %s (%g CPUs)", n["ip"], "up" if n["alive"] else "gone", n["cpus"])
        self._nodes = nodes

    def tick(self) -> Decision:
        now = self.clock()
        self.watch_nodes(now)
        for line in self.pool.refresh():
            log.info("%s", line)
        st = self.status()
        table = {w.sid for w in st.workers}
        self._stopped = {sid: t for sid, t in self._stopped.items() if now - t < 10 and sid in table}
        owned, starting, draining = {}, 0, set(self._stopped)
        for m in list(self.pool.members.values()):
            if m.state == "starting":
                starting += 1
            elif m.state == "draining":
                if m.address:
                    draining.add(m.address)
            elif m.address in table:
                owned[m.address] = m
            elif now - (m.ready_at or now) < self.opts.join_timeout:
                starting += 1  # serving, heartbeats not yet in the master's table
            else:
                log.warning("%s serves at %s but has not joined the group within %.0f s (multicast port or key?); "
                            "stopping it", m.name, m.address, self.opts.join_timeout)
                self.pool.drain(m.name)
        obs = observation_from_status(st, now, owned, starting, draining)
        d = self.policy.decide(obs)
        self.apply(d)
        self.last_decision = d
        self._log_decision(d, obs)
        self._write_state(obs, d)
        return d

    def apply(self, d: Decision) -> None:
        if d.delta > 0:
            names = self.pool.add(d.delta)
            log.info("starting %s", ", ".join(names))
        elif d.delta < 0:
            for sid in d.drain:
                m = self.pool.by_sid().get(sid)
                if self.pool.drain(sid):
                    self._stopped[sid] = self.clock()
                    log.info("draining %s (%s)", sid, m.name if m else "?")

    def _log_decision(self, d: Decision, obs: Observation) -> None:
        kind = re.sub(r"[\d.]+", "#", d.reason)
        now = self.clock()
        if d.delta or self.opts.verbose or kind != self._last_logged or now - self._last_logged_at > 30:
            log.info("decision %s [workers %d, starting %d, backlog %d, waiting %d]", d, len(obs.live),
                     obs.starting, obs.backlog_chunks, obs.waiting)
            self._last_logged, self._last_logged_at = kind, now

    def _write_state(self, obs: Observation | None, d: Decision | None) -> None:
        f = self.state_dir / "run" / f"scaler-{self.slug}.json"
        rec = {
            "pid": os.getpid(), "level": self.level, "master": self.opts.master, "updated": time.time(),
            "ray": {"gcs_address": (self.cluster.info if self.cluster else {}).get("gcs_address"),
                    "mode": self.cluster.mode if self.cluster else None,
                    "node_ip": (self.cluster.info if self.cluster else {}).get("node_ip_address"),
                    "namespace": self.cluster.namespace if self.cluster else None,
                    "temp_dir": str(self.cluster.temp_dir) if self.cluster else None,
                    "ports": (self.cluster.info if self.cluster else {}).get("ports"),
                    "started_in": (self.cluster.info if self.cluster else {}).get("started_in"),
                    "nodes": self._nodes},
            "workers": self.pool.snapshot() if self.pool else [],
            "decision": {"delta": d.delta, "reason": d.reason, "drain": list(d.drain)} if d else None,
            "observed": {"workers": len(obs.live), "starting": obs.starting, "backlog": obs.backlog_chunks,
                         "waiting": obs.waiting} if obs else None,
        }
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=2))
        tmp.replace(f)

    def run(self) -> None:
        interval = max(0.05, float(self.opts.interval))
        failures = 0
        while not self.stop_event.is_set():
            try:
                self.tick()
                failures = 0
            except Exception as e:  # the master restarting, a network blip: keep going
                failures += 1
                log.warning("tick failed (%d in a row): %s: %s", failures, type(e).__name__, e)
                if failures % 5 == 0:
                    try:
                        self.login()
                    except Exception as e2:
                        log.warning("login again failed: %s", e2)
            self.stop_event.wait(interval)

    def close(self) -> None:
        if self.pool is not None:
            for line in self.pool.stop_all():
                log.info("%s", line)
            self.pool = None
        if self.cluster is not None:
            killed = self.cluster.stop()
            if killed:
                log.info("killed %d Ray processes that outlived ray.shutdown(): %s", len(killed), killed)
            log.info("Ray cluster of level %s stopped", self.level)
            self.cluster = None
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
        f = self.state_dir / "run" / f"scaler-{self.slug}.json"
        f.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def run_scaler(opts: ScalerOptions, password: str) -> int:
    """Run until SIGTERM/SIGINT; always leaves no worker and no Ray process behind."""
    import atexit

    sc = Scaler(opts, password)
    closed = threading.Event()

    def close_once():
        if not closed.is_set():
            closed.set()
            sc.close()

    atexit.register(close_once)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def install():  # again after ray.init: Ray's failure-signal handler would re-raise SIGTERM and skip clean-up
        for sig in previous:
            signal.signal(sig, lambda *_: sc.stop_event.set())

    install()
    try:
        sc.start(after_ray=install)
        log.info("scaling level %s between %d and %d workers (master %s)", sc.level, opts.settings.min_workers,
                 opts.settings.max_workers, opts.master)
        sc.run()
    finally:
        log.info("stopping")
        close_once()
        for sig, h in previous.items():
            signal.signal(sig, h)
    return 0
