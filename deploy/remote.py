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

``start``   (plan as JSON on stdin) start the host's processes in the background,
            each in its own session (``setsid``) with output to ``logs/<name>.log``,
            or as systemd units; record them in ``<state-dir>/run/deployment.json``
``status``  liveness, readiness (the address from the ready file) and log tails
``stop``    stop what ``start`` recorded (only processes whose command line is ours)
``probe``   listen on a level's multicast group with its key and report which
            members are heard (proof that heartbeats cross between hosts)
``check``   the host's Python and Strata version (reachability)

Every command prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Transport", "SshTransport", "NetnsTransport", "LocalTransport", "RemoteError", "transport_for",
           "transport_from_record", "agent_argv"]

RECORD = "deployment.json"
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
        with tempfile.TemporaryDirectory(prefix="strata-deploy-") as d:
            p = Path(d) / Path(dst).name
            p.write_text(text)
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
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f)
        os.chmod(tmp, mode)
        tmp.replace(target)
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
        tmp = f"{dst}.strata-tmp"
        # the directory first (a fresh one 0700 for private files), then the file under a
        # temporary name, its mode, and an atomic rename: a reader never sees a partial key
        dir_mode = "700" if mode & 0o077 == 0 else "755"
        self.run(["mkdir", "-p", "-m", dir_mode, "--", parent])
        cmd = ["scp", "-q", *self._opts(), "--", str(src), f"{self.target}:{tmp}"]
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{self.host_name}: scp {src} did not finish within 120 s") from None
        if r.returncode != 0:
            raise RemoteError(f"{self.host_name}: scp {src} → {dst} failed: "
                              f"{r.stderr.decode(errors='replace').strip()[-800:]}")
        self.run(["chmod", f"{mode:o}", "--", tmp])
        self.run(["mv", "-f", "--", tmp, dst])
        return True


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


def _record_path(state_dir: str) -> Path:
    return Path(state_dir) / "run" / RECORD


def _load_record(state_dir: str) -> dict | None:
    p = _record_path(state_dir)
    if not p.exists():
        return None
    return json.loads(p.read_text())


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ours(p: dict) -> bool:
    """The pid is alive and still runs the command we started (not a reused pid)."""
    pid = int(p.get("pid") or 0)
    if pid <= 0:
        return False
    cmd = _cmdline(pid)
    if not cmd or p["ready"] not in cmd:
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


def agent_start(state_dir: str, plan: dict) -> dict:
    sd = Path(state_dir)
    (sd / "logs").mkdir(parents=True, exist_ok=True)
    (sd / "run").mkdir(parents=True, exist_ok=True)
    os.chmod(sd, 0o700)
    old = _load_record(state_dir)
    if old:
        running = [p["name"] for p in old["processes"] if _alive(old, p)]
        if running:
            return {"error": f"already running in {state_dir}: {', '.join(running)} (deployment "
                             f"{old.get('deployment')}); run `strata deploy down` first"}
    mode = plan.get("mode", "process")
    procs = []
    for p in plan["processes"]:
        Path(p["ready"]).unlink(missing_ok=True)
        entry = {"name": p["name"], "role": p["role"], "level": p["level"], "ready": p["ready"], "log": p["log"]}
        if mode == "process":
            env = {**os.environ, **p.get("env", {})}
            with open(p["log"], "ab") as log:
                log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {shlex.join(p['argv'])}\n".encode())
                log.flush()
                proc = subprocess.Popen(p["argv"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=env, cwd=state_dir, close_fds=True)
            entry["pid"] = proc.pid
            entry["argv"] = p["argv"]
        else:
            entry["unit"] = p["unit"]
        procs.append(entry)
    if mode == "systemd":
        user = plan.get("service_user")
        if user and os.geteuid() == 0:
            for root, dirs, files in os.walk(sd):
                for n in dirs + files:
                    shutil.chown(os.path.join(root, n), user)
            shutil.chown(sd, user)
            for path in plan.get("chown", []):  # e.g. the users file the master reads
                if os.path.exists(path):
                    shutil.chown(path, user)
        _systemctl("daemon-reload")
        units = [p["unit"] for p in procs]
        _systemctl("enable", *units)
        _systemctl("restart", *units)
    record = {"deployment": plan.get("deployment"), "mode": mode, "started": time.time(), "processes": procs}
    tmp = _record_path(state_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(_record_path(state_dir))
    return {"processes": [{k: v for k, v in p.items() if k != "argv"} for p in procs]}


def _alive(record: dict, p: dict) -> bool:
    if record.get("mode") == "systemd":
        return _unit_state(p["unit"]).get("ActiveState") in ("active", "activating", "reloading")
    return _ours(p)


def agent_status(state_dir: str) -> dict:
    record = _load_record(state_dir)
    if record is None:
        return {"deployment": None, "processes": []}
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
    return {"deployment": record.get("deployment"), "mode": record.get("mode"), "processes": out}


def agent_stop(state_dir: str, timeout: float = 20.0) -> dict:
    record = _load_record(state_dir)
    if record is None:
        return {"stopped": 0, "note": f"nothing recorded in {state_dir}"}
    procs = record["processes"]
    if record.get("mode") == "systemd":
        units = [p["unit"] for p in procs]
        _systemctl("disable", "--now", *units, check=False)
        n = len(units)
    else:
        mine = [p for p in procs if _ours(p)]
        for p in mine:
            try:
                os.killpg(p["pid"], signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        # wait for the whole process group (a worker's Spark JVM is its child), then SIGKILL
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
        n = len(mine)
    for p in procs:
        Path(p["ready"]).unlink(missing_ok=True)
    _record_path(state_dir).replace(_record_path(state_dir).with_name("deployment.stopped.json"))
    return {"stopped": n}


def agent_probe(level: str, key_file: str, address: str, port: int, interface: str, expect: list[str],
                seconds: float) -> dict:
    """Listen (never send) on the level's group; report the members heard."""
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

    import strata

    tls = True
    try:
        import importlib.util

        tls = importlib.util.find_spec("strata.tls") is not None
    except ImportError:  # pragma: no cover
        tls = False
    return {"python": platform.python_version(), "executable": sys.executable,
            "strata": getattr(strata, "__version__", "?"), "tls": tls, "uid": os.geteuid()}


def agent_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.deploy.remote", description="strata deploy host agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start")
    st.add_argument("--state-dir", required=True)
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
        if a.cmd == "status":
            return _reply(agent_status(a.state_dir))
        if a.cmd == "stop":
            return _reply(agent_stop(a.state_dir))
        if a.cmd == "probe":
            return _reply(agent_probe(a.level, a.key_file, a.address, a.port, a.interface,
                                      [x for x in a.expect.split(",") if x], a.seconds))
        return _reply(agent_check())
    except Exception as e:  # one JSON answer, whatever happened
        return _reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    sys.exit(agent_main())
