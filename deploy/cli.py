"""``strata deploy check|up|down|status|units --inventory FILE``: level groups on several hosts.

``up`` validates the inventory against the config's lattice, makes the group
keys (and TLS material) once on this machine, gives every host exactly the
files of the levels it runs, starts the processes (in the background, or as
systemd units with ``--systemd``), waits until every process is ready and
until each level's master host hears every worker of its level on the level's
multicast group, and records what it started next to the inventory
(``<inventory>.deployed.json``) for ``status`` and ``down``.  A process whose
inventory port is 0 gets a port chosen on its host once and kept (a restarted
master keeps its address); ``up --fresh`` sets each master's event log aside
first, so the level starts a new timeline instead of restoring the old one.

A level with a ``[levels."L".spark]`` table gets its own Spark standalone cluster: ``up``
starts its master and workers first (deploy/spark_daemons.py; Spark's authentication and
encryption on, the level's secret in a 0600 properties file on those hosts only), waits
until the master is alive and every Spark worker registered, then starts the Strata
processes, whose workers reach the cluster through the config's ``[groups."L"]
spark_master``.  Each level's ``spark_secret_file`` goes to that level's worker hosts only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path, PurePosixPath

from strata import tls as stls
from strata.errors import EXIT_ERROR, EXIT_OK, CliError, ConfigError
from strata.groups import load_or_create_key
from strata.spark_settings import read_secret

from .inventory import Host, Inventory, InventoryError, Proc, load_inventory
from .remote import RemoteError, agent_argv, transport_for, transport_from_record
from . import spark_daemons
from .units import (PLAN_ENV, key_files_for, log_file, process_argv, process_env, ready_file, render_env_files,
                    render_units, spark_secret_files_for, spark_secret_source, tls_files_for, tls_supported,
                    write_rendered)

__all__ = ["add_parsers", "deploy_up", "deploy_down", "deploy_status", "ensure_secrets"]

PROBE_SECONDS = 30.0


def _progress(msg: str) -> None:
    print(f"[deploy] {msg}", file=sys.stderr, flush=True)


def _load(args) -> Inventory:
    try:
        inv = load_inventory(args.inventory)
    except InventoryError as e:
        raise CliError(str(e)) from None
    for w in inv.warnings:
        _progress(f"warning: {w}")
    return inv


def _parallel(fn, items):
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as ex:
        futures = [ex.submit(fn, it) for it in items]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except (RemoteError, CliError, OSError) as e:
                errors.append(str(e))
                results.append(None)
    if errors:
        raise CliError("\n".join(errors))
    return results


# ---- secrets ---------------------------------------------------------------------------------------
def ensure_secrets(inv: Inventory) -> None:
    """Group keys (and TLS material) for every level, made once on this machine."""
    keys = inv.secrets / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(inv.secrets, 0o700)
    os.chmod(keys, 0o700)
    for lv, g in inv.levels.items():
        path = keys / f"{g.slug}.key"
        if not path.exists():
            _progress(f"new group key for level {lv}: {path}")
        load_or_create_key(path, create=True)
    if not inv.tls:
        return
    if not tls_supported():
        raise CliError("inventory deployment.tls = true, but this Strata build has no TLS support "
                       "(strata.tls); set tls = false for a development deployment")
    tdir = inv.secrets / "tls"
    need = {lv: roles for lv, roles in _tls_roles(inv).items()}
    missing = [lv for lv, roles in need.items() if not all(stls.has_material(tdir, r, lv) for r in roles)]
    if missing and (tdir / "ca.pem").exists() and not (tdir / "ca.key").exists():
        raise CliError(f"{tdir}: certificates for levels {', '.join(missing)} are missing and the CA key is not "
                       f"there (kept offline?): issue them with `strata certs --out` a directory holding "
                       f"ca.pem and ca.key, and copy the level's files into {tdir}")
    if missing:
        _progress(f"new TLS certificates for levels {', '.join(missing)} in {tdir} (CA key stays here)")
        stls.create_deployment(tdir, missing)


def _tls_roles(inv: Inventory) -> dict[str, tuple[str, ...]]:
    return {lv: ("master", "worker", "client") for lv in inv.levels}


def spark_secrets(inv: Inventory) -> dict[str, str]:
    """Each deployed level's Spark secret, read now from its ``spark_secret_file`` (relative to the
    config): ``up`` copies the file to the level's worker hosts and puts the secret into the
    properties file of the level's Spark daemons.  A missing, exposed or empty file: one line."""
    out = {}
    for lv in inv.spark_secret_paths:
        try:
            out[lv] = read_secret(spark_secret_source(inv, lv), lv)
        except ConfigError as e:
            raise CliError(f"{e} (strata deploy copies it to level {lv}'s worker hosts"
                           + (" and gives it to the level's Spark daemons)" if lv in inv.spark else ")")) from None
    return out


# ---- preparing and starting a host ---------------------------------------------------------------------
def _host_files(inv: Inventory, host: Host, systemd: bool, procs: list[Proc] | None = None,
                secrets: dict[str, str] | None = None) -> list[tuple[Path | str, str, int]]:
    """(source file or text, remote path, mode) for every file this host receives."""
    files: list[tuple[Path | str, str, int]] = []
    for dst, src in spark_secret_files_for(inv, host).items():  # the level's workers read it (0600)
        files.append((src, dst, 0o600))
    for _role, lv in inv.spark_daemons(host):  # the level's Spark daemons: their properties, with the secret
        dst = spark_daemons.properties_path(host, inv.spark[lv].slug)
        if dst not in [f[1] for f in files]:
            files.append((spark_daemons.properties_text(inv, host, lv, (secrets or {})[lv]), dst, 0o600))
    if inv.push_config:
        files.append((inv.config_path, host.config, 0o644))
        if host.masters:  # only masters check logins; workers never see the users file
            users = inv.config.users_path
            if users.exists():
                files.append((users, _remote_users_file(host), 0o600))
    for dst, src in key_files_for(inv, host).items():
        files.append((src, dst, 0o600))
    for dst, src in tls_files_for(inv, host).items():
        files.append((src, dst, 0o644 if dst.endswith(".pem") else 0o600))
    if systemd:
        for dst, text in render_units(inv, host).items():
            files.append((text, dst, 0o644))
        for dst, text in render_env_files(inv, host, procs).items():
            files.append((text, dst, 0o644))
    return files


def _remote_users_file(host: Host) -> str:
    return str(PurePosixPath(host.config).with_name(PurePosixPath(host.config).stem + ".users.json"))


def _plan(inv: Inventory, host: Host, systemd: bool, ports: list[Proc] | None = None, fresh: bool = False) -> dict:
    procs = []
    for p in (host.processes(inv) if ports is None else ports):
        env = process_env(inv, host, p)
        procs.append({"name": p.name, "role": p.role, "level": p.level, "argv": process_argv(inv, host, p),
                      "env": {k: v for k, v in env.items() if k in PLAN_ENV},
                      "ready": ready_file(host, p), "log": log_file(host, p), "unit": p.unit})
    return {"deployment": inv.name, "mode": "systemd" if systemd else "process", "processes": procs,
            "service_user": host.service_user,
            # (--systemd: files outside the state dir the service user's processes read)
            "chown": ([_remote_users_file(host)] if (host.masters and inv.push_config) else [])
            + list(spark_secret_files_for(inv, host)),
            # up --fresh: the masters' event logs are set aside before they start (a new timeline)
            "fresh": [state_file(host, p) for p in host.processes(inv) if p.role == "master"] if fresh else []}


def state_file(host: Host, proc: Proc) -> str:
    """A master's event log and state on its host (master/main.py: ``STATE_DIR/master-<slug>.sqlite``)."""
    return host.path(f"{proc.name}.sqlite")


def _fixed_ports(inv: Inventory, host: Host, t) -> tuple[list[Proc], list[str]]:
    """The host's processes with the ports they keep (inventory port 0: chosen on the host once, reused
    after: a restarted master listens on the same address), and notes for the progress line."""
    procs = host.processes(inv)
    avoid = sorted({port for _role, lv in inv.spark_daemons(host) for port in _spark_ports(inv, host, lv) if port})
    res = t.run_json(agent_argv(host.python, "ports", "--state-dir", host.state_dir),
                     input=json.dumps({"address": host.address, "processes": {p.name: p.port for p in procs},
                                       "avoid": avoid}).encode(),
                     timeout=60)
    for m in res.get("moved", []):
        _progress(f"warning: {host.name}: {m['name']}'s port {m['old']} is taken by another program; it now "
                  f"listens on {host.address}:{m['new']} (its clients need the new address)")
    notes = [f"{n} {res['ports'][n]}" for n in res.get("chosen", [])]
    return [replace(p, port=int(res["ports"][p.name])) for p in procs], notes


def _spark_ports(inv: Inventory, host: Host, level: str) -> list[int]:
    c = inv.spark[level]
    return (([c.master_port, c.master_webui_port] if host.name == c.master_host else [])
            + ([c.worker_port, c.worker_webui_port] if host.name in c.workers else []))


def _prepare(inv: Inventory, host: Host, systemd: bool, secrets: dict[str, str]) -> dict:
    """Directories, kept ports and files of one host (nothing started yet)."""
    t = transport_for(host)
    t.mkdirs([host.state_dir, host.path("keys"), host.path("logs"), host.path("run")]
             + ([host.path("tls")] if inv.tls else [])
             + [spark_daemons.level_dir(host, inv.spark[lv].slug) for _r, lv in inv.spark_daemons(host)])
    procs, chosen = _fixed_ports(inv, host, t)
    copied = 0
    for src, dst, mode in _host_files(inv, host, systemd, procs, secrets):
        if isinstance(src, Path):
            copied += bool(t.put(src, dst, mode))
        else:
            t.put_text(src, dst, mode)
            copied += 1
    return {"host": host, "t": t, "procs": procs, "chosen": chosen, "copied": copied,
            "entry": {"host": host.name, "transport": t.describe(), "state_dir": host.state_dir,
                      "python": host.python, "processes": [], "spark": []}}


def _start_spark(inv: Inventory, prep: dict) -> None:
    """The host's Spark daemons (the levels' own clusters), recorded in the host's entry."""
    host, t = prep["host"], prep["t"]
    plan = {"deployment": inv.name, "daemons": spark_daemons.daemon_plan(inv, host)}
    res = t.run_json(agent_argv(host.python, "spark-start", "--state-dir", host.state_dir),
                     input=json.dumps(plan).encode(), timeout=120)
    prep["entry"]["spark"] = res["daemons"]


def _start(inv: Inventory, prep: dict, systemd: bool, fresh: bool) -> None:
    host, t = prep["host"], prep["t"]
    plan = _plan(inv, host, systemd, prep["procs"], fresh)
    res = t.run_json(agent_argv(host.python, "start", "--state-dir", host.state_dir),
                     input=json.dumps(plan).encode(), timeout=180)
    prep["entry"]["processes"] = res["processes"]
    names = ", ".join([p["name"] for p in res["processes"]] + [d["name"] for d in prep["entry"]["spark"]])
    chosen = prep["chosen"]
    logs = [n for n in res.get("set_aside", []) if ".sqlite." in n]  # (not its -wal, -shm)
    _progress(f"{host.name}: {prep['copied']} files copied; started {names or 'nothing'}"
              + (f"; ports kept for restarts: {', '.join(chosen)}" if chosen else "")
              + (f"; new timeline, old event log kept as {', '.join(logs)}" if logs else
                 ("; new timeline (no earlier event log)" if plan["fresh"] else "")))


def _wait_spark(inv: Inventory, record: dict, timeout: float) -> None:
    """Until every level's Spark master is alive and each of its Spark workers registered with it."""
    hosts = [h for h in record["hosts"] if h.get("spark")]
    if not hosts:
        return
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        statuses = _parallel(_host_status, hosts)
        daemons = {(h["host"], d["name"]): d for h, st in zip(hosts, statuses) for d in st.get("spark", [])}
        dead = [(k, d) for k, d in daemons.items() if not d["alive"]]
        if dead:
            raise CliError("\n".join(f"{name} on {host} exited during start-up; log tail:\n"
                                     f"{(d.get('log_tail') or '').rstrip()[-1500:]}" for (host, name), d in dead))
        pending = [f"{n} on {h}" for (h, n), d in daemons.items() if not d["ready"]]
        if not pending:
            break
        if time.monotonic() > deadline:
            raise CliError(f"Spark daemons not ready within {timeout:.0f} s: {', '.join(pending)} (see "
                           f"<state-dir>/logs/spark-*.log on those hosts)")
        time.sleep(0.5)
    for lv, c in inv.spark.items():
        _progress(f"level {lv}: Spark master {c.url} on {c.master_host} is up with {len(c.workers)} "
                  f"worker{'s' if len(c.workers) != 1 else ''} ({', '.join(c.workers)}), in "
                  f"{time.monotonic() - t0:.1f} s")


# ---- up ----------------------------------------------------------------------------------------------------
def _host_status(entry: dict) -> dict:
    t = transport_from_record(entry["host"], entry["transport"])
    return t.run_json(agent_argv(entry["python"], "status", "--state-dir", entry["state_dir"]), timeout=60)


def _wait_ready(record: dict, timeout: float) -> dict[tuple[str, str], dict]:
    """host, process name → status entry of every process, once all are ready."""
    total = sum(len(h["processes"]) for h in record["hosts"])
    deadline = time.monotonic() + timeout
    last, last_print = -1, 0.0
    while True:
        statuses = _parallel(_host_status, record["hosts"])
        procs = {(h["host"], p["name"]): p for h, st in zip(record["hosts"], statuses) for p in st["processes"]}
        dead = [(k, p) for k, p in procs.items() if not p["alive"]]
        if dead:
            parts = []
            for (host, name), p in dead:
                tail = (p.get("log_tail") or "").rstrip()[-1500:]
                parts.append(f"{name} on {host} exited during start-up; log tail:\n{tail}")
            raise CliError("\n".join(parts))
        ready = sum(1 for p in procs.values() if p["ready"])
        now = time.monotonic()
        if ready != last or now - last_print > 10:
            _progress(f"waiting for processes: {ready}/{total} ready")
            last, last_print = ready, now
        if ready == total and len(procs) == total:
            return procs
        if now > deadline:
            pending = [f"{n} on {h}" for (h, n), p in procs.items() if not p["ready"]]
            raise CliError(f"not ready within {timeout:.0f} s: {', '.join(pending)} "
                           f"(see their logs under <state-dir>/logs on those hosts)")
        time.sleep(1.0)


def _probe(inv: Inventory, level: str, expect: list[str], seconds: float) -> dict:
    host = inv.master_host(level)
    g = inv.levels[level]
    t = transport_for(host)
    return t.run_json(agent_argv(host.python, "probe", "--level", level,
                                 "--key-file", host.path("keys", f"{g.slug}.key"), "--address", g.address,
                                 "--port", str(g.port), "--interface", host.address, "--expect", ",".join(expect),
                                 "--seconds", str(seconds)), timeout=seconds + 60)


def _check_groups(inv: Inventory, procs: dict, seconds: float) -> dict[str, dict]:
    """Each level's master host must hear every worker of its level on the level's group."""
    def one(level):
        workers = sorted(p["address"] for p in procs.values() if p["level"] == level and p["role"] == "worker")
        master = next(p["address"] for p in procs.values() if p["level"] == level and p["role"] == "master")
        res = _probe(inv, level, workers + [master], seconds)
        return level, workers, res

    out = {}
    problems = []
    for level, workers, res in _parallel(one, list(inv.levels)):
        heard = res["heard"]
        strangers = sorted(s for s in heard if s not in {p["address"] for p in procs.values() if p["level"] == level})
        if res["missing"]:
            g = inv.levels[level]
            problems.append(
                f"level {level}: {inv.master_host(level).name} does not hear {', '.join(res['missing'])} on "
                f"{g.address}:{g.port} (heard: {', '.join(sorted(heard)) or 'nobody'}; rejected: "
                f"{res['rejected'] or 'none'}). Heartbeats do not cross between the hosts: check ttl "
                f"(now {g.ttl}), that UDP {g.port} to {g.address} passes the firewalls, that switches "
                f"forward the group (IGMP snooping needs a querier), and each host's address")
        _progress(f"level {level}: master host {inv.master_host(level).name} hears "
                  f"{sum(1 for h in heard.values() if h['role'] == 'worker')}/{len(workers)} workers"
                  + (f" and unknown members {strangers}" if strangers else ""))
        out[level] = {"workers": workers, "heard": heard, "rejected": res["rejected"]}
    if problems:
        raise CliError("\n".join(problems))
    return out


def deploy_up(inv: Inventory, systemd: bool = False, timeout: float | None = None,
              keep_on_failure: bool = False, fresh: bool = False) -> dict:
    rec_path = inv.record_path
    if rec_path.exists():
        raise CliError(f"a deployment is recorded in {rec_path}: run `strata deploy down --inventory "
                       f"{inv.path}` first")
    ensure_secrets(inv)
    for h in inv.hosts:
        if h.masters and inv.push_config and not inv.config.users_path.exists():
            _progress(f"warning: no users file {inv.config.users_path}: nobody can log in to the masters on "
                      f"{h.name} (add users with `strata users add`, then deploy again)")
    _progress(f"deployment {inv.name}: {len(inv.hosts)} hosts, levels {', '.join(inv.levels)}"
              + (" (systemd units)" if systemd else "")
              + (" (--fresh: each master starts a new timeline)" if fresh else ""))
    secrets = spark_secrets(inv)
    errors: list[str] = []

    def on_host(fn):
        def run(item):
            host = item["host"] if isinstance(item, dict) else item
            try:
                return fn(item)
            except (RemoteError, CliError, OSError) as e:
                msg = str(e)  # (a transport's error names its host already)
                errors.append(msg if msg.startswith(f"{host.name}: ") else f"{host.name}: {msg}")
                return None
        return run

    def each(fn, items):
        items = list(items)
        if items:
            with ThreadPoolExecutor(max_workers=min(16, len(items))) as ex:
                return list(ex.map(on_host(fn), items))
        return []

    prepared = [p for p in each(lambda h: _prepare(inv, h, systemd, secrets), inv.hosts) if p is not None]
    record = {"deployment": inv.name, "inventory": str(inv.path.resolve()) if inv.path else None,
              "mode": "systemd" if systemd else "process", "started": time.time(),
              "hosts": [p["entry"] for p in prepared]}
    _write_record(rec_path, record)
    try:
        if errors:
            raise CliError("\n".join(errors))
        if inv.spark:  # a level's own Spark cluster first: its workers reach it as they start
            each(lambda p: _start_spark(inv, p), [p for p in prepared if inv.spark_daemons(p["host"])])
            _write_record(rec_path, record)
            if errors:
                raise CliError("\n".join(errors))
            _wait_spark(inv, record, timeout or inv.ready_timeout)
        each(lambda p: _start(inv, p, systemd, fresh), prepared)
        _write_record(rec_path, record)
        if errors:
            raise CliError("\n".join(errors))
        procs = _wait_ready(record, timeout or inv.ready_timeout)
        for h in record["hosts"]:
            for p in h["processes"]:
                p["address"] = procs[(h["host"], p["name"])]["address"]
        _write_record(rec_path, record)
        groups = _check_groups(inv, procs, PROBE_SECONDS)
    except CliError:
        if not keep_on_failure:
            _progress("start-up failed: stopping what was started")
            try:
                deploy_down(record, rec_path)
            except CliError as e2:
                _progress(f"while stopping: {e2}")
        raise
    out = {"deployment": inv.name,
           "masters": {lv: next(p["address"] for p in procs.values() if p["level"] == lv and p["role"] == "master")
                       for lv in inv.levels},
           "workers": {lv: groups[lv]["workers"] for lv in inv.levels},
           "record": str(rec_path)}
    _progress(f"deployment {inv.name} is up")
    return out


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


# ---- down / status -------------------------------------------------------------------------------------------
def _record_or_inventory(inv: Inventory) -> dict:
    if inv.record_path.exists():
        return json.loads(inv.record_path.read_text())
    return {"deployment": inv.name, "hosts": [
        {"host": h.name, "transport": transport_for(h).describe(), "state_dir": h.state_dir, "python": h.python,
         "processes": []} for h in inv.hosts]}


def deploy_down(record: dict, rec_path: Path | None) -> tuple[int, int]:
    """Stop what the record lists on each host: (Strata processes, Spark daemons) stopped."""
    def stop(entry):
        t = transport_from_record(entry["host"], entry["transport"])
        res = t.run_json(agent_argv(entry["python"], "stop", "--state-dir", entry["state_dir"]), timeout=120)
        k = res.get("spark_stopped", 0)
        _progress(f"{entry['host']}: stopped {res.get('stopped', 0)} processes"
                  + (f" and {k} Spark daemon{'s' if k != 1 else ''}" if k else ""))
        return res.get("stopped", 0), k

    counts = _parallel(stop, record["hosts"])
    if rec_path is not None and rec_path.exists():
        rec_path.unlink()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def deploy_status(inv: Inventory, probe_seconds: float = 3.0) -> dict:
    record = _record_or_inventory(inv)
    statuses = _parallel(_host_status, record["hosts"])
    hosts = {}
    procs = {}
    spark: dict[str, list[dict]] = {}
    for entry, st in zip(record["hosts"], statuses):
        hosts[entry["host"]] = st["processes"]
        for p in st["processes"]:
            procs[(entry["host"], p["name"])] = p
        for d in st.get("spark", []):
            spark.setdefault(d["level"], []).append({"host": entry["host"], **d})
    groups = {}
    for lv in inv.levels:
        members = [p for p in procs.values() if p["level"] == lv and p.get("address")]
        if not members:
            continue
        try:
            res = _probe(inv, lv, [p["address"] for p in members], probe_seconds)
            groups[lv] = {"heard": res["heard"], "missing": res["missing"], "rejected": res["rejected"]}
        except RemoteError as e:
            groups[lv] = {"error": str(e)}
    healthy = bool(procs) and all(p["alive"] and p["ready"] for p in procs.values()) and \
        all(not g.get("missing") and not g.get("error") for g in groups.values()) and \
        all(d["alive"] and d["ready"] for ds in spark.values() for d in ds)
    for lv, c in inv.spark.items():  # every Spark daemon the inventory runs must be there, and registered
        ds = spark.get(lv, [])
        master = next((d for d in ds if d["role"] == "spark-master"), None)
        if (master is None or len([d for d in ds if d["role"] == "spark-worker"]) != len(c.workers)
                or (master.get("workers") is not None and len(master["workers"]) < len(c.workers))):
            healthy = False
    return {"deployment": record.get("deployment"), "healthy": healthy, "hosts": hosts, "groups": groups,
            "spark": spark}


# ---- commands ------------------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    inv = _load(args)
    summary = {"deployment": inv.name, "config": str(inv.config_path), "tls": inv.tls, "levels": {}}
    for lv, g in inv.levels.items():
        summary["levels"][lv] = {
            "group": f"{g.address}:{g.port}", "ttl": g.ttl, "master": inv.master_host(lv).name,
            "workers": {h.name: h.workers[lv] for h in inv.hosts_of(lv) if h.workers[lv]}}
        if lv in inv.spark:
            c = inv.spark[lv]
            summary["levels"][lv]["spark"] = {"master": c.url, "master_host": c.master_host,
                                              "workers": list(c.workers)}
        elif lv not in inv.spark_configured and inv.spark_master_env(lv):
            summary["levels"][lv]["spark"] = {"master": inv.spark_master_env(lv), "from": "deployment.spark_master"}
    spark_secrets(inv)  # each level's spark_secret_file is there and private (up copies it)
    if args.reach:
        def reach(h):
            t = transport_for(h)
            info = t.run_json(agent_argv(h.python, "check"), timeout=60)
            if inv.tls and not info.get("tls"):
                raise CliError(f"{h.name}: its Strata has no TLS support but the inventory says tls = true")
            roles = inv.spark_daemons(h)
            if roles and not info.get("spark_class"):
                raise CliError(f"{h.name}: cannot run level {roles[0][1]}'s Spark daemons: "
                               f"{info.get('spark_problem') or 'this Strata is too old for them'}")
            return h.name, info

        summary["hosts"] = dict(_parallel(reach, inv.hosts))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"inventory {args.inventory}: deployment {inv.name}, {len(inv.hosts)} hosts, TLS {'on' if inv.tls else 'OFF'}")
        for lv, s in summary["levels"].items():
            ws = ", ".join(f"{h}×{n}" for h, n in s["workers"].items()) or "none"
            print(f"  level {lv}: group {s['group']} ttl {s['ttl']}, master on {s['master']}, workers {ws}"
                  + (f"; Spark cluster {s['spark']['master']} on {s['spark']['master_host']}, Spark workers "
                     f"{', '.join(s['spark']['workers'])}" if "master_host" in s.get("spark", {}) else ""))
        for name, info in summary.get("hosts", {}).items():
            print(f"  {name}: reachable, Python {info['python']}, strata {info['strata']}")
    return EXIT_OK


def cmd_up(args) -> int:
    inv = _load(args)
    out = deploy_up(inv, systemd=args.systemd, timeout=args.timeout, keep_on_failure=args.keep_on_failure,
                    fresh=args.fresh)
    print(json.dumps(out))
    return EXIT_OK


def cmd_down(args) -> int:
    inv = _load(args)
    record = _record_or_inventory(inv)
    n, k = deploy_down(record, inv.record_path)
    _progress((f"stopped {n} processes" + (f" and {k} Spark daemon{'s' if k != 1 else ''}" if k else ""))
              if n or k else "nothing was running")
    return EXIT_OK


def cmd_status(args) -> int:
    inv = _load(args)
    st = deploy_status(inv)
    if args.json:
        print(json.dumps(st))
    else:
        print(f"deployment {st['deployment']}: {'healthy' if st['healthy'] else 'NOT healthy'}")
        for host, procs in st["hosts"].items():
            for p in procs:
                state = "ready" if p["ready"] else ("alive" if p["alive"] else "DEAD")
                print(f"  {host:16} {p['name']:20} {state:6} {p.get('address') or '-'}")
        for lv, ds in st["spark"].items():
            for d in ds:
                state = "ready" if d["ready"] else ("alive" if d["alive"] else "DEAD")
                extra = (f" ({len(d['workers'])} workers, apps: {', '.join(d['apps']) or 'none'})"
                         if "workers" in d else "")
                print(f"  {d['host']:16} {d['name']:20} {state:6} {d.get('address') or '-'}{extra}")
        for lv, g in st["groups"].items():
            if "error" in g:
                print(f"  level {lv}: probe failed: {g['error']}")
            else:
                print(f"  level {lv}: master host hears {len(g['heard'])} members"
                      + (f"; missing {', '.join(g['missing'])}" if g["missing"] else ""))
    return EXIT_OK if st["healthy"] else EXIT_ERROR


def cmd_units(args) -> int:
    inv = _load(args)
    hosts = [inv.host(n) for n in args.host] if args.host else None
    for p in write_rendered(inv, Path(args.out), hosts):
        print(p)
    return EXIT_OK


def add_parsers(sub) -> None:
    d = sub.add_parser("deploy", help="start level groups on several hosts from an inventory (ssh/systemd)")
    dsub = d.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")

    def inventory(p):
        p.add_argument("--inventory", required=True, help="the inventory TOML (see docs/deploy.md)")

    c = dsub.add_parser("check", help="validate the inventory against the config")
    inventory(c)
    c.add_argument("--reach", action="store_true", help="also run the host agent on every host")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    u = dsub.add_parser("up", help="copy keys/certificates, start every host's processes, wait for the groups")
    inventory(u)
    u.add_argument("--systemd", action="store_true", help="install and start systemd units instead of nohup processes")
    u.add_argument("--timeout", type=float, help="seconds to wait for readiness (default: inventory ready_timeout)")
    u.add_argument("--keep-on-failure", action="store_true", help="leave processes running if start-up fails")
    u.add_argument("--fresh", action="store_true",
                   help="start every master on a new timeline: its event log (STATE_DIR/master-<level>.sqlite*) "
                        "is renamed to *.<UTC time>.old first (default: a master restores its queries, sessions "
                        "and input)")
    u.set_defaults(func=cmd_up)

    dn = dsub.add_parser("down", help="stop what `strata deploy up` started")
    inventory(dn)
    dn.set_defaults(func=cmd_down)

    s = dsub.add_parser("status", help="processes per host and who each master host hears")
    inventory(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    un = dsub.add_parser("units", help="render systemd units and environment files per host into a directory")
    inventory(un)
    un.add_argument("--out", required=True)
    un.add_argument("--host", action="append", help="only this host (repeatable)")
    un.set_defaults(func=cmd_units)
