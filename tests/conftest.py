"""Shared fixtures: configs as test data, one SparkSession per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata.config import parse_config

os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")

DATA = Path(__file__).parent / "data"

BATTLEFIELD_TOML = """
[lattice]
levels = ["U", "C", "S", "TS"]

[streams.Vitals]
sid = "string"
bp = "double"
pr = "double"
weight = "double"

[streams.Positions]
sid = "string"
lat = "double"
lon = "string"
"""

CHINESE_WALL_TOML = """
[lattice]
coi = [["1", "2"], ["A", "B", "C"]]

[streams.MessageLog]
serviceId = "string"
msgType = "string"
sender = "string"
receiver = "string"
timestamp = "long"
outcome = "string"
"""


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
