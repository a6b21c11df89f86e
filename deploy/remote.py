"""Running things on a host: transports (operator side) and the host agent (host side).

Operator side, a :class:`Transport` runs an argv on a host and copies files to it:

* :class:`SshTransport`: ``ssh -o BatchMode=yes ... -- user@host <quoted argv>``
  (the argv is a list; every word is ``shlex.quote``-d for the remote shell,
  so nothing from the inventory is ever interpreted by a shell) and ``scp``;
* :class:`NetnsTransport`: ``ip netns exec <ns> <argv>`` (the tests' "hosts":
  network namespaces on one machine, sharing its filesystem);
* :class:`LocalTransport`: this machine.

Host side, ``python -m strata.deploy.remote <command>`` is the agent the
operator's ``strata deploy`` runs through a transport:

``ports``   (JSON on stdin) a port for each process whose inventory port is 0: the one
            it had before (``<state-dir>/run/ports.json``), else a free one, recorded
``start``   (plan as JSON on stdin) start the host's processes in the background,
            each in its own session (``setsid``) with output to ``logs/<name>.log``,
            or as systemd units; record them in ``<state-dir>/run/deployment.json``;
            with ``fresh``, first set the masters' event logs aside (``up --fresh``)
``spark-start`` (plan as JSON on stdin) start the host's Spark standalone daemons of
            the levels' own clusters (deploy/spark_daemons.py) in the background, each in
            its own session; record them in ``<state-dir>/run/spark.json``
``status``  liveness, readiness (the address from the ready file; a Spark daemon's
            start-up line in its log) and log tails
``stop``    stop what ``start`` and ``spark-start`` recorded (only processes whose command
            line is ours): the Strata processes first, then the Spark daemons
``probe``   listen on a level's multicast group with its key and report which
            members are heard (proof that heartbeats cross between hosts)
``check``   the host's Python and Strata version (reachability)

Every command prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import strata

from . import spark_daemons as sd

__all__ = ["Transport", "SshTransport", "NetnsTransport", "LocalTransport", "RemoteError", "transport_for",
           "transport_from_record", "agent_argv"]

RECORD = "deployment.json"
SPARK_RECORD = "spark.json"
_SAFE_PATH = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,+-/@=")


class RemoteError(RuntimeError):
    pass


# ================================================================================================
# operator side
# ================================================================================================
class Transport:
    kind = "?"
    shares_filesystem = False

    def __init__(self, host_name: str):
        self.host_name = host_name

    def wrap(self, argv: list[str]) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kind": self.kind}

    def run(self, argv: list[str], input: bytes | None = None, timeout: float = 120.0,
            check: bool = True) -> subprocess.CompletedProcess:
        cmd = self.wrap([str(a) for a in argv])
        try:
            r = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{self.host_name}: {shlex.join(argv[:4])} ... did not finish within "
                              f"{timeout:.0f} s") from None
        except FileNotFoundError as e:
            raise RemoteError(f"{self.host_name}: cannot run {cmd[0]}: {e.strerror}") from None
        if check and r.returncode != 0:
            tail = (r.stderr or b"").decode(errors="replace").strip()[-1500:]
            raise RemoteError(f"{self.host_name}: `{shlex.join(argv)}` exited {r.returncode}"
                              + (f":\n{tail}" if tail else ""))
        return r

    def run_json(self, argv: list[str], input: bytes | None = None, timeout: float = 120.0) -> dict:
        r = self.run(argv, input=input, timeout=timeout, check=False)
        out = (r.stdout or b"").decode(errors="replace").strip().splitlines()
        try:
            data = json.loads(out[-1]) if out else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            tail = ((r.stderr or b"") + (r.stdout or b"")).decode(errors="replace").strip()[-1500:]
            raise RemoteError(f"{self.host_name}: `{shlex.join(argv[:6])}` ... exited {r.returncode} "
                              f"without an answer" + (f":\n{tail}" if tail else ""))
        if data.get("error"):
            raise RemoteError(f"{self.host_name}: {data['error']}")
        return data

    def mkdirs(self, dirs: list[str], mode: int = 0o700) -> None:
        if dirs:
            self.run(["mkdir", "-p", "-m", f"{mode:o}", "--", *dirs])

    def put(self, src: Path, dst: str, mode: int = 0o600) -> bool:
        """Copy ``src`` (a local file) to ``dst`` on the host; False if they are the same file."""
        raise NotImplementedError  # pragma: no cover

    def put_text(self, text: str, dst: str, mode: int = 0o644) -> None:
        with tempfile.TemporaryDirectory(prefix="strata-deploy-") as d:  # (0700)
            p = Path(d) / Path(dst).name
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may hold a secret
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self.put(p, dst, mode)


class _SharedFs(Transport):
    shares_filesystem = True

    def put(self, src: Path, dst: str, mode: int = 0o600) -> bool:
        src, target = Path(src), Path(dst)
        if not src.exists():
            raise RemoteError(f"{self.host_name}: cannot copy {src}: no such file")
        if target.exists() and os.path.samefile(src, target):
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        # hosts prepared in parallel threads of this one process may write the same file: the
        # temporary name is unique per host and attempt, and the last rename wins (same content)
        tmp = target.with_name(f".{target.name}.{temp_suffix(self.host_name)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
                shutil.copyfileobj(s, f)
            os.chmod(tmp, mode)
            try:
                tmp.replace(target)
            except OSError:
                if not _same_content(src, target):
                    raise
        finally:
            tmp.unlink(missing_ok=True)
        return True


class LocalTransport(_SharedFs):
    kind = "local"

    def wrap(self, argv: list[str]) -> list[str]:
        return list(argv)


class NetnsTransport(_SharedFs):
    """A "host" that is a network namespace of this machine (``ip netns exec``)."""

    kind = "netns"

    def __init__(self, host_name: str, netns: str):
        super().__init__(host_name)
        if not netns or netns.startswith("-") or "/" in netns:
            raise ValueError(f"bad namespace name {netns!r}")
        self.netns = netns

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def describe(self) -> dict:
        return {"kind": self.kind, "netns": self.netns}


class SshTransport(Transport):
    """ssh/scp with BatchMode (never prompts) and no remote shell interpretation of our words."""

    kind = "ssh"

    def __init__(self, host_name: str, target: str, options: tuple[str, ...] = (), connect_timeout: int = 10):
        super().__init__(host_name)
        if not target or target.startswith("-") or any(c.isspace() for c in target):
            raise ValueError(f"bad ssh destination {target!r}")
        self.target = target
        self.options = tuple(options)
        self.connect_timeout = connect_timeout

    def _opts(self) -> list[str]:
        out = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}",
               "-o", "ServerAliveInterval=15"]
        for o in self.options:
            out += ["-o", o]
        return out

    @staticmethod
    def remote_command(argv: list[str]) -> str:
        """The one string ssh hands to the remote shell: every word quoted."""
        return " ".join(shlex.quote(str(a)) for a in argv)

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ssh", *self._opts(), "--", self.target, self.remote_command(argv)]

    def describe(self) -> dict:
        return {"kind": self.kind, "target": self.target, "options": list(self.options)}

    def put(self, src: Path, dst: str, mode: int = 0o600) -> bool:
        if not set(dst) <= _SAFE_PATH or not dst.startswith("/"):
            raise RemoteError(f"{self.host_name}: remote path {dst!r} must be absolute and plain "
                              f"(letters, digits, _.,+-/@=)")
        if not Path(src).exists():
            raise RemoteError(f"{self.host_name}: cannot copy {src}: no such file")
        parent = dst.rsplit("/", 1)[0] or "/"
        # unique per host and attempt: hosts that share a file system (NFS, or several "hosts" on
        # one machine) are prepared in parallel and may copy the same file at the same moment
        tmp = f"{dst}.{temp_suffix(self.host_name)}"
        # the directory first (a fresh one 0700 for private files), then the file under a
        # temporary name, its mode, and an atomic rename: a reader never sees a partial key
        dir_mode = "700" if mode & 0o077 == 0 else "755"
        self.run(["mkdir", "-p", "-m", dir_mode, "--", parent])
        cmd = ["scp", "-q", *self._opts(), "--", str(src), f"{self.target}:{tmp}"]
        placed = False
        try:
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=120)
            except subprocess.TimeoutExpired:
                raise RemoteError(f"{self.host_name}: scp {src} did not finish within 120 s") from None
            if r.returncode != 0:
                raise RemoteError(f"{self.host_name}: scp {src} → {dst} failed: "
                                  f"{r.stderr.decode(errors='replace').strip()[-800:]}")
            self.run(["chmod", f"{mode:o}", "--", tmp])
            mv = self.run(["mv", "-f", "--", tmp, dst], check=False)
            placed = mv.returncode == 0
            if not placed and self.run(["cmp", "-s", "--", tmp, dst], check=False).returncode != 0:
                # (an identical file already in place, e.g. on a read-only shared mount, is fine)
                raise RemoteError(f"{self.host_name}: cannot move {src} into place as {dst}: "
                                  f"{(mv.stderr or b'').decode(errors='replace').strip()[-800:]}")
        finally:
            if not placed:  # no temporary copy left behind, whatever failed
                try:
                    self.run(["rm", "-f", "--", tmp], check=False)
                except RemoteError:
                    pass
        return True


def temp_suffix(host_name: str) -> str:
    """A temporary file name's tail, unique per host and attempt: host, operator pid, random."""
    return f"strata-tmp.{host_name}.{os.getpid()}.{secrets.token_hex(4)}"


def _same_content(a: Path, b: Path) -> bool:
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 16), fb.read(1 << 16)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def transport_for(host) -> Transport:
    """The transport of an inventory :class:`~strata.deploy.inventory.Host`."""
    if host.transport == "ssh":
        return SshTransport(host.name, host.target, host.ssh_options)
    if host.transport == "netns":
        return NetnsTransport(host.name, host.target)
    return LocalTransport(host.name)


def transport_from_record(name: str, d: dict) -> Transport:
    kind = d.get("kind")
    if kind == "ssh":
        return SshTransport(name, d["target"], tuple(d.get("options", ())))
    if kind == "netns":
        return NetnsTransport(name, d["netns"])
    if kind == "local":
        return LocalTransport(name)
    raise RemoteError(f"{name}: unknown transport {kind!r} in the deployment record")


def agent_argv(python: str, command: str, *args: str) -> list[str]:
    return [python, "-m", "strata.deploy.remote", command, *args]


# ================================================================================================
# host side: the agent
# ================================================================================================
def _reply(obj: dict) -> int:
    print(json.dumps(obj), flush=True)
    return 0 if not obj.get("error") else 2


def _record_path(state_dir: str, name: str = RECORD) -> Path:
    return Path(state_dir) / "run" / name


def _load_record(state_dir: str, name: str = RECORD) -> dict | None:
    p = _record_path(state_dir, name)
    if not p.exists():
        return None
    return json.loads(p.read_text())


def _write_record(state_dir: str, name: str, record: dict) -> None:
    path = _record_path(state_dir, name)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ours(p: dict) -> bool:
    """The pid is alive and still runs the command we started (not a reused pid): its command
    line holds the process's ready file (a Spark daemon's: its properties file, ``mark``)."""
    pid = int(p.get("pid") or 0)
    if pid <= 0:
        return False
    cmd = _cmdline(pid)
    if not cmd or (p.get("mark") or p["ready"]) not in cmd:
        return False
    try:  # a zombie is gone
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _groups_alive(pgids: list[int]) -> set[int]:
    """Those of the process groups that still have a running (non-zombie) member."""
    want, alive = set(pgids), set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in want:
            alive.add(int(fields[2]))
    return alive


def _tail(path: str, n: int = 2500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise RemoteError(f"systemctl {' '.join(args)}: {r.stderr.strip()[-800:]}")
    return r


def _unit_state(unit: str) -> dict:
    r = _systemctl("show", "--property=ActiveState,SubState,MainPID,NRestarts", unit, check=False)
    props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return props


def _still_running(state_dir: str, records: tuple[str, ...] = (RECORD, SPARK_RECORD)) -> str | None:
    """The refusal to start over processes (or Spark daemons) this host's records list that still run."""
    for name in records:
        old = _load_record(state_dir, name)
        if old:
            running = [p["name"] for p in old.get("processes", old.get("daemons", [])) if _alive(old, p)]
            if running:
                return (f"already running in {state_dir}: {', '.join(running)} (deployment "
                        f"{old.get('deployment')}); run `strata deploy down` first")
    return None


# ---- stable ports: a process with port 0 gets a free port once, kept in run/ports.json ----------
PORTS = "ports.json"
PORT_FLOOR = 10000  # chosen ports lie in [PORT_FLOOR, the kernel's ephemeral range): never an outgoing one's


def _port_free(address: str, port: int) -> bool:
    """Whether a server could listen on address:port now (SO_REUSEADDR, as gRPC: TIME_WAIT is no obstacle)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        return True
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise RemoteError(f"{address} is not an address of this host (inventory hosts[].address)") from None
        return False
    finally:
        s.close()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _pick_port(address: str, avoid: set[int]) -> int:
    top = _ephemeral_low() - 1
    for _ in range(500):
        if top > PORT_FLOOR + 1000:
            port = random.randint(PORT_FLOOR, top)
        else:  # an unusual ephemeral range: let the kernel choose
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
                port = s.getsockname()[1]
        if port not in avoid and _port_free(address, port):
            return port
    raise RemoteError(f"no free TCP port on {address}")


def agent_ports(state_dir: str, request: dict) -> dict:
    """Fixed ports for the processes of a host whose inventory port is 0.

    ``request``: ``{"address": A, "processes": {name: port}}`` (port 0: any free port).
    A process that had a port here before gets it again (so a restarted master keeps
    its address and its clients reconnect to it); otherwise a free port is chosen
    once and recorded in ``<state-dir>/run/ports.json``.  A recorded port another
    program has taken since is replaced (reported in ``moved``).
    """
    refusal = _still_running(state_dir)
    if refusal:
        return {"error": refusal}
    address = request["address"]
    want: dict[str, int] = {k: int(v) for k, v in request["processes"].items()}
    path = Path(state_dir) / "run" / PORTS
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    fixed = {p for p in want.values() if p} | {int(p) for p in request.get("avoid", [])}  # (the Spark daemons')
    out, chosen, moved = {}, [], []
    for name, port in want.items():
        if port:
            out[name] = port
            continue
        rec = known.get(name) or {}
        old = int(rec.get("port") or 0) if rec.get("address") == address else 0
        avoid = fixed | set(out.values())
        if old and old not in avoid and _port_free(address, old):
            out[name] = old
            continue
        out[name] = _pick_port(address, avoid)
        if old:
            moved.append({"name": name, "old": old, "new": out[name]})
        else:
            chosen.append(name)
        known[name] = {"address": address, "port": out[name]}
    if chosen or moved:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{PORTS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=2, sort_keys=True))
        tmp.replace(path)
    return {"ports": out, "chosen": chosen, "moved": moved}


def _set_aside(state_dir: str, bases: list[str]) -> list[str]:
    """``up --fresh``: a master's event log and its SQLite companions renamed to ``<name>.<UTC time>.old``."""
    sd = Path(state_dir).resolve()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for base in bases:
        b = Path(base)
        if b.resolve().parent != sd:
            raise RemoteError(f"{base} is not a state file in {state_dir}")
        files = [f for f in (b, *(b.with_name(b.name + s) for s in ("-wal", "-shm", "-journal"))) if f.exists()]
        tail, n = stamp, 0  # one suffix for the log and its companions, never over an earlier one
        while any(f.with_name(f"{f.name}.{tail}.old").exists() for f in files):
            n += 1
            tail = f"{stamp}-{n}"
        for f in files:
            f.rename(f.with_name(f"{f.name}.{tail}.old"))
            moved.append(f"{f.name}.{tail}.old")
    return moved


def agent_start(state_dir: str, plan: dict) -> dict:
    sd = Path(state_dir)
    (sd / "logs").mkdir(parents=True, exist_ok=True)
    (sd / "run").mkdir(parents=True, exist_ok=True)
    os.chmod(sd, 0o700)
    refusal = _still_running(state_dir, (RECORD,))  # (the level's Spark daemons may run already: up starts them first)
    if refusal:
        return {"error": refusal}
    set_aside = _set_aside(state_dir, plan.get("fresh", []))
    mode = plan.get("mode", "process")
    procs = []
    for p in plan["processes"]:
        Path(p["ready"]).unlink(missing_ok=True)
        entry = {"name": p["name"], "role": p["role"], "level": p["level"], "ready": p["ready"], "log": p["log"]}
        if mode == "process":
            # the worker's Spark is its level's (the config), or STRATA_SPARK_MASTER only if the plan gives it
            env = {**{k: v for k, v in os.environ.items() if k != "STRATA_SPARK_MASTER"}, **p.get("env", {})}
            argv = list(p["argv"]) + ["--log-file", p["log"]]  # the process rotates its own log
            with open(p["log"], "ab") as log:
                log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {shlex.join(argv)}\n".encode())
                log.flush()
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=env, cwd=state_dir, close_fds=True)
            entry["pid"] = proc.pid
            entry["argv"] = argv
        else:
            entry["unit"] = p["unit"]
        procs.append(entry)
    if mode == "systemd":
        user = plan.get("service_user")
        if user and os.geteuid() == 0:
            for root, dirs, files in os.walk(sd):
                if Path(root) == sd:  # the Spark daemons' directory (their secret) stays the agent user's
                    dirs[:] = [x for x in dirs if x != "spark"]
                for n in dirs + files:
                    shutil.chown(os.path.join(root, n), user)
            shutil.chown(sd, user)
            for path in plan.get("chown", []):  # e.g. the users file the master reads
                if os.path.exists(path):
                    shutil.chown(path, user)
        units = [p["unit"] for p in procs]
        if units:  # (a host of Spark daemons only has none)
            _systemctl("daemon-reload")
            _systemctl("enable", *units)
            _systemctl("restart", *units)
    record = {"deployment": plan.get("deployment"), "mode": mode, "started": time.time(), "processes": procs}
    _write_record(state_dir, RECORD, record)
    return {"processes": [{k: v for k, v in p.items() if k != "argv"} for p in procs], "set_aside": set_aside}


# ---- a level's Spark standalone daemons (deploy/spark_daemons.py) ------------------------------------------
def agent_spark_start(state_dir: str, plan: dict) -> dict:
    """Start the Spark master/worker daemons of the plan as processes (also under ``up --systemd``:
    Spark daemons have no units), each in its own session, output to its log; record them in
    ``run/spark.json``.  Their secret is in their properties file (copied before, 0600), never here."""
    daemons = plan.get("daemons", [])
    if not daemons:
        return {"daemons": []}
    refusal = _still_running(state_dir, (SPARK_RECORD,))
    if refusal:
        return {"error": refusal}
    try:
        launcher = sd.spark_class()
    except RuntimeError as e:
        return {"error": str(e)}
    problem = sd.java_problem()
    if problem:
        return {"error": problem}
    (Path(state_dir) / "logs").mkdir(parents=True, exist_ok=True)
    (Path(state_dir) / "run").mkdir(parents=True, exist_ok=True)
    started = []
    for d in daemons:
        if not Path(d["mark"]).is_file():
            return {"error": f"{d['name']}: no {d['mark']} (its properties file) on this host"}
        for path in d.get("dirs", []):
            Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        argv = sd.daemon_argv(launcher, d)
        with open(d["log"], "ab") as log:
            offset = log.tell()
            log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {shlex.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=sd.daemon_env(launcher, d),
                                    cwd=d["dirs"][0] if d.get("dirs") else state_dir, close_fds=True)
        started.append({"name": d["name"], "role": d["role"], "level": d["level"], "pid": proc.pid,
                        "log": d["log"], "offset": offset, "mark": d["mark"], "ready_marker": d["ready_marker"],
                        "address": d.get("address")})
    _write_record(state_dir, SPARK_RECORD, {"deployment": plan.get("deployment"), "mode": "process",
                                            "started": time.time(), "daemons": started})
    return {"daemons": [{k: started_d[k] for k in ("name", "role", "level", "pid", "address")}
                        for started_d in started]}


def _log_since(path: str, offset: int, limit: int = 4 << 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(offset, end - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _master_json(log_text: str) -> dict | None:
    """The standalone master's own view (its web UI's ``/json/``, at the address its log names)."""
    import re
    import urllib.request

    m = re.findall(r"MasterWebUI to \S+, and started at (http://\S+)", log_text)
    if not m:
        return None
    try:
        with urllib.request.urlopen(m[-1].rstrip("/") + "/json/", timeout=3) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError):
        return None


def _spark_status(state_dir: str) -> list[dict]:
    record = _load_record(state_dir, SPARK_RECORD)
    out = []
    for d in (record or {}).get("daemons", []):
        e = {k: d[k] for k in ("name", "role", "level", "pid", "address")}
        e["alive"] = _ours(d)
        text = _log_since(d["log"], int(d.get("offset", 0)))
        e["ready"] = e["alive"] and d["ready_marker"] in text
        if e["ready"] and d["role"] == "spark-master":
            info = _master_json(text)
            if info is not None:
                e["status"] = info.get("status")
                e["workers"] = sorted(w.get("host", "?") for w in info.get("workers", []) if w.get("state") == "ALIVE")
                e["apps"] = sorted(a.get("name", "?") for a in info.get("activeapps", []))
        if not e["alive"]:
            e["log_tail"] = text[-2500:]
        out.append(e)
    return out


def _alive(record: dict, p: dict) -> bool:
    if record.get("mode") == "systemd":
        return _unit_state(p["unit"]).get("ActiveState") in ("active", "activating", "reloading")
    return _ours(p)


def agent_status(state_dir: str) -> dict:
    record = _load_record(state_dir)
    spark = _spark_status(state_dir)
    if record is None:
        return {"deployment": None, "processes": [], "spark": spark}
    out = []
    for p in record["processes"]:
        e = {k: p[k] for k in ("name", "role", "level") if k in p}
        e["alive"] = _alive(record, p)
        if record.get("mode") == "systemd":
            st = _unit_state(p["unit"])
            e["unit"], e["pid"] = p["unit"], int(st.get("MainPID") or 0)
            e["restarts"] = int(st.get("NRestarts") or 0)
        else:
            e["pid"] = p["pid"]
        try:
            info = json.loads(Path(p["ready"]).read_text())
            if not record.get("mode") == "systemd" and info.get("pid") not in (None, p.get("pid")):
                info = {}  # a stale file of an earlier run
        except (OSError, ValueError):
            info = {}
        e["address"] = info.get("address")
        e["ready"] = bool(e["address"]) and e["alive"]
        if not e["alive"]:
            if record.get("mode") == "systemd":
                r = subprocess.run(["journalctl", "-u", p["unit"], "-n", "40", "--no-pager"], capture_output=True,
                                   text=True)
                e["log_tail"] = r.stdout[-2500:]
            else:
                e["log_tail"] = _tail(p["log"])
        out.append(e)
    return {"deployment": record.get("deployment"), "mode": record.get("mode"), "processes": out, "spark": spark}


def _stop_groups(mine: list[dict], timeout: float) -> None:
    """SIGTERM to each process group, wait for the whole group (a worker's Spark JVM, a Spark
    worker's executors are its children), then SIGKILL what is left."""
    for p in mine:
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    groups = [p["pid"] for p in mine]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _groups_alive(groups):
        time.sleep(0.1)
    for pgid in _groups_alive(groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _groups_alive(groups):
        time.sleep(0.1)


def agent_stop(state_dir: str, timeout: float = 20.0) -> dict:
    record = _load_record(state_dir)
    spark = _load_record(state_dir, SPARK_RECORD)
    if record is None and spark is None:
        return {"stopped": 0, "note": f"nothing recorded in {state_dir}"}
    n = 0
    if record is not None:  # the Strata processes first (a worker's driver before its level's cluster)
        procs = record["processes"]
        if record.get("mode") == "systemd":
            units = [p["unit"] for p in procs]
            if units:
                _systemctl("disable", "--now", *units, check=False)
            n = len(units)
        else:
            mine = [p for p in procs if _ours(p)]
            _stop_groups(mine, timeout)
            n = len(mine)
        for p in procs:
            Path(p["ready"]).unlink(missing_ok=True)
        _record_path(state_dir).replace(_record_path(state_dir).with_name("deployment.stopped.json"))
    k = 0
    if spark is not None:
        mine = [d for d in spark.get("daemons", []) if _ours(d)]
        _stop_groups(mine, timeout)
        k = len(mine)
        _record_path(state_dir, SPARK_RECORD).replace(_record_path(state_dir).with_name("spark.stopped.json"))
    return {"stopped": n, "spark_stopped": k}


def agent_probe(level: str, key_file: str, address: str, port: int, interface: str, expect: list[str],
                seconds: float) -> dict:
    """Listen (never send) on the level's group; report the members heard."""
    # deferred: the agent's other commands (ports, start, status, stop) need no group key or table
    from strata.groups import load_or_create_key
    from strata.groups.membership import GroupSpec, GroupTable, receiver

    key = load_or_create_key(Path(key_file), create=False)
    spec = GroupSpec(level=level, address=address, port=port, key=key, interface=interface)
    table = GroupTable(level, key, timeout=3600.0)
    rx = receiver(spec)
    rx.settimeout(0.2)
    heard: dict[str, dict] = {}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                data, _ = rx.recvfrom(65535)
            except OSError:
                continue
            hb = table.receive(data, time.monotonic())  # refuses (and counts) anything not a valid heartbeat
            if hb is not None:  # a listener proves no address: what each heard member says of itself
                heard[hb.sid] = {"role": hb.role, "state": hb.state, "cpu": hb.cpu, "pid": hb.pid,
                                 "slots": hb.slots, "identity": hb.identity[:16]}
                if expect and set(expect) <= set(heard):
                    break
    finally:
        rx.close()
    return {"level": level, "heard": heard, "rejected": dict(table.rejected),
            "missing": sorted(set(expect) - set(heard))}


def agent_check() -> dict:
    import platform

    tls = True
    try:
        import importlib.util

        tls = importlib.util.find_spec("strata.tls") is not None
    except ImportError:  # pragma: no cover
        tls = False
    try:  # what a host needs to run a level's Spark daemons (``[levels."L".spark]``)
        spark = None if sd.java_problem() else str(sd.spark_class())
        spark_problem = sd.java_problem()
    except RuntimeError as e:
        spark, spark_problem = None, str(e)
    return {"python": platform.python_version(), "executable": sys.executable,
            "strata": getattr(strata, "__version__", "?"), "tls": tls, "uid": os.geteuid(),
            "spark_class": spark, "spark_problem": spark_problem}


def agent_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.deploy.remote", description="strata deploy host agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("start", "ports", "spark-start"):  # (their input as JSON on stdin)
        s = sub.add_parser(name)
        s.add_argument("--state-dir", required=True)
    for name in ("status", "stop"):
        s = sub.add_parser(name)
        s.add_argument("--state-dir", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--level", required=True)
    pr.add_argument("--key-file", required=True)
    pr.add_argument("--address", required=True)
    pr.add_argument("--port", type=int, required=True)
    pr.add_argument("--interface", required=True)
    pr.add_argument("--expect", default="")
    pr.add_argument("--seconds", type=float, default=3.0)
    sub.add_parser("check")
    a = p.parse_args(argv)
    try:
        if a.cmd == "start":
            return _reply(agent_start(a.state_dir, json.loads(sys.stdin.read())))
        if a.cmd == "ports":
            return _reply(agent_ports(a.state_dir, json.loads(sys.stdin.read())))
        if a.cmd == "spark-start":
            return _reply(agent_spark_start(a.state_dir, json.loads(sys.stdin.read())))
        if a.cmd == "status":
            return _reply(agent_status(a.state_dir))
        if a.cmd == "stop":
            return _reply(agent_stop(a.state_dir))
        if a.cmd == "probe":
            return _reply(agent_probe(a.level, a.key_file, a.address, a.port, a.interface,
                                      [x for x in a.expect.split(",") if x], a.seconds))
        return _reply(agent_check())
    except RemoteError as e:
        return _reply({"error": str(e)})
    except Exception as e:  # one JSON answer, whatever happened
        return _reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    sys.exit(agent_main())
