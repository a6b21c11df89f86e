"""One Ray cluster per level -- on one host or across the level's hosts -- and worker processes
of that level as Ray actors.

Three ways to run a level's Ray cluster (:class:`LevelRayCluster`, driven by ``strata scale``):

* **local** (no node IP, no head address): a private head in the scaler's process on
  127.0.0.1 only (``ray.init(address="local")``, Ray's "no cluster" switch
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, ``RAY_ADDRESS`` ignored); single host.
* **head** (``node_ip``): the scaler starts the level's head (:class:`RayNode`) on the
  level's interface address of its host and drives it; other hosts of the level join it
  with ``strata scale node --address HEAD:PORT --node-ip THEIR_ADDRESS``.
* **join** (``address``): the scaler drives an existing level cluster through the node
  of its own host (started with ``strata scale node``).

Every node of a multi-host level cluster (:class:`RayNode`) runs with

* the level's token (``STATE/ray/<level>.token``, ``RAY_AUTH_MODE=token``): every Ray
  gRPC call carries it; a caller without it gets ``UNAUTHENTICATED``;
* Ray's mutual TLS (``RAY_USE_TLS=1``) with a per-level Ray CA in the state dir
  (``STATE/ray/<level>-tls/ca.pem``; each node a certificate for its own address, see
  :func:`issue_node_cert`): a peer without a certificate of the level's Ray CA -- another
  level's node included -- fails the TLS handshake;
* fixed ports from the level's base port (:class:`RayPorts`), its own temp dir and
  namespace ``strata-<level>``; no dashboard, no Ray client server, no metrics export;
* every listener on the node's address: Ray binds its C++ gRPC servers (GCS, raylet,
  object manager, each worker's core worker) to the wildcard address whenever the node
  IP is not loopback, with no option to change it; a small ``bind()`` interposer
  (:data:`BIND_SHIM_SOURCE`, built with the host's C compiler into the state dir and
  ``LD_PRELOAD``-ed into every Ray process of the node) rewrites wildcard binds to the
  node's address.  :func:`listeners_outside` checks the result after start-up.

:class:`WorkerProcess` runs ``python -m strata worker ...`` as a child process (so the
worker's Spark JVM stays in the actor's process tree), reports the worker's address from
its ready file, stops it on request (SIGTERM, SIGKILL to its process group after a
deadline) and -- through ``PR_SET_PDEATHSIG`` -- the worker dies with the actor's process
if that dies first.  :class:`PoolWorker` (the body of the :data:`WorkerActor`) builds the
command on whichever node Ray placed it: the worker listens on *that node's* address and
uses that host's config, state dir and certificates (the node's profile,
:func:`node_profile`).  :class:`WorkerPool` keeps the actors of one level and is what the
scaler drives.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from strata.groups import level_slug

__all__ = ["LevelRayCluster", "RayNode", "RayPorts", "WorkerProcess", "PoolWorker", "WorkerPool", "PoolMember",
           "worker_command", "WorkerActor", "issue_node_cert", "ensure_ray_ca", "ray_tls_dir", "token_path",
           "build_bind_shim", "node_env", "listeners_outside", "default_ray_port", "node_profile",
           "check_node_ip", "NODE_ENV"]

log = logging.getLogger("strata.scaler")

#: unix socket paths are limited to 107 bytes; Ray appends ~70 to its temp dir
MAX_TEMP_DIR = 40
#: the environment variable carrying a node's profile (level, address, config, state dir) to its actors
NODE_ENV = "STRATA_RAY_NODE"
#: the bind shim's setting: the address wildcard binds are rewritten to
BIND_ENV = "STRATA_RAY_BIND_IP"

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
    return level_slug(level)


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def worker_command(config: str, level: str, state_dir: Path, ready_file: Path, *, listen: str = "127.0.0.1:0",
                   multicast_port: int | None = None, spark_master: str | None = None, tls_dir: str | None = None,
                   insecure: bool = False, python: str | None = None, load_reading: str | None = "process") -> list[str]:
    """The ``strata worker`` command line of one pool worker (same keys, certs and group as the level's).

    ``spark_master``: only when given (``strata scale --spark-master``); without it the worker
    uses its level's Spark settings from the configuration (strata/spark_settings.py).
    ``load_reading``: Algorithm 5's CPU reading (worker/load.py); a pool's workers may share a
    host, so by default each reports its own processes (``process``): the host's reading would
    be the same for all of them and would also move with other levels' load.  ``None``: the
    configuration's ``[cluster] load_reading``."""
    cmd = [python or sys.executable, "-m", "strata", "worker", "--config", str(Path(config).resolve()),
           "--level", level, "--listen", listen, "--state-dir", str(Path(state_dir).resolve()),
           "--ready-file", str(ready_file)]
    if spark_master:
        cmd += ["--spark-master", spark_master]
    if load_reading:
        cmd += ["--load-reading", load_reading]
    if multicast_port:
        cmd += ["--multicast-port", str(int(multicast_port))]
    if tls_dir:
        cmd += ["--tls-dir", str(Path(tls_dir).resolve())]
    if insecure:
        cmd.append("--insecure")
    return cmd


def worker_environment(environ) -> dict[str, str]:
    """A pool worker's environment: the actor's, without Ray's settings (``RAY_*``: token path,
    TLS), the node's profile and the bind shim (the worker binds its own explicit address)."""
    env = {k: v for k, v in environ.items()
           if not k.startswith("RAY_") and k not in (NODE_ENV, BIND_ENV, "LD_PRELOAD", "STRATA_SCALE_REEXEC")}
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p and "strata-bind-" not in Path(p).name]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def node_profile(environ=None) -> dict:
    """This Ray node's profile (set by the process that started the node): ``level``, ``node_ip``,
    ``config``, ``state_dir``, ``tls_dir``; ``{}`` outside a Strata node."""
    text = (os.environ if environ is None else environ).get(NODE_ENV)
    if not text:
        return {}
    try:
        prof = json.loads(text)
    except ValueError:
        return {}
    return prof if isinstance(prof, dict) else {}


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
        env = worker_environment(os.environ)  # the worker is not a Ray process: no RAY_*, no bind shim
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


class PoolWorker(WorkerProcess):
    """The body of a pool worker's actor: a :class:`WorkerProcess` whose command is made on the
    node Ray placed the actor on.

    ``spec`` (from the scaler): ``level``, ``config``, ``state_dir``, ``tls_dir``, ``insecure``,
    ``multicast_port``, ``spark_master``, ``load_reading``, ``listen`` (None: this node's
    address, port 0) and ``env`` (the level's multicast group, ...).  The node's profile
    (:func:`node_profile`) gives this host's address, config, state dir and certificates; a
    node of another level refuses the actor."""

    def __init__(self, spec: dict, name: str):
        prof = node_profile()
        level = spec["level"]
        if prof.get("level") and prof["level"] != level:
            raise RuntimeError(f"a worker of level {level} placed on a Ray node of level {prof['level']}")
        ip = prof.get("node_ip")
        if not ip:
            import ray

            ip = ray.util.get_node_ip_address()
        state_dir = Path(prof.get("state_dir") or spec["state_dir"])
        # the scaler's paths hold on its own host (the same state dir); another host's node names its own
        here = state_dir == Path(spec["state_dir"])
        config = prof.get("config") or spec["config"]
        tls_dir = prof.get("tls_dir") or (spec.get("tls_dir") if here else None)
        ready = state_dir / "run" / f"{name}.json"
        logf = state_dir / "logs" / f"{name}.log"
        ready.parent.mkdir(parents=True, exist_ok=True)
        listen = spec.get("listen") or _hostport(ip, 0)
        cmd = worker_command(config, level, state_dir, ready, listen=listen, multicast_port=spec.get("multicast_port"),
                             spark_master=spec.get("spark_master"), tls_dir=tls_dir,
                             insecure=bool(spec.get("insecure")), load_reading=spec.get("load_reading"))
        env = dict(spec.get("env") or {})
        if not ipaddress.ip_address(ip).is_loopback:
            env["STRATA_GROUP_INTERFACE"] = ip  # heartbeats leave (and the group is joined) on this node's interface
        super().__init__(cmd + ["--log-file", str(logf)], str(ready), str(logf), env)
        self.node_ip = ip

    def poll(self) -> dict:
        out = super().poll()
        out["node_ip"] = self.node_ip
        out["log"] = str(self.log_file)
        return out


_actor_class = None


def _worker_actor():
    global _actor_class
    if _actor_class is None:
        import ray

        _actor_class = ray.remote(max_restarts=0, max_task_retries=0)(PoolWorker)
    return _actor_class


def __getattr__(name):  # ``WorkerActor`` is created on first use, after Ray's environment is set
    if name == "WorkerActor":
        return _worker_actor()
    raise AttributeError(name)


# ---- the level's Ray CA, token and bind shim -------------------------------------------------------
def ray_tls_dir(state_dir: Path, level: str) -> Path:
    """``STATE/ray/<level>-tls``: the level's Ray CA and its nodes' certificates."""
    return Path(state_dir).resolve() / "ray" / f"{_slug(level)}-tls"


def token_path(state_dir: Path, level: str) -> Path:
    return Path(state_dir).resolve() / "ray" / f"{_slug(level)}.token"


def _private_dir(path: Path) -> Path:
    if path.name != "ray" and path.parent.name == "ray":
        _private_dir(path.parent)  # STATE/ray itself (token, CA, temp dirs) is private too
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _write_file(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    tmp.replace(path)


class _DirLock:
    def __init__(self, directory: Path):
        self.path = directory / ".lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def ensure_token(state_dir: Path, level: str, create: bool) -> Path:
    """The level's Ray token (0600); made here only if ``create`` (the head's host)."""
    path = token_path(state_dir, level)
    _private_dir(path.parent)
    if not path.exists():
        if not create:
            raise RuntimeError(f"{path} is missing: copy the level's Ray token from the head's host "
                               f"(STATE/ray/{path.name}, mode 0600)")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
    if path.stat().st_mode & 0o077:
        raise RuntimeError(f"{path} is readable by others (mode {path.stat().st_mode & 0o777:o}); chmod 600 it")
    return path


def ensure_ray_ca(state_dir: Path, level: str, create: bool = True) -> Path:
    """The level's Ray CA (``ca.pem``, ``ca.key`` 0600) in :func:`ray_tls_dir`; made if absent and ``create``.

    One CA per level, never shared: a node of another level holds a certificate of another
    CA, which this level's nodes refuse in the TLS handshake (and the other way round)."""
    d = _private_dir(ray_tls_dir(state_dir, level))
    ca = d / "ca.pem"
    with _DirLock(d):
        if ca.exists():
            return ca
        if not create:
            raise RuntimeError(f"{ca} is missing: copy the level's Ray CA certificate from the head's host")
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Strata"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"Strata Ray CA of level {level}")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_file(d / "ca.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()), 0o600)
        _write_file(ca, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        log.info("made the Ray CA of level %s in %s", level, d)
    return ca


def node_cert_paths(tls_dir: Path, ip: str) -> tuple[Path, Path]:
    return tls_dir / f"node-{ip}.pem", tls_dir / f"node-{ip}.key"


def issue_node_cert(state_dir: Path, level: str, ip: str, out: Path | None = None) -> tuple[Path, Path]:
    """A certificate of the level's Ray CA for the node at ``ip`` (server and client use; SANs:
    the address, and loopback); written to :func:`ray_tls_dir`, and -- for another host -- with
    ``ca.pem`` and the level's token under ``out`` as they go in that host's state dir
    (``out/ray/<level>-tls/``, ``out/ray/<level>.token``).  Needs the CA key: run it on the
    head's host."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    addr = ipaddress.ip_address(ip)
    d = ray_tls_dir(state_dir, level)
    ensure_ray_ca(state_dir, level, create=True)
    if not (d / "ca.key").exists():
        raise RuntimeError(f"{d / 'ca.key'} is missing: issue node certificates on the host holding the "
                           f"level's Ray CA (`strata scale cert`), then copy them here")
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.IPAddress(addr), x509.DNSName(str(addr)), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost")]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Strata"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, f"Ray node {addr} of level {level}")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=397))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    kpem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    targets = [d] + ([_private_dir(ray_tls_dir(Path(out), level))] if out is not None else [])
    for t in targets:
        crt, k = node_cert_paths(t, str(addr))
        _write_file(k, kpem, 0o600)
        _write_file(crt, pem, 0o644)
        if t != d:
            _write_file(t / "ca.pem", (d / "ca.pem").read_bytes(), 0o644)
            _write_file(token_path(Path(out), level), ensure_token(state_dir, level, create=True).read_bytes(), 0o600)
    return node_cert_paths(targets[-1], str(addr))


def node_tls(state_dir: Path, level: str, ip: str, create_ca: bool) -> dict[str, str]:
    """``RAY_TLS_*`` for the node at ``ip``: its certificate (issued here when this host holds the CA key)."""
    d = ray_tls_dir(state_dir, level)
    ca = ensure_ray_ca(state_dir, level, create=create_ca)
    crt, key = node_cert_paths(d, ip)
    if not crt.exists() or not key.exists():
        if not (d / "ca.key").exists():
            raise RuntimeError(f"no Ray certificate for {ip} in {d}: on the head's host run `strata scale cert "
                               f"--level {level} --state-dir STATE --ip {ip} --out DIR` and copy DIR's files to {d}")
        issue_node_cert(state_dir, level, ip)
    if key.stat().st_mode & 0o077:
        raise RuntimeError(f"{key} is readable by others; chmod 600 it")
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(crt), "RAY_TLS_SERVER_KEY": str(key),
            "RAY_TLS_CA_CERT": str(ca)}


#: ``bind()`` for Ray's processes: a bind to the wildcard address (0.0.0.0 or ::) goes to
#: $STRATA_RAY_BIND_IP instead (IPv4 in an IPv6 socket as ::ffff:a.b.c.d); any other bind is
#: untouched.  Ray 2.x binds its C++ gRPC servers to the wildcard for a non-loopback node IP.
BIND_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("STRATA_RAY_BIND_IP");
    if (ip && addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && inet_pton(AF_INET, ip, &a.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    } else if (ip && addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        struct in_addr v4;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            if (inet_pton(AF_INET, ip, &v4) == 1) {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
            if (inet_pton(AF_INET6, ip, &a.sin6_addr) == 1)
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
"""


def build_bind_shim(state_dir: Path) -> Path:
    """The bind shim as a shared object in ``STATE/ray/`` (built once per source version with
    ``$CC`` or ``cc``); raises RuntimeError without a C compiler."""
    digest = hashlib.sha256(BIND_SHIM_SOURCE.encode()).hexdigest()[:12]
    d = _private_dir(Path(state_dir).resolve() / "ray")
    so = d / f"strata-bind-{digest}.so"
    if any(c in str(so) for c in " :\t\n"):
        raise RuntimeError(f"{so}: LD_PRELOAD cannot name a path with spaces or colons; use another state dir")
    if so.exists():
        return so
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("Ray binds its gRPC servers to 0.0.0.0 on a node that is not loopback-only; Strata "
                           "rewrites those binds to the level's address with a small LD_PRELOAD shim, and "
                           "building it needs a C compiler (install gcc), or accept wildcard listeners "
                           "(still mutual TLS and the level's token) with --ray-bind-any")
    with _DirLock(d), tempfile.TemporaryDirectory(prefix="strata-bind-") as tmp:
        if so.exists():
            return so
        src = Path(tmp) / "bind.c"
        src.write_text(BIND_SHIM_SOURCE)
        out = Path(tmp) / "bind.so"
        r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl"], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"building the bind shim with {cc} failed: {r.stderr.strip()[-500:]}")
        shutil.copyfile(out, so.with_suffix(".tmp"))
        os.chmod(so.with_suffix(".tmp"), 0o755)
        so.with_suffix(".tmp").replace(so)
    log.info("built the bind shim %s", so)
    return so


def check_node_ip(ip: str) -> str:
    """``ip`` as a canonical address of one of this host's interfaces (else ValueError)."""
    try:
        addr = ipaddress.ip_address(ip.strip().strip("[]"))
    except ValueError:
        raise ValueError(f"--node-ip {ip!r} is not an IP address (give the level's interface address)") from None
    if addr.is_unspecified:
        raise ValueError(f"--node-ip {ip}: not a wildcard address; give the level's interface address")
    import psutil

    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    if str(addr) not in local:
        raise ValueError(f"--node-ip {addr} is not an address of this host (its addresses: "
                         f"{', '.join(sorted(local))})")
    return str(addr)


# ---- ports -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RayPorts:
    """The ports of one node of a level's Ray cluster, from the level's base port.

    ======================  ======================================================
    base                    GCS (the head only; the cluster's address)
    base + 1                raylet: node manager
    base + 2                raylet: object manager
    base + 3                runtime-env agent (HTTP)
    base + 4                dashboard agent gRPC (metrics agent) -- only with ray[default]
    base + 5                metrics export (Prometheus) -- only with ray[default]
    base + 6                dashboard agent HTTP -- only with ray[default]
    base + 7                the head's dashboard API server, on loopback -- only with ray[default]
    base + 10 ...           one per Ray worker process (the driver, each actor, Ray's idle
                            pooled workers): ``workers`` ports
    ======================  ======================================================
    """

    base: int
    workers: int = 40

    def __post_init__(self):
        if not 1024 <= self.base or self.base + 10 + self.workers - 1 > 65535 or self.workers < 4:
            raise ValueError(f"Ray ports {self.base}..{self.base + 10 + self.workers - 1}: need 1024 <= base, "
                             f"at least 4 worker ports and the last port <= 65535")

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def worker_range(self) -> tuple[int, int]:
        return self.base + 10, self.base + 10 + self.workers - 1

    def as_dict(self) -> dict:
        lo, hi = self.worker_range
        return {"gcs": self.base, "node_manager": self.base + 1, "object_manager": self.base + 2,
                "runtime_env_agent": self.base + 3, "metrics_agent": self.base + 4, "metrics_export": self.base + 5,
                "dashboard_agent_http": self.base + 6, "dashboard": self.base + 7, "workers": [lo, hi]}


def default_ray_port(cfg, level: str) -> int:
    """The level's base Ray port: ``[groups."L"] ray_port``, else 46000 + 100 x the level's
    position in the lattice (46000 U, 46100 C, 46200 S, 46300 TS for the example lattice)."""
    port = cfg.group(level).ray_port
    if port is not None:
        return port
    levels = list(cfg.lattice.levels)
    idx = levels.index(level) if level in levels else zlib.crc32(level.encode()) % 150
    return 46000 + 100 * idx


def _temp_dir(state_dir: Path, slug: str, suffix: str = "") -> tuple[Path, Path | None]:
    """``STATE/ray/<level><suffix>`` for Ray's session files, or -- when that is too long for
    Ray's unix sockets -- a short directory under $TMPDIR linked from there (returned second,
    to remove on exit)."""
    base = _private_dir(Path(state_dir).resolve() / "ray")
    want = base / f"{slug}{suffix}"
    if len(str(want)) <= MAX_TEMP_DIR:
        if want.is_symlink():
            want.unlink()
        want.mkdir(exist_ok=True)
        return want, None
    short = Path(tempfile.mkdtemp(prefix=f"strata-ray-{slug[:8]}-"))
    if want.is_symlink() or want.exists():
        if want.is_symlink():
            want.unlink()
        else:
            shutil.rmtree(want, ignore_errors=True)
    want.symlink_to(short, target_is_directory=True)
    return short, short


def node_env(level: str, state_dir: Path, node_ip: str, *, head: bool, profile: dict,
             bind_any: bool = False) -> dict[str, str]:
    """The environment of a node of a level's multi-host Ray cluster (set before Ray starts;
    every Ray process of the node inherits it): token, TLS, bind shim, the node's profile."""
    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
           "RAY_AUTH_TOKEN_PATH": str(ensure_token(state_dir, level, create=head)),
           "RAY_enable_metrics_collection": "0",  # no metrics export (nothing scrapes it)
           NODE_ENV: json.dumps(profile, sort_keys=True)}
    if head:  # Ray gives its new GCS ~20 s to answer; a loaded host (Spark workers starting) needs longer:
        # seen failing as "No such file ... gcs_server.err" after 30 s at a load of 10 on 2 cores
        env["RAY_gcs_server_port_wait_time_s"] = os.environ.get("RAY_gcs_server_port_wait_time_s", "60")
    env.update(node_tls(state_dir, level, node_ip, create_ca=head))
    if not bind_any:
        shim = str(build_bind_shim(state_dir))
        pre = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and "strata-bind-" not in Path(p).name]
        env["LD_PRELOAD"] = ":".join([shim] + pre)
        env[BIND_ENV] = node_ip
    return env


def listeners_outside(pids, node_ip: str | None) -> list[tuple]:
    """TCP listeners (and bound UDP sockets) of ``pids`` on neither ``node_ip`` nor loopback:
    wildcard or another interface's address.  [(pid, name, proto, ip, port)]"""
    import socket as so

    import psutil

    ok = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    if node_ip:
        ok |= {node_ip, f"::ffff:{node_ip}"}
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except psutil.Error:
            continue
        for c in conns:
            if not c.laddr or c.laddr.ip in ok:
                continue
            if c.type == so.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
                out.append((pid, name, "tcp", c.laddr.ip, c.laddr.port))
            elif c.type == so.SOCK_DGRAM and not c.raddr and not ipaddress.ip_address(c.laddr.ip).is_multicast:
                out.append((pid, name, "udp", c.laddr.ip, c.laddr.port))
    return out


# ---- the nodes of a level's Ray cluster ------------------------------------------------------------
def _level_resource(level: str) -> str:
    """A custom Ray resource every node of the level offers and every pool worker asks for."""
    return f"strata-level-{_slug(level)}"


class RayNode:
    """One node of a level's multi-host Ray cluster, started in this process (Ray's processes are
    its children and die with it): the **head** (GCS and raylet; the cluster's address is
    ``node_ip:port``) or a node **joining** the head at ``address``.

    ``num_cpus``: the CPUs this node offers the level's worker actors (0: none, e.g. a head on
    the master's host).  ``config``/``tls_dir``: this host's paths, handed to the actors placed
    here through the node's profile (:data:`NODE_ENV`)."""

    def __init__(self, level: str, state_dir: Path, node_ip: str, *, head: bool, address: str | None = None,
                 port: int = 46000, num_cpus: int = 1, object_store_mb: int = 128, worker_ports: int = 40,
                 bind_any: bool = False, config: str | None = None, tls_dir: str | None = None):
        if not head and not address:
            raise ValueError("a Ray node that is not the head needs the head's address (HOST:PORT)")
        self.level = level
        self.slug = _slug(level)
        self.state_dir = Path(state_dir).resolve()
        self.node_ip = node_ip
        self.head = head
        self.ports = RayPorts(int(port), int(worker_ports))
        self.address = _hostport(node_ip, self.ports.gcs) if head else address
        self.num_cpus = int(num_cpus)
        self.object_store_mb = int(object_store_mb)
        self.bind_any = bind_any
        self.profile = {"level": level, "node_ip": node_ip, "state_dir": str(self.state_dir),
                        "config": str(Path(config).resolve()) if config else None,
                        "tls_dir": str(Path(tls_dir).resolve()) if tls_dir else None}
        self.node = None
        self.temp_dir: Path | None = None
        self._short_dir: Path | None = None
        self.started_in: float | None = None
        self._procs: dict[int, object] = {}  # Ray's processes seen (psutil handles): orphans are stopped too

    def track(self) -> None:
        """Remember this node's processes: an agent whose raylet died is no longer our descendant."""
        for p in _descendants():
            self._procs.setdefault(p.pid, p)

    def _params(self):
        from ray._private.parameter import RayParams

        p = self.ports.as_dict()
        lo, hi = self.ports.worker_range
        params = RayParams(
            node_ip_address=self.node_ip, node_name=f"strata-{self.slug}-{self.node_ip}", num_cpus=self.num_cpus,
            resources={_level_resource(self.level): 10000}, object_store_memory=self.object_store_mb * 1024 * 1024,
            temp_dir=str(self.temp_dir), include_dashboard=False, dashboard_host="127.0.0.1",
            dashboard_port=p["dashboard"], node_manager_port=p["node_manager"], object_manager_port=p["object_manager"],
            runtime_env_agent_port=p["runtime_env_agent"], metrics_agent_port=p["metrics_agent"],
            metrics_export_port=p["metrics_export"], dashboard_agent_listen_port=p["dashboard_agent_http"],
            min_worker_port=lo, max_worker_port=hi, ray_client_server_port=None,
            # no autoscaler monitor on the head: the scaler is the level's autoscaler, and Ray's (a Python
            # process started before the raylet) only competed with the raylet's 30 s to register
            no_monitor=True)
        if self.head:
            params.gcs_server_port = self.ports.gcs
        else:
            params.gcs_address = self.address
        return params

    def start(self) -> dict:
        t0 = time.monotonic()
        env = node_env(self.level, self.state_dir, self.node_ip, head=self.head, profile=self.profile,
                       bind_any=self.bind_any)
        if os.environ.pop("RAY_ADDRESS", None):
            log.warning("ignoring RAY_ADDRESS: the level's Ray cluster is given by --node-ip/--address")
        if "ray._raylet" in sys.modules:  # Ray reads RAY_USE_TLS & co. once, when it loads
            raise RuntimeError("Ray was loaded before the level's Ray settings (TLS, token) were set; start the "
                               "node in a fresh process")
        os.environ.update(env)
        self.temp_dir, self._short_dir = _temp_dir(self.state_dir, self.slug, "" if self.head else "-node")
        from ray._private.node import Node

        for attempt in (1, 2):
            try:
                self.node = Node(self._params(), head=self.head, shutdown_at_exit=False, spawn_reaper=True)
                break
            except Exception as e:  # noqa: BLE001 - Ray gives its raylet a fixed 30 s to register
                _kill_all(_descendants())
                why = _startup_logs(self.temp_dir)  # Ray's own message rarely says why (its processes' logs do)
                # a GCS that never answered: Ray then fails reading a gcs_server.err it no longer writes
                if not any(s in str(e) for s in ("timed out during startup", "gcs_server.err")) or attempt == 2:
                    self._remove_short_dir()
                    raise RuntimeError(f"the Ray {'head' if self.head else 'node'} of level {self.level} at "
                                       f"{self.node_ip} did not start after {time.monotonic() - t0:.0f} s: {e} "
                                       f"[{why}]") from e
                log.warning("Ray node did not start (attempt %d of 2, host busy?) after %.0f s: %s [%s]; retrying",
                            attempt, time.monotonic() - t0, e, why)
        self.started_in = time.monotonic() - t0
        self.track()
        outside = listeners_outside([os.getpid()] + [p.pid for p in _descendants()], self.node_ip)
        if outside and not self.bind_any:
            self.stop()
            raise RuntimeError(f"Ray listens beyond the level's address {self.node_ip}: {outside} "
                               f"(bind shim not effective?)")
        return self.info()

    def info(self) -> dict:
        return {"head": self.head, "address": self.address, "node_ip": self.node_ip, "ports": self.ports.as_dict(),
                "cpus": self.num_cpus, "temp_dir": str(self.temp_dir) if self.temp_dir else None,
                "tls": str(ray_tls_dir(self.state_dir, self.level)), "bind_shim": not self.bind_any,
                "started_in": self.started_in}

    def alive(self) -> bool:
        """Whether this node's raylet (and, for the head, its GCS) still runs."""
        from ray._private import ray_constants

        if self.node is None:
            return False
        self.track()
        kinds = [ray_constants.PROCESS_TYPE_RAYLET] + ([ray_constants.PROCESS_TYPE_GCS_SERVER] if self.head else [])
        for kind in kinds:
            infos = self.node.all_processes.get(kind) or []
            if not infos or infos[0].process.poll() is not None:
                return False
        return True

    def stop(self, timeout: float = 5.0) -> list[int]:
        """Stop Ray's processes of this node; SIGKILL whatever of this process's children is left
        after ``timeout`` (returned): actors and the workers they run included (Ray's agents
        ignore SIGTERM once their raylet is gone)."""
        import psutil

        self.track()
        procs = list(self._procs.values())
        if self.node is not None:
            try:
                self.node.kill_all_processes(check_alive=False, allow_graceful=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("kill_all_processes: %s", e)
            self.node = None
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        _kill_all(alive)
        psutil.wait_procs(alive, timeout=5)
        self._remove_short_dir()
        return [p.pid for p in alive]

    def _remove_short_dir(self) -> None:
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)
            link = self.state_dir / "ray" / (self.slug if self.head else f"{self.slug}-node")
            if link.is_symlink():
                link.unlink()
            self._short_dir = None


class LevelRayCluster:
    """The level's Ray cluster as the scaler sees it: a private local head (``local``), a head
    this process starts on ``node_ip`` for other hosts to join (``head``), or an existing
    cluster at ``address`` reached through this host's node at ``node_ip`` (``join``).  In
    every mode this process is the cluster's driver."""

    def __init__(self, level: str, state_dir: Path, num_cpus: int, object_store_mb: int = 128, *,
                 node_ip: str | None = None, address: str | None = None, port: int | None = None,
                 worker_ports: int = 40, bind_any: bool = False, config: str | None = None,
                 tls_dir: str | None = None):
        if address and not node_ip:
            raise ValueError("joining a level's Ray cluster (--address) needs this host's --node-ip")
        self.level = level
        self.slug = _slug(level)
        self.state_dir = Path(state_dir).resolve()
        self.num_cpus = int(num_cpus)
        self.object_store_mb = int(object_store_mb)
        self.node_ip = node_ip
        self.address = address
        self.port = port
        self.worker_ports = worker_ports
        self.bind_any = bind_any
        self.config = config
        self.tls_dir = tls_dir
        self.mode = "join" if address else ("head" if node_ip else "local")
        self.namespace = f"strata-{self.slug}"
        self.temp_dir: Path | None = None
        self._short_dir: Path | None = None
        self.node: RayNode | None = None
        self.info: dict = {}

    @property
    def resource(self) -> str:
        return _level_resource(self.level)

    def _prepare_dirs(self) -> Path:
        path, self._short_dir = _temp_dir(self.state_dir, self.slug)
        return path

    def _token(self) -> Path:
        return ensure_token(self.state_dir, self.level, create=True)

    def start(self) -> dict:
        if self.mode == "local":
            return self._start_local()
        if "ray._raylet" in sys.modules:  # Ray reads RAY_USE_TLS & co. once, when it loads
            raise RuntimeError("Ray was loaded before the level's Ray settings (TLS, token) were set; start the "
                               "level's Ray cluster in a fresh process")
        t0 = time.monotonic()
        if self.mode == "head":
            self.node = RayNode(self.level, self.state_dir, self.node_ip, head=True, port=self.port,
                                num_cpus=self.num_cpus, object_store_mb=self.object_store_mb,
                                worker_ports=self.worker_ports, bind_any=self.bind_any, config=self.config,
                                tls_dir=self.tls_dir)
            self.node.start()
            address, self.temp_dir = self.node.address, self.node.temp_dir
        else:
            os.environ.pop("RAY_ADDRESS", None)
            os.environ.update(node_env(self.level, self.state_dir, self.node_ip, head=False, profile={},
                                       bind_any=self.bind_any))
            address = self.address
        import ray

        try:
            ctx = ray.init(address=address, _node_ip_address=self.node_ip, namespace=self.namespace,
                           log_to_driver=False, configure_logging=False)
        except Exception as e:
            if self.node is not None:
                self.node.stop()
            hint = ("" if self.mode == "head" else
                    f" (is a node of the level running on this host at {self.node_ip}? `strata scale node "
                    f"--address {address} --node-ip {self.node_ip}` starts one)")
            raise RuntimeError(f"cannot connect to the level's Ray cluster at {address}: {e}{hint}") from e
        self.info = dict(ctx.address_info)
        self.info.update(mode=self.mode, started_in=time.monotonic() - t0,
                         node_started_in=self.node.started_in if self.node is not None else None,
                         ports=RayPorts(self.port, self.worker_ports).as_dict() if self.port else None)
        outside = listeners_outside([os.getpid()], self.node_ip)
        if outside and not self.bind_any:
            self.stop()
            raise RuntimeError(f"this process's Ray listener is beyond the level's address {self.node_ip}: "
                               f"{outside}; run it through `strata scale` (which preloads the bind shim) or "
                               f"give --ray-bind-any")
        return self.info

    def _start_local(self) -> dict:
        if os.environ.get("RAY_ADDRESS"):
            log.warning("ignoring RAY_ADDRESS=%s: each level starts its own Ray cluster", os.environ["RAY_ADDRESS"])
            os.environ.pop("RAY_ADDRESS")
        t0 = time.monotonic()
        self.temp_dir = self._prepare_dirs()
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node IP = loopback, listeners on loopback
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray waits 30 s for its GCS to bind; give a loaded host (Spark workers starting) longer
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "60")
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(self._token())
        os.environ[NODE_ENV] = json.dumps({"level": self.level, "node_ip": "127.0.0.1",
                                           "state_dir": str(self.state_dir), "config": None, "tls_dir": None})
        import ray
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the variable was set
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to a Ray cluster; the scaler needs its own")
        for attempt in range(1, 3):
            try:
                ctx = ray.init(address="local", num_cpus=self.num_cpus, namespace=self.namespace,
                               resources={self.resource: 10000},
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
        self.info.update(mode="local", started_in=time.monotonic() - t0)
        if self.info.get("node_ip_address") not in ("127.0.0.1", None):
            log.warning("Ray node IP is %s, not loopback", self.info.get("node_ip_address"))
        return self.info

    def nodes(self) -> list[dict]:
        """The cluster's nodes: address, alive, CPUs."""
        import ray

        if self.node is not None:
            self.node.track()

        out = []
        for n in ray.nodes():
            out.append({"ip": n.get("NodeManagerAddress"), "alive": bool(n.get("Alive")),
                        "cpus": float((n.get("Resources") or {}).get("CPU", 0.0)),
                        "name": n.get("NodeName"), "id": (n.get("NodeID") or "")[:12]})
        return sorted(out, key=lambda n: (not n["alive"], n["ip"] or ""))

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
        """Disconnect; stop the Ray processes this process started (the local head, or the head
        node); then SIGKILL any of its children still alive after ``timeout`` (returned)."""
        import psutil
        import ray

        procs = _descendants()
        if ray.is_initialized():
            ray.shutdown()
        if self.node is not None:
            self.node.stop()
            self.node = None
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


def _startup_logs(temp_dir: Path | None, lines: int = 4) -> str:
    """The last warnings and errors in the GCS's and the raylet's logs of the latest Ray session under
    ``temp_dir``: why a start-up failed (Ray's exception only says that it timed out)."""
    if temp_dir is None:
        return "no Ray temp dir"
    logs = Path(temp_dir) / "session_latest" / "logs"
    out = []
    for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
        try:
            text = (logs / name).read_text(errors="replace")
        except OSError:
            continue
        picked = [ln.strip()[-240:] for ln in text.splitlines() if any(k in ln[:40] for k in (" W ", " E ", " C "))]
        out.append(f"{name}: " + (" | ".join(picked[-lines:]) if picked else f"{len(text)} bytes, no warning"))
    return "; ".join(out) or f"no GCS or raylet log in {logs}"


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
    started_at: float
    log_file: Path | None = None  # on the worker's node (reported by its actor)
    state: str = "starting"  # starting | ready | draining
    pid: int = 0
    address: str | None = None
    ready_at: float | None = None
    spawn_ref: object = None
    stop_ref: object = None
    stop_started: float | None = None
    tree: set[int] = field(default_factory=set)
    node_ip: str | None = None  # the node Ray placed the worker on


class WorkerPool:
    """The worker actors of one level: start (anywhere in the level's Ray cluster), watch, drain, stop.

    ``spec``: what every worker runs (see :class:`PoolWorker`); ``placement``: ``spread`` (Ray's
    SPREAD strategy: new workers go to the least used nodes first, across hosts) or ``pack``
    (Ray's default: fill a node before the next).  Each actor asks for ``actor_cpus`` CPUs and
    the level's node resource, so it only lands on a node of the level with a free CPU."""

    def __init__(self, level: str, state_dir: Path, spec: dict, *, actor_cpus: float = 1.0,
                 start_timeout: float = 300.0, stop_grace: float = 15.0, env: dict | None = None,
                 placement: str = "spread", clock=time.monotonic):
        if placement not in ("spread", "pack"):
            raise ValueError(f"placement {placement!r}: spread or pack")
        self.level = level
        self.slug = _slug(level)
        self.state_dir = Path(state_dir).resolve()
        self.spec = {**spec, "level": level, "env": {**(spec.get("env") or {}), **(env or {})}}
        self.placement = placement
        self.actor_cpus = actor_cpus
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
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
        return [{"name": m.name, "state": m.state, "sid": m.address, "node_ip": m.node_ip, "pid": m.pid,
                 "tree": sorted(m.tree), "log": str(m.log_file) if m.log_file else None}
                for m in self.members.values()]

    # -- actions -----------------------------------------------------------------------------
    def add(self, k: int) -> list[str]:
        actor_cls = _worker_actor()
        names = []
        for _ in range(k):
            self._n += 1
            name = f"scaled-{self.slug}-{os.getpid()}-{self._n}"
            actor = actor_cls.options(name=name, num_cpus=self.actor_cpus, resources={_level_resource(self.level): 1},
                                      scheduling_strategy="SPREAD" if self.placement == "spread" else "DEFAULT"
                                      ).remote(self.spec, name)
            m = PoolMember(name, actor, self.clock())
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
            m.node_ip = st.get("node_ip") or m.node_ip
            if st.get("log"):
                m.log_file = Path(st["log"])
            if m.state == "starting":
                if st["address"]:
                    m.address, m.state, m.ready_at = st["address"], "ready", self.clock()
                    try:
                        m.tree = set(ray.get(m.actor.pids.remote(), timeout=30))
                    except Exception:
                        pass
                    events.append(f"{m.name} ready at {m.address} (node {m.node_ip}, pid {m.pid}) after "
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
