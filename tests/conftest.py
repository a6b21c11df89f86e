"""Shared fixtures: configs as test data, one SparkSession per test session, the Spark engines of the
differential tests."""

from __future__ import annotations

import os
import pytest

from strata.config import parse_config
from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML

from .cpu_profile import register as register_cpu_profile

os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")

# ---- workers' warm-up -----------------------------------------------------------------------------------
#: The Spark workers the suite starts skip their warm-up chunks (worker/warmup.py; ``STRATA_WARMUP_SECONDS``
#: < 0), which is about half of a worker's start-up CPU (a master and two workers: 13.5 -> 7.1 CPU-s and
#: 7.0 -> 3.8 s on the 2-core VM): a warm-up only makes a worker's first chunks faster and its results are
#: thrown away, while most tests start a cluster for a handful of small chunks.  Its own tests run it in the
#: process (tests/test_engine.py), and it stays on where a test depends on it or on latency: the shared warm
#: cluster (``warm_s``, every test on it), the modules that say ``WORKER_WARM_UP = True`` (timing, the
#: levels' Spark clusters that count its tasks) and single runs that pass :data:`tests.helpers.WARM_UP`.
#: ``STRATA_WARMUP_SECONDS=...`` set when the suite starts wins everywhere.  (pytest-xdist's processes inherit
#: the environment the controller's conftest set: :data:`_SUITE_MARK` tells them the suite set it, not a user.)
_WARMUP_ENV = "STRATA_WARMUP_SECONDS"
_SUITE_MARK = "STRATA_TESTS_SKIP_WARMUP"
_SUITE_SETS_WARMUP = _WARMUP_ENV not in os.environ or os.environ.get(_SUITE_MARK) == "1"
if _SUITE_SETS_WARMUP:
    os.environ[_WARMUP_ENV] = "-1"
    os.environ[_SUITE_MARK] = "1"


@pytest.fixture(scope="module", autouse=True)
def _workers_warm_up(request):
    """A module with ``WORKER_WARM_UP = True``: the processes it starts warm up as users' do."""
    if not (_SUITE_SETS_WARMUP and getattr(request.module, "WORKER_WARM_UP", False)):
        yield
        return
    os.environ.pop(_WARMUP_ENV, None)
    try:
        yield
    finally:
        os.environ[_WARMUP_ENV] = "-1"


CHINESE_WALL_TOML = AUDIT_TOML  # the name the tests use

#: a deployment with 64-bit attributes (the example configs have almost none); a test module may name
#: another one as its own ``LEDGER_TOML``
LEDGER_TOML = """
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.Trades]
acct = "string"
qty = "long"
px = "double"
at = "timestamp"

[streams.Limits]
acct = "string"
cap = "long"
"""


#: a stream and a stored relation (whose rows' intervals end at their delete)
LOGISTICS_TOML = """
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.Vitals]
sid = "string"
bp = "double"

[relations.Units]
sid = "string"
unit = "string"
strength = "long"
"""


@pytest.fixture(scope="session")
def logistics():
    return parse_config(LOGISTICS_TOML)


@pytest.fixture(scope="session")
def battlefield():
    return parse_config(BATTLEFIELD_TOML)


@pytest.fixture(scope="session")
def chinese_wall():
    return parse_config(CHINESE_WALL_TOML)


@pytest.fixture(scope="session")
def spark():
    """The one SparkSession of the test session (local[2], small-job settings)."""
    from strata.worker.spark import get_session

    session = get_session(master=os.environ.get("STRATA_SPARK_MASTER", "local[2]"), app_name="strata-tests")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def ledger(request):
    """The ledger config: the module's ``LEDGER_TOML`` if it has one, else this file's."""
    return parse_config(getattr(request.module, "LEDGER_TOML", LEDGER_TOML))


@pytest.fixture(scope="module")
def engines(spark, battlefield, chinese_wall, ledger):
    """Three Spark engines (as many workers) per config, by ``id(config)``: battlefield, chinese_wall, ledger.
    ``STRATA_TEST_PARTIALS=on|off``: their pre-aggregation switch (``Engine.partials``; default auto),
    e.g. the differential tests on the partial-aggregate path for every single-item aggregate."""
    from strata.worker.engine import Engine

    partials = os.environ.get("STRATA_TEST_PARTIALS", "auto")
    return {id(c): [Engine(spark, c, partials=partials) for _ in range(3)] for c in (battlefield, chinese_wall, ledger)}


@pytest.fixture(scope="session")
def warm_s(tmp_path_factory):
    """One S cluster of the battlefield config (a master and one Spark worker) for the end-to-end tests
    that need no cluster of their own: each takes a fresh master on the warm worker
    (``warm_s.renew(users)``, tests/helpers.py WarmCluster).  A test that kills or restarts a worker,
    or needs another config, level or worker count, starts its own."""
    from .helpers import WarmCluster

    # its worker warms up as users' do (WARM_UP): every test on it runs the default start-up path
    cluster = WarmCluster(tmp_path_factory.mktemp("warm-s"), BATTLEFIELD_TOML, "S", 1, warm_up=True)
    yield cluster
    cluster.stop()


# ---- tiers --------------------------------------------------------------------------------------------
#: markers of the tests the quick tier leaves out: processes of a cluster, namespaces, Ray, the in-process
#: SparkSession (the differential tests through the engine)
SLOW_TIERS = ("slow", "netns", "ray", "spark")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the quick tier for the edit-test loop: leave out the tests marked "
                          + ", ".join(SLOW_TIERS) + " (CI runs everything)")


#: seconds the longest test files took in a full run (a fresh clone's, 2026-11-27 21:57 UTC, 800 s): they are
#: collected first, so that with several pytest processes (``./dev test``: pytest-xdist, a file per process)
#: the longest start first and the run does not end waiting for one of them.  Order within a file is kept.
#: tests/test_slot_timing.py (70-105 s) measures a gate's timing, which a Ray or Spark cluster test beside it
#: disturbs (started first, next to test_ray_hosts.py, it failed once: slot edges 40 ms late on average);
#: its weight puts it after every cluster-heavy file has started but not at the very end (unlisted, it
#: came late and the run waited for it); test_turns.py (35 s, mostly waiting: timing in one process) comes
#: after the cluster files but before the last and lightest ones (unlisted, it came among the last files and
#: one process ran it for half a minute after the other had finished: 745 against 826 s of tests).
LONG_FILES = {"test_cluster_e2e.py": 136, "test_ray_hosts.py": 111, "test_deploy_ssh.py": 87,
              "test_trusted_differential.py": 69, "test_exactly_once.py": 66, "test_deploy_spark.py": 64,
              "test_relations.py": 52, "test_setops.py": 46, "test_scaler.py": 45, "test_query_errors.py": 43,
              "test_subqueries.py": 38, "test_differential.py": 35, "test_roles.py": 33, "test_query_depth.py": 31,
              "test_failures.py": 31, "test_trusted_e2e.py": 31, "test_heartbeats_e2e.py": 28,
              "test_spark_cluster.py": 26, "test_deploy_netns.py": 24, "test_window_filters.py": 23,
              "test_standby.py": 21, "test_shedding.py": 21, "test_sharing_exec.py": 20, "test_level_safety.py": 20,
              "test_slot_timing.py": 20,
              "test_elastic.py": 19, "test_adaptive.py": 19, "test_access_e2e.py": 16, "test_checkpoint.py": 16,
              "test_replay_punctuations.py": 16, "test_printer_roundtrip.py": 15, "test_restart.py": 13, "test_turns.py": 12,
              "test_access_differential.py": 11, "test_fuzz.py": 11,
              "test_categories.py": 11, "test_master_streams.py": 11, "test_worker_metrics.py": 11,
              "test_engine.py": 11, "test_heartbeats.py": 10, "test_slide.py": 10}


def pytest_collection_modifyitems(config, items):
    weight = {id(it): LONG_FILES.get(it.path.name, 0) for it in items}
    items.sort(key=lambda it: -weight[id(it)])  # stable: files keep their order among equals
    if not config.getoption("--quick"):
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in SLOW_TIERS) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: starts a private Ray cluster (the elastic scaler, tests/test_scaler.py)")
    register_cpu_profile(config)  # STRATA_TEST_CPU=DIR: CPU seconds per test (tests/cpu_profile.py); off by default
