"""The CPU reading a worker multicasts, which Algorithm 5 compares with its 90 % threshold.

Two readings (``[cluster] load_reading``, ``strata worker --load-reading``):

``host``
    The load of the CPUs this process may run on (psutil), as in the dissertation,
    where every worker had a host of its own.  With a level pinned to its own CPU
    set (``[groups."L"] cpus``) another level's load does not show in it.
``process``
    The CPU this worker's own processes (the Python server and its Spark JVM) used
    since the previous reading, in percent of the cores its Spark session may use
    (``local[N]``: N, capped by the CPUs it may run on).  "Busy" then means *this
    worker* is saturated, whoever else shares the host: the reading for workers that
    share one host (``strata up``, the demo, tests), where the host reading is the
    same for all of them and is >= 90 % whenever the cluster works.  Another level's
    processes are not in it either.
"""

from __future__ import annotations

import os
import re
import time
from typing import Callable

__all__ = ["READINGS", "host_cpu_percent", "tree_cpu_times", "ProcessTreeLoad", "spark_cores", "make_load"]

READINGS = ("host", "process")


def host_cpu_percent() -> float:
    """The load of the CPUs this process may run on, in percent (psutil, non-blocking)."""
    import psutil

    per = psutil.cpu_percent(percpu=True)
    mine = [per[i] for i in sorted(os.sched_getaffinity(0)) if i < len(per)]
    return float(sum(mine) / len(mine)) if mine else float(psutil.cpu_percent(interval=None))


def tree_cpu_times(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and each of its descendants, by pid; {} if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def spark_cores(spark_master: str | None) -> int:
    """Cores a Spark session of ``spark_master`` may use on this host (``local[N]``, ``local[*]``)."""
    allowed = len(os.sched_getaffinity(0)) or 1
    m = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?", (spark_master or "").strip())
    if not m:
        return allowed  # a cluster URL: the executors are elsewhere; this host's share is all of it
    n = m.group(1)
    if n is None:
        return 1
    return allowed if n == "*" else max(1, min(int(n), allowed))


class ProcessTreeLoad:
    """CPU used by this process and its descendants between calls, in % of ``cores``.

    The first call returns 0 (no interval yet).  A process that exits between calls
    takes its time with it (that interval reads a little low), never negative."""

    def __init__(self, cores: float, pid: int | None = None, clock: Callable[[], float] = time.monotonic):
        if cores <= 0:
            raise ValueError("cores must be positive")
        self.cores = float(cores)
        self._pid = pid or os.getpid()
        self._clock = clock
        self._last: dict[int, float] = {}
        self._at: float | None = None

    def __call__(self) -> float:
        now, times = self._clock(), tree_cpu_times(self._pid)
        last, at = self._last, self._at
        self._last, self._at = times, now
        if at is None or now <= at:
            return 0.0
        # a process born since the last call: all of its CPU time falls in this interval
        used = sum(max(0.0, t - last.get(pid, 0.0)) for pid, t in times.items())
        return min(100.0, max(0.0, 100.0 * used / ((now - at) * self.cores)))


def make_load(reading: str, spark_master: str | None = None) -> Callable[[], float]:
    """The load function for ``reading`` (see the module docstring)."""
    if reading == "host":
        return host_cpu_percent
    if reading == "process":
        return ProcessTreeLoad(spark_cores(spark_master))
    raise ValueError(f"load reading must be one of {', '.join(READINGS)}, not {reading!r}")
