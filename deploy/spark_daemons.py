"""A level's own Spark standalone cluster, run by ``strata deploy`` (``[levels."L".spark]``).

Operator side: what each host runs for a level's cluster (:func:`daemon_plan`) and the
file that carries the level's secret to the Spark hosts (:func:`properties_text`, written
``0600`` to ``<state_dir>/spark/<slug>/spark.properties``).  Host side (the agent,
deploy/remote.py ``spark-start``): :func:`spark_class` finds the launcher of the host's
pyspark package, :func:`daemon_argv` and :func:`daemon_env` make each command line.

Every daemon runs the classes the pyspark package ships::

    <SPARK_HOME>/bin/spark-class org.apache.spark.deploy.master.Master --host A --port 7077
        --webui-port 8080 --properties-file <state_dir>/spark/S/spark.properties
    <SPARK_HOME>/bin/spark-class org.apache.spark.deploy.worker.Worker spark://A:7077 --host B
        --port 0 --webui-port 8081 --work-dir <state_dir>/spark/S/work [--cores N] [--memory M]
        --properties-file <state_dir>/spark/S/spark.properties

with ``SPARK_LOCAL_IP`` = the host's address (the RPC endpoint *and* the web UI bind to it,
never to every interface), an empty ``SPARK_CONF_DIR`` of its own and
``SPARK_LOCAL_DIRS`` under the level's directory.  The properties file turns on Spark's
authentication (the level's secret: in that file only, never on a command line or in an
environment), AES-based RPC encryption without SASL fall-back, local I/O encryption; it
turns off the REST submission server and the web UI's kill links, and makes a taken port
an error (``spark.port.maxRetries 0``: never a silent move to the next port).  Daemons of
different levels on one host have their own directory, log and ports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["MASTER_CLASS", "WORKER_CLASS", "READY_MARKERS", "daemon_name", "level_dir", "properties_path",
           "properties_text", "daemon_plan", "spark_class", "java_problem", "daemon_argv", "daemon_env"]

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
#: the log line that says a daemon is ready (the master elected itself; the worker registered)
READY_MARKERS = {"spark-master": "I have been elected leader! New state: ALIVE",
                 "spark-worker": "Successfully registered with master"}


def daemon_name(role: str, slug: str) -> str:
    """``spark-master-<slug>`` / ``spark-worker-<slug>``: logs/<name>.log on the host."""
    return f"{role}-{slug}"


def level_dir(host, slug: str) -> str:
    """The level's Spark directory on a host: conf/, work/, local/ and spark.properties."""
    return host.path("spark", slug)


def properties_path(host, slug: str) -> str:
    return host.path("spark", slug, "spark.properties")


def _prop_value(v: str) -> str:
    return v.replace("\\", "\\\\")  # (java.util.Properties reads a backslash as an escape)


def properties_text(inv, host, level: str, secret: str) -> str:
    """``spark.properties`` of ``level``'s daemons on ``host`` (holds the secret: mode 0600)."""
    c = inv.spark[level]
    lines = [f"# level {level}'s Spark cluster on {host.name} (deployment {inv.name}); written by strata deploy.",
             f"# The daemons bind to {host.address} (SPARK_LOCAL_IP): RPC and web UIs.",
             "spark.authenticate true",
             f"spark.authenticate.secret {_prop_value(secret)}",
             "spark.network.crypto.enabled true",
             "spark.network.crypto.saslFallback false",
             "spark.io.encryption.enabled true",
             "spark.master.rest.enabled false",
             "spark.ui.killEnabled false",
             "spark.port.maxRetries 0"]
    if host.name == c.master_host:
        lines.append(f"spark.master.ui.port {c.master_webui_port}")
    if host.name in c.workers:
        lines.append(f"spark.worker.ui.port {c.worker_webui_port}")
    return "\n".join(lines) + "\n"


def daemon_plan(inv, host) -> list[dict]:
    """The Spark daemons ``host`` runs (for the agent's ``spark-start``; no secret in it)."""
    out = []
    for role, level in inv.spark_daemons(host):
        c = inv.spark[level]
        base = level_dir(host, c.slug)
        props = properties_path(host, c.slug)
        if role == "spark-master":
            cls, args = MASTER_CLASS, ["--host", host.address, "--port", str(c.master_port),
                                       "--webui-port", str(c.master_webui_port)]
            address = c.url
        else:
            cls, args = WORKER_CLASS, [c.url, "--host", host.address, "--port", str(c.worker_port),
                                       "--webui-port", str(c.worker_webui_port), "--work-dir", f"{base}/work"]
            args += ["--cores", str(c.worker_cores)] if c.worker_cores else []
            args += ["--memory", c.worker_memory] if c.worker_memory else []
            address = host.address
        name = daemon_name(role, c.slug)
        out.append({"name": name, "role": role, "level": level, "class": cls,
                    "args": args + ["--properties-file", props], "address": address,
                    "env": {"SPARK_LOCAL_IP": host.address, "SPARK_CONF_DIR": f"{base}/conf",
                            "SPARK_LOCAL_DIRS": f"{base}/local"},
                    "dirs": [base, f"{base}/conf", f"{base}/work", f"{base}/local"],
                    "log": host.path("logs", f"{name}.log"), "mark": props,
                    "ready_marker": READY_MARKERS[role]})
    return out


# ---- host side ------------------------------------------------------------------------------------------
def spark_class() -> Path:
    """``<SPARK_HOME>/bin/spark-class`` of this host's pyspark package (raises RuntimeError, one line)."""
    try:
        from pyspark.find_spark_home import _find_spark_home

        home = Path(_find_spark_home())
    except Exception as e:  # noqa: BLE001 - no pyspark, or it finds no home
        raise RuntimeError(f"cannot find the pyspark package's SPARK_HOME: {e}") from None
    launcher = home / "bin" / "spark-class"
    if not launcher.exists():
        raise RuntimeError(f"no {launcher}: this host's pyspark cannot start a Spark standalone cluster")
    return launcher


def java_problem() -> str | None:
    """Why this host cannot run a JVM (None: it can)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return None
    if shutil.which("java"):
        return None
    return "no Java on this host (JAVA_HOME or java on PATH; Spark needs Java 17+)"


def daemon_argv(launcher: Path, d: dict) -> list[str]:
    return [str(launcher), d["class"], *d["args"]]


def daemon_env(launcher: Path, d: dict, base: dict[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment: the agent's, without any SPARK_*/PYSPARK_* it inherited, plus
    SPARK_HOME (the launcher's) and the plan's SPARK_LOCAL_IP, SPARK_CONF_DIR, SPARK_LOCAL_DIRS."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("SPARK_", "PYSPARK_", "_SPARK_"))}
    env["SPARK_HOME"] = str(launcher.parent.parent)
    env.update(d.get("env", {}))
    return env
