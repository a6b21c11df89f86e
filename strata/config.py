"""Deployment configuration: lattice, streams, time, cluster settings (TOML).

Example::

    [lattice]
    levels = ["U", "C", "S", "TS"]        # lowest first; or: coi = [["1","2"],["A","B","C"]]
                                           # or: classifications = [...] and categories = ["NATO", ...]

    [time]
    instant_seconds = 1                    # length of one instant

    [streams.Vitals]
    sid = "string"
    bp = "double"

    [relations.Units]                      # a stored relation: rows inserted and deleted by a
    sid = "string"                         # producer (input column op = insert | delete),
    unit = "string"                        # a level per row (docs/semantics.md §3a)

    [limits]                               # optional
    max_ts = 9007199254740991              # largest accepted tuple timestamp (default 2**53 - 1)
    advance_horizon = 3600                 # instants a producer may close past the largest ingested one

    [groups."S"]                           # optional, per level: its group (strata/groups), CPUs (cpusets.py)
    spark_master = "spark://10.0.0.7:7077" # and Spark (spark_settings.py): local[N] (default local[1]) or the
    spark_secret_file = "keys/S.spark"     # level's own cluster, reached with its secret (0600), Spark's
    spark_conf = { "spark.executor.memory" = "1g" }   # authentication and encryption on

Errors raise ConfigError naming the file, the key and (when it can be found)
the line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .lattice import Categories, ChineseWall, Lattice, TotalOrder
from .names import MAX_NAME_CHARS, is_identifier, name_problem

__all__ = [
    "Config", "ConfigError", "Limits", "StreamSchema", "TYPES", "SYSTEM_COLUMNS", "MAX_TS_CEILING", "OP_COLUMN",
    "RELATION_OPS",
    "load_config", "parse_config", "config_of",
]

#: attribute types a stream may declare
TYPES = ("string", "double", "long", "boolean", "timestamp")
#: system attributes every stream has: readable in queries, never writable
SYSTEM_COLUMNS = {"ts": "long", "level": "level"}
#: the input column of a stored relation saying what a row does (values: RELATION_OPS)
OP_COLUMN = "op"
RELATION_OPS = ("insert", "delete")
#: top-level sections; sections beyond lattice/time/streams/relations belong to the cluster
KNOWN_SECTIONS = ("lattice", "time", "streams", "relations", "limits", "cluster", "groups", "tls", "security", "sharing")
#: ``[limits]`` values stay below this, so a timestamp plus a RANGE length or a horizon fits a signed 64-bit long
MAX_TS_CEILING = 2**62 - 1


@dataclass(frozen=True)
class StreamSchema:
    name: str
    columns: tuple[tuple[str, str], ...]  # user attributes in declaration order
    #: a stored relation (``[relations.NAME]``): its input rows insert or delete rows (column ``op``),
    #: and a query reads its rows live at each instant, without a window
    relation: bool = False

    @property
    def kind(self) -> str:
        return "relation" if self.relation else "stream"

    def type_of(self, column: str) -> str | None:
        if column in SYSTEM_COLUMNS:
            return SYSTEM_COLUMNS[column]
        return dict(self.columns).get(column)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.columns)


class StreamError(ValueError):
    """A stream declaration that is refused; ``key``: the attribute it is about (None: the stream)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


#: what "declare at least one attribute" suggests, for a stream and for a relation
_EXAMPLE_ATTRIBUTE = {False: 'bp = "double"', True: 'unit = "string"'}


def stream_of(name: str, columns, known=(), relation: bool = False) -> StreamSchema:
    """The schema of stream ``name`` with ``columns`` ((attribute, type) pairs, in order), checked as a
    ``[streams.NAME]`` table is: identifiers, not ``ts``/``level``, no attribute twice, known types, a
    name none of ``known`` (stream names) has, all case-insensitively.  Raises :class:`StreamError`.
    ``relation``: a ``[relations.NAME]`` table (messages say so; ``op`` is not an attribute)."""
    kind = "relation" if relation else "stream"
    problem = name_problem(name, f"{kind} name")
    if problem:
        raise StreamError(problem)
    clash = next((k for k in known if k.lower() == name.lower()), None)
    if clash is not None:
        other = known[clash] if isinstance(known, dict) else None
        if other is not None and getattr(other, "relation", relation) != relation:
            raise StreamError(f"{kind} {name!r} is declared twice: {clash!r} already names a {other.kind} (streams "
                              f"and relations share one namespace; names are case-insensitive)")
        raise StreamError(f"{kind} {name!r} is declared twice (names are case-insensitive)")
    if not columns:
        raise StreamError(f"declare at least one attribute, e.g. {_EXAMPLE_ATTRIBUTE[relation]}")
    out, seen = [], set()
    for col, typ in columns:
        if isinstance(col, str) and col.lower() in SYSTEM_COLUMNS:
            raise StreamError(f"'{col}' is a system attribute every stream has; it cannot be declared", col)
        if isinstance(col, str) and col.lower() == OP_COLUMN:
            raise StreamError(f"'{col}' is the input column saying insert or delete of a relation; streams and "
                              f"relations cannot declare it", col)
        problem = name_problem(col, "attribute name")
        if problem:
            raise StreamError(problem, str(col)[:MAX_NAME_CHARS])
        if col.lower() in seen:
            raise StreamError("attribute declared twice (names are case-insensitive)", col)
        seen.add(col.lower())
        if typ not in TYPES:
            raise StreamError(f"unknown type {typ!r} (types: {', '.join(TYPES)})", col)
        out.append((col, typ))
    return StreamSchema(name, tuple(out), relation)


@dataclass(frozen=True)
class Limits:
    """``[limits]``: bounds every level group applies to what users send."""

    #: largest accepted tuple timestamp; also the longest RANGE window, in instants
    max_ts: int = 2**53 - 1
    #: how far past the largest ingested instant a producer may close instants
    advance_horizon: int = 3600
    #: released rows a master keeps per query for subscribers that resume (the oldest go first)
    result_retention_rows: int = 1_000_000
    #: ... and at most this many released results (one per chunk and query with rows; each costs ~1-2 kB
    #: besides its rows, so a query of one row per instant is bounded by this, not by the rows)
    result_retention_results: int = 10_000
    #: rows of cut chunks not yet computed above which producers' next batches wait (0: no limit)
    max_backlog_rows: int = 4_000_000
    #: open Subscribe/Ingest streams a master allows per session and per user (one more: RESOURCE_EXHAUSTED)
    max_streams_per_session: int = 8
    max_streams_per_user: int = 64
    #: a master checkpoints its state (and drops the event log before it) once this many rows were
    #: logged since its last checkpoint (0: never; a restart then replays the whole log)
    checkpoint_rows: int = 1_000_000
    #: ... or this many events (batches, advances, registrations) were
    checkpoint_events: int = 10_000


@dataclass(frozen=True)
class Config:
    lattice: Lattice
    streams: dict[str, StreamSchema]
    instant_seconds: float = 1.0
    path: Path | None = None
    sections: dict[str, Any] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)

    def stream(self, name: str) -> StreamSchema | None:
        """Case-insensitive stream lookup (CQL keywords and names are case-insensitive)."""
        if name in self.streams:
            return self.streams[name]
        folded = {k.lower(): v for k, v in self.streams.items()}
        return folded.get(name.lower())

    @property
    def users_path(self) -> Path:
        if self.path is None:
            raise ConfigError("this configuration was not loaded from a file; it has no users file")
        return self.path.with_name(self.path.stem + ".users.json")


def with_streams(config: Config, schemas) -> Config:
    """``config`` plus those of ``schemas`` (:class:`StreamSchema` s) whose names it does not declare
    (streams added at run time: ``strata streams add``); ``config`` itself when there are none."""
    extra = {s.name: s for s in schemas if config.stream(s.name) is None}
    return replace(config, streams={**config.streams, **extra}) if extra else config


def load_config(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read configuration: {e.strerror or e}") from None
    return parse_config(text, path=p)


def parse_config(text: str, path: Path | None = None) -> Config:
    where = str(path) if path else "<config>"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: invalid TOML: {e}") from None

    def err(section: str, key: str | None, msg: str) -> ConfigError:
        line = _line_of(text, section, key)
        loc = f"[{_short(section)}]" + (f" {_short(key)}" if key else "")
        return ConfigError(f"{where}{f':{line}' if line else ''}: {loc}: {msg}")

    for sec in data:
        if sec not in KNOWN_SECTIONS:
            return_err = ConfigError(
                f"{where}:{_line_of(text, sec, None) or '?'}: unknown section [{sec}] "
                f"(known: {', '.join(KNOWN_SECTIONS)})"
            )
            raise return_err

    sharing = data.get("sharing", {})
    if not isinstance(sharing, dict):
        raise err("sharing", None, "must be a table")
    for k, v in sharing.items():
        if k == "enabled" and not isinstance(v, bool):
            raise err("sharing", k, "must be true or false")
        if k == "mode" and v not in ("replicated", "trusted"):
            raise err("sharing", k, "must be \"replicated\" or \"trusted\"")
        if k not in ("enabled", "mode"):
            raise err("sharing", k, "unknown key (expected 'enabled' or 'mode')")

    cluster = data.get("cluster", {})
    if isinstance(cluster, dict) and "load_reading" in cluster and cluster["load_reading"] not in ("host", "process"):
        raise err("cluster", "load_reading", "must be \"host\" or \"process\" (Algorithm 5's CPU reading)")

    lat = data.get("lattice")
    if not isinstance(lat, dict):
        raise ConfigError(f"{where}: missing [lattice] section (levels = [...], classifications = [...] or "
                          f"coi = [[...], ...])")
    unknown = set(lat) - {"levels", "coi", "classifications", "categories"}
    if unknown:
        k = sorted(unknown)[0]
        raise err("lattice", k, "unknown key (expected 'levels', 'classifications' and 'categories', or 'coi')")
    if "categories" in lat and "classifications" not in lat:
        raise err("lattice", "categories", "categories need 'classifications' (lowest first)")
    if sum(k in lat for k in ("levels", "coi", "classifications")) != 1:
        raise err("lattice", None, "give exactly one of 'levels' (total order), 'classifications' (with "
                                   "'categories') or 'coi' (Chinese Wall)")
    key = next(k for k in ("levels", "classifications", "coi") if k in lat)
    try:
        if "levels" in lat:
            if not isinstance(lat["levels"], list) or not all(isinstance(x, str) for x in lat["levels"]):
                raise ValueError("must be a list of level names, lowest first")
            lattice: Lattice = TotalOrder(lat["levels"])
        elif "classifications" in lat:
            cls, cats = lat["classifications"], lat.get("categories", [])
            if not isinstance(cls, list) or not all(isinstance(x, str) for x in cls):
                raise ValueError("must be a list of classification names, lowest first")
            if not isinstance(cats, list) or not all(isinstance(x, str) for x in cats):
                key = "categories"
                raise ValueError("must be a list of category names")
            lattice = Categories(cls, cats)
        else:
            coi = lat["coi"]
            if not isinstance(coi, list) or not all(isinstance(c, list) for c in coi):
                raise ValueError("must be a list of lists of company names")
            lattice = ChineseWall(coi)
    except ValueError as e:
        raise err("lattice", key, str(e)) from None

    time = data.get("time", {})
    if not isinstance(time, dict):
        raise err("time", None, "must be a table")
    if set(time) - {"instant_seconds"}:
        raise err("time", sorted(set(time) - {"instant_seconds"})[0], "unknown key (expected instant_seconds)")
    instant = time.get("instant_seconds", 1)
    if isinstance(instant, bool) or not isinstance(instant, (int, float)) or instant <= 0:
        raise err("time", "instant_seconds", "must be a positive number of seconds")

    streams: dict[str, StreamSchema] = {}
    for section, relation in (("streams", False), ("relations", True)):  # one namespace for both
        raw = data.get(section, {})
        if not isinstance(raw, dict):
            raise err(section, None, f"must be a table of [{section}.NAME] tables")
        for sname, cols in raw.items():
            sec = f"{section}.{sname}"
            if not isinstance(cols, dict) or not cols:
                if is_identifier(sname):
                    raise err(sec, None, f"declare at least one attribute, e.g. {_EXAMPLE_ATTRIBUTE[relation]}")
                cols = {}
            try:
                streams[sname] = stream_of(sname, list(cols.items()), streams, relation=relation)
            except StreamError as e:
                raise err(sec, e.key, str(e)) from None

    limits = _limits(data.get("limits", {}), err)
    rest = {k: v for k, v in data.items() if k not in ("lattice", "time", "streams", "relations", "limits")}
    cfg = Config(lattice=lattice, streams=streams, instant_seconds=float(instant), path=path, sections=rest,
                 limits=limits)
    from .cpusets import check_disjoint  # [groups."L"] cpus: disjoint per level (existence is checked when pinning)

    check_disjoint(cfg, check_exist=False)
    from .spark_settings import check_spark_settings  # [groups."L"] spark_*: one Spark cluster per level

    check_spark_settings(cfg, err, text)
    return cfg


_LIMIT_MIN = {"max_ts": 1, "advance_horizon": 0, "result_retention_rows": 0, "result_retention_results": 1,
              "max_backlog_rows": 0, "max_streams_per_session": 1, "max_streams_per_user": 1,
              "checkpoint_rows": 0, "checkpoint_events": 0}


def _limits(raw: Any, err) -> Limits:
    if not isinstance(raw, dict):
        raise err("limits", None, "must be a table")
    for k, v in raw.items():
        if k not in _LIMIT_MIN:
            raise err("limits", k, f"unknown key (expected one of {', '.join(_LIMIT_MIN)})")
        if isinstance(v, bool) or not isinstance(v, int) or not _LIMIT_MIN[k] <= v <= MAX_TS_CEILING:
            raise err("limits", k, f"must be an integer from {_LIMIT_MIN[k]} to {MAX_TS_CEILING} (2**62 - 1)")
    return Limits(**raw)


def _short(text: str, limit: int = 80) -> str:
    """A name as a message shows it: a very long one cut (the message stays one readable line)."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """1-based line of ``key`` inside ``[section]`` (or of the section header)."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(re.escape(p) for p in section.split(".")) + r"\s*\]")
    start = None
    for i, line in enumerate(lines):
        if header.match(line):
            start = i
            break
    if start is None:
        return None
    if key is None:
        return start + 1
    keyre = re.compile(r"^\s*\"?" + re.escape(key) + r"\"?\s*=")
    for j in range(start + 1, len(lines)):
        if lines[j].lstrip().startswith("["):
            break
        if keyre.match(lines[j]):
            return j + 1
    return start + 1


def config_of(args):
    """The configuration named by a command's ``--config``; a bad one ends the command with its
    one-line reason (exit 1)."""
    from .errors import CliError

    try:
        return load_config(args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None
