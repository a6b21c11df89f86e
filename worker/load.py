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

A worker whose Spark master is a cluster (``[groups."L"] spark_master = "spark://..."``)
computes on the cluster's executors, not on its own host, so either reading of its host
would say nothing about whether it can take a chunk.  Its reading is the share of its
executors' task slots (their cores) that were busy (:class:`ExecutorSlotsLoad`): the task
time its executors finished since the previous reading over the interval's slot time, or the
share of slots running a task now, whichever is higher (a short job that ran between two
readings shows in the first, a long one still running in the second), from Spark's own status
store (:func:`spark_executor_samples`).  No executor reads 100 % (it can compute nothing).
"""

from __future__ import annotations

import os
import re
import time
from typing import Callable, NamedTuple

from strata.cpusets import host_cpu_percent

__all__ = ["READINGS", "host_cpu_percent", "tree_cpu_times", "ProcessTreeLoad", "spark_cores", "make_load",
           "ExecutorSample", "ExecutorSlotsLoad", "spark_executor_samples"]

READINGS = ("host", "process")


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


class ExecutorSample(NamedTuple):
    """One executor of a worker's Spark application as the status store shows it."""

    id: str
    cores: int
    active_tasks: int
    #: the summed duration of the executor's finished tasks so far, in milliseconds
    task_ms: float


class ExecutorSlotsLoad:
    """The busy share of a Spark application's executor task slots, in % (module docstring).

    ``source`` returns the executors now (:class:`ExecutorSample`, the driver left out).  The first
    call has no interval and reads the slots busy now only."""

    def __init__(self, source: Callable[[], list[ExecutorSample]], clock: Callable[[], float] = time.monotonic):
        self._source = source
        self._clock = clock
        self._last: dict[str, float] = {}
        self._at: float | None = None

    def __call__(self) -> float:
        now, execs = self._clock(), list(self._source())
        last, at = self._last, self._at
        self._last, self._at = {e.id: float(e.task_ms) for e in execs}, now
        cores = sum(max(0, int(e.cores)) for e in execs)
        if cores <= 0:
            return 100.0  # no executor (yet, or any more): this worker can take no chunk
        busy_now = 100.0 * sum(max(0, int(e.active_tasks)) for e in execs) / cores
        busy_interval = 0.0
        if at is not None and now > at:
            # an executor new since the last reading: its finished tasks all ran in this interval (roughly)
            done_ms = sum(max(0.0, float(e.task_ms) - last.get(e.id, 0.0)) for e in execs)
            busy_interval = 100.0 * done_ms / 1000.0 / ((now - at) * cores)
        return min(100.0, max(0.0, busy_now, busy_interval))


def spark_executor_samples(session) -> Callable[[], list[ExecutorSample]]:
    """A source for :class:`ExecutorSlotsLoad`: the executors of ``session``'s application (its
    SparkContext's status store: cores, active tasks, finished task time), the driver left out."""
    jsc = session.sparkContext._jsc.sc()

    def samples() -> list[ExecutorSample]:
        executors = jsc.statusStore().executorList(True)  # active executors only
        out = []
        for i in range(executors.size()):
            e = executors.apply(i)
            if e.id() == "driver":
                continue
            out.append(ExecutorSample(str(e.id()), int(e.totalCores()), int(e.activeTasks()), float(e.totalDuration())))
        return out

    return samples


def make_load(reading: str, spark_master: str | None = None,
              executors: Callable[[], list[ExecutorSample]] | None = None) -> Callable[[], float]:
    """The load function for ``reading`` (see the module docstring).  A worker whose ``spark_master``
    is a cluster and that gives its ``executors`` (:func:`spark_executor_samples`) reads their task
    slots whatever ``reading`` says; ``local[N]`` keeps ``reading``."""
    if reading not in READINGS:
        raise ValueError(f"load reading must be one of {', '.join(READINGS)}, not {reading!r}")
    if executors is not None and spark_master and not spark_master.strip().startswith("local"):
        return ExecutorSlotsLoad(executors)
    if reading == "host":
        return host_cpu_percent
    return ProcessTreeLoad(spark_cores(spark_master))
