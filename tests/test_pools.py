"""A trusted worker's Spark scheduler pools (worker/pools.py): the least served level's pool takes free
task slots first; the others keep Spark's defaults.  The session reading the file is checked end to end in
tests/test_trusted_e2e.py (no pool created on the fly)."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.trusted import bottom_of
from strata.worker.pools import NEEDY_SHARE, allocation_xml, fair_conf, pool_name


class Diamond:
    """A and B incomparable, bot below both, top above both."""

    def leq(self, a, b):
        return a == b or a == "bot" or b == "top"


def pools(xml: str) -> dict:
    root = ET.fromstring(xml)
    return {p.get("name"): (p.findtext("schedulingMode"), int(p.findtext("weight")), int(p.findtext("minShare")))
            for p in root.findall("pool")}


def test_the_least_level_is_needy_and_the_others_keep_the_defaults():
    lattice = parse_config(BATTLEFIELD_TOML).lattice
    assert bottom_of(lattice, ("S", "TS")) == "S"
    assert pools(allocation_xml(lattice, ("S", "TS"))) == {
        pool_name("S"): ("FIFO", 1, NEEDY_SHARE), pool_name("TS"): ("FIFO", 1, 0)}
    got = pools(allocation_xml(lattice, ("U", "C", "S", "TS")))
    assert got[pool_name("U")][2] == NEEDY_SHARE and [got[pool_name(x)][2] for x in ("C", "S", "TS")] == [0, 0, 0]


def test_without_a_least_level_no_pool_goes_first():
    """A and B incomparable: neither may take the slots before the other (its timing would depend on the other)."""
    assert bottom_of(Diamond(), ("A", "B", "top")) is None
    assert {v[2] for v in pools(allocation_xml(Diamond(), ("A", "B", "top"))).values()} == {0}
    assert bottom_of(Diamond(), ("A", "B", "bot")) == "bot"


def test_fair_conf_writes_the_file_and_keeps_what_the_level_sets():
    lattice = parse_config(BATTLEFIELD_TOML).lattice
    conf = fair_conf(lattice, ("S", "TS"), {"spark.executor.memory": "1g"})
    assert conf["spark.scheduler.mode"] == "FAIR" and conf["spark.executor.memory"] == "1g"
    path = conf["spark.scheduler.allocation.file"]
    with open(path) as f:
        assert pools(f.read())[pool_name("S")][2] == NEEDY_SHARE
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    own = fair_conf(lattice, ("S", "TS"), {"spark.scheduler.allocation.file": "/etc/pools.xml"})
    assert own["spark.scheduler.allocation.file"] == "/etc/pools.xml"  # the level's own file
    fifo = fair_conf(lattice, ("S", "TS"), {"spark.scheduler.mode": "FIFO"})
    assert fifo == {"spark.scheduler.mode": "FIFO"}  # the level's own mode, no pools
