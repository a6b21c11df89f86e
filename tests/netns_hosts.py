""""Hosts" that are network namespaces of this machine, for the tests of `strata deploy` (tests/test_deploy_netns.py,
test_deploy_ssh.py, test_deploy_spark.py) and of a Ray cluster across hosts (test_ray_hosts.py).

:class:`Topology`: a bridge in its own namespace and one namespace per host, each with a veth into the
bridge (multicast snooping off, so multicast crosses it) and an address of the test's subnet; names
unique per test process; everything running in the namespaces is killed when they are removed, also
on failure.  :class:`Sshd`: one OpenSSH server per host namespace with keys made by the test.  Plus
the skip reasons (not root, no CAP_NET_ADMIN, no iproute2, no sshd), ``strata deploy`` from the root
namespace or an operator's, the input file and the reference check of the replays through a deployed
master.  Nothing touches the root namespace's interfaces or routes.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from strata.config import load_config
from strata.deploy import netns
from strata.deploy.netns import ip, unavailable

from .helpers import PASSWORD, gone, read_out
from .polling import poll
from .reference.evaluator import compare_results, evaluate

PY = sys.executable
SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # compiled into Debian's sshd; it refuses to start without it


def skip_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    return unavailable()


def ssh_skip_reason() -> str | None:
    """Why the ssh "hosts" cannot be made here (no OpenSSH server or client, or no namespaces)."""
    if not Path(SSHD).exists():
        return (f"{SSHD} is missing: install the Debian package openssh-server "
                f"(`apt-get install openssh-server`; ./dev setup does it as root)")
    for tool in ("ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: install the Debian package openssh-client"
    return skip_reason()


def tls_available() -> bool:
    return importlib.util.find_spec("strata.tls") is not None


class Topology(netns.Topology):
    """:class:`strata.deploy.netns.Topology` whose commands run with the tests' password in the environment."""

    def run(self, host: str, *argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return super().run(host, *argv, timeout=timeout, env={"STRATA_PASSWORD": PASSWORD, **(env or {})})


@contextmanager
def namespaces(tag: str, subnet: str, hosts: dict[str, int], reason: str | None):
    """A :class:`Topology` for a module's tests (skipped with ``reason`` when there is one), removed at the end."""
    if reason:
        pytest.skip(reason)
    t = Topology(tag, subnet, hosts)
    try:
        t.up()
        yield t
    finally:
        t.down()


class Sshd:
    """One OpenSSH server per host namespace, keys and client options made here: each listens on its
    namespace's address only, with its own host key, public-key logins only with a key pair the test
    makes; the client trusts exactly those host keys."""

    def __init__(self, topo: Topology, base: Path):
        self.topo, self.dir = topo, base / "ssh"
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.procs: list[subprocess.Popen] = []
        self.made_privsep = False

    def keygen(self, path: Path) -> str:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
                       check=True, capture_output=True, timeout=30)
        return path.with_name(path.name + ".pub").read_text().strip()

    def start(self, hosts: list[str]) -> None:
        self.dir.mkdir(mode=0o700, parents=True)
        client_pub = self.keygen(self.dir / "id_operator")
        (self.dir / "authorized_keys").write_text(client_pub + "\n")
        known = []
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            self.made_privsep = True
        for h in hosts:
            hdir = self.dir / h
            hdir.mkdir(mode=0o700)
            host_pub = self.keygen(hdir / "host_ed25519")
            known.append(f"{self.topo.address(h)} {host_pub}")
            cfg = hdir / "sshd_config"
            cfg.write_text("\n".join([
                f"ListenAddress {self.topo.address(h)}:22",
                f"HostKey {hdir / 'host_ed25519'}",
                f"PidFile {hdir / 'sshd.pid'}",
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password", f"AllowUsers {self.user}", "UsePAM no",
                "StrictModes no",  # the key files live in pytest's temporary directories
                "X11Forwarding no", "AllowTcpForwarding no", "PrintMotd no", "LogLevel VERBOSE",
                "Subsystem sftp /usr/lib/openssh/sftp-server",  # scp speaks SFTP since OpenSSH 9
                *self.set_env(),
            ]) + "\n")
            log = open(hdir / "sshd.log", "wb")
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", self.topo.ns[h], SSHD, "-D", "-e",
                                                "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL))
            log.close()
        (self.dir / "known_hosts").write_text("\n".join(known) + "\n")
        for h in hosts:
            ok = poll(lambda: self.ssh(h, "true").returncode == 0, timeout=20, interval=0.3)
            if not ok:
                r = self.ssh(h, "true")
                raise AssertionError(f"sshd on {h} does not let the operator in: {r.stderr.strip()}\n"
                                     f"{(self.dir / h / 'sshd.log').read_text()[-2000:]}")

    @staticmethod
    def set_env() -> list[str]:
        """The suite's choice of the workers' warm-up (tests/conftest.py) for the processes started over ssh,
        as for those it starts itself (none: the remote processes warm up as users' do)."""
        v = os.environ.get("STRATA_WARMUP_SECONDS")
        return [f"SetEnv STRATA_WARMUP_SECONDS={v}"] if v else []

    def options(self) -> list[str]:
        """Inventory ssh_options: this test's key, and only the host keys it made."""
        return [f"IdentityFile={self.dir / 'id_operator'}", "IdentitiesOnly=yes",
                f"UserKnownHostsFile={self.dir / 'known_hosts'}", "GlobalKnownHostsFile=/dev/null",
                "StrictHostKeyChecking=yes", "LogLevel=ERROR"]

    def ssh(self, host: str, *argv: str) -> subprocess.CompletedProcess:
        opts = [x for o in ["BatchMode=yes", "ConnectTimeout=5", *self.options()] for x in ("-o", o)]
        return self.topo.run("op", "ssh", *opts, f"{self.user}@{self.topo.address(host)}", *argv, timeout=30)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()
        if self.made_privsep:
            shutil.rmtree(PRIVSEP_DIR, ignore_errors=True)


@contextmanager
def ssh_hosts(topo: Topology, d: Path, hosts: list[str]):
    """sshd on ``hosts`` for a module's tests: yields ``{"dir": d, "sshd": Sshd}``, to which the module adds
    its ``inventory``; at the end ``deploy down`` of that inventory, then the servers stop."""
    sshd = Sshd(topo, d)
    info = {"dir": d, "sshd": sshd}
    try:
        sshd.start(hosts)
        yield info
    finally:
        if "inventory" in info:
            deploy_op(topo, "down", "--inventory", str(info["inventory"]))
        sshd.stop()


def deploy(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`strata deploy ...` in the root namespace (transport netns: it enters the hosts' namespaces)."""
    return subprocess.run([PY, "-m", "strata", "deploy", *args], capture_output=True, text=True, timeout=timeout)


def deploy_op(topo: Topology, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`strata deploy ...` in the operator's namespace ``op``: its ssh reaches the hosts across the bridge."""
    return topo.run("op", PY, "-m", "strata", "deploy", *args, timeout=timeout)


def cli_op(topo: Topology, env: dict, command: list[str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``strata COMMAND`` as sam at level S in the operator's namespace, against the deployed S master
    (``env``: the module's ``config``, ``master``, ``tls`` and ``dir``, the inventory's, with ``secrets/tls``)."""
    base = ["--config", str(env["config"]), "--level", "S", "--user", "sam", "--master", env["master"]]
    if env["tls"]:
        base += ["--tls-dir", str(env["dir"] / "secrets" / "tls")]
    return topo.run("op", PY, "-m", "strata", *command, *base, *args, timeout=timeout)


def ours_left(topo: Topology, host: str) -> list[str]:
    """Command lines of what still runs in the host's namespace, its sshd (and sessions) aside."""
    out = []
    for pid in (int(x) for x in ip("netns", "pids", topo.ns[host]).stdout.split()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if gone(pid) or cmd[0] == SSHD.encode() or cmd[0].startswith(b"sshd"):
            continue
        out.append(b" ".join(cmd).decode(errors="replace")[:200])
    return out


# ---- the replays through a deployed master ---------------------------------------------------------------
HEADER = ["ts", "level", "sid", "bp", "pr", "weight"]
ROWS = [(1, "U", "a", 120.0, 70.0, 80.0), (1, "TS", "a", 200.0, 70.0, 80.0), (2, "S", "b", 130.0, 70.0, 80.0),
        (2, "C", "a", 110.0, 70.0, 80.0), (3, "TS", "b", 190.0, 70.0, 80.0), (3, "U", "b", 150.0, 70.0, 80.0),
        (4, "S", "a", 100.0, 70.0, 80.0), (5, "U", "a", 140.0, 70.0, 80.0)]
#: the replays' queries and their columns' types
QUERIES = [("SELECT AVG(bp) FROM Vitals [ROWS 2]", ["double"]),
           ("SELECT sid, COUNT(*) FROM Vitals [RANGE 2 seconds] GROUP BY sid", ["string", "long"])]


def vitals_csv(path: Path, rows=ROWS) -> Path:
    """``rows`` of Vitals as a CSV file at ``path``."""
    path.write_text("\n".join([",".join(HEADER)] + [",".join(map(str, r)) for r in rows]) + "\n")
    return path


def replay_args(d: Path) -> list[str]:
    """``strata replay`` arguments: ROWS (a file in ``d``) and QUERIES, the results into ``d / "out"``."""
    args = ["--input", f"Vitals={vitals_csv(d / 'vitals.csv')}", "--output", str(d / "out")]
    for q, _ in QUERIES:
        args += ["--query", q]
    return args


def assert_replay_equals_reference(config: Path, out: Path, level: str = "S") -> None:
    """Every query's results in ``out`` (a replay of :func:`replay_args`) are there and equal the reference's."""
    cfg = load_config(config)
    streams = {"Vitals": [dict(zip(HEADER, row)) for row in ROWS]}
    for i, (q, types) in enumerate(QUERIES, 1):
        got = read_out(out / f"q{i}.csv", types)
        assert got, f"query {i} produced nothing"
        compare_results(got, evaluate(q, cfg, level, streams))
