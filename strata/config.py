"""Deployment configuration: lattice, streams, time, limits and cluster settings (TOML), typed.

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

**Settings are declared once** (Spark's ``SQLConf``, Flink's ``ConfigOptions``): each is a field of
its section's frozen dataclass, made by :func:`option` with its default, its :class:`Check` and its
doc: ``[time]`` :class:`TimeSettings`, ``[limits]`` :class:`Limits`, ``[cluster]``
:class:`ClusterSettings`, ``[sharing]`` :class:`SharingSettings`, ``[groups."L"]``
:class:`GroupSettings` (its Spark keys parsed into a :class:`~strata.spark_settings.SparkSettings`),
and :data:`CHUNK_SECONDS`, the chunk length of the commands that start masters.  :data:`OPTIONS`
lists them all.  :func:`parse_config` reads and checks every one of them once, refusing an unknown
key or a bad value with one line naming file, line and key; readers get typed values
(``config.cluster.heartbeat_seconds``, ``config.group("S").spark``, ``config.sharing.enabled``,
``config.limits.max_ts``) and never look at the TOML.

Errors raise ConfigError naming the file, the key and (when it can be found) the line.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar

from .cpusets import CpuSetError, disjoint_problem, parse_cpus
from .errors import ConfigError
from .lattice import Categories, ChineseWall, Lattice, TotalOrder
from .names import MAX_NAME_CHARS, is_identifier, name_problem
from .spark_settings import GROUP_KEYS as SPARK_KEYS
from .spark_settings import SparkSettings, check_spark_settings, parse_spark

__all__ = [
    "Config", "ConfigError", "Limits", "StreamSchema", "TYPES", "SYSTEM_COLUMNS", "MAX_TS_CEILING", "OP_COLUMN",
    "RELATION_OPS", "TimeSettings", "ClusterSettings", "SharingSettings", "GroupSettings", "Check", "Option",
    "option", "options_of", "OPTIONS", "SECTIONS", "CHUNK_SECONDS", "CHUNK_RULE", "chunk_instants",
    "default_group_address", "load_config", "parse_config", "with_streams",
]

#: attribute types a stream may declare
TYPES = ("string", "double", "long", "boolean", "timestamp")
#: system attributes every stream has: readable in queries, never writable
SYSTEM_COLUMNS = {"ts": "long", "level": "level"}
#: the input column of a stored relation saying what a row does (values: RELATION_OPS)
OP_COLUMN = "op"
RELATION_OPS = ("insert", "delete")
#: the top-level sections a configuration may have
KNOWN_SECTIONS = ("lattice", "time", "streams", "relations", "limits", "cluster", "groups", "sharing")
#: ``[limits]`` values stay below this, so a timestamp plus a RANGE length or a horizon fits a signed 64-bit long
MAX_TS_CEILING = 2**62 - 1


# ---- how a setting is declared -----------------------------------------------------------------------
def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Check:
    """What a setting's TOML value must be.

    ``rule``: the refusal as its one-line error says it (``must be ...``); ``ok``: the test of a TOML
    value; ``convert``: the typed value of one that passed (it may raise ValueError with a more
    precise reason); ``error``: the class of the error :func:`parse_config` raises; ``bad``: values
    it refuses (tests/test_settings.py tries each)."""

    rule: str
    ok: Callable[[Any], bool]
    convert: Callable[[Any], Any] = _same
    error: type = ConfigError
    bad: tuple = ()

    def parse(self, value: Any) -> Any:
        """The typed value of ``value``; raises ValueError (the reason, one line) if it is refused."""
        if not self.ok(value):
            raise ValueError(self.rule)
        try:
            return self.convert(value)
        except ValueError as e:
            raise ValueError(str(e) or self.rule) from None


def option(default: Any, doc: str, check: Check) -> Any:
    """A setting of a section's dataclass: its default, doc and check, declared once."""
    return field(default=default, metadata={"doc": doc, "check": check})


@dataclass(frozen=True)
class Option:
    """One declared setting: a field made by :func:`option` (``section`` its TOML table) or a
    command's flag (``section`` empty)."""

    section: str
    name: str
    default: Any
    doc: str
    check: Check

    @property
    def where(self) -> str:
        return f"[{self.section}] {self.name}" if self.section else self.name


def options_of(cls) -> tuple[Option, ...]:
    """The settings a section's dataclass declares, in declaration order."""
    return tuple(Option(cls.SECTION, f.name, f.default, f.metadata["doc"], f.metadata["check"])
                 for f in fields(cls) if "check" in f.metadata)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(lo: int, hi: int, rule: str | None = None) -> Check:
    return Check(rule or f"must be an integer from {lo} to {hi}", lambda v: _is_int(v) and lo <= v <= hi, int,
                 bad=(lo - 1, hi + 1, 1.5, True, str(lo)))


def seconds(rule: str = "must be a positive number of seconds") -> Check:
    return Check(rule, lambda v: _is_number(v) and v > 0, float, bad=(0, -3, True, "1", math.inf))


def boolean() -> Check:
    return Check("must be true or false", lambda v: isinstance(v, bool), bad=("no", "false", 1))


def one_of(*choices: str, why: str = "") -> Check:
    return Check(f"must be {' or '.join(json.dumps(c) for c in choices)}{why}",
                 lambda v: isinstance(v, str) and v in choices, bad=("other", 1, True))


def _ipv4(v: Any, multicast: bool) -> bool:
    try:
        a = ipaddress.IPv4Address(v.strip()) if isinstance(v, str) else None
    except ValueError:
        return False
    return a is not None and (a.is_multicast or not multicast)


def ipv4_address(multicast: bool = False) -> Check:
    if multicast:
        return Check("must be an IPv4 multicast address (224.0.0.0/4; use 239.x.y.z)", lambda v: _ipv4(v, True),
                     str.strip, bad=("10.0.0.1", "nowhere", 1))
    return Check("must be an IPv4 address", lambda v: _ipv4(v, False), str.strip, bad=("::1", "nowhere", 1))


_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\s:,\[\]]+):([0-9]{1,5})")


def _host_port(v: Any) -> bool:
    m = _HOST_PORT.fullmatch(v.strip()) if isinstance(v, str) else None
    return m is not None and 1 <= int(m.group(1)) <= 65535


def host_port() -> Check:
    return Check('must be "HOST:PORT"', _host_port, str.strip, bad=("nohost", "h:0", 7000))


def _items(v: Any) -> Any:
    return v.split(",") if isinstance(v, str) else v


def host_ports() -> Check:
    """A list of ``HOST:PORT`` (or one text of them, comma-separated)."""
    return Check('must be a list of "HOST:PORT"', lambda v: isinstance(_items(v), list) and all(
        _host_port(x) for x in _items(v)), lambda v: tuple(x.strip() for x in _items(v)),
        bad=(["nohost"], "a:1,b", 7000))


def _hex_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("must be the group key in hex") from None
    if len(key) < 16:
        raise ValueError("must have at least 16 bytes (32 hex digits)")
    return key


def hex_key() -> Check:
    return Check("must be the group key in hex, at least 16 bytes", lambda v: isinstance(v, str), _hex_key,
                 bad=("zz", "00ff", 1))


def path_text() -> Check:
    return Check("must be the path of a file (relative to the config file)",
                 lambda v: isinstance(v, str) and bool(v.strip()), str.strip, bad=("", " ", 1))


def dir_text() -> Check:
    return Check("must be the path of a directory (relative to the config file)",
                 lambda v: isinstance(v, str) and bool(v.strip()), str.strip, bad=("", " ", 1))


def cpu_list() -> Check:
    return Check('must be a CPU list like "0-1,3"', lambda v: True, parse_cpus, error=CpuSetError,
                 bad=("zero", "3-1", "", True))


def _limit(lo: int) -> Check:
    return integer(lo, MAX_TS_CEILING, f"must be an integer from {lo} to {MAX_TS_CEILING} (2**62 - 1)")


# ---- the sections ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeSettings:
    """``[time]`` (its one setting is :attr:`Config.instant_seconds`)."""

    SECTION: ClassVar[str] = "time"
    instant_seconds: float = option(1.0, "the length of one instant in seconds; RANGE lengths are converted to "
                                         "instants", seconds())


@dataclass(frozen=True)
class Limits:
    """``[limits]``: bounds every level group applies to what users send."""

    SECTION: ClassVar[str] = "limits"
    max_ts: int = option(2**53 - 1, "the largest accepted tuple timestamp; also the longest RANGE window, in "
                                    "instants", _limit(1))
    advance_horizon: int = option(3600, "how far past the largest ingested instant a producer may close instants",
                                  _limit(0))
    result_retention_rows: int = option(1_000_000, "released rows a master keeps per query for subscribers that "
                                                   "resume (the oldest go first)", _limit(0))
    result_retention_results: int = option(10_000, "... and at most this many released results (one per chunk and "
                                                   "query with rows; each costs ~1-2 kB besides its rows, so a query "
                                                   "of one row per instant is bounded by this, not by the rows)",
                                           _limit(1))
    max_backlog_rows: int = option(4_000_000, "rows of cut chunks not yet computed above which producers' next "
                                              "batches wait (0: no limit)", _limit(0))
    overload: str = option("wait", "what a master does when its backlog passes its bound: \"wait\" (producers' next "
                                   "batches wait, max_backlog_rows) or \"shed\" (no producer waits; whole instants "
                                   "are shed while the backlog is high: docs/semantics.md §10)",
                           one_of("wait", "shed", why=" (a master's answer to an overload)"))
    shed_backlog_rows: int = option(0, "with overload = \"shed\": the backlog (rows) at which the level starts "
                                       "shedding (0: max_backlog_rows)", _limit(0))
    shed_resume_rows: int = option(0, "... and below which it stops (0: half the bound; must be below the bound)",
                                   _limit(0))
    max_streams_per_session: int = option(8, "open Subscribe/Ingest streams a master allows per session (one more: "
                                             "RESOURCE_EXHAUSTED)", _limit(1))
    max_streams_per_user: int = option(64, "... and per user, across its sessions", _limit(1))
    checkpoint_rows: int = option(1_000_000, "a master checkpoints its state (and drops the event log before it) "
                                             "once this many rows were logged since its last checkpoint (0: never; "
                                             "a restart then replays the whole log)", _limit(0))
    checkpoint_events: int = option(10_000, "... or this many events (batches, advances, registrations) were",
                                    _limit(0))


@dataclass(frozen=True)
class ClusterSettings:
    """``[cluster]``: what every level group of the deployment shares (a level's own
    ``[groups."L"]`` overrides the multicast defaults)."""

    SECTION: ClassVar[str] = "cluster"
    load_reading: str | None = option(None, "Algorithm 5's CPU reading, host or process (unset: host for a worker "
                                            "started on its own, process in an embedded cluster: see reading())",
                                      one_of("host", "process", why=" (Algorithm 5's CPU reading)"))
    multicast_port: int = option(47000, "the default UDP port of the level groups' multicast", integer(1, 65535))
    heartbeat_seconds: float = option(0.5, "the interval of group heartbeats (a master's own dispatch window is "
                                           "two of them)", seconds())
    interface: str = option("127.0.0.1", "the default interface heartbeats go out on (loopback: this host only)",
                            ipv4_address())
    multicast_ttl: int = option(0, "the default multicast TTL: 0 this host only, 1 across one bridge/switch",
                                integer(0, 255))
    dispatch_linger: bool = option(True, "while input arrives faster than a job takes, a master gathers ready "
                                         "chunks for up to one job's time before sending them (false: at once)",
                                   boolean())
    # how level groups sharing a host take turns (strata/scheduling.py, deploy/slots.py, docs/scheduling.md)
    scheduler: str = option("shared", "how the level groups of one host take turns: shared (the OS shares the "
                                      "CPUs), round_robin, fixed_slot, revised_fixed_slot or dynamic_threshold (a "
                                      "gate, strata slots, stops and continues each level's processes; in "
                                      "the trusted mode each worker makes the levels' calls take turns)",
                            one_of("shared", "round_robin", "fixed_slot", "revised_fixed_slot", "dynamic_threshold"))
    slot_seconds: float = option(0.25, "a level's slot (fixed_slot, revised_fixed_slot) or quantum (round_robin, "
                                       "dynamic_threshold) per round, in seconds",
                                 Check("must be a number of seconds above 0 and at most 1",
                                       lambda v: _is_number(v) and 0 < v <= 1, float, bad=(0, 1.5, True, "0.25")))
    penalty_threshold: float = option(0.8, "dynamic_threshold: a level that used more than this share of a round's "
                                           "CPU time while another level had work is penalised",
                                      Check("must be a number above 0 and below 1",
                                            lambda v: _is_number(v) and 0 < v < 1, float, bad=(0, 1, True, "0.8")))
    penalty_share: tuple[float, float] = option(
        (0.3, 0.8), "dynamic_threshold: the range [LO, HI] a penalised level's share of its quantum (alpha) is drawn "
                    "from", Check("must be [LO, HI], numbers with 0 < LO <= HI <= 1",
                                  lambda v: isinstance(v, list) and len(v) == 2 and all(_is_number(x) for x in v)
                                  and 0 < v[0] <= v[1] <= 1, lambda v: (float(v[0]), float(v[1])),
                                  bad=([0, 0.5], [0.8, 0.3], [0.3, 1.5], 0.5)))
    # the deployment's architecture (docs/trusted.md): a master and worker group per level, or one of each
    mode: str = option("replicated", "replicated: a master and a worker group per level; trusted: one master and "
                                     "one worker group, trusted for every level of the deployment, serve them all "
                                     "(strata up --mode; docs/trusted.md)", one_of("replicated", "trusted"))
    penalty_rounds: tuple[int, int] = option(
        (1, 10), "dynamic_threshold: the range [LO, HI] of the rounds a penalty lasts (beta) is drawn from",
        Check("must be [LO, HI], integers with 1 <= LO <= HI <= 1000",
              lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v)
              and 1 <= v[0] <= v[1] <= 1000, lambda v: (v[0], v[1]), bad=([0, 5], [10, 1], [1.5, 2], 3)))

    def reading(self, embedded: bool = False) -> str:
        """Algorithm 5's CPU reading of a worker (worker/load.py): ``load_reading``, else ``process``
        in an embedded cluster (all its workers on one host: the host reading is the same for all of
        them and reads >= 90 % whenever the cluster works), else ``host``."""
        return self.load_reading or ("process" if embedded else "host")


@dataclass(frozen=True)
class SharingSettings:
    """``[sharing]``: query sharing (dissertation §5.3, §6.3; strata/sharing)."""

    SECTION: ClassVar[str] = "sharing"
    enabled: bool = option(True, "workers evaluate the shared plans of a level's queries once per chunk", boolean())
    mode: str = option("replicated", "replicated: sharing within a level only (a cluster runs one level per "
                                     "master); trusted: also across levels", one_of("replicated", "trusted"))
    across_levels: bool = option(True, "a trusted worker (serving several levels) lets a level's queries reuse "
                                       "the outputs a lower level's chunks computed over the same instants "
                                       "(docs/trusted.md, Cross-level operator reuse); false: each level "
                                       "computes its own", boolean())


def default_group_address(level: str) -> str:
    """The multicast group of a level whose configuration names none (derived from its name)."""
    digest = hashlib.sha256(level.encode()).digest()
    return f"239.255.{digest[0]}.{max(1, digest[1])}"


@dataclass(frozen=True)
class GroupSettings:
    """``[groups."L"]``: one level's group (strata/groups), CPUs (strata/cpusets.py), Spark
    (strata/spark_settings.py: ``spark_master``, ``spark_conf``, ``spark_secret_file`` in
    :attr:`spark`), masters and Ray cluster.

    In :attr:`Config.groups` the options a table does not set are None; :meth:`Config.group`
    fills in the defaults (the address derived from the level, ``[cluster]``'s port, interface and
    TTL)."""

    SECTION: ClassVar[str] = 'groups."L"'
    level: str = ""
    address: str | None = option(None, "the level's multicast group (default: derived from the level's name)",
                                 ipv4_address(multicast=True))
    port: int | None = option(None, "its UDP port (default [cluster] multicast_port)", integer(1, 65535))
    interface: str | None = option(None, "the interface facing the level's network (default [cluster] interface)",
                                   ipv4_address())
    ttl: int | None = option(None, "its multicast TTL (default [cluster] multicast_ttl)", integer(0, 255))
    key_file: str | None = option(None, "the file of the level's group key (hex, >= 16 bytes), as written: relative "
                                        "to the config file (default: strata up makes one in its state directory)",
                                  path_text())
    key: bytes | None = option(None, "the level's group key itself, in hex (prefer key_file)", hex_key())
    data_dir: str | None = option(None, "where the level's master keeps its event log and the level's local Spark "
                                        "sessions their scratch files, relative to the config file (default: the "
                                        "state directory); a directory per level on a device of its own keeps one "
                                        "level's disk traffic out of another's timing (docs/scheduling.md)",
                                  dir_text())
    cpus: frozenset[int] | None = option(None, "the level's CPUs in Linux's cpuset syntax; disjoint from every other "
                                               "level's (default: not pinned)", cpu_list())
    masters: tuple[str, ...] = option((), "the level's active and standby masters, HOST:PORT (clients try each)",
                                      host_ports())
    ray_address: str | None = option(None, "HOST:PORT of the level's running Ray cluster strata scale joins",
                                     host_port())
    ray_port: int | None = option(None, "the base port of the level's Ray cluster (default 46000 + 100 x the "
                                        "level's position in the lattice)", integer(1, 65535))
    worker_metrics_port: int | None = option(None, "the port on the level's address each of its workers serves its "
                                                   "Prometheus metrics on, HTTPS for the level's scraper certificate "
                                                   "only (worker/metrics.py; unset: none; 0: any free port)",
                                             integer(0, 65535))
    #: ``spark_master``, ``spark_conf``, ``spark_secret_file`` (declared and parsed in strata/spark_settings.py)
    spark: SparkSettings | None = None
    #: ``spark_secret_file`` as the file writes it (relative to the config file; :attr:`spark` has it absolute)
    spark_secret_file: str | None = None

    def __post_init__(self):
        if self.spark is None:
            object.__setattr__(self, "spark", SparkSettings(level=self.level))

    def key_path(self, config_path: Path | None) -> Path | None:
        """``key_file`` relative to the directory of the config file at ``config_path``."""
        if self.key_file is None:
            return None
        kf = Path(self.key_file)
        return config_path.parent / kf if not kf.is_absolute() and config_path is not None else kf

    def data_path(self, config_path: Path | None) -> Path | None:
        """``data_dir`` relative to the directory of the config file at ``config_path``."""
        if self.data_dir is None:
            return None
        d = Path(self.data_dir)
        return config_path.parent / d if not d.is_absolute() and config_path is not None else d


#: every section's dataclass, by the TOML table it reads
SECTIONS = {c.SECTION: c for c in (TimeSettings, Limits, ClusterSettings, SharingSettings, GroupSettings)}

#: what a chunk's length must be; :func:`chunk_instants` checks it against the configuration's instant
CHUNK_RULE = "must be a positive whole multiple of [time] instant_seconds (a chunk is 1, 2, 3, ... instants)"
#: the length of the chunks a master cuts, in seconds: ``--chunk-seconds`` of ``strata master``, ``up`` and
#: ``replay`` (strata/cli_support.py), ``[deployment] chunk_seconds`` of an inventory (None: one instant)
CHUNK_SECONDS = Option("", "chunk_seconds", None, "the length of the chunks a master cuts and dispatches, in "
                       "seconds: a whole multiple of [time] instant_seconds (default: one instant)", seconds(CHUNK_RULE))
#: every declared setting
OPTIONS: tuple[Option, ...] = tuple(o for c in SECTIONS.values() for o in options_of(c)) + (CHUNK_SECONDS,)


def chunk_instants(chunk_seconds: float | None, instant_seconds: float) -> int:
    """The instants of a chunk of ``chunk_seconds`` (None: one).  Raises ValueError (one line:
    :data:`CHUNK_RULE`) unless it is a positive whole multiple of ``instant_seconds``: never rounded
    or clamped to one."""
    if chunk_seconds is None:
        return 1
    length = CHUNK_SECONDS.check.parse(chunk_seconds)
    k = round(length / instant_seconds)
    if k < 1 or not math.isclose(k * instant_seconds, length, rel_tol=1e-9):
        raise ValueError(f"{CHUNK_RULE}; instant_seconds is {instant_seconds:g} here")
    return k


# ---- streams -----------------------------------------------------------------------------------------
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


# ---- the configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    lattice: Lattice
    streams: dict[str, StreamSchema]
    #: ``[time] instant_seconds`` (declared in :class:`TimeSettings`)
    instant_seconds: float = TimeSettings.instant_seconds
    path: Path | None = None
    limits: Limits = field(default_factory=Limits)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    sharing: SharingSettings = field(default_factory=SharingSettings)
    #: the file's ``[groups."L"]`` tables by canonical level, as they are written (options they do not
    #: set are None); :meth:`group` fills in the defaults
    groups: dict[str, GroupSettings] = field(default_factory=dict)

    def stream(self, name: str) -> StreamSchema | None:
        """Case-insensitive stream lookup (CQL keywords and names are case-insensitive)."""
        if name in self.streams:
            return self.streams[name]
        folded = {k.lower(): v for k, v in self.streams.items()}
        return folded.get(name.lower())

    @property
    def time(self) -> TimeSettings:
        return TimeSettings(self.instant_seconds)

    def group(self, level: str) -> GroupSettings:
        """The settings of ``level``'s group with every default filled in: the multicast address
        derived from the level's name, the port, interface and TTL of ``[cluster]``.  Raises
        ValueError (a LevelError) for a level the lattice does not have."""
        lv = self.lattice.parse(level)
        g = self.groups.get(lv) or GroupSettings(level=lv)
        c = self.cluster
        return replace(g, address=g.address or default_group_address(lv), port=g.port or c.multicast_port,
                       interface=g.interface or c.interface, ttl=c.multicast_ttl if g.ttl is None else g.ttl)

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

    def err(section: str, key: str | None, msg: str, cls: type = ConfigError) -> ConfigError:
        line = _line_of(text, section, key)
        loc = f"[{_short(section)}]" + (f" {_short(key)}" if key else "")
        return cls(f"{where}{f':{line}' if line else ''}: {loc}: {msg}")

    for sec in data:
        if sec not in KNOWN_SECTIONS:
            raise ConfigError(f"{where}:{_line_of(text, sec, None) or '?'}: unknown section [{sec}] "
                              f"(known: {', '.join(KNOWN_SECTIONS)})")

    sharing = _read(SharingSettings, data.get("sharing", {}), err)
    cluster = _read(ClusterSettings, data.get("cluster", {}), err)
    lattice = _lattice(data, where, err)
    instant = _read(TimeSettings, data.get("time", {}), err).instant_seconds

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

    limits = _read(Limits, data.get("limits", {}), err)
    shed_bound = limits.shed_backlog_rows or limits.max_backlog_rows
    if limits.shed_resume_rows and shed_bound and limits.shed_resume_rows >= shed_bound:
        raise err("limits", "shed_resume_rows", f"must be below the shedding bound ({shed_bound} rows)")
    groups, spelt = _groups(data.get("groups", {}), lattice, path, text, err)
    cfg = Config(lattice=lattice, streams=streams, instant_seconds=instant, path=path, limits=limits,
                 cluster=cluster, sharing=sharing, groups=groups)
    # across levels: the CPU sets are disjoint (their existence is checked when a process pins itself,
    # strata/cpusets.py), and no Spark cluster or secret serves two levels
    problem = disjoint_problem({lv: g.cpus for lv, g in groups.items() if g.cpus is not None})
    if problem:
        level, msg = problem
        raise err(spelt[level], "cpus", msg, CpuSetError)
    check_spark_settings(cfg, lambda level, key, msg: err(spelt[level], key, msg))
    return cfg


def _read(cls, raw: Any, err, section: str | None = None, unknown: Callable[[str], str] | None = None,
          skip: tuple[str, ...] = (), **fixed):
    """The section dataclass ``cls`` of the TOML table ``raw``: each key one of its options (else
    ``unknown(key)``, or a list of them), each value passing its check; ``skip``: keys read elsewhere."""
    section = section or cls.SECTION
    if not isinstance(raw, dict):
        raise err(section, None, "must be a table")
    opts = {o.name: o for o in options_of(cls)}
    values = {}
    for k, v in raw.items():
        if k in skip:
            continue
        o = opts.get(k)
        if o is None:
            raise err(section, k, unknown(k) if unknown else f"unknown key (expected {_expected(opts)})")
        try:
            values[k] = o.check.parse(v)
        except ValueError as e:
            raise err(section, k, str(e), o.check.error) from None
    return cls(**fixed, **values)


def _expected(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def _lattice(data: dict, where: str, err) -> Lattice:
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
            return TotalOrder(lat["levels"])
        if "classifications" in lat:
            cls, cats = lat["classifications"], lat.get("categories", [])
            if not isinstance(cls, list) or not all(isinstance(x, str) for x in cls):
                raise ValueError("must be a list of classification names, lowest first")
            if not isinstance(cats, list) or not all(isinstance(x, str) for x in cats):
                key = "categories"
                raise ValueError("must be a list of category names")
            return Categories(cls, cats)
        coi = lat["coi"]
        if not isinstance(coi, list) or not all(isinstance(c, list) for c in coi):
            raise ValueError("must be a list of lists of company names")
        return ChineseWall(coi)
    except ValueError as e:
        raise err("lattice", key, str(e)) from None


def _groups(raw: Any, lattice: Lattice, path: Path | None, text: str, err) -> tuple[dict, dict]:
    """The ``[groups."L"]`` tables: (level → :class:`GroupSettings`, level → its section as spelt)."""
    if not isinstance(raw, dict):
        raise err("groups", None, 'must be a table of per-level tables, [groups."L"]')
    base = path.resolve().parent if path is not None else None
    keys = [o.name for o in options_of(GroupSettings)] + list(SPARK_KEYS)

    def unknown(k: str) -> str:
        if k.startswith("spark"):
            return f"unknown key (the Spark keys of a level: {', '.join(SPARK_KEYS)})"
        return f"unknown key (expected {_expected(keys)})"

    groups: dict[str, GroupSettings] = {}
    spelt: dict[str, str] = {}
    for name, table in raw.items():
        section = _group_section(name, text)
        if not isinstance(table, dict):
            raise err(section, None, "must be a table (address, port, cpus, spark_master, masters, ...)")
        try:
            level = lattice.parse(name)
        except ValueError as e:
            raise err(section, None, str(e)) from None
        if level in groups:
            raise err(section, None, f"level {level} already has its table, [{spelt[level]}]")
        spark_keys = {k: v for k, v in table.items() if k in SPARK_KEYS}
        spark = parse_spark(level, spark_keys, base, lambda k, m, s=section: err(s, k, m))
        secret = spark_keys["spark_secret_file"].strip() if "spark_secret_file" in spark_keys else None
        groups[level] = _read(GroupSettings, table, err, section=section, unknown=unknown, skip=SPARK_KEYS,
                              level=level, spark=spark, spark_secret_file=secret)
        spelt[level] = section
    return groups, spelt


def _group_section(name: str, text: str) -> str:
    """How ``[groups."name"]`` is spelt in the file (so that an error finds its line)."""
    if not re.search(r"^\s*\[\s*groups\s*\.\s*\"" + re.escape(name) + r"\"\s*\]", text, re.M) \
            and re.search(r"^\s*\[\s*groups\s*\.\s*" + re.escape(name) + r"\s*\]", text, re.M):
        return f"groups.{name}"
    return f'groups."{name}"'


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
