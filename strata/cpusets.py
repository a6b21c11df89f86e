"""Per-level CPU sets: pin each level's processes to its own CPUs.

When level groups share a host, one level's load must not modulate another
level's latency (a timing channel: the distributed counterpart of the
dissertation's fixed time-slot scheduler, §5.4).  The configuration gives each
level a CPU set::

    [groups."U"]
    cpus = "0"          # a list in Linux's cpuset syntax: "0-1,3", "2,4-7"

    [groups."TS"]
    cpus = "1"

Every master, worker (and its Spark JVM, which inherits the mask) and scaler
of level L then runs only on L's CPUs (``os.sched_setaffinity``), and the sets
of different levels must be disjoint.  A level without ``cpus`` is not pinned;
pinning only some levels still isolates the pinned ones from each other, not
from the unpinned ones (``check_disjoint`` does not require all or nothing,
but ``docs/scaling.md`` recommends pinning every level that shares the host).

Spark's ``local[*]`` uses the JVM's ``availableProcessors()``, which follows
the affinity mask; a worker started with ``local[N]`` uses N threads on the
level's CPUs whatever N is.  :func:`pin_current_process` also exports
``STRATA_CPUS`` (the set, for the log and child processes) and, when unset,
``OMP_NUM_THREADS`` / ``ARROW_NUM_THREADS`` sized to the set, so native thread
pools do not oversubscribe it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Protocol

from strata.errors import CliError, ConfigError

__all__ = ["CpuSetError", "parse_cpus", "format_cpus", "available_cpus", "level_cpus", "all_level_cpus",
           "check_disjoint", "disjoint_problem", "pin_current_process", "thread_affinities", "host_cpu_percent"]


class LevelGroups(Protocol):
    """What this module reads of a configuration (a :class:`strata.config.Config`, whose parser
    calls :func:`parse_cpus` and :func:`disjoint_problem`; this module does not import it): each
    level's ``[groups."L"]`` settings, their ``cpus`` parsed and the sets checked disjoint."""

    lattice: Any
    groups: Mapping[str, Any]


_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_CPU = 4095


class CpuSetError(ConfigError, CliError):
    """A bad ``cpus`` setting; also a ``CliError`` so ``strata worker``/``master`` exit 1 with the message."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.code = 1


def parse_cpus(text) -> frozenset[int]:
    """``"0-1,3"`` → ``{0, 1, 3}``; also accepts an int or a list of ints/strings.  Raises
    :class:`CpuSetError` (the reason; the caller says which setting it is about)."""
    if isinstance(text, bool):
        raise CpuSetError(f"expected a CPU list like \"0-1,3\", got {text!r}")
    if isinstance(text, int):
        text = str(text)
    if isinstance(text, (list, tuple)):
        text = ",".join(str(x) for x in text)
    if not isinstance(text, str) or not text.strip():
        raise CpuSetError(f"expected a non-empty CPU list like \"0-1,3\", got {text!r}")
    out: set[int] = set()
    for part in text.split(","):
        m = _ITEM.match(part)
        if not m:
            raise CpuSetError(f"bad item {part.strip()!r} in {text!r} (expected N or N-M, comma-separated)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise CpuSetError(f"bad range {part.strip()!r} in {text!r} (end before start)")
        if hi > MAX_CPU:
            raise CpuSetError(f"CPU {hi} out of range in {text!r}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def format_cpus(cpus) -> str:
    """``{0, 1, 3}`` → ``"0-1,3"``."""
    xs = sorted(set(cpus))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def available_cpus() -> frozenset[int]:
    """The CPUs processes of this host may use, independent of this process's own pinning.

    The cgroup's effective cpuset when there is one (containers), else the
    online CPUs, else this process's affinity.
    """
    for f in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text:
            try:
                return parse_cpus(text)
            except CpuSetError:
                continue
    return frozenset(os.sched_getaffinity(0))


def host_cpu_percent() -> float:
    """The load of the CPUs this process may run on, in percent (psutil, non-blocking): a level
    pinned to its own CPU set does not see another level's load in it.  The default reading of a
    group member's heartbeat (strata/groups/membership.py) and Algorithm 5's ``host`` reading
    (worker/load.py)."""
    import psutil  # deferred: a few ms, only for processes that send heartbeats

    per = psutil.cpu_percent(percpu=True)
    mine = [per[i] for i in sorted(os.sched_getaffinity(0)) if i < len(per)]
    return float(sum(mine) / len(mine)) if mine else float(psutil.cpu_percent(interval=None))


def disjoint_problem(sets: Mapping[str, frozenset[int]]) -> tuple[str, str] | None:
    """Why the CPU sets of different levels (level → set) are not disjoint: (the level to blame, the
    reason); None when they are."""
    levels = sorted(sets)
    for i, a in enumerate(levels):
        for b in levels[i + 1:]:
            common = sets[a] & sets[b]
            if common:
                return b, (f"levels {a} and {b} share CPU {format_cpus(common)} (cpus {format_cpus(sets[a])!r} and "
                           f"{format_cpus(sets[b])!r}); the CPU sets of different levels must be disjoint")
    return None


def all_level_cpus(config: LevelGroups, check_exist: bool = True) -> dict[str, frozenset[int]]:
    """Every level's CPU set from the configuration (levels without ``cpus`` are left out); with
    ``check_exist`` every CPU must be one of this host's."""
    out = {lv: g.cpus for lv, g in config.groups.items() if g.cpus is not None}
    avail = available_cpus() if check_exist else None
    for level, cpus in out.items():
        if avail is not None and not cpus <= avail:
            raise CpuSetError(f"[groups.\"{level}\"] cpus = {format_cpus(cpus)!r}: CPU {format_cpus(cpus - avail)} not "
                              f"available on this host (available: {format_cpus(avail)})")
    return out


def check_disjoint(config: LevelGroups, check_exist: bool = True) -> dict[str, frozenset[int]]:
    """Every level's ``cpus`` (checked disjoint when the configuration was loaded; with ``check_exist``
    here that every CPU is one of this host's)."""
    sets = all_level_cpus(config, check_exist)
    problem = disjoint_problem(sets)
    if problem:  # a configuration put together without strata.config.parse_config
        raise CpuSetError(f"[groups] {problem[1]}")
    return sets


def level_cpus(config: LevelGroups, level: str, check: bool = True) -> frozenset[int] | None:
    """The CPU set of ``level`` (None: not pinned); with ``check`` every level's CPUs must exist here."""
    level = config.lattice.parse(level)
    sets = check_disjoint(config) if check else all_level_cpus(config, check_exist=False)
    return sets.get(level)


def thread_affinities(pid: int | str = "self") -> dict[int, frozenset[int]]:
    """The affinity of every thread of a process (from /proc)."""
    out = {}
    base = Path(f"/proc/{pid}/task")
    for t in base.iterdir():
        try:
            out[int(t.name)] = frozenset(os.sched_getaffinity(int(t.name)))
        except (OSError, ValueError):
            pass
    return out


def pin_current_process(level: str, config: LevelGroups) -> frozenset[int] | None:
    """Pin this process (all its threads, and so every child it starts) to ``level``'s CPUs.

    Returns the set, or None when the level has no ``cpus``.  Raises
    :class:`CpuSetError` for a bad or overlapping configuration.
    """
    cpus = level_cpus(config, level)
    if cpus is None:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:
            raise CpuSetError(f"cannot pin level {config.lattice.parse(level)} to CPUs {format_cpus(cpus)}: {e}") from None
    os.sched_setaffinity(0, cpus)
    os.environ["STRATA_CPUS"] = format_cpus(cpus)
    for var in ("OMP_NUM_THREADS", "ARROW_NUM_THREADS"):
        os.environ.setdefault(var, str(len(cpus)))
    return cpus
