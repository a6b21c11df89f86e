"""Algorithm 5's CPU readings (worker/load.py): the host's CPUs or the worker's own processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from strata.config import ConfigError, parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.worker.load import ProcessTreeLoad, host_cpu_percent, make_load, spark_cores
from tests.polling import poll

ALLOWED = len(os.sched_getaffinity(0))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _burn(cpu_seconds: float) -> float:
    """Spend about ``cpu_seconds`` of this process's CPU; returns what was spent."""
    t0 = time.process_time()
    x = 0
    while time.process_time() - t0 < cpu_seconds:
        x += 1
    return time.process_time() - t0


@pytest.mark.parametrize("master, cores", [
    ("local", 1), ("local[1]", 1), ("local[2]", min(2, ALLOWED)), ("local[*]", ALLOWED),
    ("local[64]", ALLOWED), ("local[2, 3]", min(2, ALLOWED)), ("spark://10.0.0.1:7077", ALLOWED), (None, ALLOWED),
])
def test_spark_cores(master, cores):
    assert spark_cores(master) == cores


def test_process_reading_is_this_process_share_of_its_cores():
    clock = Clock()
    load = ProcessTreeLoad(cores=2, clock=clock)
    assert load() == 0.0  # no interval yet
    spent = _burn(0.2)
    clock.t += 1.0  # one (fake) second later: 0.2 s of CPU on 2 cores = 10 %
    got = load()
    assert 100 * spent / 2 * 0.8 <= got <= 100 * (spent + 0.1) / 2
    clock.t += 1.0  # idle second (the test process does next to nothing)
    assert load() < 5.0


def test_process_reading_counts_children_and_is_capped():
    clock = Clock()
    load = ProcessTreeLoad(cores=1, clock=clock)
    load()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.5: pass\ntime.sleep(60)"])
    try:
        # poll (not sleep) until the child has used its CPU, then read over one fake second
        assert poll(lambda: sum(psutil.Process(child.pid).cpu_times()[:2]) >= 0.45, timeout=30)
        clock.t += 1.0
        assert load() >= 40.0  # the child's 0.5 s is in this worker's reading
        clock.t += 0.001  # 0.5 s in a millisecond would be 50,000 %: capped at 100
        _burn(0.05)
        assert load() == 100.0
    finally:
        child.kill()
        child.wait()
    clock.t += 1.0
    assert 0.0 <= load() < 50.0  # the exited child's time does not come back negative


def test_make_load_and_host_reading():
    assert make_load("host") is host_cpu_percent
    assert 0.0 <= host_cpu_percent() <= 100.0
    assert isinstance(make_load("process", "local[1]"), ProcessTreeLoad)
    with pytest.raises(ValueError, match="host, process"):
        make_load("dedicated")


def test_config_load_reading_is_validated():
    assert parse_config(BATTLEFIELD_TOML + '\n[cluster]\nload_reading = "process"\n').cluster.load_reading == "process"
    with pytest.raises(ConfigError, match=r":\d+: \[cluster\] load_reading: must be \"host\" or \"process\""):
        parse_config(BATTLEFIELD_TOML + '\n[cluster]\nload_reading = "idle"\n')
