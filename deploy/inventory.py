"""The deployment inventory: which hosts run which level groups, and how to reach them.

An inventory is a TOML file (full reference and example in ``docs/deploy.md``)::

    [deployment]
    config = "strata.toml"            # the Strata config, read here (relative to this file)
    remote_config = "/etc/strata/strata.toml"   # where the hosts find it (default: the same path)
    state_dir = "/var/lib/strata"     # per host; hosts may override
    tls = true                        # false: processes run with --insecure (development only)

    [levels."S"]                      # one table per level that runs somewhere
    address = "239.255.10.3"          # the level group's multicast group
    port = 47003
    ttl = 1                           # ≥ 1 when the level spans several hosts

    [[hosts]]
    name = "s-worker-1"
    ssh = "strata@10.0.0.7"           # or transport = "netns" / "local"
    address = "10.0.0.7"              # gRPC listen address and multicast interface of this host
    levels = { S = 2 }                # level → worker count, or { workers = 2, master = true }

    [levels."S".spark]                # optional: deploy runs level S's own Spark standalone cluster
    master_host = "s-spark"           # a [[hosts]] name; its address is the master's
    master_port = 7077                # the config's [groups."S"] spark_master must be spark://<address>:7077
    workers = ["s-spark"]             # hosts running a Spark worker for S (default: the master host)

``[deployment] spark_master`` is deprecated: each level's workers use their level's
``[groups."L"]`` Spark settings of the config (strata/spark_settings.py); a local master
given there still applies, as ``STRATA_SPARK_MASTER``, to levels that set none.

:func:`load_inventory` parses and validates (against the config's lattice) and
returns an :class:`Inventory`; every error names the offending key
(``inventory hosts[2].levels: unknown level 'Q' (levels: U, C, S, TS)``).
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from strata.config import CHUNK_SECONDS, Config, ConfigError, chunk_instants, load_config
from strata.groups import level_slug
from strata.spark_settings import is_local_master, master_problem

__all__ = ["InventoryError", "Inventory", "Host", "LevelGroup", "Proc", "SparkCluster", "load_inventory",
           "parse_inventory"]

TRANSPORTS = ("ssh", "netns", "local")
DEPLOYMENT_KEYS = {"name", "config", "remote_config", "push_config", "state_dir", "python", "secrets", "tls",
                   "chunk_seconds", "spark_master", "ssh_options", "transport", "systemd_dir", "env_dir",
                   "service_user", "ready_timeout"}
LEVEL_KEYS = {"address", "port", "ttl", "master_port", "worker_port", "spark"}
SPARK_KEYS = {"master_host", "master_port", "master_webui_port", "workers", "worker_port", "worker_webui_port",
              "worker_cores", "worker_memory"}
HOST_KEYS = {"name", "transport", "ssh", "netns", "address", "state_dir", "config", "python", "levels",
             "ssh_options", "service_user"}
HOST_LEVEL_KEYS = {"workers", "master"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_SSH_TARGET = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_.:\[\]-]+")
_MULTICAST = ipaddress.ip_network("224.0.0.0/4")
_SPARK_MEMORY = re.compile(r"[1-9][0-9]{0,6}[mMgGtT]")


class InventoryError(ValueError):
    pass


@dataclass(frozen=True)
class LevelGroup:
    """A level's multicast group and ports, as the inventory fixes them."""

    level: str
    slug: str
    address: str
    port: int
    ttl: int
    master_port: int = 0  # 0: any free port
    worker_port: int = 0  # worker i listens on worker_port + i; 0: any free port


@dataclass(frozen=True)
class Proc:
    """One process the deployment runs on a host."""

    name: str  # master-<slug> | worker-<slug>-<i>
    role: str  # master | worker
    level: str
    index: int
    port: int

    @property
    def instance(self) -> str:
        """The systemd instance name (strata-master@S, strata-worker@S-0)."""
        return self.name.split("-", 1)[1]

    @property
    def unit(self) -> str:
        return f"strata-{self.role}@{self.instance}.service"


@dataclass(frozen=True)
class SparkCluster:
    """A level's Spark standalone cluster that ``strata deploy`` runs (``[levels."L".spark]``)."""

    level: str
    slug: str
    master_host: str  # a host name of the inventory
    master_address: str  # that host's address: the master binds to it
    master_port: int
    master_webui_port: int  # 0: any free port
    workers: tuple[str, ...]  # host names running a Spark worker of the level
    worker_port: int = 0  # 0: any free port
    worker_webui_port: int = 8081  # 0: any free port
    worker_cores: int | None = None  # None: every core of the host
    worker_memory: str | None = None  # None: Spark's default (the host's memory less 1 GiB)

    @property
    def url(self) -> str:
        return f"spark://{self.master_address}:{self.master_port}"

    def roles_on(self, host: str) -> list[str]:
        """``spark-master`` and/or ``spark-worker``: what this cluster runs on ``host``."""
        return (["spark-master"] if host == self.master_host else []) + \
            (["spark-worker"] if host in self.workers else [])


@dataclass(frozen=True)
class Host:
    name: str
    transport: str  # ssh | netns | local
    target: str  # ssh user@addr, netns name, or "" for local
    address: str
    state_dir: str
    config: str  # the Strata config's path on this host
    python: str
    workers: dict[str, int]  # level → worker count (levels this host runs)
    masters: tuple[str, ...]  # levels whose master this host runs
    ssh_options: tuple[str, ...] = ()
    service_user: str = "strata"

    @property
    def levels(self) -> list[str]:
        return list(self.workers)

    def processes(self, inv: "Inventory") -> list[Proc]:
        out = []
        for lv in self.levels:
            g = inv.levels[lv]
            if lv in self.masters:
                out.append(Proc(f"master-{g.slug}", "master", lv, 0, g.master_port))
            for i in range(self.workers[lv]):
                out.append(Proc(f"worker-{g.slug}-{i}", "worker", lv, i, g.worker_port + i if g.worker_port else 0))
        return out

    def path(self, *parts: str) -> str:
        """A path under this host's state dir (hosts are POSIX)."""
        return str(PurePosixPath(self.state_dir, *parts))


@dataclass
class Inventory:
    path: Path | None
    name: str
    config_path: Path  # the operator's copy
    config: Config
    push_config: bool
    secrets: Path
    tls: bool
    chunk_seconds: float
    #: deprecated ``[deployment] spark_master`` (None: unset): a local master for levels the config gives none
    spark_master: str | None
    systemd_dir: str
    env_dir: str
    ready_timeout: float
    levels: dict[str, LevelGroup]
    hosts: list[Host]
    warnings: list[str] = field(default_factory=list)
    #: level → the Spark standalone cluster ``up`` runs for it (``[levels."L".spark]``)
    spark: dict[str, SparkCluster] = field(default_factory=dict)
    #: level → ``[groups."L"] spark_secret_file`` as the config writes it (relative to the config file)
    spark_secret_paths: dict[str, str] = field(default_factory=dict)
    #: levels whose config names a Spark master (``[groups."L"] spark_master``)
    spark_configured: frozenset[str] = frozenset()

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InventoryError(f"inventory: no host named {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def master_host(self, level: str) -> Host:
        return next(h for h in self.hosts if level in h.masters)

    def hosts_of(self, level: str) -> list[Host]:
        return [h for h in self.hosts if level in h.workers]

    def spark_master_env(self, level: str) -> str | None:
        """The deprecated ``[deployment] spark_master`` for ``level``'s workers: only when the config
        names no Spark master for the level (a level's own ``[groups."L"]`` setting always wins)."""
        return self.spark_master if self.spark_master and level not in self.spark_configured else None

    def spark_daemons(self, host: Host) -> list[tuple[str, str]]:
        """(role, level) of each Spark daemon ``up`` runs on ``host`` (``spark-master``/``spark-worker``)."""
        return [(role, lv) for lv, c in self.spark.items() for role in c.roles_on(host.name)]

    def spark_secret_remote(self, host: Host, level: str) -> str | None:
        """Where ``host`` finds ``level``'s ``spark_secret_file``: the config's path, relative to the
        host's config file (``host.config``), as the worker resolves it (None: the level has none)."""
        raw = self.spark_secret_paths.get(level)
        if raw is None:
            return None
        return posixpath.normpath(posixpath.join(posixpath.dirname(host.config), raw))

    @property
    def record_path(self) -> Path:
        """Where ``strata deploy up`` records what it started (next to the inventory)."""
        base = self.path if self.path is not None else Path(f"{self.name}.toml")
        return base.with_name(base.stem + ".deployed.json")


# ---- parsing --------------------------------------------------------------------------------
def load_inventory(path: str | Path) -> Inventory:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InventoryError(f"inventory {p}: cannot read: {e.strerror or e}") from None
    return parse_inventory(text, p)


def parse_inventory(text: str, path: Path | None = None) -> Inventory:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InventoryError(f"inventory{f' {path}' if path else ''}: invalid TOML: {e}") from None
    base = path.parent if path is not None else Path.cwd()

    def err(key: str, msg: str) -> InventoryError:
        return InventoryError(f"inventory {key}: {msg}")

    unknown = set(data) - {"deployment", "levels", "hosts"}
    if unknown:
        raise err(sorted(unknown)[0], "unknown section (known: deployment, levels, hosts)")
    dep = _table(data.get("deployment"), "deployment", err)
    _no_unknown(dep, DEPLOYMENT_KEYS, "deployment", err)

    # -- the Strata config: its lattice decides which levels exist
    cfg_text = _str(dep, "config", "deployment", err, required=True)
    config_path = (base / cfg_text).resolve() if not Path(cfg_text).is_absolute() else Path(cfg_text)
    try:
        config = load_config(config_path)
    except ConfigError as e:
        raise err("deployment.config", str(e)) from None
    lattice = config.lattice
    level_names = ", ".join(lattice.levels) if len(lattice.levels) <= 16 else f"{len(lattice.levels)} levels"

    def parse_level(text: str, key: str) -> str:
        try:
            return lattice.parse(text)
        except ValueError:
            return _raise(err(key, f"unknown level {text!r} (levels: {level_names})"))

    remote_config = _str(dep, "remote_config", "deployment", err) or str(config_path)
    _posix_abs(remote_config, "deployment.remote_config", err)
    push_config = _bool(dep, "push_config", "deployment", err, True)
    state_dir = _str(dep, "state_dir", "deployment", err) or "/var/lib/strata"
    _posix_abs(state_dir, "deployment.state_dir", err)
    python = _str(dep, "python", "deployment", err) or sys.executable
    secrets_text = _str(dep, "secrets", "deployment", err)
    stem = path.stem if path is not None else "inventory"
    secrets = Path(secrets_text) if secrets_text else Path(f"{stem}.secrets")
    if not secrets.is_absolute():
        secrets = (base / secrets).resolve()
    tls = _bool(dep, "tls", "deployment", err, True)
    try:  # (default: one instant)
        chunk_seconds = chunk_instants(dep.get("chunk_seconds", CHUNK_SECONDS.default), config.instant_seconds) \
            * config.instant_seconds
    except ValueError as e:
        raise err("deployment.chunk_seconds", str(e)) from None
    spark_master = _str(dep, "spark_master", "deployment", err) or None
    if spark_master is not None:
        problem = master_problem(spark_master)
        if problem:
            raise err("deployment.spark_master", problem)
        if not is_local_master(spark_master):
            raise err("deployment.spark_master", f"{spark_master.strip()}: one Spark cluster for every level is "
                                                 f"refused (a level's Spark cluster is never shared): give each "
                                                 f"level its own in the config, [groups.\"L\"] spark_master and "
                                                 f"spark_secret_file (deprecated key: remove it)")
        spark_master = spark_master.strip()
    ssh_options = _ssh_options(dep, "ssh_options", "deployment", err)
    default_transport = _str(dep, "transport", "deployment", err) or "ssh"
    if default_transport not in TRANSPORTS:
        raise err("deployment.transport", f"must be one of {', '.join(TRANSPORTS)}, not {default_transport!r}")
    systemd_dir = _str(dep, "systemd_dir", "deployment", err) or "/etc/systemd/system"
    env_dir = _str(dep, "env_dir", "deployment", err) or "/etc/strata"
    for k, v in (("systemd_dir", systemd_dir), ("env_dir", env_dir)):
        _posix_abs(v, f"deployment.{k}", err)
    service_user = _str(dep, "service_user", "deployment", err) or "strata"
    ready_timeout = _num(dep, "ready_timeout", "deployment", err, 180.0)
    name = _str(dep, "name", "deployment", err) or stem
    if not _NAME.fullmatch(name):
        raise err("deployment.name", f"{name!r}: use letters, digits, '.', '_' and '-'")

    # -- hosts
    raw_hosts = data.get("hosts")
    if raw_hosts is None or raw_hosts == []:
        raise err("hosts", "no [[hosts]]: add at least one host")
    if not isinstance(raw_hosts, list) or not all(isinstance(h, dict) for h in raw_hosts):
        raise err("hosts", "must be an array of tables ([[hosts]])")
    spark_hosts = _spark_host_names(data.get("levels"))
    hosts: list[Host] = []
    seen_names: dict[str, int] = {}
    for i, h in enumerate(raw_hosts):
        key = f"hosts[{i}]"
        _no_unknown(h, HOST_KEYS, key, err)
        hname = _str(h, "name", key, err, required=True)
        if not _NAME.fullmatch(hname):
            raise err(f"{key}.name", f"{hname!r}: use letters, digits, '.', '_' and '-'")
        if hname in seen_names:
            raise err(f"{key}.name", f"{hname!r} is also hosts[{seen_names[hname]}]'s name")
        seen_names[hname] = i
        transport = _str(h, "transport", key, err) or ("ssh" if "ssh" in h else "netns" if "netns" in h
                                                         else default_transport)
        if transport not in TRANSPORTS:
            raise err(f"{key}.transport", f"must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        target = ""
        if transport == "ssh":
            target = _str(h, "ssh", key, err)
            if not target:
                raise err(f"{key}.ssh", "missing: the ssh destination user@address of this host")
            if not _SSH_TARGET.fullmatch(target) or target.startswith("-"):
                raise err(f"{key}.ssh", f"{target!r} is not a destination of the form user@host")
        elif transport == "netns":
            target = _str(h, "netns", key, err)
            if not target:
                raise err(f"{key}.netns", "missing: the network namespace this host lives in")
            if not _NAME.fullmatch(target):
                raise err(f"{key}.netns", f"{target!r} is not a namespace name")
        address = _str(h, "address", key, err, required=True)
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            raise err(f"{key}.address", f"{address!r} is not an IPv4 address (the interface this host's "
                                        f"processes listen on and send multicast from)") from None
        if ip.is_unspecified or ip in _MULTICAST:
            raise err(f"{key}.address", f"{address} cannot be an interface address")
        hstate = _str(h, "state_dir", key, err) or state_dir
        _posix_abs(hstate, f"{key}.state_dir", err)
        hconfig = _str(h, "config", key, err) or remote_config
        _posix_abs(hconfig, f"{key}.config", err)
        hpython = _str(h, "python", key, err) or python
        hssh = tuple(ssh_options + _ssh_options(h, "ssh_options", key, err))
        huser = _str(h, "service_user", key, err) or service_user
        rawlv = h.get("levels")
        if rawlv is None and hname in spark_hosts:
            rawlv = {}  # runs only Spark daemons of a level ([levels."L".spark])
        if rawlv is None:
            raise err(f"{key}.levels", "missing: which level groups this host runs, e.g. levels = { S = 2 } "
                                       "(or name it in a [levels.\"L\".spark] table)")
        if not isinstance(rawlv, dict) or (not rawlv and hname not in spark_hosts):
            raise err(f"{key}.levels", "must be a table level → worker count (or { workers = N, master = true })")
        workers: dict[str, int] = {}
        masters: list[str] = []
        for lvtext, spec in rawlv.items():
            lv = parse_level(lvtext, f"{key}.levels")
            lkey = f"{key}.levels.{lvtext}"
            if lv in workers:
                raise err(lkey, f"level {lv} is listed twice")
            if isinstance(spec, bool) or not isinstance(spec, (int, dict)):
                raise err(lkey, "must be a worker count or a table { workers = N, master = true }")
            if isinstance(spec, int):
                n, is_master = spec, False
            else:
                _no_unknown(spec, HOST_LEVEL_KEYS, lkey, err)
                n = spec.get("workers", 0)
                is_master = spec.get("master", False)
                if not isinstance(is_master, bool):
                    raise err(f"{lkey}.master", "must be true or false")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > 64:
                raise err(lkey if isinstance(spec, int) else f"{lkey}.workers", "worker count must be 0..64")
            if n == 0 and not is_master:
                raise err(lkey, f"runs neither a master nor a worker of level {lv}")
            workers[lv] = n
            if is_master:
                masters.append(lv)
        hosts.append(Host(hname, transport, target, address, hstate, hconfig, hpython, workers, tuple(masters),
                          hssh, huser))

    # -- masters: exactly one per level that runs anywhere
    warnings: list[str] = []
    used = [lv for lv in lattice.sort({lv for h in hosts for lv in h.workers})]
    for lv in used:
        ms = [i for i, h in enumerate(hosts) if lv in h.masters]
        if not ms:
            runs = ", ".join(h.name for h in hosts if lv in h.workers)
            raise err("hosts", f"level {lv} has no master (hosts running it: {runs}); give one host "
                               f"levels.{_toml_key(lv)} = {{ master = true }}")
        if len(ms) > 1:
            raise err(f"hosts[{ms[1]}].levels.{_toml_key(lv)}.master",
                      f"level {lv} already has its master on {hosts[ms[0]].name} (hosts[{ms[0]}]); "
                      f"a level group has exactly one master")
        if sum(h.workers[lv] for h in hosts if lv in h.workers) == 0:
            warnings.append(f"level {lv} has a master but no workers: its queries will wait for a worker")

    # -- levels: multicast group, ports, TTL
    raw_levels = _table(data.get("levels"), "levels", err)
    levels: dict[str, LevelGroup] = {}
    for lvtext, spec in raw_levels.items():
        lv = parse_level(lvtext, "levels")
        if lv not in used:
            raise err(f"levels.{_toml_key(lvtext)}", f"no host runs level {lv}: remove the table or add a host")
        if not isinstance(spec, dict):
            raise err(f"levels.{_toml_key(lvtext)}", "must be a table (address, port, ttl, ...)")
    by_level = {parse_level(k, "levels"): (k, v) for k, v in raw_levels.items()}
    for lv in used:
        ktext, spec = by_level.get(lv, (lv, {}))
        key = f"levels.{_toml_key(ktext)}"
        _no_unknown(spec, LEVEL_KEYS, key, err)
        given = config.groups.get(lv)  # what the config's [groups."L"] sets itself (None: unset)
        for secret, value in (("key", given and given.key), ("key_file", given and given.key_file)):
            if value is not None:
                raise err("deployment.config", f"the config sets [groups.\"{lv}\"] {secret}; strata deploy "
                                               f"distributes group keys itself (state_dir/keys/"
                                               f"{level_slug(lv)}.key, only to hosts of level {lv}): remove it")
        group = config.group(lv)  # the config's settings of the level's group, defaults filled in
        address = _str(spec, "address", key, err) or group.address
        try:
            maddr = ipaddress.IPv4Address(address)
        except ValueError:
            raise err(f"{key}.address", f"{address!r} is not an IPv4 multicast address") from None
        if maddr not in _MULTICAST:
            raise err(f"{key}.address", f"{address} is not a multicast address (224.0.0.0/4; use 239.x.y.z)")
        port = _int(spec, "port", key, err, group.port)
        if not 1 <= port <= 65535:
            raise err(f"{key}.port", "must be a UDP port 1..65535")
        spans = sorted({h.address for h in hosts if lv in h.workers})
        ttl = _int(spec, "ttl", key, err, 1)
        if not 0 <= ttl <= 255:
            raise err(f"{key}.ttl", "must be 0..255")
        if ttl == 0 and len(spans) > 1:
            raise err(f"{key}.ttl", f"0 keeps heartbeats on one host, but level {lv} runs on "
                                    f"{len(spans)} hosts; use ttl = 1 (hosts on one bridge/switch) or more")
        if len(spans) > 1:
            loop = [a for a in spans if ipaddress.IPv4Address(a).is_loopback]
            if loop:
                raise err("hosts", f"level {lv} spans several hosts but one has loopback address {loop[0]}: "
                                   f"heartbeats cannot cross hosts on loopback")
        mport = _int(spec, "master_port", key, err, 0)
        wport = _int(spec, "worker_port", key, err, 0)
        for k, v in (("master_port", mport), ("worker_port", wport)):
            if not 0 <= v <= 65535:
                raise err(f"{key}.{k}", "must be a TCP port 1..65535 (or 0: any free port)")
        levels[lv] = LevelGroup(lv, level_slug(lv), address, port, ttl, mport, wport)

    # distinct groups per level
    owner: dict[str, str] = {}
    for lv, g in levels.items():
        if g.address in owner:
            raise err(f"levels.{_toml_key(lv)}.address", f"{g.address} is also level {owner[g.address]}'s group: "
                                                         f"groups of different levels use distinct multicast groups")
        owner[g.address] = lv
    slugs: dict[str, str] = {}
    for lv, g in levels.items():
        if g.slug in slugs:
            raise err("levels", f"levels {slugs[g.slug]} and {lv} share the file name {g.slug!r}")
        slugs[g.slug] = lv

    # -- the levels' Spark: the config's settings, and the clusters deploy runs ([levels."L".spark])
    settings, secret_paths = _config_spark(config)
    by_name = {h.name: h for h in hosts}
    spark: dict[str, SparkCluster] = {}
    for lv in used:
        ktext, spec = by_level.get(lv, (lv, {}))
        if "spark" in spec:
            spark[lv] = _spark_cluster(lv, spec["spark"], f"levels.{_toml_key(ktext)}.spark", by_name, settings,
                                       levels[lv].slug, err)
    configured = frozenset(lv for lv, s_ in settings.items() if s_.source == "config")
    if spark_master is not None:
        applies = [lv for lv in used if lv not in configured]
        warnings.append(f"deployment.spark_master is deprecated (each level's workers use the config's "
                        f"[groups.\"L\"] spark_master): {spark_master} "
                        + (f"applies only to level{'s' if len(applies) > 1 else ''} {', '.join(applies)}, which "
                           f"set{'' if len(applies) > 1 else 's'} none" if applies
                           else "applies to no level: every level sets its own; remove it"))

    inv = Inventory(path=path, name=name, config_path=config_path, config=config, push_config=push_config,
                    secrets=secrets, tls=tls, chunk_seconds=float(chunk_seconds), spark_master=spark_master,
                    systemd_dir=systemd_dir, env_dir=env_dir, ready_timeout=float(ready_timeout),
                    levels=levels, hosts=hosts, warnings=warnings, spark=spark,
                    spark_secret_paths={lv: p for lv, p in secret_paths.items() if lv in used},
                    spark_configured=configured)
    for lv in inv.spark_secret_paths:  # the path each host of the level receives it at must be plain
        for h in inv.hosts_of(lv):
            _posix_abs(inv.spark_secret_remote(h, lv), f"deployment.config [groups.\"{lv}\"] spark_secret_file "
                                                       f"(on {h.name})", err)

    # fixed TCP ports must not collide on one address (the Spark daemons' too)
    taken: dict[tuple[str, int], str] = {}

    def claim(h: Host, port: int, what: str, key: str) -> None:
        k = (h.address, port)
        if k in taken:
            raise err(key, f"{h.name} {what} and {taken[k]} both listen on {h.address}:{port}")
        taken[k] = f"{h.name} {what}"

    for h in hosts:
        for p in h.processes(inv):
            if p.port:
                claim(h, p.port, p.name, f"levels.{_toml_key(p.level)}")
    for lv, c in spark.items():
        key = f"levels.{_toml_key(lv)}.spark"
        for role, port_name, port in (("spark-master", "master_port", c.master_port),
                                      ("spark-master", "master_webui_port", c.master_webui_port),
                                      ("spark-worker", "worker_port", c.worker_port),
                                      ("spark-worker", "worker_webui_port", c.worker_webui_port)):
            for hn in ([c.master_host] if role == "spark-master" else list(c.workers)):
                if port:
                    claim(by_name[hn], port, f"{role}-{c.slug} ({port_name})", f"{key}.{port_name}")
    # hosts that share a state dir on one machine would overwrite each other's files
    local_dirs: dict[tuple[str, str], str] = {}
    for h in hosts:
        if h.transport in ("netns", "local"):
            k = ("local", h.state_dir)
            if k in local_dirs:
                raise err(f"hosts[{seen_names[h.name]}].state_dir", f"{h.state_dir} is also {local_dirs[k]}'s, "
                                                                    f"on the same machine")
            local_dirs[k] = h.name
    if not tls:
        warnings.append("tls = false: processes run with --insecure; only the group keys protect the groups")
    for lv in used:
        given = config.groups.get(lv)
        if given is not None and (given.interface is not None or given.ttl is not None):
            warnings.append(f"the config's [groups.\"{lv}\"] interface/ttl are overridden per host by the inventory")
    return inv


# ---- the levels' Spark ----------------------------------------------------------------------------
def _spark_host_names(raw_levels) -> set[str]:
    """Host names the ``[levels."L".spark]`` tables mention (such a host may list no levels)."""
    out: set[str] = set()
    if not isinstance(raw_levels, dict):
        return out
    for spec in raw_levels.values():
        sp = spec.get("spark") if isinstance(spec, dict) else None
        if isinstance(sp, dict):
            if isinstance(sp.get("master_host"), str):
                out.add(sp["master_host"])
            ws = sp.get("workers", [])
            if isinstance(ws, list):
                out.update(w for w in ws if isinstance(w, str))
    return out


def _config_spark(config: Config) -> tuple[dict, dict[str, str]]:
    """The config's per-level Spark settings (strata/spark_settings.py; checked when the config was
    loaded) and each level's ``spark_secret_file`` as written there (relative to the config file,
    like the workers read it)."""
    settings = {lv: g.spark for lv, g in config.groups.items()}
    paths = {lv: g.spark_secret_file for lv, g in config.groups.items() if g.spark_secret_file is not None}
    return settings, paths


def _spark_cluster(lv: str, spec, key: str, hosts: dict[str, Host], settings: dict, slug: str, err) -> SparkCluster:
    if not isinstance(spec, dict):
        raise err(key, "must be a table (master_host, master_port, workers, ...)")
    _no_unknown(spec, SPARK_KEYS, key, err)
    mh = _str(spec, "master_host", key, err, required=True)
    if mh not in hosts:
        raise err(f"{key}.master_host", f"no host named {mh!r} (hosts: {', '.join(hosts)})")
    workers = _str_list(spec, "workers", key, err) if "workers" in spec else [mh]
    if not workers:
        raise err(f"{key}.workers", "no Spark worker: name at least one host")
    for w in workers:
        if w not in hosts:
            raise err(f"{key}.workers", f"no host named {w!r} (hosts: {', '.join(hosts)})")
    if len(set(workers)) != len(workers):
        raise err(f"{key}.workers", "a host is listed twice (one Spark worker per host and level)")
    ports = {}
    for k, default in (("master_port", 7077), ("master_webui_port", 8080), ("worker_port", 0),
                       ("worker_webui_port", 8081)):
        ports[k] = _int(spec, k, key, err, default)
        if not 0 <= ports[k] <= 65535:
            raise err(f"{key}.{k}", "must be a TCP port 1..65535 (or 0: any free port)")
    if ports["master_port"] == 0:
        raise err(f"{key}.master_port", "must be a fixed TCP port: the level's workers find the master there "
                                        "(the config's spark_master)")
    cores = spec.get("worker_cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or not 1 <= cores <= 1024):
        raise err(f"{key}.worker_cores", "must be a number of cores 1..1024")
    memory = spec.get("worker_memory")
    if memory is not None and (not isinstance(memory, str) or not _SPARK_MEMORY.fullmatch(memory)):
        raise err(f"{key}.worker_memory", 'must be an amount like "512m" or "4g"')
    c = SparkCluster(lv, slug, mh, hosts[mh].address, ports["master_port"], ports["master_webui_port"],
                     tuple(workers), ports["worker_port"], ports["worker_webui_port"], cores, memory)
    # the level's workers must be pointed at this cluster by the config (which they read)
    s = settings.get(lv)
    if s is None or s.source != "config" or s.is_local:
        have = f"is {s.master}" if s is not None and s.source == "config" else "is not set"
        raise err(key, f"the config's [groups.\"{lv}\"] spark_master {have}; this inventory runs level {lv}'s "
                       f"Spark master at {c.url}: set spark_master = \"{c.url}\" and spark_secret_file there")
    host_port = s.master[len("spark://"):].rsplit(":", 1) if s.master.startswith("spark://") else ["", "0"]
    if host_port[0].strip("[]").lower() != c.master_address or int(host_port[-1]) != c.master_port:
        raise err(key, f"the config's [groups.\"{lv}\"] spark_master is {s.master}, but this inventory runs level "
                       f"{lv}'s Spark master at {c.url} (master_host {mh}'s address, master_port): make them equal")
    return c


# ---- helpers ------------------------------------------------------------------------------------
def _raise(e: Exception):
    raise e


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else '"' + k.replace('"', '\\"') + '"'


def _table(v, key, err) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise err(key, "must be a table")
    return v


def _no_unknown(d: dict, known: set, key: str, err) -> None:
    extra = sorted(set(d) - known)
    if extra:
        raise err(f"{key}.{extra[0]}", f"unknown key (known: {', '.join(sorted(known))})")


def _str(d: dict, k: str, key: str, err, required: bool = False) -> str:
    if k not in d:
        if required:
            raise err(f"{key}.{k}", "missing")
        return ""
    v = d[k]
    if not isinstance(v, str) or not v.strip():
        raise err(f"{key}.{k}", "must be a non-empty string")
    if any(c in v for c in "\n\r\0"):
        raise err(f"{key}.{k}", "must not contain newlines or NUL")
    return v


def _str_list(d: dict, k: str, key: str, err) -> list[str]:
    v = d.get(k, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise err(f"{key}.{k}", "must be a list of strings")
    return list(v)


def _bool(d: dict, k: str, key: str, err, default: bool) -> bool:
    v = d.get(k, default)
    if not isinstance(v, bool):
        raise err(f"{key}.{k}", "must be true or false")
    return v


def _int(d: dict, k: str, key: str, err, default: int) -> int:
    v = d.get(k, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise err(f"{key}.{k}", "must be an integer")
    return v


def _num(d: dict, k: str, key: str, err, default: float) -> float:
    v = d.get(k, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(f"{key}.{k}", "must be a number")
    return float(v)


def _ssh_options(d: dict, k: str, key: str, err) -> list[str]:
    """ssh/scp options as ``Key=Value`` strings (each passed as ``-o Key=Value``)."""
    opts = _str_list(d, k, key, err)
    for o in opts:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*=[^\s].*", o):
            raise err(f"{key}.{k}", f"{o!r}: give ssh options as \"Key=Value\" (e.g. \"Port=2222\", "
                                   f"\"IdentityFile=/root/.ssh/strata\")")
    return opts


def _posix_abs(v: str, key: str, err) -> None:
    if not v.startswith("/"):
        raise err(key, f"{v!r} must be an absolute path on the hosts")
    if any(c in v for c in "\"'`$\\;&|<>*?!{}()\t ") or "/../" in v + "/":
        raise err(key, f"{v!r}: use a plain path (no spaces, quotes or shell characters)")
