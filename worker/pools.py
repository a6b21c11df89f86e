"""Spark scheduler pools of a trusted worker (docs/trusted.md): one pool per level it serves, declared in
an allocation file, so that a higher level's jobs never take task slots a lower level's jobs wait for.

A trusted worker runs the Spark jobs of every level it serves in one session, started with
``spark.scheduler.mode = FAIR``; each call's jobs go to its level's pool ``level-<L>``
(worker/service.py).  Spark's fair scheduler (``FairSchedulingAlgorithm``) offers a free task slot
first to a pool running fewer tasks than its ``minShare`` ("needy"), and only among pools equally
needy or not by their running tasks per ``weight``.  The pools here:

* **the least level** (the one every other served level dominates, if there is one: S of S and TS) is
  needy always (``minShare`` above any core count): while it has tasks waiting, every slot that frees
  goes to it.  A call of a higher level that outlives its deadline (strata/turns.py: calls are not
  pre-empted, and under fixed slots such an overrun reaches into the least level's slot, the next
  round's first) then holds no more than the tasks it already runs, which end in milliseconds: the
  least level's jobs are not slowed by sharing the slots with it (measured in docs/trusted.md).  The
  levels above may wait on the least level's tasks, a dependence on a level they dominate (allowed);
* **the others** keep the defaults (``minShare`` 0, ``weight`` 1): they share the slots evenly, as
  without the file (a pool of a level that does not dominate another must not be given the slots
  before it: that would make the other's timing depend on its load).

Declaring the pools also spares the one warning Spark logs per pool created on the fly with defaults.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from xml.sax.saxutils import quoteattr

from strata.groups import level_slug
from strata.trusted import bottom_of

__all__ = ["NEEDY_SHARE", "pool_name", "allocation_xml", "write_allocation_file", "fair_conf"]

#: the least level's minShare: above the task slots of any cluster a level runs on
NEEDY_SHARE = 1_000_000


def pool_name(level: str) -> str:
    """The scheduler pool of ``level``'s jobs."""
    return "level-" + level_slug(level)


def allocation_xml(lattice, levels) -> str:
    """The allocation file (Spark's ``fairscheduler.xml`` format) of a worker serving ``levels``."""
    least = bottom_of(lattice, levels)
    pools = []
    for lv in levels:
        share = NEEDY_SHARE if lv == least else 0
        pools.append(f"  <pool name={quoteattr(pool_name(lv))}>\n"
                     f"    <schedulingMode>FIFO</schedulingMode>\n"
                     f"    <weight>1</weight>\n"
                     f"    <minShare>{share}</minShare>\n"
                     f"  </pool>\n")
    return '<?xml version="1.0"?>\n<allocations>\n' + "".join(pools) + "</allocations>\n"


def write_allocation_file(lattice, levels) -> str:
    """The allocation file written to a private temporary file (removed when the process exits); its path."""
    fd, path = tempfile.mkstemp(prefix="strata-pools-", suffix=".xml")
    with os.fdopen(fd, "w") as f:
        f.write(allocation_xml(lattice, levels))
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def fair_conf(lattice, levels, spark_conf: dict | None) -> dict:
    """``spark_conf`` with a trusted worker's scheduling: FAIR and its levels' pools (each unless the
    level's ``spark_conf`` sets it)."""
    conf = dict(spark_conf or {})
    conf.setdefault("spark.scheduler.mode", "FAIR")
    if conf["spark.scheduler.mode"] == "FAIR" and "spark.scheduler.allocation.file" not in conf:
        conf["spark.scheduler.allocation.file"] = write_allocation_file(lattice, levels)
    return conf
