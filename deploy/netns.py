"""Several "hosts" on one machine: network namespaces joined by a bridge, for trying a deployment
(``strata deploy``'s ``netns`` transport runs a host's commands in one) and for the tests and the
scaling benchmark that need hosts (tests/netns_hosts.py, bench/scaling.py).

:class:`Topology`: a bridge in a namespace of its own and one namespace per host, each with a veth
into the bridge (multicast snooping off, so a level's multicast crosses it; a route for 224.0.0.0/4
on the host's link) and an address of the given /24 subnet.  Names are unique per process
(``<tag><pid>-<host>``); :meth:`Topology.down` kills whatever still runs in the namespaces it made,
and only in those, and deletes them.  Nothing touches the root namespace's interfaces or routes.
:func:`unavailable` says why namespaces cannot be made here (not Linux, no iproute2, not root, no
CAP_NET_ADMIN in a container).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["ip", "unavailable", "Topology"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS``; raises RuntimeError (its stderr) when ``check`` and it fails."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def unavailable(tools: tuple[str, ...] = (), bridge: bool = True) -> str | None:
    """Why network namespaces (with veth pairs, and a bridge when ``bridge``) cannot be made here, or
    a tool of ``tools`` is missing; None: they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None:
            return "iproute2 `ip` not found: cannot create network namespaces" if tool == "ip" else \
                f"`{tool}` not found"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run as root or deselect with -m 'not netns'"
    probe = f"stprobe{os.getpid()}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed (no CAP_NET_ADMIN in this container?): {r.stderr.strip()}"
    try:
        if bridge:
            r = ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
            if r.returncode != 0:
                return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair in a namespace: {r.stderr.strip()}"
    finally:
        ip("netns", "delete", probe, check=False)
    return None


class Topology:
    """Namespaces ``<tag><pid>-<host>`` with addresses ``<subnet>.<octet>`` (``hosts``: host -> last octet),
    veth pairs into a bridge in its own namespace ``<tag><pid>-br``."""

    def __init__(self, tag: str, subnet: str, hosts: dict[str, int]):
        self.subnet, self.hosts = subnet, dict(hosts)
        self.prefix = f"{tag}{os.getpid()}"
        self.bridge = f"{self.prefix}-br"
        self.ns = {h: f"{self.prefix}-{h}" for h in hosts}
        self.created: list[str] = []

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def up(self) -> None:
        br = self.bridge
        ip("netns", "add", br)
        self.created.append(br)
        ip("-n", br, "link", "set", "lo", "up")
        ip("-n", br, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", br, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            ip("netns", "add", ns)
            self.created.append(ns)
            # the veth pair is made inside the bridge namespace, its peer moved straight into the host's
            ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            ip("-n", br, "link", "set", f"v{i}", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def down(self) -> None:
        """Kill whatever still runs in our namespaces (only ours: we created them), then delete them."""
        for ns in reversed(self.created):
            for _ in range(50):
                pids = [int(x) for x in ip("netns", "pids", ns, check=False).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            ip("netns", "delete", ns, check=False)
        self.created.clear()

    def pids(self, host: str) -> set[int]:
        """The processes running in ``host``'s namespace."""
        return {int(x) for x in ip("netns", "pids", self.ns[host], check=False).stdout.split()}

    def run(self, host: str, *argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """``argv`` in ``host``'s namespace (output captured, text); ``env`` over this process's."""
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})

    def link_bytes(self, host: str) -> int:
        """rx + tx bytes of the host's link so far."""
        out = json.loads(ip("-j", "-s", "-n", self.ns[host], "link", "show", "dev", "eth0").stdout)[0]
        st = out.get("stats64") or out.get("stats")
        return int(st["rx"]["bytes"]) + int(st["tx"]["bytes"])
