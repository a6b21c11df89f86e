"""What a host runs: command lines, environments, systemd units and their environment files.

Every process of a deployment is ``python -m strata master|worker`` with the
host's interface address as its gRPC listen address, and the level group's
multicast settings in its environment (read by :func:`strata.groups.group_spec`)::

    STRATA_GROUP_ADDRESS=239.255.10.3   the level's multicast group
    STRATA_GROUP_INTERFACE=10.0.0.7     the host's interface: IP_MULTICAST_IF and the join
    STRATA_GROUP_TTL=1                  hops heartbeats may cross

A worker's Spark is its level's (the config's ``[groups."L"] spark_master``, read by the
worker itself): no ``--spark-master`` is passed; only a deprecated ``[deployment]
spark_master`` of the inventory is handed, as ``STRATA_SPARK_MASTER``, to workers of
levels whose config names no Spark master.

Under systemd the same settings live in one environment file per instance
(``/etc/strata/worker-S-0.env`` for ``strata-worker@S-0``), and the unit
templates in ``deploy/systemd/`` are rendered per host (interpreter, state dir,
service user); see ``docs/deploy.md``.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from strata import tls

from .inventory import Host, Inventory, Proc

__all__ = ["TEMPLATE_DIR", "TEMPLATES", "tls_supported", "process_argv", "process_env", "env_file_text",
           "render_units", "render_env_files", "render_host", "write_rendered", "tls_files_for", "key_files_for",
           "spark_secret_files_for", "spark_secret_source", "PLAN_ENV"]

TEMPLATE_DIR = Path(__file__).with_name("systemd")
TEMPLATES = ("strata-master@.service", "strata-worker@.service", "strata.target")
DOCS = "docs/deploy.md"


def tls_supported() -> bool:
    """Whether this Strata build has transport TLS (and so ``--insecure``/``strata certs``): the core's
    :mod:`strata.tls`, imported above like any other module (this module does not load without it)."""
    return tls is not None


def _extra_args(inv: Inventory) -> list[str]:
    return ["--insecure"] if (not inv.tls and tls_supported()) else []


def ready_file(host: Host, proc: Proc) -> str:
    return host.path("run", f"{proc.name}.json")


def log_file(host: Host, proc: Proc) -> str:
    return host.path("logs", f"{proc.name}.log")


def process_env(inv: Inventory, host: Host, proc: Proc) -> dict[str, str]:
    """The environment of one process (also the content of its systemd environment file)."""
    g = inv.levels[proc.level]
    env = {
        "STRATA_CONFIG": host.config,
        "STRATA_LEVEL": proc.level,
        "STRATA_LISTEN": f"{host.address}:{proc.port}",
        "STRATA_STATE_DIR": host.state_dir,
        "STRATA_MULTICAST_PORT": str(g.port),
        "STRATA_READY_FILE": ready_file(host, proc),
        "STRATA_GROUP_ADDRESS": g.address,
        "STRATA_GROUP_INTERFACE": host.address,
        "STRATA_GROUP_TTL": str(g.ttl),
        "STRATA_EXTRA_ARGS": " ".join(_extra_args(inv)),
        "PYARROW_IGNORE_TIMEZONE": "1",
    }
    if proc.role == "worker":
        spark_master = inv.spark_master_env(proc.level)  # (deprecated; only for a level the config leaves unset)
        if spark_master:
            env["STRATA_SPARK_MASTER"] = spark_master
    else:
        env["STRATA_CHUNK_SECONDS"] = repr(inv.chunk_seconds)
    return env


#: the part of :func:`process_env` a process started without systemd gets in its environment
PLAN_ENV = ("STRATA_GROUP_ADDRESS", "STRATA_GROUP_INTERFACE", "STRATA_GROUP_TTL", "STRATA_SPARK_MASTER",
            "PYARROW_IGNORE_TIMEZONE")


def process_argv(inv: Inventory, host: Host, proc: Proc) -> list[str]:
    """``python -m strata master|worker ...`` for a process started without systemd."""
    env = process_env(inv, host, proc)
    argv = [host.python, "-m", "strata", proc.role, "--config", host.config, "--level", proc.level,
            "--listen", env["STRATA_LISTEN"], "--state-dir", host.state_dir,
            "--multicast-port", env["STRATA_MULTICAST_PORT"], "--ready-file", env["STRATA_READY_FILE"]]
    if proc.role == "master":  # (a worker's Spark: its level's, from the config; no --spark-master)
        argv += ["--chunk-seconds", env["STRATA_CHUNK_SECONDS"]]
    return argv + _extra_args(inv)


def group_env(inv: Inventory, host: Host, proc: Proc) -> dict[str, str]:
    """The part of :func:`process_env` the process reads from its environment (not its argv)."""
    env = process_env(inv, host, proc)
    return {k: env[k] for k in PLAN_ENV if k in env}


def _env_quote(v: str) -> str:
    if any(c in v for c in "\n\r\0"):
        raise ValueError(f"environment value {v!r} contains a newline")
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_file_text(env: dict[str, str], header: str = "") -> str:
    lines = [f"# {header}"] if header else []
    lines += [f"{k}={_env_quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def render_units(inv: Inventory, host: Host) -> dict[str, str]:
    """The unit templates for one host: remote path → text."""
    subst = {"@PYTHON@": host.python, "@ENV_DIR@": inv.env_dir, "@STATE_DIR@": host.state_dir,
             "@USER@": host.service_user, "@DOCS@": DOCS}
    roles = {p.role for p in host.processes(inv)}
    out = {}
    for name in TEMPLATES:
        if name.startswith("strata-") and name.split("@")[0].split("-", 1)[1] not in roles:
            continue  # a worker-only host gets no master unit, and vice versa
        text = (TEMPLATE_DIR / name).read_text()
        for k, v in subst.items():
            text = text.replace(k, v)
        out[str(PurePosixPath(inv.systemd_dir, name))] = text
    return out


def render_env_files(inv: Inventory, host: Host, procs: list[Proc] | None = None) -> dict[str, str]:
    """One environment file per instance of this host: remote path → text.

    ``procs``: the host's processes with the ports ``strata deploy up`` fixed for them
    (a port 0 of the inventory replaced by the one the host keeps for the process), so
    that a unit restarted by systemd listens on the same address; default: the
    inventory's ports (``strata deploy units``: 0 stays 0)."""
    out = {}
    for p in (host.processes(inv) if procs is None else procs):
        path = str(PurePosixPath(inv.env_dir, f"{p.role}-{p.instance}.env"))
        out[path] = env_file_text(process_env(inv, host, p),
                                  f"{p.unit} on {host.name} (deployment {inv.name}; written by strata deploy)")
    return out


def render_host(inv: Inventory, host: Host) -> dict[str, str]:
    return {**render_units(inv, host), **render_env_files(inv, host)}


def write_rendered(inv: Inventory, out_dir: Path, hosts: list[Host] | None = None) -> list[Path]:
    """``strata deploy units``: every host's files under ``out_dir/<host>/<remote path>``."""
    written = []
    for h in hosts or inv.hosts:
        for remote, text in render_host(inv, h).items():
            p = Path(out_dir) / h.name / remote.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            written.append(p)
    return written


# ---- secrets: which host gets which file ------------------------------------------------------------
def key_files_for(inv: Inventory, host: Host) -> dict[str, Path]:
    """Group keys a host needs (remote path → operator's file): its own levels' only."""
    return {host.path("keys", f"{inv.levels[lv].slug}.key"): inv.secrets / "keys" / f"{inv.levels[lv].slug}.key"
            for lv in host.levels}


def spark_secret_source(inv: Inventory, level: str) -> Path:
    """The operator's copy of ``level``'s ``spark_secret_file`` (relative to the operator's config)."""
    return Path(os.path.abspath(inv.config_path.resolve().parent / inv.spark_secret_paths[level]))


def spark_secret_files_for(inv: Inventory, host: Host) -> dict[str, Path]:
    """Spark secrets a host needs (remote path → operator's file): ``[groups."L"] spark_secret_file``
    of each level it runs **workers** of, at the path the host's config names (relative to the
    host's config file).  Master-only hosts and hosts of other levels never receive it; the Spark
    daemons' hosts get the secret inside their properties file instead (deploy/spark_daemons.py)."""
    return {inv.spark_secret_remote(host, lv): spark_secret_source(inv, lv)
            for lv in host.levels if host.workers[lv] and lv in inv.spark_secret_paths}


def tls_files_for(inv: Inventory, host: Host) -> dict[str, Path]:
    """TLS material a host needs (remote path → operator's file).

    ``ca.pem`` (never ``ca.key``), and per level the host runs, the certificate and
    key of each role it runs there: ``master-<slug>`` on the level's master host,
    ``worker-<slug>`` on hosts with workers of the level.  A host never receives a
    file of a level it does not run; client certificates stay with the operator.
    """
    if not inv.tls:
        return {}
    src = inv.secrets / "tls"
    out = {host.path("tls", "ca.pem"): src / "ca.pem"}
    for lv in host.levels:
        slug = inv.levels[lv].slug
        roles = (["master"] if lv in host.masters else []) + (["worker"] if host.workers[lv] else [])
        for role in roles:
            for ext in ("pem", "key"):
                out[host.path("tls", f"{role}-{slug}.{ext}")] = src / f"{role}-{slug}.{ext}"
    return out
