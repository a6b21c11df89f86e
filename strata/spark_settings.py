"""Per-level Spark settings: which Spark a level's workers drive, with which settings and secret.

From the configuration::

    [groups."S"]
    spark_master = "spark://10.0.0.7:7077"      # or "local", "local[N]", "local[*]" (default: local[1])
    spark_conf = { "spark.executor.memory" = "1g", "spark.driver.port" = "40100" }
    spark_secret_file = "keys/S.spark"          # the text of spark.authenticate.secret of this level's
                                                # cluster; relative to the config file; mode 0600 or 0400

Every worker of level L uses L's settings (``strata worker --spark-master`` overrides the
master; without a ``spark_master`` in the configuration ``STRATA_SPARK_MASTER`` does, else
``local[1]``).  A Spark cluster (``spark://host:port``) is reached only with Spark's own
authentication and encryption, which Strata turns on itself (worker/spark.py): so a
non-local master needs ``spark_secret_file``, and the keys Strata owns (``spark.master``,
``spark.app.name``, ``spark.authenticate*``, ``spark.network.crypto.enabled``,
``spark.io.encryption.enabled``) cannot be set in ``spark_conf``.  A level's Spark cluster
is never shared with another level: two levels may not name the same cluster, the same
secret file, or (when both files can be read at load) the same secret.

The configuration's parser (``strata.config.parse_config``) reads each level's keys with
:func:`parse_spark` into the level's :class:`SparkSettings` (``config.group(level).spark``) and
checks them across levels with :func:`check_spark_settings`, with one-line errors naming file,
line and key; the secret itself is read only by a worker that starts
(:meth:`SparkSettings.read_secret`), and at load only to compare two levels' secrets.  This module
does not import the configuration's.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from .errors import ConfigError

__all__ = ["SparkSettings", "spark_settings", "parse_spark", "check_spark_settings", "master_problem",
           "is_local_master", "read_secret", "DEFAULT_MASTER", "OWNED_KEYS", "GROUP_KEYS", "MASTER_ENV"]

#: a level without ``spark_master`` (and no ``STRATA_SPARK_MASTER``): one local core per worker
DEFAULT_MASTER = "local[1]"
#: the environment variable naming the master of a level whose configuration names none
MASTER_ENV = "STRATA_SPARK_MASTER"
#: the keys of a ``[groups."L"]`` table this module reads (:func:`parse_spark`)
GROUP_KEYS = ("spark_master", "spark_conf", "spark_secret_file")
#: Spark settings Strata sets itself (``spark.authenticate`` also stands for every ``spark.authenticate.*``)
OWNED_KEYS = ("spark.master", "spark.app.name", "spark.authenticate", "spark.network.crypto.enabled",
              "spark.io.encryption.enabled")

_LOCAL = re.compile(r"local(?:\[(?:[1-9][0-9]{0,3}|\*)\])?")
_CLUSTER = re.compile(r"spark://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"
                      r":(?P<port>[0-9]{1,5})")


def is_local_master(url: str) -> bool:
    """``local``, ``local[N]`` or ``local[*]``: Spark in the worker's own JVM."""
    return bool(_LOCAL.fullmatch(url.strip()))


def master_problem(url: Any) -> str | None:
    """Why ``url`` is not a Spark master Strata accepts (None: it is one)."""
    if not isinstance(url, str) or not url.strip():
        return 'must be "local", "local[N]", "local[*]" or "spark://host:port"'
    url = url.strip()
    if _LOCAL.fullmatch(url):
        return None
    m = _CLUSTER.fullmatch(url)
    if m and 1 <= int(m.group("port")) <= 65535:
        return None
    if url.startswith("spark://") and "," in url:
        return (f"{url!r}: one standalone master per level (spark://host:port); masters in high-availability "
                f"mode are not supported")
    return f'{url!r} is not "local", "local[N]", "local[*]" or "spark://host:port" (a Spark standalone master)'


def _cluster_key(url: str) -> str:
    """What makes two cluster URLs the same cluster here (the host's spelling, case-folded)."""
    m = _CLUSTER.fullmatch(url.strip())
    return f"{m.group('host').lower()}:{int(m.group('port'))}" if m else url.strip()


@dataclass(frozen=True)
class SparkSettings:
    """One level's Spark: master URL, extra Spark settings, the file with its cluster's secret."""

    level: str
    master: str = DEFAULT_MASTER
    #: Spark settings (``spark.*`` → text) applied on top of the worker's defaults
    conf: Mapping[str, str] = field(default_factory=dict)
    #: the file holding the text of ``spark.authenticate.secret`` (absolute; None: none given)
    secret_file: Path | None = None
    #: where ``master`` came from: ``config``, ``flag``, ``env`` or ``default``
    source: str = "default"

    @property
    def is_local(self) -> bool:
        return is_local_master(self.master)

    def read_secret(self) -> str:
        """The secret of this level's cluster (read now; raises :class:`ConfigError`, one line, when
        there is no file, it cannot be read, is readable by group or others, or is empty)."""
        if self.secret_file is None:
            raise ConfigError(
                f"Spark master {self.master}: level {self.level} has no secret for its Spark cluster: set "
                f'[groups."{self.level}"] spark_secret_file to a file with the text of the cluster\'s '
                f"spark.authenticate.secret (Strata reaches a Spark cluster only with Spark's authentication)")
        return read_secret(self.secret_file, self.level)


def _mode_problem(st: os.stat_result) -> str | None:
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if mode & 0o077:
        return f"is readable or writable by group or others (mode {mode:04o}): chmod 600 it"
    return None


def read_secret(path: str | Path, level: str) -> str:
    """The text of the secret file ``path`` of ``level`` (surrounding whitespace, e.g. the final
    newline, is not part of it).  Raises :class:`ConfigError` naming the file and the reason."""
    p = Path(path)
    what = f'[groups."{level}"] spark_secret_file {p}'
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read the secret of level {level}'s Spark cluster: "
                          f"{e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        problem = _mode_problem(os.fstat(f.fileno()))
        if problem:
            raise ConfigError(f"{what} {problem}")
        data = f.read(1 << 16)
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: the secret must be text (UTF-8)") from None
    if not text:
        raise ConfigError(f"{what} is empty: it must hold the text of spark.authenticate.secret of the level's "
                          f"Spark cluster")
    if "\n" in text or "\r" in text:
        raise ConfigError(f"{what}: the secret must be one line")
    return text


def _flatten(table: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """``{spark = {executor = {memory = "1g"}}}`` (TOML's dotted keys unquoted) → ``spark.executor.memory``."""
    out = []
    for k, v in table.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, name + ".")
        else:
            out.append((name, v))
    return out


def _owned(key: str) -> bool:
    return key in OWNED_KEYS or key.startswith("spark.authenticate.")


def _why_owned(key: str) -> str:
    if key == "spark.master":
        return "give the level's master as spark_master"
    if key == "spark.app.name":
        return "a worker's application is named after its level"
    if key.startswith("spark.authenticate.secret"):
        return "give the file with the level's secret as spark_secret_file"
    return "Spark's authentication and encryption are always on for a cluster (and the secret is spark_secret_file)"


def parse_spark(level: str, table: Mapping, base: Path | None, fail: Callable[[str, str], Exception]) -> SparkSettings:
    """The settings of ``level`` from the Spark keys (:data:`GROUP_KEYS`) of its ``[groups."L"]``
    table; ``base``: the config file's directory (a relative ``spark_secret_file`` is relative to
    it); ``fail(key, message)`` makes the error to raise."""
    master, source = DEFAULT_MASTER, "default"
    if "spark_master" in table:
        problem = master_problem(table["spark_master"])
        if problem:
            raise fail("spark_master", problem)
        master, source = table["spark_master"].strip(), "config"
    conf: dict[str, str] = {}
    raw = table.get("spark_conf", {})
    if not isinstance(raw, dict):
        raise fail("spark_conf", 'must be a table of Spark settings, e.g. { "spark.executor.memory" = "1g" }')
    for k, v in _flatten(raw):
        if not k.startswith("spark."):
            raise fail("spark_conf", f"{k!r} is not a Spark setting (keys start with \"spark.\")")
        if _owned(k):
            raise fail("spark_conf", f"{k!r} is Strata's to set: {_why_owned(k)}")
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (int, float)):
            v = str(v)
        elif not isinstance(v, str):
            raise fail("spark_conf", f"{k!r}: the value must be a string, number or boolean")
        conf[k] = v
    secret_file = None
    if "spark_secret_file" in table:
        sf = table["spark_secret_file"]
        if not isinstance(sf, str) or not sf.strip():
            raise fail("spark_secret_file", "must be the path of the file holding the text of the level's "
                                            "spark.authenticate.secret")
        secret_file = Path(sf)
        if not secret_file.is_absolute():
            secret_file = (base or Path.cwd()) / secret_file
        secret_file = Path(os.path.abspath(secret_file))
    if not is_local_master(master) and secret_file is None:
        raise fail("spark_master", f"a Spark cluster ({master}) needs spark_secret_file, the text of the "
                                   f"cluster's spark.authenticate.secret: Strata reaches a Spark cluster only with "
                                   f"Spark's authentication and encryption on")
    return SparkSettings(level=level, master=master, conf=conf, secret_file=secret_file, source=source)


class LevelGroups(Protocol):
    """What this module reads of a configuration (a :class:`strata.config.Config`, whose parser calls
    :func:`parse_spark` and :func:`check_spark_settings`): each level's ``[groups."L"]`` settings,
    their Spark keys parsed into ``spark``, and ``group(level)``."""

    lattice: Any
    path: Path | None
    groups: Mapping[str, Any]

    def group(self, level: str) -> Any: ...


def check_spark_settings(config: LevelGroups, fail: Callable[[str, str, str], Exception] | None = None
                         ) -> dict[str, SparkSettings]:
    """Check the levels' Spark settings across levels (no cluster, secret file or secret serves two
    levels; a secret file readable by others is refused); returns them by level (the levels with a
    ``[groups."L"]`` table).

    ``fail(level, key, message)``: the configuration loader's error maker (file, line and key in the
    message)."""
    where = str(config.path) if config.path is not None else "<config>"

    def make(level: str, key: str, msg: str) -> Exception:
        if fail is not None:
            return fail(level, key, msg)
        return ConfigError(f'{where}: [groups."{level}"] {key}: {msg}')

    out: dict[str, SparkSettings] = {lv: g.spark for lv, g in config.groups.items()}
    clusters: dict[str, str] = {}
    files: dict[str, str] = {}
    for level, s in out.items():
        if not s.is_local:
            other = clusters.setdefault(_cluster_key(s.master), level)
            if other != level:
                raise make(level, "spark_master",
                           f"{s.master} is also level {other}'s Spark master; a level's Spark cluster is never "
                           f"shared with another level")
        if s.secret_file is not None:
            real = os.path.realpath(s.secret_file)
            other = files.setdefault(real, level)
            if other != level:
                raise make(level, "spark_secret_file",
                           f"{s.secret_file} is also level {other}'s spark_secret_file; a level's Spark cluster "
                           f"is never shared with another level (one secret per level)")
            try:
                problem = _mode_problem(os.stat(s.secret_file))
            except OSError:
                problem = None  # not here (another host's file): checked when a worker reads it
            if problem:
                raise make(level, "spark_secret_file", f"{s.secret_file} {problem}")
    with_files = [lv for lv, s in out.items() if s.secret_file is not None]
    if len(with_files) > 1:  # the same secret under two names: still one cluster for two levels
        secrets: dict[str, str] = {}
        for level in with_files:
            try:
                secret = read_secret(out[level].secret_file, level)
            except ConfigError:
                continue  # unreadable here: compared where it can be read, refused when a worker reads it
            other = secrets.setdefault(secret, level)
            if other != level:
                raise make(level, "spark_secret_file",
                           f"{out[level].secret_file} holds the same secret as level {other}'s spark_secret_file; "
                           f"a level's Spark cluster is never shared with another level")
    return out


def spark_settings(config: LevelGroups, level: str, master: str | None = None,
                   environ: Mapping[str, str] | None = None) -> SparkSettings:
    """The Spark settings of ``level``'s workers.

    ``master`` (``strata worker --spark-master``) overrides the configuration's; without either,
    ``STRATA_SPARK_MASTER`` in ``environ`` (default ``os.environ``), else ``local[1]``.  A master
    given here must not be another level's configured cluster.  Raises :class:`ConfigError`."""
    level = config.lattice.parse(level)
    environ = os.environ if environ is None else environ
    settings = {lv: g.spark for lv, g in config.groups.items()}  # checked when the configuration was loaded
    s = config.group(level).spark
    if master is not None:
        chosen, source, name = master, "flag", "--spark-master"
    elif s.source == "config":
        return s
    elif environ.get(MASTER_ENV, "").strip():
        chosen, source, name = environ[MASTER_ENV], "env", MASTER_ENV
    else:
        return s
    problem = master_problem(chosen)
    if problem:
        raise ConfigError(f"{name}: {problem}")
    chosen = chosen.strip()
    if not is_local_master(chosen):
        for other, o in settings.items():
            if other != level and not o.is_local and _cluster_key(o.master) == _cluster_key(chosen):
                raise ConfigError(f"{name} {chosen} is level {other}'s Spark master ([groups.\"{other}\"] "
                                  f"spark_master); a level's Spark cluster is never shared with another level")
    return SparkSettings(level=level, master=chosen, conf=s.conf, secret_file=s.secret_file, source=source)
