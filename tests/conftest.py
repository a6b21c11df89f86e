"""Shared fixtures: configs as test data, one SparkSession per test session."""

from __future__ import annotations

import os
import pytest

from strata.config import parse_config
from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML

os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")

CHINESE_WALL_TOML = AUDIT_TOML  # the name the tests use


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


# ---- markers of the elastic scaler's tests (appended; chains any earlier pytest_configure) ----------
_configure_before_ray = globals().get("pytest_configure")


def pytest_configure(config):
    if _configure_before_ray is not None:
        _configure_before_ray(config)
    config.addinivalue_line("markers", "ray: starts a private Ray cluster (the elastic scaler, tests/test_scaler.py)")
