"""One Ray cluster per level, and worker processes of that level as Ray actors.

:class:`LevelRayCluster` starts a private Ray head for exactly one level
(``ray.init(address="local")``: never an existing cluster, never ``RAY_ADDRESS``)
with

* its own namespace ``strata-<level>`` and its own temp dir under the state dir
  (``STATE/ray/<level>``; a short directory under ``$TMPDIR`` linked from there
  when that path is too long for Ray's unix sockets);
* its own authentication token (``STATE/ray/<level>.token``, 0600;
  ``RAY_AUTH_MODE=token``), so a process of another level's Ray cluster cannot
  talk to it even on the same host, and nothing is written to ``~/.ray``;
* node IP 127.0.0.1 and no dashboard.  Ray resolves ``127.0.0.1`` to the host's
  outward address unless its "no cluster" switch is set
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which this module sets); with it
  every Ray listener is bound to loopback (checked in ``tests/test_scaler.py``).

What Ray opens (Ray 2.x, measured with ``ss -ltnup``): TCP listeners of the
GCS server, the raylet (node manager and object manager), the runtime-env
agent and one core-worker gRPC port per Ray process (the driver and each
actor), all on 127.0.0.1 and ephemeral ports; unix sockets (raylet, plasma
store) in the session directory; the object store in ``/dev/shm``.  No UDP.

:class:`WorkerProcess` is the body of the :data:`WorkerActor`: it runs
``python -m strata worker ...`` as a child process (so the worker's Spark JVM
stays in the actor's process tree), reports the worker's address from its
ready file, stops it on request (SIGTERM, SIGKILL to its process group after a
deadline) and -- through ``PR_SET_PDEATHSIG`` -- the worker dies with the
actor's process if that dies first (the JVM follows: PySpark's gateway exits
when its parent's pipe closes).  :class:`WorkerPool` keeps the actors of one
level and is what the scaler drives.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LevelRayCluster", "WorkerProcess", "WorkerPool", "PoolMember", "worker_command", "WorkerActor"]

log = logging.getLogger("strata.scaler")

#: unix socket paths are limited to 107 bytes; Ray appends ~70 to its temp dir
MAX_TEMP_DIR = 40

# A tiny launcher: the worker gets SIGKILL when the process that started it (the
# actor) dies, then execs the real command (the death signal survives execve).
_LAUNCHER = r"""
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except OSError:
    pass
if os.getppid() != parent:
    sys.exit(75)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _slug(level: str) -> str:
    from strata.groups import level_slug

    return level_slug(level)


def worker_command(config: str, level: str, state_dir: Path, ready_file: Path, *, listen: str = "127.0.0.1:0",
                   multicast_port: int | None = None, spark_master: str = "local[1]", tls_dir: str | None = None,
                   insecure: bool = False, python: str | None = None, load_reading: str | None = "process") -> list[str]:
    """The ``strata worker`` command line of one pool worker (same keys, certs and group as the level's).

    ``load_reading``: Algorithm 5's CPU reading (worker/load.py); a pool's workers share one
    host, so by default each reports its own processes (``process``): the host's reading would
    be the same for all of them and would also move with other levels' load.  ``None``: the
    configuration's ``[cluster] load_reading``."""
    cmd = [python or sys.executable, "-m", "strata", "worker", "--config", str(Path(config).resolve()),
           "--level", level, "--listen", listen, "--state-dir", str(Path(state_dir).resolve()),
           "--ready-file", str(ready_file), "--spark-master", spark_master]
    if load_reading:
        cmd += ["--load-reading", load_reading]
    if multicast_port:
        cmd += ["--multicast-port", str(int(multicast_port))]
    if tls_dir:
        cmd += ["--tls-dir", str(Path(tls_dir).resolve())]
    if insecure:
        cmd.append("--insecure")
    return cmd


# ---- the actor's body ------------------------------------------------------------------------
class WorkerProcess:
    """One ``strata worker`` process owned by this object (the body of a Ray actor)."""

    def __init__(self, cmd: list[str], ready_file: str, log_file: str, env: dict | None = None):
        self.cmd = list(cmd)
        self.ready_file = Path(ready_file)
        self.log_file = Path(log_file)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> int:
        if self.proc is not None:
            return self.proc.pid
        self.ready_file.unlink(missing_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # the worker is not a Ray process
        env.update(self.env)
        launcher = [sys.executable, "-c", _LAUNCHER, str(os.getpid())]
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(launcher + self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        return self.proc.pid

    def poll(self) -> dict:
        """``{"pid", "address", "returncode", "log_tail"}``; address once the worker serves."""
        if self.proc is None:
            return {"pid": 0, "address": None, "returncode": None}
        rc = self.proc.poll()
        out = {"pid": self.proc.pid, "address": None, "returncode": rc, "host": os.uname().nodename}
        if self.ready_file.exists():
            try:
                out["address"] = json.loads(self.ready_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                pass
        if rc is not None:
            out["log_tail"] = self.log_tail()
        return out

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """The worker and its descendants (the Spark JVM)."""
        if self.proc is None:
            return []
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except Exception:
            return []

    def stop(self, grace: float = 15.0) -> dict:
        """SIGTERM the worker; SIGKILL its process group after ``grace`` seconds."""
        if self.proc is None:
            return {"returncode": None, "forced": False}
        forced = False
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                forced = True
        try:  # whatever is left in the worker's session (the JVM), or everything if it hung
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        self.ready_file.unlink(missing_ok=True)
        return {"returncode": rc, "forced": forced}

    def __del__(self):  # the actor is going away: take the worker with it
        p = getattr(self, "proc", None)
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


_actor_class = None


def _worker_actor():
    global _actor_class
    if _actor_class is None:
        import ray

        _actor_class = ray.remote(max_restarts=0, max_task_retries=0)(WorkerProcess)
    return _actor_class


def __getattr__(name):  # ``WorkerActor`` is created on first use, after Ray's environment is set
    if name == "WorkerActor":
        return _worker_actor()
    raise AttributeError(name)


# ---- one Ray cluster per level ------------------------------------------------------------------
class LevelRayCluster:
    """A private Ray head for one level, started in this process."""

    def __init__(self, level: str, state_dir: Path, num_cpus: int, object_store_mb: int = 128):
        self.level = level
        self.slug = _slug(level)
        self.state_dir = Path(state_dir).resolve()
        self.num_cpus = int(num_cpus)
        self.object_store_mb = int(object_store_mb)
        self.namespace = f"strata-{self.slug}"
        self.temp_dir: Path | None = None
        self._short_dir: Path | None = None
        self.info: dict = {}

    def _prepare_dirs(self) -> Path:
        base = self.state_dir / "ray"
        base.mkdir(parents=True, exist_ok=True)
        want = base / self.slug
        if len(str(want)) <= MAX_TEMP_DIR:
            want.mkdir(exist_ok=True)
            return want
        short = Path(tempfile.mkdtemp(prefix=f"strata-ray-{self.slug[:8]}-"))
        self._short_dir = short
        if want.is_symlink() or want.exists():
            if want.is_symlink():
                want.unlink()
            else:
                shutil.rmtree(want, ignore_errors=True)
        want.symlink_to(short, target_is_directory=True)
        return short

    def _token(self) -> Path:
        path = self.state_dir / "ray" / f"{self.slug}.token"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex())
        return path

    def start(self) -> dict:
        if os.environ.get("RAY_ADDRESS"):
            log.warning("ignoring RAY_ADDRESS=%s: each level starts its own Ray cluster", os.environ["RAY_ADDRESS"])
            os.environ.pop("RAY_ADDRESS")
        self.temp_dir = self._prepare_dirs()
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node IP = loopback, listeners on loopback
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray waits 30 s for its GCS to bind; give a loaded host (Spark workers starting) longer
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "60")
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(self._token())
        import ray
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the variable was set
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to a Ray cluster; the scaler needs its own")
        for attempt in range(1, 3):
            try:
                ctx = ray.init(address="local", num_cpus=self.num_cpus, namespace=self.namespace,
                               include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=str(self.temp_dir),
                               log_to_driver=False, configure_logging=False,
                               object_store_memory=self.object_store_mb * 1024 * 1024)
                break
            except Exception as e:  # noqa: BLE001 - Ray gives its raylet a fixed 30 s to register
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                log.warning("Ray did not start (attempt %d of 2, host busy?): %s; retrying", attempt, e)
                self._kill_leftovers()
        self.info = dict(ctx.address_info)
        if self.info.get("node_ip_address") not in ("127.0.0.1", None):
            log.warning("Ray node IP is %s, not loopback", self.info.get("node_ip_address"))
        return self.info

    def _kill_leftovers(self) -> None:
        """After a failed start: shut down and kill what that attempt left running."""
        import psutil
        import ray

        procs = _descendants()
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - nothing to shut down
            pass
        _kill_all(procs)
        psutil.wait_procs(procs, timeout=10)

    def stop(self, timeout: float = 15.0) -> list[int]:
        """Shut Ray down; then SIGKILL any of its processes still alive after ``timeout`` (returned)."""
        import psutil
        import ray

        procs = _descendants()
        if ray.is_initialized():
            ray.shutdown()
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        _kill_all(alive)  # e.g. Ray's per-node agents, which ignore SIGTERM once their raylet is gone
        psutil.wait_procs(alive, timeout=5)
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)
            link = self.state_dir / "ray" / self.slug
            if link.is_symlink():
                link.unlink()
            self._short_dir = None
        return [p.pid for p in alive]


def _descendants() -> list:
    """psutil handles of this process's descendants: Ray's GCS, raylet and workers, and our
    worker processes ([] if they cannot be listed)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(procs) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


# ---- the pool -----------------------------------------------------------------------------------
@dataclass
class PoolMember:
    name: str
    actor: object
    ready_file: Path
    log_file: Path
    started_at: float
    state: str = "starting"  # starting | ready | draining
    pid: int = 0
    address: str | None = None
    ready_at: float | None = None
    spawn_ref: object = None
    stop_ref: object = None
    stop_started: float | None = None
    tree: set[int] = field(default_factory=set)


class WorkerPool:
    """The worker actors of one level: start, watch, drain, stop."""

    def __init__(self, level: str, state_dir: Path, make_command, *, actor_cpus: float = 1.0,
                 start_timeout: float = 300.0, stop_grace: float = 15.0, env: dict | None = None,
                 clock=time.monotonic):
        self.level = level
        self.slug = _slug(level)
        self.state_dir = Path(state_dir).resolve()
        self.make_command = make_command  # (ready_file) -> argv
        self.actor_cpus = actor_cpus
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.env = dict(env or {})
        self.members: dict[str, PoolMember] = {}
        self.clock = clock
        self._n = 0
        (self.state_dir / "run").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)

    # -- queries ---------------------------------------------------------------------------
    def by_sid(self) -> dict[str, PoolMember]:
        return {m.address: m for m in self.members.values() if m.address}

    def count(self, state: str) -> int:
        return sum(1 for m in self.members.values() if m.state == state)

    def snapshot(self) -> list[dict]:
        return [{"name": m.name, "state": m.state, "sid": m.address, "pid": m.pid, "tree": sorted(m.tree),
                 "log": str(m.log_file)} for m in self.members.values()]

    # -- actions -----------------------------------------------------------------------------
    def add(self, k: int) -> list[str]:
        actor_cls = _worker_actor()
        names = []
        for _ in range(k):
            self._n += 1
            name = f"scaled-{self.slug}-{os.getpid()}-{self._n}"
            ready = self.state_dir / "run" / f"{name}.json"
            logf = self.state_dir / "logs" / f"{name}.log"
            actor = actor_cls.options(name=name, num_cpus=self.actor_cpus).remote(
                self.make_command(ready), str(ready), str(logf), self.env)
            m = PoolMember(name, actor, ready, logf, self.clock())
            m.spawn_ref = actor.spawn.remote()
            self.members[name] = m
            names.append(name)
        return names

    def refresh(self) -> list[str]:
        """Advance starting members, collect finished stops, drop dead ones; returns log lines."""
        import ray

        events: list[str] = []
        for m in list(self.members.values()):
            if m.state == "draining":
                if m.stop_ref is not None:
                    done, _ = ray.wait([m.stop_ref], timeout=0)
                    if done:
                        try:
                            res = ray.get(m.stop_ref)
                            events.append(f"{m.name} ({m.address}) stopped: exit {res['returncode']}"
                                          + (" after SIGKILL" if res["forced"] else ""))
                        except Exception as e:  # the actor died on its own: its worker went with it
                            events.append(f"{m.name} ({m.address}) gone: {type(e).__name__}")
                        self._forget(m)
                    elif self.clock() - (m.stop_started or 0) > self.stop_grace + 30:
                        events.append(f"{m.name} did not confirm its stop; killing the actor")
                        self._forget(m)
                continue
            try:
                if m.pid == 0 and m.spawn_ref is not None:
                    done, _ = ray.wait([m.spawn_ref], timeout=0)
                    if not done:
                        if self.clock() - m.started_at > self.start_timeout:
                            events.append(f"{m.name}: no actor within {self.start_timeout:.0f} s "
                                          f"(not enough Ray CPUs?); giving up")
                            self._forget(m)
                        continue
                    m.pid = ray.get(m.spawn_ref)
                st = ray.get(m.actor.poll.remote(), timeout=30)
            except Exception as e:
                events.append(f"{m.name}: actor failed ({type(e).__name__}: {e}); dropping it")
                self._forget(m)
                continue
            if st["returncode"] is not None:
                events.append(f"{m.name} (pid {m.pid}) exited with {st['returncode']}; log tail:\n"
                              f"{st.get('log_tail', '')[-800:]}")
                self._forget(m)
                continue
            if m.state == "starting":
                if st["address"]:
                    m.address, m.state, m.ready_at = st["address"], "ready", self.clock()
                    try:
                        m.tree = set(ray.get(m.actor.pids.remote(), timeout=30))
                    except Exception:
                        pass
                    events.append(f"{m.name} ready at {m.address} (pid {m.pid}) after "
                                  f"{m.ready_at - m.started_at:.1f} s")
                elif self.clock() - m.started_at > self.start_timeout:
                    events.append(f"{m.name} not ready within {self.start_timeout:.0f} s; stopping it")
                    self.drain(m.name)
            else:
                try:  # keep the process tree current (the JVM appears after the worker)
                    m.tree |= set(ray.get(m.actor.pids.remote(), timeout=30))
                except Exception:
                    pass
        return events

    def drain(self, key: str) -> bool:
        """Stop the worker named ``key`` (member name or sid) gracefully, in the background."""
        m = self.members.get(key) or self.by_sid().get(key)
        if m is None or m.state == "draining":
            return False
        m.state = "draining"
        m.stop_started = self.clock()
        try:
            m.stop_ref = m.actor.stop.remote(self.stop_grace)
        except Exception:
            m.stop_ref = None
            self._forget(m)
        return True

    def _forget(self, m: PoolMember) -> None:
        import ray

        self.members.pop(m.name, None)
        try:
            ray.kill(m.actor, no_restart=True)
        except Exception:
            pass

    def stop_all(self, timeout: float | None = None) -> list[str]:
        """Stop every worker (in parallel) and kill the actors."""
        import ray

        events = []
        for m in list(self.members.values()):
            if m.state != "draining":
                self.drain(m.name)
        refs = {m.name: m.stop_ref for m in self.members.values() if m.stop_ref is not None}
        wait = timeout if timeout is not None else self.stop_grace + 15
        if refs:
            done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait)
            for name, ref in refs.items():
                if ref in done:
                    try:
                        res = ray.get(ref)
                        events.append(f"{name} stopped: exit {res['returncode']}")
                    except Exception as e:
                        events.append(f"{name} gone: {type(e).__name__}")
                else:
                    events.append(f"{name} did not stop within {wait:.0f} s; killing its actor")
        for m in list(self.members.values()):
            self._forget(m)
        return events
