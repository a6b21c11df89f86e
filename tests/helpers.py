"""Helpers the end-to-end tests share: a config with its users file, the CLI, CSV files in and out,
a client session, whether a process still runs, and a running cluster that tests share
(:class:`WarmCluster`, the ``warm_s`` fixture of conftest.py)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from strata.client import Client
from strata.config import load_config
from strata.users import ROLES, UserStore
from strata.worker.warmup import WARMUP_SECONDS

#: every test user's password
PASSWORD = "correct horse"


def write_config(dir: Path, text: str, users: dict[str, str | tuple[str, str]]) -> Path:
    """A config and its users file.  ``users``: name → clearance, or (clearance, "role,role").
    A user given only a clearance gets every role (producer, analyst, operator): these tests'
    users ingest, query and read the cluster's status alike."""
    p = dir / "strata.toml"
    p.write_text(text)
    add_users(p, users)
    return p


def add_users(config: Path, users: dict[str, str | tuple[str, str]]) -> None:
    """Add (or replace) ``users`` in the users file of ``config``, as :func:`write_config` does."""
    cfg = load_config(config)
    store = UserStore(cfg.users_path, cfg.lattice)
    for name, spec in users.items():
        clearance, roles = (spec, ROLES) if isinstance(spec, str) else spec
        store.add(name, clearance, PASSWORD, replace=True, roles=roles)


def strata(*args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
    """``python -m strata ARGS`` with the test password in ``STRATA_PASSWORD``."""
    env = {**os.environ, "STRATA_PASSWORD": PASSWORD, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def write_csv(path: Path, header: list[str], rows: list[tuple]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def read_out(path: Path, types: list[str]) -> list[tuple]:
    """The rows of a result CSV (``ts``, ``level``, then columns of ``types``); an empty number is NULL."""
    conv = {"double": lambda s: None if s == "" else float(s), "long": lambda s: None if s == "" else int(s),
            "string": lambda s: s, "level": lambda s: s}
    with open(path) as f:
        rows = list(csv.reader(f))
    out = []
    for r in rows[1:]:
        out.append((int(r[0]), r[1], *[conv.get(t, str)(v) for t, v in zip(types, r[2:])]))
    return out


def login(cluster: dict | str, user: str, level: str = "S", password: str = PASSWORD, **client_kw) -> Client:
    """A session of ``user`` at ``level`` on ``cluster``'s master of that level (``cluster``: ``masters``
    by level, or the one ``master``, and its certificates in ``tls`` or ``tls_dir``: a fixture's dict or
    what ``start_cluster`` returns; or a plaintext master's address)."""
    if isinstance(cluster, str):
        address, tls = cluster, None
    else:
        address = cluster["masters"][level] if "masters" in cluster else cluster["master"]
        tls = cluster["tls"] if "tls" in cluster else cluster.get("tls_dir")
    c = Client(address, tls_dir=tls, level=level, **client_kw)
    c.login(user, password, level)
    return c


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: one that exited counts as gone also while it is a zombie (a
    child of this process not waited for, or one an init that does not reap keeps)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone(pid: int) -> bool:
    """Exited (see :func:`alive`)."""
    return not alive(pid)


#: the environment of a worker that warms up as users' do (the product's default, worker/warmup.py
#: WARMUP_SECONDS), for the processes of a test that depend on it: the suite's default skips it (conftest.py)
WARM_UP = {"STRATA_WARMUP_SECONDS": str(WARMUP_SECONDS)}


class WarmCluster:
    """A cluster of one level (``start_cluster``) that several tests use in turn: each takes a fresh
    master (a new input timeline, no queries or sessions) on the same address with :meth:`renew`, while
    the workers and their Spark sessions stay warm, as ``strata replay --cluster`` does."""

    def __init__(self, dir: Path, config_text: str, level: str, workers: int, warm_up: bool = False):
        from strata.deploy.local import start_cluster

        self.dir, self.level = dir, level
        self.config = write_config(dir, config_text, {})
        self.state = dir / "state"
        self.started = start_cluster(str(self.config), [level], workers, self.state,
                                     worker_env={i: WARM_UP for i in range(workers)} if warm_up else None)

    def renew(self, users: dict[str, str | tuple[str, str]]) -> dict:
        """A fresh master, its users file holding ``users`` too (as :func:`write_config` writes them); the
        test's view of the cluster: ``config``, ``state``, ``dir``, ``master`` (address), ``tls``,
        ``masters`` and ``tls_dir`` (as ``start_cluster`` returns them) and ``pid`` (the master's)."""
        from strata.deploy.local import renew_master

        add_users(self.config, users)
        address, tls, _ = renew_master(self.state, self.level)
        pid = next(p["pid"] for p in json.loads((self.state / "cluster.json").read_text())["processes"]
                   if p["role"] == "master" and p["level"] == self.level)
        return {"config": self.config, "state": self.state, "dir": self.dir, "master": address, "tls": tls,
                "masters": {self.level: address}, "tls_dir": tls, "pid": pid}

    def stop(self) -> None:
        from strata.deploy.local import stop_cluster

        stop_cluster(self.state)


def stable(status: dict) -> dict:
    """A status without its volatile fields (docs/semantics.md §9); the input is drained by now."""
    st = dict(status)
    st.pop("timings", None)
    st.pop("histograms", None)
    if "workers" in st:
        st["workers"] = len(st["workers"])
    if "counters" in st:
        st["counters"] = {k: v for k, v in st["counters"].items() if k not in ("redispatched", "duplicates")}
    return st
